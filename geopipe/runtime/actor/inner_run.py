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
Applies stay driver-coordinated: a span ends at an apply point, since the driver owns the
set of live groups each apply averages over ([Note: a round over the survivors] in
:mod:`geopipe.runtime.actor.outer`).

Each step's :class:`~geopipe.runtime.actor.executor.IterationResult` is returned, in order,
so the driver records every step as before; a step that made a send carries the send's
answer (``outer_sent``) with ``before_end_s``, the seconds from the send to the end of the
span (on this replica's clock), from which the driver dates the send on its own clock.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

from geopipe.runtime.actor.executor import IterationResult

__all__ = ["run_span"]


def run_span(
    worker: Any,
    start: int,
    count: int,
    record: Collection[int] = (),
    sends: Mapping[int, int] | None = None,
) -> list[IterationResult]:
    """Run optimizer steps ``start .. start + count - 1`` on ``worker`` (a
    :class:`~geopipe.runtime.actor.stage.StageWorker`), recording the events of the steps in
    ``record``; after the step that completes ``d`` inner steps, send fragment
    ``sends[d]`` of the outer loop. An error in any step ends the span with that error, as
    it would have ended that step's own call."""
    if count < 1:
        raise ValueError(f"a span runs at least one step, got count={count}")
    recorded, sends = set(record), dict(sends or {})
    out: list[IterationResult] = []
    sent_at: list[tuple[IterationResult, float]] = []
    for step in range(start, start + count):
        res = worker.run_iteration(step, step in recorded)
        fragment = sends.get(step + 1)
        if fragment is not None:
            res.outer_sent = dict(worker.outer_send(fragment))
            sent_at.append((res, time.monotonic()))
        out.append(res)
    end = time.monotonic()
    for res, t in sent_at:
        res.outer_sent["before_end_s"] = end - t
    return out
