"""An in-process worker group: the driver's seam (geopipe/runtime/control/workers.py) without Ray.

:class:`FakeWorkers` implements :class:`~geopipe.runtime.control.workers.Workers`. Its
actors are plain Python objects in this process:

* :class:`FakeStage` (:mod:`tests.unit.fake_actors`, with the fake model) stands in for a
  ``StageWorker``. Its "model" is one number per layer (with two Adam-like moments) that
  every optimizer step updates by a pure function of (step, layer), so the state after N
  steps is known without running anything (:func:`reference_state`), whatever layouts,
  recoveries and restores the run went through; a step applied to the wrong state, twice
  or not at all shows in the final state. Each micro-batch's loss is a pure function of its
  samples (:func:`sample_loss`), and the samples each stage saw are recorded, so a test
  can check that every step covered the global batch exactly once. It keeps boundary
  snapshots, reconfigures, hands state over (its own snapshot, a site peer "over
  torch.distributed", a holder "through the object store"), and writes and loads *real*
  checkpoint shards (safetensors files or in-memory shard bytes, float64 tensors) with the
  checkpoint package.
* site stores are the real :class:`~geopipe.runtime.storage.sitestore.SiteStore` on real
  directories; the calls it makes to other actors (pulling a shard from a stage replica or
  from another store) go to the fake actors directly and synchronously.

A call runs when it is made if it can (its actor answers, its arguments are ready);
else — and always for a step (``run_iteration``) — :meth:`wait` and :meth:`get` run what
can run, in call order, until nothing more can. So a step's calls are all started before
any of them answers, as on Ray, where a death in the step leaves the others blocked, and
an answer given before a death stays an answer.

Fault injection (:meth:`FakeWorkers.inject`, matched on the actor's name; and
:meth:`outage`, :meth:`hold`):

* ``die_at_step=N``: the process dies when its step ``N`` is started (:class:`WorkerLost`);
  the step's other calls block until aborted, as peers waiting on a dead replica do;
* ``freeze_at_step=N`` / ``freeze_in_save=N``: the process stops answering anything (pings
  included) from its step ``N`` on, or right after ``save_shard(N)`` returned (its shard
  is never written) — until killed;
* ``die_in_save=N``: dies after ``save_shard(N)`` returned, its shard unwritten;
* ``die_on="method"``: dies when that method is called (e.g. during a recovery);
* ``freeze_on="method"``: stops answering anything (pings included) when that method is
  called, the call itself never answered -- until killed;
* ``raise_on={"method": "message"}``: the method raises (:class:`WorkerFailed`);
* ``block_save=N``: its shard of step ``N`` is never written, though it answers pings;
* ``hold_until_step=S`` with a death: its device stays taken (its node is gone) until step
  ``S`` starts;
* :meth:`outage`: every actor of a site is silent for ``seconds`` from a step's start
  (a WAN outage as the driver sees it), then answers again;
* :meth:`hold`: devices taken by something else, free again from a given step on.

A call that would block forever (a wait without timeout on something that never answers)
raises :class:`FakeHang` after ``max_block_s`` instead of hanging the test.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from geopipe.runtime.actor.stage import StageWorker
from geopipe.runtime.control.cluster import ClusterInfo, site_resource
from geopipe.runtime.control.workers import (
    CallTimeout,
    NameTaken,
    SiteStoreActor,
    SpawnOptions,
    StageActor,
    WorkerFailed,
    WorkerLost,
)
from geopipe.runtime.storage.sitestore import SiteStore
from tests.unit.fake_actors import (
    FakeStage,
    FakeStore,
    _Block,
    reference_losses,
    reference_state,
    sample_loss,
)

__all__ = [
    "FakeHang",
    "FakeStage",
    "FakeWorkers",
    "Fault",
    "reference_losses",
    "reference_state",
    "sample_loss",
]


# -- faults ------------------------------------------------------------------------------------
@dataclass
class Fault:
    match: str  # a substring of the actor's name (e.g. "stage1/r1")
    die_at_step: int | None = None
    freeze_at_step: int | None = None
    freeze_in_save: int | None = None
    die_in_save: int | None = None
    die_on: str | None = None
    freeze_on: str | None = None  # stops answering (pings too) when this method is called
    raise_on: dict[str, str] = field(default_factory=dict)
    block_save: int | None = None  # its shard of this step is never written (it answers)
    hold_until_step: int | None = None  # dead, its device stays taken until this step
    used: bool = False  # applies to the first matching actor only


class FakeHang(BaseException):
    """A wait on the fake would never end (the real run would hang there). Not an
    ``Exception``: the driver's best-effort ``except Exception`` must not swallow it."""


class _Die(Exception):
    """Raised by an actor method whose process dies now."""


