"""Executing a recovery or a grow-back: the decisions are the planner's, the moves are here.

Recovery re-forms the job in place after a step failed, Oobleck-style:

1. find the dead and release the survivors: make their iteration fail fast, have them leave
   their process groups; a survivor stuck in a collective with a stopped replica is
   replaced by a fresh actor on its device (:meth:`Recovery._release`);
2. find the newest step boundary every stage still holds in some survivor's memory — the
   failed step is redone, no optimizer step is lost or half-applied;
3. ask the pure policy (:func:`decide`) for the layout: reconfigure on the survivors,
   restore the latest checkpoint, or fail;
4. lay the new plan over the survivors and restore every actor's state by parameter name
   (:mod:`geopipe.runtime.actor.handoff`): its own memory, else a same-site holder over
   ``torch.distributed``, else through the object store (:meth:`Recovery.relayout`).

Grow-back (:meth:`Recovery.grow`) uses the same relayout once the grow-back policy says a
better layout fits devices that came back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from geopipe.config import ClusterSpec, HealthSpec
from geopipe.optimizer.policies import (
    Fail,
    Failure,
    GrowBack,
    RestoreFromCheckpoint,
    Stay,
    decide,
    decide_grow,
    newest_common_boundary,
)
from geopipe.plan import ActorKey, Plan
from geopipe.runtime.control.checkpointing import CheckpointCoordinator
from geopipe.runtime.control.cluster import LaunchError, site_resource
from geopipe.runtime.control.health import ActorsUnresponsive, alive, quiet_get
from geopipe.runtime.control.history import RunHistory
from geopipe.runtime.control.placement import Placement
from geopipe.runtime.control.reporting import Reporter
from geopipe.runtime.control.workers import WorkerLost, Workers, ask, call_all

__all__ = ["Recovered", "Recovery"]

Key = ActorKey  # (stage, replica) in the plan that was running


@dataclass(frozen=True)
class Recovered:
    """Where training continues after a recovery."""

    step: int
    seconds: float


class Recovery:
    """Re-forms the run's layout after failures and when devices come back."""

    def __init__(
        self,
        spec: ClusterSpec,
        placement: Placement,
        checkpoints: CheckpointCoordinator,
        reporter: Reporter,
        health: HealthSpec,
        history: RunHistory,
        templates: Any,
        workers: Workers,
    ) -> None:
        self.spec = spec
        self.workers = workers  # calls the actors (Placement makes and kills them)
        self.placement = placement
        self.checkpoints = checkpoints
        self.reporter = reporter
        self.health = health
        self.history = history  # the controller's record of the run (recoveries, grow-backs)
        # Pipeline templates for every device count, built at launch before anything fails.
        self.templates = templates
        self.layout_s: float | None = None  # the running layout's predicted step time
        self.seen_reducing: list[Key] = []  # last recovery: survivors seen stuck reducing
        # An outer-loop run's OuterRounds, set when it first loses a replica group: a
        # grow-back then brings the lost groups back (runtime.control.outerfail).
        self.outer: Any = None

    @property
    def plan(self) -> Plan:
        return self.placement.plan

    # -- recovery ------------------------------------------------------------------------------
    def recover(self, step: int, refs: list, exc: BaseException, grace_s: float) -> Recovered:
        """Re-form the job after step ``step`` failed with ``exc``; ``refs`` are the step's
        calls, one per actor in :meth:`Placement.roles` order; ``grace_s`` is how long an
        aborted survivor may take to stop."""
        t0 = time.perf_counter()
        roles = self.placement.roles()
        ref_of = dict(zip(roles, refs, strict=True))
        names = {key: self.placement.name_of(a, *key) for key, a in roles.items()}
        dead = self._find_dead(roles, ref_of, exc)
        lost_sites = self._lost_sites(dead)
        # A save in flight commits if its shards can still be written (a survivor stands in
        # for a dead writer); only now, with the frozen killed, can its calls all finish.
        self.checkpoints.settle()
        err = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        self.reporter.event(
            "failure", step=step, dead=[names[k] for k in dead], error=err, lost_sites=lost_sites
        )
        lost = f"; site(s) {', '.join(lost_sites)} lost entirely" if lost_sites else ""
        self.reporter.say(
            f"step {step} failed ({len(dead)} actor(s) lost{lost}: {err}): recovering"
        )
        survivors = {key: a for key, a in roles.items() if key not in dead}
        released = self._release(survivors, ref_of, grace_s)
        w = self.workers
        have = {
            k: set(quiet_get(w, [w.call(a, "boundary_steps")], 30)[0] or [])
            for k, a in survivors.items()
        }
        boundary, holders = newest_common_boundary(
            have, self.plan.num_stages, step, self._covers(list(have))
        )
        decision, ckpt = self._decide(
            [*dead, *released], [*survivors, *released], boundary, holders
        )
        if isinstance(decision, Fail):
            raise LaunchError(
                f"unrecoverable after step {step} failed ({err}): {decision.reason} "
                f"(survivors hold step boundaries "
                f"{ {f'stage{k}/r{r}': sorted(v) for (k, r), v in have.items()} }); the last "
                f"checkpoint under {self.checkpoints.where()} is intact"
            )
        new_plan = decision.plan
        sources = (
            []
            if ckpt is not None
            else [(survivors[key], key) for key in survivors if boundary in have[key]]
        )
        pool = list((a, key) for key, a in survivors.items())
        moved = self.relayout(new_plan, pool, boundary, sources, ckpt)
        self.layout_s = decision.predicted_s
        resume_at = ckpt.step if ckpt is not None else boundary
        seconds = time.perf_counter() - t0
        restored = None
        if ckpt is not None:
            restored = {"step": ckpt.step, "site": ckpt.site, "paths": ckpt.paths}
        self.reporter.event(
            "recovered",
            step=resume_at,
            failed_step=step,
            lost_steps=step - resume_at,
            lost_sites=lost_sites,
            source="checkpoint" if ckpt is not None else "surviving replicas",
            restored_from=restored,
            seconds=seconds,
            replaced_stuck=[names[k] for k in released],
            stuck_seen_reducing=[names[k] for k in self.seen_reducing],
            moved=moved,
            plan=new_plan.to_dict(),
        )
        how = "surviving replicas"
        if ckpt is not None:
            how = f"checkpoint {ckpt.name}" + (f" (site {ckpt.site}'s copy)" if ckpt.site else "")
        self.reporter.say(
            f"recovered in {seconds:.1f} s from {how}: {new_plan.describe()}, "
            f"continuing at step {resume_at}"
        )
        self.history.recovered(seconds, resume_at, step)
        return Recovered(resume_at, seconds)

    def _find_dead(
        self, roles: dict[Key, Any], ref_of: dict[Key, Any], exc: BaseException
    ) -> list[Key]:
        """The actors that died, froze or hung; the frozen and the hung are killed."""
        if isinstance(exc, ActorsUnresponsive):  # frozen: no ping would come back either
            keys = list(roles)
            dead = [keys[i] for i in exc.indices]
        else:
            answers = alive(self.workers, list(roles.values()), self.health.unresponsive_s)
            dead = [key for key, ok in zip(roles, answers, strict=True) if not ok]
            if dead:
                return dead
            # a hang: whoever has not finished is presumed stuck
            refs = list(ref_of.values())
            _, stuck = self.workers.wait(refs, num_returns=len(ref_of), timeout=0)
            dead = [key for key, ref in ref_of.items() if ref in stuck]
        for key in dead:
            self.placement.kill(roles[key])
        return dead

    def _lost_sites(self, dead: list[Key]) -> list[str]:
        """Sites of the running plan none of whose actors survive."""
        plan, gone = self.plan, set(dead)
        sites = dict.fromkeys(plan.site_of(*key) for key in plan.actors())
        keys = plan.actors()
        return [s for s in sites if all(k in gone for k in keys if plan.site_of(*k) == s)]

    def _covers(self, keys: list[Key]) -> dict[Key, set[int]]:
        """Pipeline 0's stages whose layers each actor's snapshots hold (its ZeRO-1 group's
        layers: in a mixed plan possibly more than its own stage's)."""
        plan = self.plan
        hold = plan.held_layers()
        return {
            key: {
                j
                for j, (a, z) in enumerate(plan.partition)
                if hold[key][0] <= a and z <= hold[key][1]
            }
            for key in keys
        }

    def _release(self, survivors: dict[Key, Any], ref_of: dict[Key, Any], grace_s: float) -> list:
        """Stop the survivors' iteration and have them leave their process groups; returns
        the survivors that had to be replaced (removed from ``survivors``).

        [Note: stuck in a collective] A survivor still running after the abort is blocked in
        a collective with a replica that stopped. Neither gloo nor NCCL lets it go until
        that replica's process exits or the collective times out (measured: ``abort()``,
        ``shutdown()`` and ``destroy_process_group()`` on the other side do not close gloo's
        connections). Its device is healthy, so it is replaced by a fresh actor at once —
        unless it is its stage's last holder: then its partner must be one of the dead,
        whose process is still going (Ray SIGKILLs a frozen one after its kill grace: [Note:
        killing a frozen actor] in geopipe.runtime.control.cluster), and that exit releases
        it.
        """
        call_all(self.workers, list(survivors.values()), "abort")
        released = self._wait_aborted(survivors, ref_of, grace_s)
        cov = self._covers(list(survivors))
        kept = set().union(*(cov[j] for j in survivors if j not in released))
        needed = [k for k in released if not cov[k] <= kept]  # holds state no one else does
        if needed:
            done, _ = self.workers.wait(
                [ref_of[k] for k in needed],
                num_returns=len(needed),
                timeout=self.health.stuck_release_s,
            )
            released = [k for k in released if ref_of[k] not in done]
        for k in released:
            self.placement.kill(survivors.pop(k))
        quiet_get(self.workers, call_all(self.workers, list(survivors.values()), "leave"), 30)
        return released

    def _wait_aborted(
        self, survivors: dict[Key, Any], ref_of: dict[Key, Any], grace_s: float
    ) -> list[Key]:
        """The survivors whose aborted step has not returned after ``grace_s`` — except that
        one seen twice in a row inside its step's ZeRO-1 collectives while a partner of its
        group has returned from the step is stuck for sure (that partner will never join)
        and not waited for: recovery goes on without waiting out the grace. Those are
        remembered in :attr:`seen_reducing`."""
        pending = {k: ref_of[k] for k in survivors}
        group_of = {
            k: set(g) for groups in self.plan.shared_groups().values() for g in groups for k in g
        }
        seen: dict[Key, int] = {}
        self.seen_reducing = []
        deadline = time.monotonic() + grace_s
        while pending and time.monotonic() < deadline:
            poll = min(0.2, max(0.0, deadline - time.monotonic()))
            waiting = list(pending.values())
            ready, _ = self.workers.wait(waiting, num_returns=len(pending), timeout=poll)
            pending = {k: r for k, r in pending.items() if r not in ready}
            returned = set(survivors) - set(pending)
            asked = [k for k in pending if group_of.get(k, set()) & returned]
            refs = call_all(self.workers, [survivors[k] for k in asked], "reducing")
            answers = quiet_get(self.workers, refs, 1.0)
            found = {k for k, reducing in zip(asked, answers, strict=True) if reducing is True}
            for k in list(pending):
                seen[k] = seen.get(k, 0) + 1 if k in found else 0
                if seen[k] >= 2:
                    self.seen_reducing.append(k)
                    del pending[k]
        return [*self.seen_reducing, *pending]

    def _decide(
        self, lost: list[Key], used: list[Key], boundary: int | None, holders: dict
    ) -> tuple[Any, Any]:
        """The policy's decision for the devices still alive (a dead actor's device counts
        as lost, as in Oobleck; a replaced one's does not), and the checkpoint it uses."""
        from geopipe.optimizer.templates import build_templates

        devices = {site.name: 0 for site in self.spec.sites}
        for key in used:
            devices[self.plan.site_of(*key)] += 1
        if self.templates is None:
            self.templates = build_templates(self.spec, plan=self.plan)
        alive = [s for s, n in devices.items() if n > 0]
        found = self.checkpoints.newest(prefer=alive)
        held = frozenset(holders) if boundary is not None else frozenset()
        failure = Failure(
            plan=self.plan,
            dead=frozenset(lost),
            devices_alive=devices,
            params_available=held,
            adam_state_available=held,
            checkpoint_step=found.step if found is not None else None,
        )
        decision = decide(failure, self.templates)
        if not isinstance(decision, RestoreFromCheckpoint):
            return decision, None
        return decision, self.checkpoints.restore_from(found, list(decision.plan.stage_sites))

    # -- grow-back -----------------------------------------------------------------------------
    def grow_decision(self) -> GrowBack | Stay:
        """Whether devices that came back (a node returned or joined) allow a layout
        predicted at least 5 % faster."""
        plan, spec = self.plan, self.spec
        if plan.groups:  # the lost replica groups, whole (runtime.control.outerfail)
            from geopipe.runtime.control.outerfail import grow_decision

            return grow_decision(self)
        avail = self.workers.available()
        used = {site.name: 0 for site in spec.sites}
        for _, site in self.placement.actor_sites():
            used[site] += 1
        devices = {
            site.name: min(
                site.devices, used[site.name] + int(avail.get(site_resource(site.name), 0))
            )
            for site in spec.sites
        }
        if devices == used:
            return Stay("no free devices")
        now_s = self.layout_s if plan.heterogeneous else None
        return decide_grow(
            self.templates,
            plan,
            devices,
            spec.training.global_batch_size,
            plan.micro_batch_size,
            now_s=now_s,
        )

    def grow(self, step: int, decision: GrowBack) -> float:
        """Switch to ``decision.plan`` at step boundary ``step``: new actors take the free
        devices and load their layers from the running replicas' snapshot of ``step``."""
        w = self.workers
        t0 = time.perf_counter()
        flat = self.placement.flat()
        pool = list((a, key) for key, a in self.placement.roles().items())
        if not self.spec.training.recovery_snapshots:  # then none is kept between steps
            ask(w, flat, "snapshot", step)
        for a in flat:  # the boundary snapshot of this step, complete everywhere
            deadline = time.time() + 60
            while step not in ask(w, [a], "boundary_steps")[0] and time.time() < deadline:
                time.sleep(0.05)
        carried = self.outer.states(flat) if self.outer is not None else None
        ask(w, flat, "leave")
        moved = self.relayout(decision.plan, pool, step, pool)
        if carried is not None:  # the groups grown back start from theta_global
            pl = self.placement
            self.outer.rejoin(pl.flat(), [s for _, s in pl.actor_sites()], carried)
        self.layout_s = decision.predicted_new_s
        seconds = time.perf_counter() - t0
        self.history.grown(seconds, step, decision.plan.pipelines)
        self.reporter.event(
            "grown", step=step, seconds=seconds, moved=moved, plan=decision.plan.to_dict()
        )
        self.reporter.say(
            f"devices are back: now {decision.plan.describe()} (took {seconds:.1f} s), "
            f"at step {step}"
        )
        return seconds

    # -- the relayout both use -----------------------------------------------------------------
    def relayout(
        self,
        new_plan: Plan,
        pool: list[tuple[Any, Key]],
        step: int,
        holders: list[tuple[Any, Key]],
        ckpt: Any = None,
    ) -> dict[str, int]:
        """Lay ``new_plan`` over ``pool`` — (actor, (stage, pipeline) it held) pairs whose
        process groups are already left — preferring, per site, actors that keep their
        layers; slots no pooled actor can take get new actors. Then restore every actor to
        step boundary ``step`` from ``holders`` — (actor, old key) pairs with that snapshot —
        or from ``ckpt``; pooled actors left over serve as sources until every load is done,
        then stop. Returns the bytes moved per path (see :mod:`geopipe.runtime.actor.handoff`).

        [Note: a death while re-forming] If an actor dies before the new layout holds its
        state, the placement goes back to the layout the survivors' snapshots belong to
        (the actors made for the new one are stopped) before the error leaves: the
        controller's next recovery reads which layers each survivor holds from the plan,
        and the new plan's keys would name layers they never held."""
        pl, w = self.placement, self.workers
        old_plan, old_rows = pl.plan, pl.rows
        rows, keep, spares, made = self._lay_over(new_plan, pool)
        pl.plan, pl.rows = new_plan, rows
        try:
            w.get([w.call(a, "reconfigure", pl.stage_spec(k, r)) for a, k, r in keep])
            pl.wire()
            if ckpt is not None:  # each site's actors read their own site's copy
                w.get(
                    [w.call(a, "load_checkpoint", ckpt.paths[site]) for a, site in pl.actor_sites()]
                )
                moved = {"checkpoint": len(pl.flat())}
            else:
                moved = self._handoff(step, holders, old_plan)
            ask(w, pl.flat(), "drop_boundaries")
        except WorkerLost:
            for a in made:
                pl.kill(a)
            pl.plan, pl.rows = old_plan, old_rows
            raise
        for a in spares:
            pl.kill(a)
        return moved

    def _lay_over(
        self, new_plan: Plan, pool: list[tuple[Any, Key]]
    ) -> tuple[list, list, list, list]:
        """``new_plan``'s rows over ``pool``, per site preferring actors that keep their
        layers, new actors where none is left: (rows, kept (actor, stage, pipeline),
        spares, made)."""
        pl = self.placement
        old_plan = pl.plan
        by_site: dict[str, list[tuple[Any, Key]]] = {}
        for a, old in pool:
            by_site.setdefault(old_plan.site_of(*old), []).append((a, old))
        pl.plan = new_plan  # new actors are made for it
        rows: list[list[Any]] = []
        keep: list[tuple[Any, int, int]] = []
        made: list[Any] = []
        for k in range(new_plan.num_stages):
            row = []
            for r in range(new_plan.replicas(k)):
                cands = by_site.get(new_plan.site_of(k, r), [])
                want = new_plan.layers_of(k, r)
                same = [c for c in cands if old_plan.layers_of(*c[1]) == want]
                if same or cands:
                    a, old = (same or cands)[0]
                    cands.remove((a, old))
                    keep.append((a, k, r))
                else:
                    a = pl.create(k, r)
                    made.append(a)
                row.append(a)
            rows.append(row)
        spares = [a for rest in by_site.values() for a, _ in rest]
        return rows, keep, spares, made

    def _handoff(self, step: int, holders: list[tuple[Any, Key]], old_plan: Plan) -> dict:
        """Every actor of the (just wired) layout loads boundary ``step``, as planned by
        :func:`geopipe.runtime.actor.handoff.plan_handoff`."""
        from geopipe.model.hf import EMBED, HEAD
        from geopipe.runtime.actor.handoff import Holder, Receiver, Restore, plan_handoff

        pl, w = self.placement, self.workers
        flat = pl.flat()
        site = {id(a): s for a, s in pl.actor_sites()}
        shapes = ask(w, flat, "param_shapes")
        names = w.get([w.call(a, "boundary_names", step) for a, _ in holders])
        by_id = {id(a): a for a, _ in holders}
        hs = [
            Holder(id(a), old_plan.site_of(*key), pl.site_rank.get(id(a)), frozenset(n))
            for (a, key), n in zip(holders, names, strict=True)
        ]
        rs = [
            Receiver(id(a), site[id(a)], pl.site_rank[id(a)], sh)
            for a, sh in zip(flat, shapes, strict=True)
        ]
        aliases = {HEAD: EMBED} if pl.model.tie else None  # the head's copy of a tie
        todo = plan_handoff(rs, hs, aliases)
        calls = []
        for a in flat:
            r = todo.get(id(a), Restore())
            fetch = [(by_id[key], n) for key, n in r.fetch]
            calls.append(w.call(a, "restore_boundary", step, r, fetch))
        stats = w.get(calls)
        return {key: sum(s[key] for s in stats) for key in ("p2p_bytes", "object_store_bytes")}
