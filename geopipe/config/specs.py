"""The typed, frozen specs a cluster YAML validates into (pydantic models), with the limits
and defaults they enforce. Relations between fields are checked in :mod:`.checks`."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "MAX_DELTA_N",
    "MAX_GA_POPULATION",
    "MAX_GLOBAL_BATCH",
    "MAX_LAYERS",
    "MAX_SITE_DEVICES",
    "RECOVERY_SNAPSHOTS_KEPT",
    "CheckpointSpec",
    "Choice",
    "ClusterSpec",
    "ConfigError",
    "GASpec",
    "LinkSpec",
    "ModelSpec",
    "PlanSpec",
    "Range",
    "RaySpec",
    "SiteSpec",
    "TrainingSpec",
]

GBPS = 1e9  # bits per second in one Gbit/s
GB = 1 << 30  # bytes in one GiB (device memory is quoted in GiB)

# Upper bounds on values whose typos would make the planner allocate per-unit lists (layers,
# devices, micro-batches, ΔN candidates, GA individuals) until memory runs out. Each is far
# beyond any real run.
MAX_LAYERS = 10_000  # transformer blocks (the largest published models have ~100-200)
MAX_SITE_DEVICES = 1 << 17  # devices in one site (about the largest single clusters)
MAX_GLOBAL_BATCH = 1 << 16  # sequences per step; the schedule has one entry per micro-batch
# ΔN counts extra micro-batches in flight (each holds its activations); above this it only
# slows the search. It also keeps `delta_n: {min, max}` from expanding to a huge list.
MAX_DELTA_N = 1024
MAX_GA_POPULATION = 10_000

# Step boundaries each replica keeps in host RAM while `training.recovery_snapshots` is on: the
# newest complete one, and the one before it in case a failure strikes while the newest is
# still being gathered. The runtime keeps this many (runtime/stage.py) and the planner's
# host-memory check counts them (TrainingSpec.snapshots_kept): one number for both.
RECOVERY_SNAPSHOTS_KEPT = 2


class ConfigError(ValueError):
    """A cluster YAML is invalid. ``problems`` holds ``(field_path, message)`` pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [
            f"{source}: {path}: {msg}" if path else f"{source}: {msg}" for path, msg in problems
        ]
        super().__init__("\n".join(lines))


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Range(_Spec):
    """An inclusive integer range searched by the planner."""

    min: int = Field(ge=0)
    max: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        return self


# A planner knob is fixed (an int), a list of candidates, or an inclusive range.
Choice = int | list[int] | Range


class RaySpec(_Spec):
    address: str = Field("local", description="'local' (embedded), 'auto' or host:port")
    dashboard: bool = True
    dashboard_port: int = Field(8265, ge=1, le=65535)
    emulate_links: bool | None = Field(
        None, description="emulate WAN links in user space (default: on for address 'local')"
    )
    auth: Literal["token", "disabled"] = "token"
    namespace: str = "geopipe"

    @property
    def links_emulated(self) -> bool:
        return self.address == "local" if self.emulate_links is None else self.emulate_links


class SiteSpec(_Spec):
    name: str = Field(min_length=1)
    nodes: int = Field(ge=1)
    devices_per_node: int = Field(ge=1)
    device_memory_gb: float = Field(gt=0)
    device_tflops: float = Field(gt=0, description="peak dense TFLOP/s of one device")
    device_efficiency: float = Field(0.4, gt=0, le=1, description="achieved fraction of peak")
    backward_forward_ratio: float = Field(2.0, gt=0, description="backward time / forward time")
    device_mem_bw_gb_per_s: float = Field(1000.0, gt=0, description="device memory bandwidth")
    intra_bandwidth_gbps: float = Field(100.0, gt=0)
    intra_latency_ms: float = Field(0.01, ge=0)
    host_memory_gb: float | None = Field(
        None, gt=0, description="host RAM per node; when given, the planner checks that the "
        "recovery snapshots (training.recovery_snapshots) fit in it",
    )  # fmt: skip

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def flops_per_s(self) -> float:
        return self.device_tflops * 1e12 * self.device_efficiency