# -- handles and calls -------------------------------------------------------------------------
class FakeActor:
    """An actor handle. Other actors call it as they would through Ray
    (``handle.method.remote(...)``): directly and synchronously."""

    def __init__(self, world: FakeWorkers, name: str, kind: type, body: Any, opts: SpawnOptions):
        self.world, self.name, self.kind, self.body, self.opts = world, name, kind, body, opts
        self.dead: str | None = None  # why the process is gone
        self.frozen = False
        self.site = body.site
        self.fault: Fault | None = None

    def __repr__(self) -> str:
        return f"<FakeActor {self.name}{' dead' if self.dead else ''}>"

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        world = self.world
        return type("_M", (), {"remote": lambda _s, *a: world.direct(self, method, a)})()


class FakePending:
    _ids = itertools.count()

    def __init__(self, actor: FakeActor, method: str, args: tuple, kwargs: dict) -> None:
        self.id = next(self._ids)
        self.actor, self.method, self.args, self.kwargs = actor, method, args, kwargs
        self.issued = time.monotonic()
        self.broken = False  # a step call whose peers died or froze: it waits for an abort
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        state = "error" if self.error else ("done" if self.done else "pending")
        return f"<{self.actor.name}.{self.method}{self.args[:2]} {state}>"

    def result(self) -> Any:
        if self.error is not None:
            raise type(self.error)(str(self.error))
        return self.value


_STAGE_METHODS = {n for n in vars(StageActor) if not n.startswith("_")}
_STEP_CALLS = ("run_iteration", "run_iterations")  # a step, or a span of steps


def _steps_of(p: FakePending) -> range:
    """The steps a step call runs: ``run_iteration(step)``, ``run_iterations(start, count)``."""
    return range(p.args[0], p.args[0] + (p.args[1] if p.method == "run_iterations" else 1))


_STORE_METHODS = {n for n in vars(SiteStoreActor) if not n.startswith("_")}


