"""Recovery without restarting the job, with real Ray and DeepSpeed: a replica killed in the
middle of an iteration, a frozen one, a survivor stuck in a collective, a writer killed
mid-save, a mix of pipelines growing back — each checked against an uninterrupted run.

The recovery logic without Ray's processes and DeepSpeed's numerics (the only holder of a
stage restoring the checkpoint, every device lost, a death during a recovery, outages) is
tested against the fake worker group in tests/unit/test_controller_states.py and
test_controller_saves.py."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from _procs import process_alive
from _state import taken_names
from test_runtime import reference, tiny_doc

from geopipe.checkpoint.store import load_checkpoint, load_state_for_layers
from geopipe.config import HealthSpec, parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("event") == kind]


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "event" not in x]


def last_loss_per_step(run_dir: Path) -> list[float]:
    """Per step, the loss of its last run (steps redone after a rollback appear twice)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {x["step"]: x["loss"] for x in lines if "event" not in x}
    return [by_step[k] for k in sorted(by_step)]


def run(
    doc: dict,
    run_dir: Path,
    steps: int,
    chaos: int | None = None,
    kill=None,
    health: HealthSpec | None = None,
):
    opts = LaunchOptions(steps=steps, run_dir=str(run_dir), progress=False, chaos_kill_every=chaos)
    if health is not None:
        opts.health = health
    ctl = Controller(parse_cluster(doc, "t"), opts)
    try:
        ctl.launch()
        if kill is not None:
            threading.Thread(target=kill, args=(ctl,), daemon=True).start()
        ctl.train()
        # Every replica's own full state (collective per ZeRO-1 group, and a mix's groups
        # span rows: all asked at once).
        refs = [[a.full_state.remote() for a in row] for row in ctl.actors]
        ctl.replica_states = [ray.get(row) for row in refs]
        ctl.kept_boundaries = ray.get([a.boundary_steps.remote() for a in ctl.flat_actors()])
        return ctl, ctl.gather_state()
    finally:
        ctl.close()
        # close() returns once Ray has freed every name the run took (the next test's
        # launch takes them again).
        assert not taken_names(set(ctl.names)), "actor names left taken"


def test_replica_killed_mid_iteration_recovers_in_place(tmp_path, capsys):
    """ZeRO-1 groups of 2; a replica dies during step 2. The job re-forms on the survivors
    from their step-2 boundary snapshot (no step lost), the global batch is preserved, so the
    losses match an uninterrupted run up to float summation order (measured ~1e-6; bound
    1e-4 with codec none)."""
    doc = tiny_doc(2, 2, steps=4)
    # 8 micro-batches per pipeline: the kill, 40 % into step 2, lands well after the step-2
    # boundary snapshot is assembled in the background (with 2, under load, it could land
    # first, and the survivors would rightly roll back to step 1)
    doc["training"]["global_batch_size"] = 32
    ref = reference(doc)[0]  # the uninterrupted run, in one process
    ctl, state = run(doc, tmp_path / "chaos", steps=4, chaos=2)  # kills once, in step 2
    failure = events(tmp_path / "chaos", "failure")
    recovered = events(tmp_path / "chaos", "recovered")
    # The kill is a timer 40 % into the predicted step 2: on a loaded host step 2 can end
    # first, and the kill then fails step 3 (recovered from the step-3 boundary instead).
    (kill,) = events(tmp_path / "chaos", "chaos_kill")
    failed = failure[0]["step"]
    assert kill["step"] == 2 and failed in (2, 3)
    assert len(failure) == 1 and len(failure[0]["dead"]) == 1
    assert recovered[0]["lost_steps"] == 0 and recovered[0]["source"] == "surviving replicas"
    # 3 survivors re-form as 1 pipeline × 3 stages; each new stage is a subset of what its
    # actor held before, so nothing moves — unless the timing left a survivor stuck in the
    # all-reduce with the dead one's partner: then its replacement loads its layers from
    # its site peer over torch.distributed. Never through the object store here.
    assert recovered[0]["plan"]["partition"] == [[0, 2], [2, 3], [3, 4]]
    moved = recovered[0]["moved"]
    assert moved["object_store_bytes"] == 0
    assert (moved["p2p_bytes"] > 0) == bool(recovered[0]["replaced_stuck"])
    got = losses(tmp_path / "chaos")
    assert len(got) == 4
    assert got == pytest.approx(ref, abs=1e-4)
    assert ctl.plan.pipelines * ctl.plan.num_stages <= 3  # one device is gone
    assert state["step"] == 4
    # `geopipe status` shows the recovery and the actors that run now, not the dead one.
    status = json.loads((tmp_path / "chaos" / "status.json").read_text())
    names = [n for st in status["stages"] for n in st["actors"]]
    assert len(names) == 3 and failure[0]["dead"][0] not in names
    assert [r["failed_step"] for r in status["recoveries"]] == [failed]
    from geopipe.cli import main

    assert main(["status", str(tmp_path / "chaos")]) == 0
    assert f"recovered in place 1 time(s); last: step {failed} failed" in capsys.readouterr().out


