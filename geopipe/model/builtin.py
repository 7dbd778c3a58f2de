"""The built-in ``stdlib-bpe`` dataset: a BPE tokenizer and token dataset from the stdlib.

A demo with real subword tokens should not need a download, so the first use trains a
byte-level BPE tokenizer (vocab 4096, ``<|endoftext|>`` as EOS) on the first
:data:`STDLIB_BPE_MAX_BYTES` of the Python standard library's ``.py`` sources and tokenizes
the same files with :func:`~geopipe.model.prepare.write_dataset`. Both steps are
deterministic, so every machine with the same Python builds the same dataset (same digest).

The result is cached in ``$GEOPIPE_CACHE/stdlib-bpe-4096`` (default
``~/.cache/geopipe/stdlib-bpe-4096``): a token dataset whose ``tokenizer/`` is the trained
tokenizer. Builders write under a temporary name and rename; when several processes build at
once (the stage actors of a first run), one rename wins and the others use its result.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from geopipe.model.inputs import InputFile
from geopipe.model.prepare import OutputExistsError, write_dataset
from geopipe.model.stdlib import stdlib_files
from geopipe.model.tokens import MANIFEST

__all__ = [
    "EOS_TOKEN",
    "STDLIB_BPE_DIR",
    "STDLIB_BPE_MAX_BYTES",
    "STDLIB_BPE_VOCAB",
    "cache_root",
    "ensure_stdlib_bpe",
    "stdlib_bpe_files",
    "train_bpe_tokenizer",
]

log = logging.getLogger(__name__)

STDLIB_BPE_VOCAB = 4096
STDLIB_BPE_DIR = f"stdlib-bpe-{STDLIB_BPE_VOCAB}"
STDLIB_BPE_MAX_BYTES = 8_000_000
EOS_TOKEN = "<|endoftext|>"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$GEOPIPE_CACHE``, else ``~/.cache/geopipe``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("GEOPIPE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "geopipe"


def stdlib_bpe_files(max_bytes: int = STDLIB_BPE_MAX_BYTES) -> list[Path]:
    """The stdlib's ``.py`` files in sorted order, whole files, until ``max_bytes`` are reached."""
    files: list[Path] = []
    total = 0
    for path in stdlib_files():
        if total >= max_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    return files


def _texts(files: Iterable[Path]) -> Iterable[str]:
    for path in files:  # decoded as prepare_data decodes text files
        yield path.read_bytes().decode("utf-8", errors="replace")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Train a byte-level BPE (GPT-2 style, EOS ``<|endoftext|>``) and ``save_pretrained`` it.

    Every byte is in the initial alphabet, so any text encodes without an unknown token.
    Training is deterministic for the same texts. Returns ``out_dir``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
    )
    fast.save_pretrained(str(out_dir))
    return Path(out_dir)


def ensure_stdlib_bpe(cache_dir: str | Path | None = None) -> Path:
    """The ``stdlib-bpe`` dataset directory, built on first use (a few seconds)."""
    out = cache_root(cache_dir) / STDLIB_BPE_DIR
    if (out / MANIFEST).is_file():
        return out
    from geopipe.model.prepare import load_tokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    files = stdlib_bpe_files()
    work = Path(tempfile.mkdtemp(prefix=f".{STDLIB_BPE_DIR}.tok-", dir=out.parent))
    try:
        train_bpe_tokenizer(_texts(files), STDLIB_BPE_VOCAB, work)
        source = (
            f"stdlib:{platform.python_implementation()}-{platform.python_version()} (the first "
            f"{len(files)} .py files by path, {sum(p.stat().st_size for p in files)} bytes)"
        )
        # One process (the tokenizer still uses every core): the caller may be a stage
        # actor, whose threads make forking a worker pool unwise.
        write_dataset(
            [InputFile(p, "text") for p in files],
            load_tokenizer(work),
            out,
            tokenizer_name=STDLIB_BPE_DIR,
            sources=[source],
            progress=False,
            processes=1,
        )
        log.info("built %s in %.1f s", out, time.perf_counter() - t0)
    except OutputExistsError:
        if not (out / MANIFEST).is_file():
            raise
        log.info("another process built %s first; using it", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
