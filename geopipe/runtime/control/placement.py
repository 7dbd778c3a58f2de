"""Actor placement: one Ray actor per stage replica, in its site, wired into its site's world.

Actors are named ``geopipe/<run>/<site>/stage<k>/r<i>`` (a replacement after a failure
gets a fresh suffix), so the Ray dashboard shows the run's shape. Each site gets its own
``torch.distributed`` world over the stages it hosts; a stage's replicas form a ZeRO-1
group inside it, so no process group spans two sites.
"""

from __future__ import annotations

from typing import Any

from geopipe.config import ClusterSpec
from geopipe.model.family import ModelDesc
from geopipe.plan import ActorKey, Plan
from geopipe.runtime.actor.engine_config import EngineConfig
from geopipe.runtime.actor.links import WanPeer
from geopipe.runtime.actor.lr import factor_table
from geopipe.runtime.actor.outer_sign import GroupKeyring
from geopipe.runtime.actor.sitegroups import grad_scale, site_worlds
from geopipe.runtime.actor.stage import StageSpec, StageWorker
from geopipe.runtime.control.cluster import ACTOR_ENV, LaunchError, kill_actors, site_resource
from geopipe.runtime.control.models import model_desc
from geopipe.runtime.control.workers import NameTaken, SpawnOptions, Workers, ask
from geopipe.transport.link import LinkParams

__all__ = ["Placement"]


# [Note: one malloc arena per actor]
# Ray runs a threaded actor's calls on a pool thread, so the training loop allocates from
# one of glibc's per-thread arenas, whose heaps glibc shrinks (madvise) as soon as their top
# is free. Activations come and go by the hundred megabytes per step, and look-ahead keeps
# many micro-batches alive at once, so every step would re-fault its activations (zeroed by
# the kernel): with 31 in flight on the demo's first stage 72 k page faults a step, and over
# the test bed at ΔN 30 forwards 4x slower than at ΔN 0 (benchmarks/real_wan.py, the step
# breakdown). MALLOC_ARENA_MAX=1 puts every thread on the main heap: 1-4 k faults a step,
# forward time independent of ΔN. The few threads of an actor barely contend for it
# (they take turns at the GIL anyway).
#
# [Note: no torch.compile in stage actors]
# A stage actor runs eager torch and never compiles, yet DeepSpeed's ZeRO imports its Muon
# optimizer while building the engine, whose module-level @torch.compile decorators import
# inductor: ~1 s of CPU per actor at every launch and every replacement, beside the other
# actors starting on the same cores. TORCHDYNAMO_DISABLE=1 turns torch.compile into a no-op
# decorator, so inductor is never imported: an actor's setup CPU 2.7 s -> 1.6 s, and the
# wiring of a 4-actor launch on 2 cores 11 s -> 9 s (a launch of the suite's 2x2 cluster).
# (ACTOR_ENV lives in .cluster, which sets it for an embedded Ray's workers at start.)


# Calls a stage actor serves at once: a step, and beside it pings, recovery's questions and
# checkpoint calls.
STAGE_CONCURRENCY = 8


