"""The reaper takes a launcher's Ray processes down with it, even after ``kill -9`` — and
only those: a pid it never saw, or a non-Ray child, is left alone. No Ray needed: stand-in
processes carry Ray's markers in their command lines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _procs import process_alive

ROOT = Path(__file__).resolve().parents[2]

_LAUNCHER = """
import subprocess, sys, time
from geopipe.runtime.control.reaper import start_reaper
start_reaper()
sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
ray_like = subprocess.Popen(sleep + ["ray::DashboardAgent"])
other = subprocess.Popen(sleep + ["not-a-ray-process"])
print(ray_like.pid, other.pid, flush=True)
time.sleep(120)
"""


def test_kill_9_of_the_launcher_takes_its_ray_processes_along():
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    ray_like, other = (int(x) for x in proc.stdout.readline().split())
    try:
        time.sleep(2.5)  # the reaper notes the launcher's descendants once a second
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.time() + 15
        while time.time() < deadline and process_alive(ray_like):
            time.sleep(0.1)
        assert not process_alive(ray_like)
        assert process_alive(other)  # not Ray's: not the reaper's business
    finally:
        for pid in (ray_like, other):
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
