"""The outer loop's loss penalty: a measured table, interpolated in H, never extrapolated.

Training ``M`` replica groups that meet every ``H`` inner steps reaches a worse loss than
synchronous training at equal tokens; how much depends on ``H``, ``M``, the fragments ``F``
and the pseudo-gradient's codec, and on the model (the gap shrinks as models grow: DiLoCo
scaling laws, arXiv 2503.09799). No formula predicts it well enough to trade it against
time, so the planner reads a table measured by ``benchmarks/outer_penalty.py`` and shipped
beside this module (``loss_penalty.json``)::

    {"source": ..., "model": ..., "steps": N, "tokens_per_step": T,
     "sync_loss": {"0": L0, "1": L1, ...}, "sync_noise": x,
     "rows": [{"replicas": M, "h": H, "fragments": F, "codec": "int8", "seed": s,
               "rel_gap": g}, ...]}

``rel_gap`` is the final held-out loss's relative gap to synchronous training of the row's
own ``seed`` (``loss_outer / loss_sync[seed] - 1``; a row without ``seed`` is seed 0's);
``sync_loss`` the synchronous run's held-out loss by seed (the seed as a JSON key; the first
tables wrote a list, seeds 0 and 1); ``sync_noise`` the largest relative spread among those
seeds (what a gap must exceed to mean anything). One setting's gap moves by several percent
of loss from seed to seed on the shipped table's model (up to 8 points at M = 2), more than
the gaps a tight ``plan.max_loss_penalty`` separates, so a row worth pricing is measured at
several seeds. Only ``rows`` and ``sync_noise`` are read here.

The model, and why:

* rows are grouped by ``(M, codec, F, outer lr, outer momentum)`` — a row may say the outer
  optimizer it ran (``outer_lr``, ``outer_momentum``; DiLoCo's 0.7 and 0.9 if it does not),
  and a candidate is priced only by rows of its own outer optimizer; repeated rows of one
  ``H`` (seeds) are averaged, and the price says over how many (``(3 seeds)``);
* between two measured ``H`` the gap is linear in ``log H`` (the published sweeps space
  ``H`` geometrically and the gap grows about evenly per doubling);
* outside the measured ``H`` there is no price: above the largest ``H`` measured (or below
  the smallest) the candidate is *unpriced* and listed with the reason, never chosen on a
  guess; ``H = 1, F = 1`` costs its measured gap like any other point (the outer optimizer
  at ``H = 1`` is not plain synchronous training);
* an ``M``, ``F`` or codec the table does not hold is unpriced (no interpolation across
  them: the gap does not move smoothly enough with them to guess);
* a negative gap (the outer loop measured better; for seeds, their mean) counts as 0:
  noise is no reason to prefer the outer loop;
* the overlap ``tau`` is not interpolated either: a row may say the ``overlap`` it ran with
  (0 if it does not), and a candidate overlapping more steps than any row of its
  ``(M, codec, F)`` measured at any ``H`` is unpriced (the overlapped steps run on weights
  the outer step then replaces); within it, the gap is taken as independent of ``tau``, so
  a key's rows may differ in overlap (1 at ``H = 10``, where ``H / F = 2`` allows no more,
  4 at ``H >= 25``) and are still one curve in ``H``;
* rows of fewer than 2 replicas are not an outer loop and are skipped.

[Note: a bound on a noisy measure]
One run's gap is the mean's estimate with a spread of its own: on the shipped table's model
the same setting measured at three seeds spans up to 8 points, a pooled standard deviation of
~2.4 points per run, more than the 1.5 % a user may bound the penalty at. A planner that
checked ``plan.max_loss_penalty`` against the mean alone chose a setting measured at 1.06 %
(three seeds) whose gap through the runtime then measured 2.96 % (three other runs). So
each price carries its standard error (``spread``: the pooled per-run deviation over the
square root of the seeds averaged; an interpolated price takes its less measured end's;
the table's ``sync_noise`` stands for the deviation where no setting has several seeds),
and the bound is checked at the mean plus it (:attr:`Penalty.upper`): a setting passes a
bound only when its measurement is good enough to say so. The score, time per token x
(1 + penalty), uses the mean: the expected cost. Measuring more seeds narrows the spread.

Without a table (not measured yet) every outer candidate is unpriced and ``geopipe plan``
says so. ``GEOPIPE_LOSS_PENALTY`` names another table (a file outside the package, for a
trial); :func:`load_penalty` reads it only when the caller passes no path.
"""

