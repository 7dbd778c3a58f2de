"""``plan.strategy`` and ``plan.outer``: the second way across the WAN, an outer loop between
replica groups (the DiLoCo family), as the planner searches it.

A run may cross the WAN two ways: one pipeline cut at the sites (``strategy: pipeline``, the
default and today's only way), or ``M`` replica groups that train apart and meet every ``h``
inner steps (``outer``); ``auto`` lets the planner choose by predicted time per token ×
(1 + the measured loss penalty). ``h``, ``fragments``, ``overlap`` and ``codec`` are planner
knobs like ``plan.delta_n`` (a value, a list, or ``{min, max}``); ``lr`` and ``momentum``
are the outer optimizer's (Nesterov SGD; DiLoCo's 0.7 and 0.9 by default). Relations between
them (``h`` a multiple of ``fragments``, ``overlap < h / fragments``, the checkpoint
interval a multiple of ``h``) are cross-checks (:mod:`geopipe.config.checks`), the same rule
the runtime's streaming schedule enforces (``geopipe.outer.fragments``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator

from geopipe.config.fields import Choice, Spec, bounded

__all__ = ["MAX_OUTER_H", "MAX_OUTER_VALUES", "OuterSpec", "Strategy"]

# A knob of plan.outer may hold at most this many values: each is priced for every grouping
# of the sites, so `h: {min: 1, max: 1000000}` is refused at load, not priced a million times.
MAX_OUTER_VALUES = 256
MAX_OUTER_H = 1 << 20  # inner steps per round (published DiLoCo runs use tens to hundreds)

Strategy = Literal["pipeline", "outer", "auto"]


def _listed(v: object) -> object:
    """One codec name is a list of one (so errors name ``plan.outer.codec[i]``)."""
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise ValueError("give a codec name or a list of codec names")
    return v


CodecList = Annotated[list[str], BeforeValidator(_listed)]
OuterLr = bounded(0.0, 10.0, lo_open=True)
OuterMomentum = bounded(0.0, 1.0)


class OuterSpec(Spec):
    """The outer loop's knobs (see the module docstring)."""

    h: Choice = Field(
        [10, 25, 50, 100],
        description="inner steps per outer round; an H beyond the largest the loss penalty "
        "was measured at is listed, never chosen",
    )
    fragments: Choice = Field(1, description="streaming fragments F (h a multiple of F)")
    overlap: Choice = Field(
        0, description="inner steps a fragment's transfer overlaps, tau < h / fragments"
    )
    codec: CodecList = Field(
        ["none"], description="the pseudo-gradient's codec, or a list for the planner"
    )
    lr: OuterLr | list[OuterLr] = Field(
        0.7, description="outer learning rate, or a list for the planner"
    )
    momentum: OuterMomentum | list[OuterMomentum] = Field(
        0.9, description="outer Nesterov momentum in [0, 1), or a list for the planner"
    )

    @field_validator("momentum")
    @classmethod
    def _momentum_below_one(cls, v: float | list[float]) -> float | list[float]:
        if any(x >= 1.0 for x in (v if isinstance(v, list) else [v])):
            raise ValueError("must be in [0, 1): the outer momentum buffer would never decay")
        return v

    @field_validator("lr", "momentum")
    @classmethod
    def _some(cls, v: float | list[float]) -> float | list[float]:
        if isinstance(v, list) and not v:
            raise ValueError("the list is empty: give at least one value (or omit the key)")
        return v

    @property
    def lrs(self) -> tuple[float, ...]:
        """The outer learning rates the planner may choose, each once."""
        return tuple(dict.fromkeys(self.lr if isinstance(self.lr, list) else [self.lr]))

    @property
    def momenta(self) -> tuple[float, ...]:
        """The outer momenta the planner may choose, each once."""
        v = self.momentum
        return tuple(dict.fromkeys(v if isinstance(v, list) else [v]))

    @property
    def codecs(self) -> tuple[str, ...]:
        """The codec candidates, in the order listed (each once)."""
        return tuple(dict.fromkeys(self.codec))
