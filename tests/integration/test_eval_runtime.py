"""Tier 2: held-out evaluation through the pipeline and the optional W&B run, on the real
runtime (embedded Ray, DeepSpeed ZeRO-1, the direct data plane between two emulated sites).

A tied Llama written with ``save_pretrained`` trains two steps with ``training.eval`` every
step on the held-out tail of the training data; the run is exported with ``geopipe
export`` and `transformers` replays the same held-out batches: the pipeline's evaluation
equals it to 1e-5. The W&B run (offline) holds the losses the metrics file holds, read
back with wandb's own reader of its run files (``wandb leet inspect --json``).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from _hfdoc import two_site_hf_doc
from test_hf_runtime import save_model
from transformers import AutoModelForCausalLM

from geopipe.config import parse_cluster
from geopipe.model.data import TokenStream, open_corpus, sample_indices
from geopipe.model.gpt import lm_loss
from geopipe.runtime.actor.evaluate import EVAL_SEED_SALT, eval_samples, split_corpus
from geopipe.runtime.control.controller import Controller, LaunchOptions

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def eval_doc(model_dir: Path) -> dict:
    """Two sites of one device each, one pipeline of two stages, codec none; evaluation
    after every step on 20 % of the training data held out; W&B offline."""
    eval_ = {"every_steps": 1, "batches": 1, "holdout": 0.2}
    doc = two_site_hf_doc("eval-llama", model_dir, steps=2, data_max_bytes=100_000, eval=eval_)
    doc["logging"] = {"wandb": {"project": "geopipe-test", "mode": "offline", "tags": ["ci"]}}
    return doc


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of the run's offline W&B run, as wandb itself reads its files."""
    beside = Path(sys.executable).parent / "wandb"  # this environment's wandb first
    exe = str(beside) if beside.exists() else shutil.which("wandb") or "wandb"
    out = subprocess.run(
        [exe, "leet", "inspect", "--json", str(run_dir / "wandb")],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r["history"]["item"] for r in rows if r.get("type") == "history"]


def test_eval_through_the_pipeline_matches_transformers_and_wandb_logs(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    from geopipe.cli import main

    model_dir = save_model(tmp_path, "llama-gqa-tied")
    doc = eval_doc(model_dir)
    spec = parse_cluster(doc, "test")
    ctl = Controller(spec, LaunchOptions(run_dir=str(tmp_path / "run"), progress=False))
    try:
        ctl.launch()
        steps = ctl.train().steps
        evals = list(ctl.evals.results)
    finally:
        ctl.close()
    assert [e["step"] for e in evals] == [1, 2] and all(e["micro_batches"] == 4 for e in evals)
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]  # it learns (lr 0.01, same batches)

    # transformers on the same data: the training part for step 0, the held-out tail after
    corpus = open_corpus("stdlib", max_bytes=100_000)
    train, held = split_corpus(corpus, 0.2, 32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stream = TokenStream(train, 0)
    with torch.no_grad():  # step 0 runs the initial weights on the training part only
        first = [
            lm_loss(model(input_ids=xs).logits, ys).item()
            for xs, ys in (stream.batch(sample_indices(0, 8, mb, 2), 32) for mb in range(4))
        ]
    assert abs(steps[0].loss - sum(first) / 4) <= 1e-5
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    exported.config._attn_implementation = "sdpa"
    stream = TokenStream(held, EVAL_SEED_SALT)
    with torch.no_grad():
        want = [
            lm_loss(exported(input_ids=xs).logits, ys).item()
            for xs, ys in (stream.batch(mb, 32) for mb in eval_samples(8, 2, 1, 0))
        ]
    assert abs(evals[1]["eval_loss"] - sum(want) / len(want)) <= 1e-5
    assert evals[1]["perplexity"] == pytest.approx(math.exp(evals[1]["eval_loss"]))

    lines = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [x for x in lines if x.get("event") == "eval"]
    assert [x["eval_loss"] for x in logged] == [e["eval_loss"] for e in evals]
    history = wandb_history(tmp_path / "run")
    train_loss = {h["_step"]: h["train/loss"] for h in history if "train/loss" in h}
    assert train_loss == pytest.approx({0: steps[0].loss, 1: steps[1].loss}, abs=1e-12)
    eval_loss = {h["_step"]: h["eval/loss"] for h in history if "eval/loss" in h}
    assert eval_loss == pytest.approx({1: evals[0]["eval_loss"], 2: evals[1]["eval_loss"]})


def outer_doc() -> dict:
    """Two emulated sites, one replica group each (a one-stage pipeline of the built-in GPT),
    an outer round every 2 steps, evaluation every 2 steps (tests/integration/
    test_outer_runtime.py's run, observed)."""
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text()))
    doc["name"] = "outer-observed"
    for s in doc["sites"]:
        s["devices_per_node"] = 1
    doc["links"][0].update(latency_ms=5.0, bandwidth_gbps=1.0, codec="none")
    doc["model"] = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256, "max_seq_len": 32}
    doc["training"].update(
        global_batch_size=8,
        steps=4,
        lr=0.01,
        warmup_steps=1,
        data_max_bytes=200_000,
        eval={"every_steps": 2, "batches": 1},
    )
    doc["plan"].update(
        strategy="outer",
        pipelines=1,
        micro_batch_size=2,
        seq_len=32,
        codecs=["none"],
        calibrate=False,
        outer={"h": 2, "codec": "none", "lr": 1.0, "momentum": 0.0},
    )
    return doc


