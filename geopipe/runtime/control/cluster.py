"""Ray as the user's cluster: start an embedded one or attach, and check it has the sites.

A site is a Ray custom resource ``site:<name>`` counting its devices. ``ray.address:
local`` starts an embedded Ray with one such resource per site, so one machine emulates
several data centres; ``auto`` or ``host:port`` attaches to a cluster whose nodes were
started with ``ray start --resources='{"site:<name>": <devices>}'``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from geopipe.config import RAY_KILL_WORKER_TIMEOUT_MS, ClusterSpec
from geopipe.plan import Plan
from geopipe.runtime.control.reaper import start_reaper

if TYPE_CHECKING:
    from geopipe.runtime.control.workers import Workers

__all__ = [
    "ClusterInfo",
    "LaunchError",
    "check_sites",
    "connect",
    "kill_actors",
    "site_resource",
    "wait_released",
]

# [Note: killing a frozen actor]
# ray.kill asks an actor's worker to exit and SIGKILLs it only after Ray's
# kill_worker_timeout_milliseconds (default 5 s). A frozen stage (a hung or stopped process)
# never exits by itself, and a survivor blocked in a collective with it is released only by
# that exit, so recovery from a frozen replica waits out that timeout: 5.7 s with Ray's
# default, 1.7 s with 1 s (tests/integration/test_recovery_runtime.py, the frozen actor).
# The embedded Ray starts with 1 s (RAY_KILL_WORKER_TIMEOUT_MS); on a cluster of your own,
# start each node with RAY_kill_worker_timeout_milliseconds=1000 (README).
RAY_SYSTEM_CONFIG = {"kill_worker_timeout_milliseconds": RAY_KILL_WORKER_TIMEOUT_MS}

# How long a stopped run waits for Ray to free its actors' names. ray.kill only asks: the
# name stays taken until the process has exited (seconds for a frozen one, which Ray must
# SIGKILL), and a relaunch of the run on the same cluster needs the names.
NAME_RELEASE_S = 30.0


class LaunchError(RuntimeError):
    """The cluster cannot run this plan; the message says precisely why."""


@dataclass(frozen=True)
class ClusterInfo:
    address: str
    dashboard_url: str | None
    started_here: bool  # we started an embedded Ray and must stop it


def site_resource(site: str) -> str:
    return f"site:{site}"


def _port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def auth_env(spec: ClusterSpec) -> None:
    """Ray's token authentication: on unless the YAML says ``ray.auth: disabled``.

    RAY_AUTH_MODE must be the same for cluster, driver and workers, and Ray caches it when
    it is first imported. So we set it only while Ray is not imported yet; afterwards we
    leave an unset variable alone, because Ray ≥ 2.59 itself turns token mode on for a new
    local cluster (and refreshes its cached config when doing so). An explicit value in
    the environment always wins: the user's cluster may have been started with it.
    """
    mode = "token" if spec.ray.auth == "token" else "disabled"
    if "ray" not in sys.modules or mode == "disabled":
        os.environ.setdefault("RAY_AUTH_MODE", mode)


# Every stage actor's environment ([Note: no torch.compile in stage actors] in .placement):
# one OpenMP thread, one malloc arena, torch.compile off.
ACTOR_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1", "TORCHDYNAMO_DISABLE": "1"}


# [Note: a cold machine's first Ray start]
# Ray waits 30 s (RAY_gcs_server_port_wait_time_s) for a new head's GCS to publish its port.
# On a freshly booted 2-core machine the first start (binaries and Python packages not yet in
# the page cache, a second Ray starting beside it) ran past that once in `make test`'s first
# minute: "Timed out waiting for file .../gcs_server_port_..." (test_multinode's head, the
# CLI launch tests starting theirs on the other worker); the same start alone took 4 s. The
# wait is only an upper bound on a start that succeeds, so an embedded start allows 120 s
# (Ray's own choice for its slower rocksdb GCS); a value in the environment wins.
GCS_START_WAIT_VAR = "RAY_gcs_server_port_wait_time_s"
GCS_START_WAIT_S = "120"


@contextlib.contextmanager
def worker_env(env: dict[str, str] = ACTOR_ENV) -> Any:
    """``env`` in this process's environment while an embedded Ray starts, so its raylet and
    every worker it starts inherit it; restored after (the driver's own torch keeps its
    threads).

    [Note: an actor's environment without a runtime_env]
    An actor given its own ``runtime_env`` is started through Ray's per-actor environment
    setup, outside the actor's process: a launch of two stage actors (and their two site
    rendezvous actors) took 14.9 s of the machine's CPU with it and 12.6 s without, wall
    8.1 s and 6.7 s (/proc/stat around ``launch()``, medians of 4 on our quiet 2-core
    machine; the stage actors' own CPU is the same either way). ``MALLOC_ARENA_MAX`` is read by
    glibc only when a process starts, so the variables must be in the worker's environment
    from its start, not set by the actor. An embedded Ray started inside this context gives
    them to every worker; :class:`~geopipe.runtime.control.workers.RayWorkers` asks a site's
    workers once (a task of no CPU) and passes a ``runtime_env`` only where they lack them:
    on a cluster someone else started without them, as before."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def connect(spec: ClusterSpec, log_to_driver: bool = False) -> ClusterInfo:
    """Start the embedded Ray (``local``) or attach to an existing one."""
    import ray

    auth_env(spec)
    r = spec.ray
    if ray.is_initialized():
        return ClusterInfo(r.address, None, False)
    if r.address == "local":
        if r.dashboard and _port_in_use(r.dashboard_port):
            raise LaunchError(
                f"ray.dashboard_port {r.dashboard_port} on 127.0.0.1 is already in use "
                "(another Ray or geopipe run?); stop it or set ray.dashboard_port to a free port"
            )
        resources = {site_resource(s.name): float(s.devices) for s in spec.sites}
        os.environ.setdefault(GCS_START_WAIT_VAR, GCS_START_WAIT_S)
        start_reaper()  # the embedded Ray dies with this process, even on kill -9
        with worker_env():  # [Note: an actor's environment without a runtime_env]
            ctx = ray.init(
                address="local",
                namespace=r.namespace,
                resources=resources,
                include_dashboard=r.dashboard,
                dashboard_host="127.0.0.1",
                dashboard_port=r.dashboard_port,
                log_to_driver=log_to_driver,
                configure_logging=True,
                logging_level="WARNING",
                _system_config=RAY_SYSTEM_CONFIG,
            )
        url = f"http://{ctx.dashboard_url}" if r.dashboard and ctx.dashboard_url else None
        return ClusterInfo(ctx.address_info.get("address", "local"), url, True)
    try:
        ctx = ray.init(
            address=r.address,
            namespace=r.namespace,
            log_to_driver=log_to_driver,
            logging_level="WARNING",
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise LaunchError(
            f"cannot attach to the Ray cluster at ray.address={r.address!r}: {exc}. "
            "Start it with `ray start --head --resources='{\"site:<name>\": <devices>}'`, "
            "or use address: local for an embedded cluster"
        ) from None
    url = f"http://{ctx.dashboard_url}" if ctx.dashboard_url else None
    return ClusterInfo(r.address, url, False)


def check_sites(spec: ClusterSpec, plan: Plan, available: dict[str, float]) -> None:
    """Raise :class:`LaunchError` naming every site that lacks devices for ``plan``."""
    need: dict[str, int] = {}
    for key in plan.actors():
        site = plan.site_of(*key)
        need[site] = need.get(site, 0) + 1
    missing = []
    for site, n in need.items():
        have = int(available.get(site_resource(site), 0))
        if have < n:
            why = "the stages of a mix of pipelines"
            if not plan.heterogeneous:
                why = f"{n // plan.pipelines} stage(s) × {plan.pipelines} replicas"
            missing.append(
                f"site '{site}' needs {n} devices ({why}) but the cluster offers {have} "
                f"(resource {site_resource(site)})"
            )
    if missing:
        hint = (
            "; start its nodes with `ray start --resources='{\"site:<name>\": <devices>}'`"
            if spec.ray.address != "local"
            else ""
        )
        raise LaunchError("; ".join(missing) + hint)


def plaintext_warning(spec: ClusterSpec) -> str | None:
    """What launch says when the data plane runs without TLS across more than one node
    (``security.encrypt: false``: a trusted private network); None otherwise."""
    if spec.encrypted or spec.ray.address == "local":
        return None
    return (
        "security.encrypt is off: activations, gradients and checkpoint copies cross the "
        "network in clear (authenticated, not encrypted)"
    )


def gpus_per_actor(spec: ClusterSpec, resources: dict[str, float], actors: int) -> float:
    """GPUs each stage actor takes: ``ray.gpus_per_actor`` when set (refused when the cluster
    has fewer GPUs than the actors need), else one when there is a GPU per actor, else none
    (the actors train on CPU)."""
    have, want = resources.get("GPU", 0), spec.ray.gpus_per_actor
    if want is None:
        return 1.0 if have >= actors else 0.0
    if have < want * actors - 1e-9:
        raise LaunchError(
            f"ray.gpus_per_actor: {actors} stage actors × {want:g} GPU need "
            f"{want * actors:g} GPUs, the Ray cluster has {have:g}"
        )
    return want


def check_precision(precision: str, use_gpu: bool, stages: int = 1) -> None:
    """Refuse a precision the devices cannot train in, before any actor starts: a YAML never
    silently trains in another precision. DeepSpeed refuses fp16 on a CPU (its dynamic loss
    scaling needs the accelerator); bf16 and fp32 run on both.

    fp16 is refused on pipelines of more than one stage: each stage's DeepSpeed engine keeps
    its own dynamic loss scale, so the gradient a stage sends upstream carries its scale into
    the upstream stage's (which unscales by its own only), and an overflow skips the step in
    one stage and not in the others. DeepSpeed's own pipeline engine syncs the overflow over
    its model-parallel group; geopipe's stages do not yet, and a silently wrong gradient is
    worse than a refusal."""
    if precision == "fp16" and not use_gpu:
        raise LaunchError(
            "training.precision: fp16 needs GPUs (DeepSpeed refuses fp16 on a CPU); "
            "use bf16 or fp32 on this cluster"
        )
    if precision == "fp16" and stages > 1:
        raise LaunchError(
            f"training.precision: fp16 runs on one-stage pipelines only (this plan has "
            f"{stages} stages, and the stages' loss scales are not kept in step); use bf16"
        )


def shutdown(info: ClusterInfo | None) -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def kill_actors(workers: Workers, actors: dict[str, Any]) -> list[str]:
    """Kill ``{name: handle}`` (each for good); returns the names, to be waited for with
    :func:`wait_released` (Ray frees a name only once the process has exited)."""
    for handle in actors.values():
        with contextlib.suppress(Exception):
            workers.kill(handle)
    return list(actors)


def wait_released(names: list[str], namespace: str, timeout: float = NAME_RELEASE_S) -> list[str]:
    """Wait until Ray has freed every name of ``names``, so that the next launch of the run
    on this cluster finds them free; returns those still taken when ``timeout`` ran out or
    Ctrl-C ended the wait (empty when all were freed)."""
    held, deadline = list(names), time.monotonic() + timeout
    try:
        while True:
            held = [n for n in held if _name_taken(n, namespace)]
            if not held or time.monotonic() >= deadline:
                return held
            time.sleep(0.05)
    except KeyboardInterrupt:  # the user stops waiting: shutting down goes on
        return held


def _name_taken(name: str, namespace: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:  # Ray's answer for "no live actor of that name"
        return False
    except Exception:  # no answer (the cluster going away): nothing to wait for
        return False
    return True
