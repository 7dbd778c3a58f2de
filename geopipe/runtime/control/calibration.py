"""Calibration: the planner predicts the run it will actually see.

Two measurements feed the planner's cost model:

* before planning, on the embedded cluster, a quick single-threaded profile of the model
  on this machine replaces the YAML's nominal device speed (:func:`profile_machine`; on a
  real cluster the YAML's numbers stand unless ``plan.calibrate`` says otherwise);
* after every step, the stages' measured forward/backward times and the transport's delay
  beyond the link model (the emulator's stamps, or on real links the data plane's stamped
  send and arrival times) replace the nominal costs, the same simulator the planner uses
  predicts the next step, and over a layout's first steps ΔN — the one knob that changes
  only the action lists, not the actors — is re-chosen (:class:`Calibrator`); an outer-loop
  run's forecast is the planner's price of a round fed with its measured group steps and
  driver calls instead (:mod:`geopipe.runtime.control.outercal`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from geopipe.config import ClusterSpec, choice_values
from geopipe.model.sizes import layer_forward_flops
from geopipe.optimizer.costs import split_backward
from geopipe.optimizer.measurements import DeviceSpeed, Measurements
from geopipe.optimizer.refine import measured_costs, pessimistic, predict, refine_delta_n
from geopipe.optimizer.simulator import PipelineCosts
from geopipe.pipeline.schedule import LOOKAHEAD_FAMILIES, SPLIT_FAMILIES
from geopipe.plan import Plan
from geopipe.runtime.actor.executor import IterationResult
from geopipe.runtime.control.outercal import OuterCalibrator
from geopipe.transport.codec import measure_speeds
from geopipe.transport.wire import codec_pair

__all__ = [
    "Calibration",
    "Calibrator",
    "boundary_offsets",
    "fifo_excess",
    "fit_forward",
    "measured_split_times",
    "measured_stage_times",
    "profile_machine",
    "searched_codecs",
    "should_profile",
    "with_real_transport",
    "with_transport_overhead",
]

CALIBRATION_STEPS = 3  # steps of a layout that record events and write `calibrated` events
DELTA_N_STEPS = 2  # ΔN is (re)chosen after each of a layout's first steps
WINDOW = 3  # the prediction uses the measurements of this many latest steps


# -- before planning: this machine's speed -----------------------------------------------------
def should_profile(spec: ClusterSpec) -> bool:
    c = spec.plan.calibrate
    return spec.ray.address == "local" if c is None else c


def _measure(
    spec: ClusterSpec, micro_batch: int, seq_len: int, reps: int = 5
) -> tuple[float, float]:
    """Median seconds of one forward and one backward of the whole model, one thread."""
    import torch

    from geopipe.model.family import DTYPES, build_stage
    from geopipe.runtime.control.models import model_desc

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        desc = model_desc(spec.model)
        model = build_stage(desc, 0, desc.num_layers, seed=spec.training.seed, load_weights=False)
        model.to(DTYPES[spec.training.precision])
        x = torch.randint(0, desc.vocab_size, (micro_batch, seq_len))
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


def searched_codecs(spec: ClusterSpec) -> list[str]:
    """Every codec the plan search may put on a boundary in either direction."""
    settings = spec.plan.codecs or [lk.codec for lk in spec.links]
    return sorted({c for setting in settings for c in codec_pair(setting)} - {"none"})


def profile_machine(
    spec: ClusterSpec, micro_batch: int, seq_len: int, largest: int | None = None
) -> Measurements:
    """Every site's compute speed and the codec speeds, as measured on this machine (the
    embedded cluster's sites all run here); :func:`~geopipe.optimizer.measurements.costed`
    puts them in the cost model's place of the YAML's nominal figures.

    With ``largest`` (the largest micro-batch the plan may choose; at most 64, or 8 x
    ``micro_batch`` if more) the model is timed at
    two micro-batch sizes and the forward time fitted as ``layers x overhead + size x
    per-sample`` (:func:`fit_forward`): the per-sample slope gives the efficiency, the
    intercept each layer's fixed cost per micro-batch (kernel launches, Python). Timed at
    one size, every micro-batch size looked equally efficient and the planner chose the
    smallest, which on this machine's demo job ran 1.6x slower per sample than 8."""
    f, b = _measure(spec, micro_batch, seq_len)
    per_sample, overhead = f / micro_batch, 0.0
    other = min(largest or 0, max(8, micro_batch) * 8)
    if other > micro_batch:
        f2, _ = _measure(spec, other, seq_len)
        from geopipe.runtime.control.models import model_desc

        # the layers the timed model was built of (what the evaluator charges per layer)
        layers = model_desc(spec.model).num_layers
        per_sample, overhead = fit_forward((micro_batch, f), (other, f2), layers)
    speeds = measure_speeds(searched_codecs(spec), (micro_batch, seq_len, spec.model.n_embd))
    flops = sum(layer_forward_flops(spec.model, seq_len)) * seq_len  # per sample
    devices = {}
    for s in spec.sites:
        eff = flops / per_sample / (s.device_tflops * 1e12)
        if not 0 < eff <= 1:  # the nominal peak was wrong: keep the measured speed anyway
            devices[s.name] = DeviceSpeed(1.0, b / f, flops / per_sample / 1e12, overhead)
        else:
            devices[s.name] = DeviceSpeed(eff, b / f, None, overhead)
    return Measurements(devices=devices, codecs={s.name: dict(speeds) for s in spec.sites})


