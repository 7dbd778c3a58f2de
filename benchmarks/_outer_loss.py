"""The emulated-link half of benchmarks/outer_loop.py: the outer loop's loss gap at equal tokens
through geopipe's own runtime, and a site lost mid-round.

Loss gap: the job of :mod:`_outer_runs` trained by ``geopipe launch``'s controller on the
embedded Ray. Synchronous training is one group on the whole global batch (one site, one
device: the numerics every synchronous layout gives, geopipe's layout independence), seeds 0
to N - 1 (their largest relative difference is the noise). The outer loop is two groups, one per
emulated site (a 1 Gbit/s, 5 ms link: the link moves no number, only the time); with F = 1,
after the last round (the step count a multiple of every H) each group's weights are
θ_global bit for bit (the rounds' digests say so), and with F > 1 θ_global is read from the
final checkpoint as ``geopipe export`` reads it. The measure is outer_penalty.py's: the
final weights' held-out loss, ``rel_gap = loss_outer(seed s) / loss_sync(seed s) - 1``,
averaged over the seeds a setting runs at (one job run at 600 steps lands ~1-2 % apart from
one seed to the next: a bound of 1.5 % needs the mean of several).

Site loss: a real two-node Ray cluster (``ray.cluster_utils.Cluster``, one raylet per
site), two groups, a checkpoint every round; the west node is removed in the middle of a
round, once with one checkpoint directory the sites share and once with a directory per
site (west's deleted with its node). Where the survivors go on (M - 1 groups), the lost
steps are the recovery event's; where the run fails, the error is the result.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _outer_bed import brief_error  # noqa: E402
from _outer_runs import MICRO_BATCH, held_out_loss, job_doc, metrics, outer_doc  # noqa: E402

FAST_LINK = {"latency_ms": 5.0, "rate_mbit": 1000.0}


def _train(doc: dict, run_dir: Path) -> tuple[dict, list[float], dict]:
    """Train ``doc``; group 0's final parameters (by name), the losses, and ``rounds`` (the
    round events) with ``end_error``: an error after the last step (a failed final save),
    which leaves the trained weights to measure."""
    from geopipe.config import parse_cluster
    from geopipe.runtime.control.controller import Controller, LaunchOptions

    spec = parse_cluster(doc, doc["name"])
    steps = doc["training"]["steps"]
    ctl = Controller(spec, LaunchOptions(steps=steps, run_dir=str(run_dir), progress=False))
    end_error = None
    try:
        ctl.launch()
        try:
            ctl.train()
        except Exception as exc:  # kept only if every step ran (a failure in the final save)
            end_error = exc
        lines, events = metrics(run_dir)
        if end_error is not None and len(lines) < steps:
            raise end_error
        row = ctl.placement.rows[0]  # pipeline 0 (of group 0): its stages' full states
        states = ctl.workers.get([ctl.workers.call(a, "full_state") for a in row])
    finally:
        ctl.close()
    params: dict = {}
    for s in states:
        params.update(s["params"])
    if doc["plan"].get("strategy") == "outer":  # theta_global, as `geopipe export` writes it
        params = _theta_global(run_dir) or params
    info = {"rounds": [e for e in events if e["event"] == "outer_round"]}
    if end_error is not None:
        info["end_error"] = brief_error(end_error)
    return params, [x["loss"] for x in lines], info


def _theta_global(run_dir: Path) -> dict | None:
    """theta_global by parameter name from the run's newest checkpoint (the final save, after
    the last round), read as ``geopipe export`` reads it; None if the run saved none. With
    F = 1 it equals every group's final weights (the rounds' digests say so); with F > 1 a
    group's weights hold each fragment's drift since its last apply, theta_global does not,
    and theta_global is what a user exports."""
    from geopipe.checkpoint.store import latest_complete, load_checkpoint

    found = latest_complete(run_dir / "checkpoints")
    if found is None:
        return None
    ckpt = load_checkpoint(found.path)
    params: dict = {}
    for shard in ckpt.stages:
        params.update(shard.tensors("params/"))
    return params


def loss_gaps(
    steps: int, settings: list[dict], tmp: Path, say, seeds: int = 2, reuse: dict | None = None
) -> dict:
    """Sync at seeds 0..``seeds``-1, then every outer ``settings`` entry (plan.outer's keys,
    the ``names`` the row keeps, and ``seeds``: how many of the sync seeds it runs at, 1 if
    it does not say); H must divide ``steps`` (the run ends on a round). ``reuse``: the loss
    part of an earlier run (``--loss-reuse``): a sync seed or an outer (setting, seed) it
    measured at the same ``steps`` is taken from it instead of trained again (every run is
    bit-reproducible, so this changes no figure, only the ~4 minutes a run takes).

    A row's ``rel_gap`` is the mean over its seeds of the paired gap ``loss_outer(seed s) /
    loss_sync(seed s) - 1`` (same initial weights, same data order: what differs is the
    outer loop and the chaos of 600 steps), each seed's gap beside it; ``sync_noise`` is the
    largest relative difference between two sync seeds (what one run's gap must exceed to
    mean anything)."""
    out: dict = {"steps": steps, "sync": {}, "outer": []}
    old = _reusable(reuse, steps)
    for seed in range(max(2, seeds)):
        if seed in old["sync"]:
            out["sync"][seed] = old["sync"][seed]
            say(f"sync seed {seed}: held-out {out['sync'][seed]:.4f} (reused)")
            continue
        doc = job_doc(f"sync-s{seed}", steps, sites=("east",), seed=seed)
        doc["plan"].update(micro_batch_size=MICRO_BATCH, calibrate=False)
        t0 = time.monotonic()
        params, _, _ = _train(doc, tmp / f"sync{seed}")
        out["sync"][seed] = held_out_loss(params, doc["model"])
        say(f"sync seed {seed}: held-out {out['sync'][seed]:.4f} ({time.monotonic() - t0:.0f} s)")
    sync = list(out["sync"].values())
    out["sync_noise"] = max(abs(x - y) / min(x, y) for x in sync for y in sync)
    for o in settings:
        if steps % o["h"]:
            raise ValueError(f"loss settings need H dividing --steps: {o}")
        row = dict(o)
        row["per_seed"] = [
            old["outer"].get((_key(o), seed))
            or _outer_seed(o, seed, steps, out["sync"][seed], tmp, say)
            for seed in range(o.get("seeds", 1))
        ]
        done = [r for r in row["per_seed"] if r.get("rel_gap") is not None]
        if len(done) == len(row["per_seed"]):
            first = done[0]
            row.update(
                loss=first["loss"],
                rel_gap=sum(r["rel_gap"] for r in done) / len(done),
                rounds=first["rounds"],
                digests_equal=all(r["digests_equal"] for r in done),
            )
        else:
            bad = next(r for r in row["per_seed"] if r.get("rel_gap") is None)
            row.update(loss=None, rel_gap=None, why=bad.get("why"), trace=bad.get("trace"))
        ends = [r["end_error"] for r in row["per_seed"] if "end_error" in r]
        if ends:
            row["end_error"] = ends[0]
        out["outer"].append(row)
    return out


def _key(o: dict) -> tuple:
    """An outer setting's identity: what its loss depends on."""
    return (o["h"], o.get("fragments", 1), o.get("overlap", 0), o["codec"], o["lr"], o["momentum"])


