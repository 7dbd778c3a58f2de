"""Tokenize text once into a :class:`~geopipe.model.tokens.TokenDataset` (``geopipe prepare-data``).

Training should never wait on a tokenizer, and every node of a run must see the same tokens,
so tokenization is a separate, deterministic step: inputs are walked in sorted order, cut
into tasks (groups of text files, byte ranges of JSONL files on line boundaries, Parquet row
groups), tokenized by a pool of processes and written back in task order. The result does
not depend on the number of processes: the same inputs and tokenizer give byte-identical
shards, and hence the same dataset digest, on any machine.

Every document is followed by the tokenizer's EOS token. Text that happens to spell a special
token (``<|endoftext|>`` in a source file) is tokenized as plain text
(``split_special_tokens``), so EOS marks document ends and nothing else. Empty documents are
skipped. The output directory appears atomically: it is written under a temporary name next
to it and renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from geopipe.model.inputs import InputFile, collect_inputs
from geopipe.model.tokens import FORMAT, MANIFEST, DatasetError, choose_dtype, file_sha256

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "OutputExistsError",
    "default_processes",
    "load_tokenizer",
    "prepare_data",
    "write_dataset",
]

DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 per shard
_TASK_BYTES = 1 << 22  # input bytes per task: progress granularity and worker memory
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_PARALLELISM = "TOKENIZERS_PARALLELISM"


class OutputExistsError(DatasetError):
    """The output directory exists and overwriting was not asked for."""


class _Piece(NamedTuple):
    """A part of one file a worker tokenizes: a whole text file, a byte range of a JSONL file
    (``start``/``stop``, on line boundaries) or one Parquet row group (``start``)."""

    kind: str
    path: str
    start: int
    stop: int
    nbytes: int


def default_processes() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# ---- tokenizer ----------------------------------------------------------------------------


def load_tokenizer(tokenizer_dir: str | Path) -> Any:
    """``AutoTokenizer.from_pretrained(dir)`` from local files only; a fast tokenizer with EOS."""
    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise DatasetError(f"{path}: not a directory (a tokenizer directory is expected)")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise DatasetError(f"{path}: no tokenizer (no tokenizer.json or tokenizer_config.json)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds; the message is what matters
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetError(f"{path}: cannot load the tokenizer: {first}") from None
    if not getattr(tok, "is_fast", False):
        raise DatasetError(f"{path}: not a fast tokenizer (tokenizer.json is needed)")
    if tok.eos_token_id is None:
        raise DatasetError(f"{path}: the tokenizer has no EOS token (set eos_token)")
    return tok


def _vocab_size(tok: Any) -> int:
    """len(tokenizer), or one past the largest id if some id lies beyond it."""
    return max(len(tok), max(tok.get_vocab().values()) + 1)


# ---- tasks --------------------------------------------------------------------------------


def _jsonl_pieces(path: Path) -> Iterator[_Piece]:
    """Byte ranges of about _TASK_BYTES, each ending at a line end."""
    size = path.stat().st_size
    start = 0
    with path.open("rb") as f:
        while start < size:
            target = start + _TASK_BYTES
            if target >= size:
                stop = size
            else:
                f.seek(target - 1)
                f.readline()
                stop = f.tell()
            yield _Piece("jsonl", str(path), start, stop, stop - start)
            start = stop


def _parquet_pieces(path: Path, field: str) -> Iterator[_Piece]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except Exception as exc:
        raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from None
    schema = meta.schema_arrow
    if field not in schema.names:
        raise DatasetError(f"{path}: no column {field!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DatasetError(f"{path}: column {field!r} is {kind}, not a string")
    n, size = meta.num_row_groups, path.stat().st_size
    for i in range(n):
        yield _Piece("parquet", str(path), i, i + 1, size * (i + 1) // n - size * i // n)


def _plan(files: list[InputFile], field: str) -> list[tuple[_Piece, ...]]:
    """Cut the inputs into tasks of about _TASK_BYTES each, in input order."""
    tasks: list[tuple[_Piece, ...]] = []
    group: list[_Piece] = []
    group_bytes = 0
    for f in files:
        if f.kind == "text":
            size = f.path.stat().st_size
            group.append(_Piece("text", str(f.path), 0, size, size))
            group_bytes += size
            if group_bytes >= _TASK_BYTES:
                tasks.append(tuple(group))
                group, group_bytes = [], 0
            continue
        if group:
            tasks.append(tuple(group))
            group, group_bytes = [], 0
        pieces = _jsonl_pieces(f.path) if f.kind == "jsonl" else _parquet_pieces(f.path, field)
        tasks.extend((p,) for p in pieces)
    if group:
        tasks.append(tuple(group))
    return tasks


# ---- workers ------------------------------------------------------------------------------


class _Worker:
    """Per-process state: the tokenizer (rebuilt from its JSON) and the output settings."""

    tokenizer: Any = None
    eos: int = 0
    dtype: np.dtype = np.dtype("<u2")
    field: str = "text"


def _init_worker(tokenizer_json: str, eos: int, dtype: str, field: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True  # "<|endoftext|>" inside a document is plain text
    _Worker.tokenizer, _Worker.eos = tok, eos
    _Worker.dtype = np.dtype("<u2") if dtype == "uint16" else np.dtype("<u4")
    _Worker.field = field


def _line_number(path: str, start: int, index: int) -> int:
    """1-based line number of line ``index`` of the range starting at byte ``start``."""
    with open(path, "rb") as f:
        return f.read(start).count(b"\n") + index + 1


def _jsonl_docs(piece: _Piece, field: str) -> list[str]:
    with open(piece.path, "rb") as f:
        f.seek(piece.start)
        data = f.read(piece.stop - piece.start)
    docs: list[str] = []
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        problem = None
        try:
            doc = json.loads(line)
        except ValueError as exc:
            problem = f"not valid JSON ({exc})"
        else:
            if not isinstance(doc, dict) or field not in doc:
                problem = f"no {field!r} field"
            elif not isinstance(doc[field], str):
                problem = f"field {field!r} is {type(doc[field]).__name__}, not a string"
        if problem:
            raise DatasetError(
                f"{piece.path}:{_line_number(piece.path, piece.start, i)}: {problem}"
            )
        docs.append(doc[field])
    return docs


def _parquet_docs(piece: _Piece, field: str) -> list[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(piece.path)
    values = pf.read_row_group(piece.start, columns=[field]).column(0).to_pylist()
    if None in values:
        first = sum(pf.metadata.row_group(g).num_rows for g in range(piece.start))
        row = first + values.index(None)
        raise DatasetError(f"{piece.path}: row {row}: {field!r} is null")
    return values


def _documents(task: tuple[_Piece, ...], field: str) -> list[str]:
    docs: list[str] = []
    for piece in task:
        if piece.kind == "text":
            docs.append(Path(piece.path).read_bytes().decode("utf-8", errors="replace"))
        elif piece.kind == "jsonl":
            docs.extend(_jsonl_docs(piece, field))
        else:
            docs.extend(_parquet_docs(piece, field))
    return [d for d in docs if d]


def _encode_task(task: tuple[_Piece, ...]) -> tuple[np.ndarray, int, int]:
    """(tokens with an EOS after every document, documents, input bytes) of one task."""
    docs = _documents(task, _Worker.field)
    tok = _Worker.tokenizer
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    ids = [e.ids for e in encode(docs, add_special_tokens=False)]
    out = np.empty(sum(map(len, ids)) + len(ids), dtype=_Worker.dtype)
    pos = 0
    for seq in ids:
        out[pos : pos + len(seq)] = seq
        pos += len(seq)
        out[pos] = _Worker.eos
        pos += 1
    return out, len(docs), sum(p.nbytes for p in task)


@contextmanager
def _encoded(tasks: list[tuple[_Piece, ...]], init: tuple, processes: int) -> Iterator[Iterator]:
    """Encoded tasks in task order, from this process or from a pool of ``processes``.

    In this process the tokenizer may use its own threads. Pool workers are forked on Linux
    (no ``__main__`` guard needed, no re-imports) with the tokenizer's threads off: one
    process per CPU already, and a forked child must not use a thread pool its parent
    started. Elsewhere they are spawned (callers need the usual ``__main__`` guard).
    """
    processes = min(processes, len(tasks))
    if processes <= 1:
        _init_worker(*init)
        yield map(_encode_task, tasks)
        return
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    saved = os.environ.get(_PARALLELISM)
    os.environ[_PARALLELISM] = "false"
    try:
        # concurrent.futures, not multiprocessing.Pool: Pool.terminate (its __exit__ after
        # an error such as a bad JSONL line) can deadlock its task-handler thread on the
        # queue's lock, a hang seen in the suite; the executor's shutdown cancels what has
        # not started and waits for what has.
        pool = ProcessPoolExecutor(processes, mp.get_context(method), _init_worker, init)
        try:
            yield pool.map(_encode_task, tasks)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        if saved is None:
            os.environ.pop(_PARALLELISM, None)
        else:
            os.environ[_PARALLELISM] = saved


# ---- output -------------------------------------------------------------------------------


class _ShardWriter:
    """Splits the token stream into shards of ``shard_tokens``, hashing while writing."""

    def __init__(self, root: Path, shard_tokens: int) -> None:
        self.root, self.shard_tokens = root, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._hash = hashlib.sha256()
        self._count = 0

    def _open(self) -> None:
        name = f"tokens-{len(self.shards):05d}.bin"
        self._file = (self.root / name).open("wb")
        self._hash, self._count = hashlib.sha256(), 0
        self.shards.append({"file": name, "tokens": 0, "sha256": ""})

    def add(self, tokens: np.ndarray) -> None:
        pos = 0
        while pos < len(tokens):
            if self._file is None:
                self._open()
            take = min(len(tokens) - pos, self.shard_tokens - self._count)
            data = tokens[pos : pos + take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += take
            pos += take
            if self._count == self.shard_tokens:
                self._close()

    def _close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        self.shards[-1].update(tokens=self._count, sha256=self._hash.hexdigest())

    def finish(self) -> list[dict[str, Any]]:
        if self._file is not None:
            self._close()
        return self.shards


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``out`` (replacing it only when ``overwrite``)."""
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise OutputExistsError(f"{out}: exists (overwrite it with --overwrite)")
        old = out.with_name(f".{out.name}.old-{secrets.token_hex(4)}")
        out.rename(old)
        tmp.rename(out)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
        return
    try:
        tmp.rename(out)
    except OSError:
        if out.exists():  # another writer finished first
            raise OutputExistsError(f"{out}: exists (written concurrently)") from None
        raise


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr; yields ``advance(nbytes)``."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("tokenizing"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("tokenizing", total=total)
        yield lambda n: bar.update(task, advance=n)


