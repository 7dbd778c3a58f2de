"""An in-process worker group: the driver's seam (geopipe/runtime/control/workers.py) without Ray.

:class:`FakeWorkers` implements :class:`~geopipe.runtime.control.workers.Workers`. Its
actors are plain Python objects in this process:

* :class:`FakeStage` stands in for a ``StageWorker``. Its "model" is one number per layer
  (with two Adam-like moments) that every optimizer step updates by a pure function of
  (step, layer) (:func:`update`), so the state after N steps is known without running
  anything (:func:`reference_state`), whatever layouts, recoveries and restores the run
  went through; a step applied to the wrong state, twice or not at all shows in the final
  state. Each micro-batch's loss is a pure function of its samples (:func:`sample_loss`),
  and the samples each stage saw are recorded, so a test can check that every step covered
  the global batch exactly once. It keeps boundary snapshots, reconfigures, hands state
  over (its own snapshot, a site peer "over torch.distributed", a holder "through the
  object store"), and writes and loads *real* checkpoint shards (safetensors files or
  in-memory shard bytes, float64 tensors) with the checkpoint package.
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
import math
import threading
import time
import zlib
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from geopipe.checkpoint.format import ADAM_STATE_GROUPS
from geopipe.runtime.actor.executor import IterationResult
from geopipe.runtime.actor.stage import StageSpec, StageWorker
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

__all__ = [
    "FakeHang",
    "FakeStage",
    "FakeWorkers",
    "Fault",
    "reference_losses",
    "reference_state",
    "sample_loss",
]

Vals = tuple[float, float, float]  # a parameter, its first and second moment


# -- the fake model ----------------------------------------------------------------------------
def layer_name(i: int) -> str:
    return f"layers.{i}.w"


def _h(text: str) -> int:
    return zlib.crc32(text.encode())


def initial(name: str, seed: int) -> Vals:
    return ((_h(f"{seed}/{name}") % 1000) / 1000, 0.0, 0.0)


def update(v: Vals, step: int, name: str) -> Vals:
    """One optimizer step of parameter ``name``: a pure function of (state, step, name)."""
    g = ((_h(f"{step}/{name}") % 2001) - 1000) / 1000
    m = 0.9 * v[1] + 0.1 * g
    s = 0.99 * v[2] + 0.01 * g * g
    return (v[0] - 0.01 * m / (math.sqrt(s) + 1e-8), m, s)


def reference_state(n_layer: int, steps: int, seed: int) -> dict[str, Vals]:
    """Every parameter after ``steps`` uninterrupted steps."""
    out = {}
    for i in range(n_layer):
        name, v = layer_name(i), initial(layer_name(i), seed)
        for s in range(steps):
            v = update(v, s, name)
        out[name] = v
    return out


def sample_loss(step: int, index: int) -> float:
    return 1.0 / (1 + step) + (_h(f"{step}:{index}") % 1000) / 1e6


def reference_losses(global_batch: int, steps: int) -> list[float]:
    """Each step's mean loss over its global batch (samples ``s*B .. (s+1)*B - 1``)."""
    return [
        sum(sample_loss(s, s * global_batch + i) for i in range(global_batch)) / global_batch
        for s in range(steps)
    ]


@dataclass
class _State:
    """A replica's engine: its held parameters and the step counters."""

    values: dict[str, Vals]
    step: int
    lr_step: int

    def copy(self) -> _State:
        return _State(dict(self.values), self.step, self.lr_step)


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


class _Block(Exception):
    """Raised by an actor method that cannot run yet (it waits on something)."""


class _Die(Exception):
    """Raised by an actor method whose process dies now."""


@cache
def _digest(data: str, max_bytes: int) -> str:
    from geopipe.model.data import open_corpus

    return open_corpus(data, max_bytes=max_bytes).digest


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


