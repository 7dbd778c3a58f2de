"""The worker-group seam: everything the driver asks of its stage actors and site stores.

Like Ray Train V2's worker group (which its controller tests swap for a dummy), the driver's
components never touch Ray's actor API themselves; they hold a :class:`Workers` given at
construction and ask it to make actors (:meth:`Workers.spawn`), start calls on them
(:meth:`Workers.call`), wait for and collect the answers (:meth:`Workers.wait`,
:meth:`Workers.get`) and kill them. :class:`RayWorkers` is the production implementation;
``tests/unit/fakes.py`` has an in-process one whose actors are plain Python objects with
fault injection, so the controller's states, recovery and checkpoint coordination are
tested in the fast tier.

[Note: the shape of the seam]
The brief's shape, kept because it is the smallest that leaves the driver's algorithms
unchanged: calls are *started* and *collected* separately, because the driver's logic lives
in that gap — a step's calls are started on every actor, then watched with heartbeats while
they run (:func:`~geopipe.runtime.control.health.await_step`); a checkpoint's shard calls are
polled between steps; a store's ``save`` receives pending shard descriptions as arguments,
resolved before it runs (Ray's dependency passing, which the fake reproduces). A
synchronous ``stage.save_shard(step)`` interface would have hidden exactly what must be
tested. Two choices differ from a literal reading:

* methods are named by string (``call(actor, "run_iteration", step, record)``): one ``call``
  serves both actor kinds, and call sites read like the Ray calls they replace. What a
  string costs in typing is won back by :class:`StageActor` and :class:`SiteStoreActor`,
  which list every method the driver calls with its signature: the fake refuses any other
  name, and a unit test holds the real ``StageWorker`` and ``SiteStore`` — and every
  ``call(...)`` site in the control modules — to these protocols;
* the seam also answers the few cluster questions the driver's logic depends on (total and
  free resources per site, connect and shut down, whether Ray still holds actor names),
  so the fake can take devices away and give them back (grow-back) without a cluster.

Errors are the seam's own, translated from Ray's where a call is collected (:meth:`get`):
:class:`WorkerLost` (the actor's process is gone: Ray's ``RayActorError``, including a
remote method that failed because an actor *it* called died — Ray makes that error both
kinds, and the driver always treated it as a death), :class:`WorkerFailed` (the method
raised: ``RayTaskError``, its message kept), :class:`CallTimeout` (``GetTimeoutError``).
Each keeps Ray's message, so events and console lines read as before. Other Ray errors
pass through unchanged, as they did.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from geopipe.checkpoint.restore import SiteCopy
    from geopipe.checkpoint.store import ShardInfo
    from geopipe.config import ClusterSpec
    from geopipe.optimizer.codec_guard import Fallback
    from geopipe.runtime.actor.executor import IterationResult
    from geopipe.runtime.actor.handoff import Restore
    from geopipe.runtime.actor.outer_wire import OuterPeer, OuterSettings
    from geopipe.runtime.actor.stage import StageSpec
    from geopipe.runtime.control.cluster import ClusterInfo
    from geopipe.runtime.storage.sitestore import ShardSource

__all__ = [
    "Actor",
    "CallTimeout",
    "NameTaken",
    "Pending",
    "RayWorkers",
    "SiteStoreActor",
    "SpawnOptions",
    "StageActor",
    "WorkerFailed",
    "WorkerLost",
    "Workers",
    "ask",
    "call_all",
]

Actor = Any  # an actor the seam made (Ray: an ActorHandle); opaque to the driver
Pending = Any  # a call in flight (Ray: an ObjectRef); may be passed to another call


class WorkerLost(RuntimeError):
    """The actor's process is gone (killed, crashed, its node lost)."""


class WorkerFailed(RuntimeError):
    """The actor is alive but the method raised; the message is the remote error's."""


class CallTimeout(TimeoutError):
    """The answer did not come within the timeout given to :meth:`Workers.get`."""


class NameTaken(RuntimeError):
    """:meth:`Workers.spawn`: an actor of that name already exists in the namespace."""