class Placement:
    """The run's actors, ``rows[stage][replica]``, and how to make and wire more."""

    def __init__(
        self, spec: ClusterSpec, lr_horizon: int, gpus: float, creds: Any, workers: Workers
    ) -> None:
        self.spec = spec
        self.workers = workers  # makes, calls and kills the actors
        self.creds = creds  # the data plane's credentials, for every stage actor
        self.keyring = GroupKeyring()  # the replica groups' signing keys, fresh per run
        self.lr_horizon = lr_horizon  # the LR schedule's horizon (see Controller)
        self.gpus = gpus  # per stage actor (ray.gpus_per_actor)
        self.plan: Plan | None = None
        self.rows: list[list[Any]] = []
        self.names: list[str] = []  # every actor ever created, in order
        self._name_of: dict[int, str] = {}  # id(actor handle) -> its Ray actor name
        self._made: dict[str, Any] = {}  # every actor ever created, by name (kill_all)
        self.site_rank: dict[int, int] = {}  # id(actor handle) -> rank in its site's world
        self.wan_addresses: dict[ActorKey, tuple[str, int]] = {}  # WAN receivers
        self.model: ModelDesc = model_desc(spec.model)

    # -- the actors ----------------------------------------------------------------------------
    def flat(self) -> list[Any]:
        return [a for row in self.rows for a in row]

    def roles(self) -> dict[ActorKey, Any]:
        """``{(stage, replica): actor}`` of the current layout."""
        return {(k, r): a for k, row in enumerate(self.rows) for r, a in enumerate(row)}

    def name_of(self, actor: Any, stage: int, replica: int) -> str:
        return self._name_of.get(id(actor), self.plan.actor_name(self.spec.name, stage, replica))

    def current_names(self) -> list[list[str]]:
        return [
            [self.name_of(a, k, r) for r, a in enumerate(row)] for k, row in enumerate(self.rows)
        ]

    def place(self, plan: Plan) -> None:
        """Create every actor of ``plan`` (each in its stage's site). ``rows[k]`` holds stage
        ``k`` of every pipeline that has one (all of them unless the plan mixes templates)."""
        self.plan = plan
        self.rows = []  # filled as the actors are made: a failure midway leaves the made ones
        for k in range(plan.num_stages):  # in rows, for kill_all
            self.rows.append([])
            for r in range(plan.replicas(k)):
                self.rows[k].append(self.create(k, r))

    def first_actor_per_site(self) -> dict[str, Any]:
        """One stage actor of each site the layout uses (checks of a site's disk)."""
        out: dict[str, Any] = {}
        for k, row in enumerate(self.rows):
            out.setdefault(self.plan.stage_sites[k], row[0])
        return out

    def actor_sites(self) -> list[tuple[Any, str]]:
        """Every actor of the layout with its site."""
        return [
            (a, self.plan.site_of(k, r))
            for k, row in enumerate(self.rows)
            for r, a in enumerate(row)
        ]

    def create(self, k: int, r: int) -> Any:
        """A new actor for stage ``k`` replica ``r`` of the current plan."""
        plan, spec = self.plan, self.spec
        name = plan.actor_name(spec.name, k, r)
        if name in self.names:  # a replacement after a failure gets a fresh name
            name = f"{name}-{len(self.names)}"
        self.names.append(name)
        opts = SpawnOptions(
            name=name,
            namespace=spec.ray.namespace,
            resources={site_resource(plan.site_of(k, r)): 1},
            num_gpus=self.gpus,
            env=dict(ACTOR_ENV),
            max_concurrency=STAGE_CONCURRENCY,
        )
        try:
            actor = self.workers.spawn(StageWorker, (self.stage_spec(k, r),), opts)
        except NameTaken:
            raise LaunchError(
                f"actor name {name} is taken in Ray namespace {spec.ray.namespace!r}: another "
                f"launch of run {spec.name!r} is still running on this Ray cluster (or its "
                "actors are still being torn down); stop it, or give this run another name"
            ) from None
        self._name_of[id(actor)] = name
        self._made[name] = actor
        return actor

    def kill(self, actor: Any) -> None:
        self.workers.kill(actor)

    def kill_all(self) -> list[str]:
        """Stop every actor the run made; returns their names (Ray frees a name only once
        the process has exited: see :func:`~geopipe.runtime.control.cluster.wait_released`)."""
        names = kill_actors(self.workers, self._made)
        self.rows, self._made = [], {}
        return names

    def check_data(self, want: str | None) -> str:
        """Every actor must read the same bytes (the batches are a function of them), and a
        resumed run the bytes its checkpoint was trained on (``want``): ``stdlib`` differs
        between Python versions, so nodes with different Pythons would silently disagree.
        Returns the corpus digest."""
        data = self.spec.training.data
        got = ask(self.workers, self.flat(), "data_digest")
        all_names = [n for row in self.current_names() for n in row]
        # Middle stages read no data (None): only the ends' digests are compared.
        names = [n for n, d in zip(all_names, got, strict=True) if d is not None]
        digests = [d for d in got if d is not None]
        if len(set(digests)) > 1:
            seen: dict[str, list[str]] = {}
            for name, d in zip(names, digests, strict=True):
                seen.setdefault(d[:12], []).append(name)
            raise LaunchError(
                f"training.data ({data!r}) reads differently on the nodes: "
                + "; ".join(f"sha256 {d}… on {', '.join(n)}" for d, n in seen.items())
                + " (different Python versions, for 'stdlib'?): point training.data at a "
                "file every node has"
            )
        if want is not None and want != digests[0]:
            raise LaunchError(
                f"--resume: the checkpoint was trained on data with sha256 {want[:12]}…, "
                f"training.data ({data!r}) now reads as {digests[0][:12]}…; resuming "
                "would not continue the same run"
            )
        return digests[0]

    # -- what each actor is told -------------------------------------------------------------
    def stage_spec(self, k: int, r: int) -> StageSpec:
        """What actor ``(stage k, pipeline r)`` is told: its pipeline's own plan, and for a
        mixed plan its ZeRO-1 group's layers and gradient scale (:mod:`.sitegroups`)."""
        full, spec = self.plan, self.spec
        plan = full.pipeline(r)
        t = spec.training
        hold, scale, first, stand_in = None, 1.0, None, True
        if full.heterogeneous:
            hold = full.held_layers()[(k, r)]
            scale = grad_scale(full, (k, r))
            first = full.first_microbatch(r)
            stand_in = full.layers_of(k, r) == full.layers_of(k, 0)
        engine = EngineConfig(
            lr=t.lr,
            weight_decay=t.weight_decay,
            grad_clip=t.grad_clip,
            grad_clip_scope=t.grad_clip_scope,
            warmup_steps=t.warmup_steps,
            # the YAML's horizon, never --steps ([Note: the LR horizon] in runtime.actor.lr)
            total_steps=self.lr_horizon,
            lr_schedule=t.lr_schedule,
            min_lr_ratio=t.min_lr / t.lr,
            wsd_decay_steps=t.wsd_decay(self.lr_horizon),
            lr_table=factor_table(
                t.lr_schedule,
                t.warmup_steps,
                self.lr_horizon,
                t.min_lr / t.lr,
                t.wsd_decay(self.lr_horizon),
            ),
            betas=tuple(t.betas),
            eps=t.eps,
            micro_batches=plan.num_microbatches,
            seed=t.seed,
            micro_batch_size=plan.micro_batch_size,
            grad_scale=scale,
            defer_step=True,  # [Note: the step after the sends] in geopipe.runtime.actor.engine
            precision=t.precision,
            recompute=t.recompute,
        )
        return StageSpec(
            run=spec.name,
            stage=k,
            replica=r,
            plan=plan,
            model=self.model,
            engine=engine,
            global_batch=t.global_batch_size,
            seed=t.seed,
            data=t.data,
            data_max_bytes=t.data_max_bytes,
            topk_ratio=spec.plan.topk_ratio,
            up_wan=self._wan_peer(plan, k, k - 1) if k > 0 else None,
            down_wan=self._wan_peer(plan, k, k + 1) if k < plan.num_stages - 1 else None,
            recovery_snapshots=t.recovery_snapshots,
            hold=hold,
            stand_in_writer=stand_in,
            tie_peer=self._tie_peer(plan, k),
            creds=self.creds,
            listen_all=spec.security.listen == "all",
            wan_outage_s=spec.health.wan_outage_s,
            outer_key=self.keyring.key_of(full, r),
            **_group_of(full, r, first),
        )

    def _tie_peer(self, plan: Plan, k: int) -> WanPeer | None:
        """How the first (last) stage reaches the last (first) one when they hold the two
        copies of a tied embedding; the link is emulated when their sites differ."""
        last = plan.num_stages - 1
        if not self.ties(plan) or k not in (0, last):
            return None
        a, b = plan.stage_sites[k], plan.stage_sites[last - k]
        return WanPeer(codec="none", link=None if a == b else self._link_params(a, b))

    def ties(self, plan: Plan) -> bool:
        """Whether ``plan``'s pipelines put the two ends of a tied embedding on two stages."""
        return self.model.tie and plan.num_stages > 1

    def norm_peers(self, k: int, r: int, addr: dict) -> list | None:
        """Stage ``k`` of pipeline ``r``'s peers in the global gradient norm: ``(stage,
        receiver address, WanPeer)`` of every other stage of its pipeline (None: no
        exchange, i.e. no clipping, per-stage clipping, or a one-stage pipeline). With an
        empty ``addr``: whether there are any (an empty list)."""
        plan, t = self.plan, self.spec.training
        if not (t.grad_clip > 0 and t.grad_clip_scope == "global" and plan.depth(r) > 1):
            return None
        out = []
        for j in range(plan.depth(r)):
            if j != k and addr:
                a, b = plan.site_of(k, r), plan.site_of(j, r)
                link = None if a == b else self._link_params(a, b)
                out.append((j, addr[(j, r)], WanPeer(codec="none", link=link)))
        return out

    def _wan_peer(self, plan: Plan, src: int, dst: int) -> WanPeer | None:
        """How stage ``src`` of one pipeline's ``plan`` sends to its neighbour ``dst`` if
        that hop crosses sites."""
        a, b = plan.stage_sites[src], plan.stage_sites[dst]
        if a == b:
            return None
        return WanPeer(codec=plan.codecs[min(src, dst)], link=self._link_params(a, b))

    def _link_params(self, src: str, dst: str) -> LinkParams | None:
        """The emulated link ``src -> dst``; each of the D pipelines gets 1/D of its bandwidth
        (the planner's assumption), so the D senders need no shared token bucket."""
        return emulated_link(self.spec, src, dst, self.plan.pipelines)

    def wire(self) -> None:
        """Rendezvous each site's process group, then build engines and links."""
        plan, w = self.plan, self.workers
        self.site_rank = {}

        # Receivers first: a sender connects to its WAN neighbour's address at setup.
        def crosses(k: int, r: int) -> bool:
            return any(
                0 <= j < plan.depth(r) and plan.site_of(j, r) != plan.site_of(k, r)
                for j in (k - 1, k + 1)
            )

        def tie_end(k: int, r: int) -> bool:
            return self.ties(plan.pipeline(r)) and k in (0, plan.depth(r) - 1)

        norm = self.norm_peers  # the global gradient norm's exchange (runtime.actor.gradnorm)
        crossing = [
            key
            for key in plan.actors()
            if crosses(*key) or tie_end(*key) or norm(*key, {}) is not None
        ]
        got = ask(w, [self.rows[k][r] for k, r in crossing], "listen")
        self.wan_addresses = addr = dict(zip(crossing, got, strict=True))
        calls = []
        for world in site_worlds(plan):
            rank = {key: i for i, key in enumerate(world.members)}
            groups = [list(g) for g in world.groups]
            k0, r0 = world.members[0]
            master = ask(w, [self.rows[k0][r0]], "endpoint")[0]
            for (k, r), rk in rank.items():
                self.site_rank[id(self.rows[k][r])] = rk
            for k, r in world.members:
                up_rank, down_rank = rank.get((k - 1, r)), rank.get((k + 1, r))
                up = addr[(k - 1, r)] if k > 0 and up_rank is None else None
                last = k == plan.depth(r) - 1
                down = addr[(k + 1, r)] if not last and down_rank is None else None
                tie = addr[(plan.depth(r) - 1 - k, r)] if tie_end(k, r) else None
                calls.append(
                    w.call(
                        self.rows[k][r],
                        "setup",
                        master,
                        rank[(k, r)],
                        len(world.members),
                        groups,
                        world.group_of[(k, r)],
                        up_rank,
                        down_rank,
                        up,
                        down,
                        tie_addr=tie,
                        norm_peers=norm(k, r, addr),
                    )
                )
        w.get(calls)

    def gather_state(self) -> dict:
        """The whole model's unsharded parameters and Adam state, keyed by parameter name.

        ``full_state`` is collective inside each ZeRO-1 group, so every replica is asked;
        replica (pipeline) 0's copy of each stage is kept.
        """
        from geopipe.checkpoint.format import ADAM_STATE_GROUPS

        rows = self.rows
        states = ask(self.workers, self.flat(), "full_state")
        out: dict = {**{g: {} for g in ADAM_STATE_GROUPS}, "step": None}
        first = 0
        for row in rows:
            st = states[first]
            first += len(row)
            for g in ADAM_STATE_GROUPS:
                out[g].update(st[g])
            out["step"] = st["step"]
            out.setdefault("lr_step", st["lr_step"])
        return out


def _group_of(plan: Plan, r: int, first: int | None) -> dict:
    """Pipeline ``r``'s replica group and where its micro-batches start inside the group's
    slice of every global batch ([Note: replica groups] in :mod:`geopipe.plan`); nothing for
    a synchronous plan."""
    if plan.num_groups == 1:
        return {"first_microbatch": first}
    g = plan.group_of(r)
    start = plan.first_microbatch(plan.groups.index(g))
    return {
        "group": g,
        "groups": plan.num_groups,
        "first_microbatch": plan.first_microbatch(r) - start,
        "group_start": start,  # the groups' shares may differ: where group g's slice begins
    }


def emulated_link(spec: ClusterSpec, src: str, dst: str, senders: int = 1) -> LinkParams | None:
    """The YAML's link ``src -> dst`` as one of ``senders`` connections sharing it paces
    itself on emulated sites (None on a real network, which paces itself, or where the YAML
    has no such link)."""
    if not spec.ray.links_emulated:
        return None
    lk = spec.link(src, dst)
    if lk is None:
        return None
    return LinkParams(
        bandwidth_bps=lk.bandwidth_bps / senders,
        latency_s=lk.latency_s,
        loss=lk.loss,
        seed=spec.training.seed,
    )
