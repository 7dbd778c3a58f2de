"""Run a function in N processes (one per rank) and collect what each returns.

Ranks are forked from a ``forkserver`` that has already imported torch and DeepSpeed: a fresh
interpreter spends ~6 s of CPU importing them (torch._dynamo and inductor come in through
torch.optim and DeepSpeed's Muon module), and four ranks doing that at once on two cores took
~16 s before the first collective. The forkserver pays it once per test session.

Results travel through ``torch.save`` files rather than a queue, so large tensors cannot
deadlock the pipe. A failing rank makes the others stop at once instead of waiting for their
gloo timeout, and its traceback is raised in the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Imported once by the forkserver (a missing name is skipped by multiprocessing).
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "deepspeed",
    "deepspeed.runtime.zero.muon.original_muon",
    "geopipe.runtime.actor.engine",
]
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(_PRELOAD)


class Port(int):
    """A port :func:`free_port` chose: :func:`run_ranks` may choose it again."""


def free_port() -> Port:
    """A TCP port free on 127.0.0.1 right now (another process could still take it: then
    :func:`run_ranks` runs again on fresh ports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return Port(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, args: tuple[Any, ...], out: str) -> None:
    # One thread per rank: N ranks share 2 cores, and oversubscription makes gloo crawl.
    torch.set_num_threads(1)
    try:
        torch.save({"ok": fn(rank, *args)}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise SystemExit(1) from None


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """``[fn(rank, *args) for rank in range(world_size)]``, each rank in its own process.

    ``fn`` must be importable by name (module level): the forkserver imports it by name.
    A port :func:`free_port` chose can be taken by another process before rank 0 listens on
    it (the other test worker's Ray picks ports at random): on ``EADDRINUSE`` the ranks run
    once more on fresh ports (the ranks' work is deterministic, so nothing is hidden).
    """
    try:
        return _run_ranks(fn, world_size, args, timeout_s)
    except RuntimeError as exc:
        if "EADDRINUSE" not in str(exc) or not any(isinstance(a, Port) for a in args):
            raise
    fresh = tuple(free_port() if isinstance(a, Port) else a for a in args)
    return _run_ranks(fn, world_size, fresh, timeout_s)


def _run_ranks(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout_s: float
) -> list[Any]:
    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp) / f"rank{r}.pt") for r in range(world_size)]
        procs = [
            _CTX.Process(target=_entry, args=(fn, r, args, outs[r]), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = []
        results = []
        for r, out in enumerate(outs):
            if not Path(out).exists():
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            res = torch.load(out, weights_only=False)
            if "error" in res:
                errors.append(f"rank {r}:\n{res['error']}")
            results.append(res.get("ok"))
        if errors:
            why = f" (timed out after {timeout_s} s)" if timed_out else ""
            raise RuntimeError(f"ranks failed{why}:\n" + "\n".join(errors))
        return results