from __future__ import annotations

import json
import math
import os
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geopipe.optimizer.errors import PlanningError
from geopipe.transport.wire import CODECS

__all__ = [
    "DEFAULT_TABLE",
    "ENV_VAR",
    "Penalty",
    "PenaltyModel",
    "PenaltyTable",
    "PenaltyTableError",
    "load_penalty",
    "parse_table",
]

DEFAULT_TABLE = Path(__file__).with_name("loss_penalty.json")
ENV_VAR = "GEOPIPE_LOSS_PENALTY"
MAX_TABLE_BYTES = 1 << 22  # a table is a few KiB; refuse a stray large file before parsing

Key = tuple[int, str, int, float, float]  # (replicas M, codec, fragments F, outer lr, momentum)
# A row that does not say its outer optimizer ran DiLoCo's (the first tables did not say).
DEFAULT_OUTER = (0.7, 0.9)


class PenaltyTableError(PlanningError):
    """The loss-penalty table cannot be read; the message names the file and the row."""


@dataclass(frozen=True)
class Penalty:
    """A candidate's predicted loss penalty (relative loss gap), or why it has none."""

    value: float | None  # None: not priced
    basis: str  # how the value was obtained, or why there is none
    # the value's standard error: one run's spread over the square root of the seeds the
    # value averages ([Note: a bound on a noisy measure])
    spread: float = 0.0

    @property
    def upper(self) -> float | None:
        """The value a bound is checked at: the mean plus its standard error."""
        return None if self.value is None else self.value + self.spread

    @property
    def priced(self) -> bool:
        return self.value is not None


