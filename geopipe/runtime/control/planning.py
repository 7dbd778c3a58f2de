"""Plan the run the controller launches: profile this machine, then search (or evaluate the
plan the caller fixed) with the planner."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from geopipe.config import ClusterSpec, Range
from geopipe.optimizer.evaluate import Candidate, Evaluation, Evaluator
from geopipe.optimizer.planner import plan_cluster
from geopipe.pipeline.schedule import AUTO
from geopipe.plan import Plan
from geopipe.runtime.control.calibration import profile_machine, should_profile
from geopipe.runtime.control.cluster import LaunchError

__all__ = ["candidate_of", "plan_run"]


def plan_run(spec: ClusterSpec, fixed: Plan | None) -> tuple[ClusterSpec, Plan, Evaluation]:
    """``(spec, plan, prediction)``; the spec comes back with the measured device speed when
    the run profiles this machine (``plan.calibrate``)."""
    if should_profile(spec):
        b = fixed.micro_batch_size if fixed else max(1, _first(spec.plan.micro_batch_size))
        s = fixed.seq_len if fixed else _first(spec.plan.seq_len, spec.model.max_seq_len)
        spec = profile_machine(spec, b, s)
    if fixed is not None:
        ev = Evaluator(spec, schedule=fixed.schedule)
        return spec, fixed, ev.evaluate(candidate_of(fixed))
    report = plan_cluster(spec)
    if not report.best.feasible:
        raise LaunchError(f"no feasible plan for {spec.name}: {report.best.reason}")
    if spec.plan.schedule == AUTO:  # from here on the run is on the schedule chosen
        chosen = spec.plan.model_copy(update={"schedule": report.best.plan.schedule})
        spec = spec.model_copy(update={"plan": chosen})
    mixed = mixed_at_launch(spec, report.best)
    if mixed is not None:
        return spec, mixed.plan, mixed
    return spec, report.best.plan, report.best


def mixed_at_launch(spec: ClusterSpec, best: Evaluation) -> Evaluation | None:
    """When the planner's identical pipelines leave devices idle (uneven device counts),
    a mix of templates over all devices if it is predicted ``plan.min_gain.mixed_pipelines`` faster
    (:func:`geopipe.optimizer.policies.best_layout`); its prediction, else None."""
    from geopipe.optimizer.mixes import best_mix
    from geopipe.optimizer.templates import build_templates

    plan = best.plan
    devices = {s.name: s.devices for s in spec.sites}
    used = {s: sum(1 for key in plan.actors() if plan.site_of(*key) == s) for s in devices}
    if used == devices:
        return None
    ts = build_templates(spec, plan=plan)
    gb = spec.training.global_batch_size
    mix = best_mix(ts, devices, gb, plan.micro_batch_size, running=plan)
    gain = spec.plan.min_gain.mixed_pipelines
    if mix is None or not mix.iteration_time_s < (1 - gain) * best.iteration_time_s:
        return None
    return Evaluation(
        candidate=replace(best.candidate, pipelines=mix.plan.pipelines), plan=mix.plan,
        feasible=True, iteration_time_s=mix.iteration_time_s,
        tokens_per_iteration=best.tokens_per_iteration,
        reason="a mix of pipeline templates over all devices (bubble and memory: per "
        "template, `geopipe plan --templates`)",
    )  # fmt: skip


def candidate_of(plan: Plan) -> Candidate:
    """The planner's candidate that ``plan`` is (to evaluate it under other costs)."""
    wan = plan.wan_boundaries
    return Candidate(
        plan.pipelines, plan.micro_batch_size, plan.seq_len,
        tuple(plan.delta_n[j] for j in wan), tuple(plan.codecs[j] for j in wan), plan.schedule,
    )  # fmt: skip


def _first(choice: Any, default: int = 1) -> int:
    """The first value a plan knob may take (a fixed int, a list, or a range)."""
    if choice is None:
        return default
    if isinstance(choice, int):
        return choice
    if isinstance(choice, list):
        return choice[0]
    if isinstance(choice, Range):
        return max(1, choice.min)
    return default


def with_overrides(spec: ClusterSpec, steps: int | None, schedule: str | None) -> ClusterSpec:
    """``spec`` with the command line's ``--steps`` and ``--schedule`` applied."""
    updates: dict[str, Any] = {}
    if steps is not None:
        updates["training"] = spec.training.model_copy(update={"steps": steps})
    if schedule is not None:
        updates["plan"] = spec.plan.model_copy(update={"schedule": schedule})
    return spec.model_copy(update=updates) if updates else spec