def _reusable(reuse: dict | None, steps: int) -> dict:
    """The runs of an earlier loss part that can stand for new ones: its sync losses by
    seed, its outer runs by (setting, seed) that measured a gap; none at other ``steps``."""
    if not reuse or reuse.get("steps") != steps:
        return {"sync": {}, "outer": {}}
    sync = {int(k): float(v) for k, v in reuse.get("sync", {}).items()}
    outer = {
        (_key(row), r["seed"]): r
        for row in reuse.get("outer", [])
        for r in row.get("per_seed", [])
        if r.get("rel_gap") is not None and sync.get(r["seed"]) is not None
    }
    return {"sync": sync, "outer": outer}


def _outer_seed(o: dict, seed: int, steps: int, sync: float, tmp: Path, say) -> dict:
    """One outer run of setting ``o`` at ``seed``: its held-out loss and paired gap."""
    keys = {k: v for k, v in o.items() if k not in ("names", "seeds")}
    doc = outer_doc(f"outer-h{o['h']}", steps, keys, seed=seed, **FAST_LINK)
    doc["plan"].update(micro_batch_size=MICRO_BATCH, calibrate=False)
    t0 = time.monotonic()
    row: dict = {"seed": seed}
    try:
        tag = "-".join(o.get("names") or [f"h{o['h']}-{o['codec']}"])
        params, _losses, info = _train(doc, tmp / f"outer-{tag}-s{seed}")
        rounds = info["rounds"]
        if "end_error" in info:
            row["end_error"] = info["end_error"]
        loss = held_out_loss(params, doc["model"])
        row.update(
            loss=loss,
            rel_gap=loss / sync - 1,
            rounds=len(rounds),
            digests_equal=bool(rounds) and all(r["digests_equal"] for r in rounds),
        )
        say(
            f"outer H={o['h']} F={o.get('fragments', 1)} {o['codec']} lr {o['lr']} momentum "
            f"{o['momentum']} seed {seed}: held-out {loss:.4f}, gap {row['rel_gap']:+.4f} "
            f"({time.monotonic() - t0:.0f} s)"
        )
    except Exception as exc:
        row.update(loss=None, rel_gap=None, why=brief_error(exc))
        row["trace"] = traceback.format_exc().splitlines()[-12:]
        say(f"outer H={o['h']} seed {seed}: failed: {row['why'][:300]}")
    return row


