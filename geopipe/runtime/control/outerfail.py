"""An outer-loop run that loses a replica group goes on with the others (M - 1 groups).

The groups of an outer run share no collective inside a step (each is its own pipeline,
ZeRO-1 inside its own sites) and meet only at the outer apply, so losing one costs the
others nothing: no checkpoint is read, no survivor redoes or loses a step. What happens
(:func:`recover_groups`, the controller's Recovering state for an outer run):

1. the lost groups: those with an actor that died or froze, or with a step that hung, and
   those :class:`~geopipe.runtime.control.outerloop.GroupsLost` names (silent past
   ``health.wan_outage_s`` at the outer apply); their remaining actors are stopped;
2. a step in flight is finished by the survivors (their calls were never aborted) and
   recorded; its metrics are the survivors'; so is each step of a span in flight
   ([Note: many inner steps per driver call] in :mod:`geopipe.runtime.actor.inner_run`):
   the groups share nothing inside a span, so the survivors run it to its end;
3. the layout drops the lost groups' pipelines (the survivors' actors are not touched:
   no reconfigure, no relayout), the survivors are told to drop the lost groups'
   peers, and the round in flight (its sends, its apply) is completed over the survivors
   ([Note: a round over the survivors] in :mod:`geopipe.runtime.actor.outer`);
4. training goes on from the next step, or the checkpoint that step was due.

[Note: what the survivors train on]
Each group keeps its own slice of every global batch (:func:`geopipe.model.data.
group_sample_indices` of its stable group id and the launch's M), and the global batch
shrinks to the survivors' slices; the lost group's samples of later steps are not trained.
The alternative, re-splitting each batch over M - 1 groups, would change every survivor's
micro-batch count (a reconfigure of every engine, its gradient scale and its programme:
steps lost to a relayout) and make each sample's group depend on the history of losses,
so a resume would need that history replayed. Kept slices leave each survivor's step
exactly the step it would have run, and a sample's index a function of (step, stable group
id, M at launch) alone: a resume or a group growing back needs only which groups are live.
The data's tokens per step and loss in the metrics are the survivors'.

[Note: a lost group growing back]
At a checkpoint boundary after a loss (as any grow-back: :class:`~geopipe.runtime.control.
recovery.Recovery`), when every site of the lost groups has its devices free again,
:func:`grow_decision` asks for the launch's plan back, whole: its group ids are the stable
ones, so every actor, reconfigured by the relayout, keeps its data slice. The boundary is a
round boundary (``training.checkpoint.every_steps`` is a multiple of ``h``) and with one
fragment every group's weights there are theta_global, so the new actors load the
survivors' boundary snapshot by name (weights and Adam moments: the inner state of the
first survivor holding them) and the outer state (theta_global, momentum, rounds) is taken
from the survivors before the relayout and loaded into every actor after it
(:meth:`~geopipe.runtime.control.outerloop.OuterRounds.rejoin`). The returning group
starts from theta_global. With ``plan.outer.fragments`` > 1 the fragments applied before
the boundary have moved on locally since, so the lost groups stay lost.

What is not done yet: a lost actor inside a group whose site still has free devices
re-forms nothing inside the group (the whole group is dropped, and may grow back): the
exchange pairs equal (stage, ZeRO-1 partition) owners across groups ([Note: the outer loop
partition by partition] in :mod:`geopipe.runtime.actor.outer`), which a group re-formed on
fewer devices would break, and the driver steps every group in lockstep, which a group
rolled back to its boundary would break (docs/checkpoints-and-recovery.md). Groups grow
back only all at once (the launch's plan), never some of them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any

from geopipe.optimizer.policies import GrowBack, Stay
from geopipe.plan import Plan
from geopipe.runtime.control.cluster import LaunchError, site_resource
from geopipe.runtime.control.health import ActorsUnresponsive, StepHung, alive, hang_timeout_s
from geopipe.runtime.control.innerrun import record_span
from geopipe.runtime.control.outerdecide import wait_deciding
from geopipe.runtime.control.outerloop import GroupsLost
from geopipe.runtime.control.states import Checkpointing, Recovering, Running, State
from geopipe.runtime.control.workers import WorkerLost

__all__ = ["grow_decision", "recorded_shape", "recover_groups", "without_groups"]


def recorded_shape(
    global_batch: int, plan: Plan, launched: Plan | None
) -> tuple[int, tuple[int, ...]]:
    """What a step of ``plan`` records: its tokens, and the group of each pipeline as a step
    result names it (``launched``: an outer run's launch plan, else None).

    A result's ``replica`` is its actor's launch position: the survivors of a lost group
    are not reconfigured, so after a loss they report positions past the shrunk plan's, and
    their groups are the launch plan's. The tokens are the survivors' slices of the global
    batch ([Note: what the survivors train on]): the micro-batches the plan's pipelines run."""
    if launched is None:
        return global_batch * plan.seq_len, plan.groups
    return plan.total_microbatches * plan.micro_batch_size * plan.seq_len, launched.groups


def without_groups(plan: Plan, lost: set[int]) -> Plan:
    """``plan`` less the pipelines of replica groups ``lost`` (stable ids); the others keep
    their ids ([Note: replica groups] in :mod:`geopipe.plan`), as their actors keep their
    data slices ([Note: what the survivors train on]): a pipeline's ``group_of`` is its
    actors' group after a loss as before it (its position ``r`` may change)."""
    keep = [r for r in range(plan.pipelines) if plan.group_of(r) not in lost]
    if not keep:
        raise ValueError("no replica group is left")
    mix = tuple(plan.mix[r] for r in keep)
    first = mix[0]
    return replace(
        plan,
        pipelines=len(keep),
        mix=mix,
        groups=tuple(plan.group_of(r) for r in keep),
        stage_sites=first.stage_sites,
        partition=first.partition,
        num_microbatches=first.num_microbatches,
        delta_n=first.delta_n,
        codecs=first.codecs,
        inflight_caps=first.inflight_caps,
    )


def _lost_groups(ctl: Any, state: Recovering, actors: list[Any]) -> tuple[set[int], dict]:
    """The stable ids of the groups lost, and each survivor's answer to the failed call
    (the step's result, or a ping's pid): the dead and the frozen found by ping, the hung
    by their unfinished call, the silent by :class:`GroupsLost`."""
    outer, w, exc = ctl.outer, ctl.workers, state.error
    group = outer.group_of
    lost = set(exc.groups) if isinstance(exc, GroupsLost) else set()
    ok = alive(w, actors, ctl.spec.health.unresponsive_s)
    lost |= {group[id(a)] for a, up in zip(actors, ok, strict=True) if not up}
    if isinstance(exc, ActorsUnresponsive):
        lost |= {group[id(actors[i])] for i in exc.indices}
    answers: dict[int, Any] = {}
    wait_s = ctl.spec.health.hang_floor_s
    if outer.span is not None:  # a span's survivors may have steps to go: as long as they may
        cal = ctl.calibrator
        wait_s = hang_timeout_s(cal.predicted_s * outer.span[1], cal.calibrated, ctl.spec.health)
    timeout = 0.0 if isinstance(exc, StepHung) else wait_s
    _finish(ctl, actors, state.refs, timeout, lost, answers)
    _drain_queued(ctl, lost, answers)
    outer.decisions = None
    return lost, answers


def _finish(
    ctl: Any, actors: list[Any], refs: list, timeout: float, lost: set[int], answers: dict
) -> None:
    """Each survivor's answer to its call ``refs[i]`` into ``answers`` (a span's steps go on
    after them), its span's outer applies decided over the survivors meanwhile
    (:func:`~geopipe.runtime.control.outerdecide.wait_deciding`); a group whose actor dies,
    raises or hangs since, or that the decisions lose, joins ``lost``."""
    outer, group = ctl.outer, ctl.outer.group_of
    while True:
        current = None
        try:
            decisions = _over_survivors(ctl, actors, lost)
            for a, ref in zip(actors, refs, strict=True):
                if group[id(a)] in lost or id(a) in answers:
                    continue
                current = a
                answers[id(a)] = wait_deciding(ctl.workers, ref, timeout, decisions)
            return
        except GroupsLost as more:  # the decisions lost them (silent, or unable to follow)
            lost |= set(more.groups)
        except Exception:  # died, raised or hung since: its group goes too
            if current is None:
                raise
            lost.add(group[id(current)])
        if not outer.live - lost:
            return


def _over_survivors(ctl: Any, actors: list[Any], lost: set[int]) -> Any:
    """The walk over the outer applies of the spans in flight, over the actors of the groups
    not ``lost`` (told to drop those; the apply in flight taken back and decided over them:
    [Note: taking back a decision] in :mod:`.outerdecide`), or None when no span is in
    flight."""
    outer = ctl.outer
    if outer.decisions is None:
        return None
    survivors = [a for a in actors if outer.group_of[id(a)] not in lost]
    if lost - (set(outer.group_of.values()) - outer.live):
        with contextlib.suppress(WorkerLost):  # a survivor died too: its call surfaces it
            outer.drop(lost & outer.live, survivors)
    return outer.decisions.over(survivors)


def _drain_queued(ctl: Any, lost: set[int], answers: dict) -> None:
    """The span queued behind the failed one ([Note: the driver's control calls] in
    :mod:`geopipe.optimizer.outer_cost`) runs on the survivors too: its steps follow theirs
    in ``answers`` (a survivor that fails it loses its group), and nothing stays queued."""
    outer, q = ctl.outer, ctl.outer.queued
    outer.queued = None
    if q is None:
        return
    cal = ctl.calibrator
    wait_s = hang_timeout_s(cal.predicted_s * q.count, cal.calibrated, ctl.spec.health)
    mine = {id(a): answers.pop(id(a), None) for a in q.flat}
    _finish(ctl, q.flat, q.refs, wait_s, lost, answers)
    for a in q.flat:
        before, got = mine.get(id(a)), answers.get(id(a))
        if isinstance(before, list) and isinstance(got, list):
            answers[id(a)] = before + got
        elif before is not None and got is None:
            answers[id(a)] = before


def recover_groups(ctl: Any, state: Recovering) -> State:
    """Go on without the replica groups the failure of ``state`` cost (see the module's
    docstring); ``ctl`` is the :class:`~geopipe.runtime.control.controller.Controller`
    (its placement, workers, reporter, history, outer rounds, and its step recording).
    Raises :class:`LaunchError` when no group is lost (a failure the outer loop cannot
    pin on a group) or none is left."""
    t0 = time.perf_counter()
    pl, outer, rep = ctl.placement, ctl.outer, ctl.reporter
    actors = pl.flat()
    lost, answers = _lost_groups(ctl, state, actors)
    err = str(state.error).strip().splitlines()[-1][:300] if str(state.error).strip() else ""
    if not lost:
        raise LaunchError(
            f"the outer-loop run failed at step {state.step} ({err or type(state.error)}) "
            "without losing a replica group: resume from the last checkpoint"
        )
    if not outer.live - lost:
        raise LaunchError(
            f"every replica group of the outer loop was lost at step {state.step} ({err}): "
            f"resume from the last checkpoint under {ctl.checkpoints.where()}"
        )
    gone = [a for a in actors if outer.group_of[id(a)] in lost]
    names = {id(a): pl.name_of(a, k, r) for (k, r), a in pl.roles().items()}
    survivors = _leave_out(pl, outer.group_of, lost)
    ctl.checkpoints.settle()
    ctl.recovery.outer = outer  # a grow-back brings the lost groups back
    sites = sorted({outer.site_of[g] for g in lost})
    left = sorted(outer.live - lost)
    rep.event(
        "failure",
        step=state.step,
        dead=[names[id(a)] for a in gone],
        error=err,
        lost_sites=sites,
        lost_groups=sorted(lost),
    )
    mid_step = any(not isinstance(x, int) for x in answers.values())  # a ping answers a pid
    ctl._set_plan(pl.plan)
    outer.span, done = None, state.step
    if mid_step:  # the survivors finished the step, or a span of them: they count
        mine = [answers[id(a)] for a in survivors]
        if isinstance(mine[0], list):
            done = record_span(ctl, state.step, mine, survivors)
        else:
            ctl._record(state.step, mine)
            done = state.step + 1
    seconds = time.perf_counter() - t0
    rep.event(
        "recovered",
        step=done,
        failed_step=state.step,
        lost_steps=0,
        lost_sites=sites,
        lost_groups=sorted(lost),
        groups_left=left,
        source="surviving groups",
        restored_from=None,
        seconds=seconds,
        plan=pl.plan.to_dict(),
    )
    rep.say(
        f"replica group(s) {sorted(lost)} lost at step {state.step} (site(s) "
        f"{', '.join(sites)}): the other {len(left)} go on, no step lost"
    )
    ctl.history.recovered(seconds, done, state.step)
    ctl._relaid(done)
    try:  # the survivors drop the lost; the round in flight, over the survivors
        outer.drop(lost, survivors)
        outer.after_step(done, survivors)
    except WorkerLost as exc:  # another group went meanwhile: from what is left now
        return Recovering(done, exc, ctl._pings())
    return _next(ctl, done)


def _leave_out(pl: Any, group_of: dict[int, int], lost: set[int]) -> list[Any]:
    """Stop the actors of the groups ``lost`` (stable ids) and take their pipelines out of
    the placement's plan and rows; returns the survivors."""
    actors = pl.flat()
    for a in actors:
        if group_of[id(a)] in lost:
            pl.kill(a)
    head = pl.rows[0]  # pipeline r's stage-0 actor names its group
    drop = {pl.plan.group_of(r) for r, a in enumerate(head) if group_of[id(a)] in lost}
    keep = [r for r in range(pl.plan.pipelines) if pl.plan.group_of(r) not in drop]
    pl.plan = without_groups(pl.plan, drop)
    pl.rows = [[row[r] for r in keep if r < len(row)] for row in pl.rows]
    return [a for a in actors if group_of[id(a)] not in lost]


def _next(ctl: Any, done: int) -> State:
    """What follows ``done`` finished steps, as after any step (``Controller._run``)."""
    total = ctl.spec.training.steps
    if ctl.stop.requested:
        return Checkpointing(done, final=True, interrupted=True)
    if done >= total:
        return Checkpointing(done, final=True)
    every = ctl.spec.training.checkpoint.every_steps
    if every and done % every == 0:
        return Checkpointing(done)
    return Running(done)


def grow_decision(recovery: Any) -> GrowBack | Stay:
    """Whether the lost replica groups can grow back now ([Note: a lost group growing
    back]): every device of the launch's plan free or in use by this run."""
    outer, plan = recovery.outer, recovery.plan
    full = outer.run.plan if outer is not None else plan
    if plan.pipelines == full.pipelines:
        return Stay("no replica group lost")
    if outer.settings.fragments > 1:
        return Stay("with plan.outer.fragments > 1 a lost replica group does not grow back")
    want: dict[str, int] = {}
    for k, r in full.actors():
        want[full.site_of(k, r)] = want.get(full.site_of(k, r), 0) + 1
    used: dict[str, int] = {}
    for _, site in recovery.placement.actor_sites():
        used[site] = used.get(site, 0) + 1
    free = recovery.workers.available()
    short = {
        s: n - used.get(s, 0) - int(free.get(site_resource(s), 0))
        for s, n in want.items()
        if n > used.get(s, 0) + int(free.get(site_resource(s), 0))
    }
    if short:
        return Stay(f"the lost replica groups' devices are not back ({short} missing)")
    now_s = recovery.layout_s or 0.0
    return GrowBack(full, now_s, now_s)
