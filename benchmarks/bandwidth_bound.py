"""Cross-site training where the WAN's bandwidth binds: what 4-bit transfers buy, and
whether the planner picks the codec that wins.

The test bed (two namespaces joined by the user-space forwarder at 50 Mbit/s, one-way
40 ms; needs root), the demo GPT made so that one boundary message is 1 MiB in fp32
(micro-batch 128 × 64 tokens × hidden 32: a CPU stage computes a micro-batch in ~15-20 ms,
less than int4h's 1 MiB / 7.5 takes on the link, so the link binds for every codec), one
stage per site, look-ahead with the planner's ΔN, m = 32 micro-batches per step:

* ``none``, ``int8``, ``int4h``: the codec fixed (both directions);
* ``planner``: ``plan.codecs: [none, int8, int4h]``, the planner choosing each
  direction's codec from this machine's measured compute and codec speeds.

Each setting's median step time after calibration (steps 0-2 calibrate); its prediction
error is the controller's forecast of each counted step against the step (the forecast
uses the steps before), and ``launch`` the planner's own prediction before the run.

    sudo .venv/bin/python benchmarks/bandwidth_bound.py [--steps 8]

Ends with one JSON line. Run on a quiet machine: step times move with load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

LATENCY_MS, RATE_MBIT, M = 40.0, 50.0, 32
MBS, SEQ, HIDDEN = 128, 64, 32  # one boundary message: 128 × 64 × 32 fp32 = 1 MiB
SETTINGS = {
    "none": ["none"],
    "int8": ["int8"],
    "int4h": ["int4h"],
    "planner": ["none", "int8", "int4h"],
}


def doc_for(name: str, codecs: list[str]) -> dict:
    from _common import two_site_doc

    doc = two_site_doc(f"bw-{name}", LATENCY_MS, RATE_MBIT / 1e3, M, codecs[0], MBS)
    doc["model"] = {
        "n_layer": 2,
        "n_embd": HIDDEN,
        "n_head": 2,
        "vocab_size": 256,
        "max_seq_len": SEQ,
    }
    doc["plan"].update(seq_len=SEQ, codecs=codecs, calibrate=True)
    return doc


def _role(address: str, steps: int, names: list[str]) -> None:
    """Inside east's namespace: attach to the bed's Ray and train each setting in turn."""
    import ray
    from _common import run, spec_of

    from geopipe.runtime.control.calibration import CALIBRATION_STEPS  # steps not counted

    out = {}
    try:
        for name in names:
            doc = doc_for(name, SETTINGS[name])
            doc["ray"].update(address=address, emulate_links=False)
            tmp = Path(tempfile.mkdtemp(prefix="geopipe-bw-"))
            ctl, res, _ = run(spec_of(doc), steps, tmp, "lookahead")
            lines = [json.loads(x) for x in ctl.metrics_path.read_text().splitlines()]
            forecast = {
                x["step"]: x["predicted_iteration_time_s"] for x in lines if "event" not in x
            }
            counted = res.steps[CALIBRATION_STEPS:]
            out[name] = {
                "time_s": statistics.median(s.iteration_time_s for s in counted),
                "prediction_error": statistics.median(
                    abs(forecast[s.step] / s.iteration_time_s - 1) for s in counted
                ),
                "launch_predicted_s": forecast[0],
                "codecs": [ctl.plan.codecs[j] for j in ctl.plan.wan_boundaries],
                "delta_n": [ctl.plan.delta_n[j] for j in ctl.plan.wan_boundaries],
                "wan_mb_per_step": statistics.median(s.wan_bytes for s in counted) / 1e6,
                "losses": [round(s.loss, 4) for s in res.steps],
                "load": round(os.getloadavg()[0], 2),
            }
            r = out[name]
            r["launch_error"] = abs(r["launch_predicted_s"] / r["time_s"] - 1)
            print(
                f"  {name}: {r['time_s']:.3f} s/step ({r['codecs']}, ΔN {r['delta_n']}), "
                f"forecast {r['prediction_error']:.1%} off, launch prediction "
                f"{r['launch_predicted_s']:.3f} s ({r['launch_error']:.1%} off)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if ray.is_initialized():
            ray.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


def measure(steps: int) -> dict:
    from geopipe.testbed import BedPlan, BedUnavailable, running

    plan = BedPlan(
        ("east", "west"), LATENCY_MS, RATE_MBIT, prefix="gpbw", ray=True, cpus_per_site=2
    )
    try:
        with running(plan) as bed:
            p = bed.popen(
                plan.sites[0],
                [
                    sys.executable,
                    __file__,
                    "--role",
                    "--address",
                    bed.plan.ray_address,
                    "--steps",
                    str(steps),
                ],
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            out, _ = p.communicate(timeout=3600)
    except BedUnavailable as exc:
        return {"testbed_skipped": str(exc)}
    res = next(json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT "))
    t = {k: v["time_s"] for k, v in res.items()}
    return {
        "speedup_int4h_vs_int8": t["int8"] / t["int4h"],
        "speedup_int4h_vs_none": t["none"] / t["int4h"],
        "planner_codecs": res["planner"]["codecs"],
        "planner_choice_over_best_measured": t["planner"] / min(t.values()),
        "max_prediction_error": max(v["prediction_error"] for v in res.values()),
        "max_launch_prediction_error": max(v["launch_error"] for v in res.values()),
        "settings": res,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=8, help="3 calibrate, the rest count")
    a = ap.parse_args()
    if a.role:
        return _role(a.address, a.steps, list(SETTINGS))
    load0 = os.getloadavg()[0]
    out: dict = {"benchmark": "bandwidth_bound"}
    out.update(measure(a.steps))
    out["load_before"], out["load_after"] = round(load0, 2), round(os.getloadavg()[0], 2)

    def rounded(x):
        if isinstance(x, float):
            return round(x, 4)
        if isinstance(x, dict):
            return {k: rounded(v) for k, v in x.items()}
        return x

    print(json.dumps(rounded(out)))


if __name__ == "__main__":
    main()
