"""A prepared token dataset: ``manifest.json`` plus read-only memory-mapped token shards.

``geopipe prepare-data`` tokenizes text once, ahead of training, so that a training run
never tokenizes: every stage replica maps the same shards and reads any window in O(1),
whatever the dataset's size. The manifest records the tokenizer (a copy ships in the
dataset) and a sha256 per shard, so ``digest`` (what checkpoints record) identifies the
data without reading it, and :meth:`TokenDataset.verify` can prove the bytes are intact.

Layout of a dataset directory (format ``geopipe-tokens/1``)::

    manifest.json        # see below
    tokenizer/           # the tokenizer, as written by save_pretrained
    tokens-00000.bin     # little-endian uint16 (vocab <= 65535) or uint32 token ids
    tokens-00001.bin     # documents are concatenated, each followed by eos_token_id

``manifest.json``: ``format``, ``tokenizer`` {``name``, ``sha256`` of tokenizer.json,
``dir``}, ``vocab_size``, ``eos_token_id``, ``dtype``, ``token_count``, ``documents``,
``input_bytes``, ``shards`` [{``file``, ``tokens``, ``sha256``}], ``sources``,
``text_field``, ``split_special_tokens``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FORMAT",
    "MANIFEST",
    "DatasetError",
    "TokenDataset",
    "choose_dtype",
    "is_token_dataset",
]

FORMAT = "geopipe-tokens/1"
MANIFEST = "manifest.json"
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_HASH_BLOCK = 1 << 22


class DatasetError(ValueError):
    """Bad dataset input or a damaged dataset; the message is one line naming the file."""


def choose_dtype(vocab_size: int) -> str:
    """``"uint16"`` when every id fits (vocab_size <= 65535), else ``"uint32"``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size > 1 << 32:
        raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")
    return "uint16" if vocab_size <= 65535 else "uint32"


def is_token_dataset(path: str | Path) -> bool:
    """True for a directory holding a ``manifest.json`` (it may still fail to open)."""
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def _field(manifest: dict[str, Any], key: str, kind: type, where: Path) -> Any:
    value = manifest.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise DatasetError(f"{where}: field {key!r} missing or not a {kind.__name__}")
    return value


def read_manifest(root: Path) -> dict[str, Any]:
    """The parsed and checked manifest of the dataset at ``root``."""
    where = root / MANIFEST
    if not where.is_file():
        what = "no such directory" if not root.exists() else "missing"
        raise DatasetError(f"{where}: {what} (not a dataset made by geopipe prepare-data)")
    try:
        manifest = json.loads(where.read_bytes())
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{where}: unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DatasetError(f"{where}: format {got!r}, expected {FORMAT!r}")
    if manifest.get("dtype") not in _DTYPES:
        raise DatasetError(f"{where}: dtype {manifest.get('dtype')!r} is not uint16 or uint32")
    for key in ("vocab_size", "eos_token_id", "token_count", "documents"):
        _field(manifest, key, int, where)
    tok = _field(manifest, "tokenizer", dict, where)
    _field(tok, "sha256", str, where)
    _field(tok, "dir", str, where)
    shards = _field(manifest, "shards", list, where)
    for s in shards:
        if not isinstance(s, dict):
            raise DatasetError(f"{where}: a shard entry is not an object")
        name = _field(s, "file", str, where)
        _field(s, "tokens", int, where)
        _field(s, "sha256", str, where)
        if Path(name).name != name or name in ("", ".", ".."):
            raise DatasetError(f"{where}: shard file {name!r} is not a plain file name")
    total = sum(s["tokens"] for s in shards)
    if total != manifest["token_count"] or total < 1:
        raise DatasetError(
            f"{where}: token_count {manifest['token_count']} but the shards hold {total}"
        )
    return manifest


class TokenDataset:
    """A prepared token dataset with the sampling interface of :class:`~geopipe.model.data.Corpus`.

    Opening checks the manifest and every shard's size (cheap); :meth:`verify` also checks
    the shards' sha256 (reads everything). Shards are mapped read-only, so many processes
    share one copy in the page cache.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.source = str(path)
        self.manifest = read_manifest(self.path)
        m = self.manifest
        self.dtype = _DTYPES[m["dtype"]]
        self.vocab_size: int = m["vocab_size"]
        self.eos_token_id: int = m["eos_token_id"]
        self.documents: int = m["documents"]
        self.shards: list[np.memmap] = []
        for s in m["shards"]:
            self.shards.append(self._map(self.path / s["file"], s["tokens"]))
        sizes = np.array([len(s) for s in self.shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)])
        self._len = int(self._starts[-1])
        self.digest = self._digest()

    def _map(self, file: Path, tokens: int) -> np.memmap:
        if not file.is_file():
            raise DatasetError(f"{file}: shard missing")
        size, want = file.stat().st_size, tokens * self.dtype.itemsize
        if size != want:
            raise DatasetError(
                f"{file}: {size} bytes, expected {want} ({tokens} {self.dtype.name} tokens)"
                f"{'; truncated' if size < want else ''}"
            )
        if tokens < 1:
            raise DatasetError(f"{file}: empty shard")
        return np.memmap(file, dtype=self.dtype, mode="r", shape=(tokens,))

    def _digest(self) -> str:
        """sha256 over the format, dtype, tokenizer digest and the shards' digests."""
        m = self.manifest
        parts = [FORMAT, m["dtype"], m["tokenizer"]["sha256"]]
        parts += [f"{s['tokens']}:{s['sha256']}" for s in m["shards"]]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def __reduce__(self) -> tuple[type, tuple[str]]:
        """Pickle as the path (reopened, and re-checked, on the other side), not the tokens."""
        return (type(self), (self.source,))

    def __len__(self) -> int:
        return self._len

    @property
    def token_count(self) -> int:
        return self._len

    @property
    def tokenizer_dir(self) -> Path:
        """The tokenizer the dataset was made with (``AutoTokenizer.from_pretrained`` it)."""
        return self.path / self.manifest["tokenizer"]["dir"]

    def window(self, offset: int, n: int) -> np.ndarray:
        """Tokens ``[offset, offset + n)`` as int64, read across shard boundaries."""
        if n < 0 or offset < 0 or offset + n > self._len:
            raise ValueError(
                f"window [{offset}, {offset + n}) outside the dataset's {self._len} tokens"
            )
        out = np.empty(n, dtype=np.int64)
        k = int(np.searchsorted(self._starts, offset, side="right")) - 1
        done = 0
        while done < n:
            start = offset + done - int(self._starts[k])
            take = min(n - done, len(self.shards[k]) - start)
            out[done : done + take] = self.shards[k][start : start + take]
            done += take
            k += 1
        return out

    def verify(self) -> None:
        """Recompute every shard's sha256; a mismatch raises DatasetError naming the shard."""
        for s in self.manifest["shards"]:
            file = self.path / s["file"]
            if file_sha256(file) != s["sha256"]:
                raise DatasetError(f"{file}: sha256 mismatch (the shard is corrupt)")
        tok = self.tokenizer_dir / "tokenizer.json"
        if not tok.is_file():
            raise DatasetError(f"{tok}: missing")
        if file_sha256(tok) != self.manifest["tokenizer"]["sha256"]:
            raise DatasetError(f"{tok}: sha256 mismatch (not the tokenizer the data was made with)")

    def __repr__(self) -> str:
        return (
            f"TokenDataset(path={self.source!r}, tokens={self._len}, vocab={self.vocab_size}, "
            f"digest={self.digest[:12]})"
        )
