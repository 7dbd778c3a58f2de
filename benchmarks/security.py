"""What authenticating and encrypting the data plane costs.

1. **Handshake**: the run's mutual challenge–response on loopback, plain and inside TLS 1.3
   (connect + handshake, median of 50).
2. **Bulk throughput** at the highest rate this machine sustains (loopback, one stream,
   ``DirectSender`` → ``DirectReceiver``, 4 MiB fp32 messages, codec none): no
   authentication, authenticated, authenticated + TLS.
3. **A starved run through chaos** (issue 33, item 1; local, the embedded Ray): the tiny
   two-site run of ``tests/integration/test_starved_chaos.py`` -- TLS on, per-site
   checkpoint copies every 2 steps, 3 replicas per stage -- for 30 steps with a replica
   killed every 10 (``--chaos-kill-every 10``), while a stranger holds 48 idle sockets on
   every WAN receiver (from launch, before wiring) and chunk server, reopening each one
   closed:
   ``starved_run_lost_steps`` (steps never finished or redone after a rollback; 0 is the
   bar), ``starved_run_ray_fallback_bytes`` (checkpoint bytes that crossed sites through
   Ray instead of the data plane; 0), the largest loss difference from the undisturbed
   run (the same run, no stranger, no kill).
4. **Training over a real network** (the test bed: two namespaces joined by the user-space
   forwarder at 200 Mbit/s, one-way 40 ms; needs root): the demo GPT, one stage per site,
   look-ahead, ``security.encrypt`` on and off, runs interleaved (off, on, off, on), the
   median step time of each after calibration: ``encrypted_step_time_ratio``.

    sudo .venv/bin/python benchmarks/security.py [--no-testbed]

Ends with one JSON line. Run on a quiet machine: step times move with load.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from geopipe.transport.channel import Inbox  # noqa: E402
from geopipe.transport.direct import DirectReceiver, DirectSender  # noqa: E402
from geopipe.transport.security import (  # noqa: E402
    client_handshake,
    link_id,
    make_credentials,
)

LATENCY_MS, RATE_MBIT, M, MBS = 40.0, 200.0, 32, 2


def handshake_ms(encrypt: bool, n: int = 50) -> float:
    creds = make_credentials("bench", encrypt)
    rx = DirectReceiver(Inbox(), creds=creds)
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            with socket.create_connection(rx.address) as s:
                client_handshake(s, creds, link_id(rx.address)).close()
            times.append(time.perf_counter() - t0)
    finally:
        rx.close()
    return statistics.median(times) * 1e3


def bulk_mb_s(mode: str, messages: int = 48) -> float:
    creds = None if mode == "none" else make_credentials("bench", mode == "tls")
    inbox = Inbox()
    rx = DirectReceiver(inbox, creds=creds)
    tx = DirectSender(rx.address, "none", "forward", creds=creds)
    x = torch.randn(1 << 20)  # 4 MiB
    try:
        tx.send(("w", 0), x, "s")
        inbox.get(("w", 0), timeout=30)
        t0 = time.perf_counter()
        for i in range(messages):
            tx.send(("m", i), x, "s")
        for i in range(messages):
            inbox.get(("m", i), timeout=60)
        return messages * x.numel() * 4 / 1e6 / (time.perf_counter() - t0)
    finally:
        tx.close()
        rx.close()


def starved_run(steps: int, every: int) -> dict:
    """The starved chaos run (the integration test's scenario at the issue's size)."""
    sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests" / "unit")]
    from test_runtime import reference
    from test_starved_chaos import starved_chaos_run, starved_doc

    tmp = Path(tempfile.mkdtemp())
    doc = starved_doc(tmp / "ck-{site}", pipelines=3)  # a replica to lose at each kill
    doc["training"]["steps"] = steps
    ref = reference(doc)[0]
    calm = starved_chaos_run(doc, tmp / "calm", steps, 0, stranger=False)["losses"]
    doc["training"]["checkpoint"]["dir"] = str(tmp / "ck2-{site}")
    got = starved_chaos_run(doc, tmp / "run", steps, every)
    diffs = [abs(a - b) for a, b in zip(got["losses"], calm, strict=False)]
    return {
        "starved_run_steps": steps,
        "starved_run_kills": len(got["kills"]),
        "starved_run_lost_steps": got["lost_steps"],
        "starved_run_ray_fallback_bytes": got["ray_fallback_bytes"],
        "starved_run_data_plane_bytes": got["data_plane_bytes"],
        "starved_run_failed_copies": len(got["failed_copies"]),
        "starved_run_loss_max_diff": max(diffs) if len(diffs) == steps else None,
        "calm_run_loss_max_diff_vs_one_process": max(
            abs(a - b) for a, b in zip(calm, ref, strict=True)
        ),
        "starved_run_listeners_held": len(got["held"]),
    }


# --------------------------------------------------------------------------- the test bed


def _role(address: str, steps: int, encrypt: bool) -> None:
    """Inside east's namespace: attach to the bed's Ray, train, print the step times."""
    import ray
    from _common import run, spec_of, two_site_doc

    doc = two_site_doc(f"sec-{int(encrypt)}", LATENCY_MS, RATE_MBIT / 1e3, M, "none", MBS)
    doc["ray"].update(address=address, emulate_links=False)
    doc["plan"]["calibrate"] = True
    doc["security"] = {"encrypt": encrypt}
    try:
        ctl, res, _ = run(spec_of(doc), steps, Path(tempfile.mkdtemp()), "lookahead")
        times = [m.iteration_time_s for m in res.steps[3:]]
        out = {"encrypt": ctl.creds.encrypt, "times": times, "losses": [m.loss for m in res.steps]}
    finally:
        if ray.is_initialized():
            ray.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


def testbed(steps: int, rounds: int) -> dict:
    from geopipe.testbed import BedPlan, BedUnavailable, running

    plan = BedPlan(
        ("east", "west"), LATENCY_MS, RATE_MBIT, prefix="gpsc", ray=True, cpus_per_site=2
    )
    runs: dict[bool, list[float]] = {False: [], True: []}
    losses: dict[bool, list[float]] = {}
    try:
        with running(plan) as bed:
            for _ in range(rounds):
                for encrypt in (False, True):
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
                            "--encrypt",
                            str(int(encrypt)),
                        ],
                        stdout=subprocess.PIPE,
                        text=True,
                        cwd=ROOT,
                    )
                    out, _ = p.communicate(timeout=1800)
                    res = next(
                        json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT ")
                    )
                    assert res["encrypt"] is encrypt
                    runs[encrypt] += res["times"]
                    losses[encrypt] = res["losses"]
                    print(
                        f"  encrypt={encrypt}: median {statistics.median(res['times']):.3f} s/step",
                        file=sys.stderr,
                        flush=True,
                    )
    except BedUnavailable as exc:
        return {"testbed_skipped": str(exc)}
    plain, tls = statistics.median(runs[False]), statistics.median(runs[True])
    return {
        "step_s_plain": plain,
        "step_s_encrypted": tls,
        "encrypted_step_time_ratio": tls / plain,
        "encrypted_losses_equal": losses[True] == losses[False],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--encrypt", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=10, help="3 calibrate, the rest count")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved off/on pairs")
    ap.add_argument("--no-testbed", action="store_true", help="no test-bed figures")
    ap.add_argument("--starved-steps", type=int, default=30, help="the starved run's length")
    a = ap.parse_args()
    if a.role:
        return _role(a.address, a.steps, bool(a.encrypt))
    load0 = os.getloadavg()[0]
    out: dict = {"benchmark": "security"}
    out["auth_handshake_ms"] = handshake_ms(False)
    out["auth_tls_handshake_ms"] = handshake_ms(True)
    print(
        f"handshake: {out['auth_handshake_ms']:.2f} ms plain, "
        f"{out['auth_tls_handshake_ms']:.2f} ms with TLS 1.3",
        file=sys.stderr,
    )
    for mode, key in (
        ("none", "bulk_mb_s_unauthenticated"),
        ("plain", "bulk_mb_s_plain"),
        ("tls", "bulk_mb_s_encrypted"),
    ):
        out[key] = bulk_mb_s(mode)
        print(f"bulk over loopback ({mode}): {out[key]:.0f} MB/s", file=sys.stderr)
    out.update(starved_run(a.starved_steps, 10))
    print(
        f"starved run through chaos: {out['starved_run_lost_steps']} step(s) lost, "
        f"{out['starved_run_ray_fallback_bytes']} bytes fell back to Ray",
        file=sys.stderr,
    )
    if not a.no_testbed:
        out.update(testbed(a.steps, a.rounds))
        from outage import measure  # a partition cut and healed on the test bed

        part = measure(15.0)
        out.update({k: v for k, v in part.items() if k.startswith(("partition_", "outage_s"))})
    out["load_before"], out["load_after"] = round(load0, 2), round(os.getloadavg()[0], 2)
    four = {k: round(v, 4) for k, v in out.items() if isinstance(v, float)}
    for k in ("starved_run_loss_max_diff", "calm_run_loss_max_diff_vs_one_process"):
        four.pop(k, None)  # small: kept as they are
    print(json.dumps({**out, **four}))


if __name__ == "__main__":
    main()
