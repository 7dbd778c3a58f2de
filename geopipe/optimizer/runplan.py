"""The one planning function: spec + measurements + overrides → the plan the run executes.

``geopipe plan``, ``geopipe launch --dry-run`` and ``geopipe launch`` all call
:func:`plan_run`, so what the first two print is what the third runs: the search, the
pinning of ``schedule: auto`` to the family the search chose, the launch-time mix of
templates when identical pipelines would leave devices idle, and (``plan.strategy`` outer
or auto) the strategy table that picks between the pipeline across sites and an outer loop
between replica groups. Pure: no Ray, no torch; a launch measures first
(:mod:`geopipe.optimizer.measurements`) and passes what it measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from geopipe.config import ClusterSpec
from geopipe.optimizer.errors import PlanningError
from geopipe.optimizer.evaluate import Candidate, Evaluation, Evaluator
from geopipe.optimizer.measurements import Measurements, costed
from geopipe.optimizer.outerplan import OuterRun, outer_run
from geopipe.optimizer.penalty import PenaltyModel, load_penalty
from geopipe.optimizer.planner import PlanReport, plan_cluster
from geopipe.optimizer.strategy import StrategyReport, as_pipeline, plan_strategy
from geopipe.plan import Plan

__all__ = [
    "Overrides",
    "RunPlan",
    "candidate_of",
    "mixed_at_launch",
    "plan_run",
    "repriced",
    "with_overrides",
]


# The launch-time mix is searched on clusters up to this many devices (mixed_at_launch).
MIX_MAX_DEVICES = 64


@dataclass(frozen=True)
class Overrides:
    """What the command line (or a caller) sets over the YAML for this run."""

    steps: int | None = None  # --steps: where this launch stops (never the LR horizon)
    schedule: str | None = None  # --schedule
    plan: Plan | None = None  # run this plan instead of searching one

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.steps is not None:
            out["steps"] = self.steps
        if self.schedule is not None:
            out["schedule"] = self.schedule
        if self.plan is not None:
            out["plan"] = "fixed by the caller"
        return out


@dataclass(frozen=True)
class RunPlan:
    """The plan a run executes and its prediction under the measurements it was made with;
    ``report`` is the search behind it (None for a plan the caller fixed), ``mixed`` says
    that the launch-time mix replaced the search's identical pipelines."""

    plan: Plan
    predicted: Evaluation
    report: PlanReport | None = None
    mixed: bool = False
    strategy: StrategyReport | None = None  # plan.strategy outer or auto: every candidate
    outer: OuterRun | None = None  # the outer loop chosen, as launch runs it (plan is its)
    outer_refused: str | None = None  # why launch cannot run the outer loop chosen


def with_overrides(spec: ClusterSpec, overrides: Overrides) -> ClusterSpec:
    """``spec`` with the command line's ``--steps`` and ``--schedule`` applied: the settings
    the run executes. The spec as loaded stays the run's identity (config hash)."""
    updates: dict[str, Any] = {}
    if overrides.steps is not None:
        updates["training"] = spec.training.model_copy(update={"steps": overrides.steps})
    if overrides.schedule is not None:
        updates["plan"] = spec.plan.model_copy(update={"schedule": overrides.schedule})
    return spec.model_copy(update=updates) if updates else spec


def plan_run(
    spec: ClusterSpec,
    measured: Measurements | None = None,
    overrides: Overrides | None = None,
    exhaustive: bool = False,
    record: bool = False,
    penalty: PenaltyModel | None = None,
    strict: bool = True,
    source: str | None = None,
) -> RunPlan:
    """The plan the run will execute. ``spec`` is the YAML as loaded; the search prices with
    ``measured`` in the place of the YAML's nominal figures. Raises :class:`PlanningError`
    when nothing feasible exists. The plan carries the schedule family the search chose, so
    nothing downstream needs ``auto`` pinned in a spec. ``penalty``: the loss-penalty model
    (default: the shipped, measured table; :func:`~geopipe.optimizer.penalty.load_penalty`).
    ``strict=False`` (``geopipe plan``) returns an infeasible search for the caller to show
    instead of raising. ``source`` names the YAML in a ConfigError (default: the run's name)."""
    overrides = overrides or Overrides()
    priced = costed(with_overrides(spec, overrides), measured or Measurements())
    fixed = overrides.plan
    if fixed is not None:
        ev = Evaluator(priced, schedule=fixed.schedule)
        return RunPlan(fixed, ev.evaluate(candidate_of(fixed), record=record))
    pipeline = as_pipeline(priced)
    report = plan_cluster(pipeline, exhaustive=exhaustive, record=record)
    strategy = None
    if priced.plan.strategy != "pipeline":
        strategy = plan_strategy(
            priced, report, penalty or load_penalty(), source=source or spec.name
        )
    if strategy is not None and strategy.chosen.kind != "pipeline":
        return _outer(priced, report, strategy)
    if not report.best.feasible:
        if not strict:
            return RunPlan(report.best.plan, report.best, report, strategy=strategy)
        raise PlanningError(f"no feasible plan for {spec.name}: {report.best.reason}")
    mixed = mixed_at_launch(pipeline, report.best)
    if mixed is not None:
        return RunPlan(mixed.plan, mixed, report, mixed=True, strategy=strategy)
    return RunPlan(report.best.plan, report.best, report, strategy=strategy)


