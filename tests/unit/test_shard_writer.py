"""ShardWriter after a layout is left: a save stuck on a gather that can never finish must
not hold up the next layout's saves (a hang seen in the mixed grow-back integration test:
the step-2 save's write waited on a gather the failure cut short, and the mix's step-4
save queued behind it on the one writer thread)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from geopipe.runtime.actor.shards import ShardWriter


def _state(step: int) -> Future:
    f: Future = Future()
    f.set_result(
        {
            "params": {"w": torch.ones(2)},
            "exp_avg": {"w": torch.zeros(2)},
            "exp_avg_sq": {"w": torch.zeros(2)},
            "step": step,
            "lr_step": step,
        }
    )
    return f


def _save(w: ShardWriter, tmp, step: int, state: Future) -> None:
    w.save(str(tmp), step, state, stage=0, layers=[0, 1], writer=True, tensors={})


def test_a_save_stuck_on_a_dead_gather_does_not_block_the_next_layouts(tmp_path) -> None:
    w = ShardWriter()
    stuck: Future = Future()  # the old layout's gather: never completes
    try:
        _save(w, tmp_path / "a", 2, stuck)
        w.forget()  # the actor left its process group
        (tmp_path / "b").mkdir()
        _save(w, tmp_path / "b", 4, _state(4))
        got: Future = Future()
        threading.Thread(target=lambda: got.set_result(w.written()), daemon=True).start()
        info = got.result(timeout=30)  # before the fix: waits for ever behind the stuck write
        assert info is not None and (tmp_path / "b" / info.file).is_file()
    finally:
        stuck.cancel()  # releases the abandoned writer thread, which exit would join


def test_without_forget_the_next_save_waits_for_the_first(tmp_path) -> None:
    """The order the writer keeps inside one layout (the shard of step 4 is not written
    before the pending one of step 2)."""
    w = ShardWriter()
    first: Future = Future()
    (tmp_path / "a").mkdir()
    _save(w, tmp_path / "a", 2, first)
    _save(w, tmp_path / "a", 4, _state(4))
    pending = w._pending
    assert pending is not None and not pending.done()
    first.set_result(_state(2).result())
    info = w.written()
    assert info is not None and (tmp_path / "a" / info.file).is_file()
