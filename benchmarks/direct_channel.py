"""Throughput and latency of the direct cross-site channel (geopipe/transport/direct.py).

Sender and receiver are separate processes. Paths measured:

* ``loopback``: both on 127.0.0.1 (CPU-bound: what encode, seal, copy and decode cost).
* ``wan``: two network namespaces joined only by the test bed's forwarder (geopipe/testbed:
  a user-space TUN forwarder adding one-way latency L and a 200 Mbit/s rate; no kernel netem),
  at L = 40 ms (80 ms round trip, BDP 2 MB) unless ``--latency-ms`` says otherwise. Needs root
  and /dev/net/tun; skipped with the reason otherwise.

Per path: one-way latency of small messages (1 KiB, spaced), steady-state goodput of
back-to-back 128 KiB … 16 MiB messages (one TCP stream, kernel buffer autotuning), the same
4 MiB messages striped over 4 parallel streams, and, with ``--gloo``, a 2-rank gloo group's
``send``/``recv`` of the same tensors. With ``--ray`` (loopback only) the same payloads as
Ray actor-call arguments. Goodput counts payload bytes only; the WAN's wire also carries one
52-byte IP/TCP header per 1448-byte segment, so 96.5 % is the ceiling there.

    sudo .venv/bin/python benchmarks/direct_channel.py [--gloo] [--ray] [--quick]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KiB, MiB = 1 << 10, 1 << 20
WAN_RATE_BPS = 200e6


def _phases(quick: bool) -> list[dict]:
    """(name, bytes per message, messages, spacing s, parallel streams)."""
    scale = 2 if quick else 1
    return [
        {"name": "lat_1KiB", "size": KiB, "count": 20, "gap": 0.05, "streams": 1},
        {"name": "tput_128KiB", "size": 128 * KiB, "count": 128 // scale, "gap": 0, "streams": 1},
        {"name": "tput_1MiB", "size": MiB, "count": 48 // scale, "gap": 0, "streams": 1},
        {"name": "tput_4MiB", "size": 4 * MiB, "count": 24 // scale, "gap": 0, "streams": 1},
        {"name": "tput_16MiB", "size": 16 * MiB, "count": 8 // scale, "gap": 0, "streams": 1},
        {"name": "tput_4MiB_x4", "size": 4 * MiB, "count": 24 // scale, "gap": 0, "streams": 4},
        # pipeline traffic: one activation (128 KiB) every 15 ms as a stage computes them (70
        # Mbit/s offered), on a warm connection after an idle second; one-way times over the
        # second half
        {
            "name": "lat_128KiB_every_15ms",
            "size": 128 * KiB,
            "count": 192,
            "gap": 0.015,
            "streams": 1,
            "steady": True,
        },
        # 1F1B over the WAN: one activation per round trip, the link idle in between
        {
            "name": "lat_128KiB_every_100ms",
            "size": 128 * KiB,
            "count": 30,
            "gap": 0.1,
            "streams": 1,
            "steady": True,
        },
    ]


# --------------------------------------------------------------------------- roles


def _role_recv(bind: str, phases: list[dict]) -> None:
    """Receive every phase's messages in order; print arrival times."""
    from geopipe.transport.channel import Inbox
    from geopipe.transport.direct import DirectReceiver

    inbox = Inbox()
    k = max(p["streams"] for p in phases)
    rxs = [DirectReceiver(inbox, host=bind, advertise_host=bind) for _ in range(k)]
    print("ADDR " + json.dumps([rx.address for rx in rxs]), flush=True)
    arrivals: dict[str, list[float]] = {}
    for pi, ph in enumerate(phases):
        out = arrivals[ph["name"]] = []
        for i in range(ph["count"]):
            for j in range(ph["streams"]):
                inbox.get(("F", pi, i, j), timeout=300)
            out.append(time.monotonic())
    print("RESULT " + json.dumps(arrivals), flush=True)
    for rx in rxs:
        rx.close()


