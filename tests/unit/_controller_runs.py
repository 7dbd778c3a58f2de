"""What the controller tests against the fake worker group share (test_controller_states,
test_controller_saves): the small two-site document, a launch on the fake that records the
states it went through (:class:`Run`), and the exactness check (:func:`assert_exact`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from geopipe.checkpoint.store import load_checkpoint
from geopipe.config import HealthSpec, parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions
from tests.unit.fakes import FakeWorkers, reference_losses, reference_state

__all__ = [
    "FAST",
    "GB",
    "LAYERS",
    "ROOT",
    "Run",
    "assert_exact",
    "ckpt_params",
    "make_doc",
]

ROOT = Path(__file__).resolve().parents[2]
GB = 8  # global batch
LAYERS = 6  # the plan's layers: embedding, 4 blocks, head
# Short control-plane clocks: the mechanisms are the production ones, the waits are not.
FAST = dict(
    heartbeat_s=0.05,
    unresponsive_s=0.3,
    settle_s=0.5,
    stuck_release_s=0.5,
    copy_wait_s=2.0,
    hang_floor_s=5.0,
    hang_floor_uncalibrated_s=5.0,
)


def make_doc(corpus: Path, devices: int = 2, steps: int = 6, every: int = 2) -> dict:
    """clusters/local-2dc.yaml, small: ``devices`` per site, 4 layers, a text corpus."""
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text()))
    doc["name"] = f"fk{devices}"
    for s in doc["sites"]:
        s["devices_per_node"] = devices
    doc["model"]["max_seq_len"] = 32
    doc["training"].update(
        steps=steps,
        data=str(corpus),
        global_batch_size=GB,
        checkpoint={"every_steps": every, "keep": 3},
    )
    doc["plan"].update(calibrate=False, micro_batch_size=2, seq_len=32, pipelines=devices)
    return doc


class Run:
    """One launch on the fake: the states it went through and what it wrote."""

    def __init__(
        self,
        doc: dict,
        run_dir: Path,
        fake: FakeWorkers | None = None,
        health: dict | None = None,
        **options,
    ) -> None:
        self.fake = fake or FakeWorkers()
        self.run_dir = run_dir
        clocks = HealthSpec(**{**FAST, **(health or {})})
        opts = LaunchOptions(run_dir=str(run_dir), progress=False, health=clocks, **options)
        self.ctl = Controller(parse_cluster(doc, "t"), opts, workers=self.fake)
        self.states: list = []
        self.shown: list[str] = []  # every state status.json showed
        self._step, self._status = self.ctl._step, self.ctl.reporter.status
        self.ctl._step, self.ctl.reporter.status = self.step, self.status_written
        self.final: dict | None = None

    def step(self, state):
        self.states.append(state)
        return self._step(state)

    def status_written(self, state: str, *rest) -> None:
        self.shown.append(state)
        self._status(state, *rest)

    def go(self) -> Run:
        try:
            self.ctl.launch()
            self.ctl.train()
            self.final = self.ctl.gather_state()
        finally:
            self.ctl.close()
        return self

    def path(self) -> list[str]:
        """The states visited, e.g. ``["planning", "running 0", ..., "finished"]``."""
        out = [s.name + (f" {s.step}" if hasattr(s, "step") else "") for s in self.states]
        return [*out, self.ctl.state.name]

    def lines(self) -> list[dict]:
        text = (self.run_dir / "metrics.jsonl").read_text()
        return [json.loads(x) for x in text.splitlines()]

    def events(self, kind: str) -> list[dict]:
        return [x for x in self.lines() if x.get("event") == kind]

    def losses(self) -> list[float]:
        """Per step, the loss of its last run (steps redone after a rollback appear twice)."""
        by_step = {x["step"]: x["loss"] for x in self.lines() if "event" not in x}
        return [by_step[k] for k in sorted(by_step)]

    def status(self) -> dict:
        return json.loads((self.run_dir / "status.json").read_text())


def assert_exact(run: Run, steps: int) -> None:
    """No step lost or applied twice: the final state is ``steps`` uninterrupted steps',
    each step saw the whole global batch once per stage, and no actor ran a step on the
    wrong state."""
    assert run.fake.violations == []
    ref = reference_state(LAYERS, steps, 0)
    for i, group in enumerate(("params", "exp_avg", "exp_avg_sq")):
        assert run.final[group] == {n: v[i] for n, v in ref.items()}, group
    assert run.final["step"] == steps
    for s in range(steps):
        seen = run.fake.samples[s]
        assert seen and all(sorted(v) == list(range(s * GB, (s + 1) * GB)) for v in seen.values())
    assert run.losses() == pytest.approx(reference_losses(GB, steps), abs=1e-12)


def ckpt_params(path: Path) -> dict[str, float]:
    ckpt = load_checkpoint(path)  # verifies every shard's checksum
    return {n: float(t[0]) for s in ckpt.stages for n, t in s.tensors("params/").items()}
