"""The plan's shape: ``D`` pipelines × ``p`` stages laid over the sites.

A plan is pure data (this module imports nothing from geopipe; the planner builds plans in
:mod:`geopipe.optimizer.shapes`). Sites are visited in one order along the pipeline; each
site hosts a contiguous run of stages; stage ``k``'s ``D`` replicas all live in ``site(k)``
and form its ZeRO-1 group, so gradient reduction never crosses a WAN link: only activations
and their gradients do. A site needs ``D × (stages it hosts)`` devices.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

__all__ = ["ActorKey", "PipelineLayout", "Plan", "Shape"]

# One stage actor of a plan: (stage k, pipeline r). In a uniform plan the pipeline is the
# stage's replica; a mixed plan's pipelines are ordered so that r < replicas(k) ([Note:
# heterogeneous plans]).
ActorKey = tuple[int, int]


@dataclass(frozen=True)
class Shape:
    """How many pipelines, and which site hosts each stage (in pipeline order)."""

    pipelines: int
    stage_sites: tuple[str, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_sites)

    @property
    def wan_boundaries(self) -> tuple[int, ...]:
        """Boundaries ``j`` (stage j -> j+1) that cross from one site to another."""
        s = self.stage_sites
        return tuple(j for j in range(len(s) - 1) if s[j] != s[j + 1])

    @property
    def sites(self) -> tuple[str, ...]:
        out: list[str] = []
        for s in self.stage_sites:
            if not out or out[-1] != s:
                out.append(s)
        return tuple(out)


@dataclass(frozen=True)
class PipelineLayout:
    """One pipeline of a heterogeneous plan: its stages and its share of the batch."""

    stage_sites: tuple[str, ...]
    partition: tuple[tuple[int, int], ...]
    num_microbatches: int
    delta_n: tuple[int, ...]
    codecs: tuple[str, ...]
    inflight_caps: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, d: dict) -> PipelineLayout:
        return cls(
            stage_sites=tuple(d["stage_sites"]),
            partition=tuple(tuple(x) for x in d["partition"]),
            num_microbatches=int(d["num_microbatches"]),
            delta_n=tuple(int(x) for x in d["delta_n"]),
            codecs=tuple(d["codecs"]),
            inflight_caps=tuple(int(x) for x in d.get("inflight_caps", ())),
        )


@dataclass(frozen=True)
class Plan:
    """Everything the runtime needs to lay out and run one training job.

    [Note: heterogeneous plans] A plan is normally ``pipelines`` identical pipelines. After
    a failure the planner may mix templates (Oobleck's instantiation): then ``mix`` lists
    every pipeline (deepest first, so the pipelines that have a stage ``k`` are always
    ``0 .. replicas(k) - 1``) with its own stages and share of the micro-batches, and the
    top-level per-stage fields are pipeline 0's, which covers every layer once (it writes
    the checkpoint shards). Code that addresses actor ``(stage k, pipeline r)`` asks
    :meth:`pipeline`, :meth:`site_of` and :meth:`layers_of`; all of them also answer for
    uniform plans, so one code path serves both.
    """

    pipelines: int
    stage_sites: tuple[str, ...]
    partition: tuple[tuple[int, int], ...]
    micro_batch_size: int
    seq_len: int
    num_microbatches: int
    schedule: str
    delta_n: tuple[int, ...]  # one per boundary (0 inside a site)
    codecs: tuple[str, ...]  # one per boundary ("none" inside a site)
    # lookahead-zb only: per stage, the micro-batches in flight (forward run, weight gradient
    # not yet) its device holds, which bounds how far W is deferred; () = no memory bound.
    inflight_caps: tuple[int, ...] = ()
    mix: tuple[PipelineLayout, ...] = ()  # heterogeneous pipelines (see the note); () = uniform
    # [Note: replica groups] The outer loop's group of each pipeline (a mixed plan's; () =
    # one group, synchronous). A group's pipelines reduce their gradients together every
    # step (ZeRO-1 inside each site, as any plan); different groups sit on different sites,
    # never share a reduction, and meet only in the outer loop every H steps. Pipelines are
    # listed group by group, so group g trains on one contiguous slice of each global batch
    # (first_microbatch), and a gradient's mean is over its own group's micro-batches.
    # The ids are stable: 0 .. M-1 at launch, and a plan without lost groups
    # (geopipe.runtime.control.outerfail.without_groups) keeps the survivors' own (its
    # actors keep them for their data slices and outer keys), so they may start past 0 and
    # skip some: iterate over group_ids (range(num_groups) is right for launch plans only).
    groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mix:
            depths = [len(p.stage_sites) for p in self.mix]
            if self.pipelines != len(self.mix):
                raise ValueError("a mixed plan lists its pipelines one each")
            if depths != sorted(depths, reverse=True) and not self.groups:
                raise ValueError("a mixed plan lists its pipelines deepest first")
        if self.groups:
            g = list(self.groups)
            if not self.mix or len(g) != self.pipelines or g != sorted(g) or g[0] < 0:
                raise ValueError("groups: a mixed plan's, one per pipeline, ids in order")
            sites = [set(self.mix[r].stage_sites) for r in range(self.pipelines)]
            for r in range(self.pipelines):
                for q in range(r):
                    if g[q] != g[r] and sites[q] & sites[r]:
                        raise ValueError("replica groups must sit on different sites")

    @property
    def group_ids(self) -> tuple[int, ...]:
        """The stable ids of this plan's replica groups, in order (``(0,)`` for one)."""
        return tuple(dict.fromkeys(self.groups)) if self.groups else (0,)

    @property
    def num_groups(self) -> int:
        """Replica groups joined by the outer loop (1: synchronous training)."""
        return len(self.group_ids)

    def group_of(self, r: int) -> int:
        """The stable id of the group of this plan's pipeline ``r`` (its position here)."""
        return self.groups[r] if self.groups else 0

    def group_microbatches(self, g: int) -> int:
        """Micro-batches of one inner step of group ``g`` (all of them for one group)."""
        return sum(self.microbatches_of(r) for r in range(self.pipelines) if self.group_of(r) == g)

    @property
    def heterogeneous(self) -> bool:
        return bool(self.mix)

    def pipeline(self, r: int) -> Plan:
        """Pipeline ``r`` alone, as a one-pipeline plan (what its actors run)."""
        if not 0 <= r < self.pipelines:
            raise ValueError(f"pipeline {r} is not in a plan of {self.pipelines}")
        if not self.mix:
            return replace(self, pipelines=1)
        p = self.mix[r]
        return replace(
            self,
            pipelines=1,
            stage_sites=p.stage_sites,
            partition=p.partition,
            num_microbatches=p.num_microbatches,
            delta_n=p.delta_n,
            codecs=p.codecs,
            inflight_caps=p.inflight_caps,
            mix=(),
            groups=(),
        )

    def microbatches_of(self, r: int) -> int:
        return self.mix[r].num_microbatches if self.mix else self.num_microbatches

    @property
    def total_microbatches(self) -> int:
        """Micro-batches of one optimizer step over all pipelines (the global batch)."""
        return sum(self.microbatches_of(r) for r in range(self.pipelines))

    def first_microbatch(self, r: int) -> int:
        """Index in the global batch of pipeline ``r``'s first micro-batch (pipelines take
        consecutive slices, in order)."""
        return sum(self.microbatches_of(i) for i in range(r))

    def depth(self, r: int) -> int:
        return len(self.mix[r].stage_sites) if self.mix else self.num_stages

    def replicas(self, k: int) -> int:
        """How many pipelines have a stage ``k`` (pipelines ``0 .. replicas(k) - 1``)."""
        return sum(1 for r in range(self.pipelines) if self.depth(r) > k)

    def actors(self) -> list[tuple[int, int]]:
        """Every ``(stage, pipeline)`` of the layout, stage by stage."""
        return [(k, r) for k in range(self.num_stages) for r in range(self.replicas(k))]

    def site_of(self, k: int, r: int) -> str:
        return self.mix[r].stage_sites[k] if self.mix else self.stage_sites[k]

    def layers_of(self, k: int, r: int) -> tuple[int, int]:
        return tuple(self.mix[r].partition[k]) if self.mix else tuple(self.partition[k])

    def shared_groups(self) -> dict[str, list[list[tuple[int, int]]]]:
        """Per site, the actors linked by shared layers (connected components), each in
        :meth:`actors` order: a layer's gradient is reduced over every actor that runs it,
        so each group is one ZeRO-1 group ([Note: ZeRO-1 groups of a mixed plan] in
        geopipe.runtime.actor.sitegroups). Identical pipelines: one group per stage."""
        out: dict[str, list[list[tuple[int, int]]]] = {}
        for site in dict.fromkeys(self.site_of(*key) for key in self.actors()):
            members = [key for key in self.actors() if self.site_of(*key) == site]
            ranges = [self.layers_of(*key) for key in members]
            parent = list(range(len(members)))
            for i, (a, z) in enumerate(ranges):
                for j in range(i):
                    b, y = ranges[j]
                    if a < y and b < z:  # they share a layer: one group
                        parent[_root(parent, i)] = _root(parent, j)
            comps: dict[int, list[tuple[int, int]]] = {}
            for i, key in enumerate(members):
                comps.setdefault(_root(parent, i), []).append(key)
            out[site] = sorted(comps.values(), key=lambda g: members.index(g[0]))
        return out

    def held_layers(self) -> dict[tuple[int, int], tuple[int, int]]:
        """The layers each actor's engine holds: its group's union (its own, unless a mix
        cuts its site's layers differently)."""
        out = {}
        for groups in self.shared_groups().values():
            for g in groups:
                lo = min(self.layers_of(*key)[0] for key in g)
                hi = max(self.layers_of(*key)[1] for key in g)
                out.update(dict.fromkeys(g, (lo, hi)))
        return out

    def describe(self) -> str:
        """``2 pipeline(s) × 4 stages``, or for a mix each pipeline's depth."""
        if self.groups:
            return (
                f"{self.num_groups} replica groups of {self.pipelines // self.num_groups} "
                f"pipeline(s) × {self.num_stages} stages (outer loop)"
            )
        if not self.mix:
            return f"{self.pipelines} pipeline(s) × {self.num_stages} stages"
        depths = ", ".join(str(len(p.stage_sites)) for p in self.mix)
        return f"{self.pipelines} pipelines of {depths} stages (mixed templates)"

    @property
    def shape(self) -> Shape:
        return Shape(self.pipelines, self.stage_sites)

    @property
    def num_stages(self) -> int:
        return len(self.stage_sites)

    @property
    def wan_boundaries(self) -> tuple[int, ...]:
        return self.shape.wan_boundaries

    def actor_name(self, run: str, stage: int, replica: int) -> str:
        return f"geopipe/{run}/{self.site_of(stage, replica)}/stage{stage}/r{replica}"

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.mix:  # uniform plans keep their long-standing JSON form
            del d["mix"]
        if not self.groups:  # and one group is every plan before the outer loop
            del d["groups"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(
            pipelines=int(d["pipelines"]),
            stage_sites=tuple(d["stage_sites"]),
            partition=tuple(tuple(x) for x in d["partition"]),
            micro_batch_size=int(d["micro_batch_size"]),
            seq_len=int(d["seq_len"]),
            num_microbatches=int(d["num_microbatches"]),
            schedule=str(d["schedule"]),
            delta_n=tuple(int(x) for x in d["delta_n"]),
            codecs=tuple(d["codecs"]),
            inflight_caps=tuple(int(x) for x in d.get("inflight_caps", ())),
            mix=tuple(PipelineLayout.from_dict(x) for x in d.get("mix", ())),
            groups=tuple(int(x) for x in d.get("groups", ())),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _root(parent: list[int], i: int) -> int:
    """Union-find root of ``i`` (with path halving)."""
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i
