"""Real training across two emulated sites: 1F1B vs look-ahead vs the zero-latency ideal.

One stage per site, 64 micro-batches per iteration, a WAN link whose one-way latency
exceeds the compute of one micro-batch. In one process (one embedded Ray):

* ``1f1b``: plain 1F1B over the WAN link;
* ``lookahead``: the look-ahead schedule with the planner's ΔN over the same link;
* ``ideal``: 1F1B over a zero-latency link.

Measured iteration time = median over the steps after calibration (step 0 measures the
stages; step 1 is the first with the re-chosen ΔN). Prints ratios and one JSON line.

Run: ``.venv/bin/python benchmarks/wan_overlap.py [--steps N] [--latency-ms L]``
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
from pathlib import Path

import yaml

from geopipe.config import parse_cluster
from geopipe.runtime.controller import Controller, LaunchOptions

ROOT = Path(__file__).resolve().parents[1]


def make_spec(latency_ms: float, bandwidth_gbps: float, m: int, codec: str = "none"):
    doc = yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["name"] = "wan-overlap"
    for s in doc["sites"]:
        s["devices_per_node"] = 1
    doc["links"][0].update(latency_ms=latency_ms, bandwidth_gbps=bandwidth_gbps, codec=codec)
    doc["training"].update(global_batch_size=m, warmup_steps=0)
    doc["training"]["checkpoint"] = {"every_steps": 0, "keep": 1}
    doc["plan"].update(
        pipelines=1, micro_batch_size=1, seq_len=128, codecs=[codec],
        delta_n={"min": 0, "max": 32},
    )  # fmt: skip
    return parse_cluster(doc, "wan-overlap")


def run(spec, schedule: str, steps: int, run_dir: Path) -> dict:
    ctl = Controller(
        spec, LaunchOptions(steps=steps, schedule=schedule, run_dir=str(run_dir), progress=False)
    )
    try:
        ctl.launch()
        res = ctl.train()
        times = [m.iteration_time_s for m in res.steps[2:]]
        bubbles = [m.bubble_ratio for m in res.steps[2:]]
        cal = [
            json.loads(line)
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"calibrated"' in line
        ][-1]
        return {
            "iteration_time_s": statistics.median(times),
            "bubble_ratio": statistics.median(bubbles),
            "predicted_iteration_time_s": ctl.predicted_s,
            "delta_n": [ctl.plan.delta_n[j] for j in ctl.plan.wan_boundaries],
            "compute_per_mb_s": cal["forward_s"][0] + cal["backward_s"][0],
            "losses": [m.loss for m in res.steps],
        }
    finally:
        _stop_actors(ctl)  # keep the embedded Ray for the next setting


def _stop_actors(ctl: Controller) -> None:
    import ray

    for row in ctl.actors:
        for a in row:
            ray.kill(a)
    ctl.actors = []
    if ctl.sink is not None:
        ctl.sink.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--latency-ms", type=float, default=60.0)
    ap.add_argument("--bandwidth-gbps", type=float, default=1.0)
    ap.add_argument("--micro-batches", type=int, default=64)
    args = ap.parse_args()
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="geopipe-wan-"))
    wan = make_spec(args.latency_ms, args.bandwidth_gbps, args.micro_batches)
    ideal = make_spec(0.0, 10.0, args.micro_batches)
    out: dict[str, dict] = {}
    try:
        for name, spec, sched in (
            ("1f1b", wan, "1f1b"),
            ("lookahead", wan, "lookahead"),
            ("ideal", ideal, "1f1b"),
        ):
            out[name] = run(spec, sched, args.steps, tmp / name)
            r = out[name]
            print(
                f"{name:>9}: {r['iteration_time_s']:.3f} s/step measured, "
                f"{r['predicted_iteration_time_s']:.3f} s predicted, bubble "
                f"{r['bubble_ratio']:.1%}, ΔN {r['delta_n']}, compute/mb "
                f"{r['compute_per_mb_s'] * 1e3:.1f} ms"
            )
    finally:
        if ray.is_initialized():
            ray.shutdown()
    rtt = 2 * args.latency_ms / 1e3
    bound = out["ideal"]["iteration_time_s"] + rtt
    la, one = out["lookahead"], out["1f1b"]
    errors = {
        k: abs(v["predicted_iteration_time_s"] / v["iteration_time_s"] - 1) for k, v in out.items()
    }
    result = {
        "iteration_time_s": {k: v["iteration_time_s"] for k, v in out.items()},
        "bubble_ratio": {k: v["bubble_ratio"] for k, v in out.items()},
        "predicted_iteration_time_s": {k: v["predicted_iteration_time_s"] for k, v in out.items()},
        "bubble_reduction": 1 - la["bubble_ratio"] / one["bubble_ratio"],
        "lookahead_over_bound": la["iteration_time_s"] / bound - 1,
        "speedup_vs_1f1b": one["iteration_time_s"] / la["iteration_time_s"],
        "max_prediction_error": max(errors.values()),
        "prediction_error": errors,
        "delta_n": la["delta_n"],
        "micro_batches": args.micro_batches,
        "latency_ms": args.latency_ms,
        "compute_per_mb_ms": 1e3 * statistics.mean(v["compute_per_mb_s"] for v in out.values()),
        "final_loss": {k: v["losses"][-1] for k, v in out.items()},
    }
    print(
        f"bound = ideal + RTT = {bound:.3f} s; look-ahead {result['lookahead_over_bound']:+.1%} "
        f"over it; bubble {one['bubble_ratio']:.1%} -> {la['bubble_ratio']:.1%} "
        f"({result['bubble_reduction']:.1%} less); speed-up {result['speedup_vs_1f1b']:.2f}x; "
        f"worst prediction error {result['max_prediction_error']:.1%}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
