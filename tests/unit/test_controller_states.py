"""The controller's states, recovery and checkpoint coordination, against an in-process fake of
the worker group (tests/unit/fakes.py): no Ray, no torch training, real planner, real
policies, real checkpoint files.

The fake's model is one number per layer updated by a pure function of (step, layer), so
"no step lost, none applied twice" is checked exactly: after any history of failures,
recoveries, restores and grow-backs the run's final state must equal the state of
``steps`` uninterrupted steps (:func:`reference_state`), and every step's samples must be
the whole global batch, each once. The state machine's path is recorded by wrapping
``Controller._step``; the metrics file, status.json and ``Controller.history`` are read as
a user would.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from geopipe.checkpoint.store import latest_complete, list_checkpoints, load_checkpoint
from geopipe.runtime.control.cluster import LaunchError
from geopipe.runtime.control.workers import WorkerFailed
from tests.unit._controller_runs import (
    GB,
    LAYERS,
    Run,
    assert_exact,
    ckpt_params,
    make_doc,
)
from tests.unit.fakes import FakeWorkers, reference_state


# -- the happy path ----------------------------------------------------------------------------
def test_a_run_plans_launches_trains_checkpoints_and_finishes(tmp_path: Path, corpus: Path) -> None:
    run = Run(make_doc(corpus, steps=6, every=2), tmp_path / "run").go()
    assert run.path() == [
        "planning",
        "launching",
        "running 0",
        "running 1",
        "checkpointing 2",
        "running 2",
        "running 3",
        "checkpointing 4",
        "running 4",
        "running 5",
        "checkpointing 6",
        "finished",
    ]
    assert_exact(run, 6)
    assert run.ctl.plan.pipelines == 2 and run.ctl.plan.num_stages == 2
    (plan,) = run.events("plan")
    assert plan["config_hash"] == run.ctl.spec.digest and plan["plan"]["pipelines"] == 2
    (security,) = run.events("security")  # one replica group: no outer payloads to sign
    assert security["outer_payloads_signed"] is False and security["handshake_authenticated"]
    assert [e["step"] for e in run.events("checkpoint")] == [2, 4, 6]
    steps = [x for x in run.lines() if "event" not in x]
    assert [x["step"] for x in steps] == list(range(6))
    assert all(x["tokens"] == GB * 32 and 0 <= x["bubble_ratio"] < 1 for x in steps)
    assert run.events("calibrated")  # the measured steps fed the calibrator
    status = run.status()
    assert status["state"] == "finished" and status["step"] == 6 and status["pid"] is None
    assert status["recoveries"] == [] and run.ctl.history.recoveries == []
    assert [i.step for i in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2, 4, 6]
    ref = reference_state(LAYERS, 4, 0)
    assert ckpt_params(tmp_path / "run" / "checkpoints" / "step-00000004") == {
        n: v[0] for n, v in ref.items()
    }
    assert run.shown[0] == "launching"  # status.json from the moment there is a plan
    assert run.fake.live() == [] and len(run.fake.killed) == 4  # close() stopped them


# -- a failure in each state -------------------------------------------------------------------
def test_planning_refuses_a_checkpoint_of_another_model(tmp_path: Path, corpus: Path) -> None:
    """Moved from tests/integration/test_checkpoint_runtime.py: resuming a checkpoint whose
    model differs fails in Planning, before any actor starts, naming the field."""
    doc = make_doc(corpus, steps=2, every=1)
    Run(doc, tmp_path / "run").go()
    doc["model"]["n_embd"] = 64
    run = Run(doc, tmp_path / "run", resume=True)
    with pytest.raises(LaunchError, match=r"model.n_embd=128 but this run has 64"):
        run.go()
    assert run.path() == ["planning", "planning"]  # never left Planning
    assert run.fake.actors == []


def test_launching_fails_when_an_actor_fails_setup(tmp_path: Path, corpus: Path) -> None:
    """An actor that raises while being wired: the launch fails with the actor's message,
    status.json says failed, and every actor made so far is stopped."""
    fake = FakeWorkers()
    fake.inject("west/stage1/r0", raise_on={"setup": "no device found"})
    (tmp_path / "run").mkdir()
    run = Run(make_doc(corpus), tmp_path / "run", fake)
    with pytest.raises(WorkerFailed, match="no device found"):
        run.go()
    assert run.path() == ["planning", "launching", "failed"]
    assert run.status()["state"] == "failed"
    assert len(fake.actors) == 4 and fake.live() == []


def test_launching_names_a_site_the_cluster_lacks(tmp_path: Path, corpus: Path) -> None:
    """Moved from tests/integration/test_runtime.py (test_missing_site_is_named)."""
    doc = make_doc(corpus)
    doc["sites"][1]["name"] = "north"
    doc["links"][0]["to"] = "north"
    fake = FakeWorkers(resources={"site:east": 3, "site:west": 3})
    with pytest.raises(LaunchError, match=r"site 'north' needs 2 devices .* offers 0"):
        Run(doc, tmp_path / "run", fake).go()
    assert fake.actors == []


def test_running_an_actor_lost_mid_step_recovers_at_the_boundary(
    tmp_path: Path, corpus: Path
) -> None:
    """A replica dies in step 2: Running -> Recovering -> Running at step 2 on the three
    survivors, from their boundary snapshots (no step lost); the run's own history, the
    metrics and status.json record it."""
    fake = FakeWorkers()
    fake.inject("west/stage1/r1", die_at_step=2)
    run = Run(make_doc(corpus, steps=5, every=0), tmp_path / "run", fake).go()
    path = run.path()
    i = path.index("recovering 2")
    assert path[i - 1 : i + 2] == ["running 2", "recovering 2", "running 2"]
    (failure,) = run.events("failure")
    assert failure["step"] == 2 and failure["dead"] == ["geopipe/fk2/west/stage1/r1"]
    (rec,) = run.events("recovered")
    assert rec["step"] == 2 and rec["lost_steps"] == 0 and rec["source"] == "surviving replicas"
    # 1 x 3 stages over east, east, west: the middle stage (east) takes one layer only a
    # west survivor holds, through the object store (no process group spans sites)
    assert rec["plan"]["partition"] == [[0, 2], [2, 4], [4, 6]]
    assert rec["moved"] == {"p2p_bytes": 0, "object_store_bytes": 12}
    assert [(r["step"], r["failed_step"]) for r in run.ctl.history.recoveries] == [(2, 2)]
    assert [r["failed_step"] for r in run.status()["recoveries"]] == [2]
    assert run.ctl.plan.pipelines * run.ctl.plan.num_stages == 3
    assert_exact(run, 5)


@pytest.mark.parametrize("replica", [1, 0])
def test_checkpointing_an_actor_lost_during_the_save(
    tmp_path: Path, corpus: Path, replica: int
) -> None:
    """A replica dies as its stage's save of step 2 begins (the other replicas already
    write): Checkpointing -> Recovering -> Running(2). The save stays in flight for the
    recovery, which commits it -- every stage's shard written, by a stand-in where the dead
    one was the writer (replica 0) -- so nothing is redone or lost: the checkpoint holds
    the state of two uninterrupted steps, and the next save works."""
    fake = FakeWorkers()
    fake.inject(f"east/stage0/r{replica}", die_on="save_shard")
    run = Run(make_doc(corpus, steps=4, every=2), tmp_path / "run", fake).go()
    path = run.path()
    i = path.index("checkpointing 2")
    assert path[i : i + 3] == ["checkpointing 2", "recovering 2", "running 2"]
    assert [e["step"] for e in run.events("failure")] == [2]
    assert [e["step"] for e in run.events("checkpoint")] == [2, 4]
    stand_ins = [e["stage"] for e in run.events("checkpoint_stand_in")]
    assert stand_ins == ([0] if replica == 0 else [])
    saved = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [c.step for c in saved] == [2, 4]
    assert ckpt_params(saved[0].path) == {n: v[0] for n, v in reference_state(LAYERS, 2, 0).items()}
    assert run.events("recovered")[0]["lost_steps"] == 0
    assert_exact(run, 4)


@pytest.mark.parametrize("per_site", [False, True])
def test_checkpointing_an_actor_frozen_as_the_save_begins(
    tmp_path: Path, corpus: Path, per_site: bool
) -> None:
    """A replica freezes as its stage's save of step 2 asks for its snapshot (the call never
    answers, nor do its pings): the save names it unresponsive after ``unresponsive_s``
    instead of waiting for ever (it did: no heartbeat watched a save's snapshot), and the
    run recovers without it, exact, in both checkpoint modes."""
    fake = FakeWorkers()
    fake.inject("west/stage1/r1", freeze_on="save_shard")
    doc = make_doc(corpus, steps=4, every=2)
    if per_site:  # each site's store pulls the shards of its own copy
        doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ck-{site}")
    run = Run(doc, tmp_path / "run", fake).go()
    path = run.path()
    i = path.index("checkpointing 2")
    assert path[i : i + 3] == ["checkpointing 2", "recovering 2", "running 2"]
    (failure,) = run.events("failure")
    assert failure["step"] == 2 and failure["dead"] == ["geopipe/fk2/west/stage1/r1"]
    assert "unanswered heartbeat" in failure["error"]
    assert run.events("recovered")[0]["lost_steps"] == 0
    assert run.events("checkpoint")[-1]["step"] == 4
    assert_exact(run, 4)


def test_recovering_a_second_death_during_recovery_recovers_again(
    tmp_path: Path, corpus: Path
) -> None:
    """A replica dies in step 2; a survivor dies while the job is re-formed around it:
    Recovering -> Recovering (nested) -> Running at step 2 on the two left, no step lost.
    The nested recovery reads the survivors' layers from the layout their snapshots belong
    to ([Note: a death while re-forming] in geopipe.runtime.control.recovery)."""
    fake = FakeWorkers()
    fake.inject("west/stage1/r1", die_at_step=2)
    fake.inject("east/stage0/r0", die_on="reconfigure")
    run = Run(make_doc(corpus, steps=4, every=0), tmp_path / "run", fake).go()
    path = run.path()
    i = path.index("recovering 2")
    assert path[i - 1 : i + 3] == ["running 2", "recovering 2", "recovering 2", "running 2"]
    first, second = run.events("failure")
    assert first["dead"] == ["geopipe/fk2/west/stage1/r1"]
    assert set(second["dead"]) == {"geopipe/fk2/west/stage1/r1", "geopipe/fk2/east/stage0/r0"}
    (rec,) = run.events("recovered")  # one recovery completed, from the survivors' memory
    assert rec["step"] == 2 and rec["source"] == "surviving replicas"
    assert len(run.ctl.history.recoveries) == 1
    assert run.ctl.plan.pipelines * run.ctl.plan.num_stages == 2
    assert_exact(run, 4)


# -- site outages ------------------------------------------------------------------------------
def test_an_outage_is_waited_out_and_the_step_completes(tmp_path: Path, corpus: Path) -> None:
    """Every actor of west falls silent mid-step for 0.8 s (a WAN outage as the driver sees
    it): the step waits (status.json: waiting), the link is reported silent and healed, no
    failure, no recovery, nothing lost."""
    fake = FakeWorkers()
    fake.outage("west", at_step=2, seconds=0.8)
    run = Run(
        make_doc(corpus, devices=1, steps=4, every=0),
        tmp_path / "run",
        fake,
        health={"wan_outage_s": 5.0},
    ).go()
    assert run.events("failure") == [] == run.events("recovered")
    (silent,) = run.events("link_silent")
    (healed,) = run.events("link_healed")
    assert silent["link"] == healed["link"] == "east→west" and silent["step"] == 2
    assert 0.4 <= healed["silent_s"] <= 3.0
    assert "waiting" in run.shown and run.status()["waiting"] is None
    assert "recovering 2" not in run.path()
    assert_exact(run, 4)


def test_an_outage_past_the_deadline_takes_the_site_loss_path(tmp_path: Path, corpus: Path) -> None:
    """Moved from tests/integration/test_outage_runtime.py: west stays silent past
    ``health.wan_outage_s``; it is written off, and with its layers held nowhere else the
    job re-forms on east from the last checkpoint — and still ends exactly where an
    undisturbed run does."""
    fake = FakeWorkers()
    fake.outage("west", at_step=3, seconds=30.0)
    run = Run(
        make_doc(corpus, devices=1, steps=5, every=2),
        tmp_path / "run",
        fake,
        health={"wan_outage_s": 1.0},
    ).go()
    (failure,) = run.events("failure")
    assert failure["step"] == 3 and failure["dead"] == ["geopipe/fk1/west/stage1/r0"]
    assert failure["lost_sites"] == ["west"] and "heartbeat" in failure["error"]
    assert run.events("link_silent") and not run.events("link_healed")
    (rec,) = run.events("recovered")
    assert rec["source"] == "checkpoint" and rec["step"] == 2 and rec["lost_steps"] == 1
    assert set(run.ctl.plan.stage_sites) == {"east"}
    assert_exact(run, 5)


# -- grow-back ---------------------------------------------------------------------------------
def test_devices_that_come_back_are_grown_onto_at_a_checkpoint(
    tmp_path: Path, corpus: Path
) -> None:
    """An east replica dies in step 2 and its device stays taken until step 4: the run
    recovers on three devices; at the first checkpoint boundary after the device is free
    again (6) the job grows back to 2 x 2 (Growing -> Checkpointing), loading the new
    actor's layers from the running replicas."""
    fake = FakeWorkers()
    fake.inject("east/stage0/r1", die_at_step=2, hold_until_step=4)
    run = Run(make_doc(corpus, steps=8, every=2), tmp_path / "run", fake).go()
    path = run.path()
    assert "recovering 2" in path and "growing 4" not in path
    i = path.index("growing 6")
    assert path[i - 1 : i + 3] == ["running 5", "growing 6", "checkpointing 6", "running 6"]
    (grown,) = run.events("grown")
    assert grown["step"] == 6 and grown["plan"]["pipelines"] == 2
    assert [g["step"] for g in run.ctl.history.growbacks] == [6]
    assert run.ctl.plan.pipelines == 2 and run.ctl.plan.num_stages == 2
    assert len(fake.actors) == 5  # one new actor took the device that came back
    assert_exact(run, 8)


# -- recovery that must fall back, or cannot ---------------------------------------------------
def test_the_only_holder_of_a_stage_lost_restores_the_checkpoint(
    tmp_path: Path, corpus: Path
) -> None:
    """Moved from tests/integration/test_recovery_runtime.py: one replica per stage, the
    west one dies in step 3; its layers survive only in the checkpoint of step 3, which the
    job restores in place on what is left and continues from."""
    fake = FakeWorkers()
    fake.inject("west/stage1/r0", die_at_step=3)
    run = Run(make_doc(corpus, devices=1, steps=5, every=1), tmp_path / "run", fake).go()
    (rec,) = run.events("recovered")
    assert rec["source"] == "checkpoint" and rec["step"] == 3 and rec["lost_steps"] == 0
    assert rec["restored_from"]["step"] == 3
    assert set(run.ctl.plan.stage_sites) == {"east"}
    assert latest_complete(tmp_path / "run" / "checkpoints").step == 5
    assert_exact(run, 5)


def test_losing_every_device_is_a_clear_error_and_keeps_the_checkpoint(
    tmp_path: Path, corpus: Path
) -> None:
    """Moved from tests/integration/test_recovery_runtime.py."""
    fake = FakeWorkers()
    fake.inject("east/stage0/r0", die_at_step=2)
    fake.inject("west/stage1/r0", die_at_step=2)
    run = Run(make_doc(corpus, devices=1, steps=4, every=1), tmp_path / "run", fake)
    with pytest.raises(LaunchError, match="unrecoverable"):
        run.go()
    assert run.ctl.state.name == "failed" and run.status()["state"] == "failed"
    info = latest_complete(tmp_path / "run" / "checkpoints")
    assert info is not None and info.step == 2  # the newest complete one survives, verified


def test_chaos_kills_an_actor_mid_step_and_the_run_recovers(tmp_path: Path, corpus: Path) -> None:
    """``--chaos-kill-every 2``: a timer kills a random actor 40 % into step 2 (through the
    seam); the step fails and the run recovers in place without losing a step. (Should a
    loaded machine delay the timer past the step, the kill lands in step 3 instead.)"""
    fake = FakeWorkers(step_s=0.25)
    run = Run(make_doc(corpus, steps=4, every=0), tmp_path / "run", fake, chaos_kill_every=2)
    run.go()
    (kill,) = run.events("chaos_kill")
    (failure,) = run.events("failure")
    assert kill["step"] == 2 and failure["step"] in (2, 3) and len(fake.killed) >= 1
    assert failure["dead"] == [fake.killed[0]]
    assert run.events("recovered")[0]["lost_steps"] == 0
    assert_exact(run, 4)


def test_measured_speeds_reach_the_plan_but_not_the_config_hash(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a launch measures before planning (injected here instead of timing torch) is
    what it plans with (the plan event's ``planned_with``); the config hash every
    checkpoint records stays the YAML's, however fast the machine measured."""
    import geopipe.runtime.control.controller as controller
    from geopipe.optimizer.measurements import DeviceSpeed, Measurements

    hashes = set()
    for eff in (0.2, 0.9):
        measured = Measurements(devices={s: DeviceSpeed(eff, 2.0) for s in ("east", "west")})
        monkeypatch.setattr(controller, "measure_before_planning", lambda *_, m=measured: m)
        run = Run(make_doc(corpus, steps=2, every=2), tmp_path / f"r{eff}").go()
        (plan,) = run.events("plan")
        assert Measurements.from_dict(plan["planned_with"]) == measured
        ckpt = load_checkpoint(tmp_path / f"r{eff}" / "checkpoints" / "step-00000002")
        assert ckpt.manifest["config_hash"] == plan["config_hash"]
        hashes.add(plan["config_hash"])
    assert len(hashes) == 1
