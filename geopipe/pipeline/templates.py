"""Oobleck-style pipeline templates, adapted to sites.

A *template* is the layout of ONE pipeline: how many stages each site hosts (in pipeline
order), the layer partition and the stage→site mapping. One pipeline puts one stage replica
on one device, so a template with ``v[s]`` stages in site ``s`` uses exactly ``v[s]`` devices
there, and ``D`` identical pipelines of it use ``D·v[s]``. The *stages-per-site vector*
``v`` therefore fixes the template: the partition follows from it (balanced for the sites'
device speeds by :func:`geopipe.plan.partition_for`), and so does every predicted time,
which comes from the planner's own cost model (:class:`~geopipe.optimizer.evaluate.Evaluator`:
its costs, memory model and simulator), never from a second one.

[Note: skipped sites] A template uses exactly the sites that still have a device: a site
is left out (``v[s] == 0``) only when it has none. Never skipping would be simpler, but then
losing a whole data centre — the failure a geo-distributed run fears most — would leave no
template at all. Skipping a live site by choice is not offered: the cost model then prefers
to idle whole sites (three-dc-wan's 1.3B model fits one GPU, so 32 single-stage pipelines
in one site "win"), a decision the planner does not make either — it always spans every
site. The used sites are chained in the cheapest order over the links among them
(:func:`geopipe.plan.site_order` on that subset; for all sites that is the planner's
order), so a pipeline crosses each WAN link at most once per direction; a subset whose
links form no chain has no template. Every used site hosts a contiguous run of ≥ 1 stages.

[Note: what a prediction assumes] The micro-batch size, sequence length, schedule and the
codec of each WAN hop are fixed for a template set (taken from the running plan, or the
YAML's defaults). ΔN per WAN boundary is searched per layout, because the right advance
depends on the stage sizes: the architecture's estimate ``ceil(round trip / (t_f + t_b))``
of the upstream stage overshoots (on the shipped clusters the simulator's best is 1/8 to 1/2
of it, and the estimate itself predicts 25–30 % slower), so a prediction walks the multiples
:data:`_DELTA_N_SCALES` of it from 1/4 while the time improves, also tries the running
plan's ΔN on its site pairs, and keeps the fastest that fits in memory. Memory is checked
where in-flight activations peak (``m ≥ p + ΣΔN``), so a template that fits, fits for any
number of micro-batches. Long runs (``p·m`` above :data:`_EXACT_CELLS`) are simulated at
two points past that peak and extrapolated along the steady state, which is affine in
``m``; shorter ones are simulated exactly.

[Note: bounded enumeration] Small clusters enumerate every vector (``Π (n_s + 1)`` up to
``exhaustive_limit``). Large ones (eight sites × 64 devices would be 65^8) precompute only
the vectors a run actually meets: for every data-parallel degree ``D`` the deepest
pipeline ``D`` copies can fill (``n_s // D`` stages per site, trimmed to the layer count as
:func:`geopipe.plan.candidate_shapes` trims), and each of those with one stage fewer in
one site — what a single lost device turns it into. Any other vector is evaluated on
demand and memoised, so recovery after any failure pattern still finds its templates.

Instantiation ([Note: heterogeneous pipelines]) may mix templates, like Oobleck, but only
templates that put every layer in the same site: then each layer's replicas sit in one
site and gradient reduction never crosses a WAN link — the invariant the cost model
assumes. The runtime today runs only ``D`` identical pipelines; :func:`best_uniform` is
the choice it uses.

Layering: this module lives in ``pipeline/`` but reuses ``optimizer/``'s cost model, as the
architecture asks (one cost model); nothing in ``optimizer/`` imports it back.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from geopipe.config import ClusterSpec
from geopipe.optimizer.evaluate import Candidate, Evaluation, Evaluator
from geopipe.optimizer.simulator import lower_bound
from geopipe.plan import Plan, Shape, partition_for, site_order

__all__ = [
    "Instantiation",
    "PipelineAssignment",
    "Prediction",
    "Template",
    "TemplateSet",
    "best_uniform",
    "build_templates",
    "format_templates",
    "instantiate",
    "split_microbatches",
]

Vector = tuple[int, ...]  # stages (= devices of one pipeline) per site, in TemplateSet.sites order

# Above this many stage × micro-batch cells a run is extrapolated, not simulated (~10 µs/cell).
_EXACT_CELLS = 4096
# Heterogeneous instantiation: exhaustive while it needs at most this many (vector, pipelines)
# predictions (each a simulation), else a hill climb of at most this many steps.
_MAX_EXHAUSTIVE_PREDICTIONS = 96
# ΔN is searched over these multiples of the estimate ceil(round trip / (t_f + t_b)), starting
# at index _DELTA_N_START: on the shipped clusters the best lies between 1/8 and 1/2 of it.
_DELTA_N_SCALES = (0.0, 0.125, 0.25, 0.5, 1.0)
_DELTA_N_START = 2
_MAX_CLIMB_STEPS = 32


@dataclass(frozen=True)
class Prediction:
    """One layout (vector × pipelines × micro-batches) through the planner's cost model."""

    feasible: bool
    reason: str
    iteration_time_s: float
    delta_n: tuple[int, ...]  # one per stage boundary (0 inside a site)
    codecs: tuple[str, ...]  # one per stage boundary ("none" inside a site)
    peak_memory_bytes: tuple[float, ...]
    exact: bool  # simulated at this micro-batch count (else extrapolated, see the module note)
    per_microbatch_s: float  # steady-state slope of iteration time in the micro-batch count


