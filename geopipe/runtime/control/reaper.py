"""The embedded Ray shares its launcher's fate, however the launcher dies.

``ray.init(address="local")`` starts the GCS, a raylet, the dashboard and their agents as
the launcher's descendants. An orderly exit (or Ctrl-C) shuts them down; but after a
``kill -9`` of the launcher (a crashed login node, an OOM kill) the raylet and GCS notice
and exit while ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` were measured still
alive 15 s later, holding ports. Ray has no option to tie them to the driver, and
``PR_SET_PDEATHSIG`` cannot be set on processes Ray spawns.

So :func:`start_reaper` starts a small watcher process in its own session. It holds the
read end of a pipe whose write end only the launcher has (close-on-exec, never inherited
by Ray's processes): when the launcher is gone for any reason, the kernel closes it and
the watcher reads EOF. Meanwhile it notes, once a second, the launcher's Ray descendants
(pid and start time, so a reused pid is never hit); at EOF it terminates those still
alive and their own descendants, then kills what is left after a grace period.
psutil (a Ray dependency) walks the process tree.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys

__all__ = ["start_reaper"]

POLL_S = 1.0
GRACE_S = 3.0
_MARKS = ("ray::", "/ray/", "raylet", "gcs_server", "dashboard")
_write_ends: list[int] = []  # kept open for the launcher's lifetime


def start_reaper() -> None:
    """Start the watcher for this process (once: it watches every Ray this process starts)."""
    if _write_ends:
        return
    r, w = os.pipe()  # both close-on-exec: Ray's processes never inherit the write end
    subprocess.Popen(
        [sys.executable, "-m", "geopipe.runtime.control.reaper", str(os.getpid())],
        stdin=r,
        start_new_session=True,
        close_fds=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(r)
    _write_ends.append(w)


def _is_ray(p) -> bool:
    try:
        cmd = " ".join(p.cmdline()) or p.name()
    except Exception:  # gone, or a zombie
        return False
    return any(m in cmd for m in _MARKS)


def _watch(launcher: int) -> None:
    import psutil

    seen: dict[int, float] = {}  # pid -> create_time of the launcher's Ray descendants
    me = os.getpid()
    try:
        root = psutil.Process(launcher)
    except psutil.NoSuchProcess:
        root = None
    while root is not None:
        ready, _, _ = select.select([0], [], [], POLL_S)
        if ready and not os.read(0, 4096):
            break  # EOF: the launcher is gone
        try:
            for p in root.children(recursive=True):
                if p.pid != me and p.pid not in seen and _is_ray(p):
                    seen[p.pid] = p.create_time()
        except psutil.NoSuchProcess:
            break
    victims = []
    for pid, born in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() != born:
                continue  # the pid was reused
            victims.append(p)
            victims.extend(c for c in p.children(recursive=True) if _is_ray(c))
        except psutil.NoSuchProcess:
            continue
    for p in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(victims, timeout=GRACE_S)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


if __name__ == "__main__":
    _watch(int(sys.argv[1]))
