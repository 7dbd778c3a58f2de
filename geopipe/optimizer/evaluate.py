"""Candidate -> plan -> simulated iteration time, memory and feasibility.

:class:`Evaluator` is the fitness function of the search: it turns a candidate (pipelines,
micro-batch, sequence length, ΔN and codec per WAN boundary) into a :class:`Plan`, builds
the costs the simulator needs from the cluster spec (:mod:`geopipe.optimizer.pipecosts`)
and replays the schedule. Schedules,
partitions and whole evaluations are cached, because the genetic search revisits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from geopipe.config import ClusterSpec, GiB, choice_values
from geopipe.optimizer.costs import boundary_message_elems
from geopipe.optimizer.errors import PlanningError
from geopipe.optimizer.lean import TIE_TOLERANCE, lean_tie
from geopipe.optimizer.memory import (
    W_HELD_FRACTION,
    MemoryBreakdown,
    device_limits,
    plan_memory,
    snapshot_bytes,
    stages_over,
)
from geopipe.optimizer.pipecosts import pipeline_costs, wan_bytes
from geopipe.optimizer.shapes import build_plan, candidate_shapes
from geopipe.optimizer.simulator import (
    PipelineCosts,
    SimResult,
    in_flight_bound,
    lower_bound,
    simulate,
)
from geopipe.optimizer.steady import peak_in_flight, predict
from geopipe.pipeline.schedule import (
    AUTO,
    AUTO_CHOICES,
    IN_ORDER_FAMILIES,
    LOOKAHEAD_FAMILIES,
    SPLIT_FAMILIES,
    Schedule,
    make_schedule,
)
from geopipe.plan import Plan, Shape
from geopipe.transport.wire import (
    MAX_TOPK_NUMEL,
    codec_pair,
    pair_name,
)

__all__ = [
    "TIE_TOLERANCE",
    "Candidate",
    "Evaluation",
    "Evaluator",
    "SearchSpace",
    "choose",
    "plan_schedule",
]

INFEASIBLE = 1e3  # fitness floor for infeasible candidates (feasible ones are s/token ≪ 1)
# A link busier than this (mean of both directions) leaves no headroom for retransmissions.
MAX_LINK_UTILIZATION = 0.95


@dataclass(frozen=True)
class Candidate:
    pipelines: int
    micro_batch_size: int
    seq_len: int
    delta_n: tuple[int, ...]  # one per WAN boundary, in pipeline order
    codecs: tuple[str, ...]  # one per WAN boundary
    schedule: str = "lookahead"


@dataclass
class Evaluation:
    candidate: Candidate
    plan: Plan | None
    feasible: bool
    reason: str
    iteration_time_s: float = math.inf
    tokens_per_iteration: int = 0
    bubble_ratio: float = 1.0
    memory: list[MemoryBreakdown] = field(default_factory=list)
    memory_limit_bytes: list[float] = field(default_factory=list)
    # Host RAM per node of each site for the recovery snapshots, and its limit (if known).
    host_memory_bytes: dict[str, float] = field(default_factory=dict)
    host_memory_limit_bytes: dict[str, float] = field(default_factory=dict)
    wan_bytes: float = 0.0
    link_utilization: list[float] = field(default_factory=list)
    sim: SimResult | None = None
    pruned: bool = False  # fitness is a lower bound (the search skipped simulating it)
    # The search skipped the simulation (pruned, or memory alone rules it out): the fitness
    # serves the search, but a plain evaluate() must simulate before reporting times.
    skipped_simulation: bool = False

    @property
    def tokens_per_s(self) -> float:
        t = self.iteration_time_s
        return self.tokens_per_iteration / t if t > 0 and math.isfinite(t) else 0.0

    @property
    def device_utilization(self) -> float:
        """Share of the plan's device time spent computing: ``1 - bubble`` (every stage has
        ``D`` devices, so the bubble is already weighted by devices); 0 without a plan."""
        return 1.0 - self.bubble_ratio if self.plan is not None else 0.0

    @property
    def peak_memory_bytes(self) -> list[float]:
        return [mb.total for mb in self.memory]

    @property
    def activation_bytes(self) -> float:
        """Activation memory in flight at the peak, summed over the stages (one pipeline):
        what a larger ΔN costs (see [Note: lean ties])."""
        return sum(mb.activations for mb in self.memory)

    @property
    def fitness(self) -> float:
        """Seconds per token; infeasible candidates rank below every feasible one."""
        if self.plan is None:
            return INFEASIBLE * 10
        if not self.feasible:
            ratios = [
                *(
                    m / lim
                    for m, lim in zip(self.peak_memory_bytes, self.memory_limit_bytes, strict=True)
                ),
                *(
                    self.host_memory_bytes[s] / lim
                    for s, lim in self.host_memory_limit_bytes.items()
                ),
            ]
            over = max(ratios, default=1.0)
            return INFEASIBLE * (1.0 + over)
        return self.iteration_time_s / self.tokens_per_iteration

    def summary(self) -> dict:
        """The JSON fields `geopipe plan --json` and `geopipe simulate --json` print."""
        c = self.candidate
        return {
            "schedule": c.schedule,
            "pipelines": c.pipelines,
            "micro_batch_size": c.micro_batch_size,
            "seq_len": c.seq_len,
            "delta_n": list(c.delta_n),
            "codecs": list(c.codecs),
            "num_microbatches": self.plan.num_microbatches if self.plan else None,
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "bubble_ratio": self.bubble_ratio,
            "device_utilization": self.device_utilization,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_limit_bytes": self.memory_limit_bytes,
            "host_memory_bytes_per_node": self.host_memory_bytes,
            "host_memory_limit_bytes": self.host_memory_limit_bytes,
            "wan_bytes": self.wan_bytes,
            "link_utilization": self.link_utilization,
            "feasible": self.feasible,
            "reason": self.reason,
        }


def choose(evaluations: Iterable[Evaluation]) -> Evaluation | None:
    """The plan to run among ``evaluations`` ([Note: lean ties]).

    Among feasible, simulated ones: those within :data:`TIE_TOLERANCE` of the best fitness
    (seconds per token), the least activation memory in flight, then the faster, then the
    smaller ΔN. Without a
    feasible one, the least infeasible (lowest penalty). None for an empty input.
    """
    pool = [e for e in evaluations if not e.skipped_simulation or not e.feasible]
    ok = [e for e in pool if e.feasible]
    if not ok:
        return min(pool, key=lambda e: e.fitness, default=None)
    # Equal memory and time (ΔN the warm-up cap hides): the smaller ΔN, for a stable answer.
    return lean_tie(
        ok,
        lambda e: e.fitness,
        lambda e: e.activation_bytes,
        lambda e: (sum(e.candidate.delta_n), e.candidate.delta_n),
    )


def codec_space(settings: Sequence[str]) -> tuple[str, ...]:
    """Every boundary setting the search may choose from ``plan.codecs``: each direction on
    its own (activations and gradients tolerate different codecs, and a link's two
    directions may differ in speed), the settings as listed first."""
    fwd = dict.fromkeys(codec_pair(c)[0] for c in settings)
    bwd = dict.fromkeys(codec_pair(c)[1] for c in settings)
    pairs = [pair_name(f, b) for f in fwd for b in bwd]
    return tuple(dict.fromkeys([*settings, *pairs]))


def _memory_reason(e: Evaluation, over: list[int], host_over: list[str]) -> str:
    """Why ``e``'s plan does not fit: the first stage over its device, else the first site
    whose nodes cannot hold the recovery snapshots."""
    if over:
        k = over[0]
        return (
            f"stage {k} needs {e.memory[k].total / GiB:.3g} GiB, "
            f"device has {e.memory_limit_bytes[k] / GiB:.3g} GiB"
        )
    s = host_over[0]
    return (
        f"site {s}: recovery snapshots need {e.host_memory_bytes[s] / GiB:.3g} GiB of host "
        f"RAM per node, nodes have {e.host_memory_limit_bytes[s] / GiB:.3g} GiB (set "
        "training.recovery_snapshots: false to recover from checkpoints instead)"
    )


@dataclass(frozen=True)
class SearchSpace:
    """Candidate values of every gene; the search never leaves these lists."""

    pipelines: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]
    delta_ns: tuple[int, ...]
    codecs: tuple[str, ...]
    wan_boundaries: int
    schedule: str
    listed_codecs: int = 0  # codecs[:listed_codecs] as plan.codecs lists them (0: all)

    def valid(self, d: int, b: int, global_batch: int) -> bool:
        return global_batch % (d * b) == 0

    def size(self, global_batch: int) -> int:
        """Number of valid candidates (those whose batch divides)."""
        db = sum(
            1
            for d in self.pipelines
            for b in self.micro_batch_sizes
            if self.valid(d, b, global_batch)
        )
        w = self.wan_boundaries
        return db * len(self.seq_lens) * len(self.delta_ns) ** w * len(self.codecs) ** w


@lru_cache(maxsize=8192)
def _schedule(
    name: str, p: int, m: int, delta_n: tuple[int, ...], caps: tuple[int, ...] = ()
) -> Schedule:
    return make_schedule(name, p, m, delta_n, caps or None)


def plan_schedule(plan: Plan) -> Schedule:
    """The action lists ``plan`` runs (what the stage actors build from it too)."""
    return _schedule(
        plan.schedule, plan.num_stages, plan.num_microbatches, plan.delta_n, plan.inflight_caps
    )


def plan_peak_memory(spec: ClusterSpec, plan: Plan) -> list[MemoryBreakdown]:
    """Every stage's peak memory under ``plan``, with the activations its schedule holds in
    flight: a split backward's own lists (their caps come from device memory) counted in
    full, the other families by the steady-state count."""
    if plan.schedule in SPLIT_FAMILIES:
        in_flight: tuple[float, ...] = plan_schedule(plan).peak_held(W_HELD_FRACTION)
    else:
        args = (plan.schedule, plan.num_stages, plan.num_microbatches, plan.delta_n)
        in_flight = peak_in_flight(*args)
    return plan_memory(spec, plan, in_flight)


def peak_if_fits(spec: ClusterSpec, plan: Plan) -> list[MemoryBreakdown] | None:
    """Every stage's peak under ``plan`` if it fits its devices' memory, else None: the one
    feasibility rule for a plan (:func:`~geopipe.optimizer.memory.stages_over` on
    :func:`plan_peak_memory`), the peaks computed once for callers that need both."""
    mem = plan_peak_memory(spec, plan)
    return None if stages_over(mem, device_limits(spec, plan.stage_sites)) else mem


def fits(spec: ClusterSpec, plan: Plan) -> bool:
    """Whether ``plan`` fits its devices' memory (:func:`peak_if_fits`)."""
    return peak_if_fits(spec, plan) is not None