def test_outer_rounds_and_group_losses_reach_metrics_and_tensorboard(tmp_path, monkeypatch):
    """Each step's per-group losses (their mean is the step's loss), each round's figures
    and each evaluation (per group too) are in metrics.jsonl and, the same values, in
    TensorBoard; the progress line's round counts the rounds."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    table = {"replicas": 2, "h": 2, "fragments": 1, "codec": "none", "rel_gap": 0.01}
    table |= {"outer_lr": 1.0, "outer_momentum": 0.0}
    path = tmp_path / "penalty.json"
    path.write_text(
        json.dumps(
            {"source": "test", "model": "test", "steps": 1, "tokens_per_step": 1,
             "sync_noise": 0.0, "rows": [table]}
        )
    )  # fmt: skip
    monkeypatch.setenv("GEOPIPE_LOSS_PENALTY", str(path))
    spec = parse_cluster(outer_doc(), "outer")
    ctl = Controller(spec, LaunchOptions(run_dir=str(tmp_path / "run"), progress=False))
    try:
        ctl.launch()
        assert ctl.plan.num_groups == 2
        steps = ctl.train().steps
        shown = ctl.reporter.latest_round
    finally:
        ctl.close()
    assert shown == "round 2/2"
    for m in steps:
        assert len(m.group_loss) == 2 and sum(m.group_loss) / 2 == pytest.approx(m.loss, 1e-12)
    assert steps[0].group_loss[0] != steps[0].group_loss[1]  # each group its own samples
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rounds = [x for x in lines if x.get("event") == "outer_round"]
    evals = [x for x in lines if x.get("event") == "eval"]
    assert [r["step"] for r in rounds] == [2, 4] and [e["step"] for e in evals] == [2, 4]
    assert all(len(e["group_eval_loss"]) == 2 for e in evals)
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    tb = {(e.step, t): e.value for t in acc.Tags()["scalars"] for e in acc.Scalars(t)}
    for m in steps:
        for g, loss in enumerate(m.group_loss):
            assert tb[m.step, f"group/{g}/loss"] == pytest.approx(loss, rel=1e-6)
    for r in rounds:
        for key in ("bytes", "exposed_s", "overlapped_s", "apply_s", "codec_error", "round"):
            assert tb[r["step"], f"outer/{key}"] == pytest.approx(r[key], rel=1e-6, abs=1e-9)
    for e in evals:
        assert tb[e["step"], "eval/loss"] == pytest.approx(e["eval_loss"], rel=1e-6)
        assert tb[e["step"], "eval/group_1_loss"] == pytest.approx(e["group_eval_loss"][1], 1e-6)
