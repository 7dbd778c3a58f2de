"""Run identity with real Ray, in both checkpoint modes (a shared directory; per-site
directories, where each site's store moves the earlier run's copies aside on its own
node): a second run launched without --resume into directories holding an earlier run's
checkpoints moves them aside untouched, and when it loses the only holder of a stage its
recovery restores its own checkpoint, never the earlier run's newer one."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from test_runtime import reference, tiny_doc

from geopipe.checkpoint.store import list_checkpoints, load_checkpoint
from geopipe.config import parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def _doc() -> dict:
    doc = tiny_doc(1, 1, steps=4)
    doc["name"] = "runid"
    doc["training"]["checkpoint"] = {"every_steps": 2, "keep": 3}
    return doc


def _launch(doc: dict, run_dir: Path, chaos: int | None = None) -> Controller:
    opts = LaunchOptions(
        run_dir=str(run_dir), progress=False, chaos_kill_every=chaos, checkpoint_sync=True
    )
    ctl = Controller(parse_cluster(doc, "t"), opts)
    try:
        ctl.launch()
        ctl.train()
        return ctl
    finally:
        ctl.close()


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> tuple[str, Path]:
    """Run A: 4 steps, checkpoints at steps 2 and 4 (launched once, copied per test)."""
    run_dir = tmp_path_factory.mktemp("a")
    ctl = _launch(_doc(), run_dir)
    return ctl.run_id, run_dir / "checkpoints"


@pytest.mark.parametrize("mode", ["shared", "per-site"])
def test_second_run_never_restores_the_first_runs_checkpoints(tmp_path, run_a, capfd, mode):
    a_id, a_ckpts = run_a
    assert [i.step for i in list_checkpoints(a_ckpts)] == [2, 4]
    assert load_checkpoint(a_ckpts / "step-00000004").manifest["run_id"] == a_id
    doc = _doc()
    run_dir = tmp_path / "R"
    if mode == "shared":
        roots = {"": run_dir / "checkpoints"}
    else:
        doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ck-{site}")
        roots = {s: tmp_path / f"ck-{s}" for s in ("east", "west")}
    for root in roots.values():  # run A's checkpoints are where run B will write its own
        shutil.copytree(a_ckpts, root)
    before = _digests(a_ckpts)
    capfd.readouterr()

    # Run B, no --resume: in step 3 one stage's only actor is killed, so the recovery
    # must restore a checkpoint: B's own step 2, not A's step 4.
    ctl = _launch(doc, run_dir, chaos=3)
    b_id = ctl.run_id
    assert b_id != a_id
    err = capfd.readouterr().err
    saved: dict[int, str] = {}
    for root in roots.values():
        moved = root.with_name(f"{root.name}.prev-{a_id}")
        assert _digests(moved) == before  # A's checkpoints, intact
        assert f"moved the checkpoints of run {a_id}" in err and f"to {moved}" in err
        got = {i.step: i.run_id for i in list_checkpoints(root)}
        saved.update(got)
        # (per-site: after the recovery one site runs everything and alone gets step 4)
        assert got.get(2) == b_id and set(got.values()) == {b_id}
        lineage = load_checkpoint(root / "step-00000002").manifest["lineage"]
        assert lineage == {b_id: None}
    assert saved == {2: b_id, 4: b_id}
    lines = _lines(run_dir)
    rec = [x for x in lines if x.get("event") == "recovered"]
    assert len(rec) == 1 and rec[0]["source"] == "checkpoint", rec
    assert rec[0]["step"] == 2 and rec[0]["failed_step"] == 3
    for path in rec[0]["restored_from"]["paths"].values():
        assert load_checkpoint(path).manifest["run_id"] == b_id
    plan = next(x for x in lines if x.get("event") == "plan")
    assert plan["run_id"] == b_id
    assert json.loads((run_dir / "status.json").read_text())["run_id"] == b_id
    # B trained every step itself: the same losses as an undisturbed run.
    by_step = {x["step"]: x["loss"] for x in lines if "event" not in x}
    assert sorted(by_step) == [0, 1, 2, 3]
    assert [by_step[k] for k in range(4)] == pytest.approx(reference(doc)[0], abs=1e-4)
