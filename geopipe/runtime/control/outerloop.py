"""The driver's half of the outer loop: begin it on every actor, pair the peers, and after each
inner step send or apply the fragments the streaming schedule says.

The actors' half (:mod:`geopipe.runtime.actor.outer`) holds theta_global and the outer
momentum on each replica's fp32 master partition and moves the encoded pseudo-gradients over
the data plane itself; the driver only carries addresses and says when (in a span of inner
steps the actors make the sends themselves: :mod:`.innerrun`). Order of a round
(torchft's DiLoCo, :mod:`geopipe.outer.fragments`): after inner step ``s``, fragment
``sends_at(s)`` is encoded and its transfer starts (it runs on while training goes on), then
fragment ``applies_at(s)`` is averaged and applied, collectively in each ZeRO-1 group,
between iterations. With ``overlap`` 0 the two coincide: the round's transfer is exposed.

Peers: the replicas holding the same stage and ZeRO-1 partition in the other groups (every
group has one layout: :mod:`geopipe.optimizer.outerplan`); the exchange checks the layout's
digest and refuses a mismatch. On emulated sites each peer connection paces itself by the
YAML's link between the two sites (a real network paces itself).

[Note: losing a replica group]
An apply is a gather, then an apply over a list of groups the driver names ([Note: a round
over the survivors] in :mod:`geopipe.runtime.actor.outer`). The gather is asked in slices of
``health.heartbeat_s``: an actor that died surfaces at once (its call fails), and a peer
that stays silent while its processes live is named on the console with its link (sites
``a <-> b``) each slice; the inner steps are not held up by it before the apply. After
``health.wan_outage_s`` of silence the groups that did not hear each other are split by
:func:`kept_groups` and the rest written off. Either way :class:`GroupsLost` leaves
:meth:`OuterRounds.after_step`, and :mod:`geopipe.runtime.control.outerfail` goes on with
the survivors; asked again, ``after_step`` repeats nothing that was done (a send already
made, an apply already applied).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from geopipe.config import ClusterSpec
from geopipe.optimizer.outerplan import OuterRun
from geopipe.outer.fragments import StreamingSchedule
from geopipe.runtime.actor.outer_wire import OuterPeer, OuterSettings
from geopipe.runtime.control.placement import emulated_link
from geopipe.runtime.control.workers import CallTimeout, WorkerLost, Workers, ask, call_all
from geopipe.transport.link import LinkParams

__all__ = ["GroupsLost", "OuterRounds", "kept_groups", "peers_of", "shares"]

_SAY_EVERY_S = 10.0  # how often the console repeats that a round waits on a silent link


def peers_of(
    endpoints: list[dict], link: Callable[[str, str], LinkParams | None], sites: list[str]
) -> list[list[OuterPeer]]:
    """For each actor (``endpoints[i]``, in site ``sites[i]``), the actors of the other groups
    that hold its stage and partition."""
    out = []
    for i, me in enumerate(endpoints):
        out.append(
            [
                OuterPeer(ep["group"], tuple(ep["address"]), ep["layout"], link(sites[i], sites[j]))
                for j, ep in enumerate(endpoints)
                if ep["group"] != me["group"]
                and ep["stage"] == me["stage"]
                and ep["partition"] == me["partition"]
            ]
        )
    return out


def _field(result: Any, name: str) -> Any:
    """``name`` of a step's result (an IterationResult) or of a dict standing for one."""
    return result.get(name) if isinstance(result, dict) else getattr(result, name, None)


def shares(plan: Any) -> tuple[float, ...]:
    """Each replica group's sequences per inner step (its batch share), by group id: the
    weights of the outer average ([Note: batch shares] in :mod:`geopipe.optimizer.strategy`);
    () when every group's is the same (the plain mean)."""
    per = [plan.group_microbatches(g) * plan.micro_batch_size for g in range(plan.num_groups)]
    return tuple(float(x) for x in per) if len(set(per)) > 1 else ()


