"""Pipeline schedules as data.

A schedule is, per stage, an ordered list of :class:`Action` (stage, kind, micro-batch),
built by pure generators. The same lists are replayed by the simulator
(:mod:`geopipe.optimizer.simulator`) and executed by the stage actors
(:mod:`geopipe.runtime.stage`), so prediction and execution cannot drift apart.

Semantics every executor follows:

* ``F m`` / ``B m`` are compute on micro-batch ``m``.
* ``SEND_F m`` / ``SEND_B m`` hand the activation (gradient) to the transport and return at
  once: transfer overlaps the compute that follows.
* ``RECV_F m`` / ``RECV_B m`` wait until that message has arrived. The transport delivers
  in the background, so the wait sits just before the compute that needs the data.

Text form: one action prints as ``<stage><KIND><mb>`` (``1F0``, ``0SEND_F3``), like
``torch.distributed.pipelining``; a schedule prints one line per stage and parses back.

[Note: look-ahead] In 1F1B stage ``k`` of ``p`` runs ``p-k-1`` warm-up forwards and then
alternates one forward with one backward. Across a WAN link the backward for micro-batch
``m`` returns only after a round trip, so the upstream stage idles (GeoPipe's "cross-DC
bubble"). The look-ahead schedule gives stage ``k`` ``sum(ΔN_j for boundaries j >= k)``
extra warm-up forwards: the stage right before a WAN boundary keeps ΔN more micro-batches
in flight, and every stage before it must feed those, so it adds the same ΔN. With
asynchronous sends the extra forwards cover the round trip; the price is ΔN more
micro-batches of activations held in memory.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property, lru_cache

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "gpipe",
    "lookahead",
    "make_schedule",
    "one_f_one_b",
    "parse_schedule",
    "validate",
    "warmup_counts",
]


class Kind(IntEnum):
    F = 0
    B = 1
    SEND_F = 2
    RECV_F = 3
    SEND_B = 4
    RECV_B = 5


COMPUTE = (Kind.F, Kind.B)


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.name}{self.mb}"


_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")


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
        """Peak number of micro-batches whose forward ran but backward did not, per stage."""
        return tuple(_peak(kinds) for kinds, _ in self.programs)


@lru_cache(maxsize=4096)
def _peak(kinds: tuple[int, ...]) -> int:
    cur = peak = 0
    for c in kinds:
        if c == Kind.F:
            cur += 1
            peak = max(peak, cur)
        elif c == Kind.B:
            cur -= 1
    return peak


# Fused op codes: 6 + recv + 2*send for a forward, 10 + recv + 2*send for a backward;
# the micro-batch sits in the bits above: op = code | (mb << 4).
FUSED_F, FUSED_B = 6, 10


@lru_cache(maxsize=4096)
def _fuse(kinds: tuple[int, ...], mbs: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    i, n = 0, len(kinds)
    send_of = {Kind.F: Kind.SEND_F, Kind.B: Kind.SEND_B}
    while i < n:
        c, mb = kinds[i], mbs[i]
        recv = 0
        if c in (Kind.RECV_F, Kind.RECV_B) and i + 1 < n and mbs[i + 1] == mb:
            comp = Kind.F if c == Kind.RECV_F else Kind.B
            if kinds[i + 1] == comp:
                recv, i, c = 1, i + 1, comp
        if c in (Kind.F, Kind.B):
            send = 0
            if i + 1 < n and kinds[i + 1] == send_of[Kind(c)] and mbs[i + 1] == mb:
                send, i = 1, i + 1
            base = FUSED_F if c == Kind.F else FUSED_B
            out.append((base + recv + 2 * send) | (mb << 4))
        else:
            out.append(c | (mb << 4))
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
# Generators


def _with_comm(first: bool, last: bool, order: Sequence[tuple[Kind, int]]) -> Program:
    """Insert the receive before and the send after each compute action."""
    kinds: list[int] = []
    mbs: list[int] = []
    for kind, mb in order:
        if kind == Kind.F:
            seq = ([] if first else [Kind.RECV_F]) + [Kind.F] + ([] if last else [Kind.SEND_F])
        else:
            seq = ([] if last else [Kind.RECV_B]) + [Kind.B] + ([] if first else [Kind.SEND_B])
        kinds += [int(k) for k in seq]
        mbs += [mb] * len(seq)
    return tuple(kinds), tuple(mbs)


@lru_cache(maxsize=8192)
def _program(family: str, first: bool, last: bool, m: int, warmup: int) -> Program:
    """One stage's program; shared by every schedule with the same (m, warm-up, position)."""
    if family == "gpipe":
        order = [(Kind.F, i) for i in range(m)] + [(Kind.B, i) for i in range(m)]
    else:
        order = _one_f_one_b_order(m, warmup)
    return _with_comm(first, last, order)


