"""Tier 2: an outer-loop run's checkpoints hold the outer state, ``--resume`` continues it
bit-exactly, and ``geopipe export`` writes theta_global ([Note: the outer-loop checkpoint] in
geopipe.checkpoint.outer).

Two emulated sites, one group each (one device each: one stage), Streaming DiLoCo with
H = 4, F = 2, overlap 1, codec int8, DiLoCo's outer lr 0.7 and momentum 0.9 (so the
momentum, the rounds and each group's own drift all matter). Fragment 0 is sent after steps
1, 5 and applied after 2, 6; fragment 1 sent after 3, 7, applied after 4, 8. One run of 8
steps is the reference; a run stopped at 6 (round 1 partly through: fragment 0 applied,
fragment 1 not yet sent) or at 4 (a round's end) and resumed to 8 must give the same losses
and theta_global, bit for bit, with a shared checkpoint directory and with per-site copies.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from geopipe.checkpoint.store import latest_complete, load_checkpoint
from geopipe.config import parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions
from tests.integration.test_outer_runtime import streaming_doc

pytestmark = pytest.mark.ray
STEPS, H, F, TAU = 8, 4, 2, 1


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def _doc(ckpt_dir: str | None = None) -> dict:
    """test_outer_runtime's outer run, with F fragments, an overlap, int8 and DiLoCo's outer
    optimizer."""
    doc = streaming_doc("outer-ckpt", STEPS, H, F, TAU)
    if ckpt_dir:
        doc["training"]["checkpoint"]["dir"] = ckpt_dir
    return doc


@pytest.fixture(autouse=True)
def _penalty(tmp_path_factory, monkeypatch):
    row = {
        "replicas": 2,
        "h": H,
        "fragments": F,
        "overlap": TAU,
        "codec": "int8",
        "rel_gap": 0.01,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
    }
    doc = {"source": "test", "model": "test", "steps": 1, "tokens_per_step": 1}
    path = tmp_path_factory.mktemp("penalty") / "penalty.json"
    path.write_text(json.dumps({**doc, "sync_noise": 0.0, "rows": [row]}))
    monkeypatch.setenv("GEOPIPE_LOSS_PENALTY", str(path))


def _theta_by_name():
    """theta_global of a one-replica stage by parameter name: a function that runs inside
    the actor (made here so that Ray pickles it by value, not by this module's name)."""

    def theta(worker) -> dict[str, torch.Tensor]:
        layouts = [g["layout"] for g in worker.engine.local_snapshot()["groups"]]
        out = {}
        for lay, t in zip(layouts, worker._outer.state.opt.theta, strict=True):
            for name, off, shape in lay:
                out[name] = t[off : off + math.prod(shape)].view(shape).clone()
        return out

    return theta


def _run(run_dir: Path, ckpt_dir: str | None = None, **opts) -> dict:
    spec = parse_cluster(_doc(ckpt_dir), "outer-ckpt")
    ctl = Controller(spec, LaunchOptions(run_dir=str(run_dir), progress=False, **opts))
    try:
        ctl.launch()
        assert ctl.plan.num_groups == 2
        losses = [m.loss for m in ctl.train().steps]
        actors = [a for row in ctl.placement.rows for a in row]
        w = ctl.workers
        outer = w.get([w.call(a, "outer_state") for a in actors])
        masters = w.get([w.call(a, "full_state") for a in actors])
        named = w.get([a.__ray_call__.remote(_theta_by_name()) for a in actors])
    finally:
        ctl.close()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"losses": losses, "outer": outer, "masters": masters, "theta": named, "lines": lines}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run of all 8 steps in one go."""
    mp = pytest.MonkeyPatch()
    row = {"replicas": 2, "h": H, "fragments": F, "overlap": TAU, "codec": "int8"}
    row.update(rel_gap=0.01, outer_lr=0.7, outer_momentum=0.9)
    doc = {"source": "t", "model": "t", "steps": 1, "tokens_per_step": 1, "sync_noise": 0.0}
    path = tmp_path_factory.mktemp("ref-penalty") / "penalty.json"
    path.write_text(json.dumps({**doc, "rows": [row]}))
    mp.setenv("GEOPIPE_LOSS_PENALTY", str(path))
    try:
        run_dir = tmp_path_factory.mktemp("reference") / "run"
        return {**_run(run_dir), "dir": run_dir}
    finally:
        mp.undo()


def _same_outer(a: list[dict], b: list[dict]) -> None:
    """theta_global, momentum and round counters of every replica, bit for bit."""
    for x, y in zip(a, b, strict=True):
        assert x["steps"] == y["steps"]
        assert all(torch.equal(s, t) for s, t in zip(x["theta"], y["theta"], strict=True))
        for s, t in zip(x["momentum_buffer"], y["momentum_buffer"], strict=True):
            assert (s is None and t is None) or torch.equal(s, t)


def _resume_and_compare(reference: dict, tmp: Path, stop: int, ckpt_dir: str | None) -> dict:
    first = _run(tmp / "run", ckpt_dir, steps=stop)
    assert first["losses"] == reference["losses"][:stop]
    second = _run(tmp / "run", ckpt_dir, resume=True)
    (resumed,) = [x for x in second["lines"] if x.get("event") == "resumed"]
    assert resumed["step"] == stop
    (outer_resumed,) = [x for x in second["lines"] if x.get("event") == "outer_resumed"]
    assert len(outer_resumed["theta_digests"]) == 1  # every group restored the same theta
    # the continued steps are the reference's, bit for bit (<= 1e-6 is the contract)
    assert second["losses"] == reference["losses"][stop:]
    _same_outer(second["outer"], reference["outer"])
    for a, b in zip(second["masters"], reference["masters"], strict=True):
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    return second


def test_a_shared_directory_resume_mid_round_is_bit_exact(reference, tmp_path):
    ref = reference
    assert len(ref["losses"]) == STEPS and all(math.isfinite(x) for x in ref["losses"])
    rounds = [x for x in ref["lines"] if x.get("event") == "outer_round"]
    assert [(r["step"], r["fragment"]) for r in rounds] == [(2, 0), (4, 1), (6, 0), (8, 1)]
    assert all(r["digests_equal"] for r in rounds)
    # the groups' own weights differ (fragment 0 drifted since step 6): the checkpoint needs
    # each group's inner state, not one group's
    a, b = (m["params"] for m in ref["masters"])
    assert any(not torch.equal(a[k], b[k]) for k in a)
    _resume_and_compare(ref, tmp_path, stop=6, ckpt_dir=None)
    # the checkpoint at 6: two groups x one stage, theta_global as params/, momentum
    ckpt = load_checkpoint(latest_complete(tmp_path / "run" / "checkpoints").path)
    assert ckpt.manifest["outer"]["groups"] == 2 and len(ckpt.stages) == 2
    assert ckpt.stages[0].meta["outer"]["steps"] == [2, 2]  # round counters after step 8


def test_per_site_copies_resume_at_a_round_end_is_bit_exact(reference, tmp_path):
    ck = str(tmp_path / "ckpt-{site}")
    _resume_and_compare(reference, tmp_path, stop=4, ckpt_dir=ck)
    for site in ("east", "west"):  # each site holds a complete copy of both groups' shards
        info = latest_complete(tmp_path / f"ckpt-{site}")
        assert info is not None and info.step == STEPS
        ckpt = load_checkpoint(info.path)
        assert (ckpt.manifest["outer"]["groups"], ckpt.manifest["outer"]["stages"]) == (2, 1)
        assert len(ckpt.stages) == 2


def test_export_writes_theta_global_and_transformers_loads_it(reference, tmp_path):
    transformers = pytest.importorskip("transformers")
    from geopipe.cli.commands import export_run
    from geopipe.model.export import export_model

    out, _ = export_run(str(reference["dir"]), str(tmp_path / "hf"), dtype="fp32")
    manifest = load_checkpoint(latest_complete(reference["dir"] / "checkpoints").path).manifest
    assert manifest["step"] == STEPS
    theta = reference["theta"][0]
    assert all(torch.equal(theta[k], reference["theta"][1][k]) for k in theta)
    _, _, want = export_model(manifest["model"], theta, torch.float32)
    model = transformers.GPT2LMHeadModel.from_pretrained(out)
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # and not group 0's own weights, which differ from theta_global in fragment 0
    _, _, local = export_model(manifest["model"], reference["masters"][0]["params"], torch.float32)
    assert any(not torch.equal(got[k], local[k]) for k in local)