def site_loss(tmp: Path, h: int = 10, steps: int = 40, per_site: bool = True) -> dict:
    """Two groups on a two-node cluster; west's node removed mid-round (``--role siteloss``:
    a process of its own, so its Ray is not the loss runs' embedded one). ``per_site``:
    a checkpoint directory per site (west's deleted with its node), else one shared."""
    import shutil

    import ray
    from ray.cluster_utils import Cluster

    from geopipe.config import parse_cluster
    from geopipe.runtime.control.controller import Controller, LaunchOptions

    outer = {"h": h, "codec": "int8", "lr": 1.0, "momentum": 0.0}
    doc = outer_doc("outer-siteloss", steps, outer, **FAST_LINK)
    doc["plan"].update(micro_batch_size=MICRO_BATCH, calibrate=False)
    tmp.mkdir(parents=True, exist_ok=True)
    where = str(tmp / ("ckpt-{site}" if per_site else "ckpt"))
    doc["training"]["checkpoint"] = {"every_steps": h, "keep": 3, "dir": where}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"site:east": 2}, "include_dashboard": False},
    )
    west = cluster.add_node(num_cpus=2, resources={"site:west": 2})
    doc["ray"] = {"address": cluster.address, "emulate_links": True, "dashboard": False}
    run_dir, removed = tmp / "siteloss", {}
    kill_after = h + h // 2  # steps completed: the middle of the second round

    def remove() -> None:
        path = run_dir / "metrics.jsonl"
        while not path.exists() or len(metrics(run_dir)[0]) < kill_after:
            time.sleep(0.02)
        removed["at"], removed["after_steps"] = time.time(), len(metrics(run_dir)[0])
        cluster.remove_node(west)
        shutil.rmtree(tmp / "ckpt-west", ignore_errors=True)

    threading.Thread(target=remove, daemon=True).start()
    out: dict = {"h": h, "steps": steps, "per_site": per_site, "removed_after_steps": None}
    try:
        ctl = Controller(
            parse_cluster(doc, doc["name"]),
            LaunchOptions(steps=steps, run_dir=str(run_dir), progress=False),
        )
        try:
            ctl.launch()
            res = ctl.train()
            out["completed_steps"] = len(res.steps)
        finally:
            ctl.close()
        _lines, events = metrics(run_dir)
        rec = next((e for e in events if e["event"] == "recovered"), None)
        out["removed_after_steps"] = removed.get("after_steps")
        out["recovered"] = (
            {k: rec.get(k) for k in ("lost_steps", "failed_step", "seconds")} if rec else None
        )
        out["site_loss_lost_steps"] = rec.get("lost_steps") if rec else None
        out["groups_after"] = [e.get("groups") for e in events if e["event"] == "outer_round"][-1:]
        if rec is None:
            out["why"] = "the run finished but recorded no recovery event"
    except Exception as exc:
        out.update(site_loss_lost_steps=None, why=brief_error(exc))
        out["trace"] = traceback.format_exc().splitlines()[-8:]
        out["removed_after_steps"] = removed.get("after_steps")
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def site_loss_role(tmp: str) -> None:
    """Both checkpoint layouts: one directory shared by the sites, one per site."""
    out = {
        "shared": site_loss(Path(tmp) / "shared", per_site=False),
        "per_site": site_loss(Path(tmp) / "per-site", per_site=True),
    }
    print("RESULT " + json.dumps(out), flush=True)
