"""Checkpoint faults with real Ray and DeepSpeed (issue 33, item 6).

The newest checkpoint is damaged on disk between a run and its ``--resume``: the resume
verifies it, skips it (a console line and a ``checkpoint_skipped`` event naming the file)
and continues from the previous good one, with the losses of an uninterrupted run from
that step, bit for bit. Then the YAML's optimizer settings change and ``geopipe launch
--resume`` refuses, exit 2 without a traceback, naming both runs. The per-piece logic is
unit-tested in tests/unit/test_ckpt_saves.py and tests/unit/test_ckpt_runs.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_runtime import tiny_doc

from geopipe.config import parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def launch(doc: dict, run_dir: Path, steps: int, resume=False) -> tuple[list[float], Controller]:
    ctl = Controller(
        parse_cluster(doc, "test"),
        LaunchOptions(steps=steps, run_dir=str(run_dir), progress=False, resume=resume),
    )
    try:
        ctl.launch()
        res = ctl.train()
        return [m.loss for m in res.steps], ctl
    finally:
        ctl.close()


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == kind]


def test_resume_skips_a_corrupted_newest_checkpoint_and_stays_exact(tmp_path, capfd):
    """One uninterrupted run saves at steps 2 and 4; its newest checkpoint (4) is damaged
    and ``--resume`` continues from 2, so it trains steps 2 and 3 again: two steps, the
    second after the restored Adam state and RNG, compared bit for bit with the run itself
    (which needs no second launch of the same document to stand for it)."""
    doc = tiny_doc(1, 1, steps=4)
    doc["training"]["checkpoint"] = {"every_steps": 2, "keep": 3}
    split = tmp_path / "split"
    straight, _ = launch(doc, split, steps=4)
    assert [p.name for p in sorted((split / "checkpoints").glob("step-*"))] == [
        "step-00000002",
        "step-00000004",
    ]
    shard = split / "checkpoints" / "step-00000004" / "stage-1.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in the tensor data; the manifest is untouched
    shard.write_bytes(bytes(data))
    capfd.readouterr()

    rest, b = launch(doc, split, steps=4, resume=True)
    assert b.start_step == 2
    assert rest == straight[2:]  # exact equality: the uninterrupted run's losses
    out = capfd.readouterr()
    assert "skipping checkpoint" in out.out + out.err and "stage-1.safetensors" in out.out + out.err
    (skip,) = events(split, "checkpoint_skipped")
    assert skip["file"] == "stage-1.safetensors" and "checksum" in skip["reason"]
    assert skip["path"].endswith("step-00000004")
    (resumed,) = [r for r in events(split, "resumed") if r["step"] == 2]
    assert resumed["path"].endswith("step-00000002")

    # Other optimizer settings: `--resume` refuses (Planning: no Ray is needed to say so).
    doc["training"]["lr"] = 0.02
    cfg = tmp_path / "changed.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "geopipe.cli",
            "launch",
            str(cfg),
            "--resume",
            "--run-dir",
            str(split),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"written by run {b.run_id}" in proc.stderr and "(run " in proc.stderr
    assert "--resume " + str(split / "checkpoints" / "step-00000004") in proc.stderr
