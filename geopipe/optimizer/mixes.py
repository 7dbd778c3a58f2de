"""Mixed pipelines the runtime can run: templates over one shared layer split.

Oobleck instantiates a *mix* of pipeline templates so that every surviving device works at
its best depth. :func:`geopipe.optimizer.instantiate.instantiate` finds the mix for a set
of templates that agree on every layer's site; here the set is made so. A
:class:`SplitTemplateSet` fixes how many layers each site hosts (a *layer split*) and lays
every vector's stages over it — each site's layers balanced among its stages — so any two of
its templates can be mixed: each layer's replicas stay in one site and no gradient reduction
crosses a WAN link (the runtime's groups: :mod:`geopipe.runtime.actor.sitegroups`).

[Note: which splits] The split decides how much work each site carries. :func:`best_mix`
starts from the splits of the fastest templates that fit the alive devices (each balanced
for its own vector) and the running plan's, at most :data:`MAX_SPLITS` of them, then moves
one layer at a time across a site boundary while the mix gets faster (a local search; the
test checks it against every split of a two-site cluster). On 2 sites × 4 devices that
lost one device this finds two pipelines of different depth in the west-heavier split
(see ``benchmarks/recovery.py``).

[Note: what a mix costs that the prediction leaves out] An actor whose layers are cut
differently by another pipeline holds its ZeRO-1 group's union of layers (weights and
gradients; Adam state stays sharded) and reduces it inside its site. The predictions are
the templates' own (memory per stage), so :func:`best_mix` adds what the union costs each
such actor and drops mixes that would not fit (:func:`union_overflow`), and asks a mix to
beat the best identical pipelines by ``plan.min_gain.mixed_pipelines`` (its wider
intra-site reductions are not in the time either).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from geopipe.config import GiB
from geopipe.model.sizes import (
    adam_bytes_per_param,
    elem_bytes,
    layer_forward_flops,
    layer_param_counts,
)
from geopipe.optimizer.instantiate import Instantiation, instantiate
from geopipe.optimizer.templates import TemplateSet, Vector, best_uniform, check_batch
from geopipe.pipeline.partition import balanced_partition
from geopipe.plan import PipelineLayout, Plan

__all__ = [
    "MAX_SPLITS",
    "MixChoice",
    "SplitTemplateSet",
    "best_mix",
    "layer_split",
    "mixed_plan",
]

MAX_SPLITS = 6
MAX_SPLIT_MOVES = 8  # layer moves of the local search over splits
_MAX_VECTORS = 64  # every vector of a split while there are at most this many

LayerSplit = tuple[tuple[str, int], ...]  # (site, layers it hosts), in pipeline order


def layer_split(stage_sites: tuple[str, ...], partition: tuple[tuple[int, int], ...]) -> LayerSplit:
    """How many layers each site of a layout hosts, in pipeline order."""
    out: list[tuple[str, int]] = []
    for site, (a, z) in zip(stage_sites, partition, strict=True):
        if out and out[-1][0] == site:
            out[-1] = (site, out[-1][1] + z - a)
        else:
            out.append((site, z - a))
    return tuple(out)


class SplitTemplateSet(TemplateSet):
    """The templates of ``base``'s settings whose stages all lay over ``split``."""

    def __init__(self, base: TemplateSet, split: LayerSplit) -> None:
        super().__init__(
            base.spec,
            dict(zip(base.sites, base.devices, strict=True)),
            base.micro_batch_size,
            base.seq_len,
            base.schedule,
            base.codecs,
            base.plan_delta_n,
        )
        self.split = split
        self.layers = dict(split)
        self.predictor.partition_of = self.partition_of
        self._flops = tuple(layer_forward_flops(self.spec.model, self.seq_len))

    def stage_sites(self, v: Vector) -> tuple[str, ...] | None:
        per = dict(zip(self.sites, v, strict=True)) if len(v) == len(self.sites) else {}
        if {s for s, n in per.items() if n} != set(self.layers):
            return None
        if any(per[s] > n for s, n in self.layers.items()):
            return None
        return tuple(s for s, _ in self.split for _ in range(per[s]))

    def partition_of(self, stage_sites: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
        """Each site's layers balanced among its stages (one device kind per site)."""
        counts = tuple(sum(1 for x in stage_sites if x == s) for s, _ in self.split)
        return _split_partition(self._flops, tuple(n for _, n in self.split), counts)

    def candidate_vectors(self, devices: Vector) -> list[Vector]:
        """Every vector over the split within ``devices`` while there are few, else the
        deepest for each pipeline count and those with one stage fewer in one site."""
        idx = [self.sites.index(s) for s in self.layers]
        caps = {i: min(self.layers[self.sites[i]], devices[i]) for i in idx}
        if any(c < 1 for c in caps.values()):
            return []
        if math.prod(caps.values()) <= _MAX_VECTORS:
            combos = itertools.product(*(range(1, caps[i] + 1) for i in idx))
        else:
            combos = set()
            for d in range(1, max(caps.values()) + 1):
                top = [max(1, min(caps[i], devices[i] // d)) for i in idx]
                combos.add(tuple(top))
                for j, n in enumerate(top):
                    if n > 1:
                        combos.add((*top[:j], n - 1, *top[j + 1 :]))
        out = []
        for c in combos:
            v = [0] * len(self.sites)
            for i, n in zip(idx, c, strict=True):
                v[i] = n
            out.append(tuple(v))
        return sorted(out)


@lru_cache(maxsize=256)
def _split_partition(
    flops: tuple[float, ...], layers: tuple[int, ...], stages: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    lo = 0
    for n_layers, n_stages in zip(layers, stages, strict=True):
        part = balanced_partition(flops[lo : lo + n_layers], [1.0] * n_stages)
        out += [(lo + a, lo + z) for a, z in part]
        lo += n_layers
    return tuple(out)


@dataclass(frozen=True)
class MixChoice:
    """The fastest mix found, as the plan the runtime runs."""

    plan: Plan
    iteration_time_s: float
    instantiation: Instantiation


def mixed_plan(ts: TemplateSet, inst: Instantiation) -> Plan:
    """The runtime's plan for an instantiation over ``ts`` (pipelines deepest first)."""
    k = len(inst.pipelines)
    pipes = []
    for pa in inst.pipelines:
        t = pa.template
        pr = ts.predict(t.stages_per_site, k, pa.num_microbatches)
        assert pr is not None
        one = ts.predictor.plan(t.stage_sites, k, pa.num_microbatches, pr.delta_n)
        pipes.append(
            PipelineLayout(
                one.stage_sites,
                one.partition,
                pa.num_microbatches,
                one.delta_n,
                one.codecs,
                one.inflight_caps,
            )
        )
    pipes.sort(key=lambda p: -len(p.stage_sites))
    p0 = pipes[0]
    return Plan(
        pipelines=k,
        stage_sites=p0.stage_sites,
        partition=p0.partition,
        micro_batch_size=ts.micro_batch_size,
        seq_len=ts.seq_len,
        num_microbatches=p0.num_microbatches,
        schedule=ts.schedule,
        delta_n=p0.delta_n,
        codecs=p0.codecs,
        inflight_caps=p0.inflight_caps,
        mix=tuple(pipes),
    )


def best_mix(
    ts: TemplateSet,
    devices_alive: Mapping[str, int],
    global_batch: int | None = None,
    micro_batch: int | None = None,
    running: Plan | None = None,
) -> MixChoice | None:
    """The fastest mix over ``devices_alive`` ([Note: which splits]): different templates,
    or identical ones with unequal shares of the batch (a pipeline count that does not
    divide it); None when no split has one (:func:`best_uniform` covers the rest)."""
    total = check_batch(ts, global_batch, micro_batch)
    alive = ts.vector(devices_alive)
    now = layer_split(running.stage_sites, running.partition) if running is not None else None
    key = (alive, total, now)
    if key not in ts.mix_choices:
        ts.mix_choices[key] = _best_mix(ts, alive, total, now)
    return ts.mix_choices[key]  # type: ignore[return-value]


def _best_mix(
    ts: TemplateSet, alive: tuple[int, ...], total: int, running: LayerSplit | None
) -> MixChoice | None:
    devices_alive = dict(zip(ts.sites, alive, strict=True))
    used = {s for s, n in zip(ts.sites, alive, strict=True) if n}
    ranked: dict[LayerSplit, float] = {}
    for v in ts.candidate_vectors(alive):
        t = ts.template(v)
        if t is not None and t.feasible:
            split = layer_split(t.stage_sites, t.partition)
            ranked[split] = min(ranked.get(split, math.inf), t.iteration_time_s)
    splits = sorted(ranked, key=ranked.__getitem__)[:MAX_SPLITS]
    if running is not None and {s for s, _ in running} == used and running not in splits:
        splits.append(running)
    gb = total * ts.micro_batch_size
    tried: dict[LayerSplit, MixChoice | None] = {}

    def at(split: LayerSplit) -> MixChoice | None:
        if split not in tried:
            sts = SplitTemplateSet(ts, split)
            inst = instantiate(sts, devices_alive, gb, ts.micro_batch_size)
            equal = inst is not None and len({p.num_microbatches for p in inst.pipelines}) == 1
            if inst is None or (inst.uniform and equal):
                tried[split] = None  # identical pipelines, equal shares: best_uniform's
            else:
                plan = mixed_plan(sts, inst)
                fits = not union_overflow(sts, plan)
                tried[split] = MixChoice(plan, inst.iteration_time_s, inst) if fits else None
        return tried[split]

    def time_of(split: LayerSplit) -> float:
        got = at(split)
        return got.iteration_time_s if got is not None else math.inf

    best = min(splits, key=time_of, default=None)
    # Then move one layer across one site boundary at a time while that helps.
    for _ in range(MAX_SPLIT_MOVES):
        if best is None:
            break
        step = min(_neighbours(best), key=time_of, default=None)
        if step is None or not time_of(step) < time_of(best) * (1 - 1e-9):
            break
        best = step
    return at(best) if best is not None else None


def _neighbours(split: LayerSplit) -> list[LayerSplit]:
    """The splits one layer away: across each boundary between adjacent sites."""
    out = []
    for j in range(len(split) - 1):
        for move in (-1, 1):
            counts = [n for _, n in split]
            counts[j] += move
            counts[j + 1] -= move
            if min(counts) >= 1:
                out.append(tuple((s, n) for (s, _), n in zip(split, counts, strict=True)))
    return out


def union_overflow(ts: TemplateSet, plan: Plan) -> list[tuple[int, int]]:
    """Actors of a mixed ``plan`` that would not fit their device once their engine holds
    their ZeRO-1 group's union of layers ([Note: what a mix costs that the prediction
    leaves out]): the template's predicted peak for the stage, plus the weights and
    gradients of the layers it holds but does not run, plus the change in its Adam shard
    (the union over the group's size instead of its own layers over the pipelines)."""
    spec = ts.spec
    prec = spec.training.precision
    counts = layer_param_counts(spec.model)
    held, k = plan.held_layers(), plan.pipelines
    sizes = {key: len(g) for groups in plan.shared_groups().values() for g in groups for key in g}
    limit = {s.name: s.device_memory_gb * GiB for s in spec.sites}
    over = []
    for r in range(plan.pipelines):
        one = plan.pipeline(r)
        v = tuple(one.stage_sites.count(site) for site in ts.sites)
        pr = ts.predict(v, k, one.num_microbatches)
        if pr is None:
            continue
        for j, (a, z) in enumerate(one.partition):
            lo, hi = held[(j, r)]
            own, union = sum(counts[a:z]), sum(counts[lo:hi])
            extra = (union - own) * 2 * elem_bytes(prec)
            extra += adam_bytes_per_param(prec) * (union / sizes[(j, r)] - own / k)
            if pr.peak_memory_bytes[j] + extra > limit[one.stage_sites[j]]:
                over.append((j, r))
    return over


def uniform_time(
    ts: TemplateSet, devices_alive: Mapping[str, int], global_batch: int, micro_batch: int
) -> float:
    """Predicted iteration time of :func:`best_uniform`'s choice (inf if none fits)."""
    choice = best_uniform(ts, devices_alive, global_batch, micro_batch)
    if choice is None:
        return math.inf
    t, d = choice
    pr = ts.predict(t.stages_per_site, d, global_batch // (micro_batch * d))
    return math.inf if pr is None else pr.iteration_time_s
