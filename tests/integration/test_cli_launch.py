"""`geopipe launch` end to end, as a user runs it: a subprocess on the embedded default.

Checks the README's main job (loss falls, one metrics line per step), clean exits with
clear messages on bad input, Ctrl-C, and that no Ray process outlives the command.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
RAY_PROCS = ("raylet", "gcs_server", "dashboard.py")
# Every command these tests start carries this in its environment, and so does every Ray
# process it starts (Ray hands its daemons a copy of the starter's environment): the Ray
# processes these tests look for are their commands' own, whatever else runs beside them
# (the other tests' Rays on the other pytest-xdist worker, see tests/conftest.py).
TAG = f"GEOPIPE_TEST_CLI={os.getpid()}-{time.time_ns()}"


def ray_processes() -> list[str]:
    """Ray's processes of the commands these tests started, in this network namespace (a
    test bed's Ray in a namespace of its own, see geopipe.testbed, is another machine as
    far as these tests go)."""
    here = os.readlink("/proc/self/ns/net")
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.readlink(proc / "ns/net") != here:
                continue
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not any(p in args for p in RAY_PROCS):
                continue
            ours = TAG.encode() in (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        # Only Ray started from this checkout's environment by these tests: other test
        # runs on the same host are other machines as far as these tests go.
        if sys.prefix in args and ours:
            out.append(args)
    return out


def env_of_a_command() -> dict[str, str]:
    """The environment of a command these tests start: token authentication, as a user's
    run has it, and :data:`TAG`."""
    name, value = TAG.split("=")
    return {**os.environ, "RAY_AUTH_MODE": "token", name: value}


def wait_no_ray(timeout: float = 20.0) -> list[str]:
    deadline = time.time() + timeout
    procs = ray_processes()
    while procs and time.time() < deadline:
        time.sleep(0.5)
        procs = ray_processes()
    return procs


def geopipe(*args: str, **kw) -> subprocess.CompletedProcess:
    env = env_of_a_command()
    return subprocess.run(
        [sys.executable, "-m", "geopipe.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        **kw,
    )


def launch_until_first_step(run_dir: Path, stdout: int) -> subprocess.Popen:
    """A long launch of the demo on one device per site in the background (the launcher's
    own behaviour is under test; two stage actors start seconds sooner than four), returned
    once its first step is in the metrics (the launcher still running)."""
    doc = yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text())
    for site in doc["sites"]:
        site["devices_per_node"] = 1
    doc["plan"]["pipelines"] = 1
    cluster = run_dir / "one-device-per-site.yaml"
    cluster.write_text(yaml.safe_dump(doc))
    metrics = run_dir / "metrics.jsonl"
    env = env_of_a_command()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "geopipe.cli",
            "launch",
            str(cluster),
            "--steps",
            "200",
            "--run-dir",
            str(run_dir),
            "--no-progress",
        ],
        cwd=ROOT,
        env=env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and any('"step"' in x for x in metrics.read_text().splitlines()):
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    return proc


def test_launch_default_cluster_trains_and_cleans_up(tmp_path):
    assert wait_no_ray() == [], "an earlier test's Ray is still running"
    metrics = tmp_path / "metrics.jsonl"
    proc = geopipe(
        "launch",
        "clusters/local-2dc.yaml",
        "--steps",
        "6",
        "--run-dir",
        str(tmp_path),
        "--metrics-out",
        str(metrics),
        "--no-progress",
        "--trace",
        str(tmp_path / "t.json"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Ray dashboard: http://127.0.0.1:" in proc.stdout
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [x for x in lines if "event" not in x]
    assert [x["step"] for x in steps] == list(range(6))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5  # byte-level loss starts near ln 256
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert any(n.startswith("F") for n in names) and any(n.startswith("B") for n in names)
    status = geopipe("status", str(tmp_path))
    assert status.returncode == 0 and "finished" in status.stdout and "stage  1" in status.stdout
    assert wait_no_ray() == []


def test_ctrl_c_stops_actors_and_ray(tmp_path):
    assert wait_no_ray() == []
    proc = launch_until_first_step(tmp_path, stdout=subprocess.PIPE)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err
    assert wait_no_ray() == []
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "interrupted" and status["pid"] is None
    # The step in flight was finished and saved: resuming continues right after it.
    from geopipe.checkpoint.store import latest_complete

    saved = latest_complete(tmp_path / "checkpoints")
    assert saved is not None and saved.step == status["step"] >= 1


def test_connect_starts_ray_with_a_one_second_kill_grace():
    """connect() starts the embedded Ray with Ray's SIGKILL grace at 1 s instead of 5
    ([Note: killing a frozen actor] in geopipe.runtime.control.cluster): a worker sees it."""
    from geopipe.config import RAY_KILL_WORKER_TIMEOUT_MS

    assert wait_no_ray() == []
    code = (
        "import ray, yaml\n"
        "from geopipe.config import parse_cluster\n"
        "from geopipe.runtime.control.cluster import connect\n"
        "doc = yaml.safe_load(open('clusters/local-2dc.yaml'))\n"
        "doc['ray']['dashboard'] = False\n"
        "connect(parse_cluster(doc, 't'))\n"
        "config = ray._raylet.Config\n"
        "grace = ray.remote(num_cpus=0)(lambda: config.kill_worker_timeout_milliseconds())\n"
        "print('GRACE', ray.get(grace.remote()))\n"
        "ray.shutdown()\n"
    )
    env = env_of_a_command()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert f"GRACE {RAY_KILL_WORKER_TIMEOUT_MS}" in out.stdout, out.stderr[-3000:]  # Ray: 5000
    assert wait_no_ray() == []


def test_kill_9_of_the_launcher_leaves_nothing_behind(tmp_path):
    """A launcher killed outright (a crashed login node, the OOM killer) runs no cleanup
    code; its embedded Ray still goes with it (geopipe.runtime.control.reaper): no Ray process
    survives, and the dashboard port is free for the next launch."""
    assert wait_no_ray() == []
    proc = launch_until_first_step(tmp_path, stdout=subprocess.DEVNULL)
    assert ray_processes(), "the launch runs an embedded Ray"
    proc.kill()
    proc.wait(timeout=30)
    assert wait_no_ray(timeout=20) == []
    doc = yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text())
    port = doc["ray"].get("dashboard_port", 8265)
    assert wait_port_free(port, timeout=20) == [], "still listening on the dashboard port"


def wait_port_free(port: int, timeout: float) -> list[str]:
    """Wait until a new listener can bind 127.0.0.1:``port``; return who holds it if never
    (pid and command line of each listening socket on it), so a failure says what leaked."""
    import psutil

    deadline = time.time() + timeout
    while True:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
                return []
            except OSError:
                if time.time() > deadline:
                    break
        time.sleep(0.5)
    holders = []
    for c in psutil.net_connections(kind="tcp"):
        if c.laddr and c.laddr.port == port:
            try:
                who = " ".join(psutil.Process(c.pid).cmdline()) if c.pid else "?"
            except psutil.Error:
                who = "?"
            holders.append(f"{c.status} pid={c.pid} {who}")
    return holders or ["bind fails, no socket listed"]


@pytest.mark.parametrize(
    "edit,message",
    [
        (("links", 0, "to", "wset"), "links[0].to: unknown site 'wset' (did you mean 'west'?)"),
        (
            ("sites", 0, "devics_per_node", 2),
            "sites[0].devics_per_node: unknown key (did you mean 'devices_per_node'?)",
        ),
    ],
)
def test_bad_yaml_is_a_clear_error(tmp_path, edit, message):
    doc = yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text())
    section, i, key, value = edit
    doc[section][i][key] = value
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    proc = geopipe("launch", str(bad), timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"{bad}: {message}" in proc.stderr


def test_dashboard_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        doc = yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text())
        doc["ray"]["dashboard_port"] = port
        cfg = tmp_path / "c.yaml"
        cfg.write_text(yaml.safe_dump(doc))
        proc = geopipe("launch", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"ray.dashboard_port {port} on 127.0.0.1 is already in use" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert wait_no_ray() == []