def _role_send(addrs: list[list], phases: list[dict], settle_s: float) -> None:
    """Send every phase back to back (or spaced); print send times."""
    import torch

    from geopipe.transport.direct import DirectSender

    txs = [DirectSender(tuple(a), "none", "forward") for a in addrs]
    sent: dict[str, list[float]] = {}
    for pi, ph in enumerate(phases):
        k = ph["streams"]
        x = torch.randn(ph["size"] // 4 // k)
        out = sent[ph["name"]] = []
        t0 = time.monotonic()
        for i in range(ph["count"]):
            if ph["gap"]:
                time.sleep(max(0.0, t0 + i * ph["gap"] - time.monotonic()))
            out.append(time.monotonic())
            for j in range(k):
                txs[j].send(("F", pi, i, j), x, stream="s")
        for tx in txs:
            tx.flush(timeout=300)
        time.sleep(settle_s)  # let the socket buffers drain before the next phase
    print("RESULT " + json.dumps(sent), flush=True)
    for tx in txs:
        tx.close()


def _role_gloo(rank: int, master: str, port: int, phases: list[dict]) -> None:
    """A 2-rank gloo group: rank 0 sends, rank 1 receives (pre-posted, known sizes)."""
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo" if master == "127.0.0.1" else "wan0"
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2)
    times: dict[str, list[float]] = {}
    for ph in phases:
        if ph["streams"] != 1:
            continue
        n = ph["size"] // 4
        out = times[ph["name"]] = []
        if rank == 1:  # every receive pre-posted, as fair to gloo as it gets
            bufs = [torch.empty(n) for _ in range(ph["count"])]
            works = [dist.irecv(b, 0) for b in bufs]
        dist.barrier()
        t0 = time.monotonic()
        if rank == 0:
            x, works = torch.randn(n), []
            for i in range(ph["count"]):
                if ph["gap"]:
                    time.sleep(max(0.0, t0 + i * ph["gap"] - time.monotonic()))
                out.append(time.monotonic())
                works.append(dist.isend(x, 1))
        for w in works:
            w.wait()
            if rank == 1:
                out.append(time.monotonic())
        dist.barrier()
    print("RESULT " + json.dumps(times), flush=True)
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


def _spawn(ns: str | None, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, __file__, *args]
    if ns:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def _line(p: subprocess.Popen, tag: str) -> str:
    for line in p.stdout:
        if line.startswith(tag + " "):
            return line[len(tag) + 1 :]
    p.wait()
    raise RuntimeError(f"{p.args} exited ({p.returncode}) without {tag}")


