"""Tier 2: a launch whose plan is an outer loop between replica groups, driven by the
controller on the suite's embedded Ray (real actors, DeepSpeed, the authenticated data plane).

Two emulated sites, one group each (one device: a one-stage pipeline); outer lr 1, momentum
0, codec none, H = 2: every round replaces both groups' weights by their exact average, so
after each round the groups hold bit-identical weights (their theta_global digests are
compared in every round event), and the checkpoint written at a round boundary holds them.
The numerics of the outer step itself (against a torch reference averaging the groups, and
against torch's Nesterov SGD) are tests/integration/test_outer_actor.py's.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from geopipe.checkpoint.store import latest_complete, load_checkpoint, load_state_for_layers
from geopipe.config import parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def _doc(steps: int = 4, h: int = 2) -> dict:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text()))
    doc["name"] = "outer"
    for s in doc["sites"]:
        s["devices_per_node"] = 1
    doc["links"][0].update(latency_ms=5.0, bandwidth_gbps=1.0, codec="none")
    doc["model"] = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256, "max_seq_len": 32}
    doc["training"].update(
        global_batch_size=8,
        steps=steps,
        lr=0.01,
        warmup_steps=1,
        data_max_bytes=200_000,
        checkpoint={"every_steps": h, "keep": 5},
    )
    doc["plan"].update(
        strategy="outer",
        pipelines=1,
        micro_batch_size=2,
        seq_len=32,
        codecs=["none"],
        calibrate=False,
        outer={"h": h, "codec": "none", "lr": 1.0, "momentum": 0.0},
    )
    return doc


def streaming_doc(name: str, steps: int, h: int, fragments: int, overlap: int) -> dict:
    """:func:`_doc`'s run as Streaming DiLoCo: ``fragments`` fragments, ``overlap``, codec
    int8, DiLoCo's outer lr 0.7 and momentum 0.9, a checkpoint every round."""
    doc = _doc(steps=steps, h=h)
    doc["name"] = name
    doc["training"]["checkpoint"] = {"every_steps": h, "keep": 5}
    doc["plan"]["outer"] = {
        "h": h,
        "fragments": fragments,
        "overlap": overlap,
        "codec": "int8",
        "lr": 0.7,
        "momentum": 0.9,
    }
    return doc


def _table(tmp: Path, h: int) -> Path:
    rows = [
        {
            "replicas": 2,
            "h": h,
            "fragments": 1,
            "codec": "none",
            "rel_gap": 0.01,
            "outer_lr": 1.0,
            "outer_momentum": 0.0,
        }
    ]
    path = tmp / "penalty.json"
    doc = {
        "source": "test",
        "model": "test",
        "steps": 1,
        "tokens_per_step": 1,
        "sync_noise": 0.0,
        "rows": rows,
    }
    path.write_text(json.dumps(doc))
    return path


def test_an_outer_loop_run_keeps_its_groups_identical_after_every_round(tmp_path, monkeypatch):
    """East's devices 3x west's: the planner balances the batch shares (6 and 2 of the 8
    sequences of a step, [Note: batch shares] in geopipe.optimizer.strategy), and launch
    runs them, the average weighted by share (its numerics: tests/integration/
    test_outer_shares.py)."""
    monkeypatch.setenv("GEOPIPE_LOSS_PENALTY", str(_table(tmp_path, 2)))
    doc = _doc()
    doc["sites"][0]["device_tflops"] = 3 * doc["sites"][1]["device_tflops"]
    spec = parse_cluster(doc, "outer")
    ctl = Controller(spec, LaunchOptions(run_dir=str(tmp_path / "run"), progress=False))
    try:
        ctl.launch()
        assert ctl.plan.num_groups == 2 and ctl.outer is not None
        assert [ctl.plan.microbatches_of(r) for r in range(2)] == [3, 1]  # 6 and 2 sequences
        assert ctl.outer.settings.weights == (6.0, 2.0)
        sites = {ctl.plan.site_of(0, r) for r in range(ctl.plan.pipelines)}
        assert sites == {"east", "west"}
        losses = [m.loss for m in ctl.train().steps]
        rows = ctl.placement.rows
        states = ctl.workers.get([ctl.workers.call(a, "full_state") for a in rows[0]])
    finally:
        ctl.close()
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rounds = [x for x in lines if x.get("event") == "outer_round"]
    assert [r["step"] for r in rounds] == [2, 4] and all(r["digests_equal"] for r in rounds)
    assert all(r["groups"] == 2 and r["bytes"] > 0 for r in rounds)
    (plan_event,) = [x for x in lines if x.get("event") == "plan"]
    assert plan_event["plan"]["groups"] == [0, 1] and plan_event["outer"]["h"] == 2
    # after the last round both groups hold the same weights, bit for bit
    a, b = (s["params"] for s in states)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the checkpoint at the round boundary holds those weights
    ckpt = load_checkpoint(latest_complete(tmp_path / "run" / "checkpoints").path)
    assert ckpt.step == 4
    saved = load_state_for_layers(ckpt, a.keys())["params"]
    assert saved.keys() == a.keys() and all(torch.equal(saved[k], a[k]) for k in a)
