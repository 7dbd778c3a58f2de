"""geopipe against torch pipelining on a real (emulated) network: the test bed.

Two network namespaces (``east``, ``west``) joined only by the test bed's user-space
forwarder (geopipe/testbed) at 200 Mbit/s and one-way latency L ∈ {0, 20, 40} ms; a Ray
head in east and a raylet in west; ``emulate_links: false``, so every activation,
gradient and Ray control message pays the real round trips. The demo GPT, one stage per
site, m = 32 micro-batches of 2 × 128 tokens, codec none unless named:

* ``torch_1f1b``, ``torch_gpipe``: torch.distributed.pipelining ``Schedule1F1B`` /
  ``ScheduleGPipe`` over gloo, the same split and data (benchmarks/torch_pipe_baseline.py);
* ``geopipe_1f1b``, ``geopipe_lookahead`` (the planner's ΔN, re-chosen after step 0 from
  the measured stages), ``geopipe_lookahead_int8``.

geopipe's figures are its own metrics: median ``iteration_time_s`` over the steps after
calibration (steps 0-2 calibrate), its prediction after calibration, the bubble ratio from
the stages' busy time and the per-stage step breakdown. torch's: median seconds per step
(the slower rank's) after two warm-up steps.

    sudo .venv/bin/python benchmarks/real_wan.py [--quick]

Needs root and /dev/net/tun (says so and exits otherwise). Brings its own test bed up
(prefix ``gprw``) and down. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RATE_MBIT = 200.0
M, MBS, SEQ = 32, 2, 128
GEOPIPE_RUNS = (
    ("geopipe_1f1b", "1f1b", "none"),
    ("geopipe_lookahead", "lookahead", "none"),
    ("geopipe_lookahead_int8", "lookahead", "int8"),
    ("geopipe_lookahead_zb", "lookahead-zb", "none"),
    ("geopipe_auto", "auto", "none"),
)
# geopipe_lookahead_zb and geopipe_auto (the planner picks look-ahead or lookahead-zb) run
# only on request (--runs)
DEFAULT_RUNS = (
    "torch_1f1b",
    "torch_gpipe",
    "geopipe_1f1b",
    "geopipe_lookahead",
    "geopipe_lookahead_int8",
)


# --------------------------------------------------------------------------- geopipe (driver)


def _geopipe_role(address: str, latency_ms: float, steps: int, runs: list[str]) -> None:
    """Inside east's namespace: attach to the bed's Ray and train each setting in turn."""
    import ray
    from _common import run, spec_of, two_site_doc

    out = {}
    tmp = Path(tempfile.mkdtemp(prefix="geopipe-realwan-"))
    try:
        for name, schedule, codec in GEOPIPE_RUNS:
            if name not in runs:
                continue
            doc = two_site_doc(f"realwan-{name}", latency_ms, RATE_MBIT / 1e3, M, codec, MBS)
            doc["ray"].update(address=address, emulate_links=False)
            doc["plan"]["calibrate"] = True  # plan from this machine's speed, not the YAML's
            ctl, res, events = run(spec_of(doc), steps, tmp / name, schedule)
            out[name] = _summary(ctl, res, events)
            out[name]["load"] = round(os.getloadavg()[0], 2)
            r = out[name]
            print(
                f"  {name}: {r['iteration_time_s']:.3f} s/step, predicted "
                f"{r['predicted_s']:.3f} s (model {r['model_error']:.1%} off), bubble "
                f"{r['bubble_ratio']:.1%}, ΔN {r['delta_n']} ({r['schedule']})",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if ray.is_initialized():
            ray.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


def _step_costs(ctl, step):
    """The calibrated costs with ``step``'s own measured stage times (from its breakdown)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from geopipe.runtime.control.calibration import measured_stage_times

    rs = [
        SimpleNamespace(stage=k, breakdown=b, micro_batches=M) for k, b in enumerate(step.breakdown)
    ]
    f, b, end = measured_stage_times(rs, len(rs))
    return replace(ctl.calibrator.costs, fwd_s=tuple(f), bwd_s=tuple(b), step_s=tuple(end))


