"""Boundary snapshots: each replica's copy of its stage's full state at recent step boundaries.

After a step, a replica copies its own ZeRO-1 partition (the only stall) and a background
"state keeper" thread gathers the stage's full state (weights and Adam moments) from the
replicas on the engine's checkpoint-only communicator. Recovery rolls every survivor back
to the newest boundary all stages still hold, so no optimizer step is ever half-applied and
none is lost; checkpoints write the same gathered state.

[Note: one keeper thread] Every job on the checkpoint communicator (boundary gathers,
checkpoint shards) runs on one thread, in submission order — the same order on every
replica, as a collective needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from geopipe.checkpoint.format import ADAM_STATE_GROUPS, PARAMS_GROUP
from geopipe.runtime.actor.zero_state import assemble_snapshot

__all__ = ["BoundaryKeeper"]


def _keeper() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-keeper")


class BoundaryKeeper:
    """Full states of the newest ``kept`` complete step boundaries (and gathers in flight)."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._pool = _keeper()
        self._futures: dict[int, Future] = {}  # step -> gathered full state
        # where each parameter lies in each flat ZeRO-1 buffer (the outer state's gather
        # cuts by it: geopipe.runtime.actor.outer_ckpt); set by the first take
        self.layouts: list | None = None

    def take(self, step: int, engine: Any) -> float:
        """Copy this replica's partition now and gather the full state of boundary ``step``
        in the background; returns the seconds training stalled."""
        t0 = time.perf_counter()
        snap = engine.local_snapshot()
        self.layouts = [g["layout"] for g in snap["groups"]]
        self._futures[step] = self._pool.submit(
            assemble_snapshot, snap, engine.ckpt_group, engine.replicas
        )
        self._drop_old()
        return time.perf_counter() - t0

    def retake_weights(self, step: int, engine: Any) -> float:
        """Take boundary ``step`` again after an outer apply changed its weights: only the
        weights are copied and gathered, the Adam moments (which an apply leaves alone) are
        the first take's. COLLECTIVE like :meth:`take` (every replica of the group applies).

        [Note: an apply's re-take] Recovery must roll back to the weights after the outer
        step, so the boundary is taken again; a whole take copied the moments twice more
        (the local copy and its gather): under streaming every replica pays that F times
        per H, beside steps that pay for every CPU-millisecond on a host the exchange
        shares (a third of an apply's cost on the 2-core test bed). Nothing when the
        boundary is not held (as after a take without recovery snapshots)."""
        if step not in self._futures:
            return 0.0
        t0 = time.perf_counter()
        before = self._futures.pop(step)
        snap = engine.local_snapshot(weights_only=True)
        self._futures[step] = self._pool.submit(
            assemble_snapshot, snap, engine.ckpt_group, engine.replicas, before
        )
        self._drop_old()
        return time.perf_counter() - t0

    def _drop_old(self) -> None:
        # Drop only complete boundaries beyond the newest ``kept``: dropping a complete one
        # for a gather that then fails would leave nothing to roll back to.
        keep = self.steps()[-self.kept :] if self.kept else []
        for old in [st for st, f in self._futures.items() if f.done()]:
            if old not in keep:
                del self._futures[old]

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run another collective of the checkpoint communicator (the outer state's gather)
        on the keeper thread, after the gathers already submitted ([Note: one keeper
        thread])."""
        return self._pool.submit(fn, *args)

    def future(self, step: int) -> Future:
        return self._futures[step]

    def holds(self, step: int) -> bool:
        return step in self._futures

    def discard(self, step: int) -> None:
        self._futures.pop(step, None)

    def steps(self) -> list[int]:
        """Steps whose full state is held (gathered completely)."""
        return sorted(st for st, f in self._futures.items() if f.done() and f.exception() is None)

    def state(self, step: int) -> dict:
        return self._futures[step].result()

    def names(self, step: int) -> list[str]:
        return list(self.state(step)[PARAMS_GROUP])

    def subset(self, step: int, names: list[str]) -> dict:
        """Part of the boundary's state: ``names`` of every group, plus the step counters."""
        st = self.state(step)
        return {
            **{g: {n: st[g][n] for n in names} for g in ADAM_STATE_GROUPS},
            "step": st["step"],
            "lr_step": st["lr_step"],
        }

    def after_leave(self) -> None:
        """The process group is gone: a gather of the old layout may wait forever for a peer
        that failed before joining it. Keep the complete boundaries, start a fresh thread."""
        self._futures = {st: self._futures[st] for st in self.steps()}
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = _keeper()

    def clear(self) -> None:
        """Forget every boundary (the layout they belong to is gone and restored from)."""
        self._futures = {}
