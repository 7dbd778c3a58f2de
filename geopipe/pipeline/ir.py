"""The schedule IR: per-stage action lists, their text form and the helpers generators share.

See :mod:`geopipe.pipeline.schedule` for the semantics and the generators (this module is
what the generators, the validator and the simulator import, so it imports none of them).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property, lru_cache

__all__ = [
    "COMPUTE",
    "FUSED_B",
    "FUSED_F",
    "FUSED_I",
    "FUSED_MASK",
    "FUSED_SHIFT",
    "INPUT_BACKWARD",
    "Action",
    "Kind",
    "Program",
    "Schedule",
    "ScheduleError",
    "parse_action",
    "parse_schedule",
    "warmup_counts",
    "with_comm",
]


class Kind(IntEnum):
    F = 0
    B = 1
    SEND_F = 2
    RECV_F = 3
    SEND_B = 4
    RECV_B = 5
    I = 6  # noqa: E741 - torch's letter; backward w.r.t. the stage input only
    W = 7  # backward w.r.t. the weights, after the I of the same micro-batch


COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
# The backward that produces the gradient sent upstream (and waits for the one from below).
INPUT_BACKWARD = (Kind.B, Kind.I)


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.name}{self.mb}"


_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


def parse_action(text: str) -> Action:
    m = _ACTION_RE.match(text.strip())
    if not m:
        raise ValueError(f"not an action: {text!r} (expected like '1F0' or '0SEND_F3')")
    return Action(int(m.group(1)), Kind[m.group(2)], int(m.group(3)))


class ScheduleError(ValueError):
    """A schedule breaks an invariant; the message shows the stage × step grid."""


Program = tuple[tuple[int, ...], tuple[int, ...]]  # (kinds, micro-batches) of one stage


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists plus the in-flight cap each stage promised to respect.

    Stored as int programs (kinds, micro-batches) because generators share them between
    schedules and the simulator reads them directly; :attr:`stages` gives the Actions.
    """

    name: str
    num_stages: int
    num_microbatches: int
    programs: tuple[Program, ...]
    caps: tuple[int, ...]
    delta_n: tuple[int, ...] = ()

    @classmethod
    def from_actions(
        cls, name: str, p: int, m: int, stages: Sequence[Sequence[Action]], caps, delta_n=()
    ) -> Schedule:
        programs = tuple(
            (tuple(int(a.kind) for a in acts), tuple(a.mb for a in acts)) for acts in stages
        )
        sched = cls(name, p, m, programs, tuple(caps), tuple(delta_n))
        for k, acts in enumerate(stages):
            for a in acts:
                if a.stage != k:
                    raise ScheduleError(f"action {a} sits in stage {k}'s list")
        return sched

    @cached_property
    def stages(self) -> tuple[tuple[Action, ...], ...]:
        return tuple(
            tuple(Action(k, Kind(c), mb) for c, mb in zip(kinds, mbs, strict=True))
            for k, (kinds, mbs) in enumerate(self.programs)
        )

    def to_text(self) -> str:
        head = (
            f"# {self.name} stages={self.num_stages} microbatches={self.num_microbatches} "
            f"caps={','.join(map(str, self.caps))} "
            f"delta_n={','.join(map(str, self.delta_n)) or '-'}"
        )
        lines = [head] + [" ".join(str(a) for a in acts) for acts in self.stages]
        return "\n".join(lines) + "\n"

    @cached_property
    def fused(self) -> list[list[int]]:
        """Programs with each ``RECV x, x, SEND x`` run folded into one op (see simulator)."""
        return [list(_fuse(kinds, mbs)) for kinds, mbs in self.programs]

    @cached_property
    def max_in_flight(self) -> tuple[int, ...]:
        """Peak number of micro-batches whose forward ran but whose backward did not finish
        (``B``, or ``W`` for a split backward: a deferred ``W`` still holds activations)."""
        return tuple(_peak(kinds) for kinds, _ in self.programs)

    @cached_property
    def hold_points(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per stage, the distinct ``(full, partial)`` counts right after each forward: micro-
        batches whose forward ran but no backward (all activations held), and those past
        ``I`` but before ``W`` (only what ``W`` needs). Memory peaks at one of these."""
        return tuple(_hold_points(kinds) for kinds, _ in self.programs)

    def peak_held(self, w_fraction: float) -> tuple[float, ...]:
        """Peak activations held per stage, in micro-batches' worth, when a micro-batch past
        ``I`` still holds ``w_fraction`` of its activations until its ``W``."""
        return tuple(
            max((f + w_fraction * w for f, w in pts), default=0.0) for pts in self.hold_points
        )


@lru_cache(maxsize=4096)
def _peak(kinds: tuple[int, ...]) -> int:
    cur = peak = 0
    for c in kinds:
        if c == Kind.F:
            cur += 1
            peak = max(peak, cur)
        elif c == Kind.B or c == Kind.W:
            cur -= 1
    return peak


@lru_cache(maxsize=4096)
def _hold_points(kinds: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    full = partial = 0
    points: set[tuple[int, int]] = set()
    for c in kinds:
        if c == Kind.F:
            full += 1
            points.add((full, partial))
        elif c == Kind.B:
            full -= 1
        elif c == Kind.I:
            full, partial = full - 1, partial + 1
        elif c == Kind.W:
            partial -= 1
    # Only the Pareto front matters for a peak with any fraction in [0, 1].
    return tuple(
        sorted(
            pt
            for pt in points
            if not any(o != pt and o[0] >= pt[0] and o[1] >= pt[1] for o in points)
        )
    )


# Fused op codes (the simulator's hot loop reads these): plain kinds keep their value (0..7);
# ``[RECV] compute [SEND]`` runs become base + recv + 2*send with base 8 (F), 12 (B) or 16
# (I). The micro-batch sits in the bits above: op = code | (mb << FUSED_SHIFT).
FUSED_F, FUSED_B, FUSED_I = 8, 12, 16
FUSED_SHIFT, FUSED_MASK = 5, 31
_FUSED_BASE = {Kind.F: FUSED_F, Kind.B: FUSED_B, Kind.I: FUSED_I}


@lru_cache(maxsize=4096)
def _fuse(kinds: tuple[int, ...], mbs: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    i, n = 0, len(kinds)
    send_of = {Kind.F: Kind.SEND_F, Kind.B: Kind.SEND_B, Kind.I: Kind.SEND_B}
    while i < n:
        c, mb = kinds[i], mbs[i]
        recv = 0
        if c in (Kind.RECV_F, Kind.RECV_B) and i + 1 < n and mbs[i + 1] == mb:
            nxt = kinds[i + 1]
            if (c == Kind.RECV_F and nxt == Kind.F) or (c == Kind.RECV_B and nxt in INPUT_BACKWARD):
                recv, i, c = 1, i + 1, nxt
        if c in _FUSED_BASE:
            send = 0
            if i + 1 < n and kinds[i + 1] == send_of[Kind(c)] and mbs[i + 1] == mb:
                send, i = 1, i + 1
            out.append((_FUSED_BASE[Kind(c)] + recv + 2 * send) | (mb << FUSED_SHIFT))
        else:
            out.append(c | (mb << FUSED_SHIFT))
        i += 1
    return tuple(out)


def parse_schedule(text: str) -> Schedule:
    """Inverse of :meth:`Schedule.to_text`."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("#"):
        raise ValueError("schedule text must start with a '# <name> stages=… ' header")
    head = dict(tok.split("=", 1) for tok in lines[0][1:].split()[1:])
    name = lines[0][1:].split()[0]
    p, m = int(head["stages"]), int(head["microbatches"])
    caps = tuple(int(c) for c in head["caps"].split(","))
    dn = (
        () if head.get("delta_n", "-") == "-" else tuple(int(x) for x in head["delta_n"].split(","))
    )
    stages = [[parse_action(tok) for tok in ln.split()] for ln in lines[1:]]
    if len(stages) != p:
        raise ValueError(f"header says {p} stages but {len(stages)} lines follow")
    return Schedule.from_actions(name, p, m, stages, caps, dn)


# ----------------------------------------------------------------------------------------------
# Shared by the generators


def with_comm(first: bool, last: bool, order: Sequence[tuple[Kind, int]]) -> Program:
    """Insert the receive before and the send after each compute action."""
    kinds: list[int] = []
    mbs: list[int] = []
    for kind, mb in order:
        if kind == Kind.F:
            seq = ([] if first else [Kind.RECV_F]) + [Kind.F] + ([] if last else [Kind.SEND_F])
        elif kind == Kind.W:
            seq = [Kind.W]
        else:  # B or I: wait for the gradient from below, send ours up
            seq = ([] if last else [Kind.RECV_B]) + [kind] + ([] if first else [Kind.SEND_B])
        kinds += [int(k) for k in seq]
        mbs += [mb] * len(seq)
    return tuple(kinds), tuple(mbs)


def check_pm(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"need at least one stage and one micro-batch (got p={p}, m={m})")


def warmup_counts(p: int, m: int, delta_n: Sequence[int]) -> list[int]:
    """Warm-up forwards per stage: ``p-k-1`` plus ΔN of every boundary at or after ``k``."""
    if len(delta_n) != max(p - 1, 0):
        raise ValueError(
            f"delta_n needs one entry per stage boundary ({p - 1}), got {len(delta_n)}"
        )
    if any(d < 0 for d in delta_n):
        raise ValueError(f"delta_n must be non-negative, got {list(delta_n)}")
    out = []
    for k in range(p):
        out.append(min(m, p - k - 1 + sum(delta_n[k:])))
    return out