def model_bubbles(ctl, steps) -> list[float]:
    """Per step: the simulator's bubble on that step's own measured stage times (sends,
    snapshot and the rest of the step count as busy there): the fill/drain floor."""
    from geopipe.optimizer.evaluate import plan_schedule
    from geopipe.optimizer.simulator import simulate

    return [simulate(plan_schedule(ctl.plan), _step_costs(ctl, s)).bubble_ratio for s in steps]


def _model_times(ctl, steps) -> list[float]:
    """Per step: the simulator's time for that step's own measured stage times (from its
    breakdown) and the calibrated links — the model's error with the host's load drift
    taken out (the forecast uses the steps before)."""
    from geopipe.optimizer.refine import predict

    return [predict(ctl.plan, _step_costs(ctl, s)) for s in steps]


def _summary(ctl, res, events: list[dict]) -> dict:
    from geopipe.runtime.control.calibration import CALIBRATION_STEPS  # steps not counted

    steps = res.steps[CALIBRATION_STEPS:]
    plan_ev = next(e for e in events if e["event"] == "plan")
    lines = [json.loads(x) for x in ctl.metrics_path.read_text().splitlines()]
    forecast = {x["step"]: x["predicted_iteration_time_s"] for x in lines if "event" not in x}
    model = _model_times(ctl, steps)
    parts = [
        {k: statistics.mean(s.breakdown[st][k] for s in steps) for k in steps[0].breakdown[st]}
        for st in range(len(steps[0].breakdown))
    ]
    return {
        "iteration_time_s": statistics.median(s.iteration_time_s for s in steps),
        "step_s": [s.iteration_time_s for s in res.steps],
        # the controller's forecast of each step, made from the steps before it
        "predicted_s": statistics.median(forecast[s.step] for s in steps),
        "model_error": statistics.median(
            abs(m / s.iteration_time_s - 1) for m, s in zip(model, steps, strict=True)
        ),
        "bubble_ratio": statistics.median(s.bubble_ratio for s in steps),
        "delta_n": [ctl.plan.delta_n[j] for j in ctl.plan.wan_boundaries],
        "schedule": ctl.plan.schedule,
        "partition": [list(p) for p in ctl.plan.partition],
        "losses": [s.loss for s in res.steps],
        "links_measured": plan_ev.get("links_measured", []),
        "breakdown_s": [{k: round(v, 4) for k, v in p.items()} for p in parts],
        "bubble_parts": bubble_parts(steps),
        "model_bubble": statistics.median(model_bubbles(ctl, steps)),
    }


def bubble_parts(steps) -> dict[str, float]:
    """Where the measured bubble (1 − busy / (p · T), busy = forward + backward + optimizer)
    goes, as fractions of p · T summed over the stages: blocked on arrivals (``recv_wait``:
    fill, drain, latency not hidden), handing tensors to the links (``send``), waiting for
    the last sends (``drain``), the recovery snapshot, the rest of the compute thread
    (``other``), and ``outside``: T minus the stage's own step (a stage whose step starts
    late or ends early, e.g. the lighter stage). They add up to the bubble."""
    keys = ("recv_wait", "send", "drain", "snapshot", "other")
    out = dict.fromkeys((*keys, "outside"), 0.0)
    total = 0.0
    for s in steps:
        total += len(s.breakdown) * s.iteration_time_s
        for b in s.breakdown:
            own = sum(b.get(k, 0.0) for k in ("forward", "backward", "optimizer", *keys))
            out["outside"] += s.iteration_time_s - own
            for k in keys:
                out[k] += b.get(k, 0.0)
    return {k: round(v / total, 4) for k, v in out.items()}


# --------------------------------------------------------------------------- driver


