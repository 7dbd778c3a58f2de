"""The plan's shape: ``D`` pipelines × ``p`` stages laid over the sites.

A plan is pure data (this module imports nothing from geopipe; the planner builds plans in
:mod:`geopipe.optimizer.shapes`). Sites are visited in one order along the pipeline; each
site hosts a contiguous run of stages; stage ``k``'s ``D`` replicas all live in ``site(k)``
and form its ZeRO-1 group, so gradient reduction never crosses a WAN link: only activations
and their gradients do. A site needs ``D × (stages it hosts)`` devices.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

__all__ = ["Plan", "Shape"]


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
    # lookahead-zb only: per stage, the micro-batches in flight (forward run, weight gradient
    # not yet) its device holds, which bounds how far W is deferred; () = no memory bound.
    inflight_caps: tuple[int, ...] = ()

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
            inflight_caps=tuple(int(x) for x in d.get("inflight_caps", ())),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)
