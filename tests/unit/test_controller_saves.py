"""Checkpoint coordination against the in-process fake worker group (tests/unit/fakes.py):
saves a frozen or wedged writer cannot finish, per-site copies, and resuming -- each run
checked for exactness as in test_controller_states (:func:`assert_exact`: the final state
is that of the same number of uninterrupted steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geopipe.checkpoint.store import latest_complete, list_checkpoints, load_checkpoint
from geopipe.runtime.control.cluster import LaunchError
from geopipe.runtime.control.health import ShardsUnwritten
from geopipe.runtime.storage.sitestore import SiteStore
from tests.unit._controller_runs import (
    LAYERS,
    Run,
    assert_exact,
    ckpt_params,
    make_doc,
)
from tests.unit.fakes import FakeWorkers, reference_state


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
    """Moved from the integration tier (test_checkpoint_runtime, then test_ckpt_faults):
    the resume verifies the newest checkpoint, skips it (a console line and an event
    naming the bad file) and continues exactly from the one before."""
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
    (skip,) = run.events("checkpoint_skipped")
    assert skip["file"] == "stage-1.safetensors" and "checksum" in skip["reason"]
    assert skip["path"].endswith("step-00000003")


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
