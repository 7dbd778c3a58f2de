"""Re-choose ΔN from measured stage times (pure; the controller calls it after step 0).

The planner's compute model is nominal (FLOPs × device speed). Once the stages have run one
iteration, their measured forward/backward times replace it and ΔN — the only knob that
does not change how the actors are laid out — is re-chosen on the same simulator.
"""

from __future__ import annotations

from dataclasses import replace

from geopipe.config import ClusterSpec
from geopipe.optimizer import steady
from geopipe.optimizer.costs import split_backward
from geopipe.optimizer.evaluate import (
    Evaluator,
    peak_if_fits,
    plan_schedule,
)
from geopipe.optimizer.lean import lean_descent, tie_limit
from geopipe.optimizer.simulator import PipelineCosts, simulate
from geopipe.pipeline.schedule import LOOKAHEAD_FAMILIES, SPLIT_FAMILIES
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
    if plan.schedule in SPLIT_FAMILIES:  # the plan's own lists (caps), replayed in full
        return simulate(plan_schedule(plan), costs).iteration_time_s
    args = (plan.schedule, plan.num_stages, plan.num_microbatches, plan.delta_n)
    return steady.predict(*args, costs).iteration_time_s


def _memory(spec: ClusterSpec, plan: Plan) -> float | None:
    """Total peak bytes over the stages (ΔN changes only the activations), None if it does
    not fit."""
    mem = peak_if_fits(spec, plan)
    return None if mem is None else sum(mb.total for mb in mem)


def refine_delta_n(
    spec: ClusterSpec, plan: Plan, costs: PipelineCosts, candidates: list[int]
) -> tuple[Plan, float]:
    """ΔN per WAN boundary for ``costs``: coordinate descent to the fastest that fits, then
    ([Note: lean ties]) the least memory whose time stays within the tie tolerance of it."""
    if plan.schedule not in LOOKAHEAD_FAMILIES or not plan.wan_boundaries:
        return plan, predict(plan, costs)
    values = sorted({min(v, plan.num_microbatches) for v in candidates})
    best, best_t = plan, predict(plan, costs)
    changed = True
    while changed:
        changed = False
        for j in plan.wan_boundaries:
            for v in values:
                trial = _with(best, j, v)
                if trial == best or _memory(spec, trial) is None:
                    continue
                t = predict(trial, costs)
                if t < best_t * (1 - 1e-9):
                    best, best_t, changed = trial, t, True
    limit = tie_limit(best_t)
    lean = {"t": best_t, "mem": _memory(spec, best)}

    def accept(dn: list[int]) -> bool:  # fits, holds less, and stays within the tolerance
        trial = replace(best, delta_n=tuple(dn))
        mem = _memory(spec, trial)
        if mem is None or (lean["mem"] is not None and mem >= lean["mem"]):
            return False
        t = predict(trial, costs)
        if t <= limit:
            lean.update(t=t, mem=mem)
        return t <= limit

    dn = lean_descent(
        best.delta_n, plan.wan_boundaries, lambda _, v: [x for x in values if x < v], accept
    )
    return replace(best, delta_n=tuple(dn)), lean["t"]


def _with(plan: Plan, j: int, v: int) -> Plan:
    dn = list(plan.delta_n)
    dn[j] = v
    return replace(plan, delta_n=tuple(dn))