@dataclass(frozen=True)
class SpawnOptions:
    """Where and how a new actor runs. ``None`` leaves a setting at the backend's default."""

    name: str
    namespace: str
    resources: dict[str, float] | None = None  # e.g. {"site:east": 1}: one of its devices
    num_gpus: int | None = None
    node: str | None = None  # pinned to this node (a site store beside its site's actors)
    env: dict[str, str] = field(default_factory=dict)  # the actor process's environment
    max_concurrency: int = 1  # calls the actor serves at once (pings beside a step)


class StageActor(Protocol):
    """What the driver calls on a stage replica
    (:class:`~geopipe.runtime.actor.stage.StageWorker`), through :meth:`Workers.call`."""

    # lifecycle and health
    def ping(self) -> int: ...
    def clock_skews(self) -> dict[str, tuple[float, float]]: ...
    def abort(self) -> None: ...
    def leave(self) -> None: ...
    def reducing(self) -> bool: ...
    def node_id(self) -> str: ...
    def data_digest(self) -> str | None: ...
    # wiring (Placement) and the launch-time link probe
    def listen(self) -> tuple[str, int]: ...
    def endpoint(self) -> tuple[str, int]: ...
    def setup(
        self,
        master: tuple[str, int],
        site_rank: int,
        site_world: int,
        groups: list[list[int]],
        my_group: int,
        up_rank: int | None,
        down_rank: int | None,
        up_addr: tuple[str, int] | None = None,
        down_addr: tuple[str, int] | None = None,
        timeout_s: float = 600.0,
        tie_addr: tuple[str, int] | None = None,
        norm_peers: list | None = None,
    ) -> float: ...
    def reconfigure(self, spec: StageSpec) -> tuple[int, tuple[int, int]]: ...
    def probe_link(self, address: tuple[str, int], link: Any, sizes: list[int]) -> dict: ...
    def probe_echo(self, address: tuple[str, int], link: Any, sizes: list[int]) -> dict: ...
    def codec_speeds(self, codecs: list[str]) -> dict[str, float]: ...
    # training
    def run_iteration(self, step: int, record: bool = False) -> IterationResult: ...
    def run_iterations(
        self, start: int, count: int, record: list, sends: dict, applies: dict | None = None
    ) -> list: ...
    def set_delta_n(self, delta_n: list[int]) -> None: ...
    def set_codecs(self, fallbacks: list[Fallback]) -> None: ...
    def full_state(self) -> dict: ...
    def param_shapes(self) -> dict[str, tuple[int, ...]]: ...
    # held-out evaluation (evaluation.Evaluator)
    def set_eval(self, setup: Any) -> None: ...
    def run_eval(self, step: int) -> dict[str, Any]: ...
    # step boundaries (recovery, grow-back)
    def snapshot(self, step: int) -> None: ...
    def boundary_steps(self) -> list[int]: ...
    def boundary_names(self, step: int) -> list[str]: ...
    def drop_boundaries(self) -> None: ...
    def restore_boundary(
        self, step: int, todo: Restore, fetch: list[tuple[Any, list[str]]]
    ) -> dict[str, int]: ...
    # checkpoints
    def sees_file(self, path: str, content: str) -> bool: ...
    def save_shard(self, directory: str | None, step: int) -> float: ...
    def shard_written(self) -> ShardInfo | None: ...
    def write_shard_instead(self, step: int) -> ShardInfo | None: ...
    def release_shard(self, step: int) -> None: ...
    def chunk_address(self) -> tuple[str, int] | None: ...
    def load_checkpoint(self, path: str) -> int: ...
    def load_outer_checkpoint(self, path: str) -> str: ...
    # the outer loop between replica groups (outerloop.OuterRounds)
    def outer_begin(self, settings: OuterSettings) -> dict[str, Any]: ...
    def outer_connect(self, peers: list[OuterPeer]) -> None: ...
    def outer_send(self, fragment: int, done: int | None = None) -> dict[str, Any]: ...
    def outer_gather(
        self,
        fragment: int,
        timeout_s: float | None = None,
        sent_done: int | None = None,
        send_wait_s: float = 0.0,
    ) -> dict[str, Any]: ...
    def outer_decide(self, done: int, groups: list[int] | None, seq: int = 0) -> dict[str, Any]: ...
    def outer_drop(self, groups: list[int]) -> None: ...
    def outer_apply(self, fragment: int, groups: list[int] | None = None) -> dict[str, Any]: ...
    def outer_state(self) -> dict[str, Any]: ...
    def load_outer_state(self, state: dict[str, Any]) -> None: ...


