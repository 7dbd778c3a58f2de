"""Tier 2: a run never adopts another run's checkpoints.

Run A trains 6 steps into a run directory (checkpoints at 2, 4, 6). Run B — the same
cluster file, launched into the same directory without --resume — finds them moved aside
(``checkpoints.prev-<A's id>``, byte for byte), loses a replica in step 3 with recovery
snapshots off, so recovery must restore a checkpoint: it restores B's own step 2 (A's step
6 would have "finished" the run), never A's, and B's losses equal an undisturbed run's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_recovery_runtime import events, last_loss_per_step, run
from test_runtime import reference, tiny_doc

from geopipe.checkpoint.store import list_checkpoints

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def test_a_fresh_run_moves_another_runs_checkpoints_aside_and_recovers_its_own(tmp_path):
    doc = tiny_doc(2, 2, steps=6)
    doc["name"] = "identity"
    doc["training"]["recovery_snapshots"] = False
    doc["training"]["checkpoint"] = {"every_steps": 2, "keep": 5}
    run_dir = tmp_path / "run"
    ctl_a, _ = run(doc, run_dir, steps=6)
    a_ckpts = digests(run_dir / "checkpoints")
    assert [i.run_id for i in list_checkpoints(run_dir / "checkpoints")] == [ctl_a.run_id] * 3

    ctl_b, state = run(doc, run_dir, steps=6, chaos=3)
    moved = run_dir / f"checkpoints.prev-{ctl_a.run_id}"
    assert digests(moved) == a_ckpts  # A's checkpoints survive untouched, moved aside
    assert events(run_dir, "checkpoints_moved_aside")[-1]["run"] == ctl_a.run_id
    rec = events(run_dir, "recovered")
    assert len(rec) == 1 and rec[0]["source"] == "checkpoint"
    assert rec[0]["step"] in (2, 3), rec  # B's own (A's reached step 6)
    assert state["step"] == 6
    mine = list_checkpoints(run_dir / "checkpoints")
    assert mine and {i.run_id for i in mine} == {ctl_b.run_id} != {ctl_a.run_id}
    status = json.loads((run_dir / "status.json").read_text())
    assert status["run_id"] == ctl_b.run_id
    b_losses = [x for x in last_loss_per_step(run_dir)]
    assert b_losses == pytest.approx(reference(doc)[0], abs=1e-4)
