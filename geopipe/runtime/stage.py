"""StageWorker: one pipeline-stage replica as a Ray actor.

Each iteration the worker executes exactly the action list the planner produced for its
stage (:mod:`geopipe.pipeline.schedule`, the same IR the simulator replays):

* ``F m``: forward micro-batch ``m`` (the first stage reads its tokens from the
  deterministic stream; the others take the activation that arrived);
* ``B m``: the last stage back-propagates its loss; the others back-propagate the gradient
  received from downstream (surrogate backward, see :mod:`geopipe.runtime.engine`);
* ``SEND_*``: hand the tensor to the channel and go on (transfer overlaps compute);
* ``RECV_*``: wait for the message, which the transport has been receiving meanwhile.

The replicas of a stage inside one site form its DeepSpeed ZeRO-1 group. Each site has its
own ``torch.distributed`` world, so gradient reduction cannot cross a WAN link by
construction; inter-site traffic goes over Ray through coded channels.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from geopipe.model.data import Corpus, TokenStream, global_indices
from geopipe.model.gpt import GPTConfig
from geopipe.optimizer.memory import SNAPSHOTS_KEPT
from geopipe.pipeline.schedule import Kind, make_schedule
from geopipe.plan import Plan
from geopipe.transport.channel import Inbox, P2PReceiver, P2PSender, WanSender
from geopipe.transport.link import LinkParams

__all__ = ["StageSpec", "StageWorker", "WanPeer"]

_F, _B, _SF, _RF, _SB, _RB = (int(k) for k in Kind)
_STATE_TAG = 7 << 20  # p2p tags of the state hand-off; iterations use small tags


@dataclass(frozen=True)
class WanPeer:
    """How this replica reaches its neighbour in another site."""

    codec: str
    link: LinkParams | None  # None: no emulation (the WAN is real)


@dataclass(frozen=True)
class StageSpec:
    """Everything one stage replica needs; plain data so Ray can ship it."""

    run: str
    stage: int
    replica: int
    plan: dict
    model: dict  # GPTConfig fields
    engine: dict  # EngineConfig fields
    global_batch: int
    seed: int
    data: str
    data_max_bytes: int
    topk_ratio: float = 0.01
    up_wan: WanPeer | None = None  # set when the upstream neighbour is in another site
    down_wan: WanPeer | None = None
    recv_timeout_s: float = 600.0
    extra: dict = field(default_factory=dict)


class StageWorker:
    """The actor body (wrapped with ``ray.remote`` by the controller)."""

    def __init__(self, spec: StageSpec) -> None:
        from concurrent.futures import ThreadPoolExecutor

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        self.engine = None
        # One thread runs every job on the checkpoint communicator (boundary snapshots,
        # checkpoint shards), in submission order — the same order on every replica.
        self._keeper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-keeper")
        # Shard files are written on their own thread: a slow disk must not hold up the
        # keeper's gathers, in which the other replicas wait for this one.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self._boundary: dict[int, Any] = {}  # step -> Future of the full state at that step
        self._fault: tuple[int, float] | None = None  # see inject_fault
        self._fault_write_delay_s = 0.0  # see inject_fault
        self._configure(spec)

    def _configure(self, spec: StageSpec) -> None:
        """(Re)build everything that depends on the plan: program, data, channels."""
        self.spec = spec
        self.plan = Plan.from_dict(spec.plan)
        k, p = spec.stage, self.plan.num_stages
        self.k, self.p = k, p
        self.first, self.last = k == 0, k == p - 1
        self.model_cfg = GPTConfig(**spec.model)
        sched = make_schedule(self.plan.schedule, p, self.plan.num_microbatches, self.plan.delta_n)
        self.program = list(zip(*sched.programs[k], strict=True))
        self.layers = tuple(self.plan.partition[k])
        self.stream: TokenStream | None = None
        if self.first or self.last:
            self.stream = TokenStream(Corpus(spec.data, max_bytes=spec.data_max_bytes), spec.seed)
        self.inbox = Inbox()
        self.up_send: Any = None
        self.down_send: Any = None
        self.up_recv: P2PReceiver | None = None
        self.down_recv: P2PReceiver | None = None
        self.shape = (self.plan.micro_batch_size, self.plan.seq_len, self.model_cfg.n_embd)

    def set_delta_n(self, delta_n: list[int]) -> None:
        """Switch to another look-ahead depth between iterations (same layout, new lists)."""
        from dataclasses import replace

        self.plan = replace(self.plan, delta_n=tuple(delta_n))
        sched = make_schedule(
            self.plan.schedule, self.p, self.plan.num_microbatches, self.plan.delta_n
        )
        self.program = list(zip(*sched.programs[self.k], strict=True))

    # -- wiring ------------------------------------------------------------------------------
    def endpoint(self) -> tuple[str, int]:
        """An address and a free port, for the site's rendezvous (asked of its rank 0)."""
        ip = _local_ip()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(
        self,
        master: tuple[str, int],
        site_rank: int,
        site_world: int,
        groups: list[list[int]],
        my_group: int,
        up_rank: int | None,
        down_rank: int | None,
        up_actor: Any = None,
        down_actor: Any = None,
        timeout_s: float = 600.0,
    ) -> float:
        """Join the site's process group, build the ZeRO-1 engine and the channels."""
        from geopipe.runtime.engine import EngineConfig, StageEngine, init_process_group

        t0 = time.perf_counter()
        init_process_group(site_rank, site_world, master[0], master[1], timeout_s)
        self.engine = StageEngine(
            self.model_cfg, self.layers, groups, my_group, EngineConfig(**self.spec.engine)
        )
        s = self.spec
        if up_rank is not None:
            self.up_send = P2PSender(up_rank)
            self.up_recv = P2PReceiver(up_rank, self.inbox)
        elif up_actor is not None:
            self.up_send = WanSender(
                _poster(up_actor), s.up_wan.codec, "backward", s.up_wan.link, s.topk_ratio
            )
        if down_rank is not None:
            self.down_send = P2PSender(down_rank)
            self.down_recv = P2PReceiver(down_rank, self.inbox)
        elif down_actor is not None:
            self.down_send = WanSender(
                _poster(down_actor), s.down_wan.codec, "forward", s.down_wan.link, s.topk_ratio
            )
        return time.perf_counter() - t0

    def deliver(self, key: tuple, sealed: Any, deliver_at: float) -> None:
        """Inter-site arrival (called by the neighbour over Ray, on another thread)."""
        self.inbox.deliver_sealed(key, sealed, deliver_at)

    # -- one iteration -------------------------------------------------------------------------
    def _batch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.plan
        idx = global_indices(
            step, self.spec.global_batch, self.spec.replica, plan.pipelines, mb,
            plan.micro_batch_size,
        )  # fmt: skip
        return self.stream.batch(idx, plan.seq_len)

    def run_iteration(self, step: int, record: bool = False) -> dict:
        """Execute this stage's action list for optimizer step ``step``."""
        m = self.plan.num_microbatches
        t_start = time.monotonic()
        if self.up_recv is not None:
            self.up_recv.start(
                [(("F", step, mb), 2 * mb, self.shape) for c, mb in self.program if c == _RF]
            )
        if self.down_recv is not None:
            self.down_recv.start(
                [(("B", step, mb), 2 * mb + 1, self.shape) for c, mb in self.program if c == _RB]
            )
        events: list[tuple[str, int, float, float]] = []
        losses: list[float] = []
        inputs: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        outs: dict[int, torch.Tensor] = {}
        busy = wait = 0.0
        wan_bytes = 0
        timeout = self.spec.recv_timeout_s
        eng = self.engine
        sends = [i for i, (c, _) in enumerate(self.program) if c in (_SF, _SB)]
        for i, (c, mb) in enumerate(self.program):
            if self._fault is not None and self._fault[0] == step and sends and i == sends[-1]:
                time.sleep(self._fault[1])
                os._exit(1)  # the injected failure: a process dying mid-iteration
            t0 = time.monotonic()
            if c == _RF:
                inputs[mb] = self.inbox.get(("F", step, mb), timeout=timeout)
            elif c == _RB:
                grads[mb] = self.inbox.get(("B", step, mb), timeout=timeout)
            elif c == _F:
                x = self._batch(step, mb)[0] if self.first else inputs.pop(mb)
                outs[mb] = eng.forward(mb, x)
            elif c == _B:
                if self.last:
                    losses.append(eng.backward_last(mb, self._batch(step, mb)[1]))
                else:
                    eng.backward(mb, grads.pop(mb))
            elif c == _SF:
                wan_bytes += self._send(self.down_send, ("F", step, mb), outs.pop(mb), 2 * mb)
            else:  # _SB
                wan_bytes += self._send(
                    self.up_send, ("B", step, mb), eng.input_grad(mb), 2 * mb + 1
                )
            t1 = time.monotonic()
            if c in (_F, _B):
                busy += t1 - t0
            elif c in (_RF, _RB):
                wait += t1 - t0
            if record:
                events.append((Kind(c).name, mb, t0 - t_start, t1 - t_start))
            if c == _B and self.first:
                eng.input_grad(mb)  # frees the stored input of micro-batch mb
        outs.clear()
        for ch in (self.up_send, self.down_send):
            if isinstance(ch, P2PSender):
                ch.wait_all()
            elif isinstance(ch, WanSender):
                _wait_refs(ch.flush())
        for r in (self.up_recv, self.down_recv):
            if r is not None:
                r.join()
        if self.spec.extra.get("boundary_snapshots", True):
            self._snapshot_boundary(step + 1)
        t_end = time.monotonic()
        transfers = [t for t in self.inbox.transfers if t[0][1] == step]
        self.inbox.transfers = [t for t in self.inbox.transfers if t[0][1] > step]
        # How much later than the (emulated) link each inbound WAN message became usable.
        excess = {"F": [], "B": []}
        for key, delay in transfers:
            excess[key[0]].append(delay)
        return {
            "stage": self.k,
            "replica": self.spec.replica,
            "step": step,
            "losses": losses,
            "busy_s": busy,
            "wait_s": wait,
            "duration_s": t_end - t_start,
            "start": t_start,
            "wan_bytes": wan_bytes,
            "events": events,
            "optimizer_steps": eng.step_count,
            "transport_excess_s": excess,
            "micro_batches": m,
        }

    @staticmethod
    def _send(ch: Any, key: tuple, tensor: torch.Tensor, tag: int) -> int:
        if isinstance(ch, P2PSender):
            ch.send(tag, tensor)
            return 0
        return ch.send(key, tensor, stream=f"{key[0]}/mb{key[2]}")

    # -- profiling, state, lifecycle -------------------------------------------------------------
    def full_state(self) -> dict:
        return self.engine.full_state()

    def load_full_state(self, state: dict) -> None:
        self.engine.load_full_state(state)

    # -- checkpoints ---------------------------------------------------------------------------
    # -- state at step boundaries: recovery and checkpoints ------------------------------------
    def _snapshot_boundary(self, step: int) -> float:
        """Copy this replica's ZeRO-1 partition now; gather the stage's full state in the
        background (on the checkpoint communicator). Keeps the two newest complete boundaries:
        after a failure every survivor can roll back to the last step boundary all stages
        reached, so no optimizer step is ever half-applied and none is lost."""
        from geopipe.runtime.engine import assemble_snapshot

        t0 = time.perf_counter()
        eng = self.engine
        snap = eng.local_snapshot()
        self._boundary[step] = self._keeper.submit(
            assemble_snapshot, snap, eng.ckpt_group, eng.replicas
        )
        # Keep the newest SNAPSHOTS_KEPT *complete* boundaries (and those still gathering):
        # dropping a complete one for a gather that then fails would leave nothing.
        keep = self.boundary_steps()[-SNAPSHOTS_KEPT:]
        for old in [st for st in self._boundary if self._boundary[st].done()]:
            if old not in keep:
                del self._boundary[old]
        return time.perf_counter() - t0

    def snapshot(self, step: int) -> None:
        """Take the snapshot of boundary ``step`` now (when they are not taken every step)."""
        if step not in self._boundary:
            self._snapshot_boundary(step)

    def boundary_steps(self) -> list[int]:
        """Steps whose full state this replica holds (gathered completely)."""
        return sorted(
            st for st, f in self._boundary.items()
            if f.done() and f.exception() is None
        )  # fmt: skip

    def boundary_state(self, step: int) -> dict:
        return self._boundary[step].result()

    def save_shard(self, directory: str, step: int) -> float:
        """Write this stage's shard of the checkpoint at ``step`` (a step boundary).

        The full state comes from the boundary snapshot taken when the step finished (or is
        taken now), so training stalls at most for a memory copy of the replica's own
        partition; gathering runs on the state-keeper thread, writing on the writer thread.
        Replica 0 writes; the others keep what they need to write in its place.
        Returns the seconds training was stalled.
        """
        from geopipe.checkpoint.store import capture_rng, write_shard_file
        from geopipe.runtime.handoff import GROUPS

        t0 = time.perf_counter()
        if step not in self._boundary:
            self._snapshot_boundary(step)
        future = self._boundary[step]
        codec: dict[str, torch.Tensor] = {}
        for name, ch in (("up", self.up_send), ("down", self.down_send)):
            if isinstance(ch, WanSender):
                for stream, t in ch.codec_state().items():
                    codec[f"codec/{name}/{stream}"] = t.detach().clone()
        rng = capture_rng()
        layers, k = list(self.layers), self.k

        def write_file() -> Any:
            st = future.result()
            tensors = dict(codec)
            for group in GROUPS:
                tensors.update({f"{group}/{n}": t for n, t in st[group].items()})
            meta = {"adam_step": st["step"], "lr_step": st["lr_step"], "layers": layers}
            if self._fault_write_delay_s:
                time.sleep(self._fault_write_delay_s)
            return write_shard_file(directory, k, tensors, meta, rng=rng)

        def write() -> Any:
            future.result()  # every replica takes part in the gather
            if not self.spec.extra.get("boundary_snapshots", True):
                self._boundary.pop(step, None)  # taken for this checkpoint only
            return write_file() if self.spec.replica == 0 else None

        # Any replica holds the gathered state: if replica 0 dies mid-save, another writes.
        self._shard_fallback = (step, write_file)
        self._shard_future = self._writer.submit(write)
        return time.perf_counter() - t0

    def release_shard(self, step: int) -> None:
        """Checkpoint ``step`` is committed: drop the state kept for a stand-in write."""
        if getattr(self, "_shard_fallback", (None,))[0] == step:
            self._shard_fallback = None

    def write_shard_instead(self, step: int) -> Any:
        """Write this stage's shard of checkpoint ``step`` in place of a replica 0 that died
        while saving it (same gathered state); returns its ShardInfo."""
        fallback = getattr(self, "_shard_fallback", None)
        if fallback is None or fallback[0] != step:
            raise RuntimeError(f"no pending shard of step {step} on this replica")
        return fallback[1]()

    def shard_written(self) -> Any:
        """Wait for the background gather/write; returns its ShardInfo (None on non-writers)."""
        future, self._shard_future = getattr(self, "_shard_future", None), None
        return None if future is None else future.result()

    def load_checkpoint(self, path: str) -> int:
        """Load this stage's layers from a checkpoint of any partition; returns its step.

        Parameters and Adam moments are matched by name. RNG and codec state are restored
        only when the checkpoint's stage k held exactly these layers (same partition).
        """
        from geopipe.checkpoint.store import load_checkpoint, load_state_for_layers, restore_rng

        ckpt = load_checkpoint(path, verify=False)  # the controller verified the checksums
        names = [n for n, _ in self.engine.module.named_parameters()]
        state: dict[str, Any] = load_state_for_layers(ckpt, names)
        meta = ckpt.stages[0].meta
        state["step"], state["lr_step"] = int(meta["adam_step"]), int(meta["lr_step"])
        self.engine.load_full_state(state)
        if self.k < len(ckpt.stages) and ckpt.stages[self.k].meta.get("layers") == list(
            self.layers
        ):
            shard = ckpt.stages[self.k]
            rng = shard.rng()
            if rng is not None:
                restore_rng(rng)
            for name, ch in (("up", self.up_send), ("down", self.down_send)):
                if isinstance(ch, WanSender):
                    ch.load_codec_state(shard.tensors(f"codec/{name}/"))
        return ckpt.step

    def ping(self) -> int:
        return os.getpid()

    def data_digest(self) -> str:
        return self.stream.corpus.digest

    def inject_fault(self, step: int, delay_s: float, write_delay_s: float = 0.0) -> None:
        """Fault injection for tests: at ``step``, stall ``delay_s`` before this replica's
        last send, then exit — so its peers get as far as they can without it (e.g. into a
        gradient all-reduce) before it dies. ``write_delay_s`` slows its checkpoint writes
        (to kill it mid-save)."""
        self._fault = (step, delay_s) if delay_s >= 0 else None
        self._fault_write_delay_s = write_delay_s

    def abort(self) -> None:
        """Make a running iteration fail fast (a peer died): waiting receives raise."""
        self.inbox.close()

    def leave(self) -> None:
        """Drop the engine, channels and process group (after a failure). A peer blocked in a
        collective with us is *not* released by this (gloo keeps its connections until the
        process exits): the controller replaces such a peer."""
        from concurrent.futures import ThreadPoolExecutor

        from geopipe.runtime.engine import destroy_process_group

        self.inbox.close()
        for ch in (self.up_send, self.down_send):
            if isinstance(ch, WanSender):
                ch.close()
        # A gather of the old layout may wait forever for a peer that failed before joining
        # it: keep only the boundaries that completed, and start a fresh state keeper.
        self._boundary = {st: self._boundary[st] for st in self.boundary_steps()}
        self._keeper.shutdown(wait=False, cancel_futures=True)
        self._keeper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-keeper")
        self._shard_future = None
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
        destroy_process_group()

    def reconfigure(self, spec: StageSpec) -> tuple[int, tuple[int, int]]:
        """Take the stage this new spec describes; the actor and its memory (the boundary
        snapshots) survive, the engine and channels are rebuilt by the next :meth:`setup`.
        Returns the stage and layers it had."""
        before = (self.k, self.layers)
        if self.engine is not None:
            self.leave()
        self._configure(spec)
        return before

    def drop_boundaries(self) -> None:
        """Forget the snapshots of the layout before a reconfiguration (once all restored)."""
        self._boundary = {}

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self.engine.module.named_parameters()}

    def boundary_names(self, step: int) -> list[str]:
        return list(self._boundary[step].result()["params"])

    def boundary_subset(self, step: int, names: list[str]) -> dict:
        """Part of the step-``step`` snapshot, for a receiver that fetches it through the
        object store (a holder in another site, or outside the new layout)."""
        from geopipe.runtime.handoff import GROUPS

        st = self._boundary[step].result()
        return {
            **{g: {n: st[g][n] for n in names} for g in GROUPS},
            "step": st["step"],
            "lr_step": st["lr_step"],
        }

    def restore_boundary(
        self,
        step: int,
        own: list[str],
        sends: list[tuple[int, list[str]]],
        recvs: list[tuple[int, list[str]]],
        fetch: list[tuple[Any, list[str]]],
    ) -> dict[str, int]:
        """Take part in the hand-off :func:`geopipe.runtime.handoff.plan_handoff` planned:
        keep ``own`` names from this replica's snapshot, send to and receive from site
        ranks over the re-formed ``torch.distributed`` world (all posted at once, so no
        order of calls across actors can deadlock), fetch the rest through the object
        store, then load the merged step-``step`` state. Returns the bytes per path."""
        import ray
        import torch.distributed as dist

        from geopipe.runtime.handoff import GROUPS, flat_size, pack, unpack

        shapes = self.param_shapes()
        dev = self.engine.device if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = self._boundary[step].result() if sends else None
        ops, received, p2p = [], [], 0
        for dst, names in sends:
            header, flat = pack(mine, names)
            ops += [
                dist.P2POp(dist.isend, header.to(dev), dst, tag=_STATE_TAG),
                dist.P2POp(dist.isend, flat.to(dev), dst, tag=_STATE_TAG + 1),
            ]
        for src, names in recvs:
            header = torch.empty(2, dtype=torch.int64, device=dev)
            flat = torch.empty(flat_size(shapes, names), dtype=torch.float32, device=dev)
            ops += [
                dist.P2POp(dist.irecv, header, src, tag=_STATE_TAG),
                dist.P2POp(dist.irecv, flat, src, tag=_STATE_TAG + 1),
            ]
            received.append((names, header, flat))
            p2p += flat.numel() * flat.element_size()
        works = dist.batch_isend_irecv(ops) if ops else []
        parts = ray.get([a.boundary_subset.remote(step, names) for a, names in fetch])
        fetched = sum(t.numel() * t.element_size() for p in parts for t in p["params"].values())
        for work in works:
            work.wait()
        if own:
            parts.append(self.boundary_subset(step, own))
        parts += [unpack(h.cpu(), f.cpu(), names, shapes) for names, h, f in received]
        merged: dict[str, Any] = {g: {} for g in GROUPS}
        for part in parts:
            for g in GROUPS:
                merged[g].update(part[g])
            if merged.setdefault("step", part["step"]) != part["step"]:
                raise RuntimeError(f"hand-off mixes Adam steps {merged['step']} and {part['step']}")
            merged["lr_step"] = part["lr_step"]
        self.engine.load_full_state(merged)
        return {"own": len(own), "p2p_bytes": p2p, "object_store_bytes": 3 * fetched}

    def shutdown(self) -> None:
        from geopipe.runtime.engine import destroy_process_group

        self.inbox.close()
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
        destroy_process_group()


def _poster(actor: Any):
    def post(key: tuple, sealed: Any, deliver_at: float) -> Any:
        return actor.deliver.remote(key, sealed, deliver_at)

    return post


def _wait_refs(refs: list) -> None:
    if refs:
        import ray

        ray.get(refs)
        refs.clear()


def _local_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (tests)
        return "127.0.0.1"
