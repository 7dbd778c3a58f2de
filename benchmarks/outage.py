"""A WAN outage on a real network: waited out, and what it costs.

The test bed (two namespaces joined by the user-space forwarder, 200 Mbit/s, one-way
20 ms; needs root): the demo GPT, one stage per site, look-ahead, 12 steps. Once as is,
once with the link cut (``geopipe testbed set --cut``: nothing passes either way, both
sites alive) for ``--outage-s`` seconds after step 3, then healed:

* ``outage_15s_lost_steps``: steps redone (0: the step in flight waited for the link);
* ``outage_15s_extra_s``: the outage run's wall time minus the undisturbed run's minus the
  outage itself — what the outage cost beyond its own length (TCP's retransmission backoff
  after the heal, mostly);
* ``partition_detect_s``: from the cut to the driver's ``link_silent`` (the unanswered-ping
  limit, ``unresponsive_s`` = 10 s, plus a heartbeat);
* ``partition_heal_lost_steps``: the same as the first, under the security benchmark's name;
* ``outage_losses_equal``: the outage run's losses equal the undisturbed run's (1e-6).

    sudo .venv/bin/python benchmarks/outage.py [--outage-s 15]

``benchmarks/recovery.py --outage`` and ``benchmarks/security.py`` report the same keys.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

LATENCY_MS, RATE_MBIT, M, MBS, STEPS, CUT_AFTER = 20.0, 200.0, 16, 2, 12, 3


def _role(address: str, run_dir: str) -> None:
    """Inside east's namespace: attach to the bed's Ray, train, print losses and times."""
    import ray
    from _common import run, spec_of, two_site_doc

    doc = two_site_doc("outage", LATENCY_MS, RATE_MBIT / 1e3, M, "none", MBS)
    doc["ray"].update(address=address, emulate_links=False)
    try:
        t0 = time.time()
        _, res, events = run(spec_of(doc), STEPS, Path(run_dir), "lookahead")
        out = {
            "wall_s": time.time() - t0,
            "losses": [m.loss for m in res.steps],
            "events": [
                e
                for e in events
                if e["event"] in ("link_silent", "link_healed", "failure", "recovered")
            ],
        }
    finally:
        if ray.is_initialized():
            ray.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum('"event"' not in x for x in path.read_text().splitlines())


def _train(bed, run_dir: Path, outage_s: float | None) -> dict:
    proc = bed.popen(
        bed.plan.sites[0],
        [
            sys.executable,
            __file__,
            "--role",
            "--address",
            bed.plan.ray_address,
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    cut_at = None
    if outage_s is not None:
        while _steps_done(run_dir) < CUT_AFTER and proc.poll() is None:
            time.sleep(0.05)
        bed.set_link(cut=True)
        cut_at = time.time()
        time.sleep(outage_s)
        bed.set_link(cut=False)
    out, _ = proc.communicate(timeout=1800)
    res = next(json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT "))
    res["cut_at"] = cut_at
    return res


def measure(outage_s: float = 15.0) -> dict:
    from geopipe.testbed import BedPlan, BedUnavailable, running

    plan = BedPlan(
        ("east", "west"), LATENCY_MS, RATE_MBIT, prefix="gpou", ray=True, cpus_per_site=2
    )
    tmp = Path(tempfile.mkdtemp(prefix="geopipe-outage-"))
    try:
        with running(plan) as bed:
            calm = _train(bed, tmp / "calm", None)
            hit = _train(bed, tmp / "cut", outage_s)
    except BedUnavailable as exc:
        return {"outage_skipped": str(exc)}
    lost = sum(e.get("lost_steps", 0) for e in hit["events"] if e["event"] == "recovered")
    silent = [e for e in hit["events"] if e["event"] == "link_silent"]
    detect = silent[0]["at"] - hit["cut_at"] if silent and "at" in silent[0] else None
    equal = len(calm["losses"]) == len(hit["losses"]) and all(
        abs(a - b) <= 1e-6 for a, b in zip(calm["losses"], hit["losses"], strict=True)
    )
    return {
        "outage_s": outage_s,
        "outage_15s_lost_steps": lost,
        "outage_15s_extra_s": hit["wall_s"] - calm["wall_s"] - outage_s,
        "partition_heal_lost_steps": lost,
        "partition_detect_s": detect,
        "outage_failures": sum(e["event"] == "failure" for e in hit["events"]),
        "outage_losses_equal": equal,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--outage-s", type=float, default=15.0)
    a = ap.parse_args()
    if a.role:
        return _role(a.address, a.run_dir)
    out = measure(a.outage_s)
    print(f"a {a.outage_s:g} s cut after step {CUT_AFTER}: {out}", file=sys.stderr)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