class LinkSpec(_Spec):
    """One WAN link direction ``from -> to``; mirrored unless the reverse is also given."""

    src: str = Field(alias="from")
    dst: str = Field(alias="to")
    bandwidth_gbps: float = Field(gt=0)
    latency_ms: float = Field(ge=0)
    loss: float = Field(0.0, ge=0, lt=1)
    codec: str = "none"

    @property
    def bandwidth_bps(self) -> float:
        return self.bandwidth_gbps * GBPS

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3


class ModelSpec(_Spec):
    n_layer: int = Field(ge=1)
    n_embd: int = Field(ge=8)
    n_head: int = Field(ge=1)
    vocab_size: int = Field(256, ge=2)
    max_seq_len: int = Field(ge=2)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self


class CheckpointSpec(_Spec):
    dir: str | None = Field(None, description="default: <run_dir>/checkpoints")
    every_steps: int = Field(0, ge=0, description="0 = only at the end and at shutdown")
    keep: int = Field(3, ge=1)


class TrainingSpec(_Spec):
    global_batch_size: int = Field(
        ge=1, le=MAX_GLOBAL_BATCH, description="sequences per optimizer step"
    )
    steps: int = Field(ge=1)
    lr: float = Field(gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_decay_steps: int | None = Field(
        None,
        ge=1,
        description="cosine LR horizon (default: steps as written in the YAML; `launch "
        "--steps` only says where to stop, so a stopped run resumes on the same schedule)",
    )
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(
        0.0, ge=0, description="0 disables clipping (DeepSpeed's default is 1)"
    )
    seed: int = 0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    data: str = Field("stdlib", description="'stdlib' or a path to a text file or directory")
    data_max_bytes: int = Field(4_000_000, ge=1024)
    run_dir: str | None = Field(None, description="default: runs/<name>")
    checkpoint: CheckpointSpec = CheckpointSpec()
    recovery_snapshots: bool = Field(
        True, description="keep every stage's full state of the last two step boundaries in "
        "host RAM (24 B per parameter per replica) so a failure loses no step; off: recover "
        "from the latest checkpoint",
    )  # fmt: skip

    @property
    def snapshots_kept(self) -> int:
        """Step boundaries each replica keeps in host RAM (0 with snapshots off)."""
        return RECOVERY_SNAPSHOTS_KEPT if self.recovery_snapshots else 0


class GASpec(_Spec):
    population: int = Field(48, ge=4, le=MAX_GA_POPULATION)
    generations: int = Field(30, ge=1)
    seed: int = 0
    crossover_prob: float = Field(0.7, ge=0, le=1)
    mutation_prob: float = Field(0.3, ge=0, le=1)


class PlanSpec(_Spec):
    schedule: Literal["gpipe", "1f1b", "lookahead", "zb-h1", "lookahead-zb"] = "lookahead"
    calibrate: bool | None = Field(
        None, description="time the model on this machine before planning (default: local)"
    )
    micro_batch_size: Choice = Range(min=1, max=64)
    seq_len: Choice | None = Field(None, description="default: model.max_seq_len")
    delta_n: Choice = Field(Range(min=0, max=64), description=f"at most {MAX_DELTA_N}")
    codecs: list[str] | None = Field(None, description="codecs to search (default: each link's)")
    pipelines: Choice | None = Field(None, description="data-parallel degree D (default: search)")
    topk_ratio: float = Field(0.01, gt=0, le=1)
    ga: GASpec = GASpec()


class ClusterSpec(_Spec):
    name: str = Field(min_length=1)
    ray: RaySpec = RaySpec()
    sites: list[SiteSpec] = Field(min_length=1)
    links: list[LinkSpec] = Field(default_factory=list)
    model: ModelSpec
    training: TrainingSpec
    plan: PlanSpec = PlanSpec()

    # -- derived views -----------------------------------------------------------------------
    def site(self, name: str) -> SiteSpec:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(name)

    def link(self, src: str, dst: str) -> LinkSpec | None:
        """The link direction ``src -> dst`` (a mirrored one-way entry counts both ways)."""
        reverse = None
        for lk in self.links:
            if lk.src == src and lk.dst == dst:
                return lk
            if lk.src == dst and lk.dst == src:
                reverse = lk
        if reverse is None:
            return None
        return reverse.model_copy(update={"src": src, "dst": dst})

    @property
    def digest(self) -> str:
        """A hash of the whole validated config (checkpoints record it)."""
        blob = json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
