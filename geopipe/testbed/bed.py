"""Bring the test bed up and down: namespaces, the forwarder, and optionally Ray in them.

``Bed.up(plan)`` makes one namespace per site, starts the forwarder (which creates each
site's ``wan0``), addresses the devices and, with ``plan.ray``, starts a Ray head in the
first site's namespace and one raylet in every other, each node carrying its site's
resource (``site:<name>``) — the layout of a real multi-region cluster, on one host. Every
byte between the sites, Ray's own gRPC included, crosses the forwarder.

State lives in ``$GEOPIPE_TESTBED_DIR`` (default ``/run/geopipe-testbed``): the plan as
JSON (the forwarder re-reads it on SIGHUP), the forwarder's log and counters, and the Ray
cluster's authentication token (token authentication is on, as Ray ≥ 2.60 defaults to;
the token is the bed's own, so it neither uses nor overwrites ``~/.ray/auth_token``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from geopipe.testbed import netns
from geopipe.testbed.plan import DEVICE, RAY_PORT, BedError, BedPlan

__all__ = ["Bed", "BedUnavailable", "running", "state_dir", "stop_forwarders"]


class BedUnavailable(RuntimeError):
    """This machine cannot host the test bed (no root, no TUN); the message says which."""


def state_dir() -> Path:
    return Path(os.environ.get("GEOPIPE_TESTBED_DIR", "/run/geopipe-testbed"))


def _alive(pid: int | None, marker: str) -> bool:
    """Whether ``pid`` runs and is the process we started (its command line has
    ``marker``), so a recycled PID is never signalled."""
    if not pid:
        return False
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


_FORWARDER = "geopipe.testbed.forwarder"


class Bed:
    """One test bed, as recorded in its state file."""

    def __init__(self, plan: BedPlan, root: Path | None = None) -> None:
        self.plan = plan
        self.root = root or state_dir()

    # -- files ---------------------------------------------------------------------------------
    @property
    def state(self) -> Path:
        return self.root / f"{self.plan.prefix}.json"

    @property
    def token_path(self) -> Path:
        return self.root / f"{self.plan.prefix}.token"

    @property
    def ray_temp(self) -> Path:
        # Short: Ray's unix socket paths must stay under 108 bytes.
        return Path("/tmp") / f"{self.plan.prefix}-ray"

    @classmethod
    def load(cls, prefix: str = "gptb", root: Path | None = None) -> Bed:
        root = root or state_dir()
        path = root / f"{prefix}.json"
        if not path.exists():
            raise BedError(f"no test bed is up (no {path}); start one with `geopipe testbed up`")
        return cls(BedPlan.from_json(path.read_text()), root)

    # -- running things inside -----------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """The environment for processes in the bed: Ray's auth settings as the cluster's."""
        env = dict(os.environ)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        # Ray's own node health check must wait out a WAN outage as long as geopipe does
        # (health.wan_outage_s, 60 s by default): 40 missed checks of 3 s, not Ray's 5.
        env.setdefault("RAY_health_check_failure_threshold", "40")
        # A frozen actor is SIGKILLed 1 s after ray.kill, not 5 ([Note: killing a frozen
        # actor] in geopipe.runtime.control.cluster).
        from geopipe.config import RAY_KILL_WORKER_TIMEOUT_MS  # here: the forwarder never needs it

        env.setdefault("RAY_kill_worker_timeout_milliseconds", str(RAY_KILL_WORKER_TIMEOUT_MS))
        env["RAY_AUTH_MODE"] = self.plan.auth_mode
        if self.plan.auth_mode == "token":
            env["RAY_AUTH_TOKEN_PATH"] = str(self.token_path)
        else:
            env.pop("RAY_AUTH_TOKEN_PATH", None)
        if self.plan.ray_address:
            env["GEOPIPE_TESTBED_RAY"] = self.plan.ray_address
        return env

    def argv(self, site: str, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.plan.namespace(site), *cmd]

    def popen(self, site: str, cmd: Sequence[str], **kw: object) -> subprocess.Popen:
        """Start ``cmd`` inside ``site``'s namespace with the bed's environment."""
        return subprocess.Popen(self.argv(site, cmd), env=kw.pop("env", self.env()), **kw)

    # -- up ------------------------------------------------------------------------------------
    @classmethod
    def up(cls, plan: BedPlan, root: Path | None = None) -> Bed:
        """Create namespaces, start the forwarder, address the devices (and start Ray)."""
        why = netns.unavailable()
        if why:
            raise BedUnavailable(f"the test bed {why}")
        taken = [ns for ns in plan.namespaces if netns.exists(ns)]
        if taken:
            raise BedError(
                f"namespace(s) {', '.join(taken)} already exist: a test bed is up "
                "(`geopipe testbed down` first, or choose another --prefix)"
            )
        bed = cls(plan, root)
        try:
            for ns in plan.namespaces:
                netns.add(ns)
                netns.copy_tcp_sysctls(ns)
            plan.save(bed.state)
            bed._start_forwarder()
            for s in plan.sites:
                ns = plan.namespace(s)
                netns.wait_device(ns, DEVICE)
                netns.configure_device(ns, DEVICE, f"{plan.address(s)}/{plan.prefixlen}")
            if plan.ray:
                bed._start_ray()
        except BaseException:
            bed.down()
            raise
        return bed

    def _start_forwarder(self) -> None:
        log = open(self.root / f"{self.plan.prefix}.forwarder.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", _FORWARDER, str(self.state)],
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            text=True,
        )
        log.close()
        ready, _, _ = select.select([proc.stdout], [], [], 15.0)
        line = proc.stdout.readline() if ready else ""
        proc.stdout.close()
        if line.strip() != "ready":
            proc.kill()
            proc.wait()
            tail = (self.root / f"{self.plan.prefix}.forwarder.log").read_text()[-2000:]
            raise RuntimeError(f"the forwarder did not start: {tail.strip() or 'no output'}")
        self.plan = replace(self.plan, forwarder_pid=proc.pid)
        self.plan.save(self.state)

    def _ray_cmd(self, site: str, head: bool) -> list[str]:
        p = self.plan
        ray = str(Path(sys.executable).with_name("ray"))
        cmd = [
            ray,
            "start",
            "--node-ip-address",
            p.address(site),
            "--num-cpus",
            str(p.cpus_per_site),
            "--resources",
            json.dumps({f"site:{site}": p.cpus_per_site}),
            "--object-store-memory",
            str(512 << 20),
            "--disable-usage-stats",
        ]
        if head:
            return [
                *cmd,
                "--head",
                "--port",
                str(RAY_PORT),
                "--include-dashboard",
                "false",
                "--temp-dir",
                str(self.ray_temp),
            ]
        return [*cmd, "--address", p.head_address]

    def _start_ray(self) -> None:
        p = self.plan
        if p.auth_mode == "token":
            self.token_path.write_text(uuid.uuid4().hex)
            self.token_path.chmod(0o600)
        self.plan = p = replace(p, ray_address=p.head_address)
        p.save(self.state)
        for i, site in enumerate(p.sites):
            out = subprocess.run(
                self.argv(site, self._ray_cmd(site, head=i == 0)),
                env=self.env(),
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                raise RuntimeError(f"`ray start` in site {site} failed:\n{out.stderr[-3000:]}")
        self.wait_ray()

    def wait_ray(self, timeout_s: float = 60.0) -> None:
        """Until every site's node has joined the cluster."""
        code = (
            "import ray,sys,time\n"
            f"ray.init(address={self.plan.ray_address!r}, logging_level='ERROR')\n"
            f"t=time.monotonic()+{timeout_s}\n"
            "while time.monotonic()<t:\n"
            "    r=ray.cluster_resources()\n"
            f"    if all(r.get('site:'+s,0)>0 for s in {list(self.plan.sites)!r}): sys.exit(0)\n"
            "    time.sleep(0.5)\n"
            "sys.exit(1)\n"
        )
        out = subprocess.run(
            self.argv(self.plan.sites[0], [sys.executable, "-c", code]),
            env=self.env(),
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise RuntimeError(f"not every site's Ray node joined:\n{out.stderr[-3000:]}")

    # -- changing the link ---------------------------------------------------------------------
    def set_link(
        self,
        latency_ms: float | None = None,
        rate_mbit: float | None = None,
        cut: bool | None = None,
    ) -> None:
        """New latency/rate, or a cut (100 % loss) / heal, in place: the forwarder re-reads
        the state file on SIGHUP."""
        self.plan = self.plan.with_link(latency_ms, rate_mbit, cut)
        self.plan.save(self.state)
        pid = self.plan.forwarder_pid
        if not _alive(pid, _FORWARDER):
            raise BedError("the forwarder is not running: `geopipe testbed down`, then `up`")
        os.kill(pid, signal.SIGHUP)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # the counters file echoes the settings in force
            st = self.stats()
            if (
                st.get("latency_ms") == self.plan.latency_ms
                and (st.get("rate_mbit") == self.plan.rate_mbit)
                and bool(st.get("cut")) == self.plan.cut
            ):
                return
            time.sleep(0.1)
        raise RuntimeError("the forwarder did not confirm the new link settings")

    def stats(self) -> dict:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.state.with_suffix(".stats.json").read_text())
        return {}

    def status(self) -> dict:
        p = self.plan
        pid = p.forwarder_pid
        cpu_s = None
        if _alive(pid, _FORWARDER):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return {
            "sites": {
                s: {
                    "namespace": p.namespace(s),
                    "address": p.address(s),
                    "up": netns.exists(p.namespace(s)),
                    "processes": len(netns.pids(p.namespace(s))),
                }
                for s in p.sites
            },
            "latency_ms": p.latency_ms,
            "rate_mbit": p.rate_mbit,
            "queue_ms": p.queue_ms,
            "forwarder": {
                "pid": pid,
                "running": _alive(pid, _FORWARDER),
                "cpu_s": cpu_s,
                **self.stats(),
            },
            "ray_address": p.ray_address,
        }

    # -- down ----------------------------------------------------------------------------------
    def down(self) -> list[int]:
        """Stop everything the bed started, by PID, and remove its namespaces and files.
        Returns the PIDs stopped. Never ``ray stop``: that would stop every Ray on the host."""
        stopped: list[int] = []
        for ns in self.plan.namespaces:
            if netns.exists(ns):
                stopped += netns.stop_processes(ns)
        pid = self.plan.forwarder_pid
        if _alive(pid, _FORWARDER):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 5.0
            while _alive(pid, _FORWARDER) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid, _FORWARDER):
                os.kill(pid, signal.SIGKILL)
            stopped.append(pid)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        for ns in self.plan.namespaces:
            netns.delete(ns)
        for suffix in (".json", ".token", ".stats.json", ".tmp", ".stats.tmp", ".forwarder.log"):
            with contextlib.suppress(OSError):
                (self.root / f"{self.plan.prefix}{suffix}").unlink()
        shutil.rmtree(self.ray_temp, ignore_errors=True)
        return stopped


def stop_forwarders(prefix: str) -> list[int]:
    """Stop forwarders of test bed ``prefix`` found by their command line (their state file
    is gone, so no PID was recorded); returns their PIDs."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if _FORWARDER.encode() in argv and any(
                a.endswith(f"/{prefix}.json".encode()) for a in argv
            ):
                os.kill(int(proc.name), signal.SIGTERM)
                out.append(int(proc.name))
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(_alive(p, _FORWARDER) for p in out):
        time.sleep(0.05)
    return out


@contextlib.contextmanager
def running(plan: BedPlan, root: Path | None = None) -> Iterator[Bed]:
    """A test bed for the duration of a ``with`` block (benchmarks, tests)."""
    bed = Bed.up(plan, root)
    try:
        yield bed
    finally:
        bed.down()
