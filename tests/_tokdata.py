"""A small BPE tokenizer and stdlib documents for the token-dataset tests."""

from __future__ import annotations

from pathlib import Path

from geopipe.model.builtin import train_bpe_tokenizer
from geopipe.model.stdlib import stdlib_files

SMALL_VOCAB = 512


def stdlib_sources(n: int, skip: int = 40) -> list[Path]:
    """``n`` non-empty stdlib .py files (past the first ``skip``, for variety)."""
    files = [p for p in stdlib_files()[skip:] if p.stat().st_size > 0]
    return files[:n]


def train_small_tokenizer(out: Path, vocab: int = SMALL_VOCAB) -> Path:
    """A byte-level BPE with ``<|endoftext|>`` as EOS, trained on a few stdlib files (~0.1 s)."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_sources(8)]
    return train_bpe_tokenizer(texts, vocab, out)
