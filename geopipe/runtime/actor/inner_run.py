"""A run of inner steps in one call: what an outer-loop run's driver asks of each stage replica
instead of one ``run_iteration`` call per step.

[Note: many inner steps per driver call]
The replica groups of an outer-loop run share nothing inside an inner step (each is its own
pipeline, ZeRO-1 inside its own sites); they meet only at an outer apply. A driver that asks
for one step at a time makes every group wait, every step, for the slowest group and for a
control round trip to the driver's site (~80 ms over a 40 ms link: measured 1.93x the
no-WAN step time on the test bed). So the driver asks each replica for a *span* of steps at
once (:func:`geopipe.runtime.control.innerrun.span_of` says how many: up to the next point
where the driver must act) and the replica runs them back to back.

The outer loop's *sends* fall inside a span: the driver names them (``sends``: inner steps
done -> fragment, from the pure :class:`~geopipe.outer.fragments.StreamingSchedule`) and
the replica makes each itself right after the step that calls for it, exactly where the
driver's ``outer_send`` call used to land (after that step's optimizer step and boundary
snapshot, before the next step), so the pseudo-gradient taken is the same, bit for bit.

[Note: applies decided inside a span]
Applies stay driver-coordinated, since the driver owns the set of live groups each apply
averages over ([Note: a round over the survivors] in :mod:`geopipe.runtime.actor.outer`),
but they no longer end a span. The driver names the apply points of a span (``applies``:
inner steps done -> fragment) and, as each comes up while the span runs, tells every replica
on another of its threads the groups to average over, the live ones (``outer_decide``), and
asks each for its gather of the round (which waits for the span to make the send, then files
the peers' payloads as they arrive). The span's thread, reaching the apply point, waits until
it holds every named group's payload and makes the apply there -- where the driver's
``outer_apply`` call used to land (after the send and the step, before the next step), so the
weights are the same, bit for bit. The wait is the only cost an apply adds to the span: the
transfer compute did not hide. No control round trip lies between the payloads' arrival and
the apply (the decision came before them); before, each apply ended a span and a far group
paid a control round trip there (1.26x the no-WAN step time at five applies per 50 steps on
the test bed). A payload that does not come is waited for in the driver's slices, and past
``health.wan_outage_s`` the driver takes its decision back where no apply has used it yet
and names the survivors' final groups ([Note: taking back a decision] in
:mod:`geopipe.runtime.control.outerdecide`); a replica group lost meanwhile is dropped the same
way (:mod:`geopipe.runtime.control.outerfail`).

A span may be called while the one before it still runs (the driver queues the next span
when it has nothing to do between them: [Note: the driver's control calls] in
:mod:`geopipe.optimizer.outer_cost`). A stage actor serves calls on several threads, so two
outstanding spans could start in either order: each waits its turn (:class:`_Turn`: the
span from the step the last one ended at, or from an earlier step after a rollback).

Each step's :class:`~geopipe.runtime.actor.executor.IterationResult` is returned, in order,
so the driver records every step as before; a step that made a send carries the send's
answer (``outer_sent``) with ``before_end_s``, the seconds from the send to the end of the
span (on this replica's clock), from which the driver dates the send on its own clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

from geopipe.runtime.actor.executor import IterationResult

__all__ = ["TURN_WAIT_S", "run_span"]

TURN_WAIT_S = 3600.0  # a queued span waits this long at most for the one before it


class _Turn:
    """Whose turn it is among a replica's outstanding spans: one at a time, and a span
    from step ``s`` only once the steps before ``s`` are done (``next``: the step the last
    span ended at; None after a failed span, when the order no longer matters)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.busy = False
        self.next: int | None = None

    def take(self, start: int) -> None:
        with self.cond:
            ok = self.cond.wait_for(
                lambda: not self.busy and (self.next is None or start <= self.next),
                timeout=TURN_WAIT_S,
            )
            if not ok:
                raise TimeoutError(f"the span from step {start} waited for step {self.next}")
            self.busy = True

    def give(self, end: int | None) -> None:
        with self.cond:
            self.busy, self.next = False, end
            self.cond.notify_all()


def run_span(
    worker: Any,
    start: int,
    count: int,
    record: Collection[int] = (),
    sends: Mapping[int, int] | None = None,
    applies: Mapping[int, int] | None = None,
) -> list[IterationResult]:
    """Run optimizer steps ``start .. start + count - 1`` on ``worker`` (a
    :class:`~geopipe.runtime.actor.stage.StageWorker`), recording the events of the steps in
    ``record``; after the step that completes ``d`` inner steps, send fragment
    ``sends[d]`` of the outer loop, then apply fragment ``applies[d]`` over the groups the
    driver names ([Note: applies decided inside a span]; the answer: that step's
    ``outer_applied``, with ``decide_wait_s``, the seconds this replica waited for the
    decision). An error in any step ends the span with that error, as it would have ended
    that step's own call."""
    if count < 1:
        raise ValueError(f"a span runs at least one step, got count={count}")
    turn = worker.__dict__.setdefault("_span_turn", _Turn())
    turn.take(start)
    try:
        out = _run(worker, start, count, record, sends, applies)
    except BaseException:
        turn.give(None)
        raise
    turn.give(start + count)
    return out


def _run(
    worker: Any,
    start: int,
    count: int,
    record: Collection[int],
    sends: Mapping[int, int] | None,
    applies: Mapping[int, int] | None,
) -> list[IterationResult]:
    """:func:`run_span`'s steps, once it is the span's turn."""
    recorded, sends, applies = set(record), dict(sends or {}), dict(applies or {})
    out: list[IterationResult] = []
    sent_at: list[tuple[IterationResult, float]] = []
    for step in range(start, start + count):
        res = worker.run_iteration(step, step in recorded)
        done = step + 1
        fragment = sends.get(done)
        if fragment is not None:
            res.outer_sent = dict(worker.outer_send(fragment, done))
            sent_at.append((res, time.monotonic()))
        fragment = applies.get(done)
        if fragment is not None:
            t0 = time.monotonic()
            groups = worker.outer_decision(done, fragment, TURN_WAIT_S)
            waited = time.monotonic() - t0
            res.outer_applied = {**worker.outer_apply(fragment, groups), "decide_wait_s": waited}
        out.append(res)
    end = time.monotonic()
    for res, t in sent_at:
        res.outer_sent["before_end_s"] = end - t
    return out