def _one_f_one_b_order(m: int, warmup: int) -> list[tuple[Kind, int]]:
    order = [(Kind.F, i) for i in range(warmup)]
    for j in range(m - warmup):
        order.append((Kind.F, warmup + j))
        order.append((Kind.B, j))
    order += [(Kind.B, j) for j in range(m - warmup, m)]
    return order


def _check_pm(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"need at least one stage and one micro-batch (got p={p}, m={m})")


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards: simple, m activations in flight per stage."""
    _check_pm(p, m)
    progs = tuple(_program("gpipe", k == 0, k == p - 1, m, m) for k in range(p))
    return Schedule("gpipe", p, m, progs, tuple([m] * p))


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


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-flush 1F1B: at most ``p-k`` micro-batches in flight on stage k."""
    _check_pm(p, m)
    sched = lookahead(p, m, [0] * (p - 1))
    return Schedule("1f1b", p, m, sched.programs, sched.caps)


def lookahead(p: int, m: int, delta_n: Sequence[int]) -> Schedule:
    """1F1B with ΔN extra warm-up forwards upstream of each boundary (see the note above).

    ``delta_n[j]`` is the scheduling advance for the boundary between stage ``j`` and
    ``j+1``; boundaries inside a site normally get 0.
    """
    _check_pm(p, m)
    warm = warmup_counts(p, m, delta_n)
    progs = tuple(_program("1f1b", k == 0, k == p - 1, m, warm[k]) for k in range(p))
    caps = tuple(min(m, w + 1) for w in warm)
    return Schedule("lookahead", p, m, progs, caps, tuple(delta_n))


def make_schedule(name: str, p: int, m: int, delta_n: Sequence[int] | None = None) -> Schedule:
    """Build a schedule by family name (``gpipe``, ``1f1b``, ``lookahead``)."""
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "lookahead":
        return lookahead(p, m, list(delta_n) if delta_n is not None else [0] * (p - 1))
    raise ValueError(f"unknown schedule '{name}' (gpipe, 1f1b, lookahead)")


# ----------------------------------------------------------------------------------------------
# Validation


