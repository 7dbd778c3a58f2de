"""Look-ahead with split backward (``lookahead-zb``) vs plain look-ahead, real training.

Two emulated sites, one stage each, ``m`` micro-batches per step, a WAN link whose round
trip is comparable to one micro-batch's compute. The model is the demo GPT widened to
n_embd 384 at sequence length 64: there, on this CPU, a stage's backward splits evenly
(``I`` ≈ ``W`` ≈ ``F``, Qi et al.'s regime, as large matmuls on GPUs); at the demo's
n_embd 128 and sequence 128 attention dominates and ``W`` is only ~30 % of the backward.

In one process (one embedded Ray), for ΔN = 0..``--max-delta-n`` each of ``lookahead`` and
``lookahead-zb`` trains a few steps with ΔN fixed, the settings interleaved and the whole
sweep repeated ``--repeats`` times: other jobs on this shared 2-core machine slow runs down
at random, so each setting keeps its quietest run (least median step time after the three
calibration steps; all repeats are printed). Per setting: that run's measured iteration
time and the runtime's own calibrated prediction for it, and the upstream stage's peak
activation memory as the activation meter measured it (bytes autograd held) and as the
planner's memory model predicts it. "Predicted" below means the simulator on one set of
costs — the medians of the kept runs' calibrated stage times (F, B, I, W, step, link) — so
that the rule compares schedules, not the noise of separate calibrations.

* ``memory_saving_at_equal_time``: T* = the best look-ahead time; among the settings within
  2 % of T*, 1 − (least upstream activation memory of lookahead-zb) / (least of lookahead).
* ``speedup_at_memory_cap``: with the upstream device holding ``--cap`` micro-batches of
  activations (ΔN ≤ cap − 2 on two stages), the fastest lookahead over the fastest
  lookahead-zb that fits.
* ``max_prediction_error``: |calibrated prediction / measured − 1| over the lookahead-zb
  settings (each setting's quietest run).

With ``--testbed`` the link is real networking instead of the runtime's emulator: the
script brings up its own test bed (geopipe/testbed, namespaces ``gpws-east``/``gpws-west``
joined only by the user-space forwarder at ``--latency-ms`` one way and
``--bandwidth-gbps``; a Ray head in east, a raylet in west), runs the same sweep inside
east's namespace attached to the bed's Ray with ``emulate_links: false`` (every activation,
gradient and Ray control message crosses the forwarder), and brings the bed down at the
end, on errors too. Needs root and /dev/net/tun (says so and exits otherwise).

Run: ``.venv/bin/python benchmarks/wsplit.py [--latency-ms L] [--repeats R] [--testbed] ...``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from _common import run, spec_of, two_site_doc

from geopipe.optimizer.evaluate import plan_peak_memory, plan_schedule
from geopipe.optimizer.refine import measured_costs
from geopipe.optimizer.simulator import simulate
from geopipe.runtime.control.calibration import CALIBRATION_STEPS  # steps not counted

SCHEDULES = ("lookahead", "lookahead-zb")


def measure(spec, schedule: str, steps: int, run_dir: Path) -> dict:
    ctl, res, events = run(spec, steps, run_dir, schedule)
    measured = res.steps[CALIBRATION_STEPS:]
    plan = ctl.plan
    sched = plan_schedule(plan)
    model = plan_peak_memory(ctl.ctx.priced, plan)  # the planner's own memory verdict's figures
    cal = [e for e in events if e["event"] == "calibrated"][-1]
    stages = range(len(measured[0].breakdown))
    parts = sorted({k for m in measured for b in m.breakdown for k in b})
    breakdown = [  # per stage: median seconds per step of each part of the compute thread
        {
            k: round(statistics.median(m.breakdown[s].get(k, 0.0) for m in measured), 4)
            for k in parts
        }
        for s in stages
    ]
    return {
        "breakdown_s": breakdown,
        "iteration_time_s": statistics.median(m.iteration_time_s for m in measured),
        "calibrated_prediction_s": ctl.calibrator.predicted_s,
        "in_flight": sched.max_in_flight[0],
        "measured_activation_bytes": max(m.peak_activation_bytes[0] for m in measured),
        "predicted_activation_bytes": model[0].activations,
        "losses": [m.loss for m in res.steps],
        "calibration": cal,
        "spec": ctl.ctx.priced,
        "plan": plan,
    }


def shared_costs(runs: list[dict]):
    """Median calibrated stage times over all runs, as the simulator's costs."""

    def med(key: str, k: int) -> float:
        return statistics.median(r["calibration"][key][k] for r in runs if key in r["calibration"])

    base = runs[0]
    p = base["plan"].num_stages
    costs = measured_costs(
        base["spec"],
        base["plan"],
        [med("forward_s", k) for k in range(p)],
        [med("backward_s", k) for k in range(p)],
        [med("step_s", k) for k in range(p)],
        ([med("input_s", k) for k in range(p)], [med("weight_s", k) for k in range(p)]),
    )
    lat = base["calibration"]["link_latency_s"]
    lf = [
        statistics.median(r["calibration"]["link_latency_s"]["forward"][j] for r in runs)
        for j in range(len(lat["forward"]))
    ]
    lb = [
        statistics.median(r["calibration"]["link_latency_s"]["backward"][j] for r in runs)
        for j in range(len(lat["backward"]))
    ]
    return replace(costs, lat_f=tuple(lf), lat_b=tuple(lb))