def events_ready(run_dir: Path) -> bool:
    """At least two steps done (so a checkpoint exists) before the kill."""
    path = run_dir / "metrics.jsonl"
    return path.exists() and sum('"event"' not in x for x in path.read_text().splitlines()) >= 2


def test_frozen_actor_is_caught_by_heartbeat_and_replaced(tmp_path):
    """A stage process that stops answering (SIGSTOP: as a hung host or a partitioned node
    looks from the controller) raises no actor error; the heartbeat finds it, the job
    re-forms on the others without losing a step, and the frozen process is gone after."""
    import os
    import signal

    doc = tiny_doc(2, 2, steps=6)
    frozen: list[int] = []

    def freeze(ctl: Controller) -> None:
        run_dir = tmp_path / "frozen"
        while ctl.state.name != "running" or not events_ready(run_dir):
            time.sleep(0.05)
        pid = ray.get(ctl.actors[1][1].ping.remote())
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)

    ref = reference(doc)[0]
    try:
        # A short unanswered-ping limit (production: 10 s) keeps the test quick; the
        # mechanism is the same.
        health = HealthSpec(heartbeat_s=0.5, unresponsive_s=3.0)
        _, state = run(doc, tmp_path / "frozen", steps=6, kill=freeze, health=health)
        failure = events(tmp_path / "frozen", "failure")
        assert len(failure) == 1 and "heartbeat" in failure[0]["error"]
        assert len(failure[0]["dead"]) == 1 and failure[0]["dead"][0].endswith("stage1/r1")
        recovered = events(tmp_path / "frozen", "recovered")
        # Frozen mid-gather, the stage's newest boundary is incomplete and the one before it
        # is used: at most the step in flight and the one before are redone.
        assert recovered[0]["lost_steps"] <= 1 and recovered[0]["source"] == "surviving replicas"
        assert last_loss_per_step(tmp_path / "frozen") == pytest.approx(ref, abs=1e-4)
        assert state["step"] == 6
        # Ray SIGKILLs the stopped worker 1 s after the kill (RAY_SYSTEM_CONFIG); a loaded
        # host can take longer to reap it
        deadline = time.time() + 60
        while time.time() < deadline and process_alive(frozen[0]):
            time.sleep(0.2)
        assert not process_alive(frozen[0]), "the frozen stage process outlived the recovery"
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_survivor_stuck_in_a_collective_is_replaced(tmp_path):
    """Stage 0 replica 1 stalls before its last send of step 2 and then dies. Meanwhile its
    pipeline's stage-1 replica waits for that activation, so stage 1 replica 0 — which got
    everything — sits in the ZeRO-1 gradient all-reduce with a partner that will never
    join. Nothing can release it but its partner's exit (gloo keeps the connection), so the
    controller replaces it with a new actor on the same device, which loads stage 1 from
    its partner over the re-formed intra-site process group. No step is lost."""
    doc = tiny_doc(2, 2, steps=4)

    def fault(ctl: Controller) -> None:
        ray.get(ctl.actors[0][1].inject_fault.remote(2, 3.0))

    ref = reference(doc)[0]
    _, state = run(doc, tmp_path / "stuck", steps=4, kill=fault)
    failure = events(tmp_path / "stuck", "failure")
    assert len(failure) == 1 and failure[0]["dead"][0].endswith("stage0/r1")
    rec = events(tmp_path / "stuck", "recovered")[0]
    assert len(rec["replaced_stuck"]) == 1 and rec["replaced_stuck"][0].endswith("stage1/r0")
    assert rec["lost_steps"] == 0
    assert rec["moved"]["p2p_bytes"] > 0  # the replacement's layers, from its site peer
    assert losses(tmp_path / "stuck") == pytest.approx(ref, abs=1e-4)
    assert state["step"] == 4


