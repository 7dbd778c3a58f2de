"""Cluster YAML -> typed, validated specs.

The YAML is validated once, at load, and everything downstream takes these
frozen models (or plain values pulled out of them). Every error names the file,
the field path (``links[0].latency_ms``) and what is wrong; unknown keys are
errors with a did-you-mean. pydantic does the type checking and gives us field
paths; the cross-checks (links name real sites, the model fits, the batch
divides) live in :func:`_cross_check`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from geopipe.transport.wire import CODECS

__all__ = [
    "ClusterSpec",
    "ConfigError",
    "LinkSpec",
    "ModelSpec",
    "PlanSpec",
    "SiteSpec",
    "TrainingSpec",
    "load_cluster",
    "parse_cluster",
]

GBPS = 1e9  # bits per second in one Gbit/s
GB = 1 << 30  # bytes in one GiB (device memory is quoted in GiB)


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
    global_batch_size: int = Field(ge=1, description="sequences per optimizer step")
    steps: int = Field(ge=1)
    lr: float = Field(gt=0)
    warmup_steps: int = Field(0, ge=0)
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


class GASpec(_Spec):
    population: int = Field(48, ge=4)
    generations: int = Field(30, ge=1)
    seed: int = 0
    crossover_prob: float = Field(0.7, ge=0, le=1)
    mutation_prob: float = Field(0.3, ge=0, le=1)


class PlanSpec(_Spec):
    schedule: Literal["gpipe", "1f1b", "lookahead"] = "lookahead"
    calibrate: bool | None = Field(
        None, description="time the model on this machine before planning (default: local)"
    )
    micro_batch_size: Choice = Range(min=1, max=64)
    seq_len: Choice | None = Field(None, description="default: model.max_seq_len")
    delta_n: Choice = Range(min=0, max=64)
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


# --------------------------------------------------------------------------------------------
# Loading and error formatting


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("int", "list[int]", "Range", "function-after[_ordered(), Range]"):
            continue  # union-branch markers pydantic inserts for `Choice`
        else:
            out += ("." if out else "") + str(part)
    return out


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """Walk the spec classes along an error location (for did-you-mean suggestions)."""
    model: Any = ClusterSpec
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(part)
        if field is None:
            field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return None
        model = _unwrap(field.annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    args = getattr(tp, "__args__", None)
    if not args:
        return tp
    for a in args:
        inner = _unwrap(a)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return tp


def _field_names(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def _describe(err: dict[str, Any]) -> tuple[str, str]:
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        key = str(loc[-1])
        msg = "unknown key"
        if parent is not None:
            close = difflib.get_close_matches(key, _field_names(parent), n=1, cutoff=0.6)
            if close:
                msg += f" (did you mean '{close[0]}'?)"
            else:
                msg += f" (allowed: {', '.join(_field_names(parent))})"
        return _format_loc(loc), msg
    if kind == "missing":
        return _format_loc(loc), "required field is missing"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if "input" in err and kind not in ("model_type", "dict_type"):
        got = err["input"]
        if not isinstance(got, (dict, list)):
            msg += f" (got {got!r})"
    return _format_loc(loc), msg


def parse_cluster(data: Any, source: str = "<cluster>") -> ClusterSpec:
    """Validate a parsed YAML document; raise :class:`ConfigError` listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError(source, [("", "the file must be a mapping of sections (name, sites, …)")])
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as exc:
        problems: list[tuple[str, str]] = []
        for err in exc.errors():
            item = _describe(err)
            if item not in problems:
                problems.append(item)
        raise ConfigError(source, _collapse_union_noise(problems)) from None
    problems = _cross_check(spec)
    if problems:
        raise ConfigError(source, problems)
    return spec