def _tokenize_into(tmp: Path, files: list[InputFile], tok: Any, opts: dict[str, Any]) -> dict:
    """Tokenize ``files`` into shards under ``tmp``; the manifest's data fields."""
    vocab = _vocab_size(tok)
    dtype = choose_dtype(vocab)
    tasks = _plan(files, opts["text_field"])
    init = (tok.backend_tokenizer.to_str(), int(tok.eos_token_id), dtype, opts["text_field"])
    writer = _ShardWriter(tmp, opts["shard_tokens"])
    documents = done = 0
    total = sum(p.nbytes for t in tasks for p in t)
    with (
        _encoded(tasks, init, opts["processes"]) as results,
        _progress(total, opts["progress"]) as advance,
    ):
        for tokens, docs, nbytes in results:
            writer.add(tokens)
            documents += docs
            done += nbytes
            advance(nbytes)
    shards = writer.finish()
    return {
        "vocab_size": vocab,
        "eos_token_id": int(tok.eos_token_id),
        "dtype": dtype,
        "token_count": sum(s["tokens"] for s in shards),
        "documents": documents,
        "input_bytes": done,
        "shards": shards,
    }


def write_dataset(
    files: list[InputFile],
    tokenizer: Any,
    out_dir: str | Path,
    *,
    tokenizer_name: str,
    sources: list[str],
    text_field: str = "text",
    processes: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize ``files`` with a loaded ``tokenizer`` into the dataset ``out_dir``; the manifest.

    The building block of :func:`prepare_data` for callers that choose the files themselves.
    """
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    out = Path(out_dir)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise OutputExistsError(f"{out}: exists (overwrite it with --overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        opts = {
            "text_field": text_field,
            "shard_tokens": shard_tokens,
            "progress": progress,
            "processes": processes or default_processes(),
        }
        data = _tokenize_into(tmp, files, tokenizer, opts)
        if data["token_count"] == 0:
            raise DatasetError(f"{', '.join(sources)}: no documents (no non-empty text found)")
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        manifest = {
            "format": FORMAT,
            "tokenizer": {
                "name": tokenizer_name,
                "sha256": file_sha256(tmp / "tokenizer" / "tokenizer.json"),
                "dir": "tokenizer",
            },
            **data,
            "sources": list(sources),
            "text_field": text_field,
            "split_special_tokens": True,
        }
        with (tmp / MANIFEST).open("w") as f:
            f.write(json.dumps(manifest, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, out, overwrite)
    finally:
        with suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    return manifest


def prepare_data(
    inputs: Sequence[str | Path],
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    text_field: str = "text",
    processes: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize text, JSONL and Parquet ``inputs`` into a token dataset at ``out_dir``.

    Files and directories (recursed, sorted by relative path); ``.jsonl``/``.json``: one
    document per line, its ``text_field``; ``.parquet``: the ``text_field`` column; any other
    text file is one document (binary files inside directories are skipped). The tokenizer
    in ``tokenizer_dir`` is loaded from local files only and copied into the dataset.
    ``processes`` defaults to the CPUs available. Returns the manifest.
    """
    tok = load_tokenizer(tokenizer_dir)
    out = Path(out_dir)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise OutputExistsError(f"{out}: exists (overwrite it with --overwrite)")
    files = collect_inputs(inputs, exclude=out.resolve())
    return write_dataset(
        files,
        tok,
        out,
        tokenizer_name=Path(tokenizer_dir).resolve().name,
        sources=[str(i) for i in inputs],
        text_field=text_field,
        processes=processes,
        shard_tokens=shard_tokens,
        progress=progress,
        overwrite=overwrite,
    )
