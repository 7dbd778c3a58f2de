"""The driver's side of an outer-loop run's spans: many inner steps per call to each actor
([Note: many inner steps per driver call] in :mod:`geopipe.runtime.actor.inner_run`).

A pipeline run calls ``run_iteration`` once per step on every actor (``Controller._run``):
its stages exchange every micro-batch anyway, so a step boundary costs the driver little.
An outer-loop run's groups meet only at outer applies, and a per-step call made the far
group pay a control round trip to the driver's site and a barrier with every other group
each inner step (1.93x the no-WAN step time on the test bed). Here the driver asks every
actor for a *span* of steps (:func:`span_of`), up to the next point where it must act:

* an outer apply (the driver names the groups it averages over: [Note: losing a replica
  group] in :mod:`.outerloop`); the sends inside the span are made by the actors;
* a checkpoint boundary (``training.checkpoint.every_steps``: also where a lost group may
  grow back), an evaluation (``training.eval``), the end of training;
* a step whose events are recorded (calibration's first steps, ``--trace``'s last), after
  which calibration may hand out a new look-ahead before the next step, as it always did;
* :data:`SPAN_S` seconds of predicted steps, so that the progress line moves and a Ctrl-C
  is honoured (after the span, then the checkpoint) within seconds.

Every step's results come back in order and are recorded one by one exactly as a per-step
run records them (metrics, TensorBoard, progress, calibration, the guards), so what a run
writes per step is unchanged; ``completed_at`` in the metrics is when the driver received the
span. A codec fallback ordered at one step of a span takes effect from the next span (its
actors ran on): the span's later samples were taken under the old codec, so they are not
judged against the new one. The hang timeout scales with the span's length; heartbeats
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
from typing import Any

from geopipe.optimizer.policies import GrowBack
from geopipe.outer.fragments import StreamingSchedule
from geopipe.runtime.control.health import (
    hang_timeout_s,
)
from geopipe.runtime.control.states import Checkpointing, Growing, Recovering, Running, State
from geopipe.runtime.control.workers import WorkerFailed, WorkerLost, call_all

__all__ = ["MAX_SPAN", "SPAN_S", "next_state", "record_span", "run_span", "span_of"]

SPAN_S = 5.0  # predicted seconds of steps per call at most: the progress line's lag
MAX_SPAN = 1000  # steps per call at most (a prediction of ~0 s: a run of tiny steps)


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
    which the driver must act (an apply of ``schedule``, a checkpoint every ``every`` steps,
    an evaluation ``eval_due(done)``, a recorded step ``recorded(step)``, ``total``), at most
    ``max_span`` steps (None: :data:`SPAN_S` seconds of ``predicted_s`` steps)."""
    cap = max_span or max(1, min(MAX_SPAN, int(SPAN_S / predicted_s) if predicted_s > 0 else 1))
    end = min(total, start + max(1, cap))
    for step in range(start, end):
        done = step + 1
        if (
            recorded(step)
            or schedule.applies_at(done) is not None
            or (every and done % every == 0)
            or eval_due(done)
        ):
            return done - start
    return max(1, end - start)


def run_span(ctl: Any, step: int) -> State:
    """RUNNING, for an outer-loop run: a span of steps from ``step`` on every actor, each
    step recorded, then the outer loop's apply, an evaluation, and what comes next (as
    ``Controller._run`` after one step). ``ctl`` is the
    :class:`~geopipe.runtime.control.controller.Controller`."""
    total, outer, cal = ctl.spec.training.steps, ctl.outer, ctl.calibrator
    trace = bool(ctl.opts.trace)

    def recorded(s: int) -> bool:
        return cal.wants(s) or (trace and s == total - 1)

    every = ctl.spec.training.checkpoint.every_steps
    due = lambda d: ctl.evals.due(d, total)  # noqa: E731
    count = span_of(
        step, total, cal.predicted_s, outer.schedule, every, due, recorded, outer.max_span
    )
    steps = range(step, step + count)
    record = [s for s in steps if recorded(s)]
    sends = {s + 1: f for s in steps if (f := outer.schedule.sends_at(s + 1)) is not None}
    flat = ctl.flat_actors()
    outer.span = (step, count)  # what a recovery finds in flight
    refs = call_all(ctl.workers, flat, "run_iterations", step, count, record, sends)
    for s in steps:  # --chaos-kill-every: 40 % into step s, as when each step was a call
        ctl.chaos.maybe_strike(s, ctl._rows(), cal.predicted_s * (s - step + 0.4) / 0.4)
    hang_s = hang_timeout_s(cal.predicted_s * count, cal.calibrated, ctl.spec.health)
    answers = ctl._await(step, flat, refs, hang_s)
    if isinstance(answers, Recovering):
        return answers
    outer.span, nxt = None, step + count
    try:
        record_span(ctl, step, answers)
        outer.after_step(nxt, [a for a, _ in ctl.placement.actor_sites()])  # the apply
        ctl.evals.after_step(nxt, total, ctl.flat_actors())  # training.eval
    except (WorkerLost, WorkerFailed) as exc:  # an actor died between spans
        return Recovering(nxt, exc, ctl._pings())
    return next_state(ctl, nxt)


def record_span(ctl: Any, start: int, answers: list[list]) -> int:
    """Record each step of a span (``answers[i]``: actor ``i``'s results, in step order) as a
    finished step, and note the outer sends the actors made; returns the steps done. An
    actor lost while a step is recorded (a call the guards make) does not keep the later
    steps from being recorded: the first such error is raised once all are."""
    received = time.perf_counter()
    codecs = ctl.plan.codecs
    count = min(len(a) for a in answers)
    failed: BaseException | None = None
    for i in range(count):
        results = [a[i] for a in answers]
        if ctl.plan.codecs != codecs:  # sampled under a codec no longer in force
            for r in results:
                r.codec_error = {}
        try:
            ctl._record(start + i, results)
        except (WorkerLost, WorkerFailed) as exc:
            failed = failed or exc
        ctl.outer.note_sends(start + i + 1, results, received)
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
