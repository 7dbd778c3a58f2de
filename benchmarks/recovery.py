"""Recovery vs restart, on the emulated cluster with ZeRO-1 groups of 2.

One run of the embedded default (2 pipelines × 2 stages, each stage's two replicas a ZeRO-1
group inside its site). A replica is killed in the middle of step K:

* ``recovery_s``: from the kill to the first completed step after it — the controller
  re-forms the job in place on the survivors (boundary snapshots in memory) and continues;
* ``restart_s``: the alternative in the same run — stop everything (actors and Ray), start
  again and resume from the latest checkpoint, until the first step completes;
* ``lost_steps``: optimizer steps that had to be redone (0: the failed step restarts from
  the step boundary, no step is lost), and the losses before and after the failure next to
  an uninterrupted run's.

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


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    import ray

    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text()))
    doc["training"]["checkpoint"] = {"every_steps": 2, "keep": 10}
    spec = parse_cluster(doc, "recovery")
    tmp = Path(tempfile.mkdtemp(prefix="geopipe-recovery-"))

    # 1. The chaos run: one replica killed in the middle of step KILL_STEP.
    ctl = Controller(
        spec,
        LaunchOptions(steps=STEPS, run_dir=str(tmp / "chaos"), progress=False,
                      chaos_kill_every=KILL_STEP),
    )  # fmt: skip
    try:
        ctl.launch()
        ctl.train()
    finally:
        ctl.close()
    lines = metrics(tmp / "chaos")
    kill = next(x for x in lines if x.get("event") == "chaos_kill")
    rec = next(x for x in lines if x.get("event") == "recovered")
    steps = [x for x in lines if "event" not in x]
    after = next(x for x in steps if x["completed_at"] > kill["time"])
    recovery_s = after["completed_at"] - kill["time"]

    # 2. The alternative: stop everything, restart from the latest checkpoint.
    ray_was_up = ray.is_initialized()
    t0 = time.time()
    if ray_was_up:
        ray.shutdown()
    # The newest checkpoint a restart at the time of the failure would have found.
    before = [
        x["step"] for x in lines if x.get("event") == "checkpoint" and x["step"] <= kill["step"]
    ]
    path = tmp / "chaos" / "checkpoints" / f"step-{max(before):08d}"
    ctl2 = Controller(
        spec,
        LaunchOptions(steps=rec["failed_step"] + 1, run_dir=str(tmp / "restart"),
                      progress=False, resume=str(path)),
    )  # fmt: skip
    try:
        ctl2.launch()
        ctl2.train()
    finally:
        ctl2.close()
    restart_s = time.time() - t0
    restart_from = ctl2.start_step

    # 3. Reference losses: the same run without a failure.
    ref = Controller(spec, LaunchOptions(steps=STEPS, run_dir=str(tmp / "ref"), progress=False))
    try:
        ref.launch()
        ref.train()
    finally:
        ref.close()
    ref_losses = [x["loss"] for x in metrics(tmp / "ref") if "event" not in x]
    chaos_losses = [x["loss"] for x in steps]
    k = rec["failed_step"]
    result = {
        "recovery_s": recovery_s,
        "recovery_controller_s": rec["seconds"],
        "restart_s": restart_s,
        "restart_over_recovery": restart_s / recovery_s,
        "restart_resumed_from_step": restart_from,
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
    print(
        f"killed a replica in step {k}: back to training in {recovery_s:.1f} s "
        f"(controller {rec['seconds']:.1f} s), lost steps {rec['lost_steps']}; restart from "
        f"checkpoint step {restart_from} takes {restart_s:.1f} s "
        f"({result['restart_over_recovery']:.1f}x longer)"
    )
    print(f"state moved to the new layout (bytes per path): {rec['moved']}")
    print(
        f"loss: step {k - 1} {result['loss_before']:.4f}, step {k} {result['loss_after']:.4f} "
        f"(uninterrupted {result['reference_loss_after']:.4f}); worst deviation over the run "
        f"{result['max_loss_deviation']:.2%}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
