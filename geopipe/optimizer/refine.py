"""Re-choose ΔN from measured stage times (pure; the controller calls it after step 0).

The planner's compute model is nominal (FLOPs × device speed). Once the stages have run one
iteration, their measured forward/backward times replace it and ΔN — the only knob that
does not change how the actors are laid out — is re-chosen on the same simulator.
"""

from __future__ import annotations

from dataclasses import replace

from geopipe.config import ClusterSpec
from geopipe.optimizer.costs import split_backward
from geopipe.optimizer.evaluate import Evaluator, plan_schedule
from geopipe.optimizer.memory import W_HELD_FRACTION, device_limits, plan_memory, stages_over
from geopipe.optimizer.simulator import PipelineCosts, simulate
from geopipe.pipeline.schedule import LOOKAHEAD_FAMILIES
from geopipe.plan import Plan

__all__ = ["measured_costs", "pessimistic", "predict", "refine_delta_n"]


def measured_costs(
    spec: ClusterSpec,
    plan: Plan,
    fwd_s: list[float],
    bwd_s: list[float],
    step_s: list[float] | None = None,
    split_s: tuple[list[float], list[float]] | None = None,
) -> PipelineCosts:
    """The plan's costs with compute (and optionally step) times replaced by measurements.

    ``split_s``: measured ``(I, W)`` per stage for split schedules; without it a measured
    backward is split as the nominal cost model splits it."""
    base = Evaluator(spec, schedule=plan.schedule).costs(plan)
    if split_s is not None:
        inp, wgt = tuple(split_s[0]), tuple(split_s[1])
    else:
        parts = [split_backward(b, first=k == 0) for k, b in enumerate(bwd_s)]
        inp, wgt = tuple(i for i, _ in parts), tuple(w for _, w in parts)
    return replace(
        base,
        fwd_s=tuple(fwd_s),
        bwd_s=tuple(bwd_s),
        step_s=tuple(step_s) if step_s is not None else base.step_s,
        inp_s=inp,
        wgt_s=wgt,
    )


def pessimistic(costs: PipelineCosts, compute: float = 0.6, latency: float = 1.25) -> PipelineCosts:
    """Costs under which a ΔN is harder to make sufficient: faster stages, slower links."""
    return replace(
        costs,
        fwd_s=tuple(x * compute for x in costs.fwd_s),
        bwd_s=tuple(x * compute for x in costs.bwd_s),
        inp_s=tuple(x * compute for x in costs.inp_s),
        wgt_s=tuple(x * compute for x in costs.wgt_s),
        lat_f=tuple(x * latency for x in costs.lat_f),
        lat_b=tuple(x * latency for x in costs.lat_b),
    )


def predict(plan: Plan, costs: PipelineCosts) -> float:
    return simulate(plan_schedule(plan), costs).iteration_time_s


def _fits(spec: ClusterSpec, plan: Plan) -> bool:
    sched = plan_schedule(plan)
    mem = plan_memory(spec, plan, sched.peak_held(W_HELD_FRACTION))
    return not stages_over(mem, device_limits(spec, plan.stage_sites))


def refine_delta_n(
    spec: ClusterSpec, plan: Plan, costs: PipelineCosts, candidates: list[int]
) -> tuple[Plan, float]:
    """Coordinate descent over ΔN per WAN boundary: fastest, then smallest, that fits."""
    if plan.schedule not in LOOKAHEAD_FAMILIES or not plan.wan_boundaries:
        return plan, predict(plan, costs)
    best, best_t = plan, predict(plan, costs)
    changed = True
    while changed:
        changed = False
        for j in plan.wan_boundaries:
            for v in sorted(set(candidates)):
                dn = list(best.delta_n)
                dn[j] = min(v, plan.num_microbatches)
                trial = replace(best, delta_n=tuple(dn))
                if trial == best or not _fits(spec, trial):
                    continue
                t = predict(trial, costs)
                better = t < best_t * (1 - 1e-9)
                tie_smaller = abs(t - best_t) <= best_t * 1e-9 and dn[j] < best.delta_n[j]
                if better or tie_smaller:
                    best, best_t, changed = trial, t, True
    return best, best_t