class SiteStoreActor(Protocol):
    """What the driver calls on a site's checkpoint store
    (:class:`~geopipe.runtime.storage.sitestore.SiteStore`), through :meth:`Workers.call`."""

    def ping(self) -> str: ...
    def moved(self) -> tuple[str, str] | None: ...
    def save(
        self,
        step: int,
        save_id: str,
        manifest: dict,
        sources: list[ShardSource],
        *infos: ShardInfo,
    ) -> dict: ...
    def abort(self, step: int, save_id: str) -> None: ...
    def holdings(self) -> list[SiteCopy]: ...
    def rejected(self) -> dict[str, str]: ...  # copies that failed verification, and why
    def path_of(self, step: int) -> str: ...
    def manifest(self, step: int) -> dict: ...  # of its copy (a restore's copy is sized by it)
    def copy_from(self, step: int, source: Any, rate_bps: float | None = None) -> str: ...


class Workers(Protocol):
    """The driver's handle on the cluster and its actors (see the module docstring)."""

    ray_metrics: bool  # whether step figures are mirrored into the cluster's metrics

    # -- the cluster ---------------------------------------------------------------------------
    def connect(self, spec: ClusterSpec) -> ClusterInfo: ...
    def connected(self) -> bool: ...
    def resources(self) -> dict[str, float]: ...  # every resource of the cluster
    def available(self) -> dict[str, float]: ...  # those no actor holds now
    def shutdown(self) -> None: ...  # stop the cluster this process started
    def wait_released(self, names: list[str], namespace: str) -> list[str]: ...

    # -- actors --------------------------------------------------------------------------------
    def spawn(self, cls: type, args: tuple, opts: SpawnOptions) -> Actor: ...
    def call(self, actor: Actor, method: str, *args: Any, **kwargs: Any) -> Pending: ...
    def wait(
        self, pendings: Sequence[Pending], num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[Pending], list[Pending]]: ...
    def get(self, pendings: Sequence[Pending], timeout: float | None = None) -> list: ...
    def kill(self, actor: Actor) -> None: ...


def call_all(workers: Workers, actors: Sequence[Actor], method: str, *args: Any) -> list:
    """Start ``method(*args)`` on every actor of ``actors`` at once."""
    return [workers.call(a, method, *args) for a in actors]


def ask(workers: Workers, actors: Sequence[Actor], method: str, *args: Any) -> list:
    """``method(*args)`` on every actor at once, and the answers (the first error raises)."""
    return workers.get(call_all(workers, actors, method, *args))


# -- Ray ---------------------------------------------------------------------------------------
@functools.cache
def _remote_class(cls: type, max_concurrency: int) -> Any:
    """``cls`` as a Ray actor class, made once per process: ``ray.remote`` makes a new class
    that Ray exports again on first use, fingerprinting it by disassembling every method
    (~0.1 s per actor, CPU the actors starting beside it need)."""
    import ray

    return ray.remote(max_concurrency=max_concurrency)(cls)


def _translated(exc: BaseException) -> BaseException:
    """The seam's error for one of Ray's (see the module docstring), else ``exc`` itself."""
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    if isinstance(exc, RayActorError):  # before RayTaskError: a call that a death failed
        return WorkerLost(str(exc))
    if isinstance(exc, RayTaskError):
        return WorkerFailed(str(exc))
    if isinstance(exc, GetTimeoutError):
        return CallTimeout(str(exc))
    return exc


