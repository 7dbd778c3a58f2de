"""Where a bed run's CPU goes: a sampler of /proc, read over a run's measured window.

On this 2-core host the emulated WAN (the forwarder, at real-time priority), the driver,
Ray's own daemons and the actors' receiving threads all share the cores that compute, so a
step that runs slower beside a WAN may be paying for CPU spent elsewhere. The sampler reads
every process's CPU time (and every actor thread's) twice a second; :meth:`CpuSampler.over`
gives the CPU seconds each kind of process spent between two wall-clock times, and the
host's busy share. Linux only (it reads /proc); the bed is Linux only too.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def kind_of(cmdline: str) -> str:
    """A process's kind from its command line."""
    if "geopipe.testbed" in cmdline and "forward" in cmdline:
        return "forwarder"
    if cmdline.startswith("ray::"):  # an actor or a Ray worker (its title is set by Ray)
        return "actor" if "idle" not in cmdline.lower() else "ray_worker_idle"
    if "outer_loop.py" in cmdline:
        return "driver"
    if any(k in cmdline for k in ("raylet", "gcs_server", "dashboard", "ray/_private", "log_mon")):
        return "ray_daemon"
    return "other"


def _ticks(stat: str) -> int:
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def snapshot(actors: set[int] | None = None) -> tuple[float, dict, tuple[int, int]]:
    """(time, {key: (kind, ticks)}, (host busy, host total)): every process's ticks under
    ``(pid,)`` and every actor thread's under ``(pid, tid, comm)``. ``actors``: the pids
    seen as actors before, kept as actors (Ray rewrites an actor's title at every call, and
    a read in the middle of that sees neither title); the new ones are added to it."""
    actors = set() if actors is None else actors
    now = time.time()
    procs: dict = {}
    names: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        cmd = _read(d / "cmdline")
        stat = _read(d / "stat")
        if cmd is None or stat is None:
            continue
        kind = kind_of(cmd.replace("\0", " ").strip())
        if kind == "actor":
            actors.add(int(d.name))
        elif int(d.name) in actors:
            kind = "actor"
        procs[(int(d.name),)] = (kind, _ticks(stat))
        names[int(d.name)] = cmd.replace("\0", " ").strip()[:48]
        if kind == "actor":
            for t in (d / "task").iterdir() if (d / "task").exists() else ():
                ts, comm = _read(t / "stat"), _read(t / "comm")
                if ts is not None and comm is not None:
                    procs[(int(d.name), int(t.name), comm.strip())] = ("thread", _ticks(ts))
    cpu = _read(Path("/proc/stat")).splitlines()[0].split()[1:]
    vals = [int(x) for x in cpu]
    idle = vals[3] + vals[4]
    procs["names"] = names
    return now, procs, (sum(vals) - idle, sum(vals))


class CpuSampler:
    """Snapshots every ``interval`` seconds in a thread, from start() to stop()."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.samples: list[tuple[float, dict, tuple[int, int]]] = []
        self.actors: set[int] = set()  # pids seen as actors (:func:`snapshot`)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append(snapshot(self.actors))
            self._stop.wait(self.interval)

    def start(self) -> CpuSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Idempotent: the last snapshot is taken once."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.samples.append(snapshot(self.actors))

    def over(self, t0: float, t1: float) -> dict:
        """CPU seconds per kind between the samples enclosing ``t0`` and ``t1``, the host's
        busy cores, and the actors' busiest threads (by name, summed over actors; a thread
        that ended before the window's last sample is in its process's figure only)."""
        times = [s[0] for s in self.samples]
        if len(times) < 2:
            return {}
        i = max(0, bisect.bisect_right(times, t0) - 1)  # the samples enclosing the window
        j = min(bisect.bisect_left(times, t1), len(times) - 1)
        if j <= i:
            return {}
        (ta, a, ha), (tb, b, hb) = self.samples[i], self.samples[j]
        kinds: dict[str, float] = {}
        threads: dict[str, float] = {}
        busiest: dict[str, float] = {}  # processes, by command line
        for key, val in b.items():
            if key == "names":
                continue
            kind, ticks = val
            d = (ticks - a.get(key, (kind, 0))[1]) / TICK
            if kind == "thread":
                name = "main" if key[0] == key[1] else key[2]
                threads[name] = threads.get(name, 0.0) + d
            else:
                kinds[kind] = kinds.get(kind, 0.0) + d
                busiest[f"{key[0]} {b['names'][key[0]]}"] = d
        span = tb - ta
        top = sorted(threads.items(), key=lambda x: -x[1])[:8]
        procs = sorted(busiest.items(), key=lambda x: -x[1])[:6]
        return {
            "seconds": round(span, 2),
            "host_busy_cores": round((hb[0] - ha[0]) / max(1, hb[1] - ha[1]) * os.cpu_count(), 3),
            "cpu_s": {k: round(v, 2) for k, v in sorted(kinds.items())},
            "actor_threads_s": {k: round(v, 2) for k, v in top},
            "busiest_s": {k: round(v, 2) for k, v in procs},
        }
