"""Checking a checkpoint directory against its manifest before it is trusted.

[Note: what is verified, when] Every shard's size and SHA-256 is checked against the
manifest (:func:`verify_dir`): by a save before it replaces anything already committed,
by the driver before a resume or a recovery from a shared directory, and by a site's store
before it hands a copy to the stage actors. A store hashes each copy once and then trusts
:func:`signature` — size, mtime, ctime and inode of every file in the directory — so a
shard rewritten, truncated, replaced or deleted since is hashed again: ctime changes with
any write and cannot be set back from user space. A cache keyed on the manifest alone (as
before) missed a shard corrupted after its commit.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from geopipe.checkpoint.store import _check_files, _read_manifest

__all__ = ["bad_file", "signature", "verify_dir"]

_FILE_IN = re.compile(r"(stage-\d+\.safetensors|manifest\.json)")


def verify_dir(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint in ``path`` once every shard it names has its size
    and SHA-256 (any directory name: a save's temporary one too). Raises
    :class:`CheckpointError` naming the first bad file."""
    path = Path(path)
    doc = _read_manifest(path, None)
    _check_files(path, doc, verify=True)
    return doc


def bad_file(reason: str) -> str | None:
    """The file a verification error names (``stage-1.safetensors``, ``manifest.json``)."""
    m = _FILE_IN.search(reason)
    return m.group(1) if m else None


def signature(path: str | os.PathLike[str]) -> tuple:
    """What changes when any file of the directory is written, replaced, truncated,
    added or deleted: (name, size, mtime, ctime, inode) of each, sorted by name."""
    out = []
    with os.scandir(path) as it:
        for e in it:
            st = e.stat(follow_symlinks=False)
            out.append((e.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(sorted(out))
