"""Tier 2: a site that falls silent mid-step is waited for, not written off.

Two emulated sites, one stage each. The west stage process is stopped (SIGSTOP) during a
step and continued 6 s later: from the driver that is what a WAN outage or partition looks
like — every actor of the site silent, the east side alive. The step waits (status.json:
``waiting``, naming the link), the run continues where it was with the losses of an
undisturbed run and no step lost; the console and metrics say when the link went silent
and when it healed. (Past ``health.wan_outage_s`` the site-loss path re-forms the job
without west instead: tests/unit/test_controller_states.py, against the fake worker group.)

The undisturbed run is the single-process reference (test_runtime's): an undisturbed launch
of the same document gave the outage run's losses bitwise, but costs a launch's actor
start-up; the reference was measured within 8e-7 of both over the 40 steps, bound 1e-5 (the
parity test's).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import ray
from test_recovery_runtime import events, events_ready, last_loss_per_step, run
from test_runtime import reference, tiny_doc

from geopipe.checkpoint.store import list_checkpoints
from geopipe.config import HealthSpec

pytestmark = pytest.mark.ray
# Enough steps that the freeze (after step 2) lands mid-run however fast the steps go.
STEPS = 40


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def freezer(run_dir: Path, seconds: float, seen: list, after_checkpoint: bool = False):
    """Stop west's stage for ``seconds`` once two steps are done (and, with
    ``after_checkpoint``, a checkpoint is complete); record what status.json says meanwhile."""

    def ready() -> bool:
        if not events_ready(run_dir):
            return False
        return not after_checkpoint or any(
            i.status == "complete" for i in list_checkpoints(run_dir / "checkpoints")
        )

    def freeze(ctl) -> None:
        pid = ray.get(ctl.actors[1][0].ping.remote())
        while True:  # until the freeze lands inside a step, not in a checkpoint's save
            while ctl.state.name != "running" or not ready():
                time.sleep(0.05)
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.3)
            if ctl.state.name == "running":
                break
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.5)
        seen.append(pid)
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                with contextlib.suppress(OSError, ValueError):
                    doc = json.loads((run_dir / "status.json").read_text())
                    if doc.get("state") == "waiting":
                        seen.append(doc["waiting"])
                time.sleep(0.2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    return freeze


def test_a_short_outage_is_waited_out_with_the_same_losses(tmp_path: Path) -> None:
    doc = tiny_doc(1, 1, steps=STEPS)
    doc["name"] = "outage"
    health = HealthSpec(heartbeat_s=0.5, unresponsive_s=2.0, wan_outage_s=30.0)
    calm = reference(doc)[0]  # the undisturbed run, in one process
    seen: list = []
    _, state = run(
        doc, tmp_path / "out", steps=STEPS, health=health, kill=freezer(tmp_path / "out", 6.0, seen)
    )
    assert state["step"] == STEPS
    assert last_loss_per_step(tmp_path / "out") == pytest.approx(calm, abs=1e-5)
    assert events(tmp_path / "out", "failure") == [] == events(tmp_path / "out", "recovered")
    silent, healed = (
        events(tmp_path / "out", "link_silent"),
        events(tmp_path / "out", "link_healed"),
    )
    assert len(silent) == 1 and silent[0]["link"] == "east→west"
    assert len(healed) == 1 and 3.0 <= healed[0]["silent_s"] <= 20.0
    waits = [w for w in seen[1:] if isinstance(w, dict)]
    assert waits and waits[-1]["link"] == "east→west" and waits[-1]["limit_s"] == 30.0
