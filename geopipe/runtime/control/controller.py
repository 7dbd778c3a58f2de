"""The controller: a small state machine over components that each do one job.

Like Ray Train V2's controller, each state is a type carrying its payload, and
:meth:`Controller._step` maps a state to the next::

    Running(step) ──step done──▶ Running(step+1) | Checkpointing(step+1) | Growing(step+1)
        │ failed
        ▼
    Recovering(step, error) ──▶ Running(boundary)
    Growing(step, decision) ──▶ Checkpointing(step)
    Checkpointing(step, final) ──▶ Running(step) | Finished | Interrupted | Recovering

The components: :class:`~geopipe.runtime.control.placement.Placement` (actors, names, wiring),
:mod:`~geopipe.runtime.control.health` (errors, heartbeat, hang timeout),
:class:`~geopipe.runtime.control.recovery.Recovery` (relayout after failures and grow-back),
:class:`~geopipe.runtime.control.checkpointing.CheckpointCoordinator`,
:class:`~geopipe.runtime.control.calibration.Calibrator` and
:class:`~geopipe.runtime.control.reporting.Reporter` (status file, progress, metrics). Decisions
(recover how, grow or not) are the planner's pure policies.

Whatever happens — an error, Ctrl-C — :meth:`Controller.close` stops the actors and, when
this process started the embedded Ray, Ray itself, so no processes are left behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path
from typing import Any

from geopipe.config import ClusterSpec
from geopipe.optimizer.errors import PlanningError
from geopipe.optimizer.evaluate import Evaluation
from geopipe.optimizer.measurements import Measurements
from geopipe.optimizer.outerplan import OuterRun
from geopipe.optimizer.runplan import Overrides, plan_run
from geopipe.plan import Plan
from geopipe.runtime.control.calibration import Calibrator
from geopipe.runtime.control.chaos import ChaosMonkey
from geopipe.runtime.control.checkpointing import CheckpointCoordinator
from geopipe.runtime.control.cluster import ClusterInfo, LaunchError, auth_env
from geopipe.runtime.control.context import RunContext
from geopipe.runtime.control.guards import NanGuard, guard_codecs
from geopipe.runtime.control.health import (
    ActorsUnresponsive,
    StepHung,
    await_step,
    hang_timeout_s,
    raise_model_error,
)
from geopipe.runtime.control.history import RunHistory
from geopipe.runtime.control.innerrun import next_state, run_span
from geopipe.runtime.control.launching import launch_components
from geopipe.runtime.control.metrics import aggregate, measured_events
from geopipe.runtime.control.options import LaunchOptions, RunResult
from geopipe.runtime.control.outerckpt import check_outer_launch
from geopipe.runtime.control.outerfail import recorded_shape, recover_groups
from geopipe.runtime.control.outerloop import OuterRounds
from geopipe.runtime.control.placement import Placement
from geopipe.runtime.control.planning import measure_before_planning
from geopipe.runtime.control.recovery import Recovery
from geopipe.runtime.control.reporting import Reporter
from geopipe.runtime.control.signals import StopRequest, graceful_sigint
from geopipe.runtime.control.states import (
    TERMINAL,
    Checkpointing,
    Failed,
    Finished,
    Growing,
    Interrupted,
    Launching,
    Planning,
    Recovering,
    Running,
    State,
    Waiting,
)
from geopipe.runtime.control.teardown import stop_actors
from geopipe.runtime.control.workers import (
    RayWorkers,
    WorkerFailed,
    WorkerLost,
    Workers,
    ask,
    call_all,
)
from geopipe.transport.security import make_credentials

__all__ = [
    "OUTER_NOT_LAUNCHED",
    "Controller",
    "LaunchOptions",
    "RunResult",
    "State",
]

# What launch says when the strategy table's outer loop is one the runtime cannot run yet
# (the reason follows: groups of different layouts, a split tied embedding).
OUTER_NOT_LAUNCHED = (
    "plan.strategy chose an outer loop between replica groups that `geopipe plan` prices but "
    "launch cannot run yet (set plan.strategy: pipeline to launch the pipeline across sites)"
)

# A recovery interrupted by another death is retried from what is left, this many times.
MAX_NESTED_RECOVERIES = 3


def run_dir_for(spec: ClusterSpec, override: str | None) -> Path:
    return Path(override or spec.training.run_dir or os.path.join("runs", spec.name))


class Controller:
    """Owns one training run on one Ray cluster (or, in tests, on whatever ``workers``
    stands for it: :mod:`geopipe.runtime.control.workers`)."""

    workers: Workers  # every actor call and the cluster's resources go through it
    spec: ClusterSpec
    opts: LaunchOptions
    state: State
    run_dir: Path
    lr_horizon: int  # the LR schedule's horizon (the YAML's steps, not --steps)
    reporter: Reporter
    checkpoints: CheckpointCoordinator
    placement: Placement | None
    recovery: Recovery | None
    calibrator: Calibrator | None
    chaos: ChaosMonkey
    cluster: ClusterInfo | None
    plan: Plan | None
    predicted: Evaluation | None
    start_step: int  # > 0 when resuming
    data_digest: str | None  # sha256 of the corpus every actor reads

    def __init__(
        self,
        spec: ClusterSpec,
        options: LaunchOptions | None = None,
        workers: Workers | None = None,
    ) -> None:
        opts = options or LaunchOptions()
        # Stopping at N and resuming to 2N must follow the same LR schedule as running 2N in
        # one go, so the horizon is the YAML's, never --steps.
        self.lr_horizon = spec.training.lr_decay_steps or spec.training.steps
        # This launch's identity: in status.json, the metrics and every checkpoint it
        # writes; recovery restores only checkpoints of its lineage (see _plan()).
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        self.overrides = Overrides(opts.steps, opts.schedule, opts.plan)
        self.ctx = RunContext(
            spec, self.overrides, opts.health, run_id=run_id, lineage={run_id: None}
        )
        auth_env(self.spec)  # before anything imports ray: it reads RAY_AUTH_MODE at import
        self.workers = workers if workers is not None else RayWorkers()
        self.opts = opts
        self.state = Planning()
        self.run_dir = run_dir_for(self.spec, opts.run_dir)
        self.history = RunHistory()  # failures, recoveries, grow-backs: the run's own record
        self.reporter = Reporter(
            self.spec.name, self.run_dir, self.spec.training.steps, self.history
        )
        self.nan_guard = NanGuard(self.spec.training, self.reporter)
        # The data plane's secret (and TLS CA): made here, handed to the actors over Ray.
        self.creds = make_credentials(run_id, self.spec.encrypted)
        self.reporter.run_id, self.reporter.sets = run_id, list(opts.sets)
        # The checkpoint coordinator reads the settings (directories, keep, clocks); site
        # copies are paced by the link rates of the context current when they run.
        self.checkpoints = CheckpointCoordinator(
            self.spec,
            self.run_dir,
            self.reporter,
            self._rows,
            self._manifest,
            synchronous=opts.checkpoint_sync,
            stage_sites=lambda: list(self.plan.stage_sites) if self.plan else [],
            actor_sites=lambda: self.placement.actor_sites() if self.placement else [],
            creds=self.creds,
            link=lambda a, b: self.ctx.priced.link(a, b),
            workers=self.workers,
        )
        self.placement = self.recovery = self.calibrator = None
        self.cluster = self.plan = self.predicted = None
        self.start_step, self.data_digest = 0, None
        self.chaos = ChaosMonkey(
            opts.chaos_kill_every, self.spec.training.seed, 0, self.reporter, self.workers
        )
        self._resume: Any = None
        self.links_measured: list = []  # the WAN links as probed at launch
        self.outer_run: OuterRun | None = None  # the strategy's outer loop, when chosen
        self.outer: OuterRounds | None = None  # its driver half, from Launching on
        self.planned_with = Measurements()  # what the plan was made with (the plan event)
        self.stop = StopRequest(self.reporter.say)  # set by the first Ctrl-C while training
        self._nested_failures = 0  # recoveries in a row that a further death interrupted

    @property
    def spec(self) -> ClusterSpec:
        """The settings the run executes (the YAML with the command line's overrides)."""
        return self.ctx.settings

    @property
    def run_id(self) -> str:
        return self.ctx.run_id

    @property
    def lineage(self) -> dict[str, int | None]:
        return self.ctx.lineage

    # -- public surface ------------------------------------------------------------------------
    @property
    def actors(self) -> list[list[Any]]:
        """The stage actors now, ``[stage][replica]``."""
        return self._rows()

    @property
    def names(self) -> list[str]:
        """Every actor name the run has used (replacements included)."""
        return self.placement.names if self.placement else []

    @property
    def skipped_checkpoints(self) -> list[tuple[str, str]]:
        return self.checkpoints.skipped

    def _rows(self) -> list[list[Any]]:
        return self.placement.rows if self.placement else []

    @property
    def metrics_path(self) -> Path | None:
        """Where the per-step metrics lines go (None before :meth:`launch`)."""
        sink = self.reporter.sink
        return sink.path if sink is not None else None

    @property
    def predicted_s(self) -> float:
        """The step time the controller predicts now (calibrated once measured)."""
        return self.calibrator.predicted_s

    def flat_actors(self) -> list[Any]:
        return [a for row in self._rows() for a in row]

    # -- PLANNING and LAUNCHING ----------------------------------------------------------------
    def launch(self) -> None:
        """Plan, then start and wire the actors: the states Planning and Launching."""
        self.state = Planning()
        while isinstance(self.state, (Planning, Launching)):
            self._status_early()
            self.state = self._step(self.state)

    def _plan(self) -> State:
        """PLANNING: find the checkpoint to resume, measure this machine (when the run
        profiles it) and plan with :func:`~geopipe.optimizer.runplan.plan_run`, the function
        ``geopipe plan`` and ``--dry-run`` call."""
        self._resume = self.checkpoints.find_resume(self.opts.resume, self.run_id)
        self.start_step = self._resume.step if self._resume else 0
        if self._resume is not None:  # the resumed run's checkpoints up to here are ours too
            self.ctx = self.ctx.resumed(self._resume.lineage_for(self.run_id))
        self.checkpoints.identify(self.run_id, self.lineage, fresh=self._resume is None)
        self.chaos.first_step = self.start_step
        self.ctx = self.ctx.measured(measure_before_planning(self.spec, self.overrides))
        try:
            rp = plan_run(self.ctx.spec, self.ctx.measurements, self.overrides)
        except PlanningError as exc:
            raise LaunchError(str(exc)) from None
        if rp.outer_refused:
            raise LaunchError(f"{OUTER_NOT_LAUNCHED}: {rp.outer_refused}")
        check_outer_launch(self.spec, rp.outer, self._resume)
        self.outer_run = rp.outer
        self.ctx = self.ctx.planned(rp.plan, rp.predicted)
        self.planned_with = self.ctx.measurements
        self.plan, self.predicted = rp.plan, rp.predicted
        return Launching()

    def _status_early(self) -> None:
        """status.json during Planning and Launching (once there is a plan to show)."""
        if self.plan is not None:
            with contextlib.suppress(OSError):
                self._status(self.start_step)

    # -- RUNNING: the state machine ------------------------------------------------------------
    def train(self) -> RunResult:
        """Run optimizer steps ``start .. steps-1`` (``start`` > 0 when resuming).

        Ctrl-C finishes the step in flight, saves a checkpoint and then raises
        KeyboardInterrupt; a second Ctrl-C abandons the step.
        """
        self.calibrator.restart(self.start_step)
        self._result = RunResult(
            self.plan,
            self.predicted,
            run_dir=self.run_dir,
            dashboard_url=self.cluster.dashboard_url if self.cluster else None,
            actor_names=list(self.names),
        )
        self._last_results: list = []
        self.reporter.start_progress(self.opts.progress, self.start_step)
        self.stop.requested = False
        with graceful_sigint(self.stop):
            try:
                while not isinstance(self.state, TERMINAL):
                    self.state = self._step(self.state)
            finally:
                self.reporter.stop_progress()
        if self.opts.trace and self._last_results:
            from geopipe.timeline import write_chrome_trace

            write_chrome_trace(
                self.opts.trace,
                measured_events(self._last_results),
                process=f"{self.spec.name} (measured)",
            )
        if isinstance(self.state, Interrupted):
            raise KeyboardInterrupt
        return self._result

    def _step(self, state: State) -> State:
        """Advance the run by one state."""
        if isinstance(state, Running):
            return self._run(state.step)
        if isinstance(state, Planning):
            return self._plan()
        if isinstance(state, Launching):
            return launch_components(self)
        if isinstance(state, Recovering):
            if self.outer is not None:  # the other groups go on (runtime.control.outerfail)
                return recover_groups(self, state)
            self._status(state.step, state)
            grace_s = max(5.0, 2 * self.calibrator.predicted_s)
            try:
                rec = self.recovery.recover(state.step, state.refs, state.error, grace_s)
            except WorkerLost as exc:
                # a survivor died while re-forming: recover again (a bounded number of times)
                self._nested_failures += 1
                if self._nested_failures > MAX_NESTED_RECOVERIES:
                    raise
                return Recovering(state.step, exc, self._pings())
            self._nested_failures = 0
            self._relaid(rec.step)
            return Running(rec.step)
        if isinstance(state, Growing):
            self._status(state.step, state)
            try:  # the save in flight first: its gathers run on the groups a grow-back leaves
                self.checkpoints.poll(wait=True)
            except ActorsUnresponsive as exc:  # a wedged writer: recover instead of growing
                return Recovering(state.step, exc, self._pings())
            self.recovery.grow(state.step, state.decision)
            self._relaid(state.step)
            return Checkpointing(state.step)
        if isinstance(state, Checkpointing):
            return self._checkpoint(state)
        raise RuntimeError(f"no transition from {state}")

    def _pings(self) -> list:
        """A ping to every actor: the calls a recovery watches when no step was running."""
        return call_all(self.workers, self.flat_actors(), "ping")

    def _run(self, step: int) -> State:
        total = self.spec.training.steps
        if step >= total:  # e.g. resumed at the end: nothing to run
            return Checkpointing(step, final=True) if self._result.steps else Finished()
        if self.outer is not None and self.outer.max_span != 0:  # many steps per call
            return run_span(self, step)
        record = self.calibrator.wants(step) or (bool(self.opts.trace) and step == total - 1)
        flat = self.flat_actors()
        refs = call_all(self.workers, flat, "run_iteration", step, record)
        self.chaos.maybe_strike(step, self._rows(), self.calibrator.predicted_s)
        hang_s = hang_timeout_s(
            self.calibrator.predicted_s, self.calibrator.calibrated, self.spec.health
        )
        results = self._await(step, flat, refs, hang_s)
        if isinstance(results, Recovering):
            return results
        nxt = step + 1
        try:
            self._record(step, results)
            if self.outer is not None:  # the outer loop's sends and applies after this step
                self.outer.after_step(nxt, [a for a, _ in self.placement.actor_sites()])
            self.evals.after_step(nxt, total, self.flat_actors())  # training.eval
        except (WorkerLost, WorkerFailed) as exc:  # an actor died between steps (ΔN)
            raise_model_error(exc)  # a diverged pseudo-gradient: no recovery
            return Recovering(nxt, exc, self._pings())
        return next_state(self, nxt)

    def _await(
        self, step: int, flat: list, refs: list, hang_s: float, side: Any = None
    ) -> list | Recovering:
        """The answers to the calls ``refs`` (one per actor of ``flat``) that run from
        ``step`` on, or the Recovering state their failure calls for (a model error ends the
        run instead): one step's calls here, a span's in runtime.control.innerrun (with its
        outer applies' decisions as ``side`` work: :func:`await_step`)."""
        site_of = {id(a): s for a, s in self.placement.actor_sites()}
        sites = [site_of.get(id(a), "?") for a in flat]
        try:
            return await_step(
                self.workers,
                flat,
                refs,
                hang_s,
                self.spec.health,
                sites,
                lambda *e: self._silence(step, sites, *e),
                side,
            )
        except (WorkerLost, WorkerFailed, StepHung, ActorsUnresponsive) as exc:
            raise_model_error(exc)  # the model's own exception: no recovery
            return Recovering(step, exc, refs)

    def run_step(self, step: int) -> list:
        """One optimizer step outside the state machine (benchmarks): nothing is recorded
        and a failure raises instead of recovering."""
        flat = self.flat_actors()
        refs = call_all(self.workers, flat, "run_iteration", step, False)
        hang_s = hang_timeout_s(0.0, False, self.spec.health)
        return await_step(self.workers, flat, refs, hang_s, self.spec.health)

    def _record(
        self, step: int, results: list, at: float | None = None, status: bool = True
    ) -> None:
        """Metrics, calibration, status and progress of a finished step (``at``: when the
        driver received it, on the wall clock: a span's steps share their span's; default
        now; ``status``: rewrite status.json, which a span does at its last step only)."""
        launched = self.outer_run.plan if self.outer_run else None
        tokens, groups = recorded_shape(self.spec.training.global_batch_size, self.plan, launched)
        m = aggregate(results, self.plan.num_stages, tokens, groups)
        self._result.steps.append(m)
        self.reporter.step(m, self.calibrator.predicted_s, at)
        # The calibration model replays one uniform layout; a mix keeps the planner's
        # prediction (its pipelines' ΔN were chosen with it); an outer run's is re-priced.
        if not self.plan.heterogeneous or self.outer is not None:
            self._calibrate(step, results)
        self._guard_codecs(step, results)
        self.nan_guard.check(step, results)  # before this boundary can be checkpointed
        if status:
            self._status(step + 1)
        self._last_results = results
        self.checkpoints.poll()

    def _calibrate(self, step: int, results: list) -> None:
        """Predict the next step from the measured ones; hand out a re-chosen ΔN."""
        cal = self.calibrator.observe(step, self.plan, results)
        if cal.event is not None:
            self.reporter.event("calibrated", **cal.event)
        if cal.plan.delta_n != self.plan.delta_n:
            ask(self.workers, self.flat_actors(), "set_delta_n", list(cal.plan.delta_n))
        self._set_plan(cal.plan)

    def _guard_codecs(self, step: int, results: list) -> None:
        """A hop erring past ``plan.max_codec_error`` falls back (:func:`guard_codecs`)."""
        plan = guard_codecs(
            self.spec, self.plan, step, results, self.workers, self.flat_actors(), self.reporter
        )
        if plan is not None:
            self._set_plan(plan)

    def _checkpoint(self, state: Checkpointing) -> State:
        try:
            self.checkpoints.save(state.step)
            if state.final:  # the last save must commit (after a recovery: saved again)
                self.checkpoints.poll(wait=True, final=True)
        except (WorkerLost, WorkerFailed, ActorsUnresponsive) as exc:  # or a writer froze
            return Recovering(state.step, exc, self._pings())
        if not state.final:
            return Running(state.step)
        return Interrupted() if state.interrupted else Finished()

    def _relaid(self, step: int) -> None:
        """A new layout runs from ``step``: measure it afresh."""
        self._set_plan(self.placement.plan)
        self.evals.prepare(self.flat_actors())  # the held-out data on the new layout's actors
        self.calibrator.restart(step)
        if self.plan.heterogeneous and self.recovery.layout_s is not None:
            self.calibrator.predicted_s = self.recovery.layout_s  # not calibrated for mixes

    def _set_plan(self, plan: Plan) -> None:
        self.plan = self.placement.plan = plan

    def _silence(self, step: int, sites: list[str], event: str, site: str, secs: float) -> None:
        """A site went silent mid-step, stays so, or answers again (``Reporter.silence``
        says so); status.json shows Waiting while it is silent."""
        limit = self.spec.health.wan_outage_s
        if self.reporter.silence(step, sites, event, site, secs, limit):
            self._status(step, Waiting(step))
        else:
            self._status(step)

    def _status(self, step: int, state: State | None = None) -> None:
        names = self.placement.current_names() if self.placement else []
        self.reporter.status((state or self.state).name, step, self.plan, names)

    # -- state of the whole model ---------------------------------------------------------------
    def _manifest(self, step: int) -> dict:
        return self.ctx.manifest(self.plan, step, self.data_digest)

    def gather_state(self) -> dict:
        """The whole model's unsharded parameters and Adam state, keyed by parameter name."""
        return self.placement.gather_state()

    # -- shutdown -------------------------------------------------------------------------------
    def close(self, interrupted: bool = False) -> None:
        """Stop the actors (and the embedded Ray we started); safe to call twice."""
        if interrupted:
            self.state = Interrupted()
        elif not isinstance(self.state, (Finished, Planning)):
            self.state = Failed()
        if self.run_dir.exists() and self.plan is not None:
            with contextlib.suppress(OSError):
                if not (self.run_dir / "status.json").exists():
                    self._status(self.start_step)
                self.reporter.final_status(self.state.name)
        if self.workers.connected():
            stop_actors(
                self.workers,
                self.checkpoints,
                self.placement,
                self.cluster,
                self.spec.ray.namespace,
                self.reporter,
            )
        self.reporter.close()