def fit_forward(
    small: tuple[int, float], large: tuple[int, float], layers: int
) -> tuple[float, float]:
    """``(seconds per sample, fixed seconds per layer per micro-batch)`` of the line through
    two timed forwards ``(micro-batch size, seconds)``; a fit the timings' noise bends out
    of shape (a negative slope or intercept) keeps the small size's figure alone and no
    overhead (the planner as before)."""
    (b1, f1), (b2, f2) = small, large
    slope = (f2 - f1) / (b2 - b1)
    fixed = f1 - slope * b1
    if slope <= 0 or fixed <= 0:
        return f1 / b1, 0.0
    return slope, fixed / layers


# -- while training: the measured steps ---------------------------------------------------------
def measured_stage_times(
    results: list[IterationResult], num_stages: int
) -> tuple[list[float], list[float], list[float]]:
    """Mean forward and backward seconds per micro-batch per stage, and each stage's extra
    time at the end of the step, from the replicas' step breakdowns (always reported, so
    every step calibrates, not only the ones that record events).

    Handing a tensor to a link (``send``) runs on the compute thread between computations,
    so it is folded into the computation before it: a forward on stages that send
    activations, a backward on stages that send gradients (half each in between). The end
    of the step — ZeRO-1 reduction and optimizer, the boundary snapshot, bookkeeping — is
    the simulator's ``step_s``. Means, not medians: the simulator adds the times up, so
    occasional slow operations (a GC pause, a busy core) belong in the figure.
    """
    fwd: list[list[float]] = [[] for _ in range(num_stages)]
    bwd: list[list[float]] = [[] for _ in range(num_stages)]
    end: list[list[float]] = [[] for _ in range(num_stages)]
    for r in results:
        k, b, m = r.stage, r.breakdown, max(1, r.micro_batches)
        share_f = 0.0 if k == num_stages - 1 else (1.0 if k == 0 else 0.5)
        send = b.get("send", 0.0)
        fwd[k].append((b.get("forward", 0.0) + share_f * send) / m)
        bwd[k].append((b.get("backward", 0.0) + (1 - share_f) * send) / m)
        end[k].append(b.get("optimizer", 0.0) + b.get("snapshot", 0.0) + b.get("other", 0.0))
    return (
        [statistics.mean(x) for x in fwd],
        [statistics.mean(x) for x in bwd],
        [statistics.mean(x) if x else 0.0 for x in end],
    )


def measured_split_times(
    results: list[IterationResult], num_stages: int
) -> tuple[list[float], list[float]] | None:
    """Mean ``I`` and ``W`` seconds per stage from recorded events, or None without any
    ``I`` event. (No ``W`` carries the optimizer step: the runtime steps after the sends,
    [Note: the step after the sends] in :mod:`geopipe.runtime.actor.engine`.)"""
    inp: list[list[float]] = [[] for _ in range(num_stages)]
    wgt: list[list[float]] = [[] for _ in range(num_stages)]
    for r in results:
        inp[r.stage] += [t1 - t0 for kind, _, t0, t1 in r.events if kind == "I"]
        wgt[r.stage] += [t1 - t0 for kind, _, t0, t1 in r.events if kind == "W"]
    if not any(inp):
        return None
    return (
        [statistics.mean(x) if x else 0.0 for x in inp],
        [statistics.mean(x) if x else 0.0 for x in wgt],
    )


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


def fifo_excess(stamps: list[tuple[float, float]], ser_s: float, lat_s: float) -> list[float]:
    """How much later than the link model each message became usable.

    ``stamps`` are ``(sent, usable)`` on one clock, of one link direction in one step. The
    model is the simulator's: a FIFO server taking ``ser_s`` per message, then ``lat_s``.
    """
    out, free = [], float("-inf")
    for sent, usable in sorted(stamps):
        free = max(sent, free) + ser_s
        out.append(usable - (free + lat_s))
    return out