_PROBE: Any = None


def _env_probe() -> Any:
    """A Ray task of no CPU answering its worker's values of some environment variables
    (registered once per process)."""
    global _PROBE
    if _PROBE is None:
        import ray

        def env_of(keys: list[str]) -> dict[str, str | None]:
            return {k: os.environ.get(k) for k in keys}

        _PROBE = ray.remote(num_cpus=0)(env_of)
    return _PROBE


def _pinned(node: str | None) -> dict[str, Any]:
    """Ray options that pin a task or actor to ``node`` (none when ``node`` is None)."""
    if node is None:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


class RayWorkers:
    """:class:`Workers` on a Ray cluster. Ray is imported on first use, never at import:
    ``cluster.auth_env`` must set Ray's authentication mode before that."""

    ray_metrics = True

    def __init__(self) -> None:
        # per (site resources, pinned node): its workers' values of the actors' variables
        self._env_seen: dict[tuple, dict[str, str | None]] = {}

    def connect(self, spec: ClusterSpec) -> ClusterInfo:
        from geopipe.runtime.control.cluster import connect

        return connect(spec)

    def connected(self) -> bool:
        import sys

        return "ray" in sys.modules and sys.modules["ray"].is_initialized()

    def resources(self) -> dict[str, float]:
        import ray

        return ray.cluster_resources()

    def available(self) -> dict[str, float]:
        import ray

        return ray.available_resources()

    def shutdown(self) -> None:
        import ray

        ray.shutdown()

    def wait_released(self, names: list[str], namespace: str) -> list[str]:
        from geopipe.runtime.control.cluster import wait_released

        return wait_released(names, namespace)

    def _workers_have(self, opts: SpawnOptions) -> bool:
        """Whether the workers an actor of ``opts`` would start as already hold ``opts.env``
        ([Note: an actor's environment without a runtime_env] in .cluster): asked once per
        site (and pinned node) by a task of no CPU; False if the question fails."""
        import ray

        where = (tuple(sorted(opts.resources or {})), opts.node)
        if where not in self._env_seen:
            kw = {"resources": {k: 0.001 for k in where[0]}, **_pinned(opts.node)}
            try:
                ref = _env_probe().options(**kw).remote(sorted(opts.env))
                self._env_seen[where] = ray.get(ref, timeout=60)
            except Exception:
                self._env_seen[where] = {}
        return all(self._env_seen[where].get(k) == v for k, v in opts.env.items())

    def spawn(self, cls: type, args: tuple, opts: SpawnOptions) -> Actor:
        import ray

        kw: dict[str, Any] = {"name": opts.name, "namespace": opts.namespace, "num_cpus": 0}
        if opts.resources is not None:
            kw["resources"] = dict(opts.resources)
        if opts.num_gpus is not None:
            kw["num_gpus"] = opts.num_gpus
        kw.update(_pinned(opts.node))
        if opts.env and not self._workers_have(opts):
            kw["runtime_env"] = {"env_vars": dict(opts.env)}
        try:
            return _remote_class(cls, opts.max_concurrency).options(**kw).remote(*args)
        except ray.exceptions.ActorAlreadyExistsError as exc:
            raise NameTaken(str(exc)) from None

    def call(self, actor: Actor, method: str, *args: Any, **kwargs: Any) -> Pending:
        return getattr(actor, method).remote(*args, **kwargs)

    def wait(
        self, pendings: Sequence[Pending], num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[Pending], list[Pending]]:
        import ray

        return ray.wait(list(pendings), num_returns=num_returns, timeout=timeout)

    def get(self, pendings: Sequence[Pending], timeout: float | None = None) -> list:
        import ray

        try:
            return ray.get(list(pendings), timeout=timeout)
        except Exception as exc:
            err = _translated(exc)
            if err is exc:
                raise
            raise err from exc

    def kill(self, actor: Actor) -> None:
        import ray

        ray.kill(actor, no_restart=True)
