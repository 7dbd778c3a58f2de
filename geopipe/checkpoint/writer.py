"""Writing checkpoints: shard files and the writer that commits a step atomically.

The on-disk format and the rules a save follows are described in :mod:`.store` (which reads,
lists and prunes what this module writes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geopipe.checkpoint.rootdir import (
    _ACTIVE,
    _ACTIVE_LOCK,
    _fsync,
    _release_tmp,
    _sha256_file,
    _trash_path,
    step_dirname,
    tmp_dirname,
)
from geopipe.checkpoint.store import (
    _META_FORMAT,
    _META_JSON,
    _META_STAGE,
    _REQUIRED,
    _RESERVED,
    FORMAT_VERSION,
    MANIFEST,
    RNG_TORCH,
    CheckpointError,
    ShardInfo,
    _check_model_dict,
)
from geopipe.checkpoint.verify import verify_dir

__all__ = ["CheckpointWriter", "shard_bytes", "shard_name", "write_shard_file"]

if TYPE_CHECKING:  # imported where shards are encoded: a site store commits its copies
    import torch  # with the writer, and starts without torch (see the package docstring)


def _prepare(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that own their storage, as safetensors requires."""
    import torch

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in tensors.items():
        if not isinstance(key, str) or not key or key == "__metadata__":
            raise CheckpointError(f"invalid tensor key {key!r}")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{key!r} is a {type(value).__name__}, not a torch.Tensor")
        t = value.detach().cpu()
        storage = t.untyped_storage()
        if t.nbytes and (
            not t.is_contiguous() or storage.nbytes() != t.nbytes or storage.data_ptr() in seen
        ):
            t = t.clone(memory_format=torch.contiguous_format)  # a view, or shared storage
        if t.nbytes:
            seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def _encode(
    stage: int,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any] | None,
    rng: Mapping[str, Any] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and safetensors header of stage ``stage``'s shard."""
    import torch

    if not isinstance(stage, int) or stage < 0:
        raise CheckpointError(f"stage must be an int >= 0, got {stage!r}")
    data = _prepare(tensors)
    info = dict(meta or {})
    if rng is not None:
        if "rng" in info or RNG_TORCH in data:
            raise CheckpointError("pass RNG state either as rng= or in meta/tensors, not both")
        info["rng"] = {"python": rng["python"], "numpy": rng["numpy"]}
        data[RNG_TORCH] = rng["torch"].detach().cpu().to(torch.uint8).clone()
    try:
        meta_json = json.dumps(info, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"stage {stage} metadata is not JSON-serialisable: {e}") from e
    header = {_META_FORMAT: str(FORMAT_VERSION), _META_STAGE: str(stage), _META_JSON: meta_json}
    return data, header


def shard_name(stage: int) -> str:
    return f"stage-{stage}.safetensors"


def write_shard_file(
    directory: str | os.PathLike[str],
    stage: int,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any] | None = None,
    *,
    rng: Mapping[str, Any] | None = None,
) -> ShardInfo:
    """Write and fsync ``stage-<k>.safetensors`` into `directory`, returning its checksum.

    A free function so a stage in another process can write into a writer's `tmp_dir` on a
    shared filesystem and hand the `ShardInfo` back to the controller (`add_shard`).
    """
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    data, header = _encode(stage, tensors, meta, rng)
    name = shard_name(stage)
    path = Path(directory) / name
    try:
        save_file(data, path, metadata=header)
        _fsync(path)
        digest = _sha256_file(path)
        size = path.stat().st_size
    except Exception as e:
        path.unlink(missing_ok=True)
        raise CheckpointError(f"writing {path} failed: {e}") from e
    return ShardInfo(stage, name, digest, size, len(data), time.perf_counter() - t0)


def shard_bytes(
    stage: int,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any] | None = None,
    *,
    rng: Mapping[str, Any] | None = None,
) -> tuple[bytes, ShardInfo]:
    """The exact bytes `write_shard_file` would write, in memory, with their `ShardInfo`:
    for a stage whose checkpoint directory is on another machine (per-site copies), which
    the sites' stores pull (:mod:`geopipe.runtime.storage.sitestore`)."""
    from safetensors.torch import save

    t0 = time.perf_counter()
    data, header = _encode(stage, tensors, meta, rng)
    blob = save(data, metadata=header)
    digest = hashlib.sha256(blob).hexdigest()
    info = ShardInfo(
        stage, shard_name(stage), digest, len(blob), len(data), time.perf_counter() - t0
    )
    return blob, info


