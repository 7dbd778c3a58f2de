"""Plan the run the controller launches: profile this machine, then search (or evaluate the
plan the caller fixed) with the planner."""

from __future__ import annotations

from typing import Any

from geopipe.config import ClusterSpec, Range
from geopipe.optimizer.evaluate import Candidate, Evaluation, Evaluator
from geopipe.optimizer.planner import plan_cluster
from geopipe.plan import Plan
from geopipe.runtime.calibration import profile_machine, should_profile
from geopipe.runtime.cluster import LaunchError

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
    return spec, report.best.plan, report.best


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
