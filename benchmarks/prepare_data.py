"""Throughput of ``prepare_data`` (what ``geopipe prepare-data`` runs) on ~100 MB of JSONL.

The input is synthetic but deterministic: documents of 20-200 consecutive lines cut at seeded
random places from the standard library's sources, one JSON object per line. The tokenizer is
the built-in stdlib-bpe one (a 4096-token byte-level BPE, built into a temporary cache first,
not timed). Timed: the whole ``prepare_data`` call with the default process count (loading
the tokenizer, planning, tokenizing, writing shards and hashes). MB are input bytes (1e6).

Run: ``.venv/bin/python benchmarks/prepare_data.py [--mb 100] [--processes N]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from geopipe.model.builtin import ensure_stdlib_bpe
from geopipe.model.prepare import default_processes, prepare_data
from geopipe.model.stdlib import stdlib_files


def write_jsonl(path: Path, target_bytes: int, seed: int = 0) -> int:
    """Write documents until ``target_bytes``; returns the bytes written."""
    sources = [p.read_text(encoding="utf-8", errors="replace").splitlines() for p in stdlib_files()]
    sources = [lines for lines in sources if len(lines) >= 20]
    rng = np.random.default_rng(seed)
    written = 0
    with path.open("w", encoding="utf-8") as f:
        while written < target_bytes:
            lines = sources[int(rng.integers(len(sources)))]
            start = int(rng.integers(len(lines)))
            doc = "\n".join(lines[start : start + int(rng.integers(20, 201))])
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            written += len(line.encode())
    return written


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100.0, help="input size in MB")
    ap.add_argument("--processes", type=int, default=None, help="default: the CPUs available")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="geopipe-prepare-"))
    try:
        data = tmp / "synthetic.jsonl"
        size = write_jsonl(data, int(args.mb * 1e6))
        tokenizer = ensure_stdlib_bpe(tmp / "cache") / "tokenizer"
        processes = args.processes or default_processes()
        t0 = time.perf_counter()
        m = prepare_data([data], tokenizer, tmp / "out", processes=processes, progress=False)
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mb_s = size / 1e6 / seconds
    print(
        f"prepare_data: {size / 1e6:.1f} MB of JSONL, {m['documents']:,} documents -> "
        f"{m['token_count']:,} tokens ({size / m['token_count']:.2f} bytes/token) in "
        f"{seconds:.1f} s with {processes} process(es): {mb_s:.1f} MB/s, "
        f"{m['token_count'] / seconds / 1e6:.2f} M tokens/s"
    )
    print(
        json.dumps(
            {
                "prepare_data_mb_per_s": round(mb_s, 2),
                "tokens": m["token_count"],
                "seconds": round(seconds, 2),
                "processes": processes,
            }
        )
    )


if __name__ == "__main__":
    main()
