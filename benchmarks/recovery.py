"""Recovery vs restart, on the emulated cluster with ZeRO-1 groups of 2; losing a whole site;
what replicating checkpoints across sites costs.

One run of the embedded default (2 pipelines × 2 stages, each stage's two replicas a ZeRO-1
group inside its site). A replica is killed in the middle of step K:

* ``recovery_s``: from the kill to the first completed step after it — the controller
  re-forms the job in place on the survivors (boundary snapshots in memory) and continues;
* ``restart_s``: the alternative in the same run — stop everything (actors and Ray), start
  again and resume from the latest checkpoint, until the first step completes;
* ``lost_steps``: optimizer steps that had to be redone (0: the failed step restarts from
  the step boundary, no step is lost), and the losses before and after the failure next to
  an uninterrupted run's.

Checkpoints without a shared file system (``{site}`` in ``training.checkpoint.dir``):

* ``replication_stall_ratio``: wall time per step with per-site directories and every
  checkpoint replicated to both sites, over the same run with one shared directory (same
  fixed plan, a checkpoint every 2 steps; three runs of each, alternating so drift
  cancels; ``shared_runs_spread`` is the noise floor);
* ``site_loss_lost_steps`` / ``site_loss_resume_s``: a real two-node Ray cluster (one
  raylet per site, ``ray.cluster_utils``), per-site directories; the west node is removed
  in the middle of a step and its directory deleted. Lost steps (≤ ``checkpoint_every_steps``)
  and the time from the removal to the first completed step after it.

Run: ``.venv/bin/python benchmarks/recovery.py``. Prints ratios and one JSON line.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from pathlib import Path

import yaml
from _common import ROOT

from geopipe.config import parse_cluster
from geopipe.runtime.controller import Controller, LaunchOptions

KILL_STEP = 4
STEPS = 8
STALL_STEPS = 18  # per run of the replication-stall comparison
EVERY = 2  # checkpoint interval of the site-level measurements


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def demo_doc() -> dict:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text()))
    # No dashboard: its processes steal CPU from the timings, and another Ray on this
    # machine may hold its port.
    doc["ray"]["dashboard"] = False
    return doc


def train(spec, run_dir: Path, **opts) -> Controller:
    ctl = Controller(spec, LaunchOptions(run_dir=str(run_dir), progress=False, **opts))
    try:
        ctl.launch()
        ctl.train()
    finally:
        ctl.close()
    return ctl


def chaos_vs_restart(tmp: Path) -> dict:
    """A replica killed mid-step: in-place recovery, against a restart from a checkpoint."""
    import ray

    doc = demo_doc()
    doc["training"]["checkpoint"] = {"every_steps": 2, "keep": 10}
    spec = parse_cluster(doc, "recovery")
    train(spec, tmp / "chaos", steps=STEPS, chaos_kill_every=KILL_STEP)
    lines = metrics(tmp / "chaos")
    kill = next(x for x in lines if x.get("event") == "chaos_kill")
    rec = next(x for x in lines if x.get("event") == "recovered")
    steps = [x for x in lines if "event" not in x]
    after = next(x for x in steps if x["completed_at"] > kill["time"])
    recovery_s = after["completed_at"] - kill["time"]

    # The alternative: stop everything, restart from the latest checkpoint.
    t0 = time.time()
    if ray.is_initialized():
        ray.shutdown()
    # The newest checkpoint a restart at the time of the failure would have found.
    before = [
        x["step"] for x in lines if x.get("event") == "checkpoint" and x["step"] <= kill["step"]
    ]
    path = tmp / "chaos" / "checkpoints" / f"step-{max(before):08d}"
    ctl2 = train(spec, tmp / "restart", steps=rec["failed_step"] + 1, resume=str(path))
    restart_s = time.time() - t0

    # Reference losses: the same run without a failure.
    train(spec, tmp / "ref", steps=STEPS)
    ref_losses = [x["loss"] for x in metrics(tmp / "ref") if "event" not in x]
    chaos_losses = [x["loss"] for x in steps]
    k = rec["failed_step"]
    return {
        "recovery_s": recovery_s,
        "recovery_controller_s": rec["seconds"],
        "restart_s": restart_s,
        "restart_over_recovery": restart_s / recovery_s,
        "restart_resumed_from_step": ctl2.start_step,
        "lost_steps": rec["lost_steps"],
        "failed_step": k,
        "state_moved_bytes": rec["moved"],
        "new_plan": {key: rec["plan"][key] for key in ("pipelines", "stage_sites", "partition")},
        "loss_before": chaos_losses[k - 1],
        "loss_after": chaos_losses[k],
        "reference_loss_after": ref_losses[k],
        "losses": chaos_losses,
        "reference_losses": ref_losses,
        "max_loss_deviation": max(
            abs(a - b) / b for a, b in zip(chaos_losses, ref_losses, strict=True)
        ),
    }


def wall_per_step(run_dir: Path) -> float:
    """Wall time per step after the two calibration steps, checkpoint saves included."""
    done = [x["completed_at"] for x in metrics(run_dir) if "event" not in x][2:]
    return (done[-1] - done[0]) / (len(done) - 1)


ORDER = ("shared", "per_site", "per_site", "shared", "shared", "per_site")  # drift cancels


def replication_stall(tmp: Path) -> dict:
    """Per-site replicated checkpoints against one shared directory, same fixed plan; runs
    alternate (``ORDER``) so a load drift on this shared machine hits both alike."""
    import ray

    from geopipe.runtime.planning import plan_run

    doc = demo_doc()
    doc["training"]["checkpoint"] = {"every_steps": EVERY, "keep": 2}
    shared = parse_cluster(doc, "stall")
    _, plan, _ = plan_run(shared, None)
    ray.init(address="local", resources={"site:east": 2, "site:west": 2},
             include_dashboard=False, logging_level="WARNING")  # fmt: skip
    times: dict[str, list[float]] = {"shared": [], "per_site": []}
    replicated_bytes = 0
    try:
        for i, name in enumerate(ORDER):
            spec = shared
            if name == "per_site":  # a directory per run: each starts with no checkpoints
                doc["training"]["checkpoint"]["dir"] = str(tmp / f"stall-{i}-ckpt-{{site}}")
                spec = parse_cluster(doc, "stall")
            run_dir = tmp / f"stall-{i}-{name}"
            train(spec, run_dir, steps=STALL_STEPS, plan=plan)
            times[name].append(wall_per_step(run_dir))
            saves = [x for x in metrics(run_dir) if x.get("event") == "checkpoint"]
            if name == "per_site":
                assert all(set(x["copies"]) == {"east", "west"} for x in saves), saves
                replicated_bytes = max(x["bytes"] for x in saves)
    finally:
        ray.shutdown()
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    return {
        "replication_stall_ratio": mean["per_site"] / mean["shared"] - 1,
        # the noise floor: how much two runs of the same setting differ
        "shared_runs_spread": (max(times["shared"]) - min(times["shared"])) / mean["shared"],
        "wall_per_step_s": times,
        "checkpoint_bytes": replicated_bytes,
    }


def site_loss(tmp: Path) -> dict:
    """A two-node cluster, one raylet per site, per-site checkpoint directories: the west
    node is removed mid-step and its directory deleted."""
    import shutil
    import threading

    import ray
    from ray.cluster_utils import Cluster

    doc = demo_doc()
    doc["name"] = "siteloss"
    doc["training"]["checkpoint"] = {"every_steps": EVERY, "keep": 3,
                                     "dir": str(tmp / "loss-ckpt-{site}")}  # fmt: skip
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"site:east": 2}, "include_dashboard": False},
    )
    west = cluster.add_node(num_cpus=2, resources={"site:west": 2})
    doc["ray"] = {"address": cluster.address, "emulate_links": True, "dashboard": False}
    spec = parse_cluster(doc, "siteloss")
    run_dir = tmp / "siteloss"
    removed: dict[str, float] = {}

    def remove() -> None:  # in the middle of step 5 (a checkpoint of step 4 is in flight)
        path = run_dir / "metrics.jsonl"
        while not path.exists() or sum("event" not in x for x in metrics(run_dir)) < 5:
            time.sleep(0.02)
        time.sleep(0.4)
        removed["at"] = time.time()
        cluster.remove_node(west)
        shutil.rmtree(tmp / "loss-ckpt-west", ignore_errors=True)

    threading.Thread(target=remove, daemon=True).start()
    try:
        train(spec, run_dir, steps=STEPS + 2)
    finally:
        ray.shutdown()  # attached, not started here: the controller leaves it up
        cluster.shutdown()
    lines = metrics(run_dir)
    rec = next(x for x in lines if x.get("event") == "recovered")
    after = next(x for x in lines if "event" not in x and x["completed_at"] > removed["at"])
    return {
        "site_loss_lost_steps": rec["lost_steps"],
        "checkpoint_every_steps": EVERY,
        "site_loss_resume_s": after["completed_at"] - removed["at"],
        "site_loss_controller_s": rec["seconds"],
        "site_loss_restored_from": {k: rec["restored_from"][k] for k in ("site", "step")},
        "site_loss_failed_step": rec["failed_step"],
        "site_loss_new_plan": {k: rec["plan"][k] for k in ("pipelines", "stage_sites")},
    }


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="geopipe-recovery-"))
    result = chaos_vs_restart(tmp)
    k = result["failed_step"]
    print(
        f"killed a replica in step {k}: back to training in {result['recovery_s']:.1f} s "
        f"(controller {result['recovery_controller_s']:.1f} s), lost steps "
        f"{result['lost_steps']}; restart from checkpoint step "
        f"{result['restart_resumed_from_step']} takes {result['restart_s']:.1f} s "
        f"({result['restart_over_recovery']:.1f}x longer)"
    )
    print(f"state moved to the new layout (bytes per path): {result['state_moved_bytes']}")
    print(
        f"loss: step {k - 1} {result['loss_before']:.4f}, step {k} {result['loss_after']:.4f} "
        f"(uninterrupted {result['reference_loss_after']:.4f}); worst deviation over the run "
        f"{result['max_loss_deviation']:.2%}"
    )
    stall = replication_stall(tmp)
    result.update(stall)
    print(
        f"replicating checkpoints to both sites (every {EVERY} steps, "
        f"{stall['checkpoint_bytes'] / 1e6:.1f} MB each): wall time per step "
        f"{stall['wall_per_step_s']['per_site']} s vs shared directory "
        f"{stall['wall_per_step_s']['shared']} s: stall ratio "
        f"{stall['replication_stall_ratio']:+.1%} (shared runs differ by "
        f"{stall['shared_runs_spread']:.1%} among themselves)"
    )
    loss = site_loss(tmp)
    result.update(loss)
    print(
        f"west site lost mid step {loss['site_loss_failed_step']}: restored from "
        f"{loss['site_loss_restored_from']['site']}'s copy of step "
        f"{loss['site_loss_restored_from']['step']}, {loss['site_loss_lost_steps']} step(s) "
        f"lost (interval {EVERY}), training again {loss['site_loss_resume_s']:.1f} s after "
        f"the removal (controller {loss['site_loss_controller_s']:.1f} s)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
