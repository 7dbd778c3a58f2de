"""A minimal emulated WAN for benchmarks/direct_channel.py: two network namespaces joined
only by a user-space forwarder that moves IP packets between a TUN device in each, adding a
one-way latency and serialising them at a rate, so TCP pays real round trips.

Kernel netem is absent on these machines. TUN devices are opened with IFF_VNET_HDR and
TSO/checksum offload, so the kernel hands over whole GSO super-packets (up to 64 KiB) and a
Python forwarder keeps up with 200 Mbit/s; the rate is charged per on-the-wire segment
(payload plus one IP/TCP header per MSS). The forwarder runs at SCHED_FIFO so it does not
queue behind busy processes on a 2-core machine. Needs root and /dev/net/tun.

Usage (root): ``python benchmarks/_tun_link.py --latency-ms 40 --rate-mbit 200`` sets up
namespaces ``gpdc-a`` (10.231.0.1) and ``gpdc-b`` (10.231.0.2), forwards until killed, and
removes them on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import os
import select
import signal
import struct
import subprocess
import threading
import time
from collections import deque

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
CLONE_NEWNET = 0x40000000
VNET_HDR = struct.Struct("<BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, off
NS = ("gpdc-a", "gpdc-b")
IPS = ("10.231.0.1", "10.231.0.2")

_libc = ctypes.CDLL(None, use_errno=True)


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def _open_tun_in(ns: str, name: str) -> int:
    """Open a TUN device inside namespace ``ns`` (the device lives where it was created)."""
    here = os.open("/proc/self/ns/net", os.O_RDONLY)
    there = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(there, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        flags = IFF_TUN | IFF_NO_PI | IFF_VNET_HDR
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    finally:
        _libc.setns(here, CLONE_NEWNET)
        os.close(here)
        os.close(there)
    return fd


def setup() -> tuple[int, int]:
    teardown()
    fds = []
    for i, ns in enumerate(NS):
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        fds.append(_open_tun_in(ns, "wan0"))
        _sh("ip", "-n", ns, "addr", "add", f"{IPS[i]}/24", "dev", "wan0")
        _sh("ip", "-n", ns, "link", "set", "wan0", "up")
    return fds[0], fds[1]


def teardown() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL, check=False)


def _wire_bytes(pkt: bytes) -> int:
    _flags, gso_type, hdr_len, gso_size, _cs, _co = VNET_HDR.unpack_from(pkt)
    data = len(pkt) - VNET_HDR.size
    if gso_type and gso_size:
        segs = -(-(data - hdr_len) // gso_size)
        return data + (segs - 1) * hdr_len
    return data


def forward(src: int, dst: int, latency_s: float, rate_bps: float, queue_s: float) -> None:
    """Read packets from ``src``; write each to ``dst`` once serialised and ``latency_s`` on."""
    held: deque[tuple[float, bytes]] = deque()
    free_at = 0.0
    while True:
        now = time.monotonic()
        timeout = max(0.0, held[0][0] - now) if held else 1.0
        r, _, _ = select.select([src], [], [], timeout)
        if r:
            for _ in range(64):  # drain a burst without re-selecting
                try:
                    pkt = os.read(src, 65536 + VNET_HDR.size)
                except BlockingIOError:
                    break
                now = time.monotonic()
                start = max(now, free_at)
                if start - now > queue_s:
                    continue  # drop-tail: the router's buffer is full
                free_at = start + _wire_bytes(pkt) * 8 / rate_bps
                held.append((free_at + latency_s, pkt))
        now = time.monotonic()
        while held and held[0][0] <= now:
            with contextlib.suppress(OSError):
                os.write(dst, held.popleft()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency-ms", type=float, default=40.0)
    ap.add_argument("--rate-mbit", type=float, default=200.0)
    ap.add_argument("--queue-ms", type=float, default=100.0)
    a = ap.parse_args()
    with contextlib.suppress(PermissionError, OSError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    fa, fb = setup()
    for fd in (fa, fb):
        os.set_blocking(fd, False)
    args = (a.latency_ms / 1e3, a.rate_mbit * 1e6, a.queue_ms / 1e3)
    for s, d in ((fa, fb), (fb, fa)):
        threading.Thread(target=forward, args=(s, d, *args), daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print("ready", flush=True)
    stop.wait()
    teardown()


if __name__ == "__main__":
    main()
