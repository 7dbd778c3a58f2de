"""The controller: plan, place the stage actors, train, and shut down cleanly.

An explicit state machine (PLANNING → LAUNCHING → RUNNING → FINISHED | FAILED); each step
of RUNNING is one optimizer step on every stage replica. Whatever happens — an error,
Ctrl-C — ``close()`` stops the actors and, when this process started the embedded Ray,
Ray itself, so no processes are left behind.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geopipe.config import ClusterSpec
from geopipe.optimizer.evaluate import Evaluation
from geopipe.plan import Plan
from geopipe.runtime.cluster import (
    ClusterInfo,
    LaunchError,
    auth_env,
    check_sites,
    connect,
    site_resource,
)
from geopipe.runtime.metrics import MetricsSink, StepMetrics, aggregate, measured_events
from geopipe.runtime.stage import StageSpec, StageWorker, WanPeer
from geopipe.transport.link import LinkParams

__all__ = ["Controller", "LaunchOptions", "RunResult", "State"]


CALIBRATION_STEPS = 3  # steps whose measured stage times re-calibrate the prediction
HEARTBEAT_S = 1.0  # while a step runs, each unfinished actor is pinged this often …
UNRESPONSIVE_S = 10.0  # … and one that leaves a ping unanswered this long is lost


class ActorsUnresponsive(RuntimeError):
    """Stage actors stopped answering heartbeats (frozen process, lost or partitioned node)."""

    def __init__(self, indices: list[int], seconds: float) -> None:
        super().__init__(f"{len(indices)} actor(s) unanswered heartbeat for {seconds:.0f} s")
        self.indices = indices


class State(enum.Enum):
    PLANNING = "planning"
    LAUNCHING = "launching"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


@dataclass
class LaunchOptions:
    steps: int | None = None
    schedule: str | None = None
    run_dir: str | None = None
    metrics_out: str | None = None
    trace: str | None = None
    progress: bool = True
    plan: Plan | None = None  # run this plan instead of searching one
    resume: str | bool = False  # True: newest complete checkpoint of the run; or a path
    chaos_kill_every: int | None = None  # kill a random stage actor every N steps (demo aid)
    checkpoint_sync: bool = False  # write checkpoints synchronously (benchmarks compare)


@dataclass
class RunResult:
    plan: Plan
    predicted: Evaluation
    steps: list[StepMetrics] = field(default_factory=list)
    run_dir: Path | None = None
    dashboard_url: str | None = None
    actor_names: list[str] = field(default_factory=list)


def run_dir_for(spec: ClusterSpec, override: str | None) -> Path:
    return Path(override or spec.training.run_dir or os.path.join("runs", spec.name))


class Controller:
    """Owns one training run on one Ray cluster."""

    def __init__(self, spec: ClusterSpec, options: LaunchOptions | None = None) -> None:
        opts = options or LaunchOptions()
        # The LR schedule's horizon is the YAML's, not --steps: stopping at N and resuming to
        # 2N must follow the same schedule as running 2N in one go.
        self.lr_horizon = spec.training.lr_decay_steps or spec.training.steps
        updates: dict[str, Any] = {}
        if opts.steps is not None:
            updates["training"] = spec.training.model_copy(update={"steps": opts.steps})
        if opts.schedule is not None:
            updates["plan"] = spec.plan.model_copy(update={"schedule": opts.schedule})
        self.spec = spec.model_copy(update=updates) if updates else spec
        auth_env(self.spec)  # before anything imports ray: it reads RAY_AUTH_MODE at import
        self.opts = opts
        self.state = State.PLANNING
        self._stop_requested = False  # set by the first Ctrl-C during train()
        self.data_digest: str | None = None  # sha256 of the corpus the actors read
        self._calibrated = False  # predicted_s comes from measured stage and link times
        self.run_dir = run_dir_for(self.spec, opts.run_dir)
        self.cluster: ClusterInfo | None = None
        self.actors: list[list[Any]] = []  # [stage][replica]
        self.names: list[str] = []
        self._name_of: dict[int, str] = {}  # id(actor handle) -> its Ray actor name
        self.plan: Plan | None = None
        self.predicted: Evaluation | None = None
        self.sink: MetricsSink | None = None
        self.resume_from: str | None = None
        self.start_step = 0
        self.skipped_checkpoints: list[tuple[str, str]] = []
        self._pending_ckpt = None
        self._templates = None
        self._chaos_done: set[int] = set()
        self._calib_pool: list[dict] = []
        self._continue_from = 0
        self.recoveries: list[dict] = []

    # -- PLANNING ------------------------------------------------------------------------------
    def make_plan(self) -> tuple[Plan, Evaluation]:
        from geopipe.optimizer.evaluate import Candidate, Evaluator
        from geopipe.optimizer.planner import plan_cluster
        from geopipe.runtime.calibrate import calibrate, should_calibrate

        spec = self.spec
        if should_calibrate(spec):
            ref = self.opts.plan
            b = ref.micro_batch_size if ref else max(1, _first(spec.plan.micro_batch_size))
            s = ref.seq_len if ref else _first(spec.plan.seq_len, spec.model.max_seq_len)
            spec = self.spec = calibrate(spec, b, s)
        if self.opts.plan is not None:
            plan = self.opts.plan
            ev = Evaluator(spec, schedule=plan.schedule)
            wan = plan.wan_boundaries
            cand = Candidate(
                plan.pipelines, plan.micro_batch_size, plan.seq_len,
                tuple(plan.delta_n[j] for j in wan), tuple(plan.codecs[j] for j in wan),
                plan.schedule,
            )  # fmt: skip
            return plan, ev.evaluate(cand)
        report = plan_cluster(spec)
        if not report.best.feasible:
            raise LaunchError(f"no feasible plan for {spec.name}: {report.best.reason}")
        return report.best.plan, report.best

    # -- LAUNCHING -----------------------------------------------------------------------------
    def launch(self) -> None:
        import ray

        self.resume_from, self.start_step = self._find_resume()
        self.plan, self.predicted = self.make_plan()
        self.state = State.LAUNCHING
        self.cluster = connect(self.spec)
        check_sites(self.spec, self.plan, ray.cluster_resources())
        plan, spec = self.plan, self.spec
        self._use_gpu = ray.cluster_resources().get("GPU", 0) >= plan.pipelines * plan.num_stages
        self.actors = []
        for k in range(plan.num_stages):
            self.actors.append([self._create_actor(k, r) for r in range(plan.pipelines)])
        self._wire()
        self._check_data()
        if self.resume_from is not None:
            steps = ray.get([a.load_checkpoint.remote(self.resume_from) for a in self._flat()])
            assert set(steps) == {self.start_step}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics = Path(self.opts.metrics_out) if self.opts.metrics_out else None
        self.sink = MetricsSink(metrics or self.run_dir / "metrics.jsonl", spec.name)
        self.sink.event("plan", plan=plan.to_dict(), predicted=self.predicted.summary())
        # Pipeline templates for every device count are ready before anything fails.
        from geopipe.pipeline.templates import build_templates

        self._templates = build_templates(spec, plan=plan)
        if self.resume_from is not None:
            self.sink.event("resumed", path=self.resume_from, step=self.start_step)
        self._write_status(self.start_step)  # `geopipe status` works from the first step on

    def _check_data(self) -> None:
        """Every actor must read the same bytes (the batches are a function of them), and a
        resumed run the bytes its checkpoint was trained on. ``stdlib`` differs between
        Python versions, so nodes with different Pythons would silently disagree."""
        import ray

        digests = ray.get([a.data_digest.remote() for a in self._flat()])
        names = [
            self.plan.actor_name(self.spec.name, k, r)
            for k, row in enumerate(self.actors)
            for r in range(len(row))
        ]
        if len(set(digests)) > 1:
            seen: dict[str, list[str]] = {}
            for name, d in zip(names, digests, strict=True):
                seen.setdefault(d[:12], []).append(name)
            raise LaunchError(
                f"training.data ({self.spec.training.data!r}) reads differently on the nodes: "
                + "; ".join(f"sha256 {d}… on {', '.join(n)}" for d, n in seen.items())
                + " (different Python versions, for 'stdlib'?): point training.data at a "
                "file every node has"
            )
        self.data_digest = digests[0]
        want = getattr(self, "_resume_data_digest", None)
        if want is not None and want != self.data_digest:
            raise LaunchError(
                f"--resume: the checkpoint was trained on data with sha256 {want[:12]}…, "
                f"training.data ({self.spec.training.data!r}) now reads as "
                f"{self.data_digest[:12]}…; resuming would not continue the same run"
            )

    def _flat(self) -> list[Any]:
        return [a for row in self.actors for a in row]

    def _stage_spec(self, k: int, r: int) -> StageSpec:
        plan, spec = self.plan, self.spec
        m, t = spec.model, spec.training
        model = {
            "n_layer": m.n_layer, "n_embd": m.n_embd, "n_head": m.n_head,
            "vocab_size": m.vocab_size, "block_size": m.max_seq_len,
        }  # fmt: skip
        engine = {
            "lr": t.lr, "weight_decay": t.weight_decay, "grad_clip": t.grad_clip,
            "warmup_steps": t.warmup_steps, "total_steps": max(self.lr_horizon, t.steps),
            "micro_batches": plan.num_microbatches, "seed": t.seed,
            "micro_batch_size": plan.micro_batch_size,
        }  # fmt: skip
        return StageSpec(
            run=spec.name, stage=k, replica=r, plan=plan.to_dict(), model=model,
            engine=engine, global_batch=t.global_batch_size, seed=t.seed, data=t.data,
            data_max_bytes=t.data_max_bytes, topk_ratio=spec.plan.topk_ratio,
            up_wan=self._wan_peer(k, k - 1) if k > 0 else None,
            down_wan=self._wan_peer(k, k + 1) if k < plan.num_stages - 1 else None,
            extra={"boundary_snapshots": spec.training.recovery_snapshots},
        )  # fmt: skip

    def _create_actor(self, k: int, r: int) -> Any:
        import ray

        plan, spec = self.plan, self.spec
        name = plan.actor_name(spec.name, k, r)
        if name in self.names:  # a replacement after a failure gets a fresh name
            name = f"{name}-{len(self.names)}"
        self.names.append(name)
        cls = ray.remote(max_concurrency=8)(StageWorker)
        actor = cls.options(
            name=name,
            namespace=spec.ray.namespace,
            resources={site_resource(plan.stage_sites[k]): 1},
            num_cpus=0,
            num_gpus=1 if self._use_gpu else 0,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        ).remote(self._stage_spec(k, r))
        self._name_of[id(actor)] = name
        return actor

    def _wan_peer(self, src: int, dst: int) -> WanPeer | None:
        """How stage ``src`` sends to its neighbour ``dst`` if that hop crosses sites."""
        plan = self.plan
        a, b = plan.stage_sites[src], plan.stage_sites[dst]
        if a == b:
            return None
        return WanPeer(codec=plan.codecs[min(src, dst)], link=self._link_params(a, b))

    def _link_params(self, src: str, dst: str) -> LinkParams | None:
        """The emulated link ``src -> dst``; each of the D pipelines gets 1/D of its bandwidth
        (the planner's assumption), so the D senders need no shared token bucket."""
        if not self.spec.ray.links_emulated:
            return None
        lk = self.spec.link(src, dst)
        return LinkParams(
            bandwidth_bps=lk.bandwidth_bps / self.plan.pipelines,
            latency_s=lk.latency_s,
            loss=lk.loss,
            seed=self.spec.training.seed,
        )

    def _wire(self) -> None:
        """Rendezvous each site's process group, then build engines and channels."""
        import ray

        plan = self.plan
        sites = list(dict.fromkeys(plan.stage_sites))
        self._site_rank: dict[int, int] = {}  # id(actor) -> rank in its site's world
        calls = []
        for site in sites:
            stages = [k for k in range(plan.num_stages) if plan.stage_sites[k] == site]
            d = plan.pipelines
            world = d * len(stages)
            rank = {(k, r): li * d + r for li, k in enumerate(stages) for r in range(d)}
            groups = [[li * d + r for r in range(d)] for li in range(len(stages))]
            master = ray.get(self.actors[stages[0]][0].endpoint.remote())
            for (k, r), rk in rank.items():
                self._site_rank[id(self.actors[k][r])] = rk
            for li, k in enumerate(stages):
                for r in range(d):
                    up_rank = rank.get((k - 1, r))
                    down_rank = rank.get((k + 1, r))
                    up_actor = self.actors[k - 1][r] if k > 0 and up_rank is None else None
                    down_actor = (
                        self.actors[k + 1][r]
                        if k < plan.num_stages - 1 and down_rank is None
                        else None
                    )
                    calls.append(
                        self.actors[k][r].setup.remote(
                            master, rank[(k, r)], world, groups, li, up_rank, down_rank,
                            up_actor, down_actor,
                        )
                    )  # fmt: skip
        ray.get(calls)

    # -- RUNNING -------------------------------------------------------------------------------
    def train(self) -> RunResult:
        """Run optimizer steps ``start .. steps-1`` (``start`` > 0 when resuming).

        Ctrl-C finishes the step in flight, saves a checkpoint and then raises
        KeyboardInterrupt; a second Ctrl-C abandons the step.
        """

        spec = self.spec
        self.state = State.RUNNING
        self.predicted_s = self.predicted.iteration_time_s
        self._calibrated = False
        result = RunResult(self.plan, self.predicted, run_dir=self.run_dir,
                           dashboard_url=self.cluster.dashboard_url if self.cluster else None,
                           actor_names=list(self.names))  # fmt: skip
        from ray.exceptions import RayActorError, RayTaskError

        start = self.start_step
        progress = _Progress(spec.training.steps, self.opts.progress, done=start)
        every = spec.training.checkpoint.every_steps
        last_results: list[dict] = []
        interrupted = False
        calib_base = start
        step = start
        with self._graceful_sigint():
            try:
                while step < spec.training.steps:
                    last = step == spec.training.steps - 1
                    calibrating = step - calib_base < CALIBRATION_STEPS
                    record = calibrating or (bool(self.opts.trace) and last)
                    results, interrupted = self._run_step(step, record, interrupted)
                    if results is None:  # a failure: recovered in place, redo from the boundary
                        step = calib_base = self._continue_from
                        continue
                    # self.plan, not a local copy: recovery, grow-back and calibration
                    # replace it.
                    tokens = spec.training.global_batch_size * self.plan.seq_len
                    m = aggregate(results, self.plan.num_stages, tokens)
                    result.steps.append(m)
                    self.sink.write(
                        m,
                        {
                            "predicted_iteration_time_s": self.predicted_s,
                            "completed_at": time.time(),
                        },
                    )
                    if calibrating:
                        first = step == calib_base
                        # After ΔN is chosen (first step), pool the following steps' measurements.
                        self._calib_pool = [] if first else [*self._calib_pool, *results]
                        self._recalibrate(self._calib_pool or results, choose_delta_n=first)
                    self._write_status(step + 1)
                    progress.update(m)
                    last_results = results
                    self._poll_checkpoint()
                    step += 1
                    if interrupted:
                        break
                    if every and step % every == 0 and not last:
                        if self.recoveries and self._maybe_grow(step):
                            calib_base = step
                        try:
                            self.save_checkpoint(step)
                        except (RayActorError, RayTaskError) as exc:  # died between steps
                            self._recover(step, [a.ping.remote() for a in self._flat()], exc)
                            step = calib_base = self._continue_from
                if result.steps and (interrupted or step == spec.training.steps):
                    self.save_checkpoint(step)
                self._poll_checkpoint(wait=True)
            finally:
                progress.close()
        if self.opts.trace and last_results:
            from geopipe.timeline import write_chrome_trace

            write_chrome_trace(
                self.opts.trace, measured_events(last_results), process=f"{spec.name} (measured)"
            )
        if interrupted:
            raise KeyboardInterrupt
        self.state = State.FINISHED
        return result

    def _run_step(self, step: int, record: bool, interrupted: bool) -> tuple[Any, bool]:
        """One optimizer step on every replica; ``(None, …)`` if it failed and was recovered.

        ``interrupted`` turns true once a Ctrl-C arrived (see ``_graceful_sigint``).
        """
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        flat = self._flat()
        refs = [a.run_iteration.remote(step, record) for a in flat]
        self._maybe_chaos(step)
        try:
            results = self._await_step(flat, refs)
        except (RayActorError, RayTaskError, GetTimeoutError, ActorsUnresponsive) as exc:
            self._recover(step, refs, exc)
            return None, interrupted or self._stop_requested
        return results, interrupted or self._stop_requested

    def hang_timeout_s(self) -> float:
        """How long a step may run before it counts as hung: 20 × the predicted step — after
        calibration a prediction from the measured stage times and link delays, so a slow
        WAN gets a long timeout and a fast one a short one — but at least 30 s (120 s
        before calibration, whose first steps include warm-up)."""
        floor = 30.0 if self._calibrated else 120.0
        return max(floor, 20 * self.predicted_s)

    def _await_step(self, flat: list[Any], refs: list) -> list:
        """The step's results, failing fast: an actor error as soon as one is known, a frozen
        actor after ``UNRESPONSIVE_S`` of unanswered heartbeats, a hang (actors answer but
        the step makes no progress) after :meth:`hang_timeout_s`."""
        import ray
        from ray.exceptions import GetTimeoutError

        hang_s = self.hang_timeout_s()
        deadline = time.monotonic() + hang_s
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        pings: dict[int, tuple[Any, float]] = {}  # actor index -> (ping in flight, sent at)
        beat = time.monotonic() + HEARTBEAT_S
        while pending:
            wait_s = max(0.0, beat - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            ray.get(ready)  # an actor error surfaces at once, not when the others finish
            now = time.monotonic()
            if now < beat or not pending:
                continue
            beat = now + HEARTBEAT_S
            if now > deadline:
                raise GetTimeoutError(f"step unfinished after {hang_s:.0f} s: a hang")
            lost = []
            for i in (index[ref] for ref in pending):
                ping, sent = pings.get(i, (None, now))
                if ping is not None and not ray.wait([ping], timeout=0)[0]:
                    if now - sent > UNRESPONSIVE_S:
                        lost.append(i)
                    continue
                pings[i] = (flat[i].ping.remote(), now)
            if lost:
                raise ActorsUnresponsive(lost, UNRESPONSIVE_S)
        return ray.get(refs)

    @contextlib.contextmanager
    def _graceful_sigint(self):
        """First Ctrl-C: finish the step in flight, save a checkpoint, stop. Second: abandon.

        A handler that only sets a flag, rather than Python's default KeyboardInterrupt, so
        the interrupt can never land between writing a step's metrics and its status, or in
        the middle of a checkpoint's bookkeeping.
        """
        import signal
        import threading

        self._stop_requested = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            print(
                "\ngeopipe: finishing the step in flight, then saving a checkpoint "
                "(Ctrl-C again to abandon it)",
                file=sys.stderr,
            )

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _maybe_chaos(self, step: int) -> None:
        """``--chaos-kill-every N``: kill a random stage actor in the middle of every N-th step."""
        n = self.opts.chaos_kill_every
        if not n or step == self.start_step or step % n or step in self._chaos_done:
            return
        import random
        import threading

        import ray

        self._chaos_done.add(step)
        rng = random.Random(self.spec.training.seed * 7919 + step)
        k = rng.randrange(self.plan.num_stages)
        r = rng.randrange(self.plan.pipelines)
        victim = self.actors[k][r]
        delay = 0.4 * self.predicted_s

        def kill() -> None:
            print(f"geopipe chaos: killing stage {k} replica {r} at step {step}", file=sys.stderr)
            self.sink.event("chaos_kill", step=step, stage=k, replica=r, time=time.time())
            ray.kill(victim, no_restart=True)

        threading.Timer(delay, kill).start()

    # -- recovery -------------------------------------------------------------------------------
    def _recover(self, step: int, refs: list, exc: BaseException) -> None:
        """Re-form the job on the surviving actors, from the last step boundary.

        1. find the dead (ping) and make the survivors' iteration fail fast (abort), then let
           them leave their process groups; a survivor stuck in a collective with a stopped
           replica is replaced by a fresh actor on its device;
        2. choose the state: the newest step boundary every stage still holds in some
           survivor's memory (the iteration in flight is redone, no optimizer step is lost or
           half-applied), else the latest complete checkpoint, else fail;
        3. choose the layout: the best pipeline template for the devices still alive (a dead
           actor's device counts as lost, as in Oobleck) with the same global batch;
        4. reconfigure the survivors, re-form the ZeRO-1 groups and restore the state by
           parameter name (:mod:`geopipe.runtime.handoff`): from the actor's own memory, else
           from a same-site holder over torch.distributed, else through the object store.
        """
        import ray

        from geopipe.checkpoint.store import latest_complete
        from geopipe.pipeline.templates import build_templates
        from geopipe.runtime.recovery import Fail, Failure, RestoreFromCheckpoint, decide

        t0 = time.perf_counter()
        roles = {(k, r): a for k, row in enumerate(self.actors) for r, a in enumerate(row)}
        ref_of = dict(zip(roles, refs, strict=True))
        if isinstance(exc, ActorsUnresponsive):  # frozen: no ping would come back either
            keys = list(roles)
            dead = [keys[i] for i in exc.indices]
            for key in dead:
                ray.kill(roles[key], no_restart=True)
        else:
            dead = [
                key for key, ok in zip(roles, _alive(list(roles.values())), strict=True) if not ok
            ]
        if not dead:  # a hang: whoever has not finished is presumed stuck
            _, stuck = ray.wait(refs, num_returns=len(refs), timeout=0)
            dead = [key for key, ref in ref_of.items() if ref in stuck]
            for key in dead:
                ray.kill(roles[key], no_restart=True)
        # A save in flight commits if its shards can still be written (a survivor stands in
        # for a dead writer); only now, with the frozen killed, can its calls all finish.
        self._settle_pending_checkpoint()
        err = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        names = {
            key: self._name_of.get(id(a), self.plan.actor_name(self.spec.name, *key))
            for key, a in roles.items()
        }
        self.sink.event("failure", step=step, dead=[names[k] for k in dead], error=err)
        print(
            f"geopipe: step {step} failed ({len(dead)} actor(s) lost): recovering", file=sys.stderr
        )
        alive = {key: a for key, a in roles.items() if key not in dead}
        for a in alive.values():
            a.abort.remote()
        grace = max(5.0, 2 * self.predicted_s)
        _, stuck = ray.wait([ref_of[k] for k in alive], num_returns=len(alive), timeout=grace)
        # Still running after the abort: blocked in a collective with a replica that has
        # stopped. Neither gloo nor NCCL lets such a peer go until that replica's process
        # exits or the collective times out (measured: abort(), shutdown() and
        # destroy_process_group() on the other side do not close gloo's connections). The
        # actor and its device are healthy, so it is replaced now: its device stays usable.
        released = [k for k in alive if ref_of[k] in stuck]
        # A stuck replica whose stage has no free survivor holds state nobody else has: its
        # partner in the collective must be one of the dead, whose process is still going
        # (a frozen one takes Ray a few seconds to SIGKILL). Its exit releases the stuck one.
        needed = [k for k in released
                  if not any(j[0] == k[0] and j not in released for j in alive)]  # fmt: skip
        if needed:
            done, _ = ray.wait([ref_of[k] for k in needed], num_returns=len(needed), timeout=60)
            released = [k for k in released if ref_of[k] not in done]
        for k in released:
            ray.kill(alive.pop(k), no_restart=True)
        _quiet_get([a.leave.remote() for a in alive.values()], 30)

        # 2. which state
        have = {
            k: set(_quiet_get([a.boundary_steps.remote()], 30)[0] or []) for k, a in alive.items()
        }
        p = self.plan.num_stages
        boundary, holders = None, {}
        for s_ in sorted(set().union(*have.values()) if have else set(), reverse=True):
            found = {k: [key for key in alive if key[0] == k and s_ in have[key]] for k in range(p)}
            if all(found.values()):
                boundary, holders = s_, found
                break
        # 3. the decision (pure policy, unit-tested exhaustively): reconfigure, restore from
        # the latest checkpoint, or fail — and the template for the devices still alive.
        devices = {site.name: 0 for site in self.spec.sites}
        for k, _r in [*alive, *released]:
            devices[self.plan.stage_sites[k]] += 1
        if self._templates is None:
            self._templates = build_templates(self.spec, plan=self.plan)
        info = latest_complete(self.checkpoint_root) if self.checkpoint_root.is_dir() else None
        held = frozenset(holders) if boundary is not None else frozenset()
        failure = Failure(
            plan=self.plan,
            dead=frozenset([*dead, *released]),
            devices_alive=devices,
            params_available=held,
            optimizer_available=held,
            checkpoint_step=info.step if info is not None else None,
        )
        decision = decide(failure, self._templates)
        if isinstance(decision, Fail):
            raise LaunchError(
                f"unrecoverable: {decision.reason} (survivors hold step boundaries "
                f"{ {f'stage{k}/r{r}': sorted(v) for (k, r), v in have.items()} }); the last "
                f"checkpoint under {self.checkpoint_root} is intact"
            )
        ckpt = info if isinstance(decision, RestoreFromCheckpoint) else None
        new_plan = decision.plan
        # 4. re-lay the survivors; each restores from its own memory what it keeps, the
        # rest from the holders of the boundary (intra-site over torch.distributed).
        sources = [] if ckpt is not None else [(alive[key], key[0]) for key in alive
                                               if boundary in have[key]]  # fmt: skip
        moved = self._relayout(new_plan, [(a, key[0]) for key, a in alive.items()],
                               boundary, sources, ckpt)  # fmt: skip
        resume_at = ckpt.step if ckpt is not None else boundary
        seconds = time.perf_counter() - t0
        self.sink.event(
            "recovered",
            step=resume_at,
            failed_step=step,
            lost_steps=step - resume_at,
            source="checkpoint" if ckpt is not None else "surviving replicas",
            seconds=seconds,
            replaced_stuck=[names[k] for k in released],
            moved=moved,
            plan=new_plan.to_dict(),
        )
        how = f"checkpoint {ckpt.path.name}" if ckpt is not None else "surviving replicas"
        print(
            f"geopipe: recovered in {seconds:.1f} s from {how}: {new_plan.pipelines} pipeline(s) "
            f"× {new_plan.num_stages} stages, continuing at step {resume_at}",
            file=sys.stderr,
        )
        self.recoveries.append({"seconds": seconds, "step": resume_at, "failed_step": step})
        self._continue_from = resume_at

    def _relayout(
        self,
        new_plan: Plan,
        pool: list[tuple[Any, int]],
        step: int,
        holders: list[tuple[Any, int]],
        ckpt: Any = None,
    ) -> dict[str, int]:
        """Lay ``new_plan`` over ``pool`` — (actor, stage it held) pairs whose process groups
        are already left — preferring, per site, actors that keep their layers; slots no
        pooled actor can take get new actors. Then restore every actor to step boundary
        ``step`` from ``holders`` — (actor, old stage) pairs with that snapshot — or from
        ``ckpt``; pooled actors left over serve as sources until every load is done, then
        stop. Returns the bytes moved per path (see :mod:`geopipe.runtime.handoff`)."""
        import ray

        self._calibrated = False  # new layout, new actors: re-calibrated over the next steps
        old_plan = self.plan
        by_site: dict[str, list[tuple[Any, int]]] = {}
        for a, old_k in pool:
            by_site.setdefault(old_plan.stage_sites[old_k], []).append((a, old_k))
        self.plan = new_plan
        rows: list[list[Any]] = []
        slots: list[tuple[Any, int, int | None]] = []
        keep: list[tuple[Any, int, int]] = []
        for k in range(new_plan.num_stages):
            cands = by_site.get(new_plan.stage_sites[k], [])
            row = []
            for r in range(new_plan.pipelines):
                same = [c for c in cands if old_plan.partition[c[1]] == new_plan.partition[k]]
                if same or cands:
                    a, old_k = (same or cands)[0]
                    cands.remove((a, old_k))
                    keep.append((a, k, r))
                else:
                    a, old_k = self._create_actor(k, r), None
                row.append(a)
                slots.append((a, k, old_k))
            rows.append(row)
        spares = [a for rest in by_site.values() for a, _ in rest]
        self.actors = rows
        ray.get([a.reconfigure.remote(self._stage_spec(k, r)) for a, k, r in keep])
        self._wire()
        if ckpt is not None:
            ray.get([a.load_checkpoint.remote(str(ckpt.path)) for a, _k, _old in slots])
            moved = {"checkpoint": len(slots)}
        else:
            moved = self._handoff(step, holders, old_plan)
        ray.get([a.drop_boundaries.remote() for a in self._flat()])
        for a in spares:
            ray.kill(a, no_restart=True)
        return moved

    def _handoff(self, step: int, holders: list[tuple[Any, int]], old_plan: Plan) -> dict:
        """Every actor of the (just wired) layout loads boundary ``step``, as planned by
        :func:`geopipe.runtime.handoff.plan_handoff`."""
        import ray

        from geopipe.runtime.handoff import Holder, Receiver, Restore, plan_handoff

        plan, flat = self.plan, self._flat()
        site = {id(a): plan.stage_sites[k] for k, row in enumerate(self.actors) for a in row}
        shapes = ray.get([a.param_shapes.remote() for a in flat])
        names = ray.get([a.boundary_names.remote(step) for a, _ in holders])
        by_id = {id(a): a for a, _ in holders}
        hs = [
            Holder(id(a), old_plan.stage_sites[k], self._site_rank.get(id(a)), frozenset(n))
            for (a, k), n in zip(holders, names, strict=True)
        ]
        rs = [Receiver(id(a), site[id(a)], self._site_rank[id(a)], sh)
              for a, sh in zip(flat, shapes, strict=True)]  # fmt: skip
        todo = plan_handoff(rs, hs)
        calls = []
        for a in flat:
            r = todo.get(id(a), Restore())
            fetch = [(by_id[key], n) for key, n in r.fetch]
            calls.append(a.restore_boundary.remote(step, r.own, r.sends, r.recvs, fetch))
        stats = ray.get(calls)
        return {key: sum(s[key] for s in stats) for key in ("p2p_bytes", "object_store_bytes")}

    def _vector(self, plan: Plan) -> tuple[int, ...]:
        """Stages per site (in the templates' site order) of ``plan``."""
        return tuple(plan.stage_sites.count(site) for site in self._templates.sites)

    def _maybe_grow(self, step: int) -> bool:
        """Back in: after a recovery, when devices are free again (a node returned or
        joined), switch at this step boundary to the better template they allow.

        New actors take the free devices; state moves from the running replicas' snapshots
        of this boundary, actor to actor. Only a predicted gain of 5 % or more is worth it.
        """
        import ray

        from geopipe.pipeline.templates import best_uniform

        plan, spec = self.plan, self.spec
        avail = ray.available_resources()
        used = {site.name: 0 for site in spec.sites}
        for k, row in enumerate(self.actors):
            used[plan.stage_sites[k]] += len(row)
        devices = {
            site.name: min(
                site.devices, used[site.name] + int(avail.get(site_resource(site.name), 0))
            )
            for site in spec.sites
        }
        if devices == used:
            return False
        gbs, b = spec.training.global_batch_size, plan.micro_batch_size
        choice = best_uniform(self._templates, devices, gbs, b)
        if choice is None:
            return False
        template, d = choice
        new_plan = self._templates.plan_for(template, d, gbs // (d * b))
        now = self._templates.predict(self._vector(plan), plan.pipelines, plan.num_microbatches)
        new = self._templates.predict(self._vector(new_plan), d, new_plan.num_microbatches)
        if now is None or new is None or new.iteration_time_s > 0.95 * now.iteration_time_s:
            return False
        t0 = time.perf_counter()
        pool = [(a, k) for k, row in enumerate(self.actors) for a in row]
        if not spec.training.recovery_snapshots:  # then none is kept between steps
            ray.get([a.snapshot.remote(step) for a in self._flat()])
        for a in self._flat():  # the boundary snapshot of this step, complete everywhere
            deadline = time.time() + 60
            while step not in ray.get(a.boundary_steps.remote()) and time.time() < deadline:
                time.sleep(0.05)
        ray.get([a.leave.remote() for a in self._flat()])
        moved = self._relayout(new_plan, pool, step, pool)
        seconds = time.perf_counter() - t0
        self.sink.event("grown", step=step, seconds=seconds, moved=moved, plan=new_plan.to_dict())
        print(
            f"geopipe: devices are back: now {new_plan.pipelines} pipeline(s) × "
            f"{new_plan.num_stages} stages (took {seconds:.1f} s), at step {step}",
            file=sys.stderr,
        )
        return True

    # -- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        d = self.spec.training.checkpoint.dir
        return Path(d) if d else self.run_dir / "checkpoints"

    def save_checkpoint(self, step: int) -> None:
        """Snapshot every stage (training stalls only for that) and write shards in the
        background; the manifest is committed once every shard is on disk (see
        :meth:`_poll_checkpoint`). One save at a time: a new one first completes the last."""
        import ray

        from geopipe.checkpoint.store import CheckpointWriter

        self._poll_checkpoint(wait=True)
        t0 = time.perf_counter()
        writer = CheckpointWriter(self.checkpoint_root, step)
        flat = [a for row in self.actors for a in row]
        try:
            stalls = ray.get([a.save_shard.remote(str(writer.tmp_dir), step) for a in flat])
        except BaseException:
            writer.abort()
            raise
        # Every replica's background thread takes part in the gather; replica 0's writes.
        refs = [a.shard_written.remote() for a in flat]
        self._pending_ckpt = (writer, refs, t0, max(stalls))
        if self.opts.checkpoint_sync:
            self._poll_checkpoint(wait=True)

    def _poll_checkpoint(self, wait: bool = False) -> None:
        import ray

        from geopipe.checkpoint.store import CheckpointError, prune

        pending = getattr(self, "_pending_ckpt", None)
        if pending is None:
            return
        writer, refs, t0, stall = pending
        if not wait:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) < len(refs):
                return
        self._pending_ckpt = None
        try:
            # A replica that failed after its stage's shard was written (by replica 0) does
            # not spoil the checkpoint: commit() checks that every stage's shard is there.
            errors = []
            for ref in refs:
                try:
                    info = ray.get(ref)
                except Exception as exc:
                    errors.append(exc)
                    continue
                if info is not None and info.stage not in writer.stages_written:
                    writer.add_shard(info)
            if errors:  # a replica died while saving: survivors write the shards it owed
                self._stand_in_writers(writer, refs)
            try:
                path = writer.commit(self._manifest(writer.step), num_stages=self.plan.num_stages)
            except CheckpointError:
                if errors:  # a stage's writer failed: say why, not just "shard missing"
                    raise errors[0] from None
                raise
        except BaseException:
            writer.abort()  # the previous checkpoint stays the newest complete one
            raise
        for a in self._flat():  # the stand-in copies are no longer needed
            a.release_shard.remote(writer.step)
        deleted = prune(self.checkpoint_root, self.spec.training.checkpoint.keep)
        self.sink.event(
            "checkpoint",
            step=writer.step,
            path=str(path),
            stall_s=stall,
            seconds=time.perf_counter() - t0,
            bytes=sum(f.stat().st_size for f in path.iterdir()),
            pruned=[p.name for p in deleted],
        )

    def _settle_pending_checkpoint(self) -> None:
        """After a failure: commit the save in progress if every shard made it, else drop it
        (the previous complete checkpoint stays the newest)."""
        pending, self._pending_ckpt = self._pending_ckpt, None
        if pending is None:
            return
        import ray

        writer, refs = pending[0], pending[1]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
        if len(ready) == len(refs):  # _poll_checkpoint stands in for writers that died
            self._pending_ckpt = pending
            try:
                self._poll_checkpoint(wait=True)
                return
            except Exception:  # a shard failed with its writer: _poll_checkpoint aborted it
                pass
        else:
            writer.abort()
        self.sink.event("checkpoint_abandoned", step=writer.step)

    def _stand_in_writers(self, writer: Any, refs: list) -> None:
        """Shards whose writer (replica 0) died mid-save are written by a surviving replica
        of the same stage: every replica gathered the same full state for the save. Called
        once the shards that did get written are recorded in ``writer``."""
        flat = self._flat()
        refs_of = dict(zip(map(id, flat), refs, strict=True))
        for k, row in enumerate(self.actors):
            if k in writer.stages_written:
                continue
            for a in row[1:]:
                if _ref_failed(refs_of[id(a)]):
                    continue
                info = _quiet_get([a.write_shard_instead.remote(writer.step)], 60)[0]
                if info is not None:
                    writer.add_shard(info)
                    self.sink.event("checkpoint_stand_in", step=writer.step, stage=k)
                    break

    def _manifest(self, step: int) -> dict:
        m, t = self.spec.model, self.spec.training
        return {
            "config_hash": self.spec.digest,
            "plan": self.plan.to_dict(),
            "data": {"seed": t.seed, "step": step, "source": t.data, "digest": self.data_digest},
            "model": model_shape(self.spec),
            "run": self.spec.name,
            "lr": t.lr,
            "steps_total": t.steps,
            "global_batch_size": t.global_batch_size,
            "n_embd": m.n_embd,
        }

    def _find_resume(self) -> tuple[str | None, int]:
        """The checkpoint to resume from and its step (None, 0 without --resume)."""
        from geopipe.checkpoint.store import (
            CheckpointError,
            check_compatible,
            latest_complete,
            load_checkpoint,
        )

        res = self.opts.resume
        if not res:
            return None, 0
        if res is True:
            root = self.checkpoint_root
            if not root.is_dir():
                raise LaunchError(f"--resume: no checkpoint directory {root}")

            def skipped(path: Path, reason: str) -> None:
                print(f"geopipe: skipping checkpoint {path.name}: {reason}", file=sys.stderr)
                self.skipped_checkpoints.append((path.name, reason))

            info = latest_complete(root, on_skip=skipped)
            if info is None:
                raise LaunchError(f"--resume: no complete checkpoint under {root}")
            path = info.path
        else:
            path = Path(res)
        try:
            ckpt = load_checkpoint(path)
            check_compatible(ckpt.manifest, model_shape(self.spec))
        except CheckpointError as exc:
            raise LaunchError(f"--resume: {exc}") from None
        self._resume_data_digest = ckpt.manifest.get("data", {}).get("digest")
        return str(path), ckpt.step

    def _recalibrate(self, results: list[dict], choose_delta_n: bool) -> None:
        """Replace the nominal compute model by the measured stage times; re-choose ΔN.

        ΔN is the one planner knob that changes only the action lists, not the actors'
        layout, so it can follow the measurement; the new lists take effect next step.
        After step 0 ΔN is chosen for pessimistic costs (stages 40 % faster, links 25 %
        slower than measured): too small a ΔN exposes the whole round trip, one too large
        only holds a few more activations. After step 1, run under that ΔN, only the
        prediction is updated: stage times depend on how busy the machine is, which
        depends on the schedule.
        """
        import ray

        from geopipe.config import choice_values
        from geopipe.optimizer.refine import measured_costs, pessimistic, predict, refine_delta_n

        fwd, bwd, step_t = measured_stage_times(results, self.plan.num_stages)
        costs = measured_costs(self.spec, self.plan, fwd, bwd, step_t)
        costs = with_transport_overhead(costs, results, self.plan)
        cands = choice_values(self.spec.plan.delta_n, default=[0], powers_of_two=False)
        if self.opts.plan is not None or self.plan.schedule != "lookahead":
            cands = sorted({self.plan.delta_n[j] for j in self.plan.wan_boundaries} or {0})
        new = self.plan
        if choose_delta_n:
            new, _ = refine_delta_n(self.spec, self.plan, pessimistic(costs), cands)
        t = predict(new, costs)
        self.sink.event(
            "calibrated",
            forward_s=fwd,
            backward_s=bwd,
            step_s=step_t,
            link_latency_s={"forward": list(costs.lat_f), "backward": list(costs.lat_b)},
            delta_n=list(new.delta_n),
            previous_delta_n=list(self.plan.delta_n),
            predicted_iteration_time_s=t,
        )
        if new.delta_n != self.plan.delta_n:
            ray.get([a.set_delta_n.remote(list(new.delta_n)) for row in self.actors for a in row])
        self.plan = new
        self.predicted_s = t
        self._calibrated = True

    def _write_status(self, step: int) -> None:
        plan = self.plan
        status = {
            "run": self.spec.name,
            "pid": os.getpid(),
            "state": self.state.value,
            "step": step,
            "steps": self.spec.training.steps,
            "dashboard_url": self.cluster.dashboard_url if self.cluster else None,
            "ray_address": self.cluster.address if self.cluster else None,
            "plan": plan.to_dict(),
            "stages": [
                {
                    "stage": k,
                    "site": plan.stage_sites[k],
                    "layers": list(plan.partition[k]),
                    "actors": [
                        self._name_of.get(id(a), plan.actor_name(self.spec.name, k, r))
                        for r, a in enumerate(self.actors[k])
                    ]
                    if k < len(self.actors)
                    else [],
                }
                for k in range(plan.num_stages)
            ],
            "recoveries": list(self.recoveries),
            "updated": time.time(),
        }
        tmp = self.run_dir / "status.json.tmp"
        tmp.write_text(json.dumps(status, indent=1))
        tmp.replace(self.run_dir / "status.json")

    def gather_state(self) -> dict:
        """The whole model's unsharded parameters and Adam state, keyed by parameter name.

        ``full_state`` is collective inside each ZeRO-1 group, so every replica is asked;
        replica 0's copy of each stage is kept.
        """
        import ray

        states = ray.get([a.full_state.remote() for row in self.actors for a in row])
        out: dict = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "step": None}
        d = self.plan.pipelines
        for k in range(self.plan.num_stages):
            st = states[k * d]
            for key in ("params", "exp_avg", "exp_avg_sq"):
                out[key].update(st[key])
            out["step"] = st["step"]
            out.setdefault("lr_step", st["lr_step"])
        return out

    # -- shutdown -------------------------------------------------------------------------------
    def close(self, interrupted: bool = False) -> None:
        """Stop the actors (and the embedded Ray we started); safe to call twice."""
        import ray

        if interrupted:
            self.state = State.INTERRUPTED
        elif self.state not in (State.FINISHED, State.PLANNING):
            self.state = State.FAILED
        if self.run_dir.exists() and self.plan is not None:
            with contextlib.suppress(OSError):
                self._write_status_final()
        if ray.is_initialized():
            for row in self.actors:
                for a in row:
                    with contextlib.suppress(Exception):
                        ray.kill(a)
            self.actors = []
            if self.cluster is not None and self.cluster.started_here:
                with contextlib.suppress(Exception):
                    ray.shutdown()
        if self.sink is not None:
            self.sink.close()

    def _write_status_final(self) -> None:
        path = self.run_dir / "status.json"
        if not path.exists():
            self._write_status(self.start_step)
        data = json.loads(path.read_text())
        data["state"] = self.state.value
        data["pid"] = None
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)