def with_real_transport(
    costs: PipelineCosts,
    results: list[IterationResult],
    plan: Plan,
    offsets: dict[int, float],
) -> PipelineCosts:
    """On real links: each WAN hop's latency becomes what the stamped messages took beyond
    their serialisation (probe's latency + the mean excess over the FIFO model).

    ``offsets[j]`` is the clock offset across boundary ``j`` (downstream minus upstream,
    from the launch-time probe); boundaries without one keep the probe's latency.
    """
    lat_f, lat_b = list(costs.lat_f), list(costs.lat_b)
    ex_f: dict[int, list[float]] = {}
    ex_b: dict[int, list[float]] = {}
    for r in results:
        k = r.stage
        fwd, bwd = r.transport_stamps.get("F", []), r.transport_stamps.get("B", [])
        if fwd and k > 0 and (k - 1) in offsets:
            off = offsets[k - 1]  # sent on stage k-1's clock, usable on stage k's
            st = [(s + off, u) for _, s, u in fwd]
            ex_f.setdefault(k - 1, []).extend(fifo_excess(st, costs.ser_f[k - 1], lat_f[k - 1]))
        if bwd and k < plan.num_stages - 1 and k in offsets:
            off = offsets[k]  # sent on stage k+1's clock, usable on stage k's
            st = [(s - off, u) for _, s, u in bwd]
            ex_b.setdefault(k, []).extend(fifo_excess(st, costs.ser_b[k], lat_b[k]))
    for j, xs in ex_f.items():
        lat_f[j] = max(0.0, costs.lat_f[j] + statistics.mean(xs))
    for j, xs in ex_b.items():
        lat_b[j] = max(0.0, costs.lat_b[j] + statistics.mean(xs))
    return replace(costs, lat_f=tuple(lat_f), lat_b=tuple(lat_b))


def boundary_offsets(plan: Plan, measured: list[Any]) -> dict[int, float]:
    """Clock offset per WAN boundary of ``plan`` from the launch-time link measurements."""
    by_pair = {(m.src, m.dst): m.clock_offset_s for m in measured}
    out = {}
    for j in plan.wan_boundaries:
        a, b = plan.stage_sites[j], plan.stage_sites[j + 1]
        if (a, b) in by_pair:
            out[j] = by_pair[(a, b)]
        elif (b, a) in by_pair:
            out[j] = -by_pair[(b, a)]
    return out


@dataclass(frozen=True)
class Calibration:
    """The outcome of one calibration step: the plan to run next and its prediction."""

    plan: Plan
    predicted_s: float
    event: dict[str, Any] | None  # the ``calibrated`` metrics event (first steps only)