class FakeWorkers:
    """:class:`~geopipe.runtime.control.workers.Workers` in this process (module docstring)."""

    ray_metrics = False

    def __init__(
        self,
        step_s: float = 0.0,
        max_block_s: float = 10.0,
        resources: dict[str, float] | None = None,
    ) -> None:
        self.step_s = step_s  # how long each step's calls take to answer
        self.max_block_s = max_block_s
        self.lock = threading.RLock()  # ChaosMonkey kills from a timer thread
        self.spec: Any = None
        self._total: dict[str, float] = dict(resources or {})  # {}: the spec's sites
        self._connected = False
        self.actors: list[FakeActor] = []  # every actor made, in order
        self._outstanding: list[FakePending] = []
        self.calls: list[tuple[str, str]] = []  # (actor name, method) of every call
        self.killed: list[str] = []  # names, in the order the driver killed them
        self.faults: list[Fault] = []
        self.outages: list[dict] = []  # {"site", "at_step", "seconds", "start", "end"}
        self.holds: list[dict] = []  # {"site", "n", "until_step"}
        self._breaking: int | None = None  # a step whose calls, issued until the next
        # wait, are broken: a death or freeze struck while the driver was starting it
        self._starting = False  # a step's calls are being started (no wait since)
        self.max_step = -1  # the newest step started
        self.worlds: dict[Any, dict[int, FakeStage]] = {}  # master address -> rank -> stage
        self.samples: dict[int, dict[int, list[int]]] = {}  # step -> stage -> samples seen
        self.violations: list[str] = []  # what a real engine would have got wrong
        self._ports = itertools.count(20000)

    # -- faults --------------------------------------------------------------------------------
    def inject(self, match: str, **fault: Any) -> Fault:
        f = Fault(match, **fault)
        self.faults.append(f)
        for a in self.actors:  # an actor already made takes it too
            if a.fault is None and not a.dead and match in a.name:
                a.fault, f.used = f, True
                break
        return f

    def outage(self, site: str, at_step: int, seconds: float) -> None:
        self.outages.append(
            {"site": site, "at_step": at_step, "seconds": seconds, "start": None, "end": None}
        )

    def hold(self, site: str, n: int = 1, until_step: int | None = None) -> None:
        """``n`` of ``site``'s devices are taken (not by the run) until step ``until_step``
        starts (None: until :meth:`release`)."""
        self.holds.append({"site": site, "n": n, "until_step": until_step})

    def release(self, site: str | None = None) -> None:
        self.holds = [h for h in self.holds if site is not None and h["site"] != site]

    def live(self, kind: type = StageWorker) -> list[FakeActor]:
        return [a for a in self.actors if not a.dead and a.kind is kind]

    # -- the cluster ---------------------------------------------------------------------------
    def connect(self, spec: Any) -> ClusterInfo:
        self.spec, self._connected = spec, True
        if not self._total:
            self._total = {site_resource(s.name): float(s.devices) for s in spec.sites}
            self._total["CPU"] = 2.0
        return ClusterInfo("fake", None, False)

    def connected(self) -> bool:
        return self._connected

    def resources(self) -> dict[str, float]:
        return dict(self._total)

    def available(self) -> dict[str, float]:
        with self.lock:
            free = dict(self._total)
            for a in self.actors:
                f = a.fault
                held = f is not None and f.hold_until_step is not None
                if not a.dead or (held and self.max_step < f.hold_until_step):
                    for r, n in (a.opts.resources or {}).items():
                        free[r] = free.get(r, 0.0) - n
            for h in self.holds:
                if h["until_step"] is None or self.max_step < h["until_step"]:
                    key = site_resource(h["site"])
                    free[key] = free.get(key, 0.0) - h["n"]
            return free

    def shutdown(self) -> None:
        self._connected = False

    def wait_released(self, names: list[str], namespace: str) -> list[str]:
        return []

    # -- actors --------------------------------------------------------------------------------
    def spawn(self, cls: type, args: tuple, opts: SpawnOptions) -> FakeActor:
        with self.lock:
            if any(a.name == opts.name and not a.dead for a in self.actors):
                raise NameTaken(f"actor {opts.name} already exists")
            if cls is StageWorker:
                body: Any = FakeStage(args[0], self)
            elif cls is SiteStore:
                body = FakeStore(args, self)
            else:
                raise TypeError(f"the fake makes no {cls.__name__}")
            actor = FakeActor(self, opts.name, cls, body, opts)
            body.handle = actor
            self.actors.append(actor)
            for f in self.faults:
                if not f.used and f.match in opts.name:
                    actor.fault, f.used = f, True
                    break
            if isinstance(body, FakeStore) and body.error is not None:
                actor.dead = f"the actor died in its creation task: {body.error}"
            return actor

    def call(self, actor: FakeActor, method: str, *args: Any, **kwargs: Any) -> FakePending:
        known = _STAGE_METHODS if actor.kind is StageWorker else _STORE_METHODS
        if method not in known:
            raise AssertionError(f"{method} is not in the seam's protocol for {actor.kind}")
        with self.lock:
            p = FakePending(actor, method, args, kwargs)
            self.calls.append((actor.name, method))
            if method in _STEP_CALLS:  # answers once the step's calls are all started
                self._outstanding.append(p)
                self._step_started(actor, _steps_of(p))
                p.broken = p.broken or self._breaking in _steps_of(p)
            elif not self._try(p):  # anything else is answered at once if it can be
                self._outstanding.append(p)
            return p

    def _step_started(self, actor: FakeActor, steps: range) -> None:
        """Faults that strike when a step (or a span of them: ``run_iterations``) starts; a
        death or freeze breaks the step."""
        if not self._starting:  # a new attempt at the steps: what they saw is counted anew
            self._starting = True
            for step in steps:
                self.samples[step] = {}
        self.max_step = max(self.max_step, steps[0])
        for o in self.outages:
            if o["start"] is None and o["at_step"] in steps:
                o["start"], o["end"] = time.monotonic(), time.monotonic() + o["seconds"]
        f = actor.fault
        if f is not None and f.die_at_step in steps and not actor.dead:
            self._die(actor, f"the actor died in step {f.die_at_step} (injected)")
        if f is not None and f.freeze_at_step in steps:
            actor.frozen = True
        if actor.dead or actor.frozen:
            self._break(steps[0])

    def _break(self, step: int) -> None:
        """Step ``step`` cannot finish: its calls wait until aborted (peers blocked on a
        replica that will never send, or in a collective it will never join)."""
        self._breaking = step
        for p in self._outstanding:
            if p.method in _STEP_CALLS and step in _steps_of(p):
                p.broken = True

    def kill(self, actor: FakeActor) -> None:
        with self.lock:
            self.killed.append(actor.name)
            if not actor.dead:
                self._die(actor, "the actor was killed (ray.kill)")

    def _die(self, actor: FakeActor, why: str) -> None:
        actor.dead, actor.frozen = why, False
        for p in list(self._outstanding):  # the step it was in cannot finish
            if p.actor is actor and p.method in _STEP_CALLS:
                self._break(p.args[0])
        if isinstance(actor.body, FakeStage):
            actor.body.leave_world()

    def wait(self, pendings: list, num_returns: int = 1, timeout: float | None = None):
        pendings = list(pendings)
        limit = self.max_block_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            self.pump()
            done = [p for p in pendings if p.done]
            if len(done) >= num_returns or time.monotonic() >= deadline:
                break
            time.sleep(min(0.002, max(0.0, deadline - time.monotonic())))
        if len(done) < num_returns and timeout is None:
            raise FakeHang(
                f"waited {limit} s for calls that never answer: "
                f"{[p for p in pendings if not p.done][:4]}"
            )
        ready = done[:num_returns]
        return ready, [p for p in pendings if p not in ready]

    def get(self, pendings: list, timeout: float | None = None) -> list:
        pendings = list(pendings)
        _, rest = self.wait(pendings, len(pendings), timeout)
        if rest:
            raise CallTimeout(f"Get timed out: {len(rest)} call(s) unanswered after {timeout} s")
        return [p.result() for p in pendings]

    def get_one(self, pending: FakePending, timeout: float | None = None) -> Any:
        """What a real site store's ``ray.get`` is in the fake."""
        return pending.result()

    # -- running calls -------------------------------------------------------------------------
    def pump(self) -> None:
        """Run every call that can run now, in call order, until none can."""
        with self.lock:
            self._breaking, self._starting = None, False  # the step's calls are all started
            progress = True
            while progress:
                progress = False
                for p in list(self._outstanding):
                    if self._try(p):
                        self._outstanding.remove(p)
                        progress = True

    def _try(self, p: FakePending) -> bool:
        a = p.actor
        if a.dead:
            p.error, p.done = WorkerLost(f"{a.name}: {a.dead}"), True
            return True
        for arg in p.args:
            if isinstance(arg, FakePending):
                if not arg.done:
                    return False
                if arg.error is not None:
                    p.error, p.done = arg.error, True
                    return True
        if a.frozen or self._silent(a, p.method):
            return False
        args = tuple(x.value if isinstance(x, FakePending) else x for x in p.args)
        try:
            p.value = self._invoke(a, p, args, p.kwargs)
        except _Block:
            return False
        except _Die as exc:
            self._die(a, str(exc))
            p.error = WorkerLost(f"{a.name}: {exc}")
        except (WorkerLost, WorkerFailed, CallTimeout) as exc:  # a call it made failed
            p.error = exc
        except Exception as exc:
            p.error = WorkerFailed(f"{type(exc).__name__}: {exc}")
        p.done = True
        return True

    def _invoke(self, a: FakeActor, p: FakePending, args: tuple, kwargs: dict) -> Any:
        f = a.fault
        if f is not None:
            if f.die_on == p.method:
                raise _Die(f"the actor died in {p.method} (injected)")
            if f.freeze_on == p.method:
                a.frozen = True  # this call, and every later one, never answers
                raise _Block
            if p.method in f.raise_on:
                raise RuntimeError(f.raise_on[p.method])
        if p.method in _STEP_CALLS:
            if p.broken and not a.body.aborted:
                raise _Block  # waits for a peer that will never send, until aborted
            if time.monotonic() < p.issued + self.step_s * len(_steps_of(p)):
                raise _Block
        out = getattr(a.body, p.method)(*args, **kwargs)
        if f is not None and p.method == "save_shard":
            if f.die_in_save == args[1]:
                self._die(a, f"the actor died writing its shard of step {args[1]} (injected)")
            if f.freeze_in_save == args[1]:
                a.frozen = True
        return out

    def _silent(self, a: FakeActor, method: str) -> bool:
        """An outage in progress: its site's actors answer nothing, and no step of a layout
        that spans the site finishes anywhere (its data crosses the silent link) unless
        aborted."""
        now = time.monotonic()
        for o in self.outages:
            if o["start"] is not None and now < o["end"]:
                if a.site == o["site"]:
                    return True
                body = a.body
                if (
                    method in _STEP_CALLS
                    and not body.aborted
                    and o["site"] in body.plan.stage_sites
                ):
                    return True
        return False

    def direct(self, actor: FakeActor, method: str, args: tuple) -> FakePending:
        """An actor calling another one (a store pulling a shard): at once, in this thread."""
        p = FakePending(actor, method, args, {})
        if actor.dead:
            p.error = WorkerLost(f"{actor.name}: {actor.dead}")
        elif actor.frozen or self._silent(actor, method):
            p.error = CallTimeout(f"{actor.name} does not answer")
        else:
            try:
                p.value = getattr(actor.body, method)(*args)
            except Exception as exc:
                p.error = WorkerFailed(f"{type(exc).__name__}: {exc}")
        p.done = True
        return p

    # -- site worlds ("torch.distributed" inside a site) ---------------------------------------
    def join(self, master: Any, rank: int, stage: FakeStage) -> None:
        self.worlds.setdefault(tuple(master), {})[rank] = stage

    def member(self, master: Any, rank: int) -> FakeStage:
        return self.worlds[tuple(master)][rank]

    def port(self) -> int:
        return next(self._ports)