def _exposed(waits: list[tuple[int, float]]) -> float:
    """The transfer a round exposed beyond the slower group's steps, from each replica's
    wait at the apply (``(group, seconds)``): the midrange of the groups' waits (each group's
    the longest of its replicas'). With two groups, the one that got there first by ``s``
    seconds waits ``s + T`` and the other ``T - s`` for a transfer of ``T`` past the later
    arrival: the midrange is ``T``. The first alone (the old figure) counts the skew twice,
    since the inner step already holds the slower group's steps; the last alone misses it.
    Where the later group waited not at all (``T <= s``) it is an upper bound; with more
    groups, an estimate: no wait measured on one replica's clock says more without a clock
    shared by the sites."""
    per: dict[int, float] = {}
    for g, w in waits:
        per[g] = max(per.get(g, 0.0), w)
    return (max(per.values()) + min(per.values())) / 2 if per else 0.0


class GroupsLost(WorkerLost):
    """Replica groups written off during an outer round: an actor of theirs died, or they
    stayed silent past ``health.wan_outage_s`` (``silent``: their processes may live)."""

    def __init__(self, groups: Iterable[int], why: str, silent: bool = False) -> None:
        self.groups = sorted(set(groups))
        self.silent = silent
        super().__init__(f"replica group(s) {self.groups} lost: {why}")


def kept_groups(have: dict[int, set[int]]) -> list[int]:
    """The groups a round goes on with when some did not hear each other: the largest set
    in which every group holds every other's payload (``have[g]``: the groups whose
    payloads every replica of ``g`` holds, itself included); on a tie the set with the
    lowest group ids, so the driver's choice is deterministic (two groups cut apart: group
    0's side stays). Exhaustive over subsets: M is a handful of sites."""
    groups = sorted(have)
    for size in range(len(groups), 0, -1):
        for subset in itertools.combinations(groups, size):
            if all(b in have[a] for a in subset for b in subset):
                return list(subset)
    return []


