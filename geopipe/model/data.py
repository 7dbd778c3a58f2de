"""Deterministic, resumable token stream over a byte corpus (vocab 256) or a token dataset.

Every sample is a pure function of ``(seed, sample_index)`` and every sample index is a pure
function of ``(step, group, pipeline, micro_batch)`` (the outer loop's replica groups take
disjoint slices of each global batch: :func:`group_sample_indices`), so the only data state a
run needs to checkpoint is ``{"seed", "step", "corpus_digest"}``: resuming at step N reproduces
exactly the batches an uninterrupted run would have seen, on any node and any pipeline layout.
The stream only needs ``len``, ``window`` and ``digest`` of its corpus, so a prepared
:class:`~geopipe.model.tokens.TokenDataset` works the same as the byte :class:`Corpus`.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from geopipe.model.stdlib import stdlib_files as _stdlib_files
from geopipe.model.tokens import TokenDataset, is_token_dataset, read_manifest

__all__ = [
    "STDLIB_BPE",
    "VOCAB_SIZE",
    "Corpus",
    "TokenStream",
    "global_indices",
    "group_sample_indices",
    "micro_batches_per_pipeline",
    "open_corpus",
    "sample_indices",
]

VOCAB_SIZE = 256  # the byte corpus's vocabulary
STDLIB_BPE = "stdlib-bpe"
_BINARY_SNIFF = 8192


def _is_text(path: Path) -> bool:
    """Cheap binary sniff: a NUL byte in the first 8 KiB means 'not text'."""
    with path.open("rb") as f:
        return b"\0" not in f.read(_BINARY_SNIFF)


def _read_files(files: list[Path], max_bytes: int | None) -> bytes:
    """Concatenate files in the given order, stopping once max_bytes are collected."""
    chunks: list[bytes] = []
    total = 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
    out = b"".join(chunks)
    return out if max_bytes is None else out[:max_bytes]


def _dir_files(root: Path) -> list[Path]:
    """All text-ish files under root, sorted by relative path for a machine-independent order."""
    files = [p for p in root.rglob("*") if p.is_file() and _is_text(p)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


class Corpus:
    """An immutable byte corpus held as a uint8 array.

    ``source`` is ``"stdlib"`` (the Python standard library's ``.py`` sources: a corpus every
    machine has without downloads), a path to a file, or a directory (all text-ish files
    under it, sorted by relative path). At most ``max_bytes`` bytes are kept (``None``: all).
    """

    def __init__(self, source: str | Path = "stdlib", max_bytes: int | None = 4_000_000) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        self.source = str(source)
        if str(source) == "stdlib":
            data = _read_files(_stdlib_files(), max_bytes)
        else:
            path = Path(source)
            if not path.exists():
                raise ValueError(
                    f"corpus source {self.source!r} does not exist "
                    "(expected 'stdlib', a text file or a directory)"
                )
            files = _dir_files(path) if path.is_dir() else [path]
            data = _read_files(files, max_bytes)
        if not data:
            raise ValueError(f"corpus source {self.source!r} contains no (text) bytes")
        self.tokens: np.ndarray = np.frombuffer(data, dtype=np.uint8)

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "<bytes>") -> Corpus:
        """Build a corpus from in-memory bytes (tests, synthetic data)."""
        if not data:
            raise ValueError("corpus data is empty")
        corpus = cls.__new__(cls)
        corpus.source = name
        corpus.tokens = np.frombuffer(bytes(data), dtype=np.uint8)
        return corpus

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def window(self, offset: int, n: int) -> np.ndarray:
        """Bytes ``[offset, offset + n)`` as int64 token ids."""
        return self.tokens[offset : offset + n].astype(np.int64)

    @cached_property
    def digest(self) -> str:
        """sha256 of the bytes, so every node of a multi-node run can check it has the same data."""
        return hashlib.sha256(self.tokens.tobytes()).hexdigest()

    def __repr__(self) -> str:
        return f"Corpus(source={self.source!r}, bytes={len(self)}, digest={self.digest[:12]})"


class TokenStream:
    """Random windows of a corpus, where sample ``i`` depends only on ``(seed, i)``.

    The offset of a sample comes from ``np.random.default_rng([seed, index])`` (a
    counter-based derivation with no hidden state), so samples can be produced in any order,
    on any node, and after any restart with identical results.
    """

    def __init__(self, corpus: Corpus | TokenDataset, seed: int) -> None:
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.corpus = corpus
        self.seed = seed

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        """Tokens [offset, offset + seq_len + 1) as int64 (inputs plus one shifted target)."""
        if index < 0:
            raise ValueError(f"sample index must be non-negative, got {index}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        n = len(self.corpus)
        if n < seq_len + 1:
            raise ValueError(
                f"corpus {self.corpus.source!r} has {n} tokens but a sample of seq_len "
                f"{seq_len} needs at least {seq_len + 1}"
            )
        offset = int(np.random.default_rng([self.seed, index]).integers(0, n - seq_len))
        return self.corpus.window(offset, seq_len + 1)

    def batch(self, indices: list[int] | range, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs x (n, seq_len) and next-token targets y (n, seq_len) for the given samples."""
        indices = list(indices)
        if not indices:
            raise ValueError("batch needs at least one sample index")
        rows = np.stack([self.sample(i, seq_len) for i in indices])
        data = torch.from_numpy(rows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def state_dict(self, step: int) -> dict[str, Any]:
        """Everything needed to resume the stream at optimizer step ``step``."""
        return {"seed": self.seed, "step": int(step), "corpus_digest": self.corpus.digest}

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Check a saved state matches this stream and return the step to resume at."""
        if state["seed"] != self.seed:
            raise ValueError(f"data seed mismatch: checkpoint {state['seed']}, stream {self.seed}")
        if state["corpus_digest"] != self.corpus.digest:
            raise ValueError(
                "corpus digest mismatch: the checkpoint was trained on different data "
                f"({state['corpus_digest'][:12]} != {self.corpus.digest[:12]})"
            )
        return int(state["step"])


def open_corpus(source: str | Path, max_bytes: int | None = 4_000_000) -> Corpus | TokenDataset:
    """The corpus a run's ``data`` setting names.

    A directory holding ``manifest.json`` is a prepared :class:`TokenDataset`;
    ``"stdlib-bpe"`` is the built-in BPE dataset (built and cached on first use); anything
    else (``"stdlib"``, a text file, a directory of text) is a byte :class:`Corpus` of at
    most ``max_bytes`` bytes. ``max_bytes`` applies to byte corpora only: a token dataset is
    used whole.
    """
    if str(source) == STDLIB_BPE:
        from geopipe.model.builtin import ensure_stdlib_bpe  # trains a tokenizer on first use

        return TokenDataset(ensure_stdlib_bpe())
    if is_token_dataset(source):
        return TokenDataset(source)
    path = Path(source)
    if path.is_dir() and any(path.glob("tokens-*.bin")):
        # Token shards read as text would train on garbage (a missing manifest, not a corpus).
        read_manifest(path)
    return Corpus(source, max_bytes=max_bytes)


def micro_batches_per_pipeline(global_batch: int, num_pipelines: int, micro_batch_size: int) -> int:
    """Micro-batches each pipeline runs per optimizer step; validates divisibility."""
    if global_batch < 1 or num_pipelines < 1 or micro_batch_size < 1:
        raise ValueError(
            "global_batch, num_pipelines and micro_batch_size must be >= 1, got "
            f"{global_batch}, {num_pipelines}, {micro_batch_size}"
        )
    if global_batch % num_pipelines:
        raise ValueError(
            f"global_batch {global_batch} is not divisible by num_pipelines {num_pipelines}"
        )
    per_pipeline = global_batch // num_pipelines
    if per_pipeline % micro_batch_size:
        raise ValueError(
            f"per-pipeline batch {per_pipeline} is not divisible by "
            f"micro_batch_size {micro_batch_size}"
        )
    return per_pipeline // micro_batch_size


def sample_indices(
    step: int, global_batch: int, micro_batch: int, micro_batch_size: int
) -> list[int]:
    """Sample indices of the ``micro_batch``-th micro-batch of the global batch at ``step``.

    Step ``s`` uses samples ``s*global_batch .. (s+1)*global_batch - 1`` in micro-batches
    of consecutive samples; pipelines take consecutive runs of micro-batches, whatever their
    number and share (:func:`global_indices` for equal shares).
    """
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if not 0 <= micro_batch < global_batch // micro_batch_size:
        raise ValueError(
            f"micro_batch {micro_batch} out of range [0, {global_batch // micro_batch_size})"
        )
    first = step * global_batch + micro_batch * micro_batch_size
    return list(range(first, first + micro_batch_size))


def global_indices(
    step: int,
    global_batch: int,
    pipeline: int,
    num_pipelines: int,
    micro_batch: int,
    micro_batch_size: int,
) -> list[int]:
    """Sample indices of micro-batch ``micro_batch`` of pipeline ``pipeline`` at ``step``.

    Step ``s`` uses samples ``s*global_batch .. (s+1)*global_batch - 1``, split into
    ``num_pipelines`` contiguous equal slices, each split in order into micro-batches.
    """
    n_micro = micro_batches_per_pipeline(global_batch, num_pipelines, micro_batch_size)
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if not 0 <= pipeline < num_pipelines:
        raise ValueError(f"pipeline {pipeline} out of range [0, {num_pipelines})")
    if not 0 <= micro_batch < n_micro:
        raise ValueError(f"micro_batch {micro_batch} out of range [0, {n_micro})")
    per_pipeline = global_batch // num_pipelines
    first = step * global_batch + pipeline * per_pipeline + micro_batch * micro_batch_size
    return list(range(first, first + micro_batch_size))


def group_sample_indices(
    step: int,
    global_batch: int,
    group: int,
    groups: int,
    micro_batch: int,
    micro_batch_size: int,
    start: int | None = None,
) -> list[int]:
    """Sample indices of micro-batch ``micro_batch`` of replica group ``group``'s slice at
    ``step``, when ``groups`` replica groups (the outer loop's) share each global batch.
    ``start``: where the group's slice begins, in micro-batches of the global batch, when the
    groups' shares differ (the planner's balanced shares: [Note: batch shares] in
    :mod:`geopipe.optimizer.strategy`); None: equal shares, as below.

    Group ``g`` of ``M`` takes samples ``[g*B/M, (g+1)*B/M)`` of global batch ``B``, and its
    own pipelines divide that slice as one group's pipelines divide a whole global batch
    (``micro_batch`` counts micro-batches inside the slice). The union over groups is
    therefore exactly the single-group global batch, each sample once, and a sample stays a
    pure function of ``(seed, index)``: M groups see the samples one group would, which is
    what makes the outer loop comparable with synchronous training at equal tokens. With
    ``groups == 1`` this is :func:`sample_indices`."""
    if groups < 1 or not 0 <= group < groups:
        raise ValueError(f"replica group {group} out of range [0, {groups})")
    if start is not None:
        if start < 0 or micro_batch < 0 or start + micro_batch >= global_batch // micro_batch_size:
            raise ValueError(
                f"micro_batch {micro_batch} of a slice from {start} is outside the global "
                f"batch of {global_batch // micro_batch_size} micro-batches"
            )
        return sample_indices(step, global_batch, start + micro_batch, micro_batch_size)
    if global_batch % (groups * micro_batch_size):
        raise ValueError(
            f"global_batch {global_batch} does not split into {groups} replica groups of "
            f"whole micro-batches of {micro_batch_size}"
        )
    per_group = global_batch // groups // micro_batch_size
    if not 0 <= micro_batch < per_group:
        raise ValueError(
            f"micro_batch {micro_batch} out of range [0, {per_group}) of a group's slice"
        )
    return sample_indices(step, global_batch, group * per_group + micro_batch, micro_batch_size)
