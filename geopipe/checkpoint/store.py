"""Crash-safe, partition-independent training checkpoints (the pure on-disk format layer).

Why this shape: a geo-distributed run can be killed at any instant and is often re-planned
onto a different pipeline partition, so a checkpoint must (1) either exist completely or not
at all, (2) never execute code when read (no pickle, no ``torch.load``), and (3) be keyed by
partition-independent parameter names so any stage layout can load it.

The on-disk format is described in :mod:`geopipe.checkpoint.format`.

Saving (:mod:`.writer`): stages write shards into the temporary directory (each file
fsynced, SHA-256 taken), then `CheckpointWriter.commit` writes the manifest, fsyncs the
directory, renames it to ``step-<NNNNNNNN>`` and fsyncs the root. Loading opens only the
files the manifest names, only through safetensors, and only after their checksums verify.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from safetensors import safe_open

from geopipe.checkpoint.format import ADAM_STATE_GROUPS, EXP_AVG, EXP_AVG_SQ, PARAMS
from geopipe.checkpoint.rootdir import (
    _ACTIVE,
    _ACTIVE_LOCK,
    _STEP_RE,
    _delete_checkpoint,
    _dir_stats,
    _scan,
    _sha256_file,
)

if TYPE_CHECKING:  # tensors are read through safetensors, which imports torch then: a
    import torch  # site store lists, verifies and prunes without it (package docstring)

__all__ = [
    "EXP_AVG",
    "EXP_AVG_SQ",
    "FORMAT_VERSION",
    "MODEL_FIELDS",
    "PARAMS",
    "CheckpointError",
    "CheckpointInfo",
    "Lineage",
    "LoadedCheckpoint",
    "ShardInfo",
    "StageShard",
    "accepts",
    "check_compatible",
    "latest_complete",
    "list_checkpoints",
    "load_checkpoint",
    "load_state_for_layers",
    "move_aside",
    "prune",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_FIELDS = ("n_layer", "n_embd", "n_head", "vocab_size", "max_seq_len")
RNG_TORCH = "rng/torch"
_REQUIRED = ("config_hash", "plan", "data", "model")  # the caller must supply these
_RESERVED = ("format_version", "step", "num_stages", "stages")  # the writer fills these
_META_FORMAT, _META_STAGE, _META_JSON = "geopipe.format", "geopipe.stage", "geopipe.meta"
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")

Status = Literal["complete", "corrupt", "partial"]


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable, corrupt, or does not fit this run."""


@dataclass(frozen=True)
class ShardInfo:
    """What writing one stage's shard produced; plain data so it can cross process bounds."""

    stage: int
    file: str
    sha256: str
    bytes: int
    tensors: int
    seconds: float

    def manifest_entry(self) -> dict[str, Any]:
        """The manifest's record of this shard (timing is not part of the format)."""
        entry = asdict(self)
        del entry["seconds"]
        return entry


@dataclass(frozen=True)
class CheckpointInfo:
    """One entry of `list_checkpoints`: where, which step, and whether it can be trusted."""

    path: Path
    step: int
    status: Status
    reason: str | None  # why it is corrupt or partial; None when complete
    time: float  # manifest time if readable, else the directory's mtime
    size_bytes: int
    run_id: str | None = None  # the run that wrote it (None: unreadable, or written before ids)


Lineage = Mapping[str, "int | None"]  # run id -> the newest of its steps this run may use


def accepts(lineage: Lineage | None, run_id: str | None, step: int) -> bool:
    """Whether a checkpoint of ``run_id`` at ``step`` belongs to a run with ``lineage``:
    its own checkpoints (cap None), and a resumed ancestor's up to the step it resumed
    from — never another run's, never an ancestor's later ones. ``""`` stands for
    checkpoints written before runs had ids. No lineage: every checkpoint (tools)."""
    if lineage is None:
        return True
    key = run_id or ""
    if key not in lineage:
        return False
    cap = lineage[key]
    return cap is None or step <= cap


# --------------------------------------------------------------------------------------------
# reading and validating


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_model_dict(model: object) -> None:
    if not isinstance(model, Mapping):
        raise CheckpointError(f"manifest 'model' must be a dict, got {type(model).__name__}")
    bad = [f for f in MODEL_FIELDS if not _is_int(model.get(f))]
    if bad:
        raise CheckpointError(f"manifest 'model' lacks integer field(s) {bad}")


