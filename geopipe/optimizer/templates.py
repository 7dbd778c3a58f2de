"""Oobleck-style pipeline templates, adapted to sites.

A *template* is the layout of ONE pipeline: how many stages each site hosts (in pipeline
order), the layer partition and the stage→site mapping. One pipeline puts one stage replica
on one device, so a template with ``v[s]`` stages in site ``s`` uses exactly ``v[s]`` devices
there, and ``D`` identical pipelines of it use ``D·v[s]``. The *stages-per-site vector*
``v`` therefore fixes the template: the partition follows from it (balanced for the sites'
device speeds by :func:`geopipe.optimizer.shapes.partition_for`), and so does every
predicted time, which comes from the planner's own cost model through
:class:`~geopipe.optimizer.ladder.LayoutPredictor` (the
:class:`~geopipe.optimizer.evaluate.Evaluator`'s costs, memory model and simulator, with
ΔN searched per layout: see [Note: what a prediction assumes] there), never from a second
one.

[Note: skipped sites] A template uses exactly the sites that still have a device: a site
is left out (``v[s] == 0``) only when it has none. Never skipping would be simpler, but then
losing a whole data centre — the failure a geo-distributed run fears most — would leave no
template at all. Skipping a live site by choice is not offered: the cost model then prefers
to idle whole sites (three-dc-wan's 1.3B model fits one GPU, so 32 single-stage pipelines
in one site "win"), a decision the planner does not make either — it always spans every
site. The used sites are chained in the cheapest order over the links among them
(:func:`geopipe.optimizer.shapes.site_order` on that subset; for all sites that is the
planner's order), so a pipeline crosses each WAN link at most once per direction; a subset
whose links form no chain has no template. Every used site hosts a contiguous run of ≥ 1
stages.

[Note: bounded enumeration] Small clusters enumerate every vector (``Π (n_s + 1)`` up to
``exhaustive_limit``). Large ones (eight sites × 64 devices would be 65^8) precompute only
the vectors a run actually meets: for every data-parallel degree ``D`` the deepest
pipeline ``D`` copies can fill (``n_s // D`` stages per site, trimmed to the layer count as
:func:`geopipe.optimizer.shapes.candidate_shapes` trims), and each of those with one stage
fewer in one site — what a single lost device turns it into. Any other vector is evaluated
on demand and memoised, so recovery after any failure pattern still finds its templates.

:func:`best_uniform` picks ``D`` identical pipelines of one template; mixing templates
(heterogeneous pipelines) is :func:`geopipe.optimizer.instantiate.instantiate` over the
template sets of :mod:`geopipe.optimizer.mixes`, and the runtime runs whichever
:func:`geopipe.optimizer.policies.best_layout` predicts faster.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from geopipe.config import ClusterSpec
from geopipe.model.sizes import num_layers
from geopipe.optimizer.errors import PlanningError
from geopipe.optimizer.evaluate import Evaluator
from geopipe.optimizer.ladder import LayoutPredictor, Prediction
from geopipe.optimizer.shapes import build_plan, partition_for, site_order, trim_to_layers
from geopipe.plan import Plan

__all__ = [
    "Template",
    "TemplateSet",
    "Vector",
    "best_uniform",
    "build_templates",
    "check_batch",
]

Vector = tuple[int, ...]  # stages (= devices of one pipeline) per site, in TemplateSet.sites order


@dataclass(frozen=True)
class Template:
    """The best layout of one pipeline for a stages(=devices)-per-site vector.

    Times are for this pipeline alone (``D = 1``: it holds all the Adam state and has every
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
        self.codecs = dict(codecs)
        self.plan_delta_n = dict(plan_delta_n or {})
        self.num_layers = num_layers(spec.model.n_layer)
        gbs = spec.training.global_batch_size
        if gbs % micro_batch_size:
            raise ValueError(
                f"global batch {gbs} is not divisible by micro-batch {micro_batch_size}"
            )
        self.num_microbatches = gbs // micro_batch_size  # the whole batch on one pipeline
        self.templates: dict[Vector, Template] = {}
        self.exhaustive = False
        self.predictor = LayoutPredictor(
            spec, micro_batch_size, seq_len, schedule, codecs, plan_delta_n
        )
        self._orders: dict[frozenset[str], tuple[str, ...] | None] = {}
        self._predictions: dict[tuple[Vector, int, int], Prediction | None] = {}
        self.uniform_choices: dict[tuple[Vector, int], tuple[Template, int] | None] = {}
        # mixes.best_mix's answers (a MixChoice or None) by (alive, micro-batches, running
        # layer split): a recovery weighs many failures over few device counts
        self.mix_choices: dict[tuple, object] = {}

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
        deepest sites give up stages (:func:`geopipe.optimizer.shapes.trim_to_layers`, as
        the planner's shapes) until the pipeline is no deeper than the model has layers.
        """
        if any(0 < n < pipelines for n in devices):
            return None
        per = {s: n // pipelines for s, n in zip(self.sites, devices, strict=True)}
        if not trim_to_layers(per, self.sites, self.num_layers):
            return None
        v = tuple(per[s] for s in self.sites)
        return v if self.stage_sites(v) is not None else None

    # -- predictions -----------------------------------------------------------------------
    def predict(self, v: Vector, pipelines: int, num_microbatches: int) -> Prediction | None:
        """Predict ``pipelines`` copies of vector ``v`` each running ``num_microbatches``.

        None if ``v`` has no valid layout. Memoised.
        """
        key = (v, pipelines, num_microbatches)
        if key not in self._predictions:
            stage_sites = self.stage_sites(v)
            ok = stage_sites is not None and pipelines >= 1 and num_microbatches >= 1
            self._predictions[key] = (
                self.predictor.predict(stage_sites, pipelines, num_microbatches) if ok else None
            )
        return self._predictions[key]

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
            partition=self.partition_of(stage_sites),
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

    def partition_of(self, stage_sites: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
        """A layout's layer ranges: balanced for the sites' device speeds."""
        return partition_for(self.spec, stage_sites, self.seq_len)

    def lower_bound(self, v: Vector, pipelines: int, num_microbatches: int) -> float:
        """A cheap bound no prediction of this layout can beat (the simulator's)."""
        stage_sites = self.stage_sites(v)
        if stage_sites is None:
            return math.inf
        return self.predictor.lower_bound(stage_sites, pipelines, num_microbatches)

    def plan_for(self, template: Template, pipelines: int, num_microbatches: int) -> Plan:
        """The runtime's plan for ``pipelines`` identical copies of ``template``."""
        pr = self.predict(template.stages_per_site, pipelines, num_microbatches)
        if pr is None:
            raise ValueError(f"template {template.stages_per_site} has no valid layout")
        return build_plan(
            self.spec,
            template.stage_sites,
            partition=template.partition,
            pipelines=pipelines,
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
            raise PlanningError(f"no micro-batch size divides the global batch {gbs}")
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
# The uniform choice (what the runtime runs)


def check_batch(ts: TemplateSet, global_batch: int | None, micro_batch: int | None) -> int:
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
    total = check_batch(ts, global_batch, micro_batch)
    alive = ts.vector(devices_alive)
    key = (alive, total)
    if key in ts.uniform_choices:
        return ts.uniform_choices[key]
    pairs: list[tuple[float, Vector, int]] = []
    for v in ts.candidate_vectors(alive):
        for d in range(1, copies(v, alive) + 1):
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
    ts.uniform_choices[key] = result
    return result


def copies(v: Vector, devices: Vector) -> int:
    """How many pipelines of ``v`` fit in ``devices``."""
    return min((a // n for a, n in zip(devices, v, strict=True) if n), default=0)
