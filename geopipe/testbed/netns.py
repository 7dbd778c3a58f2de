"""Network namespaces through iproute2: create, address, list and stop what runs inside.

Processes started in a namespace are found again with ``ip netns pids`` and stopped by
those PIDs only. Never ``ray stop``: it kills every Ray process on the host, other users'
clusters included, not just the namespace's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

__all__ = [
    "TCP_OVERRIDES",
    "add",
    "configure_device",
    "copy_tcp_sysctls",
    "delete",
    "exists",
    "listed",
    "pids",
    "set_sysctl",
    "stop_processes",
    "unavailable",
    "wait_device",
]

# TCP settings a new namespace would otherwise reset to the kernel's defaults (they are per
# namespace): the host's buffer limits decide how much of a long fat link one stream fills.
_TCP_SYSCTLS = ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.core.rmem_max", "net.core.wmem_max")
# Set in every namespace whatever the host says. slow_start_after_idle=0: a connection idle
# for longer than its RTO (a pipeline's gap between steps, a phase change) keeps its
# congestion window instead of restarting from the initial 10 segments, which on an 80 ms
# round trip costs ~10 round trips of slow start to refill the 2 MB path (the standard
# setting for long fat links; measured in benchmarks/README.md, `direct_channel.py`).
TCP_OVERRIDES = {"net.ipv4.tcp_slow_start_after_idle": "0"}


def unavailable() -> str | None:
    """Why this machine cannot host the test bed, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and TUN devices); run it with sudo"
    if not os.path.exists("/dev/net/tun"):
        return "this machine has no /dev/net/tun (TUN devices)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def listed() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def exists(ns: str) -> bool:
    return ns in listed()


def add(ns: str) -> None:
    """A fresh namespace with its loopback up."""
    _ip("netns", "add", ns)
    _ip("-n", ns, "link", "set", "lo", "up")


def copy_tcp_sysctls(ns: str) -> None:
    """Give ``ns`` the host's TCP buffer limits and :data:`TCP_OVERRIDES` (best effort:
    some are host-wide)."""
    for key in _TCP_SYSCTLS:
        path = Path("/proc/sys") / key.replace(".", "/")
        with contextlib.suppress(OSError):
            set_sysctl(ns, key, " ".join(path.read_text().split()))
    for key, value in TCP_OVERRIDES.items():
        set_sysctl(ns, key, value)


def set_sysctl(ns: str, key: str, value: str) -> bool:
    """``sysctl -w key=value`` inside ``ns``; False when the kernel refused it."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"],
        check=False,
        capture_output=True,
    )
    return out.returncode == 0


def wait_device(ns: str, dev: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _ip("-n", ns, "link", "show", dev, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"device {dev} did not appear in namespace {ns}")
        time.sleep(0.02)


def configure_device(ns: str, dev: str, cidr: str) -> None:
    """Address ``dev`` in ``ns`` and bring it up; the subnet's route goes through it."""
    _ip("-n", ns, "addr", "add", cidr, "dev", dev)
    _ip("-n", ns, "link", "set", dev, "up")


def pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def stop_processes(ns: str, grace_s: float = 1.0) -> list[int]:
    """SIGTERM every process in ``ns``, SIGKILL those left after ``grace_s``; returns the
    PIDs it signalled. Only the namespace's processes are touched.

    The grace is short: a bed's GCS, raylets and Ray agents, told to stop, wait on peers
    that are stopping too (measured: all still up 6 s after SIGTERM), and nothing of theirs
    outlives the bed (its namespaces and Ray temp directory are deleted next)."""
    found = pids(ns)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and pids(ns):
        time.sleep(0.1)
    for pid in pids(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and pids(ns):
        time.sleep(0.05)
    return found


def delete(ns: str) -> None:
    _ip("netns", "del", ns, check=False)
