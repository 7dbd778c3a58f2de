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

import copy
import json
from pathlib import Path

import pytest
import yaml

from geopipe.checkpoint.store import latest_complete, list_checkpoints, load_checkpoint
from geopipe.config import HealthSpec, parse_cluster
from geopipe.runtime.control.cluster import LaunchError
from geopipe.runtime.control.controller import Controller, LaunchOptions
from geopipe.runtime.control.health import ShardsUnwritten
from geopipe.runtime.control.workers import WorkerFailed
from geopipe.runtime.storage.sitestore import SiteStore
from tests.unit.fakes import FakeWorkers, reference_losses, reference_state

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


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"line {i} of a small corpus for the fake\n" for i in range(2000)))
    return path


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


def test_a_wedged_writer_met_at_a_grow_back_is_recovered_from(tmp_path: Path, corpus: Path) -> None:
    """As above, but a survivor's writer never finishes its shard of step 4: the grow-back
    at 6 first needs that save, waits ``hang_floor_uncalibrated_s``, drops it (step 2 stays
    the newest complete checkpoint) and recovers without the writer (Growing -> Recovering)
    instead of ending the run. The writer was the only holder of its stage left, so the run
    goes on from checkpoint 2 and saves step 4 again."""
    fake = FakeWorkers()
    fake.inject("east/stage0/r1", die_at_step=2, hold_until_step=4)
    fake.inject("west/stage1/r0", block_save=4)
    doc = make_doc(corpus, steps=8, every=2)
    root = tmp_path / "run" / "checkpoints"
    run, exc, newest = _wedged(doc, fake, tmp_path / "run", lambda: root)
    assert exc.step == 4 and exc.names == ["west/stage1/r0"] and newest == 2
    path = run.path()
    i = path.index("growing 6")
    assert path[i + 1 : i + 3] == ["recovering 6", "running 2"]
    assert "geopipe/fk2/west/stage1/r0" in fake.killed
    assert [e["step"] for e in run.events("checkpoint")] == [2, 4, 6, 8]
    assert_exact(run, 8)


# -- saves that cannot finish ------------------------------------------------------------------
def test_a_frozen_writer_blocks_the_save_until_killed_then_a_survivor_stands_in(
    tmp_path: Path, corpus: Path
) -> None:
    """Stage 0's writer freezes while its shard of step 2 is being written: the save cannot
    commit and the next step cannot finish. The heartbeat finds it; recovery kills it, and
    only then can the save settle: its partner (which gathered the same state) writes the
    shard instead, the step-2 checkpoint commits with the right state, and training goes
    on from the survivors without losing a step."""
    fake = FakeWorkers()
    fake.inject("east/stage0/r0", freeze_in_save=2)
    run = Run(make_doc(corpus, steps=4, every=2), tmp_path / "run", fake).go()
    (failure,) = run.events("failure")
    assert failure["dead"] == ["geopipe/fk2/east/stage0/r0"] and "heartbeat" in failure["error"]
    assert [e["stage"] for e in run.events("checkpoint_stand_in")] == [0]
    assert [e["step"] for e in run.events("checkpoint")] == [2, 4]
    kinds = [x.get("event") for x in run.lines() if x.get("event")]
    assert kinds.index("checkpoint_stand_in") < kinds.index("recovered")
    ref = reference_state(LAYERS, 2, 0)
    assert ckpt_params(tmp_path / "run" / "checkpoints" / "step-00000002") == {
        n: v[0] for n, v in ref.items()
    }
    assert run.events("recovered")[0]["lost_steps"] == 0
    assert_exact(run, 4)


