"""The driver's side of an outer-loop run's spans: many inner steps per call to each actor
([Note: many inner steps per driver call] in :mod:`geopipe.runtime.actor.inner_run`).

A pipeline run calls ``run_iteration`` once per step on every actor (``Controller._run``):
its stages exchange every micro-batch anyway, so a step boundary costs the driver little.
An outer-loop run's groups meet only at outer applies, and a per-step call made the far
group pay a control round trip to the driver's site and a barrier with every other group
each inner step (1.93x the no-WAN step time on the test bed). Here the driver asks every
actor for a *span* of steps (:func:`span_of`), up to the next point where it must act:

* a checkpoint boundary (``training.checkpoint.every_steps``: also where a lost group may
  grow back), an evaluation (``training.eval``), the end of training;
* a step whose events are recorded (calibration's first steps, ``--trace``'s last), after
  which calibration may hand out a new look-ahead before the next step, as it always did;
* :data:`SPAN_S` seconds of predicted steps, so that the progress line moves and a Ctrl-C
  is honoured (after the span, then the checkpoint) within seconds.

[Note: spans end at applies] A span that only its length cuts ends at an apply point: the
last one within :data:`SPAN_S` seconds, or, when the next lies further, after one of the
equal spans that reach it (:func:`~geopipe.optimizer.outer_cost.span_end`, which the
planner's count of calls uses too). The span's results arrive together (``completed_at``
is the span's), so spans that end where rounds end make the metrics' times whole rounds:
what a round costs is read between two span ends, not guessed across a cut one (the
outer-loop benchmark's step times, a user's tokens/s over a stretch). It costs nothing:
the next span is queued behind this one either way.

The outer loop's sends and applies are made inside the spans by the actors; the driver only
decides each apply's groups while the span runs ([Note: applies decided inside a span] in
:mod:`geopipe.runtime.actor.inner_run`; :mod:`.outerdecide`). A span that ends only for its
length (the driver has nothing to do after it) has the next span called at once, queued
behind it on every actor (:class:`Span`; the actors take them in turn), so the actors do not
wait for the driver's round trip there; a Ctrl-C then waits for the queued span too. A
group lost while a span is queued: the survivors run it as well, and the recovery records it
(:mod:`.outerfail`).

Every step's results come back in order and are recorded one by one exactly as a per-step
run records them (metrics, TensorBoard, progress, calibration, the guards), so what a run
writes per step is unchanged; ``completed_at`` in the metrics is when the driver received the
span. A codec fallback ordered at one step of a span takes effect from the next span (its
actors ran on): the span's later samples were taken under the old codec, so they are not
judged against the new one (a run with a lossy codec inside a group queues no span:
:func:`~geopipe.optimizer.outer_cost.queues_spans`). The hang timeout scales with the
span's length; heartbeats
go on as in any step (the actors answer pings on another thread); a group lost mid-span
goes to :func:`~geopipe.runtime.control.outerfail.recover_groups`, which records the
survivors' whole span, so no step is lost by them; a model error ends the run.

Why a call returning a list rather than a Ray streaming generator (results as each step
ends): the driver acts only at span ends anyway, the seam's fake (tests/unit/fakes.py) and
the failure paths stay those of ordinary calls, and the span is a few seconds long, so the
progress line lags by at most that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from geopipe.optimizer.outer_cost import MAX_SPAN, SPAN_S, queues_spans, span_cap, span_end
from geopipe.optimizer.policies import GrowBack
from geopipe.outer.fragments import StreamingSchedule
from geopipe.runtime.control.health import hang_timeout_s, raise_model_error
from geopipe.runtime.control.outerdecide import Decisions, Point, points_of
from geopipe.runtime.control.states import Checkpointing, Growing, Recovering, Running, State
from geopipe.runtime.control.workers import WorkerFailed, WorkerLost, call_all

__all__ = [
    "MAX_SPAN",
    "SPAN_S",
    "Span",
    "next_state",
    "record_span",
    "run_span",
    "span_of",
]


def span_of(
    start: int,
    total: int,
    predicted_s: float,
    schedule: StreamingSchedule,
    every: int,
    eval_due: Callable[[int], bool],
    recorded: Callable[[int], bool],
    max_span: int | None = None,
) -> int:
    """How many steps from ``start`` one call runs: up to and including the first step after
    which the driver must act (a checkpoint every ``every`` steps, an evaluation
    ``eval_due(done)``, a recorded step ``recorded(step)``, ``total``), at most ``max_span``
    steps (None: :data:`SPAN_S` seconds of ``predicted_s`` steps), ending at one of
    ``schedule``'s apply points where only the length cuts it ([Note: spans end at
    applies]). The applies are made inside the span ([Note: applies decided inside a
    span])."""
    cap = max_span or span_cap(predicted_s)
    end = span_end(start, total, max(1, cap), schedule.period)
    for step in range(start, end):
        done = step + 1
        if recorded(step) or (every and done % every == 0) or eval_due(done):
            return done - start
    return max(1, end - start)


@dataclass
class Span:
    """A span's call on every actor: steps ``start .. start + count - 1``, the call's
    ``refs`` (one per actor of ``flat``), and its apply points (:mod:`.outerdecide`)."""

    start: int
    count: int
    flat: list
    refs: list
    points: list[Point]

    @property
    def end(self) -> int:
        return self.start + self.count


def _start(ctl: Any, step: int, recorded: Callable[[int], bool]) -> Span:
    """Call a span from ``step`` on every actor (its length: :func:`span_of`), with the
    sends and applies the schedule puts inside it."""
    total, outer, cal = ctl.spec.training.steps, ctl.outer, ctl.calibrator
    every = ctl.spec.training.checkpoint.every_steps
    due = lambda d: ctl.evals.due(d, total)  # noqa: E731
    count = span_of(
        step, total, cal.predicted_s, outer.schedule, every, due, recorded, outer.max_span
    )
    steps = range(step, step + count)
    record = [s for s in steps if recorded(s)]
    sends = {s + 1: f for s in steps if (f := outer.schedule.sends_at(s + 1)) is not None}
    points = points_of(outer.schedule, step, count)
    applies = {p.done: p.fragment for p in points}
    flat = ctl.flat_actors()
    refs = call_all(ctl.workers, flat, "run_iterations", step, count, record, sends, applies)
    return Span(step, count, flat, refs, points)


def decisions_for(ctl: Any, span: Span) -> Decisions:
    """The walk over ``span``'s apply points (and the queued span's after them), over the
    actors of the live groups: the one in flight if it is over these actors, else a new
    one. A gather waits on its replica for the span's send at most a heartbeat, then is
    asked again: a walk the driver drops (its spans returned) leaves no call waiting long
    on an actor's threads."""
    outer, h = ctl.outer, ctl.spec.health
    points = span.points + (outer.queued.points if outer.queued is not None else [])
    d = outer.decisions
    if d is None or [id(a) for a in d.actors] != [id(a) for a in span.flat]:
        send_wait_s = max(0.05, min(h.heartbeat_s, h.wan_outage_s))
        d = outer.decisions = Decisions(outer, span.flat, points, send_wait_s)
    else:
        d.add(points)
    return d