def _torch(bed, schedule: str, steps: int, split: int) -> dict:
    import torch_pipe_baseline as tpb

    a = tpb.parser().parse_args(
        [
            "--schedule",
            schedule,
            "--steps",
            str(steps),
            "--split",
            str(split),
            "--micro-batches",
            str(M),
            "--micro-batch-size",
            str(MBS),
            "--seq-len",
            str(SEQ),
        ]
    )
    return tpb.run(a, bed)


def _geopipe(bed, latency_ms: float, steps: int, runs: list[str]) -> dict:
    p = bed.popen(
        bed.plan.sites[0],
        [
            sys.executable,
            __file__,
            "--role",
            "geopipe",
            "--address",
            bed.plan.ray_address,
            "--latency-ms",
            str(latency_ms),
            "--steps",
            str(steps),
            "--runs",
            ",".join(runs),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    out, _ = p.communicate(timeout=3600)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"the geopipe driver exited ({p.returncode}) without a result")


def measure_latency(bed, latency_ms: float, a: argparse.Namespace) -> dict:
    """Every setting at one latency. The pairs the ratios compare run back to back
    (geopipe 1F1B, torch 1F1B, geopipe look-ahead, torch GPipe), so a change in the shared
    host's load between settings skews them as little as it can."""
    bed.set_link(latency_ms=latency_ms)
    res: dict = {}
    order = [
        ["geopipe_1f1b"],
        ["torch_1f1b"],
        ["geopipe_lookahead", "geopipe_lookahead_int8", "geopipe_lookahead_zb", "geopipe_auto"],
        ["torch_gpipe"],
    ]
    for group in order:
        runs = [r for r in group if r in a.runs]
        if not runs:
            continue
        if runs[0].startswith("geopipe"):
            res.update(_geopipe(bed, latency_ms, a.geopipe_steps, runs))
            continue
        sched = runs[0].split("_", 1)[1]
        split = next((r["partition"][1][0] for r in res.values() if "partition" in r), 3)
        r = _torch(bed, sched, a.torch_steps, split)
        r["load"] = round(os.getloadavg()[0], 2)
        res[runs[0]] = r
        print(f"  torch_{sched}: {r['median_s']:.3f} s/step", file=sys.stderr, flush=True)
    return res


def _brief(res: dict) -> dict:
    """One latency's settings for the JSON line: times, and geopipe's own figures."""
    keys = (
        "predicted_s",
        "model_error",
        "delta_n",
        "bubble_ratio",
        "bubble_parts",
        "model_bubble",
        "breakdown_s",
        "links_measured",
        "load",
    )
    out = {}
    for name, r in res.items():
        out[name] = {"time_s": round(_time(r), 4)}
        out[name].update(
            {k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in keys if k in r}
        )
    return out


def _time(r: dict) -> float:
    return r.get("iteration_time_s", r.get("median_s"))


def headline(per_l: dict[float, dict]) -> dict:
    """The issue's ratios (None where a setting was not run)."""

    def ratio(a: str, b: str, lat: float, inv: bool = False) -> float | None:
        r = per_l.get(lat, {})
        if a not in r or b not in r:
            return None
        x, y = _time(r[a]), _time(r[b])
        return y / x if inv else x / y

    issue = [r[0] for r in GEOPIPE_RUNS if r[0] in DEFAULT_RUNS]  # the issue's settings
    errors = [
        abs(r["predicted_s"] / r["iteration_time_s"] - 1)
        for res in per_l.values()
        for k, r in res.items()
        if k in issue
    ]
    models = [r["model_error"] for res in per_l.values() for k, r in res.items() if k in issue]
    l40 = per_l.get(40.0, {})
    bubble = model_bubble = bubble_zb = None
    if "geopipe_1f1b" in l40 and "geopipe_lookahead" in l40:
        la, fb = l40["geopipe_lookahead"], l40["geopipe_1f1b"]
        bubble = 1 - la["bubble_ratio"] / fb["bubble_ratio"]
        model_bubble = 1 - la["model_bubble"] / fb["model_bubble"]
    if "geopipe_1f1b" in l40 and "geopipe_lookahead_zb" in l40:
        zb, fb = l40["geopipe_lookahead_zb"], l40["geopipe_1f1b"]
        bubble_zb = 1 - zb["bubble_ratio"] / fb["bubble_ratio"]
    bubble_auto = None
    auto_schedule = {
        f"L{lat:g}": r["geopipe_auto"]["schedule"]
        for lat, r in per_l.items()
        if "geopipe_auto" in r
    }
    if "geopipe_1f1b" in l40 and "geopipe_auto" in l40:
        bubble_auto = 1 - l40["geopipe_auto"]["bubble_ratio"] / l40["geopipe_1f1b"]["bubble_ratio"]
    zb_errors = [
        abs(
            r["geopipe_lookahead_zb"]["predicted_s"] / r["geopipe_lookahead_zb"]["iteration_time_s"]
            - 1
        )
        for r in per_l.values()
        if "geopipe_lookahead_zb" in r
    ]
    return {
        "parity_1f1b_L0": ratio("geopipe_1f1b", "torch_1f1b", 0.0),
        "parity_1f1b_L40": ratio("geopipe_1f1b", "torch_1f1b", 40.0),
        "speedup_lookahead_vs_torch_1f1b_L40": ratio(
            "geopipe_lookahead", "torch_1f1b", 40.0, inv=True
        ),
        "speedup_lookahead_int8_vs_torch_1f1b_L40": ratio(
            "geopipe_lookahead_int8", "torch_1f1b", 40.0, inv=True
        ),
        "max_prediction_error": max(errors) if errors else None,
        "max_model_error": max(models) if models else None,
        "bubble_reduction_L40": bubble,
        # the same from the simulator on the steps' own stage times (fill/drain only)
        "bubble_reduction_L40_model": model_bubble,
        # look-ahead with split backward (--runs ... geopipe_lookahead_zb): W fills the drain
        "bubble_reduction_L40_zb": bubble_zb,
        "max_prediction_error_zb": max(zb_errors) if zb_errors else None,
        # schedule: auto (the planner keeps lookahead-zb only if predicted >= 2 % faster)
        "bubble_reduction_L40_auto": bubble_auto,
        "auto_schedule": auto_schedule,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["geopipe"], help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--latency-ms", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--latencies", default="0,20,40", help="one-way latencies (ms)")
    ap.add_argument(
        "--runs",
        default=",".join(DEFAULT_RUNS),
        help="settings to run (also: geopipe_lookahead_zb)",
    )
    ap.add_argument("--geopipe-steps", type=int, default=8, help="3 calibrate, the rest count")
    ap.add_argument("--torch-steps", type=int, default=6, help="2 warm up, the rest count")
    ap.add_argument("--quick", action="store_true", help="L ∈ {0, 40}, fewer steps")
    a = ap.parse_args()
    a.runs = a.runs.split(",")
    if a.role == "geopipe":
        return _geopipe_role(a.address, a.latency_ms, a.steps, a.runs)
    if a.quick:
        a.latencies, a.geopipe_steps, a.torch_steps = "0,40", 6, 4
    from geopipe.testbed import BedPlan, BedUnavailable, running

    plan = BedPlan(("east", "west"), 0.0, RATE_MBIT, prefix="gprw", ray=True, cpus_per_site=2)
    load0 = os.getloadavg()[0]
    per_l: dict[float, dict] = {}
    t0 = time.monotonic()
    try:
        with running(plan) as bed:
            for lat in (float(x) for x in a.latencies.split(",")):
                print(f"L = {lat:g} ms (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
                per_l[lat] = measure_latency(bed, lat, a)
    except BedUnavailable as exc:
        print(json.dumps({"benchmark": "real_wan", "skipped": str(exc)}))
        return
    result = {
        "benchmark": "real_wan",
        "rate_mbit": RATE_MBIT,
        "micro_batches": M,
        "load_before": round(load0, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "seconds": round(time.monotonic() - t0),
        **headline(per_l),
        "per_latency": {f"L{lat:g}": _brief(res) for lat, res in per_l.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
