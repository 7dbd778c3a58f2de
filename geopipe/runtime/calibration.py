"""Calibration: the planner predicts the run it will actually see.

Two measurements feed the planner's cost model:

* before planning, on the embedded cluster, a quick single-threaded profile of the model
  on this machine replaces the YAML's nominal device speed (:func:`profile_machine`; on a
  real cluster the YAML's numbers stand unless ``plan.calibrate`` says otherwise);
* over the first steps of a layout, the stages' measured forward/backward times and the
  transport's delay beyond the link model replace the nominal costs, and ΔN — the one
  knob that changes only the action lists, not the actors — is re-chosen
  (:class:`Calibrator`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from geopipe.config import ClusterSpec, choice_values
from geopipe.model.sizes import layer_forward_flops, num_layers
from geopipe.optimizer.refine import measured_costs, pessimistic, predict, refine_delta_n
from geopipe.optimizer.simulator import PipelineCosts
from geopipe.pipeline.schedule import LOOKAHEAD_FAMILIES
from geopipe.plan import Plan
from geopipe.runtime.executor import IterationResult

__all__ = [
    "Calibration",
    "Calibrator",
    "measured_split_times",
    "measured_stage_times",
    "profile_machine",
    "should_profile",
    "with_transport_overhead",
]

CALIBRATION_STEPS = 3  # steps of a layout whose measurements re-calibrate the prediction


# -- before planning: this machine's speed -----------------------------------------------------
def should_profile(spec: ClusterSpec) -> bool:
    c = spec.plan.calibrate
    return spec.ray.address == "local" if c is None else c


def _measure(
    spec: ClusterSpec, micro_batch: int, seq_len: int, reps: int = 5
) -> tuple[float, float]:
    """Median seconds of one forward and one backward of the whole model, one thread."""
    import torch

    from geopipe.model.gpt import GPTConfig, GPTStage

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = spec.model
        cfg = GPTConfig(m.n_layer, m.n_embd, m.n_head, m.vocab_size, m.max_seq_len)
        model = GPTStage(cfg, 0, num_layers(cfg.n_layer), seed=spec.training.seed)
        x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
        fwd, bwd = [], []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            out = model(x)
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        fwd, bwd = sorted(fwd[1:]), sorted(bwd[1:])
        return fwd[reps // 2], bwd[reps // 2]
    finally:
        torch.set_num_threads(threads)


def profile_machine(spec: ClusterSpec, micro_batch: int, seq_len: int) -> ClusterSpec:
    """A copy of ``spec`` whose sites compute at the measured speed of this machine."""
    f, b = _measure(spec, micro_batch, seq_len)
    flops = sum(layer_forward_flops(spec.model, seq_len)) * micro_batch * seq_len
    sites = []
    for s in spec.sites:
        eff = flops / f / (s.device_tflops * 1e12)
        if not 0 < eff <= 1:  # the nominal peak was wrong: keep the measured speed anyway
            sites.append(
                s.model_copy(
                    update={"device_tflops": flops / f / 1e12, "device_efficiency": 1.0,
                            "backward_forward_ratio": b / f}
                )
            )  # fmt: skip
        else:
            sites.append(
                s.model_copy(update={"device_efficiency": eff, "backward_forward_ratio": b / f})
            )
    return spec.model_copy(update={"sites": sites})


# -- while training: the measured steps ---------------------------------------------------------
def measured_stage_times(
    results: list[IterationResult], num_stages: int
) -> tuple[list[float], list[float], list[float]]:
    """Mean forward and backward seconds per stage from recorded events, and the extra time
    of each stage's last backward (it runs the ZeRO-1 reduction and the optimizer step).
    With a split backward the backward is ``I`` + ``W`` and the last ``W`` carries the step.

    Means, not medians: the simulator adds the times up, so occasional slow operations
    (a GC pause, a busy core) belong in the figure.
    """
    fwd, full, inp, wgt, extra = _samples(results, num_stages)
    bwd = [
        statistics.mean(inp[k]) + statistics.mean(wgt[k] or [0.0])
        if inp[k]
        else statistics.mean(full[k])
        for k in range(num_stages)
    ]
    return (
        [statistics.mean(x) for x in fwd],
        bwd,
        [statistics.mean(x) if x else 0.0 for x in extra],
    )


def measured_split_times(
    results: list[IterationResult], num_stages: int
) -> tuple[list[float], list[float]] | None:
    """Mean ``I`` and ``W`` seconds per stage (each step's last ``W``, which carries the
    optimizer step, left out), or None when the schedule did not split the backward."""
    _, _, inp, wgt, _ = _samples(results, num_stages)
    if not any(inp):
        return None
    return (
        [statistics.mean(x) if x else 0.0 for x in inp],
        [statistics.mean(x) if x else 0.0 for x in wgt],
    )


def _samples(results: list[IterationResult], num_stages: int) -> tuple[list[list[float]], ...]:
    """Per stage: F, B, I and W durations (B and W without each step's last one), and how much
    longer each step's last B or W took than the others (the optimizer step)."""
    out: dict[str, list[list[float]]] = {k: [[] for _ in range(num_stages)] for k in "FBIW"}
    extra: list[list[float]] = [[] for _ in range(num_stages)]
    for r in results:
        k = r.stage
        for kind, acc in out.items():
            d = [t1 - t0 for kk, _, t0, t1 in r.events if kk == kind]
            if kind in "BW" and len(d) > 1:
                acc[k] += d[:-1]
                extra[k].append(max(0.0, d[-1] - statistics.mean(d[:-1])))
            else:
                acc[k] += d
    return out["F"], out["B"], out["I"], out["W"], extra


def with_transport_overhead(
    costs: PipelineCosts, results: list[IterationResult], plan: Plan
) -> PipelineCosts:
    """Add the real transport's mean delay beyond the emulated link to each WAN hop
    (serialising, the transport itself, decoding: what the link model alone lacks)."""
    lat_f, lat_b = list(costs.lat_f), list(costs.lat_b)
    fwd: dict[int, list[float]] = {}
    bwd: dict[int, list[float]] = {}
    for r in results:  # pooled over every replica (and step) of a stage
        fwd.setdefault(r.stage, []).extend(r.transport_excess_s.get("F", []))
        bwd.setdefault(r.stage, []).extend(r.transport_excess_s.get("B", []))
    for k, xs in fwd.items():
        if xs and k > 0:
            lat_f[k - 1] = costs.lat_f[k - 1] + statistics.mean(xs)
    for k, xs in bwd.items():
        if xs and k < plan.num_stages - 1:
            lat_b[k] = costs.lat_b[k] + statistics.mean(xs)
    return replace(costs, lat_f=tuple(lat_f), lat_b=tuple(lat_b))


@dataclass(frozen=True)
class Calibration:
    """The outcome of one calibration step: the plan to run next and its prediction."""

    plan: Plan
    predicted_s: float
    event: dict[str, Any]  # the ``calibrated`` metrics event


class Calibrator:
    """Pools the first :data:`CALIBRATION_STEPS` steps of each layout and re-predicts.

    After the first step ΔN is chosen for pessimistic costs (stages 40 % faster, links 25 %
    slower than measured): too small a ΔN exposes the whole round trip, one too large only
    holds a few more activations. The following steps, run under that ΔN, only update the
    prediction: stage times depend on how busy the machine is, which depends on the
    schedule.
    """

    def __init__(self, spec: ClusterSpec, fixed_plan: bool, predicted_s: float) -> None:
        self.spec = spec
        self.fixed_plan = fixed_plan  # the plan was given: ΔN stays within its own values
        self.predicted_s = predicted_s
        self.calibrated = False  # predicted_s comes from measured times
        self._base = 0  # first step of the current layout
        self._pool: list[IterationResult] = []

    def restart(self, step: int) -> None:
        """A new layout (recovery, grow-back) from ``step`` on: measure it afresh."""
        self._base = step
        self._pool = []
        self.calibrated = False

    def wants(self, step: int) -> bool:
        """Whether ``step``'s measurements are needed (the executor then records events)."""
        return step - self._base < CALIBRATION_STEPS

    def observe(self, step: int, plan: Plan, results: list[IterationResult]) -> Calibration:
        first = step == self._base
        # After ΔN is chosen (first step), pool the following steps' measurements.
        self._pool = [] if first else [*self._pool, *results]
        return self._calibrate(plan, self._pool or results, choose_delta_n=first)

    def _calibrate(
        self, plan: Plan, results: list[IterationResult], choose_delta_n: bool
    ) -> Calibration:
        fwd, bwd, step_t = measured_stage_times(results, plan.num_stages)
        split = measured_split_times(results, plan.num_stages)
        costs = measured_costs(self.spec, plan, fwd, bwd, step_t, split)
        costs = with_transport_overhead(costs, results, plan)
        cands = choice_values(self.spec.plan.delta_n, default=[0], powers_of_two=False)
        if self.fixed_plan or plan.schedule not in LOOKAHEAD_FAMILIES:
            cands = sorted({plan.delta_n[j] for j in plan.wan_boundaries} or {0})
        new = plan
        if choose_delta_n:
            new, _ = refine_delta_n(self.spec, plan, pessimistic(costs), cands)
        t = predict(new, costs)
        self.predicted_s = t
        self.calibrated = True
        event = {
            "forward_s": fwd,
            "backward_s": bwd,
            "step_s": step_t,
            **({"input_s": split[0], "weight_s": split[1]} if split else {}),
            "link_latency_s": {"forward": list(costs.lat_f), "backward": list(costs.lat_b)},
            "delta_n": list(new.delta_n),
            "previous_delta_n": list(plan.delta_n),
            "predicted_iteration_time_s": t,
        }
        return Calibration(new, t, event)
