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

* ``replication_stall_ratio``: time per step with per-site directories and every
  checkpoint replicated to both sites, over the same with one shared directory: on the
  same actors, cycles of (save, N steps, wait for the save) alternating between the two
  kinds, the median of each per-site cycle over the shared one beside it; N = 20 (the
  demo's own interval), and N = 2 beside it (``replication_stall_ratio_every_2``, a stress
  case);
* ``site_loss_lost_steps`` / ``site_loss_resume_s``: a real two-node Ray cluster (one
  raylet per site, ``ray.cluster_utils``), per-site directories; the west node is removed
  in the middle of a step and its directory deleted. Lost steps (≤ ``checkpoint_every_steps``)
  and the time from the removal to the first completed step after it.

Run: ``.venv/bin/python benchmarks/recovery.py``. Prints ratios and one JSON line.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from _common import ROOT

from geopipe.config import parse_cluster
from geopipe.plan import Plan
from geopipe.runtime.control.controller import Controller, LaunchOptions

KILL_STEP = 4
STEPS = 8
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


# (checkpoint interval in steps, cycles per kind of save): the demo's own interval (its
# YAML: every 20 steps), and a stress case where the interval (~1 s here) is about the time
# replicating a checkpoint over half the emulated link takes.
STALL_CASES = ((20, 8), (2, 12))


