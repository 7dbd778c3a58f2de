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


class GASpec(_Spec):
    population: int = Field(48, ge=4, le=MAX_GA_POPULATION)
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


# --------------------------------------------------------------------------------------------
# Loading and error formatting


def _is_branch(part: Any) -> bool:
    """Is this location part a union-branch marker pydantic inserts for `Choice`?"""
    return isinstance(part, str) and (
        part in ("int", "list[int]", "Range") or part.endswith(", Range]")
    )


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_branch(part):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """Walk the spec classes along an error location (for did-you-mean suggestions)."""
    model: Any = ClusterSpec
    for part in loc:
        if isinstance(part, int) or _is_branch(part):
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
        for err in _matching_branch(exc.errors()):
            item = _describe(err)
            if item not in problems:
                problems.append(item)
        raise ConfigError(source, _collapse_union_noise(problems)) from None
    problems = _cross_check(spec)
    if problems:
        raise ConfigError(source, problems)
    return spec


# Error kinds that only say "the input is not of this branch's shape".
_WRONG_SHAPE = {"int_type", "int_parsing", "list_type", "model_type", "dict_type"}


def _matching_branch(errors: list[Any]) -> list[Any]:
    """Keep only the errors of the `Choice` branch that accepted the input's shape.

    A bad `Choice` fails all three union branches; for a mapping (or a list) the other two
    only complain about the type, which would hide the real message ("min (5) is larger
    than max (2)", a bad list item). Fields where no branch took the shape are left alone.
    """

    def split(err: Any) -> tuple[tuple[Any, ...], Any] | None:
        loc = tuple(err["loc"])
        i = next((i for i, part in enumerate(loc) if _is_branch(part)), None)
        return None if i is None else (loc[:i], loc[i])

    matched: dict[tuple[Any, ...], Any] = {}
    for err in errors:
        where = split(err)
        if where is None:
            continue
        deeper = len(err["loc"]) > len(where[0]) + 1
        if deeper or err["type"] not in _WRONG_SHAPE:
            matched.setdefault(*where)
    out = []
    for err in errors:
        where = split(err)
        if where is not None and matched.get(where[0], where[1]) != where[1]:
            continue
        out.append(err)
    return out


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


def choice_values(
    choice: Choice | None,
    *,
    default: list[int],
    powers_of_two: bool = False,
    upper: int | None = None,
) -> list[int]:
    """Expand a planner knob into its candidate values (sorted, unique).

    ``upper`` drops values above it before a range is expanded, so a typo like
    ``{min: 1, max: 1000000000}`` costs nothing where only small values are usable.
    """
    if choice is None:
        vals = sorted(set(default))
    elif isinstance(choice, int):
        vals = [choice]
    elif isinstance(choice, list):
        vals = sorted(set(choice))
    else:
        top = choice.max if upper is None else min(choice.max, upper)
        if powers_of_two:
            return [1 << i for i in range(0, 31) if choice.min <= (1 << i) <= top]
        return list(range(choice.min, top + 1))
    return vals if upper is None else [v for v in vals if v <= upper]


def _choice_bounds(choice: Choice) -> tuple[int, int]:
    """Smallest and largest value of a non-empty knob, without expanding a range."""
    if isinstance(choice, int):
        return choice, choice
    if isinstance(choice, list):
        return min(choice), max(choice)
    return choice.min, choice.max


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

    problems += _check_plan(spec)

    # Does the model fit at all? Static state (weights, grads, Adam) of the whole model must fit
    # in all devices together, and the largest single layer must fit in the largest device.
    from geopipe.optimizer.costs import param_totals  # local: avoids an import cycle

    m = spec.model
    total_params, largest_layer = param_totals(m)  # closed form: n_layer may be a typo
    bpp = _bytes_per_param(spec.training.precision)
    total_need = total_params * bpp
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
    elif largest_layer * bpp > biggest_dev:
        problems.append(
            (
                "model",
                f"one layer needs {largest_layer * bpp / GB:.2f} GiB but the largest device has "
                f"{biggest_dev / GB:.2f} GiB",
            )
        )
    if m.n_layer > MAX_LAYERS:
        problems.append(
            ("model.n_layer", f"{m.n_layer} layers is above the supported {MAX_LAYERS} (a typo?)")
        )
    if sum(s.devices for s in spec.sites) > 1 and m.n_layer + 2 < len(spec.sites):
        problems.append(
            ("model.n_layer", f"{m.n_layer + 2} layers cannot span {len(spec.sites)} sites")
        )
    return problems


def _short(vals: list[int]) -> str:
    """A candidate list for a message, elided in the middle when long."""
    if len(vals) <= 8:
        return str(vals)
    return f"[{vals[0]}, {vals[1]}, {vals[2]}, …, {vals[-1]}]"


