"""The fake worker group's actors (:mod:`tests.unit.fakes`): the fake model -- one number per
layer, updated by a pure function of (step, layer), so the state after N steps is known
without running anything -- and :class:`FakeStage` and :class:`FakeStore`, the stand-ins
for a ``StageWorker`` and a site store that :class:`~tests.unit.fakes.FakeWorkers` holds."""

from __future__ import annotations

import itertools
import math
import time
import zlib
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, Any

from geopipe.checkpoint.format import ADAM_STATE_GROUPS
from geopipe.runtime.actor.executor import IterationResult
from geopipe.runtime.actor.stage import StageSpec
from geopipe.runtime.storage.sitestore import SiteStore

if TYPE_CHECKING:
    from tests.unit.fakes import FakeActor, FakeWorkers

__all__ = [
    "FakeStage",
    "FakeStore",
    "layer_name",
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


class _Block(Exception):
    """Raised by an actor method that cannot run yet (it waits on something)."""


@cache
def _digest(data: str, max_bytes: int) -> str:
    from geopipe.model.data import open_corpus

    return open_corpus(data, max_bytes=max_bytes).digest


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
