"""The plan's shape: ``D`` pipelines × ``p`` stages laid over the sites.

A plan is pure data. Sites are visited in one order along the pipeline (chosen so the
pipeline's hops are as cheap as possible); each site hosts a contiguous run of stages;
stage ``k``'s ``D`` replicas all live in ``site(k)`` and form its ZeRO-1 group, so gradient
reduction never crosses a WAN link: only activations and their gradients do. A site needs
``D × (stages it hosts)`` devices. The layer partition balances the stages' compute for
their sites' device speeds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache

from geopipe.config import ClusterSpec
from geopipe.optimizer.costs import layer_forward_flops
from geopipe.pipeline.partition import balanced_partition, order_sites
from geopipe.transport.wire import transfer_time

__all__ = ["Plan", "Shape", "candidate_shapes", "site_order"]

_NOMINAL_MESSAGE_BYTES = 4 << 20  # ranks site orders by latency + a 4 MiB activation's time


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
class Plan:
    """Everything the runtime needs to lay out and run one training job."""

    pipelines: int
    stage_sites: tuple[str, ...]
    partition: tuple[tuple[int, int], ...]
    micro_batch_size: int
    seq_len: int
    num_microbatches: int
    schedule: str
    delta_n: tuple[int, ...]  # one per boundary (0 inside a site)
    codecs: tuple[str, ...]  # one per boundary ("none" inside a site)

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
        return f"geopipe/{run}/{self.stage_sites[stage]}/stage{stage}/r{replica}"

    def to_dict(self) -> dict:
        return asdict(self)

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
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def site_order(spec: ClusterSpec) -> list[str]:
    """Sites in pipeline order: the cheapest chain over the links (both directions)."""

    def hop(a: str, b: str) -> float | None:
        fwd, back = spec.link(a, b), spec.link(b, a)
        if fwd is None or back is None:
            return None
        return sum(
            transfer_time(_NOMINAL_MESSAGE_BYTES, lk.bandwidth_bps, lk.latency_s, lk.loss)
            for lk in (fwd, back)
        )

    return order_sites([s.name for s in spec.sites], hop)


def candidate_shapes(spec: ClusterSpec, pipelines: list[int] | None = None) -> list[Shape]:
    """One shape per feasible data-parallel degree ``D``.

    With ``D`` pipelines a site of ``N`` devices hosts ``N // D`` stages (all of a stage's
    replicas in that site). Every site must host at least one stage; if the pipeline would
    be deeper than the model has layers, the sites with the most stages give some up.
    """
    order = site_order(spec)
    n_layers = spec.model.n_layer + 2
    devices = {s.name: s.devices for s in spec.sites}
    max_d = min(devices.values())
    ds = pipelines if pipelines is not None else list(range(1, max_d + 1))
    shapes: list[Shape] = []
    for d in ds:
        if d < 1 or d > max_d:
            continue
        per_site = {name: devices[name] // d for name in order}
        while sum(per_site.values()) > n_layers:
            name = max(order, key=lambda n: (per_site[n], n))
            if per_site[name] == 1:
                break
            per_site[name] -= 1
        if sum(per_site.values()) > n_layers:
            continue
        stage_sites = tuple(name for name in order for _ in range(per_site[name]))
        shape = Shape(d, stage_sites)
        if shape not in shapes:
            shapes.append(shape)
    return shapes


@lru_cache(maxsize=4096)
def _partition_cached(
    flops: tuple[float, ...], speeds: tuple[float, ...]
) -> tuple[tuple[int, int], ...]:
    return tuple(balanced_partition(flops, speeds))


def partition_for(spec: ClusterSpec, shape: Shape, seq_len: int) -> tuple[tuple[int, int], ...]:
    """Layer ranges per stage balanced for the stage sites' device speeds."""
    flops = tuple(layer_forward_flops(spec.model, seq_len))
    speeds = tuple(spec.site(s).flops_per_s for s in shape.stage_sites)
    return _partition_cached(flops, speeds)