def replication_stall(tmp: Path) -> dict:
    """Per-site replicated checkpoints against one shared directory, on the same actors.

    One run (per-site directories) whose controller also gets a shared-directory
    coordinator over the same actors. A cycle is what training sees with a checkpoint every
    ``n`` steps: save, ``n`` steps, and the wait for the save to complete (which the next
    save would otherwise do). Cycles alternate between the two kinds of save, so load drift
    on this shared machine — which moves whole runs by tens of percent — hits both alike;
    the median ratio of neighbouring cycles is reported."""
    import statistics

    from geopipe.runtime.control.checkpointing import CheckpointCoordinator

    doc = demo_doc()
    doc["training"]["checkpoint"] = {"every_steps": 0, "keep": 2}
    shared_spec = parse_cluster(doc, "stall")
    doc["training"]["checkpoint"]["dir"] = str(tmp / "stall-ckpt-{site}")
    opts = LaunchOptions(steps=2, run_dir=str(tmp / "stall"), progress=False)
    ctl = Controller(parse_cluster(doc, "stall"), opts)
    out: dict = {}
    try:
        ctl.launch()
        ctl.train()  # two steps (calibration) and the final per-site save
        shared = CheckpointCoordinator(
            shared_spec, tmp / "stall", ctl.reporter, ctl._rows, ctl._manifest, workers=ctl.workers
        )
        coords = {"per_site": ctl.checkpoints, "shared": shared}
        step = 2
        for every, cycles in STALL_CASES:
            times: dict[str, list[float]] = {"shared": [], "per_site": []}
            for i in range(2 * cycles):
                name = ("per_site", "shared")[i % 2]
                t0 = time.perf_counter()
                coords[name].save(step)
                for _ in range(every):
                    ctl.run_step(step)
                    step += 1
                    coords[name].poll()
                coords[name].poll(wait=True)
                times[name].append((time.perf_counter() - t0) / every)
            # Each per-site cycle against the shared one right after it: load drift on this
            # machine moves whole minutes by tens of percent, neighbours alike.
            pairs = sorted(
                p / q - 1 for p, q in zip(times["per_site"], times["shared"], strict=True)
            )
            q1, _, q3 = statistics.quantiles(pairs, n=4)
            out[every] = {
                "ratio": statistics.median(pairs),
                "pair_ratio_iqr": [q1, q3],
                "step_s_median": {k: statistics.median(v) for k, v in times.items()},
                "step_s": times,
            }
        saves = [x for x in metrics(tmp / "stall") if x.get("event") == "checkpoint"]
        replicated = [x for x in saves if set(x.get("copies", {})) == {"east", "west"}]
        assert len(replicated) == 1 + sum(c for _, c in STALL_CASES)
    finally:
        ctl.close()
    every = STALL_CASES[0][0]
    return {
        "replication_stall_ratio": out[every]["ratio"],
        "replication_stall_every_steps": every,
        "replication_stall_ratio_every_2": out[2]["ratio"],
        "replication_stall_detail": out,
        "checkpoint_bytes": max(x["bytes"] for x in replicated),
        "replication_seconds_median": statistics.median(x["seconds"] for x in replicated[1:]),
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
    doc["training"]["checkpoint"] = {
        "every_steps": EVERY,
        "keep": 3,
        "dir": str(tmp / "loss-ckpt-{site}"),
    }
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


HETERO_STEPS = 6
HETERO_KILL = 3


def hetero_doc() -> dict:
    """2 sites × 4 devices and the 8-layer demo GPT (the planner runs 2 × (2 east, 2 west))."""
    doc = demo_doc()
    doc["name"] = "hetero"
    for s in doc["sites"]:
        s["devices_per_node"] = 4
    doc["model"]["n_layer"] = 8
    doc["training"].update(steps=HETERO_STEPS)
    doc["training"]["checkpoint"] = {"every_steps": 0, "keep": 1}
    # No lossy codec: the losses are compared with the single-process run.
    doc["links"][0]["codec"] = "none"
    doc["plan"]["codecs"] = ["none"]
    return doc


def reference_losses(spec, seq_len: int) -> list[float]:
    """The uninterrupted run in one process (same model, samples, Adam, LR schedule; the
    gradient is the mean over the global batch whatever the micro-batch size)."""
    from functools import partial

    import torch

    from geopipe.model.data import Corpus, TokenStream, sample_indices
    from geopipe.model.family import build_stage
    from geopipe.model.gpt import lm_loss
    from geopipe.runtime.actor.lr import lr_factor
    from geopipe.runtime.control.models import model_desc

    m, t = spec.model, spec.training
    desc = model_desc(m)
    model = build_stage(desc, 0, desc.num_layers, seed=t.seed)
    opt = torch.optim.Adam(model.parameters(), lr=t.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, partial(lr_factor, warmup_steps=t.warmup_steps, total_steps=t.steps)
    )
    stream = TokenStream(Corpus(t.data, max_bytes=t.data_max_bytes), t.seed)
    b, seq = 1, seq_len
    n = t.global_batch_size // b
    out = []
    for step in range(t.steps):
        opt.zero_grad()
        total = 0.0
        for i in range(n):
            x, y = stream.batch(sample_indices(step, t.global_batch_size, i, b), seq)
            loss = lm_loss(model(x), y)
            (loss / n).backward()
            total += loss.item()
        opt.step()
        sched.step()
        out.append(total / n)
    return out


def hetero_patterns(ctl: Controller) -> dict:
    """Predicted step time after losing devices of 2 × 4: the layout recovery chooses (a
    mix where it is ≥ 2 % faster) against the best identical pipelines, from the runtime's
    own (profiled) cost model and templates — what its recovery decides by."""
    from geopipe.optimizer.mixes import uniform_time
    from geopipe.optimizer.policies import best_layout

    plan, ts = ctl.plan, ctl.recovery.templates
    gb, b = ctl.spec.training.global_batch_size, plan.micro_batch_size
    before_s = ctl.predicted.iteration_time_s
    out = {}
    for lost_e, lost_w in ((1, 0), (0, 1), (2, 0), (1, 1), (0, 2)):
        alive = {"east": 4 - lost_e, "west": 4 - lost_w}
        uni = uniform_time(ts, alive, gb, b)
        choice = best_layout(ts, alive, gb, b, running=plan)
        out[(lost_e, lost_w)] = {
            "uniform_s": uni,
            "chosen_s": choice[2],
            "mixed": choice[1].heterogeneous,
            "layout": choice[1].describe(),
            "gain": uni / choice[2],
            "retained": before_s / choice[2],
            "retained_uniform": before_s / uni,
        }
    return out


def hetero_run(tmp: Path, name: str, lost: tuple[int, int]) -> tuple[dict, dict]:
    """Launch 2 × 4, kill ``lost`` = (east, west) replicas 40 % into step HETERO_KILL (as
    --chaos-kill-every kills), train on; the predictions and the run's figures."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    spec = parse_cluster(hetero_doc(), "hetero")
    run_dir, killed_at = tmp / name, []
    ctl = Controller(spec, LaunchOptions(run_dir=str(run_dir), progress=False))
    try:
        ctl.launch()
        patterns = hetero_patterns(ctl)
        plan = ctl.plan
        assert plan.pipelines > 1 and plan.stage_sites == ("east",) * 2 + ("west",) * 2
        rows = ctl.actors  # pipeline 1's east stages 0, 1 and west stages 3, 2
        victims = [rows[0][1], rows[1][1]][: lost[0]] + [rows[3][1], rows[2][1]][: lost[1]]

        def kill() -> None:
            done: list = []
            while len(done) < HETERO_KILL:
                time.sleep(0.01)
                if (run_dir / "metrics.jsonl").exists():
                    done = [x for x in metrics(run_dir) if "event" not in x]
            time.sleep(0.4 * done[-1]["iteration_time_s"])
            killed_at.append(time.time())
            for v in victims:
                ray.kill(v, no_restart=True)

        threading.Thread(target=kill, daemon=True).start()
        ctl.train()
    finally:
        ctl.close()
    ref = reference_losses(spec, plan.seq_len)
    lines = metrics(run_dir)
    rec = next(x for x in lines if x.get("event") == "recovered")
    steps = {x["step"]: x for x in lines if "event" not in x}
    losses = [steps[k]["loss"] for k in sorted(steps)]
    after = min(x["completed_at"] for x in steps.values() if x["completed_at"] > killed_at[0])
    return patterns, {
        "plan_before": plan.describe(),
        "plan_after": Plan.from_dict(rec["plan"]).describe(),
        "recovery_s": after - killed_at[0],  # the kill to the first completed step after it
        "recovery_controller_s": rec["seconds"],
        "lost_steps": rec["lost_steps"],
        "replaced_stuck": rec["replaced_stuck"],
        "max_loss_deviation": max(abs(a - r) for a, r in zip(losses, ref, strict=True)),
        "losses": losses,
        "reference_losses": ref,
    }


def hetero(tmp: Path) -> dict:
    """Mixed pipelines after a failure on 2 × 4: retained throughput after losing one device
    (mix vs identical pipelines); one lost east device run for real (the different-template
    mix), and the pattern with the largest predicted gain run for real too."""
    patterns, one = hetero_run(tmp, "hetero-1", (1, 0))
    singles = [patterns[(1, 0)], patterns[(0, 1)]]
    top = max(patterns, key=lambda k: patterns[k]["gain"])
    runs = {"lose 1 east": one}
    if top != (1, 0):
        runs[f"lose {top[0]} east + {top[1]} west"] = hetero_run(tmp, "hetero-top", top)[1]
    return {
        "retained_throughput_1_of_8": min(p["retained"] for p in singles),
        "retained_throughput_uniform_1_of_8": min(p["retained_uniform"] for p in singles),
        "hetero_gain": patterns[(1, 0)]["gain"],
        "hetero_pattern": "lose 1 east",
        "hetero_gain_max": patterns[top]["gain"],
        "hetero_gain_max_pattern": f"lose {top[0]} east + {top[1]} west",
        "hetero_recovery_s": max(r["recovery_s"] for r in runs.values()),
        "hetero_lost_steps": max(r["lost_steps"] for r in runs.values()),
        "hetero_max_loss_deviation": max(r["max_loss_deviation"] for r in runs.values()),
        "hetero_patterns": {f"lose {e} east + {w} west": p for (e, w), p in patterns.items()},
        "hetero_runs": runs,
    }


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="geopipe-recovery-"))
    if "--outage" in sys.argv:  # the test bed (root): a 15 s WAN cut, waited out
        from outage import measure

        print(json.dumps(measure(15.0)))
        return
    if "--hetero-only" in sys.argv:
        _report_hetero(hetero(tmp))
        return
    if "--replication-only" in sys.argv:
        stall = replication_stall(tmp)
        print(json.dumps({k: v for k, v in stall.items() if k != "replication_stall_detail"}))
        return
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
    for every, d in stall["replication_stall_detail"].items():
        print(
            f"replicating a {stall['checkpoint_bytes'] / 1e6:.1f} MB checkpoint to both sites "
            f"every {every} steps: median {d['step_s_median']['per_site'] * 1e3:.0f} ms/step vs "
            f"{d['step_s_median']['shared'] * 1e3:.0f} ms with one shared directory: "
            f"{d['ratio']:+.1%} (median of paired cycles; interquartile range "
            f"{d['pair_ratio_iqr'][0]:+.1%} … {d['pair_ratio_iqr'][1]:+.1%})"
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
    het = hetero(tmp)
    result.update(het)
    _report_hetero(het, result)


def _report_hetero(het: dict, result: dict | None = None) -> None:
    for name, p in het["hetero_patterns"].items():
        print(
            f"{name}: {p['layout']} predicted {p['chosen_s'] * 1e3:.0f} ms/step, identical "
            f"pipelines {p['uniform_s'] * 1e3:.0f} ms: gain {p['gain']:.3f}, retained "
            f"throughput {p['retained']:.3f} (identical pipelines {p['retained_uniform']:.3f})"
        )
    for name, r in het["hetero_runs"].items():
        print(
            f"{name} for real: {r['plan_before']} -> {r['plan_after']}, training again "
            f"{r['recovery_s']:.1f} s after the kill (controller {r['recovery_controller_s']:.1f}"
            f" s), lost steps {r['lost_steps']}, worst loss deviation from the uninterrupted "
            f"run {r['max_loss_deviation']:.1e}"
        )
    print(json.dumps(result if result is not None else het))


if __name__ == "__main__":
    main()