def _read_manifest(path: Path, step: int | None) -> dict[str, Any]:
    """Parse and structurally validate manifest.json; the error says why it is unusable."""
    try:
        text = (path / MANIFEST).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"missing {MANIFEST} (the save never finished)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {MANIFEST}: {e}") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{MANIFEST} is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CheckpointError(f"{MANIFEST} is not a JSON object")
    if doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{MANIFEST} has format_version {doc.get('format_version')!r}, "
            f"this geopipe reads {FORMAT_VERSION}"
        )
    if not _is_int(doc.get("step")) or (step is not None and doc["step"] != step):
        raise CheckpointError(f"{MANIFEST} step {doc.get('step')!r} does not match {path.name}")
    if not isinstance(doc.get("time"), (int, float)):
        raise CheckpointError(f"{MANIFEST} has no numeric 'time'")
    _check_model_dict(doc.get("model"))
    n, stages = doc.get("num_stages"), doc.get("stages")
    if not _is_int(n) or n < 1 or not isinstance(stages, list) or len(stages) != n:
        raise CheckpointError(f"{MANIFEST} num_stages={n!r} does not match its 'stages' list")
    for k, e in enumerate(stages):
        # The file name is fixed by the stage index: nothing else in the directory is opened.
        if not (
            isinstance(e, dict)
            and e.get("stage") == k
            and e.get("file") == f"stage-{k}.safetensors"
            and isinstance(e.get("sha256"), str)
            and _SHA_RE.match(e["sha256"])
            and _is_int(e.get("bytes"))
            and e["bytes"] >= 0
        ):
            raise CheckpointError(f"{MANIFEST} stage entry {k} is malformed: {e!r}"[:300])
    return doc


def _check_files(path: Path, doc: Mapping[str, Any], verify: bool) -> None:
    """Every shard exists with the recorded size and, if `verify`, the recorded SHA-256."""
    entries = doc["stages"]
    for e in entries:
        try:
            st = os.lstat(path / e["file"])
        except FileNotFoundError:
            raise CheckpointError(f"{e['file']} is missing") from None
        except OSError as err:
            raise CheckpointError(f"cannot stat {e['file']}: {err}") from err
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{e['file']} is not a regular file")
        if st.st_size != e["bytes"]:
            raise CheckpointError(
                f"{e['file']} is {st.st_size} bytes but the manifest says {e['bytes']}"
            )
    if not verify:
        return

    def digest(e: Mapping[str, Any]) -> str | OSError:
        try:
            return _sha256_file(path / e["file"])
        except OSError as err:
            return err

    # hashlib releases the GIL, so shards hash in parallel
    with ThreadPoolExecutor(max_workers=max(1, min(len(entries), os.cpu_count() or 1, 8))) as ex:
        digests = list(ex.map(digest, entries))
    for e, got in zip(entries, digests, strict=True):
        if isinstance(got, OSError):
            raise CheckpointError(f"cannot read {e['file']}: {got}")
        if got != e["sha256"]:
            raise CheckpointError(
                f"{e['file']} checksum mismatch (sha256 {got[:16]}..., "
                f"manifest {e['sha256'][:16]}...)"
            )