def repriced(
    spec: ClusterSpec, measured: Measurements, overrides: Overrides, rp: RunPlan
) -> Evaluation:
    """The launch's prediction for ``rp`` once its real links are measured (``measured``).

    A pipeline is evaluated again as placed, with the links it now knows. A mix keeps its
    own prediction (its pipelines' evaluation is not one pipeline's), and so does an outer
    run: its placed plan priced as one pipeline is not its cost (one group's inner steps
    without the rounds' exchange, or infeasible), so the launch's forecast had dropped the
    WAN from every outer run on a real network (0.056 s a step predicted against 0.089 s
    measured at 10 Mbit/s and 80 ms on the test bed). An outer run's links between groups
    are not probed (only a pipeline's WAN boundaries are), and its calibration prices the
    rounds it runs (:mod:`geopipe.runtime.control.outercal`)."""
    if rp.outer is not None or rp.plan.heterogeneous:
        return rp.predicted
    return plan_run(spec, measured, replace(overrides, plan=rp.plan)).predicted


def _outer(spec: ClusterSpec, report: PlanReport, strategy: StrategyReport) -> RunPlan:
    """The chosen outer loop as launch runs it, its prediction per inner step (a round's
    time over H: what the progress line and calibration compare with), or the reason the
    runtime cannot run it."""
    chosen = strategy.chosen
    try:
        run = outer_run(spec, chosen)
    except PlanningError as exc:
        return RunPlan(
            report.best.plan, report.best, report, strategy=strategy, outer_refused=str(exc)
        )
    tokens = spec.training.global_batch_size * run.plan.seq_len
    predicted = replace(
        chosen.evaluations[0],
        plan=run.plan,
        iteration_time_s=run.round_s / run.h,
        tokens_per_iteration=tokens,
        reason=f"{chosen.label} (outer loop, H={run.h})",
    )
    return RunPlan(run.plan, predicted, report, strategy=strategy, outer=run)


def mixed_at_launch(spec: ClusterSpec, best: Evaluation) -> Evaluation | None:
    """When the planner's identical pipelines leave devices idle (uneven device counts),
    a mix of templates over all devices if it is predicted ``plan.min_gain.mixed_pipelines``
    faster (:func:`geopipe.optimizer.mixes.best_mix`); its prediction, else None. Clusters
    of more than :data:`MIX_MAX_DEVICES` devices keep identical pipelines: the template
    search over every device vector grows too fast for a planner that must answer in
    seconds (512 devices: more than ten minutes)."""
    from geopipe.optimizer.mixes import best_mix
    from geopipe.optimizer.templates import build_templates

    plan = best.plan
    devices = {s.name: s.devices for s in spec.sites}
    used = {s: sum(1 for key in plan.actors() if plan.site_of(*key) == s) for s in devices}
    if used == devices or sum(devices.values()) > MIX_MAX_DEVICES:
        return None
    ts = build_templates(spec, plan=plan)
    gb = spec.training.global_batch_size
    mix = best_mix(ts, devices, gb, plan.micro_batch_size, running=plan)
    gain = spec.plan.min_gain.mixed_pipelines
    if mix is None or not mix.iteration_time_s < (1 - gain) * best.iteration_time_s:
        return None
    return Evaluation(
        candidate=replace(best.candidate, pipelines=mix.plan.pipelines),
        plan=mix.plan,
        feasible=True,
        iteration_time_s=mix.iteration_time_s,
        tokens_per_iteration=best.tokens_per_iteration,
        reason="a mix of pipeline templates over all devices (bubble and memory: per "
        "template, `geopipe plan --templates`)",
    )


def candidate_of(plan: Plan) -> Candidate:
    """The planner's candidate that ``plan`` is (to evaluate it under other costs)."""
    wan = plan.wan_boundaries
    return Candidate(
        pipelines=plan.pipelines,
        micro_batch_size=plan.micro_batch_size,
        seq_len=plan.seq_len,
        delta_n=tuple(plan.delta_n[j] for j in wan),
        codecs=tuple(plan.codecs[j] for j in wan),
        schedule=plan.schedule,
    )