def _grid(s: Schedule, mark: tuple[int, int] | None, width: int = 24) -> str:
    """The stage × step grid around a failing step, with the step marked ``[..]``."""
    lo = 0
    if mark is not None:
        lo = max(0, mark[1] - width // 2)
    rows = []
    for k, acts in enumerate(s.stages):
        cells = []
        for i in range(lo, min(len(acts), lo + width)):
            txt = str(acts[i])
            if mark == (k, i):
                txt = f"[{txt}]"
            cells.append(txt)
        rows.append(f"stage {k:>2} @{lo:>3}: " + " ".join(cells))
    return "\n".join(rows)


# Where a missing action belongs: next to these actions of the same micro-batch (in order of
# preference), so the error grid can mark the spot.
_NEIGHBOURS: dict[Kind, tuple[Kind, ...]] = {
    Kind.F: (Kind.RECV_F, Kind.SEND_F, Kind.B),
    Kind.B: (Kind.RECV_B, Kind.SEND_B, Kind.F),
    Kind.RECV_F: (Kind.F,),
    Kind.SEND_F: (Kind.F,),
    Kind.RECV_B: (Kind.B,),
    Kind.SEND_B: (Kind.B,),
}


def _missing(
    s: Schedule, k: int, pos: dict[tuple[Kind, int], int], kind: Kind, mb: int
) -> ScheduleError:
    """The error for an action stage ``k`` never runs, marking the step it belongs beside.

    A missing action has no step of its own, so we mark its compute (or, for a missing
    compute, its receive/send) — else the stage's last step — to show where it is missing.
    """
    acts = s.stages[k]
    near = next((pos[(n, mb)] for n in _NEIGHBOURS[kind] if (n, mb) in pos), None)
    if near is not None:
        where, mark = f" (it belongs beside {acts[near]}, marked)", (k, near)
    elif acts:
        where, mark = " (marked: the stage's last step)", (k, len(acts) - 1)
    else:
        where, mark = " (the stage has no steps)", None
    return ScheduleError(f"stage {k} never runs {kind.name}{mb}{where}\n{_grid(s, mark)}")


def validate(s: Schedule) -> None:
    """Check the invariants every executor relies on; raise :class:`ScheduleError`.

    * each micro-batch has exactly one F and one B per stage, B after F;
    * receives precede their compute and sends follow it; every send has its receive;
    * in-flight micro-batches per stage never exceed the stage's cap;
    * no deadlock: a zero-cost run with asynchronous sends completes.
    """
    p, m = s.num_stages, s.num_microbatches
    if len(s.stages) != p or len(s.caps) != p:
        raise ScheduleError(f"{s.name}: expected {p} stage lists and caps")
    for k, acts in enumerate(s.stages):
        pos: dict[tuple[Kind, int], int] = {}
        inflight = 0
        for i, a in enumerate(acts):
            if a.stage != k:
                raise ScheduleError(f"action {a} sits in stage {k}'s list\n{_grid(s, (k, i))}")
            if not 0 <= a.mb < m:
                raise ScheduleError(f"micro-batch out of range in {a}\n{_grid(s, (k, i))}")
            if (a.kind, a.mb) in pos:
                raise ScheduleError(f"{a} appears twice\n{_grid(s, (k, i))}")
            pos[(a.kind, a.mb)] = i
            if a.kind == Kind.F:
                inflight += 1
                if inflight > s.caps[k]:
                    raise ScheduleError(
                        f"stage {k} holds {inflight} micro-batches, above its cap {s.caps[k]}\n"
                        f"{_grid(s, (k, i))}"
                    )
            elif a.kind == Kind.B:
                if (Kind.F, a.mb) not in pos:
                    raise ScheduleError(f"{a} runs before its forward\n{_grid(s, (k, i))}")
                inflight -= 1
            elif a.kind == Kind.SEND_F and (Kind.F, a.mb) not in pos:
                raise ScheduleError(f"{a} sends before the forward ran\n{_grid(s, (k, i))}")
            elif a.kind == Kind.SEND_B and (Kind.B, a.mb) not in pos:
                raise ScheduleError(f"{a} sends before the backward ran\n{_grid(s, (k, i))}")
        for mb in range(m):
            for kind in COMPUTE:
                if (kind, mb) not in pos:
                    raise _missing(s, k, pos, kind, mb)
            need = []
            if k > 0:
                need += [(Kind.RECV_F, Kind.F), (Kind.SEND_B, None)]
            if k < p - 1:
                need += [(Kind.SEND_F, None), (Kind.RECV_B, Kind.B)]
            for comm, before in need:
                if (comm, mb) not in pos:
                    raise _missing(s, k, pos, comm, mb)
                if before is not None and pos[(comm, mb)] > pos[(before, mb)]:
                    i = pos[(before, mb)]
                    raise ScheduleError(
                        f"{before.name}{mb} on stage {k} runs before {comm.name}{mb}\n"
                        f"{_grid(s, (k, i))}"
                    )
        past = {Kind.RECV_F, Kind.SEND_B} if k == 0 else set()
        if k == p - 1:
            past |= {Kind.SEND_F, Kind.RECV_B}
        extra = [i for i, a in enumerate(acts) if a.kind in past]
        if extra:
            i = extra[0]
            raise ScheduleError(
                f"stage {k} talks past the pipeline's end: {acts[i]}\n{_grid(s, (k, i))}"
            )
    _check_deadlock(s)


def _check_deadlock(s: Schedule) -> None:
    p = s.num_stages
    ptr = [0] * p
    sent: set[tuple[int, Kind, int]] = set()  # (receiving stage, RECV kind, mb)
    while True:
        moved = False
        for k in range(p):
            acts = s.stages[k]
            while ptr[k] < len(acts):
                a = acts[ptr[k]]
                if a.kind in (Kind.RECV_F, Kind.RECV_B) and (k, a.kind, a.mb) not in sent:
                    break
                if a.kind == Kind.SEND_F:
                    sent.add((k + 1, Kind.RECV_F, a.mb))
                elif a.kind == Kind.SEND_B:
                    sent.add((k - 1, Kind.RECV_B, a.mb))
                ptr[k] += 1
                moved = True
        if all(ptr[k] == len(s.stages[k]) for k in range(p)):
            return
        if not moved:
            k = next(k for k in range(p) if ptr[k] < len(s.stages[k]))
            waits = ", ".join(
                f"stage {j} at {s.stages[j][ptr[j]]}" for j in range(p) if ptr[j] < len(s.stages[j])
            )
            raise ScheduleError(f"deadlock: {waits}\n{_grid(s, (k, ptr[k]))}")