class Calibrator:
    """Predicts each step from the measurements of the steps before it.

    ΔN — the one knob that changes only the action lists, not the actors — is chosen after
    each of a layout's first :data:`DELTA_N_STEPS` steps from that step's measurements, for
    pessimistic costs (stages twice as fast, links 25 % slower than measured): too small a
    ΔN exposes the whole round trip, one too large only holds a few more activations. The
    first step runs cold (allocations, first-touch), so the second decides. From then on ΔN
    stays and every step re-predicts from the last :data:`WINDOW` steps under it: stage
    times on a shared host move with its load, and a prediction from the first steps alone
    drifts from what later steps see. Link costs: the probe's (real links) or the YAML's
    (emulated), plus what the stamped messages took beyond that model.
    """

    def __init__(
        self,
        spec: ClusterSpec,
        fixed_plan: bool,
        predicted_s: float,
        links: list | None = None,
        outer: Any = None,
    ) -> None:
        """``outer``: an outer-loop run's driver half (:class:`~geopipe.runtime.control.
        outerloop.OuterRounds`), whose steps :class:`OuterCalibrator` forecasts."""
        self.spec = spec
        self.fixed_plan = fixed_plan  # the plan was given: ΔN stays within its own values
        self.predicted_s = predicted_s
        self.calibrated = False  # predicted_s comes from measured times
        self.links = list(links or [])  # launch-time link measurements (clock offsets)
        self._base = 0  # first step of the current layout
        self._pool: list[list[IterationResult]] = []
        self.costs: PipelineCosts | None = None  # the latest calibrated costs
        self._shares: list[float] = []  # each stage's I share of a split backward
        self.outer = OuterCalibrator(spec, outer.run, outer) if outer is not None else None

    def restart(self, step: int) -> None:
        """A new layout (recovery, grow-back) from ``step`` on: measure it afresh."""
        self._base = step
        self._pool = []
        self._shares = []
        self.calibrated = False
        if self.outer is not None:
            self.outer.restart(step)

    def wants(self, step: int) -> bool:
        """Whether ``step``'s events are recorded (the first steps' timelines)."""
        return step - self._base < CALIBRATION_STEPS

    def observe(self, step: int, plan: Plan, results: list[IterationResult]) -> Calibration:
        i = step - self._base
        if self.outer is not None:  # a mix of replica groups: priced as the planner prices it
            got = self.outer.observe(step, plan, results, self.predicted_s)
            if got is None:
                return Calibration(plan, self.predicted_s, None)
            self.predicted_s, self.calibrated = got[0], True
            fresh = i < CALIBRATION_STEPS or self.outer.closed
            return Calibration(plan, got[0], got[1] if fresh else None)
        choose = i < DELTA_N_STEPS
        # Pool only steps run under the ΔN in force: after a choice, start afresh.
        self._pool = [] if choose else [*self._pool, results][-WINDOW:]
        cal = self._calibrate(plan, self._pool or [results], choose_delta_n=choose)
        return cal if i < CALIBRATION_STEPS else replace(cal, event=None)

    def _costs(self, plan: Plan, steps: list[list[IterationResult]]) -> PipelineCosts:
        """Stage times: per step the mean (the simulator adds them up), then the median
        over the window's steps, so one step slowed by another process does not move the
        prediction of the next; transport delays pooled over the window."""
        per_step = [measured_stage_times(rs, plan.num_stages) for rs in steps]
        fwd, bwd, step_t = (
            [statistics.median(col) for col in zip(*(t[i] for t in per_step), strict=True)]
            for i in range(3)
        )
        split = None
        if plan.schedule in SPLIT_FAMILIES:
            shares = self._input_shares(plan, steps)
            split = (
                [s * b for s, b in zip(shares, bwd, strict=True)],
                [(1 - s) * b for s, b in zip(shares, bwd, strict=True)],
            )
        costs = measured_costs(self.spec, plan, fwd, bwd, step_t, split)
        pooled = [r for rs in steps for r in rs]
        costs = with_transport_overhead(costs, pooled, plan)
        return with_real_transport(costs, pooled, plan, boundary_offsets(plan, self.links))

    def _input_shares(self, plan: Plan, steps: list[list[IterationResult]]) -> list[float]:
        """Each stage's ``I`` share of its backward: from the timelines of the steps that
        recorded one (the first of a layout), kept for the steps after; until then the
        cost model's split (:func:`~geopipe.optimizer.costs.split_backward`)."""
        measured = measured_split_times([r for rs in steps for r in rs], plan.num_stages)
        if measured is not None:
            self._shares = [
                i / (i + w) if i + w > 0 else 0.0 for i, w in zip(*measured, strict=True)
            ]
        if len(self._shares) != plan.num_stages:
            parts = [split_backward(1.0, first=k == 0) for k in range(plan.num_stages)]
            self._shares = [i / (i + w) for i, w in parts]
        return self._shares

    def _calibrate(
        self, plan: Plan, steps: list[list[IterationResult]], choose_delta_n: bool
    ) -> Calibration:
        costs = self.costs = self._costs(plan, steps)
        cands = choice_values(self.spec.plan.delta_n, default=[0], powers_of_two=False)
        if self.fixed_plan or plan.schedule not in LOOKAHEAD_FAMILIES:
            cands = sorted({plan.delta_n[j] for j in plan.wan_boundaries} or {0})
        new = plan
        if choose_delta_n:
            new, _ = refine_delta_n(self.spec, plan, pessimistic(costs, compute=0.5), cands)
        t = predict(new, costs)
        self.predicted_s = t
        self.calibrated = True
        event = {
            "forward_s": list(costs.fwd_s),
            "backward_s": list(costs.bwd_s),
            "step_s": list(costs.step_s),
            **(
                {"input_s": list(costs.inp_s), "weight_s": list(costs.wgt_s)}
                if plan.schedule in SPLIT_FAMILIES
                else {}
            ),
            "link_latency_s": {"forward": list(costs.lat_f), "backward": list(costs.lat_b)},
            "delta_n": list(new.delta_n),
            "previous_delta_n": list(plan.delta_n),
            "predicted_iteration_time_s": t,
        }
        return Calibration(new, t, event)
