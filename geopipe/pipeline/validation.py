"""The invariants every executor of a schedule relies on, checked with readable errors.

On a violation :func:`validate` raises :class:`~geopipe.pipeline.schedule.ScheduleError`
whose message names the broken rule and prints the stage × step grid with the failing step
marked ``[..]`` (like ``torch.distributed.pipelining``'s simulator).
"""

from __future__ import annotations

from geopipe.pipeline.ir import Action, Kind, Schedule, ScheduleError

__all__ = ["validate"]


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
    Kind.F: (Kind.RECV_F, Kind.SEND_F, Kind.B, Kind.I),
    Kind.B: (Kind.RECV_B, Kind.SEND_B, Kind.F),
    Kind.I: (Kind.W, Kind.RECV_B, Kind.SEND_B, Kind.F),
    Kind.W: (Kind.I, Kind.F),
    Kind.RECV_F: (Kind.F,),
    Kind.SEND_F: (Kind.F,),
    Kind.RECV_B: (Kind.B, Kind.I),
    Kind.SEND_B: (Kind.B, Kind.I),
}


def _missing(
    s: Schedule, k: int, pos: dict[tuple[Kind, int], int], kind: Kind, mb: int, what: str = ""
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
    name = what or f"{kind.name}{mb}"
    return ScheduleError(f"stage {k} never runs {name}{where}\n{_grid(s, mark)}")


def _scan_stage(s: Schedule, k: int) -> dict[tuple[Kind, int], int]:
    """Walk stage ``k`` once: ownership, ranges, duplicates, order within a micro-batch, the
    in-flight cap. Returns where each ``(kind, mb)`` sits."""
    acts, m = s.stages[k], s.num_microbatches
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
        elif a.kind in (Kind.B, Kind.I):
            if (Kind.F, a.mb) not in pos:
                raise ScheduleError(f"{a} runs before its forward\n{_grid(s, (k, i))}")
            if a.kind == Kind.B:
                inflight -= 1
        elif a.kind == Kind.W:
            if (Kind.I, a.mb) not in pos:
                raise ScheduleError(
                    f"{a} runs before its input-gradient backward {Action(k, Kind.I, a.mb)}\n"
                    f"{_grid(s, (k, i))}"
                )
            inflight -= 1
        elif a.kind == Kind.SEND_F and (Kind.F, a.mb) not in pos:
            raise ScheduleError(f"{a} sends before the forward ran\n{_grid(s, (k, i))}")
        elif a.kind == Kind.SEND_B and not any((b, a.mb) in pos for b in (Kind.B, Kind.I)):
            raise ScheduleError(f"{a} sends before the backward ran\n{_grid(s, (k, i))}")
    return pos


def _check_micro_batch(s: Schedule, k: int, pos: dict[tuple[Kind, int], int], mb: int) -> None:
    """Stage ``k`` runs ``mb`` completely: F, then B or I and W, with its messages."""
    p = s.num_stages
    if (Kind.F, mb) not in pos:
        raise _missing(s, k, pos, Kind.F, mb)
    split = (Kind.I, mb) in pos or (Kind.W, mb) in pos
    if split and (Kind.B, mb) in pos:
        i = pos[(Kind.B, mb)]
        raise ScheduleError(
            f"micro-batch {mb} on stage {k} has a full backward B{mb} and a split one (I/W)\n"
            f"{_grid(s, (k, i))}"
        )
    if not split and (Kind.B, mb) not in pos:
        raise _missing(s, k, pos, Kind.B, mb, f"B{mb} (or I{mb} and W{mb})")
    if split:
        for kind in (Kind.I, Kind.W):
            if (kind, mb) not in pos:
                raise _missing(s, k, pos, kind, mb)
    back = Kind.I if split else Kind.B
    need: list[tuple[Kind, Kind | None]] = []
    if k > 0:
        need += [(Kind.RECV_F, Kind.F), (Kind.SEND_B, None)]
    if k < p - 1:
        need += [(Kind.SEND_F, None), (Kind.RECV_B, back)]
    for comm, before in need:
        if (comm, mb) not in pos:
            raise _missing(s, k, pos, comm, mb)
        if before is not None and pos[(comm, mb)] > pos[(before, mb)]:
            i = pos[(before, mb)]
            raise ScheduleError(
                f"{before.name}{mb} on stage {k} runs before {comm.name}{mb}\n{_grid(s, (k, i))}"
            )


def validate(s: Schedule) -> None:
    """Check the invariants every executor relies on; raise ``ScheduleError``.

    * each micro-batch has, per stage, one F and either one B or one I and one W, in the
      order F, I, W (the gradient sent upstream comes from B or I);
    * receives precede their compute and sends follow it; every send has its receive;
    * in-flight micro-batches per stage (forward ran, B or W not yet) never exceed the
      stage's cap;
    * no deadlock: a zero-cost run with asynchronous sends completes.
    """
    p, m = s.num_stages, s.num_microbatches
    if len(s.stages) != p or len(s.caps) != p:
        raise ScheduleError(f"{s.name}: expected {p} stage lists and caps")
    for k, acts in enumerate(s.stages):
        pos = _scan_stage(s, k)
        for mb in range(m):
            _check_micro_batch(s, k, pos, mb)
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