def _show_choice(choice: Choice) -> str:
    if isinstance(choice, Range):
        return f"{{min: {choice.min}, max: {choice.max}}}"
    return _short(sorted(set(choice))) if isinstance(choice, list) else str(choice)


def _check_plan(spec: ClusterSpec) -> list[tuple[str, str]]:
    """The planner knobs: non-empty, in range, and some combination divides the batch.

    Ranges are never expanded beyond what is useful: pipelines above the smallest site's
    device count cannot be placed (every site hosts a stage of every pipeline), and ΔN is
    capped at :data:`MAX_DELTA_N`.
    """
    problems: list[tuple[str, str]] = []
    pl, m = spec.plan, spec.model
    empty = set()
    for name in ("micro_batch_size", "seq_len", "delta_n", "pipelines"):
        val = getattr(pl, name)
        if isinstance(val, list) and not val:
            empty.add(name)
            problems.append(
                (f"plan.{name}", "the list is empty: give at least one value (or omit the key)")
            )
    devices = {s.name: s.devices for s in spec.sites}
    for i, s in enumerate(spec.sites):
        if s.devices > MAX_SITE_DEVICES:
            problems.append(
                (
                    f"sites[{i}]",
                    f"{s.devices} devices (nodes × devices_per_node) is above the supported "
                    f"{MAX_SITE_DEVICES} per site (a typo?)",
                )
            )

    if "seq_len" not in empty:
        seq_vals = choice_values(pl.seq_len, default=[m.max_seq_len], powers_of_two=True)
        bad = [v for v in seq_vals if v > m.max_seq_len or v < 2]
        if bad:
            problems.append(
                (
                    "plan.seq_len",
                    f"seq_len {bad[0]} is outside [2, model.max_seq_len={m.max_seq_len}]",
                )
            )
        if not seq_vals:
            problems.append(("plan.seq_len", "the range contains no power of two"))

    gbs = spec.training.global_batch_size
    mb_ok: list[int] = []  # the usable micro-batch sizes
    batch_divides = True
    if "micro_batch_size" not in empty:
        mb_vals = choice_values(pl.micro_batch_size, default=[1], powers_of_two=True)
        mb_ok = [b for b in mb_vals if b >= 1]
        if not mb_vals:
            problems.append(("plan.micro_batch_size", "the range contains no power of two"))
        if len(mb_ok) < len(mb_vals):
            problems.append(("plan.micro_batch_size", "micro-batch sizes must be at least 1"))
        if mb_ok and not any(gbs % b == 0 for b in mb_ok):
            batch_divides = False
            problems.append(
                (
                    "training.global_batch_size",
                    f"{gbs} is not divisible by any micro-batch size in {_short(mb_ok)}",
                )
            )

    if pl.pipelines is not None and "pipelines" not in empty:
        smallest = min(devices, key=lambda n: (devices[n], n))
        max_d = devices[smallest]
        lo, hi = _choice_bounds(pl.pipelines)
        # Values above max_d are dropped before a range is expanded (and max_d itself is
        # capped: an oversized site is reported above).
        top = min(max_d, MAX_SITE_DEVICES)
        d_ok = [d for d in choice_values(pl.pipelines, default=[], upper=top) if d >= 1]
        if lo < 1:
            problems.append(("plan.pipelines", "the number of pipelines must be at least 1"))
        elif not d_ok:
            problems.append(
                (
                    "plan.pipelines",
                    f"at most {max_d} pipeline{'s fit' if max_d != 1 else ' fits'}: every site "
                    f"hosts a stage of every pipeline and site '{smallest}' has {max_d} "
                    f"device{'s' * (max_d != 1)} (got {_show_choice(pl.pipelines)})",
                )
            )
        elif mb_ok and batch_divides and not any(gbs % (d * b) == 0 for d in d_ok for b in mb_ok):
            problems.append(
                (
                    "training.global_batch_size",
                    f"{gbs} is not divisible by pipelines × micro-batch for any of "
                    f"pipelines {_short(d_ok)} and micro-batch sizes {_short(mb_ok)}",
                )
            )

    if "delta_n" not in empty:
        lo, hi = _choice_bounds(pl.delta_n)
        if lo < 0:
            problems.append(("plan.delta_n", f"ΔN must be at least 0 (got {lo})"))
        if hi > MAX_DELTA_N:
            problems.append(
                (
                    "plan.delta_n",
                    f"ΔN {hi} is above the supported {MAX_DELTA_N} (each extra micro-batch in "
                    f"flight holds its activations; a typo?)",
                )
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
