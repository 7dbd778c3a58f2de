"""The Python standard library's ``.py`` sources: a text corpus every machine has.

Shared by the byte corpus (:mod:`geopipe.model.data`) and the built-in BPE dataset
(:mod:`geopipe.model.builtin`), which must not import each other.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

__all__ = ["stdlib_files"]

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_files() -> list[Path]:
    """The stdlib's .py files sorted by relative path; third-party site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: site-packages can be far larger than the stdlib itself.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())
