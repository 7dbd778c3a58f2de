"""Checkpoint format: atomic commit, kill safety, corruption checks, repartitioning, no pickle."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from geopipe.checkpoint.rng import capture_rng, restore_rng
from geopipe.checkpoint.rootdir import step_dirname
from geopipe.checkpoint.store import (
    CheckpointError,
    check_compatible,
    latest_complete,
    list_checkpoints,
    load_checkpoint,
    load_state_for_layers,
    prune,
)
from geopipe.checkpoint.writer import CheckpointWriter

SHAPE = {"n_layer": 2, "n_embd": 8, "n_head": 2, "vocab_size": 16, "max_seq_len": 8}
LAYER_PARAMS = {
    "embed": ["embed.wte.weight", "embed.wpe.weight"],
    "blocks.0": ["blocks.0.ln1.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.bias"],
    "blocks.1": ["blocks.1.ln1.weight", "blocks.1.attn.qkv.weight", "blocks.1.mlp.fc.bias"],
    "head": ["head.ln_f.weight", "head.lm_head.weight"],
}


def _names(layers: list[str]) -> list[str]:
    return [n for layer in layers for n in LAYER_PARAMS[layer]]


def _state(names: list[str], seed: int) -> dict[str, torch.Tensor]:
    """params / exp_avg / exp_avg_sq entries for `names`, deterministic in (seed, name)."""
    out = {}
    for i, n in enumerate(names):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        shape = (3, 5) if n.endswith("weight") else (5,)
        out[f"params/{n}"] = torch.randn(shape, generator=g)
        out[f"exp_avg/{n}"] = torch.randn(shape, generator=g)
        out[f"exp_avg_sq/{n}"] = torch.rand(shape, generator=g)
    return out


def _manifest(step: int) -> dict:
    return {
        "config_hash": "deadbeef",
        "plan": {"stages": [["embed", "blocks.0"], ["blocks.1", "head"]], "schedule": "1f1b"},
        "data": {"seed": 0, "step": step, "corpus_digest": "abc"},
        "model": dict(SHAPE),
    }


SPLIT = [["embed", "blocks.0"], ["blocks.1", "head"]]


def _save(root: Path, step: int, split: list[list[str]] = SPLIT) -> list[dict[str, torch.Tensor]]:
    """Write one stage per thread, as the runtime does, then commit; return what was saved."""
    states = [_state(_names(layers), seed=step * 10 + k) for k, layers in enumerate(split)]
    barrier = threading.Barrier(len(split))
    errors: list[BaseException] = []
    with CheckpointWriter(root, step) as w:

        def run(k: int) -> None:
            try:
                barrier.wait()
                w.write_shard(k, states[k], {"adam_step": step, "lr_step": step + k})
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(split))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        w.commit(_manifest(step), num_stages=len(split))
    return states


def _flip_byte(path: Path, offset_from_end: int = 7) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def _statuses(root: Path, verify: bool = False) -> dict[str, str]:
    return {i.path.name: i.status for i in list_checkpoints(root, verify=verify)}


# --------------------------------------------------------------------------------------------


def test_parallel_save_list_and_load_round_trip(tmp_path: Path) -> None:
    states = _save(tmp_path, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020"]  # no tmp left

    (info,) = list_checkpoints(tmp_path, verify=True)
    ckpt_dir = tmp_path / step_dirname(20)
    assert (info.path, info.step, info.status, info.reason) == (ckpt_dir, 20, "complete", None)
    assert info.size_bytes == sum(f.stat().st_size for f in ckpt_dir.iterdir()) > 0

    ckpt = load_checkpoint(ckpt_dir)
    m = ckpt.manifest
    assert (ckpt.step, m["format_version"], m["num_stages"]) == (20, 1, 2)
    assert m["model"] == SHAPE and m["config_hash"] == "deadbeef"
    assert m["data"]["step"] == 20 and m["plan"]["schedule"] == "1f1b"
    assert abs(m["time"] - time.time()) < 60
    for k, saved in enumerate(states):
        entry = m["stages"][k]
        assert entry["file"] == f"stage-{k}.safetensors"
        assert entry["bytes"] == (ckpt_dir / entry["file"]).stat().st_size
        assert len(entry["sha256"]) == 64
        shard = ckpt.stage(k)
        assert shard.meta == {"adam_step": 20, "lr_step": 20 + k}
        got = shard.tensors()
        assert got.keys() == saved.keys()
        assert all(torch.equal(got[key], saved[key]) for key in saved)
        # plain safetensors reads the shard too: the format is not private to geopipe
        plain = load_file(ckpt_dir / entry["file"])
        assert all(torch.equal(plain[key], saved[key]) for key in saved)


def test_views_shared_storage_and_noncontiguous_tensors_are_saved(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "params/tied.a": base,
        "params/tied.b": base,  # same storage twice (tied weights)
        "params/view": base[1:3],  # a view into a bigger storage
        "params/t": base.t(),  # non-contiguous
        "params/empty": torch.zeros(0, 3),
        "params/scalar": torch.tensor(3.5, dtype=torch.float64),
        "params/half": torch.ones(2, dtype=torch.bfloat16),
    }
    with CheckpointWriter(tmp_path, 1) as w:
        w.write_shard(0, tensors)
        w.commit(_manifest(1), num_stages=1)
    got = load_checkpoint(tmp_path / step_dirname(1)).stage(0).tensors()
    for key, t in tensors.items():
        assert torch.equal(got[key], t) and got[key].dtype == t.dtype, key
    assert torch.equal(base, torch.arange(24, dtype=torch.float32).reshape(4, 6))


def test_rng_capture_restore_round_trips_through_a_shard(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.standard_normal()  # and in numpy's
    state = capture_rng()
    json.dumps({k: v for k, v in state.items() if k != "torch"})  # all but torch is JSON

    def draws() -> tuple:
        return (
            [random.random(), random.gauss(0, 1)],
            np.random.standard_normal(3).tolist(),
            torch.rand(4),
        )

    expected = draws()
    with CheckpointWriter(tmp_path, 5) as w:
        w.write_shard(0, _state(_names(["embed"]), 0), {"adam_step": 5}, rng=state)
        w.commit(_manifest(5), num_stages=1)
    draws()  # move every generator on
    shard = load_checkpoint(tmp_path / step_dirname(5)).stage(0)
    assert shard.meta["adam_step"] == 5
    restore_rng(shard.rng())
    got = draws()
    assert got[0] == expected[0] and got[1] == expected[1]
    assert torch.equal(got[2], expected[2])


def test_uncommitted_save_is_partial_ignored_and_pruned_once_stale(tmp_path: Path) -> None:
    states10 = _save(tmp_path, 10)
    w = CheckpointWriter(tmp_path, 20)
    for k, layers in enumerate(SPLIT):
        w.write_shard(k, _state(_names(layers), 99))
    tmp_name = w.tmp_dir.name
    assert tmp_name.startswith(f".tmp-step-00000020-{os.getpid()}-")  # one dir per save
    del w  # the process "dies" before commit: no abort, the tmp dir stays behind
    gc.collect()

    assert _statuses(tmp_path) == {"step-00000010": "complete", tmp_name: "partial"}
    best = latest_complete(tmp_path)
    assert best is not None and best.step == 10
    got = load_checkpoint(best.path).stage(0).tensors()
    assert all(torch.equal(got[k], v) for k, v in states10[0].items())

    assert prune(tmp_path, keep=3) == []  # newer than every complete one: may still be running
    _save(tmp_path, 30)
    removed = prune(tmp_path, keep=3)
    assert [p.name for p in removed] == [tmp_name]
    assert _statuses(tmp_path) == {"step-00000010": "complete", "step-00000030": "complete"}


_KILLED_WRITER = """
import sys, torch
from geopipe.checkpoint.writer import CheckpointWriter
w = CheckpointWriter(sys.argv[1], 20)
big = {f"params/w{i}": torch.full((2048, 8192), float(i)) for i in range(6)}  # 6 x 64 MiB
print("writing", flush=True)
w.write_shard(0, big)
"""


def test_save_killed_mid_write_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    states10 = _save(tmp_path, 10)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED_WRITER), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 60
        # safetensors streams into a hidden temp file and renames it to stage-0.safetensors
        # when done, so the first entry to appear means the write has begun
        tmp_dir = tmp_path / "none-yet"
        while not (tmp_dir.is_dir() and any(tmp_dir.iterdir())) and time.monotonic() < deadline:
            tmp_dir = next(tmp_path.glob(f".tmp-step-00000020-{proc.pid}-*"), tmp_dir)
            assert proc.poll() is None, "the writer exited before it was killed"
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_dir / "stage-0.safetensors").exists(), "the kill landed after the write"

    infos = {i.path.name: i for i in list_checkpoints(tmp_path)}
    partial = infos[tmp_dir.name]
    assert (partial.status, partial.step) == ("partial", 20)
    best = latest_complete(tmp_path)
    assert best is not None and best.step == 10
    got = load_checkpoint(best.path).stage(1).tensors()
    assert all(torch.equal(got[k], v) for k, v in states10[1].items())

    _save(tmp_path, 30)
    assert [p.name for p in prune(tmp_path, keep=2)] == [partial.path.name]
    assert _statuses(tmp_path) == {"step-00000010": "complete", "step-00000030": "complete"}


def test_flipped_bytes_are_skipped_with_a_reason_and_refused_on_load(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    bad = tmp_path / step_dirname(20)
    _flip_byte(bad / "stage-1.safetensors")

    skipped: list[tuple[Path, str]] = []
    best = latest_complete(tmp_path, on_skip=lambda p, r: skipped.append((p, r)))
    assert best is not None and best.step == 10
    ((path, reason),) = skipped
    assert path == bad and "stage-1.safetensors checksum mismatch" in reason

    with pytest.raises(CheckpointError, match=r"stage-1\.safetensors checksum mismatch"):
        load_checkpoint(bad)
    assert _statuses(tmp_path, verify=True)["step-00000020"] == "corrupt"
    assert _statuses(tmp_path, verify=False)["step-00000020"] == "complete"  # sizes still match


def test_truncated_shard_is_corrupt_even_without_verify(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    shard = tmp_path / step_dirname(10) / "stage-0.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    (info,) = list_checkpoints(tmp_path)
    assert info.status == "corrupt" and "stage-0.safetensors is" in (info.reason or "")
    (tmp_path / step_dirname(10) / "stage-1.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"stage-0\.safetensors"):
        load_checkpoint(info.path)


def test_missing_or_bad_manifest_means_no_checkpoint(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        _save(tmp_path, step)
    (tmp_path / step_dirname(20) / "manifest.json").unlink()
    (tmp_path / step_dirname(30) / "manifest.json").write_text('{"format_version": 1, "st')
    m40 = tmp_path / step_dirname(40) / "manifest.json"
    m40.write_text(json.dumps({**json.loads(m40.read_text()), "format_version": 99}))

    infos = {i.step: i for i in list_checkpoints(tmp_path)}
    assert [infos[s].status for s in (10, 20, 30, 40)] == ["complete"] + ["corrupt"] * 3
    assert "missing manifest.json" in (infos[20].reason or "")
    assert "not valid JSON" in (infos[30].reason or "")
    assert "format_version 99" in (infos[40].reason or "")

    skipped: list[str] = []
    best = latest_complete(tmp_path, on_skip=lambda p, r: skipped.append(p.name))
    assert best is not None and best.step == 10
    assert skipped == ["step-00000040", "step-00000030", "step-00000020"]
    with pytest.raises(CheckpointError, match=r"missing manifest\.json"):
        load_checkpoint(tmp_path / step_dirname(20))
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(tmp_path / step_dirname(30))


def test_missing_dir_gives_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"step-00000007 does not exist"):
        load_checkpoint(tmp_path / step_dirname(7))
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "file")
    assert list_checkpoints(tmp_path / "nowhere") == []
    assert latest_complete(tmp_path / "nowhere") is None


@pytest.mark.parametrize(
    "new_split",
    [
        [["embed"], ["blocks.0", "blocks.1"], ["head"]],
        [["embed", "blocks.0", "blocks.1", "head"]],
        [["embed", "blocks.0", "blocks.1"], ["head"]],
    ],
)
def test_checkpoint_loads_into_a_different_partition(
    tmp_path: Path, new_split: list[list[str]]
) -> None:
    states = _save(tmp_path, 10, split=SPLIT)
    saved = {k: v for s in states for k, v in s.items()}
    ckpt = load_checkpoint(tmp_path / step_dirname(10))
    for layers in new_split:
        names = _names(layers)
        got = load_state_for_layers(ckpt, names)
        for group in ("params", "exp_avg", "exp_avg_sq"):
            assert sorted(got[group]) == sorted(names)
            for n in names:
                assert torch.equal(got[group][n], saved[f"{group}/{n}"]), (group, n)


def test_load_state_for_unknown_names_names_them(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    ckpt = load_checkpoint(tmp_path / step_dirname(10))
    with pytest.raises(CheckpointError, match=r"blocks\.9\.attn\.qkv\.weight"):
        load_state_for_layers(ckpt, ["embed.wte.weight", "blocks.9.attn.qkv.weight"])


def test_check_compatible_names_each_mismatching_field(tmp_path: Path) -> None:
    manifest = {"model": {**SHAPE, "n_embd": 128}}
    check_compatible({"model": SHAPE}, SHAPE)
    with pytest.raises(CheckpointError, match=r"checkpoint model\.n_embd=128 but this run has 8"):
        check_compatible(manifest, SHAPE)
    with pytest.raises(CheckpointError) as e:
        check_compatible(manifest, {**SHAPE, "n_layer": 4})
    assert "model.n_layer=2 but this run has 4" in str(e.value)
    assert "model.n_embd=128 but this run has 8" in str(e.value)
    assert "vocab_size" not in str(e.value)


class _Evil:
    """Unpickling this creates `marker`: the proof that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def _forbid_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("a checkpoint file was unpickled")

    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(torch, "load", boom)


