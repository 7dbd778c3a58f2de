"""Calibration of an outer-loop run: its forecast per inner step is the planner's own price of
a round (:func:`geopipe.optimizer.outer_cost.price_round`), fed with what the run measures.

An outer run's plan is a mix of replica groups, which the pipeline calibration
(:class:`~geopipe.runtime.control.calibration.Calibrator`) does not replay; without this its
forecast stayed the planner's nominal one (0.06-0.24 s against 0.20-0.56 s measured on the
test bed). After every inner step :class:`OuterCalibrator` measures

* each group's inner step: the slowest of its replicas' steps (``duration_s``: the group's
  stages wait for each other inside a step), the mean over the latest :data:`STEPS` steps;
  the slowest group's, as the exchange sees it: over each stretch of inner steps between
  two points where the driver acts (an outer apply, a checkpoint, an evaluation) the groups
  run their spans side by side and the driver waits for the last, so per step the largest
  of the groups' summed steps, over the latest stretches that hold :data:`STEPS` steps and
  whole apply periods ([Note: whole periods of stretches]) (on
  a shared host the groups' steps jitter apart, and the larger of two sums exceeds the
  larger of two means);
* the driver's seconds per control call: over each *stretch*, the wall time the driver saw
  (from recording the stretch's last step to recording the previous one's) less the
  slowest group's steps, less the price of the applies made in it (exposed transfer, codec,
  outer step: the exposure measured, the rest modelled from the measured links and step),
  less the round trip its steps waited through (what the link model gives for the round
  trip to the farthest group: none for a span queued behind the one before), over the calls
  it took. A stretch is one span (:mod:`.innerrun`: its applies are made inside it); on the
  per-step path (``max_span`` 0) the steps between two applies, the apply that opened it
  made by the driver. Stretches opened by a checkpoint or an evaluation are left out (the
  forecast does not price them, as the pipeline's does not).

* the exposed transfer of an apply: what the rounds waited for the payloads, the mean over
  the latest :data:`EXPOSED_ROUNDS` rounds (OuterRounds' ``outer_round`` rows,
  ``exposed_s``: the wait of the group that came last), once a round of the present layout
  is applied; the link model's before. On a real network the model leaves out what
  TCP adds to a transfer that starts after a round's idle time (its congestion window
  restarts from slow start: ~0.4 s more per round at 10 Mbit/s and 80 ms), so the modelled
  figure under-forecast the test bed's steps by 6-16 %. The layout's first round counts
  only until a later one is measured ([Note: the layout's first round runs cold]);

and prices the round with them, the spans counted as the runtime makes them (the same
:func:`~geopipe.optimizer.outer_cost.steps_per_call`): ``predicted_s = round_s / H``. Links
are the costed spec's: probed at launch on real networks, the YAML's on emulated ones.

[Note: the layout's first round runs cold]
A layout's first round waits longer than the rounds after it on every test-bed regime that
is not bandwidth-bound: 0.96 s, then 0.44 and 0.44 (50 Mbit/s, 40 ms, H = 50); 0.73, then
0.38-0.20 (H = 1); 2.38, then 1.22 and 1.92 (10 Mbit/s, 80 ms); 0.27, then 0.00-0.07
(streaming) -- the first use of the exchange's connections and code paths, as the layout's
first step runs cold. So the first round counts only until a later one is measured. With
it in the mean, the forecast after the first round was 21 % high over the next span
(0.114 s per step against 0.094; run g, 50:40), and the run's forecast 13.5 %.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from geopipe.config import ClusterSpec
from geopipe.optimizer.evaluate import Evaluation
from geopipe.optimizer.outer_cost import (
    OUTER_CALLS_PER_FRAGMENT,
    Control,
    RoundCost,
    planned_control,
    price_round,
    queues_spans,
    span_cap,
)
from geopipe.optimizer.outerplan import OuterRun
from geopipe.outer.fragments import StreamingSchedule
from geopipe.plan import Plan

__all__ = ["STEPS", "OuterCalibrator"]

STEPS = 20  # measured figures: over this many latest steps (whole stretches, at least one)
RECORDED = 3  # a layout's first steps run one per call (they record events: innerrun)
EXPOSED_ROUNDS = 3  # the exposed transfer: the mean over this many latest rounds' applies


@dataclass(frozen=True)
class _Seen:
    at: float  # when the driver recorded the step (its clock)
    group_s: dict[int, float]  # each group's inner step: its slowest replica's


def group_sites(plan: Plan) -> dict[int, tuple[str, ...]]:
    """Each replica group's sites, in its pipelines' stage order."""
    out: dict[int, dict[str, None]] = {}
    for r in range(plan.pipelines):
        sites = plan.mix[r].stage_sites if plan.mix else plan.stage_sites
        out.setdefault(plan.group_of(r), {}).update(dict.fromkeys(sites))
    return {g: tuple(s) for g, s in out.items()}


class OuterCalibrator:
    """The forecast of an outer run's inner step from its measured steps (module docstring).
    ``rounds`` is the driver's outer loop (:class:`~geopipe.runtime.control.outerloop.
    OuterRounds`: its ``max_span`` says how many steps a call runs at most: None for
    :data:`~geopipe.optimizer.outer_cost.SPAN_S` seconds of steps, 0 for one)."""

    def __init__(self, spec: ClusterSpec, run: OuterRun, rounds: Any = None) -> None:
        s = run.setting
        self.spec, self.run, self.rounds = spec, run, rounds
        self.schedule = StreamingSchedule(s.h, s.fragments, s.overlap)
        self.cost: RoundCost | None = None  # the latest calibrated round
        self.closed = False  # the latest step ended a stretch (its event is worth writing)
        self.restart(0)

    def restart(self, step: int) -> None:
        """A new layout (a group lost or grown back) from ``step`` on: measure it afresh."""
        self._base = step
        # the present layout's rounds: OuterRounds' record of applies from this row on
        self._rounds_from = len(getattr(self.rounds, "rounds", None) or [])
        self._seen: dict[int, _Seen] = {}  # the steps of the stretch under way
        self._warm: deque[dict[int, float]] = deque(maxlen=STEPS)  # each group's step
        self._mark: int | None = None  # the last step of the latest stretch
        # per stretch: (seconds beyond compute and the apply, calls, compute seconds, steps,
        # the calls whose round trip the steps waited through, the inner steps done when it
        # began); enough of them for an apply period of one-step spans
        self._units: deque[tuple[float, float, float, int, int, int]] = deque(
            maxlen=STEPS + self.schedule.period
        )

    # -- the runtime's calls ---------------------------------------------------------------
    def _cap(self, predicted_s: float) -> int:
        span = getattr(self.rounds, "max_span", None)
        if span == 0:
            return 1
        return span if span else span_cap(predicted_s)

    def _acts(self, done: int) -> str | None:
        """What the driver does after ``done`` inner steps that bounds a stretch: a
        checkpoint or an evaluation (``other``); the end of the span being recorded
        (``span``); on the per-step path, an apply (``apply``)."""
        t = self.spec.training
        ev = t.eval.every_steps if t.eval is not None else 0
        if (t.checkpoint.every_steps and done % t.checkpoint.every_steps == 0) or (
            ev and done % ev == 0
        ):
            return "other"
        span = self._span()
        if span is not None:
            return "span" if done == span[1] else None
        return "apply" if self.schedule.applies_at(done) is not None else None

    def _span(self) -> tuple[int, int, bool] | None:
        """The span the driver is recording (first step, end, whether it was queued), or
        None on the per-step path (``OuterRounds.recording``)."""
        return getattr(self.rounds, "recording", None)

    def _calls(self, first: int, last: int, cap: int) -> tuple[int, int]:
        """The calls that ran steps ``first..last`` (a recorded step alone, the rest in spans
        of at most ``cap``), and those whose round trip the steps waited through: each one
        alone and the first span (the others were queued behind it), or every call when
        each runs one step."""
        alone = sum(1 for s in range(first, last + 1) if s - self._base < RECORDED)
        rest = last - first + 1 - alone
        calls = alone + -(-rest // cap)
        return calls, calls if cap == 1 else alone + min(1, rest)

    # -- measuring and pricing ---------------------------------------------------------------
    def observe(
        self,
        step: int,
        plan: Plan,
        results: list[Any],
        predicted_s: float,
        now: float | None = None,
    ) -> tuple[float, dict[str, Any]] | None:
        """Step ``step``'s results, recorded by the driver at ``now``: the next forecast per
        inner step and the ``calibrated`` event's fields, or None before a warm step."""
        now = time.perf_counter() if now is None else now
        per: dict[int, float] = {}
        for r in results:
            # a result's replica is its actor's launch position (the survivors of a lost
            # group keep theirs; ``plan`` lists only them): its group is the launch plan's
            g = self.run.plan.group_of(r.replica)
            per[g] = max(per.get(g, 0.0), r.duration_s)
        self._seen[step] = _Seen(now, per)
        if not self.run.evaluations:  # an outer run made without the strategy table's plans
            return None
        if self._mark is None:  # the layout's first step runs cold: the reference only
            self._mark = step
            return None
        self._warm.append(per)
        cap = self._cap(predicted_s)
        groups, evals = self._groups(plan)
        self.closed = self._acts(step + 1) is not None  # a stretch ends: a new measurement
        if self.closed:
            self._close(step, cap, groups, evals)
            groups, evals = self._groups(plan)
        control = self._control(groups, evals, cap)
        self.cost = cost = self._price(groups, evals, control)
        t = cost.round_s / self.run.h
        event = {
            "step": step,
            "outer": True,
            "group_step_s": [e.iteration_time_s for e in evals],
            "call_s": control.call_s,
            "calls_measured": sum(u[1] for u in self._latest()),
            "round": cost.to_json(),
            "predicted_iteration_time_s": t,
        }
        return t, event

    def _groups(self, plan: Plan) -> tuple[list[tuple[str, ...]], list[Evaluation]]:
        """The live groups' sites (the planner's tuples) and evaluations carrying each group's
        measured inner step."""
        runs = zip(self.run.groups, self.run.evaluations, strict=True)
        planned = {frozenset(g): (g, e) for g, e in runs}
        groups, evals = [], []
        for g, sites in sorted(group_sites(plan).items()):
            sites_, ev = planned.get(frozenset(sites), (sites, self.run.evaluations[0]))
            got = [w[g] for w in self._warm if g in w]
            groups.append(sites_)
            evals.append(replace(ev, iteration_time_s=statistics.mean(got)) if got else ev)
        units = self._latest()
        if units:  # the slowest group as the exchanges see it (module docstring)
            slow = max(range(len(evals)), key=lambda i: evals[i].iteration_time_s)
            step = sum(u[2] for u in units) / sum(u[3] for u in units)
            evals[slow] = replace(evals[slow], iteration_time_s=step)
        return groups, evals

    def _price(self, groups: list, evals: list[Evaluation], control: Control) -> RoundCost:
        """The round priced with the measured figures, its exposed transfer the latest
        round's as the appliers waited for it (module docstring) once one is applied."""
        cost = price_round(self.spec, groups, evals, self.run.setting, control)
        f = self.run.setting.fragments
        rows = (getattr(self.rounds, "rounds", None) or [])[self._rounds_from :]
        mine = [r["exposed_s"] for r in rows if r["groups"] == len(groups)]
        if len(mine) >= 2 * f:  # [Note: the layout's first round runs cold]
            mine = mine[f:]
        # the latest EXPOSED_ROUNDS rounds' applies: one round's exposure moves a lot (a
        # transfer after idle restarts TCP's window; a shared host), their mean much less
        latest = mine[-f * EXPOSED_ROUNDS :]
        if len(groups) < 2 or len(latest) < f:  # nothing exchanged, or no round measured
            return cost
        return replace(cost, exposed_s=f * sum(latest) / len(latest))

    def _latest(self) -> list[tuple[float, float, float, int, int, int]]:
        """The latest measured stretches that hold :data:`STEPS` steps and whole apply
        periods, at least one: from an apply point to the latest apply point a stretch ended
        at (the latest that hold :data:`STEPS` steps while there are none).

        [Note: whole periods of stretches] What the stretches do not explain (the driver's
        calls, and what an apply costs beyond its measured wait: at 1 Mbit/s the driver's
        calls to the far group queue behind a payload on the same link) falls in the
        stretches that hold an apply. Measured over the latest 20 steps alone, the overhead
        per call swung with whether an apply's stretch was among them (0.16 s a call, then
        1.4 s after an apply, at 1 Mbit/s and 80 ms, spans of 12 steps, H = 50), and so did
        the forecast (0.30, then 0.40 s a step, against 0.34 measured): the run's forecast
        was 11 % low. Spans end at apply points ([Note: spans end at applies] in
        :mod:`.innerrun`), so stretches from one on hold each apply once."""
        period, units = self.schedule.period, list(self._units)
        ends = [i for i, u in enumerate(units) if (u[5] + u[3]) % period == 0]
        for i in reversed(ends):  # the latest whole periods that hold enough steps
            held = 0
            for j in range(i, -1, -1):
                held += units[j][3]
                if held >= max(STEPS, period) and units[j][5] % period == 0:
                    return units[j : i + 1][::-1]
        out: list[tuple[float, float, float, int, int, int]] = []
        for u in reversed(units):
            if sum(x[3] for x in out) >= STEPS:
                break
            out.append(u)
        return out

    def _close(self, last: int, cap: int, groups: list, evals: list[Evaluation]) -> None:
        """The stretch ``mark + 1 .. last`` is done: its seconds per call (module docstring)."""
        first, mark = self._mark + 1, self._mark
        self._mark = last
        opened = self._acts(first)
        steps = [self._seen.get(s) for s in range(first, last + 1)]
        if opened == "other" or mark not in self._seen or None in steps:
            return
        wall = self._seen[last].at - self._seen[mark].at
        compute = max(sum(w.group_s.get(g, 0.0) for w in steps) for g in steps[-1].group_s)
        calls, waits = self._calls(first, last, cap)
        span = self._span()
        if span is not None:  # one call, its applies inside: waited on unless queued
            calls, waits = 1, 0 if span[2] else 1
            applies = sum(
                1 for s in range(first, last + 1) if self.schedule.applies_at(s + 1) is not None
            )
        else:
            applies = 1 if opened == "apply" else 0
        if not queues_spans([e.plan for e in evals]):
            waits = calls
        outer = 0.0
        if applies:  # their exposed transfer, codec and outer step, as priced
            c = self._price(groups, evals, Control(0.0, 0.0))
            f = self.run.setting.fragments
            outer = applies * (c.exposed_s + c.codec_s + c.outer_step_s) / f
            calls += applies * OUTER_CALLS_PER_FRAGMENT
            waits += applies * OUTER_CALLS_PER_FRAGMENT
        self._units.append((wall - compute - outer, calls, compute, last - mark, waits, first))
        for s in [s for s in self._seen if s < mark]:
            del self._seen[s]

    def _control(self, groups: list, evals: list[Evaluation], cap: int) -> Control:
        """The runtime's calls: measured seconds each once a stretch is (else the planner's)."""
        step = max(e.iteration_time_s for e in evals)
        queued = queues_spans([e.plan for e in evals])
        planned = planned_control(self.spec, groups, self.run.setting, step, cap=cap, queued=queued)
        units = self._latest()
        if not units:
            return planned
        seconds, calls = sum(u[0] for u in units), sum(u[1] for u in units)
        waits = sum(u[4] for u in units)
        overhead = max(0.0, (seconds - waits * planned.rtt_s) / calls)
        return replace(planned, overhead_s=overhead)
