"""Checkpoint saves that never lose silently (issue 33, item 6), with real files.

* every save writes into a directory of its own: a retry, a re-save of a step, or a
  superseded site copy never shares a path with an earlier attempt, so an abandoned pull
  that wakes up late cannot unlink the new copy's shard (it did: the directory was named
  by step and pid alone);
* a commit verifies the new checkpoint before it touches anything committed: a shard
  corrupted in the temporary directory fails the commit and the last good checkpoint of
  the same step stays as it was;
* loading verifies: a flipped byte, a truncated or a deleted shard is skipped for the
  newest good checkpoint, naming the file; a site's store hashes a copy again whenever a
  file of it changed since it verified it (it used to trust a cache keyed on the
  manifest's mtime, which a corrupted shard leaves unchanged).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from geopipe.checkpoint.restore import SiteCopy, newest_restorable
from geopipe.checkpoint.store import (
    CheckpointError,
    latest_complete,
    list_checkpoints,
    load_checkpoint,
)
from geopipe.checkpoint.verify import bad_file, signature, verify_dir
from geopipe.checkpoint.writer import CheckpointWriter
from geopipe.runtime.storage.sitestore import ShardSource
from tests.unit.test_site_copies import MANIFEST, _Call, _Holder, _save, _shards, _store

MODEL = {"n_layer": 2, "n_embd": 4, "n_head": 1, "vocab_size": 256, "max_seq_len": 8}


def _manifest(step: int, run: str = "r") -> dict:
    return {"config_hash": "h", "plan": {}, "data": {"step": step}, "model": MODEL, "run_id": run}


def _commit(root: Path, step: int, value: float, run: str = "r") -> Path:
    with CheckpointWriter(root, step) as w:
        for k in range(2):
            w.write_shard(k, {f"params/w{k}": torch.full((64,), value)}, {"adam_step": step})
        return w.commit(_manifest(step, run), num_stages=2)


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def delete(path: Path) -> None:
    path.unlink()


FAULTS = {"flipped": flip, "truncated": truncate, "deleted": delete}
WHY = {"flipped": "checksum mismatch", "truncated": "bytes but the manifest", "deleted": "missing"}


# -- one directory per save --------------------------------------------------------------------
def test_every_attempt_at_a_step_writes_into_its_own_directory(tmp_path: Path) -> None:
    first = CheckpointWriter(tmp_path, 5)
    first.abort()  # a failed save, then its retry
    second = CheckpointWriter(tmp_path, 5)
    assert first.tmp_dir != second.tmp_dir and second.tmp_dir.is_dir()
    # the failed attempt's late writer recreates and clears only its own directory
    first.tmp_dir.mkdir()
    (first.tmp_dir / "stage-0.safetensors").write_bytes(b"late")
    (first.tmp_dir / "stage-0.safetensors").unlink()
    second.write_shard(0, {"params/w": torch.ones(3)})
    assert (second.tmp_dir / "stage-0.safetensors").is_file()
    second.abort()
    with CheckpointWriter(tmp_path, 6), pytest.raises(CheckpointError, match="already being"):
        CheckpointWriter(tmp_path, 6)  # two live writers of one step in one process: refused


def test_an_abandoned_pull_waking_late_cannot_touch_the_new_copy(tmp_path: Path) -> None:
    """Save "a" of step 4 is pulling stage 1 when the driver abandons it and save "b" of the
    same step pulls everything; "a"'s pull then wakes up, sees it was abandoned and removes
    its file. Named by step and pid, that file was "b"'s shard, and "b"'s commit failed
    (checked against the old naming). Now "b" commits a complete copy that verifies."""
    east = _store(tmp_path, "east")
    shards = _shards(4)
    infos = [i for _, i in shards]
    asked, woke, answered = threading.Event(), threading.Event(), threading.Event()

    def slow(step: int, file: str, off: int, n: int) -> bytes:
        asked.set()
        woke.wait(30)
        answered.set()
        return shards[1][0][off : off + n]

    late = type("W", (), {"read_chunk": _Call(slow)})()
    errors: list[BaseException] = []

    def save_a() -> None:
        try:
            east.fetch(
                4,
                "a",
                [ShardSource(0, _Holder(shards[0][0]), None), ShardSource(1, late, None)],
                *infos,
            )
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=save_a)
    t.start()
    assert asked.wait(30)  # "a" is inside its pull of stage 1
    east.abort(4, "a")  # the driver gave it up (settle after a failure); a retry follows
    good = [ShardSource(k, _Holder(b), None) for k, (b, _) in enumerate(shards)]
    assert east.fetch(4, "b", good, *infos) == [0, 1]
    woke.set()  # "a"'s pull gets its bytes now, after "b" wrote stage 1
    t.join(30)
    assert answered.is_set() and errors and "abandoned" in str(errors[0])
    out = east.commit(4, "b", MANIFEST, 2)
    ckpt = load_checkpoint(out["path"], verify=True)
    assert [e["sha256"] for e in ckpt.manifest["stages"]] == [i.sha256 for i in infos]
    assert [i.status for i in list_checkpoints(east.root)] == ["complete"]


def test_a_commit_verifies_before_it_replaces_the_last_good_checkpoint(tmp_path: Path) -> None:
    good = _commit(tmp_path, 8, 1.0)
    before = signature(good)
    w = CheckpointWriter(tmp_path, 8)  # the same step saved again (a re-save after resume)
    for k in range(2):
        w.write_shard(k, {f"params/w{k}": torch.full((64,), 2.0)}, {"adam_step": 8})
    flip(w.tmp_dir / "stage-1.safetensors")  # damaged after it was written and hashed
    with pytest.raises(CheckpointError, match=r"stage-1\.safetensors checksum mismatch"):
        w.commit(_manifest(8), num_stages=2)
    w.abort()
    assert signature(good) == before  # never touched
    assert torch.equal(load_checkpoint(good).stage(0).tensor("params/w0"), torch.full((64,), 1.0))
    assert [(i.step, i.status) for i in list_checkpoints(tmp_path)] == [(8, "complete")]


# -- loading verifies --------------------------------------------------------------------------
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_damaged_newest_checkpoint_is_skipped_naming_the_file(tmp_path: Path, fault: str) -> None:
    _commit(tmp_path, 2, 1.0)
    newest = _commit(tmp_path, 4, 2.0)
    FAULTS[fault](newest / "stage-1.safetensors")
    skipped: list[tuple[Path, str]] = []
    best = latest_complete(tmp_path, on_skip=lambda p, r: skipped.append((p, r)))
    assert best is not None and best.step == 2
    ((path, reason),) = skipped
    assert path == newest and WHY[fault] in reason and bad_file(reason) == "stage-1.safetensors"
    with pytest.raises(CheckpointError, match=r"stage-1\.safetensors"):
        verify_dir(newest)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_store_hashes_a_copy_again_once_a_file_of_it_changed(tmp_path: Path, fault: str) -> None:
    """The manifest is untouched, so a cache keyed on its mtime went on reporting the copy
    (and a recovery loaded it unverified)."""
    east = _store(tmp_path, "east")
    _save(east, 2, _shards(2))
    _save(east, 4, _shards(4))
    assert [c.step for c in east.holdings()] == [2, 4]
    copy = east.root / "step-00000004"
    FAULTS[fault](copy / "stage-0.safetensors")
    held = east.holdings()
    assert held == [SiteCopy(2, 2, frozenset({0, 1}))]
    assert newest_restorable({"east": held}, ["east"]).step == 2
    (why,) = east.rejected().values()
    assert bad_file(why) == "stage-0.safetensors" and WHY[fault] in why
    with pytest.raises(CheckpointError, match=r"site east's copy .*stage-0\.safetensors"):
        east.path_of(4)
    assert east.path_of(2) == str(east.root / "step-00000002")  # verified, then handed over


def test_a_store_rehashes_only_what_changed(tmp_path: Path, monkeypatch: Any) -> None:
    east = _store(tmp_path, "east")
    _save(east, 2, _shards(2))
    import geopipe.runtime.storage.sitestore as sitestore

    loads: list[Path] = []
    real = sitestore.load_checkpoint
    monkeypatch.setattr(
        sitestore, "load_checkpoint", lambda p, **kw: loads.append(p) or real(p, **kw)
    )
    east.holdings()
    east.path_of(2)
    assert loads == []  # committed by this store and unchanged: hashed as it arrived
    (east.root / "step-00000002" / "manifest.json").touch()
    east.holdings()
    assert loads == [east.root / "step-00000002"]
