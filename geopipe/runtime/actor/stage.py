"""StageWorker: one pipeline-stage replica as a Ray actor — the shell around its parts.

What the actor does lives in modules of its own; this class only holds them and is the
surface the controller calls over Ray:

* :mod:`~geopipe.runtime.actor.executor` runs an iteration's action list (the planner's IR);
* :mod:`~geopipe.runtime.actor.links` sends and receives activations and gradients;
* :mod:`~geopipe.runtime.actor.snapshots` keeps the full state of recent step boundaries;
* :mod:`~geopipe.runtime.actor.shards` writes checkpoint shards and loads checkpoints;
* :mod:`~geopipe.runtime.actor.handoff` restores a new layout's state from surviving replicas;
* :mod:`~geopipe.runtime.actor.engine` is the DeepSpeed ZeRO-1 engine of the stage;
* :mod:`~geopipe.runtime.actor.transfers` files a step's transport timings in its result;
* :mod:`~geopipe.runtime.actor.outer_calls` holds the outer loop's calls (inherited).

The replicas of a stage inside one site form its ZeRO-1 group. Each site has its own
``torch.distributed`` world, so gradient reduction cannot cross a WAN link by construction.
"""

from __future__ import annotations

from geopipe.runtime.actor import coldstart  # first: see its note

# isort: split
import gc
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from geopipe.config import RECOVERY_SNAPSHOTS_KEPT
from geopipe.model.data import TokenStream, group_sample_indices, open_corpus
from geopipe.model.family import DTYPES, ModelDesc, stage_param_names
from geopipe.optimizer.codec_guard import Fallback, apply_fallbacks
from geopipe.optimizer.evaluate import plan_schedule
from geopipe.plan import Plan
from geopipe.runtime.actor import probe
from geopipe.runtime.actor.engine_config import EngineConfig
from geopipe.runtime.actor.executor import FOREGROUND, Fault, IterationResult, execute
from geopipe.runtime.actor.handoff import Restore, restore_boundary
from geopipe.runtime.actor.inner_run import run_span
from geopipe.runtime.actor.links import StageLinks, WanPeer
from geopipe.runtime.actor.outer_calls import OuterCalls
from geopipe.runtime.actor.outer_wire import GroupKey
from geopipe.runtime.actor.shards import ShardWriter, load_stage
from geopipe.runtime.actor.snapshots import BoundaryKeeper
from geopipe.runtime.actor.transfers import collect_transport
from geopipe.runtime.node import node_ip
from geopipe.transport.bulk import ChunkServer
from geopipe.transport.codec import measure_speeds
from geopipe.transport.security import RunCredentials

coldstart.imports_done()

__all__ = ["SNAPSHOTS_KEPT", "StageSpec", "StageWorker", "WanPeer"]

# Step boundaries each replica keeps in host memory: the newest complete one, and the one
# before it in case a failure strikes while the newest is still being gathered. Declared
# with the `training.recovery_snapshots` switch it serves, so that the planner's host-memory
# check (which must not import the runtime) counts the same number.
SNAPSHOTS_KEPT = RECOVERY_SNAPSHOTS_KEPT


@dataclass(frozen=True)
class StageSpec:
    """Everything one stage replica needs; plain data so Ray can ship it."""

    run: str
    stage: int
    replica: int
    plan: Plan
    model: ModelDesc
    engine: EngineConfig
    global_batch: int
    seed: int
    data: str
    data_max_bytes: int
    topk_ratio: float = 0.01
    up_wan: WanPeer | None = None  # set when the upstream neighbour is in another site
    down_wan: WanPeer | None = None
    # The other copy of a tied embedding is on another stage of this pipeline (the first or
    # the last): how its gradient reaches it ([Note: tied embeddings across stages]).
    tie_peer: WanPeer | None = None
    recv_timeout_s: float = 600.0
    recovery_snapshots: bool = True  # keep boundary snapshots after every step
    # Mixed plans ([Note: heterogeneous plans] in geopipe.plan): the layers this replica's
    # engine holds (None: its own), where its pipeline's micro-batches start in the global
    # batch, and whether it may write its stage's checkpoint shard in place of a dead
    # writer (it runs the same layers as that writer).
    hold: tuple[int, int] | None = None
    first_microbatch: int | None = None  # None: replica × micro-batches (identical pipelines)
    stand_in_writer: bool = True
    # The data plane's protection: the run's credentials (secret, TLS), and whether its
    # servers listen on every interface rather than the node's address (security.listen).
    creds: RunCredentials | None = None
    listen_all: bool = False
    wan_outage_s: float = 60.0  # health.wan_outage_s: the WAN streams must outlive it
    # The outer loop's replica groups: this replica's, their number, and where its group's
    # slice of each global batch starts, in micro-batches (group_sample_indices).
    group: int = 0
    groups: int = 1
    group_start: int | None = None
    outer_key: GroupKey | None = None  # its group's signing key, every group's public one