@dataclass(frozen=True)
class Template:
    """The best layout of one pipeline for a stages(=devices)-per-site vector.

    Times are for this pipeline alone (``D = 1``: it holds all optimizer state and has every
    WAN link to itself) running ``num_microbatches`` micro-batches.
    """

    sites: tuple[str, ...]  # every site of the set, in the cluster's pipeline order
    stages_per_site: Vector  # aligned with ``sites``; 0 = the site is skipped (no devices)
    stage_sites: tuple[str, ...]  # site of each stage, in pipeline order
    partition: tuple[tuple[int, int], ...]
    num_microbatches: int
    iteration_time_s: float
    per_microbatch_s: float
    feasible: bool
    reason: str
    delta_n: tuple[int, ...]
    codecs: tuple[str, ...]
    peak_memory_bytes: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_sites)

    @property
    def num_devices(self) -> int:
        return sum(self.stages_per_site)

    @property
    def devices(self) -> dict[str, int]:
        """Devices one pipeline of this template uses, per used site."""
        return {s: n for s, n in zip(self.sites, self.stages_per_site, strict=True) if n}

    @property
    def layer_sites(self) -> tuple[str, ...]:
        """The site of every layer (templates agreeing on it may share an instantiation)."""
        return tuple(
            s
            for (a, z), s in zip(self.partition, self.stage_sites, strict=True)
            for _ in range(a, z)
        )

    def predicted_time(self, num_microbatches: int) -> float:
        """Approximate time alone for another micro-batch count (affine in the steady
        state); inf if the template does not fit alone."""
        if not self.feasible:
            return math.inf
        return self.iteration_time_s + self.per_microbatch_s * (
            num_microbatches - self.num_microbatches
        )


@dataclass(frozen=True)
class PipelineAssignment:
    """One instantiated pipeline: its template and its share of the micro-batches."""

    template: Template
    num_microbatches: int
    predicted_time_s: float  # as one of this instantiation's pipelines
    per_microbatch_s: float  # its steady-state time per extra micro-batch, likewise


@dataclass(frozen=True)
class Instantiation:
    """Pipelines covering the alive devices, with the global batch split among them."""

    pipelines: tuple[PipelineAssignment, ...]
    micro_batch_size: int
    iteration_time_s: float  # the slowest pipeline's predicted time
    devices_used: dict[str, int]

    @property
    def uniform(self) -> bool:
        """True when all pipelines share one template (what the runtime runs today)."""
        return len({p.template.stages_per_site for p in self.pipelines}) == 1


@dataclass(frozen=True)
class _TemplateCandidate(Candidate):
    """A candidate whose plan is a template layout (the evaluator's cache keys on it)."""

    stage_sites: tuple[str, ...] = ()
    num_microbatches: int = 1


class _TemplateEvaluator(Evaluator):
    """The planner's Evaluator, scoring template layouts instead of its own shapes.

    Only :meth:`make_plan` changes: the costs, memory model, simulator, feasibility rules and
    cache are the planner's. It never prunes by fitness: template candidates differ in their
    micro-batch counts, so seconds per token are not comparable between them.
    """

    @property
    def best_fitness(self) -> float:
        return math.inf

    @best_fitness.setter
    def best_fitness(self, value: float) -> None:
        del value

    def make_plan(self, c: Candidate) -> Plan | None:
        if not isinstance(c, _TemplateCandidate):
            return super().make_plan(c)
        shape = Shape(c.pipelines, c.stage_sites)
        return Plan(
            pipelines=c.pipelines,
            stage_sites=c.stage_sites,
            partition=partition_for(self.spec, shape, c.seq_len),
            micro_batch_size=c.micro_batch_size,
            seq_len=c.seq_len,
            num_microbatches=c.num_microbatches,
            schedule=c.schedule,
            delta_n=c.delta_n,
            codecs=c.codecs,
        )


