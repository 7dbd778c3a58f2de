"""A checkpoint root's directories on disk: their names (``step-<N>``, the unique tmp
names of saves and deletes), finding them, and the crash-safe file operations the writer
and the pruner share (fsync, SHA-256 of a file, rename-then-delete), with the tmp dirs of
this process's live writers that a prune must leave alone.

Its own module because this is the file system under the format, apart from what
:mod:`geopipe.checkpoint.store` reads into checkpoints (manifests, shards, their checks)
and from how :mod:`geopipe.checkpoint.writer` commits one; both use it.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["step_dirname", "tmp_dirname"]

_STEP_RE = re.compile(r"^step-(\d{8,})$")
# ``.tmp-step-<step>-<pid>-<token>`` (``-trash``: a checkpoint being deleted); older
# writers left no token
_TMP_RE = re.compile(r"^\.tmp-step-(\d{8,})-(\d+)(?:-[0-9a-f]+)?(?:-trash)?$")
_CHUNK = 8 << 20

# tmp dirs of writers alive in this process: prune and a second writer must leave them alone
_ACTIVE: set[Path] = set()
_ACTIVE_LOCK = threading.Lock()


def _release_tmp(path: Path) -> None:
    with _ACTIVE_LOCK:
        _ACTIVE.discard(path)


def step_dirname(step: int) -> str:
    """``step-<NNNNNNNN>``: zero padded so names sort like steps."""
    return f"step-{step:08d}"


def _fsync(path: Path) -> None:
    """Flush a file's or directory's data and metadata to disk (directories: the entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _dir_stats(path: Path) -> tuple[int, float]:
    """Total bytes of the regular files directly in `path`, and its mtime (0 if gone)."""
    total = 0
    try:
        with os.scandir(path) as it:
            for entry in it:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
        return total, path.stat().st_mtime
    except OSError:
        return total, 0.0


def tmp_dirname(step: int, trash: bool = False) -> str:
    """A name no other save, retry or delete uses: ``.tmp-step-<step>-<pid>-<token>``.

    [Note: one directory per save] Step and pid alone named the same directory for a
    re-save of a step (a retry after a failed save, a site's copy made again): the first
    attempt's abandoned pull, waking up later, then wrote into or unlinked files of the
    new one by path. A random token makes every attempt's directory its own, so a late
    writer can only touch the directory of the attempt it belongs to."""
    return f".tmp-step-{step:08d}-{os.getpid()}-{secrets.token_hex(6)}" + (
        "-trash" if trash else ""
    )


def _trash_path(root: Path, step: int) -> Path:
    """A fresh tmp-style name to move a checkpoint to before deleting or replacing it."""
    return root / tmp_dirname(step, trash=True)


def _delete_checkpoint(path: Path, step: int) -> None:
    """Rename, then delete: a crash mid-delete leaves a tmp dir, never a half step dir."""
    trash = _trash_path(path.parent, step)
    os.rename(path, trash)
    shutil.rmtree(trash)


def _scan(root: Path) -> Iterator[tuple[Path, int, bool]]:
    """(path, step, is_tmp) of every checkpoint-like directory; symlinks are never followed."""
    if not root.is_dir():
        return
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        if m := _STEP_RE.match(entry.name):
            yield Path(entry.path), int(m.group(1)), False
        elif m := _TMP_RE.match(entry.name):
            yield Path(entry.path), int(m.group(1)), True