# [Note: garbage collection off the step]
# Python's cyclic collector pauses every thread of the actor, and its oldest generation
# scans every object the process holds: with torch, DeepSpeed and Ray imported that is
# ~0.4 M+ objects: over the test bed one such collection takes 0.195 s inside a forward, a
# quarter of a step (benchmarks/wsplit.py --testbed; the gc column of the step breakdown). The
# objects that exist once a stage is built (modules, libraries, the engine) live as long as
# the actor, so after setup they are collected once and frozen (gc.freeze: moved to a
# generation the collector never scans); collections then only walk what training made
# since. Megatron-LM's --manual-gc answers the same straggler by disabling the collector.


def max_payload(plan: Plan, model: ModelDesc) -> int:
    """The largest frame a stage's WAN receiver accepts: twice the largest message it
    expects (an fp32 activation or gradient, a tied embedding's gradient, a link-probe
    message) plus 1 MiB. A length beyond it is refused before anything is allocated."""
    elems = plan.micro_batch_size * plan.seq_len * model.hidden
    if model.tie:
        elems = max(elems, model.vocab_size * model.hidden)
    return 2 * max(4 * elems, probe.BURST_MAX_BYTES) + (1 << 20)


class StageWorker(OuterCalls):
    """The actor body (wrapped with ``ray.remote`` by the controller)."""

    def __init__(self, spec: StageSpec) -> None:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        self.engine: Any = None
        self.boundaries = BoundaryKeeper(SNAPSHOTS_KEPT)
        self.shards = ShardWriter()
        self._fault: Fault | None = None
        self._chunks: ChunkServer | None = None  # started when a store first asks
        self._outer: Any = None  # the outer loop's state and exchange (outer_begin)
        self._configure(spec)

    def _configure(self, spec: StageSpec) -> None:
        """(Re)build everything that depends on the plan: program, data, links."""
        self.spec = spec
        self.plan = spec.plan
        self.k, self.p = spec.stage, self.plan.num_stages
        self.first, self.last = self.k == 0, self.k == self.p - 1
        self.model = spec.model
        self.dtype = DTYPES[spec.engine.precision]
        self._make_program()
        self.layers = tuple(self.plan.partition[self.k])
        self.stream: TokenStream | None = None
        if self.first or self.last:
            corpus = open_corpus(spec.data, max_bytes=spec.data_max_bytes)
            self.stream = TokenStream(corpus, spec.seed)
        self.links = StageLinks()
        self.links.creds, self.links.listen_all = spec.creds, spec.listen_all
        self.links.max_payload = max_payload(self.plan, self.model)
        self.links.user_timeout_s = max(30.0, spec.wan_outage_s + 15.0)
        self.links.codec_seed = spec.seed * 1009 + self.k
        self.shape = (self.plan.micro_batch_size, self.plan.seq_len, self.model.hidden)

    def _make_program(self) -> None:
        sched = plan_schedule(self.plan)
        self.program = list(zip(*sched.programs[self.k], strict=True))

    def set_delta_n(self, delta_n: list[int]) -> None:
        """Switch to another look-ahead depth between iterations (same layout, new lists)."""
        self.plan = replace(self.plan, delta_n=tuple(delta_n))
        self._make_program()

    def codec_speeds(self, codecs: list[str]) -> dict[str, float]:
        """This device's encode + decode speed (GB/s) of each codec on the run's boundary
        messages: asked at launch next to the link probe, priced by the planner."""
        shape = (self.plan.micro_batch_size, self.plan.seq_len, self.model.hidden)
        return measure_speeds(codecs, shape)

    def set_codecs(self, fallbacks: list[Fallback]) -> None:
        """Send with finer codecs from the next iteration (the codec error guard)."""
        self.plan = apply_fallbacks(self.plan, fallbacks)
        codecs, k = self.plan.codecs, self.k
        self.links.set_codecs(
            codecs[k - 1] if k > 0 else None, codecs[k] if k < len(codecs) else None
        )

    # -- wiring ------------------------------------------------------------------------------
    def endpoint(self) -> Any:
        """The site's rendezvous (asked of its rank 0): a store actor reached over Ray, no
        listening port ([Note: the site rendezvous goes through Ray])."""
        from geopipe.runtime.actor.distgroups import open_site

        return open_site()

    def setup(
        self,
        master: Any,
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
    ) -> float:
        """Join the site's process group, build the ZeRO-1 engine and the links: p2p ranks
        inside the site, the WAN neighbours' receiver addresses (see :meth:`listen`)."""
        from geopipe.runtime.actor.distgroups import join_site
        from geopipe.runtime.actor.engine import StageEngine

        t0 = time.perf_counter()
        join_site(site_rank, site_world, master, node_ip(), timeout_s)
        hold = tuple(self.spec.hold) if self.spec.hold is not None else None
        self.engine = StageEngine(self.model, self.layers, groups, my_group, self.spec.engine, hold)
        s, links = self.spec, self.links
        links.plan_frames(self.shape, self.dtype, self.engine.module.tied_parameter())
        if up_rank is not None:
            links.connect_up_p2p(up_rank)
        elif up_addr is not None:
            links.connect_up_wan(tuple(up_addr), s.up_wan, s.topk_ratio)
        if down_rank is not None:
            links.connect_down_p2p(down_rank)
        elif down_addr is not None:
            links.connect_down_wan(tuple(down_addr), s.down_wan, s.topk_ratio)
        if tie_addr is not None:
            links.connect_tie(tuple(tie_addr), s.tie_peer)
        self.engine.label = f"stage {self.k}, replica {s.replica}, "
        if norm_peers:  # the global gradient norm ([Note: global gradient clipping])
            from geopipe.runtime.actor.gradnorm import NormExchange

            hold = tuple(s.hold) if s.hold is not None else tuple(self.layers)
            self.engine.connect_norm_peers(
                NormExchange.connect(
                    self.k,
                    hold,
                    norm_peers,
                    links.inbox,
                    links.creds,
                    links.user_timeout_s,
                    s.recv_timeout_s,
                )
            )
        coldstart.settle_heap()  # [Note: garbage collection off the step]
        return time.perf_counter() - t0

    def listen(self) -> tuple[str, int]:
        """Open the receiver of this replica's WAN neighbours; returns its address. It takes
        only the frames of this stage's plan (`links.planned_frames`)."""
        self.links.plan_frames(self.shape, self.dtype)
        return self.links.listen(node_ip())

    def probe_link(self, address: tuple[str, int], link: Any, sizes: list[int]) -> dict:
        """Launch-time link probe, upstream side (see :mod:`geopipe.runtime.control.linkprobe`)."""
        return probe.probe(self.links.inbox, tuple(address), link, sizes, self.spec.creds)

    def probe_echo(self, address: tuple[str, int], link: Any, sizes: list[int]) -> dict:
        """Launch-time link probe, downstream side."""
        return probe.echo(self.links.inbox, tuple(address), link, sizes, self.spec.creds)

    # -- one iteration -------------------------------------------------------------------------
    def _batch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        plan, s = self.plan, self.spec
        first = s.first_microbatch
        if first is None:
            first = s.replica * plan.num_microbatches
        at = (s.group, s.groups, first + mb, plan.micro_batch_size, s.group_start)
        return self.stream.batch(group_sample_indices(step, s.global_batch, *at), plan.seq_len)

    def run_iteration(self, step: int, record: bool = False) -> IterationResult:
        """Execute this stage's action list for optimizer step ``step``."""
        res = execute(
            self.program,
            step,
            self.engine,
            self.links,
            self._batch,
            stage=self.k,
            replica=self.spec.replica,
            first=self.first,
            last=self.last,
            record=record,
            recv_timeout_s=self.spec.recv_timeout_s,
            shape=self.shape,
            dtype=self.dtype,
            fault=self._fault,
        )
        if self.spec.recovery_snapshots:
            res.breakdown["snapshot"] = self.boundaries.take(step + 1, self.engine)
        res.duration_s = time.monotonic() - res.start
        foreground = sum(res.breakdown[k] for k in FOREGROUND)
        res.breakdown["other"] = max(0.0, res.duration_s - foreground)
        collect_transport(self.links.inbox, res, step)
        return res

    def run_iterations(
        self, start: int, count: int, record: list, sends: dict, applies: dict | None = None
    ):
        """Steps ``start ..`` ``start + count - 1`` in one call, with the outer loop's sends
        and applies (:mod:`.inner_run`: [Note: many inner steps per driver call])."""
        return run_span(self, start, count, record, sends, applies)

    # -- state ---------------------------------------------------------------------------------
    def full_state(self) -> dict:
        return self.engine.full_state()

    def load_full_state(self, state: dict) -> None:
        self.engine.load_full_state(state)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self.engine.module.named_parameters()}

    # -- step boundaries: recovery and checkpoints ---------------------------------------------
    def snapshot(self, step: int) -> None:
        """Take the snapshot of boundary ``step`` now (when they are not taken every step)."""
        if not self.boundaries.holds(step):
            self.boundaries.take(step, self.engine)

    def boundary_steps(self) -> list[int]:
        return self.boundaries.steps()

    def boundary_names(self, step: int) -> list[str]:
        return self.boundaries.names(step)

    def boundary_subset(self, step: int, names: list[str]) -> dict:
        """Part of a boundary's state, for a receiver fetching it through the object store
        (a holder in another site, or outside the new layout)."""
        return self.boundaries.subset(step, names)

    def drop_boundaries(self) -> None:
        """Forget the snapshots of the layout before a reconfiguration (once all restored)."""
        self.boundaries.clear()

    def restore_boundary(
        self, step: int, todo: Restore, fetch: list[tuple[Any, list[str]]]
    ) -> dict[str, int]:
        """This actor's part of a state hand-off (see :mod:`geopipe.runtime.actor.handoff`)."""
        return restore_boundary(self.engine, self.boundaries, step, todo, fetch)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_shard(self, directory: str | None, step: int) -> float:
        """Write this stage's shard of the checkpoint at boundary ``step`` in the background
        (replica 0 writes, the others keep a fallback) into ``directory``, or into memory for
        the sites' stores to pull (None); returns the seconds stalled. In an outer-loop run
        each group's first replica writes its group's shard, which holds the outer state too
        ([Note: the outer-loop checkpoint] in geopipe.checkpoint.outer)."""
        from geopipe.runtime.actor.outer_ckpt import submit_outer

        t0 = time.perf_counter()
        if not self.boundaries.holds(step):
            self.boundaries.take(step, self.engine)
        taken_for_save = not self.spec.recovery_snapshots
        outer, pos = submit_outer(self._outer, self.boundaries, self.engine)
        self.shards.save(
            directory,
            step,
            self.boundaries.future(step),
            stage=self.k if self._outer is None else pos * self.p + self.k,
            layers=list(self.layers),
            writer=not self.spec.first_microbatch if self._outer else self.spec.replica == 0,
            tensors=self.links.codec_state(),
            only=self._own_names(),
            on_gathered=(lambda: self.boundaries.discard(step)) if taken_for_save else None,
            outer=outer,
            group=self.spec.group,
        )
        return time.perf_counter() - t0

    def _own_names(self) -> set[str] | None:
        """The parameters of this replica's own layers when its engine holds more."""
        if self.spec.hold is None or tuple(self.spec.hold) == self.layers:
            return None
        return stage_param_names(self.model, *self.layers)

    def shard_written(self) -> Any:
        return self.shards.written()

    def write_shard_instead(self, step: int) -> Any:
        if not self.spec.stand_in_writer:  # its layers differ from the writer's
            raise RuntimeError(
                f"stage {self.k} of pipeline {self.spec.replica} cannot write this stage's shard"
            )
        return self.shards.write_instead(step)

    def release_shard(self, step: int) -> None:
        self.shards.release(step)

    def chunk_address(self) -> tuple[str, int]:
        """This replica's chunk server: another site's store reads the in-memory shard
        through it, over the data plane (:mod:`geopipe.transport.bulk`)."""
        if self._chunks is None:
            host = "0.0.0.0" if self.spec.listen_all else node_ip()
            self._chunks = ChunkServer(self.read_chunk, host, self.spec.creds, node_ip())
        return self._chunks.address

    def read_chunk(self, step: int, file: str, offset: int, size: int) -> bytes:
        """A piece of this replica's in-memory shard of ``step`` (per-site checkpoint copies:
        a site's store pulls it, :mod:`geopipe.runtime.storage.sitestore`); ``file`` is unused: the
        same call reads a file of a store's copy."""
        return self.shards.chunk(step, offset, size)

    def node_id(self) -> str:
        """The Ray node this actor runs on (its site's store is placed beside it)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def sees_file(self, path: str, content: str) -> bool:
        """Whether ``path`` exists here with ``content``: is the checkpoint directory the
        driver wrote a marker into shared with this actor's node?"""
        try:
            with open(path, encoding="utf-8") as f:
                return f.read() == content
        except OSError:
            return False

    def load_checkpoint(self, path: str) -> int:
        s = self.spec
        return load_stage(self.engine, path, self.k, self.layers, self.links, s.group, s.groups)

    # -- held-out evaluation (geopipe.runtime.actor.evaluate) ----------------------------------
    def set_eval(self, setup: Any) -> None:
        """``training.eval``: open the held-out stream (holding it out of this stage's
        training stream); the driver calls it again after every new layout."""
        from geopipe.runtime.actor.evaluate import StageEval

        self._eval = StageEval(setup, self)

    def run_eval(self, step: int) -> dict[str, Any]:
        """This replica's held-out micro-batches forward, without gradients (between steps)."""
        return self._eval.run(self, step)

    # -- lifecycle -----------------------------------------------------------------------------
    def ping(self) -> int:
        return os.getpid()

    def clock_skews(self) -> dict[str, tuple[float, float]]:
        return self.links.clock_skews()  # what the WAN handshakes measured (launch reports it)

    def reducing(self) -> bool:
        """Whether this replica is inside its step's ZeRO-1 collectives now (answered on
        another thread while the step blocks there: see ``Recovery._wait_aborted``)."""
        return self.engine is not None and self.engine.reducing

    def data_digest(self) -> str | None:
        """The corpus digest; None on a middle stage (it reads no data)."""
        return self.stream.corpus.digest if self.stream is not None else None

    def inject_fault(self, step: int, delay_s: float, write_delay_s: float = 0.0) -> None:
        """Fault injection for tests: at ``step``, stall ``delay_s`` before this replica's
        last send, then exit — so its peers get as far as they can without it (e.g. into a
        gradient all-reduce) before it dies. ``write_delay_s`` slows its checkpoint writes
        (to kill it mid-save)."""
        self._fault = Fault(step, delay_s) if delay_s >= 0 else None
        self.shards.write_delay_s = write_delay_s

    def abort(self) -> None:
        """Make a running iteration fail fast (a peer died): waiting receives raise."""
        self.links.inbox.close()

    def leave(self) -> None:
        """Drop the engine, links and process group (after a failure). A peer blocked in a
        collective with us is *not* released by this (gloo keeps its connections until the
        process exits): the controller replaces such a peer."""
        self.links.close()
        self._end_outer()
        self.boundaries.after_leave()
        self.shards.forget()
        self._drop_engine()

    def reconfigure(self, spec: StageSpec) -> tuple[int, tuple[int, int]]:
        """Take the stage this new spec describes; the actor and its memory (the boundary
        snapshots) survive, the engine and links are rebuilt by the next :meth:`setup`.
        Returns the stage and layers it had."""
        before = (self.k, self.layers)
        if self.engine is not None:
            self.leave()
        self._configure(spec)
        return before

    def shutdown(self) -> None:
        self.links.inbox.close()
        self._end_outer()
        self._drop_engine()

    def _drop_engine(self) -> None:
        """Destroy the engine and the process group, and collect the old engine at once: it
        sits in reference cycles (module hooks) that were frozen after its setup ([Note:
        garbage collection off the step])."""
        from geopipe.runtime.actor.engine import destroy_process_group

        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
        destroy_process_group()
        gc.unfreeze()
        gc.collect()
