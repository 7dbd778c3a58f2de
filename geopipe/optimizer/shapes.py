"""Where a plan's stages go: the site order, the candidate shapes, the layer partition, and
the one builder of :class:`~geopipe.plan.Plan` objects.

Sites are visited in one order along the pipeline (chosen so the pipeline's hops are as
cheap as possible); with ``D`` pipelines a site of ``N`` devices hosts ``N // D`` stages. The
layer partition balances the stages' compute for their sites' device speeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

from geopipe.config import ClusterSpec
from geopipe.model.sizes import layer_forward_flops, num_layers
from geopipe.optimizer.memory import inflight_caps
from geopipe.pipeline.partition import balanced_partition, order_sites
from geopipe.pipeline.schedule import family
from geopipe.plan import Plan, Shape
from geopipe.transport.wire import transfer_time

__all__ = ["build_plan", "candidate_shapes", "partition_for", "site_order", "trim_to_layers"]

_NOMINAL_MESSAGE_BYTES = 4 << 20  # ranks site orders by latency + a 4 MiB activation's time


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


def trim_to_layers(per_site: dict[str, int], order: Sequence[str], layers: int) -> bool:
    """Take stages from the deepest sites (ties: the larger name) until the pipeline is no
    deeper than the model has layers; a site keeps at least one. False if it cannot."""
    while sum(per_site.values()) > layers:
        name = max(order, key=lambda n: (per_site[n], n))
        if per_site[name] <= 1:
            return False
        per_site[name] -= 1
    return True


def candidate_shapes(spec: ClusterSpec, pipelines: list[int] | None = None) -> list[Shape]:
    """One shape per feasible data-parallel degree ``D``.

    With ``D`` pipelines a site of ``N`` devices hosts ``N // D`` stages (all of a stage's
    replicas in that site). Every site must host at least one stage; if the pipeline would
    be deeper than the model has layers, the sites with the most stages give some up.
    """
    order = site_order(spec)
    n_layers = num_layers(spec.model.n_layer)
    devices = {s.name: s.devices for s in spec.sites}
    max_d = min(devices.values())
    ds = pipelines if pipelines is not None else list(range(1, max_d + 1))
    shapes: list[Shape] = []
    for d in ds:
        if d < 1 or d > max_d:
            continue
        per_site = {name: devices[name] // d for name in order}
        if not trim_to_layers(per_site, order, n_layers):
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


def partition_for(
    spec: ClusterSpec, stage_sites: Sequence[str], seq_len: int
) -> tuple[tuple[int, int], ...]:
    """Layer ranges per stage balanced for the stage sites' device speeds."""
    flops = tuple(layer_forward_flops(spec.model, seq_len))
    speeds = tuple(spec.site(s).flops_per_s for s in stage_sites)
    return _partition_cached(flops, speeds)


def build_plan(
    spec: ClusterSpec,
    stage_sites: Sequence[str],
    *,
    pipelines: int,
    micro_batch_size: int,
    seq_len: int,
    num_microbatches: int,
    schedule: str,
    delta_n: Sequence[int],
    codecs: Sequence[str],
    partition: Sequence[tuple[int, int]] = (),
) -> Plan:
    """The plan of ``pipelines`` copies of one layout, its partition balanced for the sites
    (``delta_n`` and ``codecs``: one per stage boundary, 0 and "none" inside a site). A
    ``lookahead-zb`` plan carries each stage's in-flight cap from its device memory.
    ``partition`` overrides the balanced one (a mixed plan's templates share a layer split)."""
    plan = Plan(
        pipelines=pipelines,
        stage_sites=tuple(stage_sites),
        partition=tuple(partition) or partition_for(spec, stage_sites, seq_len),
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        num_microbatches=num_microbatches,
        schedule=schedule,
        delta_n=tuple(delta_n),
        codecs=tuple(codecs),
    )
    if family(schedule).memory_caps:
        plan = replace(plan, inflight_caps=tuple(inflight_caps(spec, plan)))
    return plan
