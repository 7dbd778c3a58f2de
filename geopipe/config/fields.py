"""Validated field types of the cluster YAML: bounded numbers, names, codec settings.

Each refuses a bad value at the edge, with a message that states what is allowed, so the
loader can name the field and the problem and the planner never sees an absurd number.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

__all__ = ["MAX_KNOB", "Choice", "Range", "Spec", "bounded", "codec_setting", "int_in", "name_of"]

MAX_KNOB = 1 << 31  # any planner knob value (ranges and list items)


class Spec(BaseModel):
    """A section of the cluster YAML: unknown keys are errors, and a parsed spec is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def bounded(lo: float, hi: float, *, lo_open: bool = False, unit: str = "") -> Any:
    """A float that must be finite and inside a physical range; the error states the range.

    Non-finite or absurd values would pass a plain ``gt=0`` and then break the planner's
    arithmetic (an infinite device speed gives zero-time stages, ``1e-300`` an overflow), so
    every number the cost model reads is bounded here, at the edge.
    """
    span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" + (f" {unit}" if unit else "")

    def check(v: float) -> float:
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
        if not ok:
            raise ValueError(f"must be a finite number in {span}")
        return v

    check.span = span  # type: ignore[attr-defined]  # the loader quotes it for type errors
    return Annotated[float, AfterValidator(check)]


def int_in(lo: int, hi: int) -> Any:
    """An int inside ``[lo, hi]``; huge values are refused before any arithmetic sees them."""

    def check(v: int) -> int:
        if not lo <= v <= hi:
            raise ValueError(f"must be an integer in [{lo}, {hi}]")
        return v

    return Annotated[int, AfterValidator(check)]


def name_of(max_len: int) -> Any:
    """Run and site names become Ray actor and resource names and directory names."""

    def check(v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v) or len(v) > max_len:
            raise ValueError(
                f"use 1 to {max_len} letters, digits, '.', '_' or '-', starting with a letter "
                "or digit (it names Ray actors and directories)"
            )
        return v

    return Annotated[str, AfterValidator(check)]


def codec_setting(v: Any) -> Any:
    """A boundary's codec: one name for both directions, ``"fwd/bwd"``, or
    ``{forward: fwd, backward: bwd}`` (kept as ``"fwd/bwd"``; checked by `check_spec`)."""
    if not isinstance(v, dict):
        return v
    if set(v) != {"forward", "backward"} or not all(isinstance(x, str) for x in v.values()):
        raise ValueError("give a codec name, or {forward: <codec>, backward: <codec>}")
    f, b = v["forward"], v["backward"]
    return f if f == b else f"{f}/{b}"


KnobInt = int_in(-MAX_KNOB, MAX_KNOB)


class Range(Spec):
    """An inclusive integer range searched by the planner."""

    min: int = Field(ge=0, le=MAX_KNOB)
    max: int = Field(ge=0, le=MAX_KNOB)

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        return self


# A planner knob is fixed (an int), a list of candidates, or an inclusive range. (Here, not
# in .specs, so that the sections in their own modules (.outer) use the same knob type.)
Choice = KnobInt | list[KnobInt] | Range