def _queues_after(ctl: Any, span: Span, recorded: Callable[[int], bool]) -> bool:
    """Whether the driver need not act after ``span`` (it ended only for its length), so the
    next span can be called at once, queued behind it on every actor ([Note: the driver's
    control calls] in :mod:`geopipe.optimizer.outer_cost`)."""
    total = ctl.spec.training.steps
    every = ctl.spec.training.checkpoint.every_steps
    nxt = span.end
    return queues_spans([ctl.plan]) and not (
        nxt >= total
        or ctl.stop.requested
        or recorded(nxt - 1)
        or (every and nxt % every == 0)
        or ctl.evals.due(nxt, total)
    )


def run_span(ctl: Any, step: int) -> State:
    """RUNNING, for an outer-loop run: a span of steps from ``step`` on every actor (the
    one queued after the last span, if any), each step recorded, then the outer loop's
    apply, an evaluation, and what comes next (as ``Controller._run`` after one step).
    ``ctl`` is the :class:`~geopipe.runtime.control.controller.Controller`."""
    total, outer, cal = ctl.spec.training.steps, ctl.outer, ctl.calibrator
    trace = bool(ctl.opts.trace)

    def recorded(s: int) -> bool:
        return cal.wants(s) or (trace and s == total - 1)

    span, queued = outer.queued, True
    if span is None or span.start != step:
        span, queued = _start(ctl, step, recorded), False
    outer.queued = _start(ctl, span.end, recorded) if _queues_after(ctl, span, recorded) else None
    outer.span = (step, span.count)  # what a recovery finds in flight
    for s in range(step, span.end):  # --chaos-kill-every: 40 % into step s, as per-step calls
        ctl.chaos.maybe_strike(s, ctl._rows(), cal.predicted_s * (s - step + 0.4) / 0.4)
    hang_s = hang_timeout_s(cal.predicted_s * span.count, cal.calibrated, ctl.spec.health)
    side = decisions_for(ctl, span)
    answers = ctl._await(step, span.flat, span.refs, hang_s, side)
    if isinstance(answers, Recovering):
        return answers
    outer.span, nxt = None, span.end
    if outer.queued is None:
        outer.decisions = None
    try:
        record_span(ctl, step, answers, span.flat, queued)
        ctl.evals.after_step(nxt, total, ctl.flat_actors())  # training.eval
        state = next_state(ctl, nxt)
        if outer.queued is not None:  # called already: it runs first (a Ctrl-C waits for it)
            state = Running(nxt)
    except (WorkerLost, WorkerFailed) as exc:  # an actor died between spans
        raise_model_error(exc)  # a diverged pseudo-gradient (an apply made here): no recovery
        return Recovering(nxt, exc, ctl._pings())
    return state