def test_a_pickle_posing_as_a_shard_is_never_executed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    control = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(_Evil(control)))  # the payload really runs if unpickled
    assert control.exists()

    _save(tmp_path, 10)
    marker = tmp_path / "marker"
    ckpt = tmp_path / step_dirname(10)
    payload = pickle.dumps(_Evil(marker))
    (ckpt / "stage-0.safetensors").write_bytes(payload)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["stages"][0]["sha256"] = hashlib.sha256(payload).hexdigest()
    manifest["stages"][0]["bytes"] = len(payload)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    _forbid_unpickling(monkeypatch)

    assert _statuses(tmp_path) == {"step-00000010": "complete"}  # checksum and size agree
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_checkpoint(ckpt)
    skipped: list[str] = []
    assert latest_complete(tmp_path, on_skip=lambda p, r: skipped.append(r)) is None
    assert "stage-0.safetensors is not a valid safetensors file" in skipped[0]
    assert not marker.exists()


def test_torch_save_files_are_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 10)
    ckpt = tmp_path / step_dirname(10)
    marker = tmp_path / "marker"
    torch.save({"x": _Evil(marker)}, ckpt / "stage-0.pt")
    torch.save({"x": _Evil(marker)}, ckpt / "model.pt")
    _forbid_unpickling(monkeypatch)

    # stray .pt files next to the shards are ignored...
    loaded = load_checkpoint(ckpt)
    load_state_for_layers(loaded, _names(["embed", "head"]))
    assert latest_complete(tmp_path) is not None
    # ...and a manifest pointing at one is rejected before anything is opened
    manifest = json.loads((ckpt / "manifest.json").read_text())
    pt = ckpt / "stage-0.pt"
    manifest["stages"][0].update(file="stage-0.pt", bytes=pt.stat().st_size)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="stage entry 0 is malformed"):
        load_checkpoint(ckpt)
    assert latest_complete(tmp_path) is None
    assert not marker.exists()