def _alive(actors: list[Any], timeout: float = UNRESPONSIVE_S) -> list[bool]:
    """Which actors answer a ping within ``timeout`` (all pinged at once)."""
    import ray

    refs = [a.ping.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    return [r in ready and _quiet_get([r], 0)[0] is not None for r in refs]


def _ref_failed(ref: Any) -> bool:
    """Whether a finished task's result is an error."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except Exception:
        return True
    return False


def _quiet_get(refs: list, timeout: float) -> list:
    """ray.get that turns each failure into None (for best-effort calls on survivors)."""
    import ray

    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=timeout))
        except Exception:
            out.append(None)
    return out


def model_shape(spec: ClusterSpec) -> dict:
    m = spec.model
    return {
        "n_layer": m.n_layer, "n_embd": m.n_embd, "n_head": m.n_head,
        "vocab_size": m.vocab_size, "max_seq_len": m.max_seq_len,
    }  # fmt: skip


def with_transport_overhead(costs: Any, results: list[dict], plan: Plan) -> Any:
    """Add the real transport's mean delay beyond the emulated link to each WAN hop.

    Messages between sites travel over Ray (serialise, object store, actor call, decode):
    a few milliseconds that the link model alone does not contain.
    """
    import statistics
    from dataclasses import replace

    lat_f, lat_b = list(costs.lat_f), list(costs.lat_b)
    fwd: dict[int, list[float]] = {}
    bwd: dict[int, list[float]] = {}
    for r in results:  # pooled over every replica (and step) of a stage
        ex = r.get("transport_excess_s", {})
        fwd.setdefault(r["stage"], []).extend(ex.get("F", []))
        bwd.setdefault(r["stage"], []).extend(ex.get("B", []))
    for k, xs in fwd.items():
        if xs and k > 0:
            lat_f[k - 1] = costs.lat_f[k - 1] + statistics.mean(xs)
    for k, xs in bwd.items():
        if xs and k < plan.num_stages - 1:
            lat_b[k] = costs.lat_b[k] + statistics.mean(xs)
    return replace(costs, lat_f=tuple(lat_f), lat_b=tuple(lat_b))


def measured_stage_times(
    results: list[dict], num_stages: int
) -> tuple[list[float], list[float], list[float]]:
    """Mean forward and backward seconds per stage from recorded events, and the extra time
    of each stage's last backward (it runs the ZeRO-1 reduction and the optimizer step).

    Means, not medians: the simulator adds the times up, so occasional slow operations
    (a GC pause, a busy core) belong in the figure.
    """
    import statistics

    fwd: list[list[float]] = [[] for _ in range(num_stages)]
    bwd: list[list[float]] = [[] for _ in range(num_stages)]
    extra: list[list[float]] = [[] for _ in range(num_stages)]
    for r in results:
        k = r["stage"]
        f = [t1 - t0 for kind, _, t0, t1 in r["events"] if kind == "F"]
        b = [t1 - t0 for kind, _, t0, t1 in r["events"] if kind == "B"]
        fwd[k] += f
        if len(b) > 1:
            body = statistics.mean(b[:-1])
            bwd[k] += b[:-1]
            extra[k].append(max(0.0, b[-1] - body))
        else:
            bwd[k] += b
    return (
        [statistics.mean(x) for x in fwd],
        [statistics.mean(x) for x in bwd],
        [statistics.mean(x) if x else 0.0 for x in extra],
    )


def _first(choice: Any, default: int = 1) -> int:
    from geopipe.config import Range

    if choice is None:
        return default
    if isinstance(choice, int):
        return choice
    if isinstance(choice, list):
        return choice[0]
    if isinstance(choice, Range):
        return max(1, choice.min)
    return default


class _Progress:
    """A rich progress bar with step, loss, tokens/s and bubble ratio."""

    def __init__(self, total: int, enabled: bool, done: int = 0) -> None:
        self._p = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._p = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("{task.fields[info]}"),
        )  # fmt: skip
        self._p.start()
        self._task = self._p.add_task("train", total=total, completed=done, info="")

    def update(self, m: StepMetrics) -> None:
        if self._p is None:
            return
        info = (
            f"loss {m.loss:.4f}  {m.tokens_per_s:,.0f} tok/s  bubble {m.bubble_ratio:.1%}  "
            f"{m.iteration_time_s * 1e3:.0f} ms/step"
        )
        self._p.update(self._task, advance=1, info=info)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
