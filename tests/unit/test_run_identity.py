"""Run identity of checkpoints (pure store functions over real files): a run uses and
prunes only its own checkpoints and its resumed ancestor's up to the resume point; a
fresh run moves another run's directory aside, intact."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from geopipe.checkpoint.store import (
    accepts,
    latest_complete,
    list_checkpoints,
    move_aside,
    prune,
)
from geopipe.checkpoint.writer import CheckpointWriter
from geopipe.runtime.control.resumepoint import ResumePoint

SHAPE = {"n_layer": 1, "n_embd": 4, "n_head": 1, "vocab_size": 8, "max_seq_len": 4}


def save(root: Path, step: int, run_id: str | None, lineage: dict | None = None) -> None:
    manifest = {"config_hash": "x", "plan": {}, "model": SHAPE, "data": {}}
    if run_id is not None:
        manifest.update(run_id=run_id, lineage=lineage or {run_id: None})
    with CheckpointWriter(root, step) as w:
        w.write_shard(0, {"params/w": torch.full((2,), float(step))})
        w.commit(manifest, num_stages=1)


def digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_accepts_own_and_ancestors_up_to_the_resume_point() -> None:
    lineage = {"B": None, "A": 4, "": 2}
    assert accepts(lineage, "B", 100) and accepts(lineage, "A", 4) and accepts(lineage, None, 2)
    assert not accepts(lineage, "A", 6) and not accepts(lineage, None, 3)
    assert not accepts(lineage, "C", 1)
    assert accepts(None, "C", 1)  # no lineage: tools see everything


def test_resume_lineage_caps_every_ancestor() -> None:
    point = ResumePoint("p", 4, None, run_id="B", lineage={"B": None, "A": 6})
    assert point.lineage_for("C") == {"A": 4, "B": 4, "C": None}
    old = ResumePoint("p", 3, None)  # written before runs had ids
    assert old.lineage_for("C") == {"": 3, "C": None}


def test_latest_and_prune_see_only_the_runs_lineage(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        save(tmp_path, step, "A")
    save(tmp_path, 3, "B", {"B": None, "A": 2})  # B resumed from A's step 2
    b = {"B": None, "A": 2}
    assert latest_complete(tmp_path, lineage=b).step == 3
    assert latest_complete(tmp_path, lineage={"C": None, "A": 2}).step == 2
    assert latest_complete(tmp_path, lineage={"D": None}) is None
    assert latest_complete(tmp_path).step == 6  # no lineage: the newest of all
    before = digests(tmp_path)
    save(tmp_path, 5, "B", b)
    assert prune(tmp_path, keep=1, own="B") == [tmp_path / "step-00000003"]
    left = {i.step: i.run_id for i in list_checkpoints(tmp_path)}
    assert left == {2: "A", 4: "A", 5: "B", 6: "A"}  # A's untouched
    assert all(before[k] == v for k, v in digests(tmp_path).items() if k in before)


def test_move_aside_keeps_everything_and_names_the_run(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert move_aside(root) is None  # nothing there
    for step in (2, 4):
        save(root, step, "A")
    before = digests(root)
    path, run = move_aside(root)
    assert run == "A" and path == tmp_path / "checkpoints.prev-A" and not root.exists()
    assert digests(path) == before
    save(root, 2, None)  # an old-format checkpoint
    path2, run2 = move_aside(root)
    assert run2 == "unknown" and path2.name == "checkpoints.prev-unknown"
    for step in (2,):
        save(root, step, "A")
    path3, _ = move_aside(root)
    assert path3.name == "checkpoints.prev-A-2"


@pytest.mark.parametrize("verify", [False, True])
def test_listing_reports_the_run(tmp_path: Path, verify: bool) -> None:
    save(tmp_path, 2, "A")
    save(tmp_path, 4, None)
    assert [(i.step, i.run_id) for i in list_checkpoints(tmp_path, verify=verify)] == [
        (2, "A"),
        (4, None),
    ]


def test_a_resumed_run_keeps_its_parents_later_checkpoint_of_the_same_step(tmp_path: Path) -> None:
    """B resumed from A's step 2 in A's directory; when B saves step 4, A's step 4 is kept
    (renamed, invisible to listings), not replaced; a run re-saving its own step replaces."""
    for step in (2, 4):
        save(tmp_path, step, "A")
    a4 = digests(tmp_path / "step-00000004")
    save(tmp_path, 4, "B", {"B": None, "A": 2})
    kept = tmp_path / "step-00000004.prev-A"
    assert digests(kept) == a4
    assert [(i.step, i.run_id) for i in list_checkpoints(tmp_path)] == [(2, "A"), (4, "B")]
    save(tmp_path, 4, "B", {"B": None, "A": 2})  # its own: replaced, nothing more kept
    assert sorted(p.name for p in tmp_path.iterdir() if "prev" in p.name) == [kept.name]