def _summarise(phases: list[dict], sent: dict, arr: dict, rate_bps: float | None) -> dict:
    out = {}
    for ph in phases:
        s, a = sent.get(ph["name"]), arr.get(ph["name"])
        if not s or not a:
            continue
        if ph["gap"]:
            lat = [x - y for x, y in zip(a, s, strict=True)]
            lat = sorted(lat[len(lat) // 2 :] if ph.get("steady") else lat)
            out[ph["name"]] = {
                "one_way_ms_median": round(1e3 * statistics.median(lat), 2),
                "one_way_ms_p90": round(1e3 * lat[int(0.9 * (len(lat) - 1))], 2),
                "one_way_ms_mean": round(1e3 * statistics.mean(lat), 2),
            }
            continue
        n, size, h = len(a), ph["size"], len(a) // 2
        # Steady state: the second half's arrivals (start-up and slow start excluded).
        mbit = (n - 1 - h) * size * 8 / (a[-1] - a[h]) / 1e6
        r = {
            "goodput_mbit_s": round(mbit, 1),
            "overall_mbit_s": round(n * size * 8 / (a[-1] - s[0]) / 1e6, 1),
            "first_message_ms": round(1e3 * (a[0] - s[0]), 1),
        }
        if rate_bps:
            r["fraction_of_link"] = round(mbit * 1e6 / rate_bps, 3)
        out[ph["name"]] = r
    return out


def run_direct(
    phases: list[dict], ns: tuple[str, str] | None, ips: tuple[str, str], cc: str | None = None
) -> dict:
    settle = "1.0" if ns else "0.2"
    rx = _spawn(ns and ns[1], "--role", "recv", "--bind", ips[1], "--plan", json.dumps(phases))
    addrs = _line(rx, "ADDR")
    tx = _spawn(
        ns and ns[0],
        "--role",
        "send",
        "--addrs",
        addrs,
        "--plan",
        json.dumps(phases),
        "--settle",
        settle,
        *(["--congestion", cc] if cc else []),
    )
    sent = json.loads(_line(tx, "RESULT"))
    arr = json.loads(_line(rx, "RESULT"))
    tx.wait()
    rx.wait()
    return _summarise(phases, sent, arr, WAN_RATE_BPS if ns else None)


def run_gloo(phases: list[dict], ns: tuple[str, str] | None, ips: tuple[str, str]) -> dict:
    port = str(29611)
    plan = json.dumps(phases)
    r1 = _spawn(
        ns and ns[1],
        "--role",
        "gloo",
        "--rank",
        "1",
        "--master",
        ips[0],
        "--port",
        port,
        "--plan",
        plan,
    )
    r0 = _spawn(
        ns and ns[0],
        "--role",
        "gloo",
        "--rank",
        "0",
        "--master",
        ips[0],
        "--port",
        port,
        "--plan",
        plan,
    )
    sent = json.loads(_line(r0, "RESULT"))
    arr = json.loads(_line(r1, "RESULT"))
    r0.wait()
    r1.wait()
    return _summarise(phases, sent, arr, WAN_RATE_BPS if ns else None)


def run_ray(phases: list[dict]) -> dict:
    """The same payloads as Ray actor-call arguments (today's inter-site path), loopback."""
    import numpy as np
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="ERROR", num_cpus=2)

    @ray.remote
    class Sink:
        def __init__(self) -> None:
            self.times: list[float] = []

        def deliver(self, _x: np.ndarray) -> None:
            self.times.append(time.monotonic())

        def take(self) -> list[float]:
            t, self.times = self.times, []
            return t

    sink = Sink.remote()
    ray.get(sink.take.remote())
    sent, arr = {}, {}
    for ph in phases:
        if ph["streams"] != 1:
            continue
        x = np.random.default_rng(0).standard_normal(ph["size"] // 4, dtype=np.float32)
        out, refs = [], []
        t0 = time.monotonic()
        for i in range(ph["count"]):
            if ph["gap"]:
                time.sleep(max(0.0, t0 + i * ph["gap"] - time.monotonic()))
            out.append(time.monotonic())
            refs.append(sink.deliver.remote(x))
        ray.get(refs)
        sent[ph["name"]], arr[ph["name"]] = out, ray.get(sink.take.remote())
    ray.shutdown()
    return _summarise(phases, sent, arr, None)


def _wan_available() -> str | None:
    from geopipe.testbed.netns import unavailable

    return unavailable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["recv", "send", "gloo"], help=argparse.SUPPRESS)
    ap.add_argument("--bind", help=argparse.SUPPRESS)
    ap.add_argument("--addrs", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--settle", type=float, default=0.2, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--latency-ms", type=float, default=40.0, help="one-way WAN latency")
    ap.add_argument("--gloo", action="store_true", help="also measure a 2-rank gloo group")
    ap.add_argument("--ray", action="store_true", help="also measure Ray actor calls (loopback)")
    ap.add_argument("--quick", action="store_true", help="half the messages")
    ap.add_argument("--no-wan", action="store_true", help="loopback only")
    ap.add_argument(
        "--congestion",
        default=None,
        help="senders' TCP congestion control; bbr,cubic: each in turn",
    )
    ap.add_argument(
        "--idle-restart",
        default=None,
        help="net.ipv4.tcp_slow_start_after_idle in both namespaces (the bed sets "
        "0); 1,0: each in turn",
    )
    a = ap.parse_args()
    if a.role == "recv":
        return _role_recv(a.bind, json.loads(a.plan))
    if a.role == "send":
        if a.congestion:
            from geopipe.transport import direct

            direct.CONGESTION = a.congestion.split(",")[0]
        return _role_send(json.loads(a.addrs), json.loads(a.plan), a.settle)
    if a.role == "gloo":
        return _role_gloo(a.rank, a.master, a.port, json.loads(a.plan))

    phases = _phases(a.quick)
    result: dict = {"benchmark": "direct_channel", "cpus": os.cpu_count()}
    result["loopback"] = run_direct(phases, None, ("127.0.0.1", "127.0.0.1"))
    print("loopback", json.dumps(result["loopback"]), flush=True)
    if a.gloo:
        result["loopback_gloo"] = run_gloo(phases, None, ("127.0.0.1", "127.0.0.1"))
        print("loopback gloo", json.dumps(result["loopback_gloo"]), flush=True)
    if a.ray:
        result["loopback_ray"] = run_ray(phases)
        print("loopback ray", json.dumps(result["loopback_ray"]), flush=True)
    why = "--no-wan" if a.no_wan else _wan_available()
    if why:
        result["wan_skipped"] = why
    else:
        from geopipe.testbed import BedPlan, running
        from geopipe.testbed.netns import set_sysctl

        plan = BedPlan(("a", "b"), a.latency_ms, WAN_RATE_BPS / 1e6, prefix="gpdc")
        with running(plan):
            ns = (plan.namespace("a"), plan.namespace("b"))
            ips = (plan.address("a"), plan.address("b"))
            key = f"wan_rtt{2 * a.latency_ms:g}ms_200mbit"
            for idle in a.idle_restart.split(",") if a.idle_restart else [None]:
                for n in ns if idle else ():
                    set_sysctl(n, "net.ipv4.tcp_slow_start_after_idle", idle)
                for cc in (a.congestion or "").split(",") if a.congestion else [None]:
                    k = key + (f"_{cc}" if cc else "") + (f"_ssai{idle}" if idle else "")
                    result[k] = run_direct(phases, ns, ips, cc)
                    print(k, json.dumps(result[k]), flush=True)
            if a.gloo:
                result[key + "_gloo"] = run_gloo(phases, ns, ips)
                print(key + " gloo", json.dumps(result[key + "_gloo"]), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