def equal_time_saving(settings: dict, time_key: str, mem_key: str) -> dict:
    """The 2 % rule above, on ``time_key`` times and ``mem_key`` memory."""
    best = min(r[time_key] for r in settings["lookahead"])
    out: dict = {"best_lookahead_time_s": best}
    for name in SCHEDULES:
        ok = [r for r in settings[name] if r[time_key] <= 1.02 * best]
        lean = min(ok, key=lambda r: r[mem_key]) if ok else None
        out[name] = (
            {"delta_n": lean["delta_n"], "bytes": lean[mem_key], "time_s": lean[time_key]}
            if lean
            else None
        )
    la, zb = out["lookahead"], out["lookahead-zb"]
    out["saving"] = 1 - zb["bytes"] / la["bytes"] if la and zb else None
    return out


def at_cap(settings: dict, cap: int, time_key: str) -> dict:
    """Fastest setting of each schedule whose upstream stage holds at most ``cap``."""
    out: dict = {}
    for name in SCHEDULES:
        fit = [r for r in settings[name] if r["in_flight"] <= cap]
        best = min(fit, key=lambda r: r[time_key])
        out[name] = {"delta_n": best["delta_n"], "time_s": best[time_key]}
    out["speedup"] = out["lookahead"]["time_s"] / out["lookahead-zb"]["time_s"]
    return out


def _pct(x: float | None) -> str:
    return "n/a (no lookahead-zb setting within 2 %)" if x is None else f"{x:.1%}"


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, default=5.0)
    ap.add_argument("--bandwidth-gbps", type=float, default=1.0)
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--max-delta-n", type=int, default=3)
    ap.add_argument("--cap", type=int, default=2, help="upstream in-flight cap (micro-batches)")
    ap.add_argument(
        "--testbed", action="store_true", help="over the real-network test bed (root, /dev/net/tun)"
    )
    ap.add_argument("--role", choices=["sweep"], help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument(
        "--max-load",
        type=float,
        default=0.0,
        help="before each run, wait (up to 10 min) for the 1-minute load average to fall "
        "below this (0: do not wait)",
    )
    return ap.parse_args()


def _wait_for_quiet(max_load: float, timeout_s: float = 600.0) -> None:
    """Other jobs share this machine: start a run only once the load has settled."""
    deadline = time.monotonic() + timeout_s
    while max_load and os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(10)


def sweep(args: argparse.Namespace) -> dict[tuple[str, int], list[dict]]:
    """Every (schedule, ΔN) ``--repeats`` times, interleaved."""
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="geopipe-wsplit-"))
    runs: dict[tuple[str, int], list[dict]] = {}
    try:
        for rep in range(args.repeats):
            for dn in range(args.max_delta_n + 1):
                for name in SCHEDULES:
                    doc = two_site_doc(
                        f"ws-{name}-{dn}",
                        args.latency_ms,
                        args.bandwidth_gbps,
                        args.micro_batches,
                        "none",
                        args.micro_batch_size,
                    )
                    doc["plan"].update(delta_n=dn, seq_len=args.seq_len)
                    if args.address:  # inside the test bed: its Ray, its real link
                        doc["ray"].update(address=args.address, emulate_links=False)
                    doc["model"].update(n_embd=args.n_embd, max_seq_len=args.seq_len)
                    _wait_for_quiet(args.max_load)
                    r = measure(spec_of(doc), name, args.steps, tmp / f"{name}-{dn}-{rep}")
                    runs.setdefault((name, dn), []).append(r)
                    print(
                        f"[{rep}] {name:>12} ΔN {dn}: {r['iteration_time_s']:.3f} s measured, "
                        f"{r['calibrated_prediction_s']:.3f} s calibrated prediction; upstream "
                        f"holds {r['in_flight']} mb: "
                        f"{r['measured_activation_bytes'] / 2**20:.1f} MiB measured, "
                        f"{r['predicted_activation_bytes'] / 2**20:.1f} MiB modelled; "
                        f"load {os.getloadavg()[0]:.1f}\n      per stage, s/step: "
                        + "; ".join(
                            ", ".join(f"{k} {v:.3f}" for k, v in b.items() if v)
                            for b in r["breakdown_s"]
                        ),
                        flush=True,
                    )
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return runs


