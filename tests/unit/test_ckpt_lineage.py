"""The pure parts of ``--resume``'s choice (geopipe/checkpoint/lineage.py): what counts as
other training settings, and what a run directory says of its last launch."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml

from geopipe.checkpoint.lineage import (
    Launch,
    config_refusal,
    previous_launch,
    resume_lineage,
    trajectory_hash,
)
from geopipe.config import parse_cluster

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text())


def _hash(**edits) -> str:
    doc = copy.deepcopy(BASE)
    for path, value in edits.items():
        *head, last = path.split("__")
        node = doc
        for key in head:
            node = node[key]
        node[last] = value
    return trajectory_hash(parse_cluster(doc, "t"))


def test_what_a_resume_may_change_leaves_the_trajectory_alone() -> None:
    same = _hash()
    assert _hash(training__steps=999) == same  # a longer run
    assert _hash(training__checkpoint={"every_steps": 7, "keep": 5}) == same
    assert _hash(plan__pipelines=1) == same  # another plan
    doc = copy.deepcopy(BASE)
    doc["sites"][0]["devices_per_node"] = 4  # other devices
    assert trajectory_hash(parse_cluster(doc, "t")) == same
    assert _hash(training__lr=0.5) != same  # the optimizer
    assert _hash(training__seed=11) != same
    assert _hash(model__n_embd=256) != same  # the model


def test_refusal_names_both_runs_and_the_way_to_take_it() -> None:
    manifest = {"trajectory_hash": "aaaa", "run_id": "A"}
    assert config_refusal(manifest, "/x/step-00000004", "aaaa", "B") is None
    assert config_refusal({"run_id": "A"}, "/x/step-00000004", "bbbb", "B") is None  # older
    msg = config_refusal(manifest, "/x/step-00000004", "bbbb", "B")
    assert msg is not None
    assert "step-00000004 was written by run A" in msg and "(run B, bbbb)" in msg
    assert msg.endswith("--resume /x/step-00000004")


def test_previous_launch_reads_status_then_the_plan_event(tmp_path: Path) -> None:
    assert previous_launch(tmp_path) is None and resume_lineage(None) is None
    (tmp_path / "status.json").write_text(
        json.dumps({"run_id": "B", "lineage": {"A": 3, "B": None}})
    )
    last = previous_launch(tmp_path)
    assert last == Launch("B", {"A": 3, "B": None})
    assert resume_lineage(last) == {"A": 3, "B": None}
    (tmp_path / "status.json").write_text(json.dumps({"run_id": "B"}))  # older status file
    rows = [
        {"event": "plan", "run_id": "A", "lineage": {"A": None}},
        {"step": 0, "loss": 1.0},
        {"event": "plan", "run_id": "B", "lineage": {"A": 2, "B": None}},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    assert previous_launch(tmp_path) == Launch("B", {"A": 2, "B": None})
    (tmp_path / "metrics.jsonl").unlink()
    assert resume_lineage(previous_launch(tmp_path)) == {"B": None}  # its own only
