"""Checkpoints with real Ray and DeepSpeed: exact resume (past the YAML's steps, each step's
LR transformers' scheduler's), re-sharding, a bad resume path.

The driver's logic around them — a corrupt newest checkpoint skipped, a checkpoint of
another model or of other data refused, `geopipe checkpoints`, a per-site directory that
cannot be made — is tested against the fake worker group in
tests/unit/test_controller_saves.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_runtime import reference, tiny_doc

from geopipe.checkpoint.store import list_checkpoints, load_checkpoint
from geopipe.config import parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def launch(doc: dict, run_dir: Path, steps: int, resume=False, gather: bool = False):
    """(per-step losses, the state loaded before training if ``gather``, the final state,
    the controller); the steps' metrics are ``ctl.steps``."""
    ctl = Controller(
        parse_cluster(doc, "test"),
        LaunchOptions(steps=steps, run_dir=str(run_dir), progress=False, resume=resume),
    )
    try:
        ctl.launch()
        loaded = ctl.gather_state() if gather else None
        res = ctl.train()
        final = ctl.gather_state()
        ctl.steps = res.steps
        return [m.loss for m in res.steps], loaded, final, ctl
    finally:
        ctl.close()


def transformers_lrs(name: str, warmup: int, horizon: int, steps: int, **kw) -> list[float]:
    """The LR of each of ``steps`` steps under `transformers`' scheduler ``name`` (lr 0.01)
    over ``horizon`` steps, held at its last value past it, as geopipe documents."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
    sched = get_scheduler(name, opt, warmup, horizon, scheduler_specific_kwargs=kw or None)
    want = []
    for _ in range(horizon):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return want + [kw.get("min_lr", want[-1])] * (steps - horizon)


def doc_with_ckpt(devices: int, pipelines: int, every: int = 2) -> dict:
    doc = tiny_doc(devices, pipelines, steps=4)
    doc["training"]["checkpoint"] = {"every_steps": every, "keep": 3}
    return doc


def test_resume_is_bit_for_bit(tmp_path):
    """2N steps straight == resuming from that run's step-N checkpoint for N more (ZeRO-1
    groups of 2, int8 WAN): the same per-step losses and the same final parameters and Adam
    state, bitwise. (Resuming from the checkpoint a stopped run wrote at its end is the same
    code path: a checkpoint is a checkpoint; the next test resumes one.) Both runs keep
    per-site checkpoint copies (no shared directory): the resumed run reads west's copy,
    which crossed sites. The YAML says 3 steps and both runs go to 4 (``--steps``): the
    step past the YAML's steps resumes exactly too, and every step's LR, in both runs, is
    `transformers`' cosine_with_min_lr over the YAML's horizon, at the minimum LR after it."""
    doc = doc_with_ckpt(2, 2)
    doc["links"][0]["codec"] = "int8"
    doc["plan"]["codecs"] = ["int8"]
    doc["training"].update(steps=3, lr_schedule="cosine", min_lr=0.002, betas=[0.85, 0.97])
    doc["training"]["checkpoint"]["dir"] = str(tmp_path / "a-{site}")
    full, _, full_state, straight = launch(doc, tmp_path / "a", steps=4)
    half = tmp_path / "a-west" / "step-00000002"
    doc["training"]["checkpoint"]["dir"] = str(tmp_path / "b-{site}")
    second, _, resumed_state, ctl = launch(doc, tmp_path / "b", steps=4, resume=str(half))
    assert ctl.start_step == 2 and len(full) == 4 and len(second) == 2
    assert second == full[2:]  # exact equality, not approx
    want = transformers_lrs("cosine_with_min_lr", 1, 3, 4, min_lr=0.002)
    assert want[3] == 0.002 < want[2] < want[1]  # past the horizon: held at the minimum
    assert max(abs(m.lr - w) for m, w in zip(straight.steps, want, strict=True)) <= 1e-9
    assert max(abs(m.lr - w) for m, w in zip(ctl.steps, want[2:], strict=True)) <= 1e-9
    # The checkpoint (assembled from each replica's ZeRO-1 partition on a background thread)
    # holds exactly what DeepSpeed's own full-state gather returns at that point, in both
    # sites' copies, which are the same bytes.
    copies = [load_checkpoint(tmp_path / f"a-{s}" / "step-00000004") for s in ("east", "west")]
    assert [e["sha256"] for e in copies[0].manifest["stages"]] == [
        e["sha256"] for e in copies[1].manifest["stages"]
    ]
    for shard in copies[1].stages:
        for group in ("params", "exp_avg", "exp_avg_sq"):
            for name, t in shard.tensors(group + "/").items():
                assert torch.equal(t, full_state[group][name]), (group, name)
    for group in ("params", "exp_avg", "exp_avg_sq"):
        for name, t in full_state[group].items():
            assert torch.equal(t, resumed_state[group][name]), (group, name)
    for site in ("east", "west"):
        steps = [i.step for i in list_checkpoints(tmp_path / f"b-{site}") if i.status == "complete"]
        assert steps == [4]


def test_resume_into_other_replica_count_keeps_optimizer_state(tmp_path):
    """Saved by ZeRO-1 groups of 2, loaded by single replicas, and back: the loaded full
    Adam state equals the checkpoint's, and training continues with the same losses
    (same global batch, so equal up to float summation order). Every run stops short of
    the YAML's 4 steps (``--steps``), each resumed from the one before: each step's LR is
    `transformers`' cosine over the YAML's horizon, not over where a run stops."""
    two = doc_with_ckpt(2, 2)
    one = doc_with_ckpt(1, 1)
    ref = reference(two)[0]  # the uninterrupted run, in one process
    want = transformers_lrs("cosine", 1, 4, 4)
    _, _, _, first = launch(two, tmp_path / "run", steps=2)
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000002")
    losses, loaded, _, ctl = launch(one, tmp_path / "run", steps=3, resume=True, gather=True)
    assert ctl.plan.pipelines == 1
    for k, shard in enumerate(ckpt.stages):
        for group in ("params", "exp_avg", "exp_avg_sq"):
            for name, t in shard.tensors(group + "/").items():
                assert torch.equal(loaded[group][name], t), (k, group, name)
    assert loaded["step"] == 2
    assert losses == pytest.approx(ref[2:3], abs=1e-5)
    back, _, _, ctl2 = launch(two, tmp_path / "run", steps=4, resume=True)
    assert ctl2.plan.pipelines == 2 and ctl2.start_step == 3
    assert back == pytest.approx(ref[3:4], abs=1e-5)
    lrs = [m.lr for c in (first, ctl, ctl2) for m in c.steps]
    assert lrs == pytest.approx(want, abs=1e-9)
    # a horizon of 3 (the stopped run's --steps) would give step 2 another LR
    assert abs(want[2] - transformers_lrs("cosine", 1, 3, 3)[2]) > 1e-3


@pytest.mark.parametrize("where", ["missing", "not-a-checkpoint"])
def test_cli_resume_from_bad_path_exits_nonzero(tmp_path, where):
    path = tmp_path / "nope"
    if where == "not-a-checkpoint":
        path.mkdir()
        (path / "manifest.json").write_text("{not json")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "geopipe.cli",
            "launch",
            "clusters/local-2dc.yaml",
            "--resume",
            str(path),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--resume" in proc.stderr and str(path) in proc.stderr
    assert "Traceback" not in proc.stderr