def on_testbed(args: argparse.Namespace) -> None:
    """Bring up a test bed, run this script's sweep inside east's namespace against the
    bed's Ray (its output, the JSON line last, passes straight through), and bring the bed
    down whatever happens."""
    from geopipe.testbed import BedPlan, BedUnavailable, running

    plan = BedPlan(
        ("east", "west"),
        args.latency_ms,
        args.bandwidth_gbps * 1e3,
        prefix="gpws",
        ray=True,
        cpus_per_site=2,
    )
    argv = [a for a in sys.argv[1:] if a != "--testbed"]
    try:
        with running(plan) as bed:
            p = bed.popen(
                plan.sites[0],
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    *argv,
                    "--role",
                    "sweep",
                    "--address",
                    bed.plan.ray_address,
                ],
                cwd=Path(__file__).resolve().parent.parent,
            )
            try:
                rc = p.wait()
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if rc != 0:
                raise SystemExit(f"the sweep inside the test bed exited with status {rc}")
    except BedUnavailable as exc:
        print(json.dumps({"benchmark": "wsplit", "skipped": str(exc)}))


def main() -> None:
    args = _args()
    if args.testbed and args.role is None:
        return on_testbed(args)
    load0 = os.getloadavg()[0]
    runs = sweep(args)
    quietest = {key: min(rs, key=lambda r: r["iteration_time_s"]) for key, rs in runs.items()}
    costs = shared_costs(list(quietest.values()))
    settings: dict[str, list[dict]] = {name: [] for name in SCHEDULES}
    for (name, dn), rs in sorted(runs.items(), key=lambda kv: kv[0][1]):
        sched = plan_schedule(rs[0]["plan"])
        quiet = quietest[(name, dn)]
        settings[name].append(
            {
                "delta_n": dn,
                "in_flight": rs[0]["in_flight"],
                "iteration_time_s": quiet["iteration_time_s"],
                "calibrated_prediction_s": quiet["calibrated_prediction_s"],
                "predicted_iteration_time_s": simulate(sched, costs).iteration_time_s,
                "measured_activation_bytes": max(r["measured_activation_bytes"] for r in rs),
                "predicted_activation_bytes": rs[0]["predicted_activation_bytes"],
                "repeats_s": [r["iteration_time_s"] for r in rs],
            }
        )
    saving_m = equal_time_saving(settings, "iteration_time_s", "measured_activation_bytes")
    saving_p = equal_time_saving(
        settings, "predicted_iteration_time_s", "predicted_activation_bytes"
    )
    cap_m = at_cap(settings, args.cap, "iteration_time_s")
    cap_p = at_cap(settings, args.cap, "predicted_iteration_time_s")

    def errors(name: str) -> list[float]:
        return [
            abs(s["calibrated_prediction_s"] / s["iteration_time_s"] - 1) for s in settings[name]
        ]

    same_dn = [
        abs(a - b)
        for dn in range(args.max_delta_n + 1)
        for a, b in zip(
            runs[("lookahead", dn)][0]["losses"],
            runs[("lookahead-zb", dn)][0]["losses"],
            strict=True,
        )
    ]
    result = {
        "memory_saving_at_equal_time": saving_m["saving"],
        "memory_saving_at_equal_time_predicted": saving_p["saving"],
        "speedup_at_memory_cap": cap_m["speedup"],
        "speedup_at_memory_cap_predicted": cap_p["speedup"],
        "memory_cap_micro_batches": args.cap,
        "max_prediction_error": max(errors("lookahead-zb")),
        "max_prediction_error_lookahead": max(errors("lookahead")),
        "equal_time": {"measured": saving_m, "predicted": saving_p},
        "at_cap": {"measured": cap_m, "predicted": cap_p},
        "settings": settings,
        "shared_costs_ms": {
            "forward": [round(x * 1e3, 2) for x in costs.fwd_s],
            "input": [round(x * 1e3, 2) for x in costs.inp_s],
            "weight": [round(x * 1e3, 2) for x in costs.wgt_s],
            "backward": [round(x * 1e3, 2) for x in costs.bwd_s],
            "latency": [round(x * 1e3, 2) for x in costs.lat_f],
        },
        "max_loss_diff_same_delta_n": max(same_dn),
        "load_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "network": "test bed (real TCP through the forwarder)" if args.address else "emulated",
        "bandwidth_gbps": args.bandwidth_gbps,
        **{
            k: getattr(args, k)
            for k in (
                "latency_ms",
                "micro_batches",
                "micro_batch_size",
                "n_embd",
                "seq_len",
                "repeats",
                "steps",
            )
        },
    }
    print(
        f"equal time (within 2 % of {saving_m['best_lookahead_time_s']:.3f} s): upstream "
        f"activations {saving_m['lookahead']} -> {saving_m['lookahead-zb']}: saving "
        f"{_pct(result['memory_saving_at_equal_time'])} measured, "
        f"{_pct(result['memory_saving_at_equal_time_predicted'])} predicted; at a cap of "
        f"{args.cap} micro-batches: lookahead/lookahead-zb = {cap_m['speedup']:.3f} measured, "
        f"{cap_p['speedup']:.3f} predicted; worst lookahead-zb prediction error "
        f"{result['max_prediction_error']:.1%}"
    )
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
