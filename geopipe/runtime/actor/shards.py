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

from geopipe.checkpoint.format import ADAM_STATE_GROUPS, PARAMS_GROUP
from geopipe.checkpoint.outer import (
    INNER,
    OUTER_KEY,
    group_position,
    group_shards,
    group_state,
    named,
    outer_layout,
)
from geopipe.checkpoint.rng import capture_rng, restore_rng
from geopipe.checkpoint.store import (
    PARAMS,
    CheckpointError,
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
        outer: Future | None = None,
        group: int = 0,
    ) -> None:
        """Write the shard of boundary ``step`` once ``state`` is gathered (in the background).

        ``tensors`` are extra tensors to store (codec state); ``writer`` says whether this
        replica writes (the others only take part in the gather and keep a fallback);
        ``directory`` None: encode the shard in memory for the sites' stores to pull;
        ``only``: the parameter names to write (a mixed plan's engine holds more);
        ``outer``: an outer-loop run's gathered outer state
        (:func:`~geopipe.runtime.actor.outer_ckpt.gather_outer`), which moves the group's
        own state under ``inner/`` ([Note: the outer-loop checkpoint] in
        :mod:`geopipe.checkpoint.outer`); ``stage`` is then the shard's index."""
        rng = capture_rng()

        def write_file() -> ShardInfo:
            st = state.result()
            out = dict(tensors)
            prefix = "" if outer is None else INNER
            for g in ADAM_STATE_GROUPS:
                out.update(
                    {f"{prefix}{g}/{n}": t for n, t in st[g].items() if only is None or n in only}
                )
            meta = {"adam_step": st["step"], "lr_step": st["lr_step"], "layers": layers}
            if outer is not None:
                got = outer.result()
                out.update(
                    {k: t for k, t in got["tensors"].items() if only is None or _name(k) in only}
                )
                meta.update({"group": group, OUTER_KEY: got["meta"]})
            if self.write_delay_s:
                time.sleep(self.write_delay_s)
            if directory is not None:
                return write_shard_file(directory, stage, out, meta, rng=rng)
            blob, info = shard_bytes(stage, out, meta, rng=rng)
            self._staged = {step: blob}  # one save at a time: an older one is done with
            return info

        def write() -> ShardInfo | None:
            state.result()  # every replica takes part in the gather
            if outer is not None:
                outer.result()
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
        """After leaving the process group: a pending gather can no longer finish, and the
        writer thread waiting on it never returns (gloo keeps a collective open while its
        peers live). Abandon that thread and start a fresh one, so the next layout's saves
        do not queue behind it for ever (seen as a hang: a save cut short by a failure left
        the mix's first checkpoint waiting on it). The same as the state keeper's
        ``after_leave``."""
        self._pending = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")


def _name(key: str) -> str:
    """The parameter name of an outer shard key (``params/<name>``, ``outer/momentum/<name>``;
    a residual's key names none and is always written)."""
    for prefix in ("params/", "outer/momentum/"):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return ""


def load_stage(
    engine: Any,
    path: str,
    stage: int,
    layers: tuple[int, int],
    links: Any,
    group: int = 0,
    groups: int = 1,
) -> int:
    """Load a stage's layers from a checkpoint of any partition; returns its step.

    Parameters and Adam moments are matched by name. RNG and codec state are restored only
    when the checkpoint's stage ``stage`` held exactly these layers (same partition).

    An outer-loop checkpoint ([Note: the outer-loop checkpoint] in
    :mod:`geopipe.checkpoint.outer`): a replica of group ``group`` of an outer-loop run
    (``groups`` > 1, as many as the checkpoint's) loads its own group's weights and Adam
    state; a synchronous run (``groups`` 1) loads theta_global with group 0's Adam state.
    """
    ckpt = load_checkpoint(path, verify=False)  # the controller verified the checksums
    layout = outer_layout(ckpt.manifest)
    if layout is not None and groups > 1 and layout[0] != groups:
        raise CheckpointError(
            f"{ckpt.path.name} holds {layout[0]} replica groups, this run has {groups}"
        )
    g = group_position(ckpt.manifest, group) if layout is not None and groups > 1 else 0
    shards = group_shards(ckpt, g)
    prefix = PARAMS if layout is None else f"{INNER}{PARAMS}"
    saved = {k[len(prefix) :] for shard in shards for k in shard.keys if k.startswith(prefix)}
    aliases = engine.module.state_aliases()  # a tied head saved only as the embedding
    names = [n if n in saved else aliases.get(n, n) for n, _ in engine.module.named_parameters()]
    if layout is None:
        state: dict[str, Any] = load_state_for_layers(ckpt, names)
        meta = ckpt.stages[0].meta
        state["step"], state["lr_step"] = int(meta["adam_step"]), int(meta["lr_step"])
    else:
        state = group_state(ckpt, g, names)
        if groups == 1:  # the model the outer loop agreed on, not one group's drift
            state[PARAMS_GROUP] = named(group_shards(ckpt, 0), PARAMS, names)
    engine.load_full_state(state)
    if stage < len(shards) and shards[stage].meta.get("layers") == list(layers):
        shard = shards[stage]
        rng = shard.rng()
        if rng is not None:
            restore_rng(rng)
        links.load_codec_state(shard.tensors)
    return ckpt.step