def _other_runs(final: Path, run_id: object) -> Path | None:
    """Where to keep ``final`` if another run wrote it (e.g. the run a resumed run started
    from, whose later checkpoints share the directory): ``step-N.prev-<its run id>``,
    a name no listing treats as a checkpoint. None when ``final`` is absent, this run's
    own (a corrupt one being re-saved), unreadable, or the new checkpoint has no run id."""
    if not isinstance(run_id, str) or not final.is_dir():
        return None
    try:
        old = json.loads((final / "manifest.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(old, str) or old == run_id:
        return None
    target = final.with_name(f"{final.name}.prev-{old}")
    n = 1
    while target.exists():
        n += 1
        target = final.with_name(f"{final.name}.prev-{old}-{n}")
    return target


class CheckpointWriter:
    """One checkpoint being written: shards land in a tmp dir that `commit` renames into place.

    Use as a context manager to `abort` automatically if `commit` is never reached.
    """

    def __init__(self, root: str | os.PathLike[str], step: int) -> None:
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be an int >= 0, got {step!r}")
        self.root = Path(root)
        self.step = step
        self.root.mkdir(parents=True, exist_ok=True)
        # Never a directory another attempt used ([Note: one directory per save]).
        self.tmp_dir = self.root / tmp_dirname(step)
        same = f".tmp-step-{step:08d}-{os.getpid()}-"
        with _ACTIVE_LOCK:
            if any(p.parent == self.root and p.name.startswith(same) for p in _ACTIVE):
                raise CheckpointError(f"step {step} is already being written by this process")
            _ACTIVE.add(self.tmp_dir)
        # dropped without commit/abort = a killed save: the tmp dir stays, prune may take it
        self._release = weakref.finalize(self, _release_tmp, self.tmp_dir)
        self.tmp_dir.mkdir()  # exist_ok=False: a name in use is an error, never shared
        self._lock = threading.Lock()
        self._shards: dict[int, ShardInfo] = {}
        self._writing: set[int] = set()
        self._closed = False

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._closed:
            self.abort()

    def _claim(self, stage: int) -> None:
        with self._lock:
            if self._closed:
                raise CheckpointError(f"checkpoint step {self.step} was already committed/aborted")
            if stage in self._shards or stage in self._writing:
                raise CheckpointError(f"stage {stage} written twice for step {self.step}")
            self._writing.add(stage)

    def write_shard(
        self,
        stage: int,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        *,
        rng: Mapping[str, Any] | None = None,
    ) -> ShardInfo:
        """Write one stage's shard; safe to call from one thread per stage in parallel."""
        self._claim(stage)
        info = None
        try:
            info = write_shard_file(self.tmp_dir, stage, tensors, meta, rng=rng)
            return info
        finally:
            with self._lock:
                self._writing.discard(stage)
                if info is not None:
                    self._shards[stage] = info

    @property
    def stages_written(self) -> set[int]:
        with self._lock:
            return set(self._shards)

    def add_shard(self, info: ShardInfo) -> None:
        """Record a shard another process wrote into `tmp_dir` with `write_shard_file`."""
        self._claim(info.stage)
        with self._lock:
            self._writing.discard(info.stage)
            self._shards[info.stage] = info

    def commit(self, manifest: Mapping[str, Any], *, num_stages: int) -> Path:
        """Write manifest.json last, fsync, and atomically rename into ``step-<NNNNNNNN>``.

        `manifest` must hold ``config_hash``, ``plan``, ``data`` and ``model``; ``time`` defaults
        to now. An existing directory of the same step (e.g. a corrupt one a resumed run is
        re-saving) is replaced.
        """
        with self._lock:  # held throughout so no shard can start while we seal the dir
            if self._closed:
                raise CheckpointError(f"checkpoint step {self.step} was already committed/aborted")
            if self._writing:
                raise CheckpointError(f"stages {sorted(self._writing)} are still being written")
            self._write_manifest(manifest, num_stages)
            self._closed = True
        _fsync(self.tmp_dir)
        # Verified before anything already committed is touched: every shard's size and
        # SHA-256 against the manifest just written (re-read from disk, so a shard another
        # process wrote on a shared filesystem is checked as this machine sees it).
        verify_dir(self.tmp_dir)
        final = self.root / step_dirname(self.step)
        other = _other_runs(final, manifest.get("run_id"))
        if other is not None:  # another run's checkpoint of this step: kept, renamed
            os.rename(final, other)
        if final.exists():  # move the old one aside first so a crash leaves only tmp dirs
            trash = _trash_path(self.root, self.step)
            os.rename(final, trash)
            os.rename(self.tmp_dir, final)
            _fsync(self.root)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(self.tmp_dir, final)
            _fsync(self.root)
        self._release()
        return final

    def _write_manifest(self, manifest: Mapping[str, Any], num_stages: int) -> None:
        """Validate what the manifest will claim, then write it (fsynced) into the tmp dir."""
        if num_stages < 1 or set(self._shards) != set(range(num_stages)):
            raise CheckpointError(
                f"shards written for stages {sorted(self._shards)}, expected 0..{num_stages - 1}"
            )
        missing = [k for k in _REQUIRED if k not in manifest]
        clash = [k for k in _RESERVED if k in manifest]
        if missing or clash:
            raise CheckpointError(f"manifest lacks {missing} / must not set {clash}")
        _check_model_dict(manifest["model"])
        for info in self._shards.values():
            size = (self.tmp_dir / info.file).stat().st_size
            if size != info.bytes:
                raise CheckpointError(f"{info.file} is {size} bytes, ShardInfo says {info.bytes}")
        now = time.time()
        doc = {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "time": now,
            "time_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            **manifest,
            "num_stages": num_stages,
            "stages": [self._shards[k].manifest_entry() for k in range(num_stages)],
        }
        try:
            text = json.dumps(doc, indent=1, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"manifest is not JSON-serialisable: {e}") from e
        with open(self.tmp_dir / MANIFEST, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def abort(self) -> None:
        """Discard this save: remove the tmp dir (the previous checkpoint is untouched)."""
        with self._lock:
            self._closed = True
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self._release()
