"""Tier 2, issue 32: what a trainer must get right, with real Ray, DeepSpeed and torch.

* global gradient clipping over a 2-site pipelined Hugging Face Llama (its tied embedding
  split over the two sites) equals `transformers` in one process with ``clip_grad_norm_``;
* (stopping short of the YAML's steps and resuming past them equals the run in one go,
  every step's LR transformers' scheduler's over the YAML's horizon and held at the minimum
  LR past it: tests/integration/test_checkpoint_runtime.py's resume tests check it, on
  runs they launch anyway);
* a diverging run stops with exit 3 naming the step, leaving only finite checkpoints;
* a model that raises in its forward ends the run with its message, no recovery.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from _hfdoc import clipped_reference
from _tokdata import stdlib_sources, train_small_tokenizer
from test_hf_runtime import hf_doc, save_model
from test_runtime import tiny_doc

from geopipe.checkpoint.store import list_checkpoints, load_checkpoint
from geopipe.config import parse_cluster
from geopipe.model.prepare import prepare_data
from geopipe.runtime.control.controller import Controller, LaunchOptions
from geopipe.runtime.control.health import ModelFailed

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def launch(doc: dict, run_dir: Path, steps: int | None = None, resume: bool | str = False):
    ctl = Controller(
        parse_cluster(doc, "test"),
        LaunchOptions(steps=steps, run_dir=str(run_dir), progress=False, resume=resume),
    )
    try:
        ctl.launch()
        return ctl, ctl.train().steps
    finally:
        ctl.close()


def test_global_clip_across_two_sites_matches_clip_grad_norm(tmp_path: Path) -> None:
    """A tied Llama over two emulated sites, clipping active on every step (the norm is
    always far above 0.05): the losses of `transformers` + ``clip_grad_norm_`` within
    1e-5, and the reported norm is the global one, the tied embedding counted once."""
    model_dir = save_model(tmp_path, "llama-gqa-tied")
    doc = hf_doc(model_dir, "clip", steps=4)
    doc["training"]["grad_clip"] = 0.05
    ctl, steps = launch(doc, tmp_path / "run")
    assert ctl.plan.stage_sites == ("east", "west")
    ref_losses, ref_norms = clipped_reference(doc, model_dir)
    assert min(ref_norms) > 0.05 * 5  # the clip bites on every step
    assert max(abs(m.loss - r) for m, r in zip(steps, ref_losses, strict=True)) <= 1e-5
    assert [m.grad_norm for m in steps] == pytest.approx(ref_norms, rel=1e-4)


def test_diverging_run_exits_3_and_leaves_finite_checkpoints(tmp_path: Path, capsys) -> None:
    """AdamW at lr 10 with weight decay 10 multiplies every matrix by -99 a step: the
    gradients overflow within a few steps. `geopipe launch` exits 3 naming the step;
    every checkpoint left in the directory loads and holds finite values only."""
    from geopipe.cli import main

    doc = tiny_doc(1, 1, steps=12)
    doc["name"] = "diverge"
    doc["training"].update(lr=10.0, weight_decay=10.0, warmup_steps=0)
    doc["training"]["checkpoint"] = {"every_steps": 1, "keep": 2}
    path = tmp_path / "diverge.yaml"
    path.write_text(yaml.safe_dump(doc))
    run = tmp_path / "run"
    code = main(["launch", str(path), "--run-dir", str(run), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "training diverged at step" in err and "not finite" in err
    step = int(err.split("training diverged at step ")[1].split(":")[0])
    assert 1 <= step < 12
    ckpt_dir = run / "checkpoints"
    found = list_checkpoints(ckpt_dir) if ckpt_dir.exists() else []
    assert found, f"no checkpoint in {run}"
    for info in found:
        if info.status != "complete":  # an interrupted save is no checkpoint (never restored)
            continue
        ck = load_checkpoint(info.path)
        assert ck.step <= step
        for shard in ck.stages:
            for name, t in shard.tensors("").items():
                if t.is_floating_point():
                    assert torch.isfinite(t).all(), (info.path, name)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if m.get("step") == step]
    assert last and not all(
        math.isfinite(v) for v in [last[0].get("grad_norm") or 0.0, last[0].get("loss") or 0.0]
    )


def test_model_error_ends_the_run_with_its_message(tmp_path: Path) -> None:
    """Token ids past the embedding (a dataset whose manifest claims the model's vocabulary
    but whose tokens come from a larger tokenizer): the first stage's embedding raises at
    step 0. The run ends with torch's message, the stage and the step, and no recovery."""
    tok = train_small_tokenizer(tmp_path / "tok", vocab=512)
    prepare_data(stdlib_sources(3), tok, tmp_path / "ds", shard_tokens=4_000, progress=False)
    manifest = tmp_path / "ds" / "manifest.json"
    meta = json.loads(manifest.read_text())
    meta["vocab_size"] = 256  # the lie: its ids go up to 511
    manifest.write_text(json.dumps(meta))
    doc = tiny_doc(1, 1, steps=3)
    doc["name"] = "model-error"
    doc["training"]["data"] = str(tmp_path / "ds")
    ctl = Controller(
        parse_cluster(doc, "t"), LaunchOptions(run_dir=str(tmp_path / "r"), progress=False)
    )
    try:
        ctl.launch()
        with pytest.raises(ModelFailed) as info:
            ctl.train()
    finally:
        ctl.close()
    msg = str(info.value)
    assert "stage 0" in msg and "step 0" in msg and "forward of micro-batch" in msg
    assert "IndexError" in msg and "index out of range" in msg, msg
    assert "no recovery" in msg and ctl.history.recoveries == []