def test_a_save_no_one_can_finish_is_abandoned_after_settle_s(tmp_path: Path, corpus: Path) -> None:
    """A writer whose shard write never ends (it answers pings) and a death in the next
    step: the recovery waits ``settle_s`` for the save, abandons it, and the previous
    checkpoint stays the newest complete one."""
    fake = FakeWorkers()
    fake.inject("west/stage1/r0", block_save=4)
    fake.inject("east/stage0/r1", die_at_step=4)
    run = Run(make_doc(corpus, steps=6, every=2), tmp_path / "run", fake).go()
    assert [e["step"] for e in run.events("checkpoint_abandoned")] == [4]
    (rec,) = run.events("recovered")
    assert rec["step"] == 4 and rec["lost_steps"] == 0
    steps = [(i.step, i.status) for i in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert (2, "complete") in steps and (6, "complete") in steps and 4 not in dict(steps)
    assert_exact(run, 6)


def _watch_unwritten(run: Run, root_of: object) -> list:
    """Record each :class:`ShardsUnwritten` the coordinator's ``poll`` raises, with what
    ``latest_complete`` says under ``root_of()`` at that moment."""
    seen, poll = [], run.ctl.checkpoints.poll
    copies = run.ctl.checkpoints.copies
    inner = copies.poll if copies is not None else None

    def record(exc: ShardsUnwritten) -> None:
        info = latest_complete(root_of(), on_skip=lambda p, r: None)
        seen.append((exc, info.step if info is not None else None))

    def watched(*args, **kw):
        try:
            return poll(*args, **kw)
        except ShardsUnwritten as exc:
            record(exc)
            raise

    def watched_copies(*args, **kw):
        try:
            return inner(*args, **kw)
        except ShardsUnwritten as exc:
            record(exc)
            raise

    run.ctl.checkpoints.poll = watched
    if copies is not None:
        copies.poll = watched_copies
    return seen


def _wedged(doc: dict, fake: FakeWorkers, run_dir: Path, root_of: object) -> tuple:
    """``doc`` run to its end with the shard-write bound tiny (0.2 s), the one
    :class:`ShardsUnwritten` it meets watched (:func:`_watch_unwritten`): the run, the
    error, and the newest complete checkpoint when it was raised."""
    run = Run(doc, run_dir, fake, health={"hang_floor_uncalibrated_s": 0.2})
    seen = _watch_unwritten(run, root_of)
    run.go()
    ((exc, newest),) = seen
    return run, exc, newest


@pytest.mark.parametrize("per_site", [False, True])
def test_a_save_a_wedged_writer_blocks_is_cut_short_and_recovered_from(
    tmp_path: Path, corpus: Path, per_site: bool
) -> None:
    """West stage 1's writer never finishes its shard of step 4 (it answers pings: a writer
    thread wedged in a gather) and nothing else fails. The next save waits for it only
    ``hang_floor_uncalibrated_s`` (tiny here; without a bound the fake's wait raises
    FakeHang), then raises ShardsUnwritten naming that actor; nothing of step 4 is
    committed, step 2 stays the newest complete checkpoint, and the controller's recovery
    kills the writer and goes on from the survivors without losing a step. With per-site
    copies the same holds for each site's store."""
    fake = FakeWorkers()
    fake.inject("west/stage1/r0", block_save=4)
    doc = make_doc(corpus, steps=8, every=2)
    if per_site:
        doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ck-{site}")
        root = tmp_path / "ck-east"
    else:
        root = tmp_path / "run" / "checkpoints"
    run, exc, newest = _wedged(doc, fake, tmp_path / "run", lambda: root)
    assert exc.step == 4 and exc.names == ["west/stage1/r0"] and newest == 2
    (failure,) = run.events("failure")
    assert failure["dead"] == ["geopipe/fk2/west/stage1/r0"]
    assert "checkpoint step 4" in failure["error"] and "not written" in failure["error"]
    assert fake.killed[0] == "geopipe/fk2/west/stage1/r0"
    assert "recovering 6" in run.path()
    assert run.events("recovered")[0]["lost_steps"] == 0
    assert [e["step"] for e in run.events("checkpoint")] == [2, 8]
    steps = [(i.step, i.status) for i in list_checkpoints(root)]
    assert steps == [(2, "complete"), (8, "complete")]
    assert_exact(run, 8)


def test_the_last_save_a_wedged_writer_blocks_is_saved_again_after_recovery(
    tmp_path: Path, corpus: Path
) -> None:
    """The run's last save (step 4) cannot commit: its writer never finishes. The driver
    waits ``hang_floor_uncalibrated_s``, drops it (step 2 stays the newest complete
    checkpoint), recovers without the writer and saves step 4 again on the new layout."""
    fake = FakeWorkers()
    fake.inject("east/stage0/r0", block_save=4)
    doc = make_doc(corpus, steps=4, every=2)
    root = tmp_path / "run" / "checkpoints"
    run, exc, newest = _wedged(doc, fake, tmp_path / "run", lambda: root)
    assert exc.step == 4 and exc.names == ["east/stage0/r0"] and newest == 2
    path = run.path()
    i = path.index("recovering 4")
    assert path[i - 1] == "checkpointing 4" and path[-2:] == ["checkpointing 4", "finished"]
    assert [e["step"] for e in run.events("checkpoint")] == [2, 4]
    steps = [(i.step, i.status) for i in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert steps == [(2, "complete"), (4, "complete")]
    assert_exact(run, 4)


# -- per-site copies and resume ----------------------------------------------------------------
def test_per_site_copies_commit_on_every_site_and_resume_from_them(
    tmp_path: Path, corpus: Path
) -> None:
    """With ``{site}`` in the checkpoint directory each site's store (the real SiteStore on
    a real directory) pulls every shard and commits its own verified copy; a second launch
    resumes from them and ends exactly where one uninterrupted run would."""
    doc = make_doc(corpus, steps=4, every=2)
    doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ck-{site}")
    first = Run(doc, tmp_path / "run").go()
    saved = first.events("checkpoint")
    assert [e["step"] for e in saved] == [2, 4]
    assert all(set(e["copies"]) == {"east", "west"} and not e["failed_copies"] for e in saved)
    ref = reference_state(LAYERS, 4, 0)
    for site in ("east", "west"):
        assert ckpt_params(tmp_path / f"ck-{site}" / "step-00000004") == {
            n: v[0] for n, v in ref.items()
        }
    assert first.fake.live(SiteStore) == []  # close() stopped the stores too
    doc["training"]["steps"] = 6
    second = Run(doc, tmp_path / "run", resume=True).go()
    assert second.ctl.start_step == 4
    assert second.path()[:3] == ["planning", "launching", "running 4"]
    (resumed,) = second.events("resumed")
    assert resumed["step"] == 4
    assert second.final["params"] == {n: v[0] for n, v in reference_state(LAYERS, 6, 0).items()}


def test_a_site_directory_that_cannot_be_made_is_a_clear_error(
    tmp_path: Path, corpus: Path
) -> None:
    """Moved from tests/integration/test_checkpoint_runtime.py: per-site directories under
    a regular file cannot be made; the launch stops naming the field and the site, and no
    checkpoint store of the run is left alive (they start together)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should go")
    doc = make_doc(corpus, devices=1)
    doc["training"]["checkpoint"]["dir"] = str(blocker / "{site}")
    run = Run(doc, tmp_path / "run")
    with pytest.raises(LaunchError, match=r"training\.checkpoint\.dir: site (east|west) "):
        run.go()
    assert len(run.fake.actors) == 2 + 2 and run.fake.live(SiteStore) == []


# -- resuming ----------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path: Path, corpus: Path) -> tuple[dict, Path]:
    """A run of 3 steps with a checkpoint after each (1 device per site)."""
    doc = make_doc(corpus, devices=1, steps=3, every=1)
    Run(doc, tmp_path / "run").go()
    return doc, tmp_path / "run"


def test_a_corrupt_newest_checkpoint_is_skipped_on_resume(saved: tuple[dict, Path]) -> None:
    """Moved from tests/integration/test_checkpoint_runtime.py."""
    doc, run_dir = saved
    shard = run_dir / "checkpoints" / "step-00000003" / "stage-1.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    doc["training"]["steps"] = 4
    run = Run(doc, run_dir, resume=True).go()
    assert run.ctl.start_step == 2 and len(run.ctl._result.steps) == 2
    skipped = run.ctl.skipped_checkpoints
    assert skipped and "step-00000003" in skipped[0][0] and "checksum" in skipped[0][1]
    assert run.final["params"] == {n: v[0] for n, v in reference_state(LAYERS, 4, 0).items()}


def test_resuming_on_other_data_is_a_clear_error(saved: tuple[dict, Path], tmp_path: Path) -> None:
    """Moved from tests/integration/test_checkpoint_runtime.py: the manifest records the
    digest of the bytes the actors read; a resume on data that reads differently is refused
    at launch, naming both digests' prefixes and the path."""
    doc, run_dir = saved
    digest = load_checkpoint(run_dir / "checkpoints" / "step-00000003").manifest["data"]["digest"]
    assert len(digest) == 64
    other = tmp_path / "other.txt"
    other.write_text("a different corpus\n" * 200)
    doc["training"]["data"] = str(other)
    with pytest.raises(LaunchError) as err:
        Run(doc, run_dir, resume=True).go()
    message = str(err.value)
    assert f"checkpoint was trained on data with sha256 {digest[:12]}" in message
    assert str(other) in message and "now reads as" in message
    assert f"now reads as {digest[:12]}" not in message


def test_the_checkpoints_command_lists_each_status(
    saved: tuple[dict, Path], capsys: pytest.CaptureFixture
) -> None:
    """Moved from tests/integration/test_checkpoint_runtime.py (it ran the command in a
    subprocess on a real run's checkpoints; the fake writes the same files)."""
    from geopipe.cli import main

    _, run_dir = saved
    bad = run_dir / "checkpoints" / "step-00000002" / "stage-0.safetensors"
    bad.write_bytes(bad.read_bytes()[:-10])
    assert main(["checkpoints", str(run_dir), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[1]["status"] == rows[3]["status"] == "complete"
    assert rows[2]["status"] == "corrupt" and "stage-0.safetensors" in rows[2]["reason"]


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