class TemplateSet:
    """Templates of one cluster at fixed micro-batch size, sequence length and schedule.

    ``templates`` holds every precomputed vector (feasible or not); :meth:`template` and
    :meth:`predict` evaluate any other vector on demand and memoise it.
    """

    def __init__(
        self,
        spec: ClusterSpec,
        devices_per_site: Mapping[str, int],
        micro_batch_size: int,
        seq_len: int,
        schedule: str,
        codecs: Mapping[tuple[str, str], str],
        plan_delta_n: Mapping[tuple[str, str], int] | None = None,
    ) -> None:
        self.spec = spec
        self.sites: tuple[str, ...] = tuple(site_order(spec))
        self.devices: Vector = tuple(int(devices_per_site.get(s, 0)) for s in self.sites)
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.schedule = schedule
        self.num_layers = spec.model.n_layer + 2
        gbs = spec.training.global_batch_size
        if gbs % micro_batch_size:
            raise ValueError(
                f"global batch {gbs} is not divisible by micro-batch {micro_batch_size}"
            )
        self.num_microbatches = gbs // micro_batch_size  # the whole batch on one pipeline
        self.templates: dict[Vector, Template] = {}
        self.exhaustive = False
        self._codecs = dict(codecs)
        self._plan_delta_n = dict(plan_delta_n or {})
        self._ev = _TemplateEvaluator(spec, schedule=schedule)
        self._delta_ns = tuple(sorted(self._ev.space.delta_ns))
        self._orders: dict[frozenset[str], tuple[str, ...] | None] = {}
        self._predictions: dict[tuple[Vector, int, int], Prediction | None] = {}
        self._uniform: dict[tuple[Vector, int], tuple[Template, int] | None] = {}

    # -- layouts ---------------------------------------------------------------------------
    def _order(self, used: frozenset[str]) -> tuple[str, ...] | None:
        """The used sites in pipeline order (None if their links form no chain)."""
        if used not in self._orders:
            sub = self.spec.model_copy(
                update={"sites": [s for s in self.spec.sites if s.name in used]}
            )
            try:
                self._orders[used] = tuple(site_order(sub))
            except ValueError:
                self._orders[used] = None
        return self._orders[used]

    def stage_sites(self, v: Vector) -> tuple[str, ...] | None:
        """Site of each stage for vector ``v``, or None if ``v`` has no valid layout."""
        if len(v) != len(self.sites) or any(n < 0 for n in v):
            return None
        total = sum(v)
        if total < 1 or total > self.num_layers:
            return None
        per = dict(zip(self.sites, v, strict=True))
        order = self._order(frozenset(s for s, n in per.items() if n))
        if order is None:
            return None
        return tuple(s for s in order for _ in range(per[s]))

    def max_vector(self, devices: Vector, pipelines: int) -> Vector | None:
        """The deepest vector ``pipelines`` copies can fill (the planner's shape rule).

        Every site with a device is used (None if one has fewer than ``pipelines``); the
        deepest sites give up stages (ties to the larger name, as
        :func:`geopipe.plan.candidate_shapes`) until the pipeline is no deeper than the
        model has layers.
        """
        if any(0 < n < pipelines for n in devices):
            return None
        per = {s: n // pipelines for s, n in zip(self.sites, devices, strict=True)}
        while sum(per.values()) > self.num_layers:
            name = max(self.sites, key=lambda n: (per[n], n))
            if per[name] <= 1:
                return None
            per[name] -= 1
        v = tuple(per[s] for s in self.sites)
        return v if self.stage_sites(v) is not None else None

    # -- predictions -----------------------------------------------------------------------
    def _snap(self, dn: int) -> int:
        """The smallest allowed ΔN ≥ ``dn`` (the largest allowed if none is)."""
        for x in self._delta_ns:
            if x >= dn:
                return x
        return self._delta_ns[-1]

    def _delta_n_options(
        self, stage_sites: tuple[str, ...], pipelines: int
    ) -> tuple[list[tuple[int, ...]], tuple[int, ...] | None]:
        """ΔN per boundary to search: the estimate scaled by :data:`_DELTA_N_SCALES`
        (ascending), and the running plan's ΔN on its site pairs (None without a plan)."""
        p = len(stage_sites)
        zeros = (0,) * (p - 1)
        if self.schedule != "lookahead":
            return [zeros], None
        plan = self._ev.make_plan(self._candidate(stage_sites, pipelines, 1, zeros))
        assert plan is not None
        costs = self._ev.costs(plan)
        est = [0.0] * (p - 1)
        for j in plan.wan_boundaries:
            rt = costs.ser_f[j] + costs.lat_f[j] + costs.ser_b[j] + costs.lat_b[j]
            est[j] = math.ceil(rt / max(costs.fwd_s[j] + costs.bwd_s[j], 1e-12))
        wan = set(plan.wan_boundaries)
        ladder: list[tuple[int, ...]] = []
        for scale in _DELTA_N_SCALES:
            dn = tuple(self._snap(round(est[j] * scale)) if j in wan else 0 for j in range(p - 1))
            if dn not in ladder:
                ladder.append(dn)
        planned = None
        if self._plan_delta_n:
            planned = tuple(
                self._plan_delta_n.get((a, b), self._snap(round(est[j] * _DELTA_N_SCALES[2])))
                if a != b
                else 0
                for j, (a, b) in enumerate(itertools.pairwise(stage_sites))
            )
        return ladder, planned

    def _candidate(
        self, stage_sites: tuple[str, ...], pipelines: int, m: int, delta_n: tuple[int, ...]
    ) -> _TemplateCandidate:
        codecs = tuple(
            self._codecs.get((a, b), "none") if a != b else "none"
            for a, b in itertools.pairwise(stage_sites)
        )
        return _TemplateCandidate(
            pipelines=pipelines,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            delta_n=delta_n,
            codecs=codecs,
            schedule=self.schedule,
            stage_sites=stage_sites,
            num_microbatches=m,
        )

    def _eval(self, cand: _TemplateCandidate) -> Evaluation:
        """Evaluate; skip the simulation when memory rules the layout out (never prunes
        by fitness, see :class:`_TemplateEvaluator`)."""
        return self._ev.evaluate(cand, prune=True)

    def _sim(self, stage_sites: tuple[str, ...], d: int, m: int, dn: tuple[int, ...]) -> Evaluation:
        """Evaluate and always simulate (the time is wanted even if memory is over)."""
        return self._ev.evaluate(self._candidate(stage_sites, d, m, dn))

    def predict(self, v: Vector, pipelines: int, num_microbatches: int) -> Prediction | None:
        """Predict ``pipelines`` copies of vector ``v`` each running ``num_microbatches``.

        None if ``v`` has no valid layout. Memoised.
        """
        key = (v, pipelines, num_microbatches)
        if key not in self._predictions:
            self._predictions[key] = self._predict(v, pipelines, num_microbatches)
        return self._predictions[key]

    def _predict(self, v: Vector, d: int, m: int) -> Prediction | None:
        """Search ΔN (module note): walk the scaled estimates from the middle while the time
        improves, try the running plan's ΔN, keep the fastest that fits."""
        stage_sites = self.stage_sites(v)
        if stage_sites is None or d < 1 or m < 1:
            return None
        ladder, planned = self._delta_n_options(stage_sites, d)
        tried: dict[tuple[int, ...], Prediction] = {}

        def at(dn: tuple[int, ...]) -> Prediction:
            if dn not in tried:
                tried[dn] = self._predict_at(stage_sites, d, m, dn)
            return tried[dn]

        def rank(pr: Prediction) -> float:
            return pr.iteration_time_s if pr.feasible else math.inf

        i = min(len(ladder) - 1, _DELTA_N_START)
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
        best = min(tried.values(), key=lambda pr: (rank(pr), sum(pr.delta_n)))
        if not best.feasible:  # report the smallest ΔN: the least memory it can need
            best = at(ladder[0])
        return best

    def _predict_at(
        self, stage_sites: tuple[str, ...], d: int, m: int, dn: tuple[int, ...]
    ) -> Prediction:
        """Predict one ΔN: memory at the in-flight peak, time exact or extrapolated."""
        p = len(stage_sites)
        m_peak = min(m, p + sum(dn))  # in-flight activations peak from here on
        peak = self._eval(self._candidate(stage_sites, d, m_peak, dn))
        assert peak.plan is not None
        if _memory_over(peak):
            return Prediction(
                feasible=False,
                reason=peak.reason,
                iteration_time_s=math.inf,
                delta_n=dn,
                codecs=peak.plan.codecs,
                peak_memory_bytes=tuple(peak.peak_memory_bytes),
                exact=True,
                per_microbatch_s=math.inf,
            )
        at_m: Evaluation | None = peak
        if m != m_peak:
            at_m = self._sim(stage_sites, d, m, dn) if p * m <= _EXACT_CELLS else None
        # The slope: between the peak and m, or one pipeline depth further (that point may not
        # fit in memory, which does not matter for a slope, hence a plain simulation).
        if at_m is not None and at_m is not peak:
            far = at_m
        else:
            far = self._sim(stage_sites, d, m_peak + max(p, 4), dn)
        assert far.plan is not None
        slope = (far.iteration_time_s - peak.iteration_time_s) / (
            far.plan.num_microbatches - m_peak
        )
        if at_m is None:  # a long run: extrapolate along the steady state
            t, last = peak.iteration_time_s + slope * (m - m_peak), far
        else:
            t, last = at_m.iteration_time_s, at_m
        bad = next((e for e in (peak, last) if not e.feasible), None)
        return Prediction(
            feasible=bad is None,
            reason="ok" if bad is None else bad.reason,
            iteration_time_s=t,
            delta_n=dn,
            codecs=peak.plan.codecs,
            peak_memory_bytes=tuple(peak.peak_memory_bytes),
            exact=at_m is not None,
            per_microbatch_s=max(slope, 0.0),
        )

    def template(self, v: Vector) -> Template | None:
        """The template of vector ``v`` (alone, whole global batch); None if ``v`` is invalid."""
        if v in self.templates:
            return self.templates[v]
        stage_sites = self.stage_sites(v)
        pr = self.predict(v, 1, self.num_microbatches)
        if stage_sites is None or pr is None:
            return None
        t = Template(
            sites=self.sites,
            stages_per_site=v,
            stage_sites=stage_sites,
            partition=partition_for(self.spec, Shape(1, stage_sites), self.seq_len),
            num_microbatches=self.num_microbatches,
            iteration_time_s=pr.iteration_time_s,
            per_microbatch_s=pr.per_microbatch_s,
            feasible=pr.feasible,
            reason=pr.reason,
            delta_n=pr.delta_n,
            codecs=pr.codecs,
            peak_memory_bytes=pr.peak_memory_bytes,
        )
        self.templates[v] = t
        return t

    def lower_bound(self, v: Vector, pipelines: int, num_microbatches: int) -> float:
        """A cheap bound no prediction of this layout can beat (the simulator's)."""
        stage_sites = self.stage_sites(v)
        if stage_sites is None:
            return math.inf
        zeros = (0,) * (len(stage_sites) - 1)
        plan = self._ev.make_plan(self._candidate(stage_sites, pipelines, num_microbatches, zeros))
        assert plan is not None
        return lower_bound(self._ev.costs(plan), num_microbatches)

    def plan_for(self, template: Template, pipelines: int, num_microbatches: int) -> Plan:
        """The runtime's plan for ``pipelines`` identical copies of ``template``."""
        pr = self.predict(template.stages_per_site, pipelines, num_microbatches)
        if pr is None:
            raise ValueError(f"template {template.stages_per_site} has no valid layout")
        return Plan(
            pipelines=pipelines,
            stage_sites=template.stage_sites,
            partition=template.partition,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            num_microbatches=num_microbatches,
            schedule=self.schedule,
            delta_n=pr.delta_n,
            codecs=pr.codecs,
        )

    # -- queries ---------------------------------------------------------------------------
    def vector(self, devices: Mapping[str, int]) -> Vector:
        """A per-site mapping as a vector in :attr:`sites` order (missing sites: 0)."""
        unknown = set(devices) - set(self.sites)
        if unknown:
            raise ValueError(f"unknown sites {sorted(unknown)} (sites: {', '.join(self.sites)})")
        return tuple(max(0, int(devices.get(s, 0))) for s in self.sites)

    def feasible(self) -> list[Template]:
        """Precomputed templates that fit alone, fewest devices first."""
        out = [t for t in self.templates.values() if t.feasible]
        return sorted(out, key=lambda t: (t.num_devices, t.iteration_time_s, t.stages_per_site))

    def candidate_vectors(self, devices: Vector) -> list[Vector]:
        """Vectors worth trying within ``devices``: those using exactly the sites that have
        a device (see the module note), precomputed or the deepest for some pipeline count
        (evaluated on demand)."""
        out = {v for v in self.templates if _fits(v, devices) and _same_sites(v, devices)}
        for d in range(1, max(devices, default=0) + 1):
            v = self.max_vector(devices, d)
            if v is not None:
                out.add(v)
        return sorted(out)

    def best(self, devices: Mapping[str, int]) -> Template | None:
        """The fastest template (alone) that fits in ``devices``; None if none fits."""
        cands = (self.template(v) for v in self.candidate_vectors(self.vector(devices)))
        ok = [t for t in cands if t is not None and t.feasible]
        return min(ok, key=_template_key, default=None)

    def smallest(self) -> Template | None:
        """The feasible template with the fewest devices using every site that has one."""
        ok = [t for t in self.feasible() if _same_sites(t.stages_per_site, self.devices)]
        return ok[0] if ok else None


def _memory_over(ev: Evaluation) -> bool:
    return any(mb.total > lim for mb, lim in zip(ev.memory, ev.memory_limit_bytes, strict=True))


def _template_key(t: Template) -> tuple[float, int, Vector]:
    return (t.iteration_time_s, t.num_devices, t.stages_per_site)


def _fits(v: Vector, devices: Vector, copies: int = 1) -> bool:
    return all(copies * a <= b for a, b in zip(v, devices, strict=True))


def _same_sites(v: Vector, devices: Vector) -> bool:
    return all((a > 0) == (n > 0) for a, n in zip(v, devices, strict=True))


def _all_vectors(limits: Vector, num_layers: int) -> Iterator[Vector]:
    ranges = [range(min(n, num_layers) + 1) for n in limits]
    for v in itertools.product(*ranges):
        if 1 <= sum(v) <= num_layers:
            yield v


def build_templates(
    spec: ClusterSpec,
    devices_per_site: Mapping[str, int] | None = None,
    *,
    plan: Plan | None = None,
    exhaustive_limit: int = 2048,
) -> TemplateSet:
    """The templates of ``spec`` for up to ``devices_per_site`` devices (default: all).

    Settings (micro-batch, sequence length, schedule, WAN codecs) come from ``plan`` when
    given (the running plan), else from the YAML: the smallest micro-batch size dividing the
    global batch, the longest sequence length, each link's codec. Enumerates every vector
    when there are at most ``exhaustive_limit`` of them, else the bounded set of the module
    note.
    """
    ev = Evaluator(spec, schedule=plan.schedule if plan else None)
    space = ev.space
    gbs = spec.training.global_batch_size
    if plan is not None:
        b, s, sched = plan.micro_batch_size, plan.seq_len, plan.schedule
    else:
        divides = [x for x in space.micro_batch_sizes if gbs % x == 0]
        if not divides:
            raise ValueError(f"no micro-batch size divides the global batch {gbs}")
        b, s, sched = min(divides), max(space.seq_lens), space.schedule
    codecs: dict[tuple[str, str], str] = {}
    for lk in spec.links:
        for a, z in ((lk.src, lk.dst), (lk.dst, lk.src)):
            c = lk.codec if lk.codec in space.codecs else space.codecs[0]
            codecs.setdefault((a, z), c)
    plan_dn: dict[tuple[str, str], int] = {}
    if plan is not None:  # the running plan's codec and ΔN choices on its hops
        for j in plan.wan_boundaries:
            a, z = plan.stage_sites[j], plan.stage_sites[j + 1]
            codecs[(a, z)] = codecs[(z, a)] = plan.codecs[j]
            plan_dn[(a, z)] = plan.delta_n[j]
    have = devices_per_site or {x.name: x.devices for x in spec.sites}
    ts = TemplateSet(spec, have, b, s, sched, codecs, plan_dn)
    limits = ts.devices
    n_all = math.prod(min(n, ts.num_layers) + 1 for n in limits)
    if n_all <= exhaustive_limit:
        ts.exhaustive = True
        vectors: set[Vector] = set(_all_vectors(limits, ts.num_layers))
    else:
        vectors = set()
        for d in range(1, max(limits, default=0) + 1):
            v = ts.max_vector(limits, d)
            if v is None:
                continue
            vectors.add(v)
            for i, n in enumerate(v):
                if n > 1:  # one device lost there (a site is skipped only when emptied)
                    vectors.add((*v[:i], n - 1, *v[i + 1 :]))
    for v in sorted(vectors):
        ts.template(v)
    return ts


# ---------------------------------------------------------------------------------------------
# Instantiation


def _check_batch(ts: TemplateSet, global_batch: int | None, micro_batch: int | None) -> int:
    """The total micro-batch count; the set's costs are for its own micro-batch size."""
    b = ts.micro_batch_size if micro_batch is None else micro_batch
    if b != ts.micro_batch_size:
        raise ValueError(f"the templates were built for micro-batch {ts.micro_batch_size}, not {b}")
    gbs = ts.spec.training.global_batch_size if global_batch is None else global_batch
    if gbs < 1 or gbs % b:
        raise ValueError(f"global batch {gbs} is not a positive multiple of micro-batch {b}")
    return gbs // b


def best_uniform(
    templates: TemplateSet,
    devices_alive: Mapping[str, int],
    global_batch: int | None = None,
    micro_batch: int | None = None,
) -> tuple[Template, int] | None:
    """The fastest ``D`` identical pipelines of one template that fit ``devices_alive``.

    ``D`` must divide the micro-batch count (identical pipelines run equal shares). Each
    (vector, D) is judged at its real share ``m = M / D`` — memory with ``D``-way ZeRO-1,
    WAN links shared by ``D`` pipelines. Candidates are tried in order of the simulator's
    lower bound and skipped once that bound loses. None if nothing fits.
    """
    ts = templates
    total = _check_batch(ts, global_batch, micro_batch)
    alive = ts.vector(devices_alive)
    key = (alive, total)
    if key in ts._uniform:
        return ts._uniform[key]
    pairs: list[tuple[float, Vector, int]] = []
    for v in ts.candidate_vectors(alive):
        for d in range(1, _copies(v, alive) + 1):
            if total % d == 0:
                pairs.append((ts.lower_bound(v, d, total // d), v, d))
    pairs.sort()
    best: tuple[tuple[float, int, int, Vector], Vector, int] | None = None
    for lb, v, d in pairs:
        if best is not None and lb > best[0][0] * (1 + 1e-9):
            break
        pr = ts.predict(v, d, total // d)
        if pr is None or not pr.feasible:
            continue
        rank = (pr.iteration_time_s, d * sum(v), -d, v)
        if best is None or rank < best[0]:
            best = (rank, v, d)
    result = None
    if best is not None:
        tmpl = ts.template(best[1])
        assert tmpl is not None
        result = (tmpl, best[2])
    ts._uniform[key] = result
    return result


def split_microbatches(lines: list[tuple[float, float]], total: int) -> list[int]:
    """Split ``total`` micro-batches over pipelines so they finish together.

    ``lines[i] = (fixed_s, per_microbatch_s)``: pipeline i takes ``fixed + per·m`` seconds.
    Every pipeline gets ≥ 1 and the shares sum to ``total``; the slowest finish is minimal
    (water-filling: each next micro-batch goes where it ends earliest), so shares are
    proportional to speed up to rounding.
    """
    k = len(lines)
    if k < 1 or total < k:
        raise ValueError(f"cannot give {k} pipelines at least one of {total} micro-batches")
    if any(not g > 0 for _, g in lines):
        raise ValueError("per-micro-batch times must be positive")
    # Continuous water level first (bisection), then hand out the rest one by one.
    lo, hi = 0.0, max(f + g * total for f, g in lines)
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(max(1.0, (mid - f) / g) for f, g in lines) >= total:
            hi = mid
        else:
            lo = mid
    shares = [max(1, math.floor((lo - f) / g)) for f, g in lines]
    while sum(shares) > total:  # rounding slack: take back from the latest finisher
        i = max((i for i in range(k) if shares[i] > 1), key=lambda i: _finish(lines, shares, i))
        shares[i] -= 1
    heap = [(lines[i][0] + lines[i][1] * (shares[i] + 1), i) for i in range(k)]
    heapq.heapify(heap)
    for _ in range(total - sum(shares)):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, (lines[i][0] + lines[i][1] * (shares[i] + 1), i))
    return shares


def _finish(lines: list[tuple[float, float]], shares: list[int], i: int) -> float:
    return lines[i][0] + lines[i][1] * shares[i]


Combo = tuple[tuple[Vector, int], ...]  # (vector, copies) pairs, sorted


class _Scorer:
    """Predicted iteration time of template combinations (lines memoised per (v, k))."""

    def __init__(self, ts: TemplateSet, total: int) -> None:
        self.ts = ts
        self.total = total
        self.lines: dict[tuple[Vector, int], tuple[float, float] | None] = {}

    def line(self, v: Vector, k: int) -> tuple[float, float] | None:
        """(fixed, per-micro-batch) seconds of ``v`` as one of ``k`` pipelines, or None."""
        key = (v, k)
        if key not in self.lines:
            m = max(1, self.total // k)
            pr = self.ts.predict(v, k, m)
            if pr is None or not pr.feasible:
                self.lines[key] = None
            else:
                g = max(pr.per_microbatch_s, 1e-12)
                self.lines[key] = (pr.iteration_time_s - g * m, g)
        return self.lines[key]

    def time(self, combo: Combo) -> float:
        """The slowest pipeline's time once the micro-batches are split (inf: infeasible)."""
        k = sum(n for _, n in combo)
        if k < 1 or k > self.total:
            return math.inf
        lines: list[tuple[float, float]] = []
        for v, n in combo:
            ln = self.line(v, k)
            if ln is None:
                return math.inf
            lines += [ln] * n
        shares = split_microbatches(lines, self.total)
        return max(f + g * m for (f, g), m in zip(lines, shares, strict=True))


def _copies(v: Vector, devices: Vector) -> int:
    """How many pipelines of ``v`` fit in ``devices``."""
    return min((a // n for a, n in zip(devices, v, strict=True) if n), default=0)


def _combos(group: list[Vector], left: Vector, room: int) -> Iterator[Combo]:
    """Every non-empty combination of ``group``'s templates within ``left`` devices and
    at most ``room`` pipelines."""
    if not group:
        return
    v, rest = group[0], group[1:]
    for n in range(min(_copies(v, left), room), -1, -1):
        if n:
            yield ((v, n),)
        rem = tuple(a - n * x for a, x in zip(left, v, strict=True))
        for tail in _combos(rest, rem, room - n):
            yield ((v, n), *tail) if n else tail


def _exhaustive_cost(groups: list[list[Vector]], alive: Vector, total: int) -> int:
    """An upper bound on the (vector, pipelines) predictions an exhaustive search needs."""
    cost = 0
    for group in groups:
        k_max = min(total, sum(_copies(v, alive) for v in group))
        cost += len(group) * k_max
    return cost


def _hill_climb(
    sc: _Scorer, group: list[Vector], alive: Vector, start: Combo
) -> tuple[float, Combo]:
    """Improve ``start`` by adding, removing or swapping one pipeline while that helps."""
    best, best_t = dict(start), sc.time(start)
    for _ in range(_MAX_CLIMB_STEPS):
        used = tuple(sum(n * v[j] for v, n in best.items()) for j in range(len(alive)))
        moves: list[dict[Vector, int]] = []
        for w in group:
            if all(u + x <= a for u, x, a in zip(used, w, alive, strict=True)):
                moves.append({**best, w: best.get(w, 0) + 1})
        for v in best:
            less = {**best, v: best[v] - 1}
            moves.append(less)
            freed = tuple(u - x for u, x in zip(used, v, strict=True))
            for w in group:
                fits = all(u + x <= a for u, x, a in zip(freed, w, alive, strict=True))
                if w != v and fits:
                    moves.append({**less, w: less.get(w, 0) + 1})
        step_t, step = best_t, None
        for mv in moves:
            t = sc.time(tuple(sorted((v, n) for v, n in mv.items() if n)))
            if t < step_t * (1 - 1e-12):
                step_t, step = t, mv
        if step is None:
            break
        best, best_t = {v: n for v, n in step.items() if n}, step_t
    return best_t, tuple(sorted(best.items()))


def instantiate(
    templates: TemplateSet,
    devices_alive: Mapping[str, int],
    global_batch: int | None = None,
    micro_batch: int | None = None,
) -> Instantiation | None:
    """Pipelines (possibly of different templates) with the best predicted throughput.

    Templates in one instantiation must agree on every layer's site (see the module note),
    so combinations are drawn from one group of such templates at a time, and scored with
    their micro-batches split by :func:`split_microbatches`. With ``k`` pipelines each is
    costed as one of ``k`` (ZeRO-1 over the ``k`` replicas of a layer, WAN links shared
    ``k`` ways), so every pipeline count needs its own simulation: when all combinations
    need at most :data:`_MAX_EXHAUSTIVE_PREDICTIONS` of them the search is exhaustive (small
    clusters), otherwise it hill-climbs from the best uniform choice by adding, removing or
    swapping one pipeline. The best uniform choice is always a candidate. None if nothing
    fits.
    """
    ts = templates
    total = _check_batch(ts, global_batch, micro_batch)
    alive = ts.vector(devices_alive)
    groups: dict[tuple[str, ...], list[Vector]] = {}
    for v in ts.candidate_vectors(alive):
        t = ts.template(v)
        if t is not None:
            groups.setdefault(t.layer_sites, []).append(v)
    sc = _Scorer(ts, total)
    best_t, best_combo = math.inf, ()
    uni = best_uniform(ts, devices_alive, total * ts.micro_batch_size)
    if uni is not None:
        best_combo = ((uni[0].stages_per_site, uni[1]),)
        best_t = sc.time(best_combo)
    if _exhaustive_cost(list(groups.values()), alive, total) <= _MAX_EXHAUSTIVE_PREDICTIONS:
        for group in groups.values():
            for combo in _combos(sorted(group), alive, total):
                t = sc.time(combo)
                if t < best_t * (1 - 1e-12):
                    best_t, best_combo = t, combo
    elif uni is not None:
        group = groups.get(uni[0].layer_sites, [uni[0].stages_per_site])
        best_t, best_combo = _hill_climb(sc, group, alive, best_combo)
    if not best_combo or not math.isfinite(best_t):
        return None
    return _instantiation(ts, sc, dict(best_combo), total)


def _instantiation(
    ts: TemplateSet, sc: _Scorer, combo: dict[Vector, int], total: int
) -> Instantiation:
    k = sum(combo.values())
    order = sorted(combo)
    lines = []
    for v in order:
        ln = sc.line(v, k)
        assert ln is not None
        lines += [ln] * combo[v]
    shares = split_microbatches(lines, total)
    pipes: list[PipelineAssignment] = []
    i = 0
    for v in order:
        tmpl = ts.template(v)
        assert tmpl is not None
        for _ in range(combo[v]):
            pr = ts.predict(v, k, shares[i])
            assert pr is not None
            pipes.append(
                PipelineAssignment(tmpl, shares[i], pr.iteration_time_s, pr.per_microbatch_s)
            )
            i += 1
    used = {s: sum(n * v[j] for v, n in combo.items()) for j, s in enumerate(ts.sites)}
    return Instantiation(
        pipelines=tuple(pipes),
        micro_batch_size=ts.micro_batch_size,
        iteration_time_s=max(p.predicted_time_s for p in pipes),
        devices_used={s: n for s, n in used.items() if n},
    )


# ---------------------------------------------------------------------------------------------
# Report


def _fmt_s(t: float) -> str:
    if not math.isfinite(t):
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def _fmt_partition(t: Template, width: int = 48) -> str:
    """Layers per stage, grouped by site: ``2+2|1+3`` (elided when long)."""
    parts: list[str] = []
    cur, run = None, []
    for (a, z), s in zip(t.partition, t.stage_sites, strict=True):
        if s != cur and run:
            parts.append("+".join(run))
            run = []
        cur = s
        run.append(str(z - a))
    parts.append("+".join(run))
    text = "|".join(parts)
    return text if len(text) <= width else text[: width - 1] + "…"


def format_templates(ts: TemplateSet) -> str:
    """A table of the feasible templates for ``geopipe plan --templates``."""
    head = (
        f"templates: micro-batch {ts.micro_batch_size}, seq len {ts.seq_len}, "
        f"{ts.schedule}; time = one pipeline alone running all {ts.num_microbatches} "
        f"micro-batches"
    )
    lines = [head, "sites (pipeline order): " + " > ".join(ts.sites)]
    ok = ts.feasible()
    n_bad = sum(1 for t in ts.templates.values() if not t.feasible)
    enum = "every vector" if ts.exhaustive else "bounded set (see geopipe.pipeline.templates)"
    lines.append(f"{len(ts.templates)} vectors evaluated ({enum}); {len(ok)} fit in memory")
    if not ok:
        lines.append("no template fits: the model needs more devices than these sites have")
        return "\n".join(lines)
    smallest = ts.smallest() or ok[0]
    lines.append(
        f"smallest: {smallest.num_devices} device{'s' * (smallest.num_devices != 1)} "
        f"({_fmt_counts(smallest)})"
    )
    rows = [("devices/stages per site", "p", "layers per stage", "ΔN (WAN)", "time", "peak mem")]
    for t in ok:
        wan = [
            t.delta_n[j]
            for j in range(t.num_stages - 1)
            if t.stage_sites[j] != t.stage_sites[j + 1]
        ]
        peak = max(t.peak_memory_bytes, default=0.0) / (1 << 30)
        rows.append(
            (
                _fmt_counts(t),
                str(t.num_stages),
                _fmt_partition(t),
                ",".join(map(str, wan)) or "-",
                _fmt_s(t.iteration_time_s),
                f"{peak:.2f} GiB",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if n_bad:
        lines.append(f"({n_bad} vector{'s' * (n_bad != 1)} do not fit in memory)")
    return "\n".join(lines)


def _fmt_counts(t: Template) -> str:
    order = list(dict.fromkeys(t.stage_sites))
    return " ".join(f"{s}={t.devices[s]}" for s in order)
