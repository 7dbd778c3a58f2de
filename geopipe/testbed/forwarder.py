"""The emulated WAN: a user-space forwarder between one TUN device per site namespace.

Kernel netem is absent on these machines, so the WAN is a process. It opens a TUN device
(``wan0``) inside every site's namespace — the only way out of each — reads the IP packets
the kernel routes into it, and writes each into the destination site's TUN device once it
has been serialised at the link's rate and one more one-way latency has passed. TCP, Ray's
gRPC and gloo all pay real round trips, slow start and queueing.

[Note: why the forwarder is built this way]
Measured on a 2-core machine (``benchmarks/direct_channel.py``):

* **GSO offload.** The TUN devices are opened with ``IFF_VNET_HDR`` and TSO/checksum
  offload, so the kernel hands over whole GSO super-packets (up to 64 KiB) instead of
  1500-byte segments: at 200 Mbit/s the forwarder uses ~3-12 % of a core, without it ~6×
  more. The rate is charged per on-the-wire segment (payload plus one IP/TCP header per
  MSS, :func:`~geopipe.testbed.plan.wire_bytes_of_gso`).
* **SCHED_FIFO.** On 2 cores busy with training, a normal-priority forwarder queues behind
  the trainers for milliseconds, adding jitter to every packet. It runs at real-time
  priority; it never spins (it sleeps in ``select`` until the next packet is due), and the
  kernel's RT throttling bounds it anyway.
* **One thread.** All devices are served by one ``select`` loop with one heap of held
  packets: no GIL hand-offs between threads (a 5 ms switch interval would be jitter).
* **In place changes.** ``SIGHUP`` re-reads the state file (latency, rate), so a benchmark
  sweeps L without re-making namespaces or restarting Ray. A direction's packets never
  overtake each other, even when the latency drops.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import json
import os
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from geopipe.testbed.plan import DEVICE, BedPlan, wire_bytes_of_gso

__all__ = ["Direction", "Forwarder", "main", "open_tun_in"]

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
CLONE_NEWNET = 0x40000000
# struct virtio_net_hdr: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
VNET_HDR = struct.Struct("<BBHHHH")
_READ = 65536 + VNET_HDR.size
_BURST = 64  # packets read from one device before looking at the others


@dataclass
class Direction:
    """One direction of one link: a FIFO serialiser with a drop-tail queue."""

    free_at: float = 0.0  # when the link finishes serialising what it holds
    last_due: float = 0.0  # delivery time of the newest packet (no overtaking)
    packets: int = 0
    wire_bytes: int = 0
    dropped: int = 0

    def admit(
        self, now: float, wire: int, rate_bps: float, latency_s: float, queue_s: float
    ) -> float | None:
        """Delivery time of a packet of ``wire`` bytes handed over at ``now``, or None when
        the backlog already exceeds ``queue_s`` (the packet is dropped, as a router does)."""
        start = max(now, self.free_at)
        if start - now > queue_s:
            self.dropped += 1
            return None
        self.free_at = start + wire * 8 / rate_bps
        due = max(self.free_at + latency_s, self.last_due)
        self.last_due = due
        self.packets += 1
        self.wire_bytes += wire
        return due


def _ipv4_dst(pkt: bytes | memoryview) -> str | None:
    """Destination of the IPv4 packet after the vnet header (None for anything else)."""
    off = VNET_HDR.size
    if len(pkt) < off + 20 or pkt[off] >> 4 != 4:
        return None
    return ".".join(str(b) for b in pkt[off + 16 : off + 20])


def _wire_bytes(pkt: bytes) -> int:
    _flags, gso_type, hdr_len, gso_size, _cs, _co = VNET_HDR.unpack_from(pkt)
    data = len(pkt) - VNET_HDR.size
    return wire_bytes_of_gso(data, gso_size if gso_type else 0, hdr_len)


_libc = ctypes.CDLL(None, use_errno=True)


def open_tun_in(namespace: str, name: str = DEVICE) -> int:
    """Create TUN device ``name`` inside ``namespace`` and return its fd (non-blocking).

    A network device lives in the namespace it was created in, so this thread enters the
    namespace for the ``open``/``ioctl`` and returns to its own. The device exists as long
    as the fd is open: when the forwarder exits, the WAN is gone.
    """
    here = os.open("/proc/self/ns/net", os.O_RDONLY)
    there = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if _libc.setns(there, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        flags = IFF_TUN | IFF_NO_PI | IFF_VNET_HDR
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    finally:
        if _libc.setns(here, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back")
        os.close(here)
        os.close(there)
    os.set_blocking(fd, False)
    return fd


class Forwarder:
    """Moves packets between the sites' TUN devices (``fds[site]``) per ``plan``."""

    def __init__(self, plan: BedPlan, fds: dict[str, int]) -> None:
        self.plan = plan
        self.fds = fds
        self._site_of_fd = {fd: s for s, fd in fds.items()}
        self._fd_of_addr = {plan.address(s): fd for s, fd in fds.items()}
        self.dirs = {(a, b): Direction() for a in fds for b in fds if a != b}
        self._held: list[tuple[float, int, int, bytes]] = []  # (due, seq, dst fd, packet)
        self._seq = 0
        self.stopped = False
        self.unroutable = 0

    def reload(self, plan: BedPlan) -> None:
        """New latency and rate from now on (packets in flight keep their times)."""
        self.plan = plan

    def _take(self, fd: int, now: float) -> None:
        src = self._site_of_fd[fd]
        p = self.plan
        for _ in range(_BURST):
            try:
                pkt = os.read(fd, _READ)
            except BlockingIOError:
                return
            dst_fd = self._fd_of_addr.get(_ipv4_dst(pkt) or "")
            if dst_fd is None or dst_fd == fd:
                self.unroutable += 1
                continue
            d = self.dirs[(src, self._site_of_fd[dst_fd])]
            if p.cut:  # a partition: every packet lost, both ways, until healed
                d.dropped += 1
                continue
            due = d.admit(now, _wire_bytes(pkt), p.rate_bps, p.latency_s, p.queue_ms / 1e3)
            if due is not None:
                heapq.heappush(self._held, (due, self._seq, dst_fd, pkt))
                self._seq += 1

    def _release(self, now: float) -> None:
        held = self._held
        while held and held[0][0] <= now:
            _, _, dst, pkt = heapq.heappop(held)
            with contextlib.suppress(OSError):  # the device's queue is full: a drop
                os.write(dst, pkt)

    def run(self, stats_path: Path | None = None) -> None:
        fds = list(self.fds.values())
        next_stats = 0.0
        while not self.stopped:
            now = time.monotonic()
            timeout = max(0.0, self._held[0][0] - now) if self._held else 0.5
            try:
                ready, _, _ = select.select(fds, [], [], min(timeout, 0.5))
            except InterruptedError:  # pragma: no cover - PEP 475 retries select
                ready = []
            now = time.monotonic()
            for fd in ready:
                self._take(fd, now)
            self._release(time.monotonic())
            if stats_path is not None and now >= next_stats:
                self.write_stats(stats_path)
                next_stats = now + 1.0

    def stats(self) -> dict:
        return {
            "latency_ms": self.plan.latency_ms,
            "rate_mbit": self.plan.rate_mbit,
            "cut": self.plan.cut,
            "held": len(self._held),
            "unroutable": self.unroutable,
            "directions": {
                f"{a}->{b}": {
                    "packets": d.packets,
                    "wire_bytes": d.wire_bytes,
                    "dropped": d.dropped,
                }
                for (a, b), d in self.dirs.items()
            },
        }

    def write_stats(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stats()))
        tmp.replace(path)


def _realtime() -> str | None:
    """Run at SCHED_FIFO (see the note above); the reason when that is not allowed."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    except (PermissionError, OSError) as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m geopipe.testbed.forwarder STATE.json``: open the devices, print
    ``ready``, forward until SIGTERM/SIGINT; SIGHUP re-reads the link settings."""
    args = sys.argv[1:] if argv is None else argv
    state = Path(args[0])
    plan = BedPlan.from_json(state.read_text())
    why = _realtime()
    if why:
        print(f"forwarder: not real-time ({why}); expect jitter under load", file=sys.stderr)
    fwd = Forwarder(plan, {s: open_tun_in(plan.namespace(s)) for s in plan.sites})

    def stop(*_: object) -> None:
        fwd.stopped = True

    def reload(*_: object) -> None:
        with contextlib.suppress(OSError, ValueError):
            fwd.reload(BedPlan.from_json(state.read_text()))

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, reload)
    print("ready", flush=True)
    sys.stdout.close()
    try:
        fwd.run(state.with_suffix(".stats.json"))
    finally:
        for fd in fwd.fds.values():
            os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