def test_prune_keeps_newest_and_never_the_last_good_one(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        _save(tmp_path, step)
    (tmp_path / "notes").mkdir()
    (tmp_path / "README").write_text("mine")
    (tmp_path / "step-abc").mkdir()
    (tmp_path / "step-00000001").symlink_to(tmp_path / "notes")
    stale = tmp_path / ".tmp-step-00000015-999999"
    stale.mkdir()
    (stale / "stage-0.safetensors").write_bytes(b"half")

    removed = prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == [stale.name, "step-00000010", "step-00000020"]
    assert _statuses(tmp_path) == {"step-00000030": "complete", "step-00000040": "complete"}

    _save(tmp_path, 50)
    _save(tmp_path, 60)
    _flip_byte(tmp_path / step_dirname(50) / "stage-0.safetensors")
    (tmp_path / step_dirname(60) / "manifest.json").unlink()
    newer_tmp = tmp_path / ".tmp-step-00000070-999999"
    newer_tmp.mkdir()
    removed = prune(tmp_path, keep=1)
    assert [p.name for p in removed] == ["step-00000030"]  # 40 is the last good one: kept
    assert _statuses(tmp_path) == {
        "step-00000040": "complete",
        "step-00000050": "complete",  # sizes fine; checksum bad, so it did not count as kept
        "step-00000060": "corrupt",
        newer_tmp.name: "partial",
    }
    assert latest_complete(tmp_path).step == 40  # type: ignore[union-attr]
    for name in ("notes", "README", "step-abc", "step-00000001"):
        assert (tmp_path / name).exists() or (tmp_path / name).is_symlink()
    with pytest.raises(ValueError):
        prune(tmp_path, keep=0)


def test_prune_spares_a_tmp_dir_this_process_is_writing(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    with CheckpointWriter(tmp_path, 5) as w:
        assert prune(tmp_path, keep=1) == []
        assert w.tmp_dir.is_dir()
    assert not w.tmp_dir.exists()  # the context manager aborted it


def test_resaving_a_step_replaces_a_corrupt_directory(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    _flip_byte(tmp_path / step_dirname(10) / "stage-0.safetensors")
    states = _save(tmp_path, 10)
    ckpt = load_checkpoint(tmp_path / step_dirname(10))
    assert torch.equal(
        ckpt.stage(0).tensor("params/embed.wte.weight"), states[0]["params/embed.wte.weight"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010"]


def test_writer_refuses_incomplete_or_inconsistent_commits(tmp_path: Path) -> None:
    with CheckpointWriter(tmp_path, 3) as w:
        w.write_shard(0, _state(_names(["embed"]), 0))
        with pytest.raises(CheckpointError, match="twice"):
            w.write_shard(0, _state(_names(["embed"]), 0))
        with pytest.raises(CheckpointError, match=r"expected 0\.\.1"):
            w.commit(_manifest(3), num_stages=2)
        with pytest.raises(CheckpointError, match="model"):
            w.commit({"config_hash": "x", "plan": {}, "data": {}}, num_stages=1)
        with pytest.raises(CheckpointError, match="must not set"):
            w.commit({**_manifest(3), "step": 4}, num_stages=1)
        with pytest.raises(CheckpointError, match="JSON"):
            w.write_shard(1, {}, {"bad": object()})
        with pytest.raises(CheckpointError, match="already being written"):
            CheckpointWriter(tmp_path, 3)
        w.commit(_manifest(3), num_stages=1)
        with pytest.raises(CheckpointError, match="already committed"):
            w.write_shard(1, {})
    assert _statuses(tmp_path) == {"step-00000003": "complete"}