@dataclass(frozen=True)
class StageShard:
    """One stage's shard: key names and metadata are read eagerly, tensor data on demand."""

    stage: int
    path: Path
    keys: frozenset[str]
    meta: Mapping[str, Any]

    def tensors_for(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Load the named tensors (safetensors only: no code runs while reading)."""
        keys = list(keys)
        missing = [k for k in keys if k not in self.keys]
        if missing:
            raise CheckpointError(f"{self.path.name} has no tensor(s) {missing[:5]}")
        try:
            with safe_open(str(self.path), framework="pt") as f:
                return {k: f.get_tensor(k) for k in keys}
        except Exception as e:
            raise CheckpointError(f"cannot read tensors from {self.path}: {e}") from e

    def tensor(self, key: str) -> torch.Tensor:
        return self.tensors_for([key])[key]

    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every tensor whose key starts with `prefix`, keyed without it (e.g. ``"params/"``)."""
        got = self.tensors_for(sorted(k for k in self.keys if k.startswith(prefix)))
        return {k[len(prefix) :]: v for k, v in got.items()}

    def rng(self) -> dict[str, Any] | None:
        """The state saved with ``write_shard(..., rng=capture_rng())``, for `restore_rng`."""
        state = self.meta.get("rng")
        if state is None or RNG_TORCH not in self.keys:
            return None
        return {**state, "torch": self.tensor(RNG_TORCH)}


def _open_stage(path: Path, entry: Mapping[str, Any]) -> StageShard:
    """Parse a shard's safetensors header (not its data) and check it belongs here."""
    file = path / entry["file"]
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = frozenset(f.keys())
            header = f.metadata() or {}
    except Exception as e:  # SafetensorError is not exported under a stable name
        raise CheckpointError(f"{entry['file']} is not a valid safetensors file: {e}") from e
    if header.get(_META_FORMAT) != str(FORMAT_VERSION) or header.get(_META_STAGE) != str(
        entry["stage"]
    ):
        raise CheckpointError(f"{entry['file']} is not a geopipe v{FORMAT_VERSION} stage shard")
    try:
        meta = json.loads(header.get(_META_JSON, "{}"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{entry['file']} has invalid JSON metadata: {e}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{entry['file']} metadata is not a JSON object")
    return StageShard(entry["stage"], file, keys, meta)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint: its manifest plus lazy per-stage shard accessors."""

    path: Path
    manifest: Mapping[str, Any]
    stages: tuple[StageShard, ...]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def stage(self, k: int) -> StageShard:
        if not 0 <= k < len(self.stages):
            raise CheckpointError(f"{self.path.name} has stages 0..{len(self.stages) - 1}, not {k}")
        return self.stages[k]


def load_checkpoint(path: str | os.PathLike[str], *, verify: bool = True) -> LoadedCheckpoint:
    """Open a checkpoint directory after validating its manifest and shard checksums."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory")
    match = _STEP_RE.match(path.name)
    try:
        doc = _read_manifest(path, int(match.group(1)) if match else None)
        _check_files(path, doc, verify)
        stages = tuple(_open_stage(path, e) for e in doc["stages"])
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from e
    return LoadedCheckpoint(path, doc, stages)


def load_state_for_layers(
    ckpt: LoadedCheckpoint, names: Iterable[str]
) -> dict[str, dict[str, torch.Tensor]]:
    """Parameters and Adam moments of `names`, from whichever shards hold them.

    Names are partition-independent, so this is how a checkpoint saved with one pipeline split
    loads into any other. Returns ``{"params": {...}, "exp_avg": {...}, "exp_avg_sq": {...}}``;
    the moment dicts lack a name only if the checkpoint has no Adam state for it.
    """
    owner: dict[str, StageShard] = {}
    for shard in ckpt.stages:
        for key in shard.keys:
            if key.startswith(PARAMS):
                name = key[len(PARAMS) :]
                if name in owner:
                    raise CheckpointError(
                        f"{ckpt.path.name}: {name} is in stage {owner[name].stage} "
                        f"and stage {shard.stage}"
                    )
                owner[name] = shard
    wanted = list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in owner]
    if missing:
        raise CheckpointError(
            f"{ckpt.path.name} has no parameter(s) {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in ADAM_STATE_GROUPS}
    by_shard: dict[int, list[str]] = {}
    for n in wanted:
        by_shard.setdefault(owner[n].stage, []).append(n)
    for stage, shard_names in by_shard.items():
        shard = ckpt.stages[stage]
        keys = []
        for n in shard_names:
            moments = [EXP_AVG + n in shard.keys, EXP_AVG_SQ + n in shard.keys]
            if moments[0] != moments[1]:
                raise CheckpointError(f"{shard.path.name} has only one Adam moment of {n}")
            keys += [PARAMS + n] + ([EXP_AVG + n, EXP_AVG_SQ + n] if moments[0] else [])
        for key, t in shard.tensors_for(keys).items():
            group, name = key.split("/", 1)
            out[group][name] = t
    return out


def check_compatible(manifest: Mapping[str, Any], model_shape: Mapping[str, int]) -> None:
    """Raise naming every model field where the checkpoint and this run disagree."""
    saved = manifest.get("model")
    saved = saved if isinstance(saved, Mapping) else {}
    problems = [
        f"checkpoint has no model.{k} (this run has {v})"
        if k not in saved
        else f"checkpoint model.{k}={saved[k]} but this run has {v}"
        for k, v in model_shape.items()
        if k not in saved or saved[k] != v
    ]
    if problems:
        raise CheckpointError("incompatible checkpoint: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------
# listing, choosing, pruning


def _inspect(path: Path, step: int, verify: bool) -> CheckpointInfo:
    size, mtime = _dir_stats(path)
    try:
        doc = _read_manifest(path, step)
        _check_files(path, doc, verify)
        if verify:
            for e in doc["stages"]:
                _open_stage(path, e)
    except CheckpointError as e:
        return CheckpointInfo(path, step, "corrupt", str(e), mtime, size)
    run_id = doc.get("run_id")
    run_id = run_id if isinstance(run_id, str) else None
    return CheckpointInfo(path, step, "complete", None, float(doc["time"]), size, run_id)


def list_checkpoints(root: str | os.PathLike[str], *, verify: bool = False) -> list[CheckpointInfo]:
    """Every ``step-*`` and ``.tmp-*`` directory, oldest step first, with its status.

    Without `verify` "complete" means the manifest and shard sizes are right; with it the
    SHA-256s and safetensors headers are checked too.
    """
    out = []
    for path, step, is_tmp in _scan(Path(root)):
        if is_tmp:
            size, mtime = _dir_stats(path)
            reason = "save in progress or interrupted (never committed)"
            out.append(CheckpointInfo(path, step, "partial", reason, mtime, size))
        else:
            out.append(_inspect(path, step, verify))
    out.sort(key=lambda i: (i.step, i.status == "partial", i.path.name))
    return out


def latest_complete(
    root: str | os.PathLike[str],
    on_skip: Callable[[Path, str], None] | None = None,
    lineage: Lineage | None = None,
) -> CheckpointInfo | None:
    """The newest fully verified checkpoint (of ``lineage``'s runs, see :func:`accepts`);
    each newer unusable one is passed to `on_skip`.

    `on_skip(path, reason)` defaults to a logged warning, so callers can say e.g.
    "skipping step-00000020: stage-1.safetensors checksum mismatch (...)".
    """

    def warn(path: Path, reason: str) -> None:
        log.warning("skipping %s: %s", path.name, reason)

    report = on_skip or warn
    for path, step, _ in sorted(
        (s for s in _scan(Path(root)) if not s[2]), key=lambda s: s[1], reverse=True
    ):
        info = _inspect(path, step, verify=True)
        if info.status == "complete":
            if accepts(lineage, info.run_id, info.step):
                return info
            continue  # another run's: not ours to use, nor to report
        report(path, info.reason or "")
    return None


def prune(root: str | os.PathLike[str], keep: int, own: str | None = None) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep` verified ones; return them.
    With ``own`` (a run id) only that run's checkpoints count and go: another run's are
    never deleted.

    Newer checkpoints that fail verification do not count towards `keep`, so the last good one
    survives. Also deletes ``.tmp-*`` dirs older than the newest good checkpoint (killed saves).
    Corrupt ``step-*`` dirs and anything not named like a checkpoint are left alone.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    infos = list_checkpoints(root)
    good: list[CheckpointInfo] = []
    deleted: list[Path] = []
    mine = [i for i in infos if i.status == "complete" and (own is None or i.run_id == own)]
    for info in sorted(mine, key=lambda i: -i.step):
        if len(good) < keep:
            if _inspect(info.path, info.step, verify=True).status == "complete":
                good.append(info)
            continue
        _delete_checkpoint(info.path, info.step)
        deleted.append(info.path)
    if good:
        with _ACTIVE_LOCK:  # a writer being created now must not lose its fresh tmp dir
            for info in infos:
                stale = info.status == "partial" and info.step < good[0].step
                if stale and info.path not in _ACTIVE:
                    shutil.rmtree(info.path, ignore_errors=True)
                    if not info.path.exists():
                        deleted.append(info.path)
    return deleted


def move_aside(root: str | os.PathLike[str]) -> tuple[Path, str] | None:
    """Rename a checkpoint directory holding any checkpoint (complete or not) to a sibling
    ``<name>.prev-<run id>`` (the newest complete one's run, ``unknown`` without one; a
    numbered suffix if taken), so a fresh run starts empty and nothing is deleted. Returns
    (new path, run id), or None when there was nothing to move."""
    root = Path(root)
    found = list(_scan(root))
    if not found:
        return None
    complete = [i for i in list_checkpoints(root) if i.status == "complete"]
    run = next((i.run_id for i in reversed(complete) if i.run_id), None) or "unknown"
    target = root.with_name(f"{root.name}.prev-{run}")
    n = 1
    while target.exists():
        n += 1
        target = root.with_name(f"{root.name}.prev-{run}-{n}")
    root.rename(target)
    return target, run