class OuterRounds:
    """Sends and applies of one outer run; ``say``/``event`` report each applied fragment."""

    def __init__(
        self,
        spec: ClusterSpec,
        run: OuterRun,
        workers: Workers,
        say: Callable[[str], None],
        event: Callable[..., None],
    ) -> None:
        s = run.setting
        self.spec = spec
        self.workers = workers
        self.run = run
        self.schedule = StreamingSchedule(s.h, s.fragments, s.overlap)
        self.settings = OuterSettings(
            lr=run.lr,
            momentum=run.momentum,
            fragments=s.fragments,
            codec=s.codec,
            topk_ratio=spec.plan.topk_ratio,
            timeout_s=spec.health.wan_outage_s,
            seed=spec.training.seed,
            weights=shares(run.plan),
        )
        self.say, self.event = say, event
        # The gather's clock (its slices, ``health.wan_outage_s``): the unit tests drive a
        # virtual one that their scripted workers advance, so no count of slices rides on load.
        self.clock: Callable[[], float] = time.monotonic
        self.rounds: list[dict] = []  # what each applied fragment cost (the run's record)
        self._sent: dict[int, tuple[float, list[dict]]] = {}  # fragment -> (sent at, results)
        self._part: dict[int, tuple[int, int]] = {}  # id(actor) -> its (stage, partition)
        self.group_of: dict[int, int] = {}  # id(actor) -> its replica group (a stable id)
        self.site_of: dict[int, str] = {}  # replica group -> its first site (for the console)
        self.live: set[int] = set()  # the groups still in the run
        self.done_through = 0  # the inner steps whose sends and applies are all done
        # Steps per call to each actor (:mod:`.innerrun`): None, as many as the schedule,
        # checkpoints and the progress line allow; n, at most n; 0, one ``run_iteration`` per
        # step with the sends made by the driver (the path before spans; tests compare them).
        self.max_span: int | None = None
        self.span: tuple[int, int] | None = None  # (first step, steps) of the call in flight
        # The span called behind the one in flight (:mod:`.innerrun`: an innerrun.Span)
        self.queued: Any = None
        # The walk over the apply points of the spans in flight (:mod:`.outerdecide`)
        self.decisions: Any = None
        # The span whose steps the driver is recording: (first step, end, queued) (.outercal)
        self.recording: tuple[int, int, bool] | None = None

    def begin(self, actors: list[Any], sites: list[str]) -> None:
        """theta_global from every replica's masters now (all groups hold the same weights:
        the start, or a loaded checkpoint), listeners up, peers connected."""
        endpoints = ask(self.workers, actors, "outer_begin", self.settings)
        self._part, self.group_of, self.site_of = {}, {}, {}
        for a, ep, site in zip(actors, endpoints, sites, strict=True):
            self._part[id(a)] = (ep["stage"], ep["partition"])
            self.group_of[id(a)] = ep["group"]
            self.site_of.setdefault(ep["group"], site)
        self.live = set(self.group_of.values())
        peers = peers_of(endpoints, partial(emulated_link, self.spec), sites)
        w = self.workers
        w.get([w.call(a, "outer_connect", p) for a, p in zip(actors, peers, strict=True)])

    def after_step(self, done: int, actors: list[Any]) -> None:
        """``done`` inner steps have run (one call per step, or a recovery between spans):
        start the send and do the apply they call for. Raises :class:`GroupsLost` ([Note:
        losing a replica group])."""
        if done <= self.done_through:
            return  # made already: by a span, or asked again after a failure that came later
        f = self.schedule.sends_at(done)
        if f is not None and f not in self._sent:
            sends = call_all(self.workers, actors, "outer_send", f, done)
            self._sent[f] = (time.perf_counter(), self._each(actors, sends, "outer_send"))
        f = self.schedule.applies_at(done)
        if f is not None:
            t0 = time.perf_counter()
            groups, wait_s = self._gather(f, actors)
            try:
                self._apply(done, f, groups, actors, t0, wait_s)
            except GroupsLost:
                self.done_through = done  # the survivors applied: not again over them
                raise
        self.done_through = done

    def note_applied(self, done: int, results: list, actors: list[Any]) -> None:
        """The apply ``actors`` made inside a span after ``done`` inner steps (``results``:
        each one's result of that step, whose ``outer_applied`` is its apply's answer),
        recorded as :meth:`after_step` records an apply it makes ([Note: applies decided
        inside a span] in :mod:`geopipe.runtime.actor.inner_run`)."""
        applied = [_field(r, "outer_applied") for r in results]
        if not applied or any(a is None for a in applied):
            return
        f = applied[0]["fragment"]
        _, sent = self._sent.pop(f, (0.0, []))
        wait_s = _exposed(
            [
                (self.group_of.get(id(a), 0), x.get("decide_wait_s", 0.0))
                for a, x in zip(actors, applied, strict=True)
            ]
        )
        apply_s = wait_s + max(a.get("apply_s", 0.0) for a in applied)
        since = max(a.get("since_send_s", 0.0) for a in applied)
        self._record(done, f, actors, (apply_s, max(0.0, since - wait_s), wait_s), sent, applied)

    def note_sends(self, done: int, results: list, received: float) -> None:
        """The sends the actors made themselves after ``done`` inner steps (``results``: each
        actor's :class:`~geopipe.runtime.actor.executor.IterationResult` of that step, whose
        ``outer_sent`` is the send's answer), as if :meth:`after_step` had made them: dated
        ``before_end_s`` (the actors' clocks) before ``received``, when the span came back."""
        sent = [r.outer_sent for r in results if getattr(r, "outer_sent", None)]
        if not sent or sent[0]["fragment"] in self._sent:
            return
        at = received - max(s.get("before_end_s", 0.0) for s in sent)
        self._sent[sent[0]["fragment"]] = (at, sent)

    def states(self, actors: list[Any]) -> dict[tuple[int, int], dict]:
        """The outer state (theta_global, momentum, rounds) of each (stage, partition),
        from ``actors``: every group holds the same, so any group's serves all."""
        got = ask(self.workers, actors, "outer_state")
        return {self._part[id(a)]: st for a, st in zip(actors, got, strict=True)}

    def rejoin(self, actors: list[Any], sites: list[str], states: dict) -> None:
        """Begin again over ``actors`` (a lost group grown back beside the survivors) and
        load every actor with the outer state :meth:`states` took of its (stage,
        partition): the returning group starts from theta_global and the momentum."""
        self.begin(actors, sites)
        w = self.workers
        w.get([w.call(a, "load_outer_state", states[self._part[id(a)]]) for a in actors])

    def drop(self, groups: Iterable[int], survivors: list[Any]) -> None:
        """Write ``groups`` off: no round waits for them or averages over them again."""
        groups = sorted(set(groups))
        self.live -= set(groups)
        ask(self.workers, survivors, "outer_drop", groups)

    def _each(self, actors: list[Any], refs: list, method: str) -> list:
        """Every answer to ``refs`` (``method`` on each actor) awaited (a frozen actor: for
        ``health.hang_floor_uncalibrated_s``); the groups of actors that died or froze
        leave as :class:`GroupsLost`, which carries the other groups' actors and answers as
        ``answers`` (the others' errors raise as they are)."""
        w = self.workers
        wait_s = self.spec.health.hang_floor_uncalibrated_s
        got, dead, why = [], set(), ""
        for a, ref in zip(actors, refs, strict=True):
            try:
                got.append((a, w.get([ref], timeout=wait_s)[0]))
            except (WorkerLost, CallTimeout) as exc:
                dead.add(self.group_of[id(a)])
                why = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else "lost"
        if dead:
            lost = GroupsLost(dead, f"{method}: an actor died or froze ({why})")
            lost.answers = [(a, x) for a, x in got if self.group_of[id(a)] not in dead]
            raise lost
        return [x for _, x in got]

    def _apply(
        self, done: int, f: int, groups: list[int], actors: list[Any], t0: float, wait_s: float
    ) -> None:
        """The apply of fragment ``f`` over ``groups`` on ``actors``, recorded (``t0``: when
        its gather began; ``wait_s``: the gather's wait). An actor lost meanwhile: the other
        groups applied, which is recorded before :class:`GroupsLost` leaves."""
        sent_at, sent = self._sent.pop(f, (t0, []))
        try:
            applied = self._each(
                actors, call_all(self.workers, actors, "outer_apply", f, groups), "outer_apply"
            )
        except GroupsLost as lost:
            if lost.answers:
                took = (time.perf_counter() - t0, t0 - sent_at, wait_s)
                done_by = [a for a, _ in lost.answers]
                self._record(done, f, done_by, took, sent, [x for _, x in lost.answers])
            raise
        took = (time.perf_counter() - t0, t0 - sent_at, wait_s)
        self._record(done, f, actors, took, sent, applied)

    def _heard(self, f: int, actors: list[Any], pending: dict[int, Any], slice_s: float) -> dict:
        """One slice of the gather: every actor not still answering the last slice is asked
        again; per live group, the groups whose payloads every replica of it holds (a group
        with an actor that does not answer within ``health.unresponsive_s`` hears no one,
        and no one hears it). Raises :class:`GroupsLost` for the groups of actors that
        died."""
        w, h = self.workers, self.spec.health
        for i, a in enumerate(actors):
            if i not in pending:
                pending[i] = w.call(a, "outer_gather", f, slice_s)
        deadline = self.clock() + slice_s + h.unresponsive_s
        answered: list[tuple[Any, dict]] = []
        dead, mute = set(), set()
        for i, ref in list(pending.items()):
            g = self.group_of[id(actors[i])]
            try:
                ans = w.get([ref], timeout=max(0.0, deadline - self.clock()))[0]
            except WorkerLost:
                dead.add(g)
                continue
            except CallTimeout:  # frozen, or its node cut off from the driver too
                mute.add(g)
                continue
            del pending[i]
            answered.append((actors[i], ans))
            self._refused([ans])
        if dead:
            raise GroupsLost(dead, "outer_gather: an actor died")
        have = self._holding(answered)
        for g in mute:
            have[g] = {g}
            for other in have:
                have[other].discard(g)
        return have

    def _holding(self, answered: list[tuple[Any, dict]]) -> dict[int, set[int]]:
        """Per live group, the groups whose payloads every replica of it that answered holds
        (``answered``: (actor, its gather's answer))."""
        have: dict[int, set[int]] = {g: set(self.live) for g in self.live}
        for a, ans in answered:
            have[self.group_of[id(a)]] &= set(ans["have"])
        return have

    def _refused(self, answers: list[dict]) -> None:
        """Raise :class:`GroupsLost` for the live groups whose frames a replica refused
        (``refused`` in its gather's answer: a payload of NaN or inf, a frame off the plan):
        at once, not after ``health.wan_outage_s`` of waiting for a payload never taken."""
        refused: dict[int, str] = {}
        for ans in answers:
            for g, why in (ans.get("refused") or {}).items():
                if int(g) in self.live:
                    refused.setdefault(int(g), str(why))
        if refused:
            g, why = sorted(refused.items())[0]
            raise GroupsLost(refused, f"its outer frames were refused (group {g}: {why[:200]})")

    def _gather(self, f: int, actors: list[Any]) -> tuple[list[int], float]:
        """Wait for every replica to hold every live group's payload of fragment ``f``, in
        slices of ``health.heartbeat_s`` (the console names a silent link every 10 s); the
        groups the apply averages over, and the wait. Raises :class:`GroupsLost` (an actor
        died; silent groups past ``health.wan_outage_s``)."""
        h = self.spec.health
        t0 = said = self.clock()
        pending: dict[int, Any] = {}  # actor index -> its gather call still in flight
        while True:
            left = h.wan_outage_s - (self.clock() - t0)
            have = self._heard(f, actors, pending, max(0.05, min(h.heartbeat_s, left)))
            if all(have[g] >= self.live for g in self.live):
                return sorted(self.live), self.clock() - t0
            if self.silent_round(f, have, self.clock() - t0, said - t0 if said > t0 else None):
                said = self.clock()

    def silent_round(
        self, f: int, have: dict[int, set[int]], waited: float, said: float | None
    ) -> bool:
        """A gather of fragment ``f`` waited ``waited`` seconds and some group lacks a payload
        (``have``: per live group, whose it holds): past ``health.wan_outage_s`` raise
        :class:`GroupsLost` for the groups :func:`kept_groups` leaves out; else name the
        silent links on the console when due (``said``: at what wait it last did, None:
        never) and say whether it did."""
        h = self.spec.health
        # a mute group hears no one, itself included (it is never kept): not a link
        silent = sorted({(a, b) for a in have for b in self.live - have[a] if a != b})
        links = ", ".join(
            f"group {a} <- {b} (sites {self.site_of[a]} <-> {self.site_of[b]})" for a, b in silent
        )
        if waited >= h.wan_outage_s:
            keep = kept_groups(have)
            raise GroupsLost(
                self.live - set(keep),
                f"no outer payload over {links} in {h.wan_outage_s:g} s",
                silent=True,
            )
        # first after a while: a group may simply reach the apply later than another (its
        # steps ran slower), which is no silence yet
        first = min(_SAY_EVERY_S, h.wan_outage_s / 2)
        if waited - (said or 0.0) < (first if said is None else _SAY_EVERY_S):
            return False
        self.say(
            f"outer round of fragment {f} waits on {links}: silent {waited:.0f} s "
            f"of {h.wan_outage_s:g} s (health.wan_outage_s); the apply waits, "
            "the inner steps before it are done"
        )
        return True

    def _record(
        self,
        step: int,
        fragment: int,
        actors: list[Any],
        took: tuple[float, float, float],
        sent: list[dict],
        applied: list[dict],
    ) -> None:
        """``took``: the apply's seconds (gather and step), the seconds from the send to the
        apply (inner steps overlapped the transfer), and the gather's wait."""
        apply_s, overlapped_s, wait_s = took
        # theta_global must be bit-identical in every group: one digest per partition, of
        # the fragment this round changed (the others were checked at their own rounds)
        by_part: dict[tuple[int, int], set[str]] = {}
        for a, res in zip(actors, applied, strict=True):
            by_part.setdefault(self._part[id(a)], set()).add(res["digest"])
        row = {
            "step": step,
            "round": applied[0]["round"],
            "fragment": fragment,
            "groups": len(self.live),
            "apply_s": apply_s,
            "overlapped_s": overlapped_s,  # inner steps ran while the transfer was in flight
            "exposed_s": wait_s,  # the transfer compute did not hide (the appliers' wait)
            "bytes": sum(s.get("payload_bytes", 0) for s in sent),
            "codec_error": max((s.get("codec_error") or 0.0 for s in sent), default=0.0),
            "digests_equal": all(len(d) == 1 for d in by_part.values()),
        }
        self.rounds.append(row)
        self.event("outer_round", **row)
        if fragment == self.settings.fragments - 1:
            self.say(
                f"step {step}: outer round {row['round']} over {row['groups']} groups, "
                f"{row['bytes'] / 1e6:.2f} MB, exposed {wait_s:.2f} s, apply {apply_s:.2f} s"
            )

    def in_flight(self, done: int) -> bool:
        """Whether a fragment is in flight after ``done`` inner steps: a save there could
        not hold it, so a Ctrl-C runs on to its apply ([Note: the outer-loop checkpoint])."""
        from geopipe.runtime.control.outerckpt import in_flight

        return in_flight(self.schedule, done)