def _collapse_union_noise(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A bad `Choice` fails all three union branches; report one line per field."""
    seen: dict[str, str] = {}
    for path, msg in problems:
        if path in seen:
            if "int, a list of ints or {min, max}" not in seen[path]:
                seen[path] = "expected an int, a list of ints or {min, max}: " + seen[path]
            continue
        seen[path] = msg
    return list(seen.items())


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster YAML file."""
    p = Path(path)
    source = str(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(source, [("", "file not found")]) from None
    except OSError as exc:
        raise ConfigError(source, [("", f"cannot read: {exc.strerror or exc}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(source, [("", f"not valid YAML{where}: {problem}")]) from None
    return parse_cluster(data, source)


# --------------------------------------------------------------------------------------------
# Cross-checks (relations between fields that pydantic cannot see)


def choice_values(choice: Choice | None, *, default: list[int], powers_of_two: bool) -> list[int]:
    """Expand a planner knob into its candidate values (sorted, unique)."""
    if choice is None:
        return sorted(set(default))
    if isinstance(choice, int):
        return [choice]
    if isinstance(choice, list):
        return sorted(set(choice))
    if powers_of_two:
        vals = [1 << i for i in range(0, 31) if choice.min <= (1 << i) <= choice.max]
        return vals
    return list(range(choice.min, choice.max + 1))


def _bytes_per_param(precision: str) -> float:
    # fp32: 4 (weights) + 4 (grads) + 8 (Adam m, v). Mixed precision: 2 + 2 + 12 (fp32 master,
    # m, v). Both are 16 bytes per parameter before ZeRO-1 shards the optimizer part.
    del precision
    return 16.0


def _cross_check(spec: ClusterSpec) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    names = [s.name for s in spec.sites]
    for i, name in enumerate(names):
        if names.index(name) != i:
            problems.append((f"sites[{i}].name", f"duplicate site name '{name}'"))
    seen_dirs: set[tuple[str, str]] = set()
    for i, lk in enumerate(spec.links):
        for end, val in (("from", lk.src), ("to", lk.dst)):
            if val not in names:
                hint = difflib.get_close_matches(val, names, n=1)
                extra = f" (did you mean '{hint[0]}'?)" if hint else f" (sites: {', '.join(names)})"
                problems.append((f"links[{i}].{end}", f"unknown site '{val}'{extra}"))
        if lk.src == lk.dst:
            problems.append(
                (f"links[{i}]", f"a link joins two different sites, got '{lk.src}' twice")
            )
        if (lk.src, lk.dst) in seen_dirs:
            problems.append((f"links[{i}]", f"link {lk.src} -> {lk.dst} is given twice"))
        seen_dirs.add((lk.src, lk.dst))
        if lk.codec not in CODECS:
            problems.append((f"links[{i}].codec", f"unknown codec '{lk.codec}' (one of {CODECS})"))
    for i, c in enumerate(spec.plan.codecs or []):
        if c not in CODECS:
            problems.append((f"plan.codecs[{i}]", f"unknown codec '{c}' (one of {CODECS})"))
    if problems:
        return problems

    if len(spec.sites) > 1 and not _has_hamiltonian_path(spec):
        problems.append(
            ("links", "the links do not connect the sites into one chain; add the missing links")
        )

    m = spec.model
    seq_vals = choice_values(spec.plan.seq_len, default=[m.max_seq_len], powers_of_two=True)
    for v in seq_vals:
        if v > m.max_seq_len or v < 2:
            problems.append(
                ("plan.seq_len", f"seq_len {v} is outside [2, model.max_seq_len={m.max_seq_len}]")
            )
            break
    if not seq_vals:
        problems.append(("plan.seq_len", "the range contains no power of two"))
    mb_vals = choice_values(spec.plan.micro_batch_size, default=[1], powers_of_two=True)
    gbs = spec.training.global_batch_size
    if not mb_vals:
        problems.append(("plan.micro_batch_size", "the range contains no power of two"))
    elif not any(gbs % b == 0 for b in mb_vals if b > 0):
        problems.append(
            (
                "training.global_batch_size",
                f"{gbs} is not divisible by any micro-batch size in {mb_vals}",
            )
        )
    if any(b < 1 for b in mb_vals):
        problems.append(("plan.micro_batch_size", "micro-batch sizes must be at least 1"))
    if spec.plan.pipelines is not None:
        d_vals = choice_values(spec.plan.pipelines, default=[], powers_of_two=False)
        if any(d < 1 for d in d_vals):
            problems.append(("plan.pipelines", "the number of pipelines must be at least 1"))
        elif not any(gbs % (d * b) == 0 for d in d_vals for b in mb_vals if b > 0):
            problems.append(
                (
                    "training.global_batch_size",
                    f"{gbs} is not divisible by pipelines × micro-batch for any of "
                    f"pipelines {d_vals} and micro-batch sizes {mb_vals}",
                )
            )

    # Does the model fit at all? Static state (weights, grads, Adam) of the whole model must fit
    # in all devices together, and the largest single layer must fit in the largest device.
    from geopipe.optimizer.costs import layer_param_counts  # local: avoids an import cycle

    counts = layer_param_counts(m)
    bpp = _bytes_per_param(spec.training.precision)
    total_need = sum(counts) * bpp
    total_have = sum(s.devices * s.device_memory_gb * GB for s in spec.sites)
    biggest_dev = max(s.device_memory_gb * GB for s in spec.sites)
    if total_need > total_have:
        problems.append(
            (
                "model",
                f"the model's weights, gradients and Adam state need {total_need / GB:.1f} GiB "
                f"but all devices together have {total_have / GB:.1f} GiB",
            )
        )
    elif max(counts) * bpp > biggest_dev:
        problems.append(
            (
                "model",
                f"one layer needs {max(counts) * bpp / GB:.2f} GiB but the largest device has "
                f"{biggest_dev / GB:.2f} GiB",
            )
        )
    if sum(s.devices for s in spec.sites) > 1 and m.n_layer + 2 < len(spec.sites):
        problems.append(
            ("model.n_layer", f"{m.n_layer + 2} layers cannot span {len(spec.sites)} sites")
        )
    return problems


def _has_hamiltonian_path(spec: ClusterSpec) -> bool:
    names = [s.name for s in spec.sites]
    n = len(names)
    adj = [[spec.link(a, b) is not None for b in names] for a in names]
    # Held-Karp reachability over subsets; n is small (sites, not devices).
    reach = [[False] * n for _ in range(1 << n)]
    for i in range(n):
        reach[1 << i][i] = True
    for mask in range(1 << n):
        for i in range(n):
            if not reach[mask][i]:
                continue
            for j in range(n):
                if not mask & (1 << j) and adj[i][j]:
                    reach[mask | (1 << j)][j] = True
    return any(reach[(1 << n) - 1])
