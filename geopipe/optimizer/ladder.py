"""Predicting one pipeline layout through the planner's cost model, and the ΔN ladder it walks.

A *layout* is a tuple of stage sites (pipeline order) run as ``D`` identical pipelines of
``m`` micro-batches each. :class:`LayoutPredictor` scores layouts with the planner's own
:class:`~geopipe.optimizer.evaluate.Evaluator` (costs, memory model, simulator, feasibility
rules and cache); only the plan it builds differs (:class:`_LayoutEvaluator`).

[Note: what a prediction assumes] The micro-batch size, sequence length, schedule and the
codec of each WAN hop are fixed for a predictor (taken from the running plan, or the
YAML's defaults). ΔN per WAN boundary is searched per layout, because the right advance
depends on the stage sizes: the analytic estimate :func:`delta_n_estimate`
(``ceil(round trip / (t_f + t_b))`` of the upstream stage) overshoots (on the shipped
clusters the simulator's best is 1/8 to 1/2 of it, and the estimate itself predicts 25–30 %
slower), so a prediction walks the multiples :data:`DELTA_N_SCALES` of it from 1/4 while the
time improves, also tries the running plan's ΔN on its site pairs, and keeps the fastest
that fits in memory. Memory is checked where in-flight activations peak (``m ≥ p + ΣΔN``),
so a layout that fits, fits for any number of micro-batches. Times are the evaluator's,
exact at any ``m`` for a cost independent of ``m`` (:mod:`geopipe.optimizer.steady`, the one
steady-state extrapolation); the slope per extra micro-batch is measured over
:data:`SLOPE_SPAN` micro-batches.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from geopipe.config import ClusterSpec
from geopipe.optimizer.evaluate import Candidate, Evaluation, Evaluator
from geopipe.optimizer.lean import lean_tie
from geopipe.optimizer.memory import stages_over
from geopipe.optimizer.shapes import build_plan
from geopipe.optimizer.simulator import PipelineCosts, lower_bound
from geopipe.pipeline.schedule import LOOKAHEAD_FAMILIES
from geopipe.plan import Plan

__all__ = [
    "DELTA_N_SCALES",
    "SLOPE_SPAN",
    "LayoutCandidate",
    "LayoutPredictor",
    "Prediction",
    "delta_n_cover",
    "delta_n_estimate",
]

# Micro-batches over which a prediction's slope is measured: a multiple of every common
# steady-state period (see geopipe.optimizer.steady), so the slope is the steady state's.
SLOPE_SPAN = 12
# ΔN is searched over these multiples of the estimate, starting at index DELTA_N_START: on
# the shipped clusters the best lies between 1/8 and 1/2 of it.
DELTA_N_SCALES = (0.0, 0.125, 0.25, 0.5, 1.0)
DELTA_N_START = 2

Layout = tuple[str, ...]  # the site of each stage, in pipeline order


def delta_n_estimate(costs: PipelineCosts, j: int) -> int:
    """The analytic ΔN of boundary ``j``: enough micro-batches for the upstream stage's compute
    (``t_f + t_b``) to cover one round trip over the boundary — the activation's way there
    plus its gradient's way back, ``ceil((t_x,fwd + t_x,bwd) / (t_f + t_b))``.

    [Note: one ΔN estimate] The templates scale this (the genetic search starts from
    :func:`delta_n_cover`, which does not overshoot).
    The round trip is the sum of both directions, which differ when the codec or the link
    is asymmetric (top-k gradients, uneven links); twice the slower direction would overshoot
    there. On symmetric links the two agree.
    """
    rt = costs.ser_f[j] + costs.lat_f[j] + costs.ser_b[j] + costs.lat_b[j]
    return math.ceil(rt / max(costs.fwd_s[j] + costs.bwd_s[j], 1e-12))


def delta_n_cover(costs: PipelineCosts, wan: Sequence[int]) -> tuple[int, ...]:
    """The least ΔN per WAN boundary ``wan[i]`` with which the look-ahead steady state runs at
    the pipeline's pace; independent of the number of micro-batches.

    [Note: ΔN at the pipeline's pace] In the steady state the pipeline takes one
    micro-batch per period ``T``, its slowest server (a stage's ``c_k = t_f + t_b``, or one
    link direction's serialisation). Stage ``k`` runs rounds ``F w_k+g, B g`` with
    ``w_k - w_{k+1} = 1 + ΔN_k``. A micro-batch's forward from stage ``a`` down to stage
    ``z`` and its backward up again is a cycle of the schedule's dependency graph that
    spans ``z - a + 1 + Σ_{a≤k<z} ΔN_k`` rounds of stage ``a`` and takes
    ``Σ_{a..z} c_k`` plus both hops over every boundary between (serialisation and
    latency), so nothing waits iff for every span ``[a, z]``

        (z - a + 1 + Σ_{a≤k<z} ΔN_k) · T  ≥  Σ_{a≤k≤z} c_k + Σ_{a≤k<z} hop_k.

    Spans ending at the last stage give :func:`~geopipe.optimizer.simulator.in_flight_bound`'s
    condition; spans of two stages, the single boundary's. Only WAN boundaries have a ΔN
    to give: going through spans by their downstream end, each deficit goes to the most
    downstream WAN boundary of the span (it then also serves the spans after) — the greedy
    that covers intervals with the least total, as for interval covering (tested by brute
    force; and against replays: the slope of iteration time in ``m`` is ``T``, and one ΔN
    less at any boundary makes it larger). The simulator's best ΔN is
    this or next to it (its warm-up and cool-down also count); :func:`delta_n_estimate`,
    which covers each boundary's hops with the upstream stage's compute alone, overshoots
    2–8× on the shipped clusters. ``O(p²)``.
    """
    c = [x + y for x, y in zip(costs.fwd_s, costs.bwd_s, strict=True)]
    period = max([*c, *costs.ser_f, *costs.ser_b, 1e-12])
    hop = [sum(x) for x in zip(costs.ser_f, costs.lat_f, costs.ser_b, costs.lat_b, strict=True)]
    free = set(wan)
    dn = [0] * (len(c) - 1)
    for z in range(1, len(c)):
        work, given, target = c[z], 0, None
        for a in range(z - 1, -1, -1):
            work += c[a] + hop[a]
            given += dn[a]
            if target is None and a in free:
                target = a  # the span's most downstream WAN boundary
            # Relative slack: a span that exactly fills its rounds needs no more.
            need = math.ceil(work / period * (1 - 1e-12)) - (z - a + 1)
            if need > given and target is not None:
                dn[target] += need - given
                given = need
    return tuple(dn[j] for j in wan)


@dataclass(frozen=True)
class Prediction:
    """One layout (vector × pipelines × micro-batches) through the planner's cost model."""

    feasible: bool
    reason: str
    iteration_time_s: float
    delta_n: tuple[int, ...]  # one per stage boundary (0 inside a site)
    codecs: tuple[str, ...]  # one per stage boundary ("none" inside a site)
    peak_memory_bytes: tuple[float, ...]
    per_microbatch_s: float  # steady-state slope of iteration time in the micro-batch count


@dataclass(frozen=True)
class LayoutCandidate(Candidate):
    """A candidate whose plan is a given layout (the evaluator's cache keys on it)."""

    stage_sites: Layout = ()
    num_microbatches: int = 1
    partition: tuple[tuple[int, int], ...] = ()  # () = balanced for the sites' speeds


class _LayoutEvaluator(Evaluator):
    """The planner's Evaluator, scoring given layouts instead of its own shapes.

    Only :meth:`make_plan` changes: the costs, memory model, simulator, feasibility rules and
    cache are the planner's. It never prunes by fitness: layouts differ in their micro-batch
    counts, so seconds per token are not comparable between them.
    """

    @property
    def best_fitness(self) -> float:
        return math.inf

    @best_fitness.setter
    def best_fitness(self, value: float) -> None:
        del value

    def make_plan(self, c: Candidate) -> Plan | None:
        if not isinstance(c, LayoutCandidate):
            return super().make_plan(c)
        return build_plan(
            self.spec,
            c.stage_sites,
            pipelines=c.pipelines,
            micro_batch_size=c.micro_batch_size,
            seq_len=c.seq_len,
            num_microbatches=c.num_microbatches,
            schedule=c.schedule,
            delta_n=c.delta_n,
            codecs=c.codecs,
            partition=c.partition,
        )


class LayoutPredictor:
    """Predicts layouts at fixed micro-batch size, sequence length, schedule and WAN codecs.

    ``codecs`` and ``plan_delta_n`` map a site pair ``(a, b)`` (hop ``a -> b``) to its codec
    and to the running plan's ΔN there. ``partition_of`` gives a layout's layer ranges when
    they are not the balanced ones (templates of a mix: :mod:`geopipe.optimizer.mixes`).
    """

    def __init__(
        self,
        spec: ClusterSpec,
        micro_batch_size: int,
        seq_len: int,
        schedule: str,
        codecs: Mapping[tuple[str, str], str],
        plan_delta_n: Mapping[tuple[str, str], int] | None = None,
        partition_of: Callable[[Layout], tuple[tuple[int, int], ...]] | None = None,
    ) -> None:
        self.partition_of = partition_of
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.schedule = schedule
        self._codecs = dict(codecs)
        self._plan_delta_n = dict(plan_delta_n or {})
        self._ev = _LayoutEvaluator(spec, schedule=schedule)
        self._delta_ns = tuple(sorted(self._ev.space.delta_ns))

    def candidate(
        self, stage_sites: Layout, pipelines: int, m: int, delta_n: tuple[int, ...]
    ) -> LayoutCandidate:
        codecs = tuple(
            self._codecs.get((a, b), "none") if a != b else "none"
            for a, b in itertools.pairwise(stage_sites)
        )
        return LayoutCandidate(
            pipelines=pipelines,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            delta_n=delta_n,
            codecs=codecs,
            schedule=self.schedule,
            stage_sites=stage_sites,
            num_microbatches=m,
            partition=self.partition_of(stage_sites) if self.partition_of else (),
        )

    def plan(self, stage_sites: Layout, pipelines: int, m: int, delta_n: tuple[int, ...]) -> Plan:
        plan = self._ev.make_plan(self.candidate(stage_sites, pipelines, m, delta_n))
        assert plan is not None
        return plan

    def simulate(self, stage_sites: Layout, d: int, m: int, dn: tuple[int, ...]) -> Evaluation:
        """Evaluate and always simulate (the time is wanted even if memory is over)."""
        return self._ev.evaluate(self.candidate(stage_sites, d, m, dn))

    def _eval(self, cand: LayoutCandidate) -> Evaluation:
        """Evaluate; skip the simulation when memory rules the layout out (never prunes
        by fitness, see :class:`_LayoutEvaluator`)."""
        return self._ev.evaluate(cand, prune=True)

    def lower_bound(self, stage_sites: Layout, pipelines: int, m: int) -> float:
        """A cheap bound no prediction of this layout can beat (the simulator's)."""
        zeros = (0,) * (len(stage_sites) - 1)
        return lower_bound(self._ev.costs(self.plan(stage_sites, pipelines, m, zeros)), m)

    # -- the ΔN ladder ---------------------------------------------------------------------
    def _snap(self, dn: int) -> int:
        """The smallest allowed ΔN ≥ ``dn`` (the largest allowed if none is)."""
        for x in self._delta_ns:
            if x >= dn:
                return x
        return self._delta_ns[-1]

    def _ladder(
        self, stage_sites: Layout, pipelines: int
    ) -> tuple[list[tuple[int, ...]], tuple[int, ...] | None]:
        """ΔN per boundary to search: the estimate scaled by :data:`DELTA_N_SCALES`
        (ascending), and the running plan's ΔN on its site pairs (None without a plan)."""
        p = len(stage_sites)
        zeros = (0,) * (p - 1)
        if self.schedule not in LOOKAHEAD_FAMILIES:
            return [zeros], None
        plan = self.plan(stage_sites, pipelines, 1, zeros)
        costs = self._ev.costs(plan)
        est = [0] * (p - 1)
        for j in plan.wan_boundaries:
            est[j] = delta_n_estimate(costs, j)
        wan = set(plan.wan_boundaries)
        ladder: list[tuple[int, ...]] = []
        for scale in DELTA_N_SCALES:
            dn = tuple(self._snap(round(est[j] * scale)) if j in wan else 0 for j in range(p - 1))
            if dn not in ladder:
                ladder.append(dn)
        planned = None
        if self._plan_delta_n:
            planned = tuple(
                self._plan_delta_n.get((a, b), self._snap(round(est[j] * DELTA_N_SCALES[2])))
                if a != b
                else 0
                for j, (a, b) in enumerate(itertools.pairwise(stage_sites))
            )
        return ladder, planned

    def predict(self, stage_sites: Layout, d: int, m: int) -> Prediction:
        """Search ΔN (module note): walk the scaled estimates from the middle while the time
        improves, try the running plan's ΔN, keep the fastest that fits."""
        ladder, planned = self._ladder(stage_sites, d)
        tried: dict[tuple[int, ...], Prediction] = {}

        def at(dn: tuple[int, ...]) -> Prediction:
            if dn not in tried:
                tried[dn] = self._predict_at(stage_sites, d, m, dn)
            return tried[dn]

        def rank(pr: Prediction) -> float:
            return pr.iteration_time_s if pr.feasible else math.inf

        i = min(len(ladder) - 1, DELTA_N_START)
        at(ladder[i])
        j = i
        for step in (-1, 1):  # walk downhill; down also past what does not fit in memory
            while 0 <= j + step < len(ladder):
                here, there = rank(at(ladder[j])), rank(at(ladder[j + step]))
                if not (there < here or (step < 0 and math.isinf(here))):
                    break
                j += step
            if j != i:  # unimodal: once going down helped, going up cannot
                break
        if planned is not None:
            at(planned)
        fastest = min(rank(pr) for pr in tried.values())
        if math.isinf(fastest):  # report the smallest ΔN: the least memory it can need
            return at(ladder[0])
        # ΔN changes activations only: the least memory within the tie tolerance
        return lean_tie(
            tried.values(),
            rank,
            lambda pr: sum(pr.peak_memory_bytes),
            lambda pr: (sum(pr.delta_n),),
        )

    def _predict_at(self, stage_sites: Layout, d: int, m: int, dn: tuple[int, ...]) -> Prediction:
        """Predict one ΔN: memory at the in-flight peak, the time at ``m`` (exact)."""
        p = len(stage_sites)
        m_peak = min(m, p + sum(dn))  # in-flight activations peak from here on
        peak = self._eval(self.candidate(stage_sites, d, m_peak, dn))
        assert peak.plan is not None
        if stages_over(peak.memory, peak.memory_limit_bytes):
            return Prediction(
                feasible=False,
                reason=peak.reason,
                iteration_time_s=math.inf,
                delta_n=dn,
                codecs=peak.plan.codecs,
                peak_memory_bytes=tuple(peak.peak_memory_bytes),
                per_microbatch_s=math.inf,
            )
        at_m = peak if m == m_peak else self.simulate(stage_sites, d, m, dn)
        # The slope may be measured past what fits in memory: a plain simulation.
        far = self.simulate(stage_sites, d, m + SLOPE_SPAN, dn)
        slope = (far.iteration_time_s - at_m.iteration_time_s) / SLOPE_SPAN
        bad = next((e for e in (peak, at_m) if not e.feasible), None)
        return Prediction(
            feasible=bad is None,
            reason="ok" if bad is None else bad.reason,
            iteration_time_s=at_m.iteration_time_s,
            delta_n=dn,
            codecs=peak.plan.codecs,
            peak_memory_bytes=tuple(peak.peak_memory_bytes),
            per_microbatch_s=max(slope, 0.0),
        )
