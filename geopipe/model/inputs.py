"""The input files of ``geopipe prepare-data``: which files a list of paths names, in what
order, and how each one is read (text, JSONL or Parquet; binary files found in a directory
skipped).

Its own module because the file walk decides only *what* is tokenized and in which order
(the order the dataset digest depends on), before any tokenizer is loaded:
:mod:`geopipe.model.prepare` cuts these files into tasks, tokenizes and writes them, and
:mod:`geopipe.model.builtin` hands it files of its own.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from geopipe.model.tokens import DatasetError

__all__ = ["InputFile", "collect_inputs"]

_JSONL = frozenset({".jsonl", ".json"})
_PARQUET = frozenset({".parquet"})
_SNIFF = 8192


@dataclass(frozen=True)
class InputFile:
    """One input file and how to read it: ``text`` (one document), ``jsonl`` or ``parquet``."""

    path: Path
    kind: str


def _kind(path: Path, explicit: bool) -> str | None:
    """How to read ``path``; None skips a binary file found in a directory."""
    suffix = path.suffix.lower()
    if suffix in _JSONL:
        return "jsonl"
    if suffix in _PARQUET:
        return "parquet"
    with path.open("rb") as f:
        if b"\0" not in f.read(_SNIFF):
            return "text"
    if explicit:
        raise DatasetError(f"{path}: not a text, JSONL or Parquet file (binary content)")
    return None


def _walk(root: Path, exclude: Path | None) -> list[Path]:
    """Files under ``root`` sorted by relative path; hidden names and ``exclude`` skipped."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [
            d for d in dirnames if not d.startswith(".") and (here / d).resolve() != exclude
        ]
        found.extend(here / f for f in filenames if not f.startswith("."))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def collect_inputs(inputs: Sequence[str | Path], exclude: Path | None = None) -> list[InputFile]:
    """The input files in a deterministic order: inputs in the order given, directories
    recursed and sorted by relative path (binary files in them skipped)."""
    if not inputs:
        raise DatasetError("no inputs given")
    files: list[InputFile] = []
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            for p in _walk(path, exclude):
                kind = _kind(p, explicit=False)
                if kind is not None:
                    files.append(InputFile(p, kind))
        elif path.is_file():
            files.append(InputFile(path, _kind(path, explicit=True) or "text"))
        else:
            raise DatasetError(f"{path}: no such file or directory")
    return files