class Evaluator:
    """Scores candidates for one cluster spec (pure: no Ray, no DeepSpeed)."""

    def __init__(self, spec: ClusterSpec, schedule: str | None = None):
        self.spec = spec
        pl = spec.plan
        # A pipeline needs a device in every site: larger counts are never expanded.
        max_d = min(s.devices for s in spec.sites)
        d_vals = (
            choice_values(pl.pipelines, default=[], upper=max_d)
            if pl.pipelines is not None
            else None
        )
        self.shapes: dict[int, Shape] = {s.pipelines: s for s in candidate_shapes(spec, d_vals)}
        if not self.shapes:
            raise PlanningError(
                "no pipeline shape fits these sites: every site must host at least one stage"
            )
        any_shape = next(iter(self.shapes.values()))
        wan = len(any_shape.wan_boundaries)
        link_codecs = []
        for j in any_shape.wan_boundaries:
            lk = spec.link(any_shape.stage_sites[j], any_shape.stage_sites[j + 1])
            link_codecs.append(lk.codec if lk else "none")
        listed = tuple(dict.fromkeys(pl.codecs or link_codecs or ["none"]))
        codecs = codec_space(listed) if pl.codecs else listed
        sched = schedule or pl.schedule
        if sched == AUTO:  # chosen at the plan level (plan_cluster); templates, fixed
            sched = AUTO_CHOICES[0]  # evaluations and the like score plain look-ahead
        m = spec.model
        self.space = SearchSpace(
            pipelines=tuple(sorted(self.shapes)),
            micro_batch_sizes=tuple(
                choice_values(pl.micro_batch_size, default=[1], powers_of_two=True)
            ),
            seq_lens=tuple(
                v
                for v in choice_values(pl.seq_len, default=[m.max_seq_len], powers_of_two=True)
                if v <= m.max_seq_len
            ),
            delta_ns=tuple(choice_values(pl.delta_n, default=[0], powers_of_two=False))
            if sched in LOOKAHEAD_FAMILIES
            else (0,),
            codecs=codecs,
            wan_boundaries=wan,
            schedule=sched,
            listed_codecs=len(listed),
        )
        self._cache: dict[Candidate, Evaluation] = {}
        self.evaluations = 0  # distinct candidates scored
        self.best_fitness = math.inf  # best feasible fitness simulated so far (for pruning)

    # -- building blocks ---------------------------------------------------------------------
    def make_plan(self, c: Candidate) -> Plan | None:
        shape = self.shapes.get(c.pipelines)
        gbs = self.spec.training.global_batch_size
        if shape is None or gbs % (c.pipelines * c.micro_batch_size):
            return None
        p = shape.num_stages
        dn = [0] * (p - 1)
        codecs = ["none"] * (p - 1)
        for i, j in enumerate(shape.wan_boundaries):
            dn[j] = c.delta_n[i] if c.schedule in LOOKAHEAD_FAMILIES else 0
            codecs[j] = c.codecs[i]
        return build_plan(
            self.spec,
            shape.stage_sites,
            pipelines=c.pipelines,
            micro_batch_size=c.micro_batch_size,
            seq_len=c.seq_len,
            num_microbatches=gbs // (c.pipelines * c.micro_batch_size),
            schedule=c.schedule,
            delta_n=dn,
            codecs=codecs,
        )

    def unusable(self, plan: Plan) -> str:
        """Why ``plan`` cannot run whatever the memory (empty if it can)."""
        elems = boundary_message_elems(self.spec.model, plan.micro_batch_size, plan.seq_len)
        used = {c for j in plan.wan_boundaries for c in codec_pair(plan.codecs[j])}
        if elems > MAX_TOPK_NUMEL and "topk" in used:
            return (
                f"topk cannot encode a message of {elems:,} elements (int32 indices: at most "
                f"{MAX_TOPK_NUMEL:,})"
            )
        return ""

    def costs(self, plan: Plan) -> PipelineCosts:
        """Seconds per action for one pipeline of ``plan`` (:func:`pipeline_costs`)."""
        return pipeline_costs(self.spec, plan)

    # -- evaluation ----------------------------------------------------------------------------
    def host_memory(self, plan: Plan) -> tuple[dict[str, float], dict[str, float]]:
        """Host RAM per node the recovery snapshots take in each site (worst case: every
        device of the node runs a replica of the site's biggest stage), and the limits the
        YAML states. Nothing when snapshots are off."""
        spec = self.spec
        if not spec.training.recovery_snapshots:
            return {}, {}
        need: dict[str, float] = {}
        for k, site in enumerate(plan.stage_sites):
            b = snapshot_bytes(spec.model, plan.partition[k], spec.training.snapshots_kept)
            need[site] = max(need.get(site, 0.0), b * spec.site(site).devices_per_node)
        limits = {
            s: spec.site(s).host_memory_gb * GiB
            for s in need
            if spec.site(s).host_memory_gb is not None
        }
        return need, limits

    def evaluate(self, c: Candidate, record: bool = False, prune: bool = False) -> Evaluation:
        """Score ``c``. With ``prune`` (the searches), skip the simulation when memory already
        rules the candidate out or its lower bound loses to the best plan seen so far. Such
        entries are cached for the searches only: a plain call simulates them."""
        cached = None if record else self._cache.get(c)
        if cached is not None and (prune or not cached.skipped_simulation):
            return cached
        ev = self._evaluate(c, record, self.best_fitness if prune else None)
        if not record:
            self._cache[c] = ev
            if cached is None:  # re-simulating a skipped entry is not a new candidate
                self.evaluations += 1
            if ev.feasible and not ev.pruned and ev.fitness < self.best_fitness:
                self.best_fitness = ev.fitness
        return ev

    def _evaluate(self, c: Candidate, record: bool, prune_above: float | None) -> Evaluation:
        plan = self.make_plan(c)
        if plan is None:
            return Evaluation(
                c, None, False, "global batch not divisible by pipelines × micro-batch"
            )
        spec = self.spec
        why = self.unusable(plan)
        if why:
            return Evaluation(c, None, False, why)
        elems = boundary_message_elems(spec.model, plan.micro_batch_size, plan.seq_len)
        args = (plan.schedule, plan.num_stages, plan.num_microbatches, plan.delta_n)
        # Split backwards: the plan's own lists are replayed in full; the steady-state
        # shortcut covers the other families.
        split = plan.schedule in SPLIT_FAMILIES
        mem = plan_peak_memory(spec, plan)
        limits = device_limits(spec, plan.stage_sites)
        over = stages_over(mem, limits)
        host, host_limits = self.host_memory(plan)
        host_over = [s for s, lim in host_limits.items() if host[s] > lim]
        base = Evaluation(
            candidate=c,
            plan=plan,
            feasible=not over and not host_over,
            reason="ok",
            tokens_per_iteration=spec.training.global_batch_size * plan.seq_len,
            memory=mem,
            memory_limit_bytes=limits,
            host_memory_bytes=host,
            host_memory_limit_bytes=host_limits,
            wan_bytes=wan_bytes(spec, plan, elems),
        )
        if over or host_over:
            base.reason = _memory_reason(base, over, host_over)
            if prune_above is not None:
                base.skipped_simulation = True
                return base  # the penalty depends on memory only: no need to simulate
        costs = self.costs(plan)
        if prune_above is not None and not record:
            lb = lower_bound(costs, plan.num_microbatches, split)
            if plan.schedule in IN_ORDER_FAMILIES:  # too little ΔN shows here (simulator docs)
                peaks = np.array([peak_in_flight(*args)])
                lb = max(lb, float(in_flight_bound(costs, plan.num_microbatches, peaks)[0]))
            # Within the tie tolerance a slower plan may still win on memory: keep those.
            if lb / base.tokens_per_iteration > prune_above * (1 + TIE_TOLERANCE + 1e-6):
                base.iteration_time_s = lb
                base.pruned = base.skipped_simulation = True
                base.reason = "pruned: its lower bound is slower than the best plan found"
                return base
        if split:
            sim = simulate(plan_schedule(plan), costs, record=record)
        else:
            sim = predict(*args, costs, record=record)
        base.iteration_time_s = sim.iteration_time_s
        base.bubble_ratio = sim.bubble_ratio
        base.link_utilization = [
            sim.link_busy_s[j] / 2 / sim.iteration_time_s for j in plan.wan_boundaries
        ]
        base.sim = sim if record else None
        util = base.link_utilization
        if not over and util and max(util) > MAX_LINK_UTILIZATION:
            base.feasible = False
            base.reason = f"WAN link saturated ({max(util):.0%} busy)"
        return base