def test_without_recovery_snapshots_a_failure_restores_the_checkpoint(tmp_path):
    """training.recovery_snapshots: false (host RAM too small for them): replicas keep no
    state between steps, so a failure restores the latest checkpoint — in place, on the
    survivors — and the run still matches the uninterrupted one."""
    doc = tiny_doc(2, 2, steps=4)
    doc["name"] = "nosnap"
    doc["training"]["recovery_snapshots"] = False
    doc["training"]["checkpoint"] = {"every_steps": 1, "keep": 5}
    ref = reference(doc)[0]
    ctl, state = run(doc, tmp_path / "off", steps=4, chaos=2)
    rec = events(tmp_path / "off", "recovered")
    assert len(rec) == 1 and rec[0]["source"] == "checkpoint"
    # The chaos kill is timed from a thread of the driver: it lands in step 2 or, racing
    # that step's end, in step 3 (as in the fake tier's chaos test). The checkpoint of the
    # failed step if its shards were all written before the kill, else the step before.
    failed, back = rec[0]["failed_step"], rec[0]["step"]
    assert failed in (2, 3), rec[0]
    assert back in (failed - 1, failed) and rec[0]["lost_steps"] == failed - back
    assert last_loss_per_step(tmp_path / "off") == pytest.approx(ref, abs=1e-4)
    assert state["step"] == 4
    assert ctl.kept_boundaries == [[] for _ in ctl.kept_boundaries]  # nothing held over


def test_writer_dying_mid_save_keeps_the_checkpoint(tmp_path):
    """Replica 0 of stage 0 encodes the stage's shard; it is killed while doing so for the
    step-2 checkpoint, with per-site checkpoint directories (no shared file system). Its
    partner gathered the same full state for the save, so it encodes the shard instead,
    both sites' stores pull it and the checkpoint commits on each — identical, tensor for
    tensor, to the one an undisturbed run writes into a shared directory — while training
    recovers from the survivors' snapshots."""
    from geopipe.checkpoint.store import load_checkpoint

    doc = tiny_doc(2, 2, steps=5)
    doc["name"] = "standin"
    doc["training"]["checkpoint"] = {"every_steps": 2, "keep": 5}
    ref_doc = copy.deepcopy(doc)
    doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ckpt-{site}")
    run_dir = tmp_path / "killed"

    def kill_writer(ctl: Controller) -> None:
        victim = ctl.actors[0][0]
        ray.get(victim.inject_fault.remote(-1, -1, write_delay_s=5.0))
        while not (run_dir / "metrics.jsonl").exists() or len(losses(run_dir)) < 2:
            time.sleep(0.02)
        time.sleep(1.0)  # the step-2 save started: inside its 5 s write
        ray.kill(victim, no_restart=True)

    run(ref_doc, tmp_path / "ref", steps=5)
    run(doc, run_dir, steps=5, kill=kill_writer)
    assert [e["stage"] for e in events(run_dir, "checkpoint_stand_in") if e["step"] == 2] == [0]
    saved = next(e for e in events(run_dir, "checkpoint") if e["step"] == 2)
    assert set(saved["copies"]) == {"east", "west"} and not saved["failed_copies"]
    want = load_checkpoint(tmp_path / "ref" / "checkpoints" / "step-00000002")
    for site in ("east", "west"):
        got = load_checkpoint(tmp_path / f"ckpt-{site}" / "step-00000002")  # verifies
        assert set(got.manifest["copies"]) == {"east", "west"}
        for k in (0, 1):
            for prefix in ("params/", "exp_avg/", "exp_avg_sq/"):
                a, b = got.stages[k].tensors(prefix), want.stages[k].tensors(prefix)
                assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert last_loss_per_step(run_dir) == pytest.approx(losses(tmp_path / "ref"), abs=1e-4)


def mixed_doc() -> dict:
    """3 pipelines × (east, west) on 3 devices per site: losing an east device leaves
    2 + 3, where the planner predicts a mix (one pipeline with two west stages, one with
    one; 7 and 5 micro-batches) faster than any identical pipelines."""
    doc = tiny_doc(3, 3, steps=10)
    doc["model"].update(n_layer=4, n_embd=64)
    doc["links"][0]["latency_ms"] = 1.0
    doc["training"]["global_batch_size"] = 24
    doc["training"]["checkpoint"] = {"every_steps": 2, "keep": 4}
    return doc