@dataclass(frozen=True)
class PenaltyTable:
    """The measured gaps by ``(M, codec, F)``: ``(H, gap)`` points sorted by ``H``."""

    path: str
    source: str
    model: str
    steps: int
    tokens_per_step: int
    sync_noise: float
    # (H, mean gap, rows averaged) sorted by H
    points: Mapping[Key, tuple[tuple[int, float, int], ...]] = field(default_factory=dict)
    overlaps: Mapping[Key, int] = field(default_factory=dict)  # the largest measured per key
    # one run's gap spread (standard deviation): pooled over the settings measured at
    # several seeds, else ``sync_noise`` ([Note: a bound on a noisy measure])
    run_sd: float = 0.0

    def predict(
        self,
        replicas: int,
        h: int,
        fragments: int,
        codec: str,
        overlap: int = 0,
        outer: tuple[float, float] = DEFAULT_OUTER,
    ) -> Penalty:
        """The penalty of ``M`` groups meeting every ``h`` steps in ``fragments`` with
        ``codec``, each send overlapping ``overlap`` steps, under the outer optimizer
        ``outer`` = (lr, momentum) (module docstring: the rules)."""
        where = f"M={replicas}, {codec}, F={fragments}, outer lr {outer[0]:g}/{outer[1]:g}"
        miss = self._missing(replicas, fragments, codec, outer)
        if miss:
            return Penalty(None, miss)
        key = (replicas, codec, fragments, *outer)
        if overlap > self.overlaps.get(key, 0):
            return Penalty(
                None,
                f"overlap {overlap} is beyond the largest measured "
                f"({self.overlaps.get(key, 0)}, {where})",
            )
        pts = self.points[key]
        hs = [x for x, *_ in pts]
        if h > hs[-1] or h < hs[0]:
            side = "beyond the largest" if h > hs[-1] else "below the smallest"
            span = f"H={hs[-1]}" if h > hs[-1] else f"H={hs[0]}"
            return Penalty(
                None, f"H={h} is {side} H measured ({span}, {where}): never extrapolated"
            )
        i = bisect_left(hs, h)
        if hs[i] == h:
            se = self.run_sd / math.sqrt(pts[i][2])
            return Penalty(max(0.0, pts[i][1]), f"measured at H={h}{_seeds(pts[i])} ({where})", se)
        (h0, g0, n0), (h1, g1, n1) = pts[i - 1], pts[i]
        w = (math.log(h) - math.log(h0)) / (math.log(h1) - math.log(h0))
        gap = g0 + w * (g1 - g0)
        return Penalty(
            max(0.0, gap),
            f"interpolated in log H between H={h0} ({g0:.2%}{_seeds(pts[i - 1])}) and "
            f"H={h1} ({g1:.2%}{_seeds(pts[i])}) ({where})",
            self.run_sd / math.sqrt(min(n0, n1)),  # the less measured end's
        )

    def _missing(
        self, replicas: int, fragments: int, codec: str, outer: tuple[float, float]
    ) -> str:
        """Why ``(M, codec, F, outer)`` has no measured rows (empty if it has)."""
        if (replicas, codec, fragments, *outer) in self.points:
            return ""
        outers = sorted({(lr, mu) for *_, lr, mu in self.points})
        if outer not in outers:
            shown = ", ".join(f"{lr:g}/{mu:g}" for lr, mu in outers)
            return f"outer lr/momentum {outer[0]:g}/{outer[1]:g} not measured (measured: {shown})"
        points = {k[:3] for k in self.points if k[3:] == outer}
        codecs = sorted({c for _, c, _ in points})
        if codec not in codecs:
            return f"codec {codec} not measured (measured: {', '.join(codecs) or 'no rows'})"
        ms = sorted({m for m, c, _ in points if c == codec})
        if replicas not in ms:
            return (
                f"M={replicas} not measured for codec {codec} (measured: "
                f"{', '.join(f'M={m}' for m in ms)})"
            )
        fs = sorted({f for m, c, f in points if (m, c) == (replicas, codec)})
        return (
            f"F={fragments} not measured for M={replicas}, {codec} (measured: "
            f"{', '.join(f'F={f}' for f in fs)})"
        )

    def describe(self) -> dict[str, Any]:
        """What ``geopipe plan --json`` says about the table the penalties come from."""
        return {
            "path": self.path,
            "source": self.source,
            "model": self.model,
            "steps": self.steps,
            "tokens_per_step": self.tokens_per_step,
            "sync_noise": self.sync_noise,
            "run_sd": self.run_sd,
        }


def _pooled_sd(samples: list[list[float]], fallback: float) -> float:
    """One run's standard deviation, pooled over every setting measured at two seeds or
    more (each setting's own mean removed); ``fallback`` where none is."""
    dev = sum(sum((x - sum(g) / len(g)) ** 2 for x in g) for g in samples if len(g) > 1)
    dof = sum(len(g) - 1 for g in samples if len(g) > 1)
    return math.sqrt(dev / dof) if dof else fallback


def _seeds(point: tuple[int, float, int]) -> str:
    """How many rows (seeds) a point averages, for a price's basis; nothing for one."""
    n = point[2]
    return f" ({n} seeds)" if n > 1 else ""


@dataclass(frozen=True)
class PenaltyModel:
    """The table the planner prices with, or None where there is none yet (``path``: where
    it was looked for)."""

    table: PenaltyTable | None
    path: str

    def predict(
        self,
        replicas: int,
        h: int,
        fragments: int,
        codec: str,
        overlap: int = 0,
        outer: tuple[float, float] = DEFAULT_OUTER,
    ) -> Penalty:
        if self.table is None:
            return Penalty(None, "no measured loss-penalty table")  # where: self.path
        return self.table.predict(replicas, h, fragments, codec, overlap, outer)


