"""Writing this stage's checkpoint shard, and loading a stage from any checkpoint.

The full state comes from the boundary snapshot (:mod:`geopipe.runtime.actor.snapshots`), so a
save stalls training only for a copy of the replica's own ZeRO-1 partition; the gather runs
on the state keeper, the file write on a writer thread of its own — a slow disk must not
hold up the keeper's gathers, in which the other replicas wait for this one.

Every replica gathers the same full state, so each keeps what it needs to write the shard:
replica 0 writes, and if it dies mid-save the controller asks a survivor to write instead.

With per-site checkpoint directories (``{site}`` in ``training.checkpoint.dir``) no stage
writes a file: the shard is encoded in memory (the exact bytes of the file) and every
site's store pulls it in chunks (:meth:`ShardWriter.chunk`) and writes, fsyncs and verifies
its own copy (:mod:`geopipe.runtime.storage.sitestore`). The bytes stay until the checkpoint is
committed — one more copy of the stage's state in host RAM for that long; a spool file on
local disk would trade it for a disk write if RAM is tight.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from geopipe.checkpoint.format import ADAM_STATE_GROUPS
from geopipe.checkpoint.rng import capture_rng, restore_rng
from geopipe.checkpoint.store import (
    PARAMS,
    ShardInfo,
    load_checkpoint,
    load_state_for_layers,
)
from geopipe.checkpoint.writer import shard_bytes, write_shard_file

__all__ = ["ShardWriter", "load_stage"]


class ShardWriter:
    """One replica's part in checkpoint saves."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self._pending: Future | None = None
        # (step, write) kept until the checkpoint commits, to write in a dead writer's place
        self._fallback: tuple[int, Callable[[], ShardInfo]] | None = None
        self._staged: dict[int, bytes] = {}  # step -> shard bytes (per-site copies)
        self.write_delay_s = 0.0  # fault injection: slows writes so a test can kill mid-save

    def save(
        self,
        directory: str | None,
        step: int,
        state: Future,
        *,
        stage: int,
        layers: list[int],
        writer: bool,
        tensors: dict,
        on_gathered: Callable[[], None] | None = None,
        only: set[str] | None = None,
    ) -> None:
        """Write the shard of boundary ``step`` once ``state`` is gathered (in the background).

        ``tensors`` are extra tensors to store (codec state); ``writer`` says whether this
        replica writes (the others only take part in the gather and keep a fallback);
        ``directory`` None: encode the shard in memory for the sites' stores to pull;
        ``only``: the parameter names to write (a mixed plan's engine holds more)."""
        rng = capture_rng()

        def write_file() -> ShardInfo:
            st = state.result()
            out = dict(tensors)
            for group in ADAM_STATE_GROUPS:
                out.update(
                    {f"{group}/{n}": t for n, t in st[group].items() if only is None or n in only}
                )
            meta = {"adam_step": st["step"], "lr_step": st["lr_step"], "layers": layers}
            if self.write_delay_s:
                time.sleep(self.write_delay_s)
            if directory is not None:
                return write_shard_file(directory, stage, out, meta, rng=rng)
            blob, info = shard_bytes(stage, out, meta, rng=rng)
            self._staged = {step: blob}  # one save at a time: an older one is done with
            return info

        def write() -> ShardInfo | None:
            state.result()  # every replica takes part in the gather
            if on_gathered is not None:
                on_gathered()
            return write_file() if writer else None

        self._fallback = (step, write_file)
        self._pending = self._pool.submit(write)

    def written(self) -> ShardInfo | None:
        """Wait for the background gather/write; its ShardInfo (None on non-writers)."""
        future, self._pending = self._pending, None
        return None if future is None else future.result()

    def write_instead(self, step: int) -> ShardInfo:
        """Write the shard of ``step`` in place of a replica 0 that died while saving it."""
        if self._fallback is None or self._fallback[0] != step:
            raise RuntimeError(f"no pending shard of step {step} on this replica")
        return self._fallback[1]()

    def chunk(self, step: int, offset: int, size: int) -> bytes:
        """Bytes ``[offset, offset+size)`` of the in-memory shard of ``step``."""
        blob = self._staged.get(step)
        if blob is None:
            raise RuntimeError(f"no shard of step {step} is held in memory here")
        return blob[offset : offset + size]

    def release(self, step: int) -> None:
        """Checkpoint ``step`` is committed: drop what was kept for a stand-in write."""
        if self._fallback is not None and self._fallback[0] == step:
            self._fallback = None
        self._staged.pop(step, None)

    def forget(self) -> None:
        """After leaving the process group: a pending gather can no longer finish."""
        self._pending = None


def load_stage(engine: Any, path: str, stage: int, layers: tuple[int, int], links: Any) -> int:
    """Load a stage's layers from a checkpoint of any partition; returns its step.

    Parameters and Adam moments are matched by name. RNG and codec state are restored only
    when the checkpoint's stage ``stage`` held exactly these layers (same partition).
    """
    ckpt = load_checkpoint(path, verify=False)  # the controller verified the checksums
    saved = {k[len(PARAMS) :] for shard in ckpt.stages for k in shard.keys if k.startswith(PARAMS)}
    aliases = engine.module.state_aliases()  # a tied head saved only as the embedding
    names = [n if n in saved else aliases.get(n, n) for n, _ in engine.module.named_parameters()]
    state: dict[str, Any] = load_state_for_layers(ckpt, names)
    meta = ckpt.stages[0].meta
    state["step"], state["lr_step"] = int(meta["adam_step"]), int(meta["lr_step"])
    engine.load_full_state(state)
    if stage < len(ckpt.stages) and ckpt.stages[stage].meta.get("layers") == list(layers):
        shard = ckpt.stages[stage]
        rng = shard.rng()
        if rng is not None:
            restore_rng(rng)
        links.load_codec_state(shard.tensors)
    return ckpt.step