# -- the actors --------------------------------------------------------------------------------
class FakeStage:
    """A stage replica: a StageWorker's driver-facing behaviour over the fake model."""

    def __init__(self, spec: StageSpec, world: FakeWorkers) -> None:
        self.world = world
        self.handle: FakeActor | None = None
        self.state: _State | None = None  # None: no engine (before setup, after leave)
        self.boundaries: dict[int, _State] = {}
        self.aborted = False
        self.master: Any = None
        self._saves: dict[int, tuple[str | None, _State]] = {}  # step -> (dir, state)
        self._blobs: dict[int, bytes] = {}  # in-memory shards (per-site copies)
        self._last_save: int | None = None
        self._written: dict[int, Any] = {}  # step -> the writer's ShardInfo
        self.sent: list[tuple[int, int]] = []  # outer sends a span made (steps done, fragment)
        self.outer_calls: list[tuple] = []  # a span's applies ((kind, steps done, fragment))
        self.configure(spec)

    def configure(self, spec: StageSpec) -> None:
        self.spec, self.plan, self.k = spec, spec.plan, spec.stage
        self.site = spec.plan.stage_sites[spec.stage]
        self.layers = tuple(spec.plan.partition[spec.stage])
        held = tuple(spec.hold) if spec.hold is not None else self.layers
        self.held = [layer_name(i) for i in range(*held)]
        self.own = [layer_name(i) for i in range(*self.layers)]

    # lifecycle
    def ping(self) -> int:
        return 4242

    def clock_skews(self) -> dict[str, tuple[float, float]]:
        return {}  # in-process: no WAN handshake, nothing measured

    def abort(self) -> None:
        self.aborted = True

    def leave(self) -> None:
        self.state = None
        self._saves, self._blobs, self._written = {}, {}, {}
        self.leave_world()

    def leave_world(self) -> None:
        for members in self.world.worlds.values():
            for rank, st in list(members.items()):
                if st is self:
                    del members[rank]

    def reducing(self) -> bool:
        return False

    def node_id(self) -> str:
        return f"node-{self.site}"

    def data_digest(self) -> str | None:
        if self.k not in (0, self.plan.num_stages - 1):
            return None
        return _digest(self.spec.data, self.spec.data_max_bytes)

    # wiring
    def listen(self) -> tuple[str, int]:
        return ("fake", self.world.port())

    def endpoint(self) -> tuple[str, int]:
        return ("fake-master", self.world.port())

    def setup(self, master: Any, site_rank: int, site_world: int, *rest: Any, **kw: Any) -> float:
        seed = self.spec.seed
        self.state = _State({n: initial(n, seed) for n in self.held}, 0, 0)
        self.aborted, self.master = False, tuple(master)
        self.world.join(master, site_rank, self)
        return 0.001

    def reconfigure(self, spec: StageSpec) -> tuple[int, tuple[int, int]]:
        before = (self.k, self.layers)
        if self.state is not None:
            self.leave()
        self.configure(spec)
        return before

    def probe_link(self, address: Any, link: Any, sizes: list[int]) -> dict:
        return {"rtt_s": 0.05, "ping_sent": [0.0, 1.0], "pong_in": [0.05, 1.05]}

    def probe_echo(self, address: Any, link: Any, sizes: list[int]) -> dict:
        arrivals = list(itertools.accumulate([0.0] + [n * 8 / 1e8 for n in sizes[1:]]))
        return {"arrivals": arrivals, "ping_in": [0.025, 1.025], "pong_sent": [0.025, 1.025]}

    def codec_speeds(self, codecs: list[str]) -> dict[str, float]:
        return dict.fromkeys(codecs, 1.0)

    # training
    def run_iteration(self, step: int, record: bool = False) -> IterationResult:
        if self.aborted:
            raise RuntimeError(f"step {step} aborted: a peer failed")
        st = self.state
        if st is None or st.step != step or set(st.values) != set(self.held):
            why = f"{self.handle.name}: step {step} on " + (
                "no engine" if st is None else f"the state of step {st.step}"
            )
            self.world.violations.append(why)
            raise RuntimeError(why)
        for n in self.held:
            st.values[n] = update(st.values[n], step, n)
        st.step, st.lr_step = step + 1, st.lr_step + 1
        if self.spec.recovery_snapshots:
            self._take(step + 1)
        return self._result(step, record)

    def run_iterations(
        self, start: int, count: int, record: list, sends: dict, applies: dict | None = None
    ) -> list:
        """A span of steps (:mod:`geopipe.runtime.actor.inner_run`); the fake has no outer
        state, so a send and an apply are only noted (``sent``: (steps done, fragment);
        ``outer_calls``: ("apply", steps done, fragment))."""
        out = []
        for step in range(start, start + count):
            res = self.run_iteration(step, step in record)
            if step + 1 in sends:
                self.sent.append((step + 1, sends[step + 1]))
                res.outer_sent = {"fragment": sends[step + 1], "payload_bytes": 0}
            if applies and step + 1 in applies:
                self.outer_calls.append(("apply", step + 1, applies[step + 1]))
            out.append(res)
        return out

    def _result(self, step: int, record: bool) -> IterationResult:
        from geopipe.model.data import group_sample_indices

        plan, spec = self.plan, self.spec
        m, b = plan.num_microbatches, plan.micro_batch_size
        first = spec.first_microbatch
        if first is None:
            first = spec.replica * m
        batches = [
            group_sample_indices(
                step, spec.global_batch, spec.group, spec.groups, first + mb, b, spec.group_start
            )
            for mb in range(m)
        ]
        seen = self.world.samples.setdefault(step, {}).setdefault(self.k, [])
        seen.extend(i for mb in batches for i in mb)
        last = self.k == plan.num_stages - 1
        losses = [sum(sample_loss(step, i) for i in mb) / len(mb) for mb in batches] if last else []
        n = len(self.own)
        f, bw = 1e-3 * n * m, 2e-3 * n * m
        parts = {"forward": f, "backward": bw, "optimizer": 1e-3, "snapshot": 1e-4}
        duration = sum(parts.values()) + 1e-3
        crosses = plan.num_stages > 1 and len(set(plan.stage_sites)) > 1
        events = []
        if record:
            t = 0.0
            for mb in range(m):
                events += [("F", mb, t, t + f / m), ("B", mb, t + f / m, t + (f + bw) / m)]
                t += (f + bw) / m
        return IterationResult(
            stage=self.k,
            replica=spec.replica,
            step=step,
            losses=losses,
            busy_s=f + bw + 1e-3,
            wait_s=0.0,
            duration_s=duration,
            start=time.monotonic(),
            wan_bytes=1000 * m if crosses else 0,
            micro_batches=m,
            optimizer_steps=1,
            events=events,
            breakdown={**parts, "other": 1e-3},
            lr=0.01,
            grad_norm=1.0,
        )

    def set_delta_n(self, delta_n: list[int]) -> None:
        self.plan = replace(self.plan, delta_n=tuple(delta_n))

    # held-out evaluation: the last stage reports one loss (its step count) per evaluation
    def set_eval(self, setup: Any) -> None:
        self.eval_setup = setup

    def run_eval(self, step: int) -> dict[str, Any]:
        last = self.k == self.plan.num_stages - 1
        spec = self.spec
        losses = [float(step)] if last else []
        return {"stage": self.k, "pipeline": spec.replica, "group": spec.group, "losses": losses}

    def set_codecs(self, fallbacks: list) -> None:
        from geopipe.optimizer.codec_guard import apply_fallbacks

        self.plan = apply_fallbacks(self.plan, fallbacks)

    def full_state(self) -> dict:
        st = self.state
        return {
            **{g: {n: v[i] for n, v in st.values.items()} for i, g in enumerate(ADAM_STATE_GROUPS)},
            "step": st.step,
            "lr_step": st.lr_step,
        }

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict.fromkeys(self.held, (1,))

    # step boundaries
    def _take(self, step: int) -> None:
        self.boundaries[step] = self.state.copy()
        for old in sorted(self.boundaries)[:-2]:  # SNAPSHOTS_KEPT
            del self.boundaries[old]

    def snapshot(self, step: int) -> None:
        if step not in self.boundaries:
            self._take(step)

    def boundary_steps(self) -> list[int]:
        return sorted(self.boundaries)

    def boundary_names(self, step: int) -> list[str]:
        return list(self.boundaries[step].values)

    def boundary_subset(self, step: int, names: list[str]) -> _State:
        st = self.boundaries[step]
        return _State({n: st.values[n] for n in names}, st.step, st.lr_step)

    def drop_boundaries(self) -> None:
        self.boundaries = {}

    def restore_boundary(self, step: int, todo: Any, fetch: list) -> dict[str, int]:
        parts = [self.boundary_subset(step, todo.own)] if todo.own else []
        p2p = obj = 0
        for rank, names in todo.recvs:  # a site peer "over torch.distributed"
            parts.append(self.world.member(self.master, rank).boundary_subset(step, names))
            p2p += 12 * len(names)
        for holder, names in fetch:  # "through the object store"
            parts.append(holder.boundary_subset.remote(step, names).result())
            obj += 12 * len(names)
        if len({(p.step, p.lr_step) for p in parts}) > 1:
            raise RuntimeError(f"hand-off mixes steps {sorted({p.step for p in parts})}")
        values = {n: v for p in parts for n, v in p.values.items()}
        self.state = _State(values, parts[0].step, parts[0].lr_step)
        return {"own": len(todo.own), "p2p_bytes": p2p, "object_store_bytes": obj}

    # checkpoints
    def sees_file(self, path: str, content: str) -> bool:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read() == content
        except OSError:
            return False

    def save_shard(self, directory: str | None, step: int) -> float:
        """Snapshot, then write the shard "in the background" — at once, as a real writer
        thread does well before the next step ends — unless a fault stops the write."""
        if step not in self.boundaries:
            self._take(step)
        self._saves[step] = (directory, self.boundaries[step])
        self._last_save = step
        if not self.spec.recovery_snapshots:
            del self.boundaries[step]
        f = self.handle.fault
        stopped = f is not None and step in (f.block_save, f.die_in_save, f.freeze_in_save)
        if self.spec.replica == 0 and not stopped:
            self._written[step] = self._write(step)
        return 0.001

    def _write(self, step: int) -> Any:
        info, blob = self._shard(step)
        if blob is not None:
            self._blobs[step] = blob
        return info

    def _shard(self, step: int) -> tuple[Any, Any]:
        import torch

        from geopipe.checkpoint.writer import shard_bytes, write_shard_file

        directory, st = self._saves[step]
        tensors = {
            f"{g}/{n}": torch.tensor([st.values[n][i]], dtype=torch.float64)
            for i, g in enumerate(ADAM_STATE_GROUPS)
            for n in self.own
        }
        meta = {"adam_step": st.step, "lr_step": st.lr_step, "layers": list(self.layers)}
        if directory is not None:
            return write_shard_file(directory, self.k, tensors, meta), None
        blob, info = shard_bytes(self.k, tensors, meta)
        return info, blob

    def shard_written(self) -> Any:
        if self.spec.replica != 0:
            return None
        if self._last_save not in self._written:
            raise _Block  # a write that never ends
        return self._written[self._last_save]

    def write_shard_instead(self, step: int) -> Any:
        if not self.spec.stand_in_writer:
            raise RuntimeError(f"stage {self.k} cannot write this stage's shard")
        return self._write(step)

    def release_shard(self, step: int) -> None:
        self._blobs.pop(step, None)
        self._saves.pop(step, None)
        self._written.pop(step, None)

    def chunk_address(self) -> None:
        return None  # no data plane in the fake: stores pull through "Ray" calls

    def read_chunk(self, step: int, file: str, offset: int, size: int) -> bytes:
        return self._blobs[step][offset : offset + size]

    def load_checkpoint(self, path: str) -> int:
        from geopipe.checkpoint.store import load_checkpoint, load_state_for_layers

        ckpt = load_checkpoint(path)
        got = load_state_for_layers(ckpt, self.held)
        values = {n: tuple(float(got[g][n][0]) for g in ADAM_STATE_GROUPS) for n in self.held}
        self.state = _State(values, ckpt.step, ckpt.step)
        return ckpt.step


class FakeStore:
    """A site's checkpoint store: the real :class:`SiteStore` on a real directory, whose
    calls to other actors go to the fake ones (``get`` is the store's own seam for that)."""

    def __init__(self, args: tuple, world: FakeWorkers) -> None:
        self.site = args[0]
        self.handle: FakeActor | None = None
        self.error: str | None = None
        try:
            self.inner: Any = SiteStore(*args)
            self.inner.get = world.get_one
        except Exception as exc:  # as a Ray actor whose constructor raised: dead on arrival
            self.inner, self.error = None, f"{type(exc).__name__}: {exc}"

    def chunk_address(self) -> tuple[str, int]:
        raise RuntimeError("no data plane in the fake")

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_") or self.inner is None:
            raise AttributeError(method)
        return getattr(self.inner, method)