def test_mixed_pipelines_after_a_failure_checkpoint_then_grow_back(tmp_path):
    """A replica dies in step 2 (or 3) and its device stays taken (a placeholder actor holds
    it, as if its node were gone): the survivors re-form as a mix of two templates (the west
    site's layers cut differently by the two pipelines, so its three actors share one
    ZeRO-1 group holding the union of their layers), the micro-batches split 7 : 5 by
    speed. The mix saves the step-4 checkpoint (shards of its pipeline 0, every layer once,
    exactly the state the run went on from); then the device is freed and at the next
    checkpoint boundary it is seen free (6, or 8 if Ray released it late) the job grows
    back through the same relayout. Every step's
    loss equals the uninterrupted run's (same samples, order of reduction aside)."""
    doc = mixed_doc()
    ref = reference(doc)[0]
    run_dir = tmp_path / "mix"
    holder: list = []

    @ray.remote(num_cpus=0, resources={"site:east": 1})
    class Placeholder:
        def ping(self) -> int:
            return 1

    def fault(ctl: Controller) -> None:
        victim = ctl.actors[0][1]  # an east replica of stage 0, killed in step 2 or 3
        while not (run_dir / "metrics.jsonl").exists() or len(losses(run_dir)) < 2:
            time.sleep(0.01)
        ray.kill(victim, no_restart=True)
        while not events(run_dir, "failure"):
            time.sleep(0.05)
        holder.append(Placeholder.remote())  # takes the dead actor's device
        ray.get(holder[0].ping.remote())
        while not any(e["step"] == 4 for e in events(run_dir, "checkpoint")):
            time.sleep(0.1)
        ray.kill(holder[0])  # the device is back (for the step-6 or step-8 boundary)

    try:
        ctl, state = run(doc, run_dir, steps=10, kill=fault)
    finally:
        for h in holder:
            ray.kill(h)
    rec = events(run_dir, "recovered")[0]
    # 0, unless the failure cut the background gather of the newest boundary short (its
    # partner died mid-gather): then the one before is used and a step is redone.
    assert rec["failed_step"] in (2, 3)
    assert rec["lost_steps"] <= 1 and rec["source"] == "surviving replicas"
    mix = rec["plan"]["mix"]
    assert [p["stage_sites"] for p in mix] == [["east", "west", "west"], ["east", "west"]]
    assert [p["num_microbatches"] for p in mix] == [7, 5]
    assert last_loss_per_step(run_dir) == pytest.approx(ref, abs=1e-4)
    assert state["step"] == 10
    grown = events(run_dir, "grown")
    assert grown and grown[0]["step"] in (6, 8) and not grown[0]["plan"].get("mix")
    assert ctl.plan.pipelines * ctl.plan.num_stages == 6  # 3 × (east, west) again
    # The new actor loaded its layers from a holder in its own site, over torch.distributed
    # (never through the object store: every layer has a holder in its site).
    assert grown[0]["moved"]["p2p_bytes"] > 0 and grown[0]["moved"]["object_store_bytes"] == 0
    for states in ctl.replica_states:  # the replicas of each stage hold identical parameters
        for name, t in states[0]["params"].items():
            assert all(torch.equal(t, other["params"][name]) for other in states[1:]), name
    # The checkpoint the mix wrote holds every parameter once, and exactly the state the
    # run went on from: the full model loaded from it gives step 4's recorded loss.
    ckpt = load_checkpoint(run_dir / "checkpoints" / "step-00000004")
    assert ckpt.manifest["plan"].get("mix")
    assert step_loss_from(ckpt, doc, 4) == pytest.approx(last_loss_per_step(run_dir)[4], abs=1e-5)


def step_loss_from(ckpt, doc: dict, step: int) -> float:
    """The mean loss of ``step``'s global batch under the checkpoint's parameters."""
    from geopipe.model.data import Corpus, TokenStream, sample_indices
    from geopipe.model.family import build_stage
    from geopipe.model.gpt import lm_loss
    from geopipe.runtime.control.models import model_desc

    spec = parse_cluster(doc, "ref")
    m, t, b = spec.model, spec.training, spec.plan.micro_batch_size
    desc = model_desc(m)
    model = build_stage(desc, 0, desc.num_layers, seed=t.seed)
    names = [n for n, _ in model.named_parameters()]
    params = load_state_for_layers(ckpt, names)["params"]
    assert set(params) == set(names)  # every parameter, from exactly one shard
    model.load_state_dict(params)
    stream = TokenStream(Corpus(t.data, max_bytes=t.data_max_bytes), t.seed)
    n = t.global_batch_size // b
    with torch.no_grad():
        losses = [
            lm_loss(model(x), y).item()
            for x, y in (
                stream.batch(sample_indices(step, t.global_batch_size, i, b), spec.plan.seq_len)
                for i in range(n)
            )
        ]
    return sum(losses) / n
