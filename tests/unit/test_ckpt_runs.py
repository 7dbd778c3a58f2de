"""Checkpoint faults through the whole driver (the fake worker group, real files; issue 33,
item 6): a recovery skips a checkpoint corrupted after its commit, in both storage modes;
per-site copies short of what ``replicate`` promises show in status.json, ``geopipe
status`` and the final line; ``--resume`` follows the lineage of the last launch in the run
directory and refuses a checkpoint written under other training settings unless named."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from geopipe.checkpoint.store import list_checkpoints
from geopipe.cli.render import format_status, replication_lines
from geopipe.runtime.control.cluster import LaunchError
from tests.unit._controller_runs import LAYERS, Run, assert_exact, make_doc
from tests.unit.fakes import FakeWorkers, reference_state


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def corrupt_when_saved(run: Run, step: int, dirs: list[Path]) -> None:
    """Flip a byte of stage 1's shard of ``step`` in each of ``dirs`` as soon as the
    checkpoint is committed (the manifest stays as it was)."""
    event = run.ctl.reporter.event
    done: list[int] = []

    def hooked(kind: str, **fields) -> None:
        event(kind, **fields)
        if kind == "checkpoint" and fields["step"] == step and not done:
            done.append(step)  # once: after the recovery the step is saved again
            for d in dirs:
                flip(d / f"step-{step:08d}" / "stage-1.safetensors")

    run.ctl.reporter.event = hooked


@pytest.mark.parametrize("mode", ["shared", "per-site"])
def test_a_recovery_skips_a_checkpoint_corrupted_after_its_commit(
    tmp_path: Path, corpus: Path, mode: str
) -> None:
    """One replica per stage; west's dies in step 3, so its layers survive only in the
    checkpoints. Step 3's was damaged on disk after it committed: the recovery verifies it,
    says so (console, a ``checkpoint_skipped`` event naming the file) and restores step 2,
    and the run still ends exactly where an undisturbed one does."""
    fake = FakeWorkers()
    fake.inject("west/stage1/r0", die_at_step=3)
    doc = make_doc(corpus, devices=1, steps=5, every=1)
    dirs = [tmp_path / "run" / "checkpoints"]
    if mode == "per-site":
        doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ck-{site}")
        dirs = [tmp_path / "ck-east", tmp_path / "ck-west"]
    run = Run(doc, tmp_path / "run", fake)
    corrupt_when_saved(run, 3, dirs)
    run.go()
    (rec,) = run.events("recovered")
    assert rec["source"] == "checkpoint" and rec["restored_from"]["step"] == 2
    assert rec["lost_steps"] == 1
    skipped = run.events("checkpoint_skipped")
    assert skipped and all(e["file"] == "stage-1.safetensors" for e in skipped)
    assert all("step-00000003" in e["path"] and "checksum" in e["reason"] for e in skipped)
    if mode == "per-site":  # every live site's copy was checked, each said once
        assert {e["site"] for e in skipped} <= {"east", "west"} and len(skipped) == len(
            {e["site"] for e in skipped}
        )
    assert_exact(run, 5)


def test_copies_short_of_replicate_show_in_status_and_the_final_line(
    tmp_path: Path, corpus: Path
) -> None:
    """west's store fails every save: each checkpoint commits on east only. status.json
    counts the short saves and names west as behind; `geopipe status` and the launch's
    final lines say so."""
    fake = FakeWorkers()
    fake.inject("west/checkpoints", raise_on={"save": "No space left on device"})
    doc = make_doc(corpus, steps=4, every=2)
    doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ck-{site}")
    run = Run(doc, tmp_path / "run", fake).go()
    assert [sorted(e["copies"]) for e in run.events("checkpoint")] == [["east"], ["east"]]
    rep = run.status()["replication"]
    assert rep["short_saves"] == 2 and rep["promised"] == 2
    assert rep["behind"] == {"west": None} and rep["newest_step"] == 4
    assert "No space left" in rep["last_short"]["failed"]["west"]
    assert run.events("replication_short")
    text = format_status(run.status(), "finished")
    assert "site west         behind: no copy, newest checkpoint step 4" in text
    assert "replication short: 2 save(s) committed fewer than 2 copies" in text
    assert replication_lines(run.ctl.reporter.replication)  # the launch's final lines
    assert [i.step for i in list_checkpoints(tmp_path / "ck-west")] == []


def test_a_full_replication_shows_nothing(tmp_path: Path, corpus: Path) -> None:
    doc = make_doc(corpus, steps=2, every=2)
    doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ck-{site}")
    run = Run(doc, tmp_path / "run").go()
    rep = run.status()["replication"]
    assert rep["behind"] == {} and rep["short_saves"] == 0
    text = format_status(run.status(), "finished")
    assert replication_lines(rep) == [] and "behind" not in text and "short" not in text


# -- --resume follows the lineage ---------------------------------------------------------------
def test_resume_continues_the_last_launchs_lineage(tmp_path: Path, corpus: Path) -> None:
    """A writes steps 1..3. B resumes from A's step 1 in the same run directory and dies
    before its first save. ``--resume`` continues B: from A's step 1 (B's lineage), not A's
    step 3, the newest checkpoint in the directory -- and ends where an undisturbed run
    does."""
    doc = make_doc(corpus, devices=1, steps=3, every=1)
    run_dir = tmp_path / "run"
    a = Run(doc, run_dir).go()
    ck = run_dir / "checkpoints"
    assert [i.step for i in list_checkpoints(ck)] == [1, 2, 3]
    b = Run(doc, run_dir, resume=str(ck / "step-00000001"))
    try:
        b.ctl.launch()  # planned and launched: status.json names B and its lineage
    finally:
        b.ctl.close()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["run_id"] == b.ctl.run_id
    assert status["lineage"] == {a.ctl.run_id: 1, b.ctl.run_id: None}
    doc["training"]["steps"] = 4
    c = Run(doc, run_dir, resume=True).go()
    assert c.ctl.start_step == 1
    assert c.ctl.lineage == {a.ctl.run_id: 1, c.ctl.run_id: None}  # B wrote nothing
    assert c.final["params"] == {n: v[0] for n, v in reference_state(LAYERS, 4, 0).items()}


def test_resume_falls_back_to_the_plan_event_for_older_status_files(
    tmp_path: Path, corpus: Path
) -> None:
    doc = make_doc(corpus, devices=1, steps=2, every=1)
    run_dir = tmp_path / "run"
    Run(doc, run_dir).go()
    b = Run(doc, run_dir, resume=str(run_dir / "checkpoints" / "step-00000001"))
    try:
        b.ctl.launch()
    finally:
        b.ctl.close()
    status = json.loads((run_dir / "status.json").read_text())
    del status["lineage"]  # written before status.json recorded it
    (run_dir / "status.json").write_text(json.dumps(status))
    c = Run(doc, run_dir, resume=True).go()
    assert c.ctl.start_step == 1  # B's lineage, from its plan event in metrics.jsonl


def test_resume_refuses_other_training_settings_unless_named(tmp_path: Path, corpus: Path) -> None:
    """The YAML's optimizer settings changed since the checkpoint was written: ``--resume``
    refuses it (exit 2 through LaunchError), naming both runs and how to take it anyway;
    ``--resume PATH`` takes it. A longer ``training.steps`` is no such change."""
    doc = make_doc(corpus, devices=1, steps=2, every=1)
    run_dir = tmp_path / "run"
    a = Run(doc, run_dir).go()
    newest = run_dir / "checkpoints" / "step-00000002"
    doc["training"]["lr"] = doc["training"].get("lr", 3e-4) * 2
    refused = Run(doc, run_dir, resume=True)
    with pytest.raises(LaunchError) as err:
        refused.go()
    msg = str(err.value)
    assert msg.startswith("--resume: step-00000002 was written by run " + a.ctl.run_id)
    assert f"(run {refused.ctl.run_id}," in msg and f"--resume {newest}" in msg
    assert refused.path() == ["planning", "planning"] and refused.fake.actors == []
    named = Run(doc, run_dir, resume=str(newest)).go()
    assert named.ctl.start_step == 2


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("mode", ["shared", "per-site"])
def test_a_second_run_never_restores_the_first_runs_checkpoints(
    tmp_path: Path, corpus: Path, mode: str
) -> None:
    """Moved from the integration tier (the driver's logic; the real shard writes and
    resumes stay there): run B, launched without --resume where run A's checkpoints of
    steps 2 and 4 are (a shared directory; per-site directories, each site's store moving
    them on its own), moves them aside intact; losing its only holder of stage 1 in step 3,
    its recovery restores B's own step 2, never A's newer step 4, and B's state is that of
    4 uninterrupted steps."""
    a = Run(make_doc(corpus, devices=1, steps=4, every=2), tmp_path / "A").go()
    a_id, a_ckpts = a.ctl.run_id, tmp_path / "A" / "checkpoints"
    assert [(i.step, i.run_id) for i in list_checkpoints(a_ckpts)] == [(2, a_id), (4, a_id)]
    doc = make_doc(corpus, devices=1, steps=4, every=2)
    run_dir = tmp_path / "R"
    if mode == "shared":
        roots = [run_dir / "checkpoints"]
    else:
        doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ck-{site}")
        roots = [tmp_path / f"ck-{s}" for s in ("east", "west")]
    for root in roots:  # A's checkpoints are where B will write its own
        shutil.copytree(a_ckpts, root)
    before = _digests(a_ckpts)
    fake = FakeWorkers()
    fake.inject("west/stage1/r0", die_at_step=3)
    b = Run(doc, run_dir, fake).go()
    b_id = b.ctl.run_id
    assert b_id != a_id
    moved = b.events("checkpoints_moved_aside")
    assert sorted(e["path"] for e in moved) == sorted(
        str(r.with_name(f"{r.name}.prev-{a_id}")) for r in roots
    )
    saved: dict[int, str] = {}
    for root in roots:
        assert _digests(root.with_name(f"{root.name}.prev-{a_id}")) == before  # intact
        got = {i.step: i.run_id for i in list_checkpoints(root)}
        saved.update(got)
        assert got.get(2) == b_id and set(got.values()) == {b_id}
    assert saved == {2: b_id, 4: b_id}
    (rec,) = b.events("recovered")
    assert rec["source"] == "checkpoint" and rec["step"] == 2 and rec["failed_step"] == 3
    for path in rec["restored_from"]["paths"].values():
        assert list_checkpoints(Path(path).parent)[0].run_id == b_id
        assert Path(path).parent in roots
    assert b.status()["run_id"] == b_id
    assert_exact(b, 4)