def record_span(
    ctl: Any, start: int, answers: list[list], actors: list, queued: bool = False
) -> int:
    """Record each step of a span (``answers[i]``: actor ``actors[i]``'s results, in step
    order) as a finished step, and note the outer apply and sends the actors made; returns
    the steps done. An actor lost while a step is recorded (a call the guards make) does not
    keep the later steps from being recorded: the first such error is raised once all are.
    ``queued``: the span was called before the one ahead of it returned (the calibration's
    stretch is the span: :mod:`.outercal`)."""
    received, wall = time.perf_counter(), time.time()
    codecs = ctl.plan.codecs
    count = min(len(a) for a in answers)
    failed: BaseException | None = None
    ctl.outer.recording = (start, start + count, queued)
    for i in range(count):
        results = [a[i] for a in answers]
        if ctl.plan.codecs != codecs:  # sampled under a codec no longer in force
            for r in results:
                r.codec_error = {}
        # the send and the apply after this step first: a span ends at an apply ([Note:
        # spans end at applies]), and the calibration that closes the span at this step
        # prices that apply with its measured exposure, not the round before's
        ctl.outer.note_sends(start + i + 1, results, received)
        ctl.outer.note_applied(start + i + 1, results, actors)
        try:  # completed_at: when the span came back; status.json once, at its end (the
            # driver's status write per step was 42 % of its time on a span's records)
            ctl._record(start + i, results, wall, status=i == count - 1)
        except (WorkerLost, WorkerFailed) as exc:
            failed = failed or exc
    ctl.outer.done_through = max(ctl.outer.done_through, start + count)  # made in the span
    ctl.outer.recording = None
    if failed is not None:
        raise failed
    return start + count


def next_state(ctl: Any, nxt: int) -> State:
    """What follows ``nxt`` finished steps (the same for one step or a span): a Ctrl-C's
    final checkpoint (unless an outer fragment is in flight), the end, a checkpoint
    boundary (or a grow-back there), or the next step."""
    total, outer = ctl.spec.training.steps, ctl.outer
    if ctl.stop.requested and not (outer and outer.in_flight(nxt)):
        return Checkpointing(nxt, final=True, interrupted=True)
    if nxt == total:
        return Checkpointing(nxt, final=True)
    every = ctl.spec.training.checkpoint.every_steps
    if every and nxt % every == 0:
        if ctl.history.lost_devices:
            decision = ctl.recovery.grow_decision()
            if isinstance(decision, GrowBack):
                return Growing(nxt, decision)
        return Checkpointing(nxt)
    return Running(nxt)