def load_penalty(
    path: str | Path | None = None, environ: Mapping[str, str] = os.environ
) -> PenaltyModel:
    """The penalty model from ``path`` (default: ``$GEOPIPE_LOSS_PENALTY``, else the shipped
    table). A missing file is no table (every outer candidate unpriced); an unreadable or
    malformed one is a :class:`PenaltyTableError`."""
    p = Path(path if path is not None else environ.get(ENV_VAR) or DEFAULT_TABLE)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_TABLE_BYTES + 1)
    except FileNotFoundError:
        return PenaltyModel(None, str(p))
    except OSError as exc:
        raise PenaltyTableError(f"loss-penalty table {p}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TABLE_BYTES:
        raise PenaltyTableError(f"loss-penalty table {p}: larger than {MAX_TABLE_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise PenaltyTableError(f"loss-penalty table {p}: not JSON: {exc}") from None
    return PenaltyModel(parse_table(doc, str(p)), str(p))


def _field(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    v = obj.get(key) if isinstance(obj, Mapping) else None
    ok = isinstance(v, kind) and not isinstance(v, bool)
    if kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok:
        raise ValueError(f"{where}{key}: expected {kind.__name__}, got {v!r}")
    return float(v) if kind is float else v


def parse_table(doc: Any, path: str = "<table>") -> PenaltyTable:
    """Validate a parsed table (see the module docstring for its format)."""
    try:
        if not isinstance(doc, Mapping):
            raise ValueError("expected a JSON object")
        rows = doc.get("rows")
        if not isinstance(rows, list) or not rows:
            raise ValueError("rows: expected a non-empty list")
        sums: dict[Key, dict[int, list[float]]] = {}
        overlaps: dict[Key, int] = {}
        for i, row in enumerate(rows):
            where = f"rows[{i}]."
            m = _field(row, "replicas", int, where)
            h = _field(row, "h", int, where)
            f = _field(row, "fragments", int, where)
            tau = _field({"overlap": 0, **row}, "overlap", int, where)
            codec = _field(row, "codec", str, where)
            if _field({"seed": 0, **row}, "seed", int, where) < 0:
                raise ValueError(f"{where}seed: expected a non-negative int, got {row['seed']}")
            gap = _field(row, "rel_gap", float, where)
            lr = _field({"outer_lr": DEFAULT_OUTER[0], **row}, "outer_lr", float, where)
            mu = _field({"outer_momentum": DEFAULT_OUTER[1], **row}, "outer_momentum", float, where)
            if h < 1 or f < 1 or h % f or not 0 <= tau < h // f:
                raise ValueError(
                    f"{where[:-1]}: needs h >= 1, fragments >= 1, h a multiple of fragments "
                    f"and 0 <= overlap < h / fragments (got H={h}, F={f}, overlap {tau})"
                )
            if codec not in CODECS:
                raise ValueError(f"{where}codec: unknown codec {codec!r}")
            if m < 2:
                continue
            key = (m, codec, f, lr, mu)
            sums.setdefault(key, {}).setdefault(h, []).append(gap)
            overlaps[key] = max(overlaps.get(key, 0), tau)
        points = {
            k: tuple((h, sum(g) / len(g), len(g)) for h, g in sorted(v.items()))
            for k, v in sums.items()
        }
        noise = float(doc.get("sync_noise") or 0.0)
        return PenaltyTable(
            path,
            str(doc.get("source", "")),
            str(doc.get("model", "")),
            int(doc.get("steps") or 0),
            int(doc.get("tokens_per_step") or 0),
            noise,
            points,
            overlaps,
            run_sd=_pooled_sd([g for v in sums.values() for g in v.values()], noise),
        )
    except (ValueError, TypeError) as exc:
        raise PenaltyTableError(f"loss-penalty table {path}: {exc}") from None
