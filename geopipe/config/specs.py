"""The typed, frozen specs a cluster YAML validates into (pydantic models), with the limits
and defaults they enforce. Relations between fields are checked in :mod:`.checks`."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from geopipe.config.fields import (
    Choice,
    Range,
    Spec,
    bounded,
    codec_setting,
    name_of,
)
from geopipe.config.health import HealthSpec
from geopipe.config.modelspec import HF_ONLY_FIELDS, ModelSpec
from geopipe.config.observe import EvalSpec, LoggingSpec
from geopipe.config.optim import OptimizerFields
from geopipe.config.outer import OuterSpec, Strategy
from geopipe.config.raycluster import RaySpec
from geopipe.model.recompute import setting as recompute_setting

__all__ = [
    "MAX_DELTA_N",
    "MAX_GA_POPULATION",
    "MAX_GLOBAL_BATCH",
    "MAX_SITE_DEVICES",
    "RECOVERY_SNAPSHOTS_KEPT",
    "SITE_PLACEHOLDER",
    "CheckpointSpec",
    "Choice",
    "ClusterSpec",
    "ConfigError",
    "GASpec",
    "HealthSpec",
    "LinkSpec",
    "OuterSpec",
    "PlanSpec",
    "Range",
    "RaySpec",
    "SecuritySpec",
    "SiteSpec",
    "TrainingSpec",
]

GBPS = 1e9  # bits per second in one Gbit/s
GiB = float(1 << 30)  # bytes in one GiB: device and host memory are quoted in GiB

# Upper bounds on values whose typos would make the planner allocate per-unit lists (layers,
# devices, micro-batches, ΔN candidates, GA individuals) until memory runs out. Each is far
# beyond any real run. The model's (layers, widths, vocabulary) are in config.modelspec.
MAX_SITE_DEVICES = 1 << 17  # devices in one site (about the largest single clusters)
MAX_GLOBAL_BATCH = 1 << 16  # sequences per step; the schedule has one entry per micro-batch
# ΔN counts extra micro-batches in flight (each holds its activations); above this it only
# slows the search. It also keeps `delta_n: {min, max}` from expanding to a huge list.
MAX_DELTA_N = 1024
MAX_GA_POPULATION = 10_000
MAX_GA_GENERATIONS = 100_000
MAX_STEPS = 10**12  # optimizer steps (and every other step count)
MAX_SEED = (1 << 63) - 1  # torch and numpy take seeds below 2**64; numpy needs them >= 0

# Step boundaries each replica keeps in host RAM while `training.recovery_snapshots` is on: the
# newest complete one, and the one before it in case a failure strikes while the newest is
# still being gathered. The runtime keeps this many (runtime/actor/stage.py) and the planner's
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


SiteName = name_of(64)
RunName = name_of(128)


CodecSetting = Annotated[str, BeforeValidator(codec_setting)]

# Physical ranges (units in the key names). Wide enough for any real hardware, narrow
# enough that every time and byte count the planner derives stays a finite float.
TFLOPS = bounded(1e-6, 1e4, lo_open=True, unit="TFLOP/s")
FRACTION = bounded(0.0, 1.0, lo_open=True)
MEMORY_GB = bounded(1e-9, 1e6, unit="GiB")
BANDWIDTH_GBPS = bounded(1e-6, 1e6, unit="Gbit/s")
MEM_BW_GB_PER_S = bounded(1e-3, 1e6, unit="GB/s")
LATENCY_MS = bounded(0.0, 1e5, unit="ms")
LOSS = bounded(0.0, 0.5, unit="(a fraction: 0.01 is 1 %)")
RATIO = bounded(0.01, 100.0)
PROB = bounded(0.0, 1.0)
LR = bounded(0.0, 10.0, lo_open=True)
RECOMPUTE = Annotated[str, AfterValidator(recompute_setting)]  # geopipe.model.recompute
DECAY = bounded(0.0, 10.0)
CLIP = bounded(0.0, 1e6)


class SiteSpec(Spec):
    name: SiteName
    nodes: int = Field(ge=1, le=MAX_SITE_DEVICES)
    devices_per_node: int = Field(ge=1, le=MAX_SITE_DEVICES)
    device_memory_gb: MEMORY_GB
    device_tflops: TFLOPS = Field(description="peak dense TFLOP/s of one device")
    device_efficiency: FRACTION = Field(0.4, description="achieved fraction of peak")
    backward_forward_ratio: RATIO = Field(2.0, description="backward time / forward time")
    layer_overhead_ms: LATENCY_MS = Field(
        0.0,
        description="fixed forward time per layer per micro-batch beyond its FLOPs (kernel "
        "launches, Python): what makes small micro-batches slow; measured at launch with "
        "plan.calibrate",
    )
    device_mem_bw_gb_per_s: MEM_BW_GB_PER_S = Field(1000.0, description="device memory bandwidth")
    intra_bandwidth_gbps: BANDWIDTH_GBPS = 100.0
    intra_latency_ms: LATENCY_MS = 0.01
    host_memory_gb: MEMORY_GB | None = Field(
        None,
        description="host RAM per node; when given, the planner checks that the "
        "recovery snapshots (training.recovery_snapshots) fit in it",
    )
    codec_gb_per_s: dict[str, MEM_BW_GB_PER_S] = Field(
        default_factory=dict,
        description="encode + decode speed of each codec on one device, GB/s of the "
        "uncompressed tensor (measured at launch with plan.calibrate; missing: nominal)",
    )

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def flops_per_s(self) -> float:
        return self.device_tflops * 1e12 * self.device_efficiency


class LinkSpec(Spec):
    """One WAN link direction ``from -> to``; mirrored unless the reverse is also given."""

    src: str = Field(alias="from")
    dst: str = Field(alias="to")
    bandwidth_gbps: BANDWIDTH_GBPS
    latency_ms: LATENCY_MS
    loss: LOSS = 0.0
    codec: CodecSetting = Field("none", description="or {forward: …, backward: …}")

    @property
    def bandwidth_bps(self) -> float:
        return self.bandwidth_gbps * GBPS

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3


SITE_PLACEHOLDER = "{site}"


class CheckpointSpec(Spec):
    """Where checkpoints go. One directory every node shares, or — with ``{site}`` in the
    path — one directory per site (a node-local disk on a real cluster; distinct directories
    when one machine emulates the sites), each holding a complete copy of every checkpoint
    when ``replicate`` is on (the default then): see :mod:`geopipe.runtime.control.sitecopies`."""

    dir: str | None = Field(
        None, description="default: <run_dir>/checkpoints; '{site}' makes it per site"
    )
    every_steps: int = Field(
        0, ge=0, le=MAX_STEPS, description="0 = only at the end and at shutdown"
    )
    keep: int = Field(3, ge=1, le=1_000_000)
    replicate: bool | None = Field(
        None,
        description="per-site directories: copy every shard to every other site, so each "
        "site holds a complete checkpoint (default: on when dir has '{site}'); off: one "
        "complete copy, in the first pipeline site's directory",
    )

    @field_validator("dir")
    @classmethod
    def _only_site_placeholder(cls, v: str | None) -> str | None:
        if v is None:
            return v
        rest = v.replace(SITE_PLACEHOLDER, "")
        if "{" in rest or "}" in rest:
            raise ValueError(f"the only placeholder allowed is {SITE_PLACEHOLDER} (got {v!r})")
        if not v.replace(SITE_PLACEHOLDER, "").strip():
            raise ValueError("must name a directory, not only the placeholder")
        return v

    @field_validator("replicate")
    @classmethod
    def _replication_needs_sites(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        d = info.data.get("dir")
        if v and (d is None or SITE_PLACEHOLDER not in d):
            raise ValueError(
                "replication copies shards between per-site directories, but "
                f"training.checkpoint.dir ({d or '<run_dir>/checkpoints'}) is one directory: "
                f"put {SITE_PLACEHOLDER} in it (e.g. /local/ckpt/{SITE_PLACEHOLDER})"
            )
        return v

    @property
    def per_site(self) -> bool:
        """Each site writes its own directory (``{site}`` in ``dir``)."""
        return self.dir is not None and SITE_PLACEHOLDER in self.dir

    @property
    def replicated(self) -> bool:
        """Every site of the plan gets a complete copy (default: with per-site dirs)."""
        return self.per_site if self.replicate is None else self.replicate

    def dir_for(self, site: str, default: str) -> str:
        """The checkpoint directory of ``site`` (``default`` when ``dir`` is unset)."""
        return (self.dir or default).replace(SITE_PLACEHOLDER, site)


class TrainingSpec(OptimizerFields):  # + the optimizer keys (config.optim)
    global_batch_size: int = Field(
        ge=1, le=MAX_GLOBAL_BATCH, description="sequences per optimizer step"
    )
    steps: int = Field(ge=1, le=MAX_STEPS)
    lr: LR
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    lr_decay_steps: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description="the LR schedule's horizon (default: steps as written in the YAML; `launch "
        "--steps` only says where to stop); past it the LR stays at its final value",
    )
    weight_decay: DECAY = 0.0
    grad_clip: CLIP = Field(0.0, description="0 disables clipping (DeepSpeed's default is 1)")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    recompute: RECOMPUTE = Field(
        "none", description="activation recompute: none, full or every-N (every N-th block)"
    )
    data: str = Field("stdlib", description="'stdlib' or a path to a text file or directory")
    data_max_bytes: int = Field(4_000_000, ge=1024, le=1 << 40)
    run_dir: str | None = Field(None, description="default: runs/<name>")
    checkpoint: CheckpointSpec = CheckpointSpec()
    eval: EvalSpec | None = Field(None, description="held-out evaluation (off by default)")
    recovery_snapshots: bool = Field(
        True,
        description="keep every stage's full state of the last two step boundaries in "
        "host RAM (24 B per parameter per replica) so a failure loses no step; off: recover "
        "from the latest checkpoint",
    )

    @property
    def snapshots_kept(self) -> int:
        """Step boundaries each replica keeps in host RAM (0 with snapshots off)."""
        return RECOVERY_SNAPSHOTS_KEPT if self.recovery_snapshots else 0


class GASpec(Spec):
    population: int = Field(48, ge=4, le=MAX_GA_POPULATION)
    generations: int = Field(30, ge=1, le=MAX_GA_GENERATIONS)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    crossover_prob: PROB = 0.7
    mutation_prob: PROB = 0.3

    @model_validator(mode="after")
    def _probabilities_sum(self) -> GASpec:
        # DEAP's varOr draws one of crossover, mutation or reproduction per offspring, so
        # the two probabilities share one unit (it asserts otherwise).
        if self.crossover_prob + self.mutation_prob > 1.0 + 1e-12:
            raise ValueError(
                f"crossover_prob ({self.crossover_prob:g}) + mutation_prob "
                f"({self.mutation_prob:g}) must be at most 1: each offspring is made by one of "
                "crossover, mutation or copying"
            )
        return self


class GainsSpec(Spec):
    """How much faster (predicted) a choice must be before the run takes it: the model errs
    by a few per cent, and keeping the simpler or the running choice costs nothing."""

    auto_schedule: PROB = Field(
        0.02, description="schedule auto: look-ahead with split backward over plain look-ahead"
    )
    mixed_pipelines: PROB = Field(
        0.02, description="pipelines of different shapes over the best identical ones"
    )
    grow_back: PROB = Field(0.05, description="a layout over returned devices over the running one")
    outer: PROB = Field(
        0.02,
        description="strategy auto: the outer loop over the exact synchronous pipeline "
        "(after its loss penalty)",
    )


class PlanSpec(Spec):
    schedule: Literal["gpipe", "1f1b", "lookahead", "zb-h1", "lookahead-zb", "auto"] = Field(
        "lookahead",
        description="auto: plan look-ahead and look-ahead with split backward, keep the faster",
    )
    calibrate: bool | None = Field(
        None, description="time the model on this machine before planning (default: local)"
    )
    micro_batch_size: Choice = Range(min=1, max=64)
    seq_len: Choice | None = Field(None, description="default: model.max_seq_len")
    delta_n: Choice = Field(Range(min=0, max=64), description=f"at most {MAX_DELTA_N}")
    codecs: list[CodecSetting] | None = Field(
        None,
        description="codecs to search, each direction of a boundary on its own "
        "(default: each link's setting)",
    )
    max_codec_error: FRACTION | None = Field(
        None,
        description="a boundary whose sampled relative codec error exceeds this switches "
        "that direction to the next finer codec",
    )
    pipelines: Choice | None = Field(None, description="data-parallel degree D (default: search)")
    topk_ratio: FRACTION = 0.01
    ga: GASpec = GASpec()
    min_gain: GainsSpec = GainsSpec()
    strategy: Strategy = Field(
        "pipeline",
        description="pipeline: one pipeline across the sites; outer: replica groups joined by "
        "an outer loop (plan.outer); auto: the planner chooses",
    )
    outer: OuterSpec = OuterSpec()
    max_loss_penalty: PROB | None = Field(
        None,
        description="an outer-loop candidate whose predicted loss penalty (relative gap to "
        "synchronous training) exceeds this, at its measured mean plus its standard error, is "
        "never chosen",
    )


class SecuritySpec(Spec):
    """How the data plane (activations, gradients, checkpoint copies) protects itself. Every
    connection is authenticated with the run's secret whatever these say
    (:mod:`geopipe.transport.security`)."""

    encrypt: bool | None = Field(
        None,
        description="TLS 1.3 with a per-run CA on every data-plane connection (default: on "
        "whenever the run may span more than one node, i.e. unless ray.address is 'local', "
        "the embedded single-machine cluster, whatever ray.emulate_links says); off is for "
        "trusted private networks, and launch says so",
    )
    listen: Literal["node", "all"] = Field(
        "node",
        description="'node': listen on the node's own address (Ray's node IP); 'all': on every "
        "interface (0.0.0.0)",
    )


class ClusterSpec(Spec):
    name: RunName
    ray: RaySpec = RaySpec()
    sites: list[SiteSpec] = Field(min_length=1)
    links: list[LinkSpec] = Field(default_factory=list)
    model: ModelSpec
    training: TrainingSpec
    plan: PlanSpec = PlanSpec()
    security: SecuritySpec = SecuritySpec()
    health: HealthSpec = HealthSpec()
    logging: LoggingSpec = LoggingSpec()

    @property
    def encrypted(self) -> bool:
        """Whether the data plane runs TLS (see :class:`SecuritySpec`). By topology, not by
        link emulation: a cluster Ray attaches to may span nodes even when its WAN links are
        emulated (the test bed's are), and there every byte crosses a real network."""
        enc = self.security.encrypt
        return (self.ray.address != "local") if enc is None else enc

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
        """A hash of the whole validated config (checkpoints record it). The built-in GPT's
        hash leaves out the `transformers`-only model fields, so it is what it was before
        they existed."""
        # How the data plane is protected changes no number a checkpoint holds.
        # Neither a machine's measured codec speeds and per-layer overhead nor the codec
        # error policy change what a checkpoint holds.
        # Nor does the loss-penalty bound; and a pipeline run's plan.outer is unused, so its
        # hash is what it was before the outer loop existed.
        plan = {"max_codec_error", "min_gain", "max_loss_penalty"}
        if self.plan.strategy == "pipeline":
            plan |= {"strategy", "outer"}
        # What a run reports (logging, held-out evaluation) changes no number either.
        exclude: dict = {
            "security": True,
            "health": True,
            "logging": True,
            "ray": {"gpus_per_actor"},  # how devices are shared changes no number
            "training": {"eval"},
            "plan": plan,
            "sites": {"__all__": {"codec_gb_per_s", "layer_overhead_ms"}},
        }
        if not self.model.is_hf:
            exclude["model"] = {"hf", *HF_ONLY_FIELDS}
        doc = self.model_dump(mode="json", by_alias=True, exclude=exclude)
        # Keys added since checkpoints recorded digests count only when set away from their
        # default (an older run's checkpoints keep resuming); recompute never (same numbers).
        train = doc["training"]
        train.pop("recompute", None)
        for key, field in OptimizerFields.model_fields.items():
            if key in train and train[key] == json.loads(json.dumps(field.default)):
                del train[key]
        blob = json.dumps(doc, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
