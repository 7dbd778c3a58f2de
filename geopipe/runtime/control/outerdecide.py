"""The driver's decisions of the outer applies inside a span ([Note: applies decided inside a
span] in :mod:`geopipe.runtime.actor.inner_run`).

While a span runs, :class:`Decisions` walks its apply points in order. As a point comes up it
names its groups at once, the live ones, to every replica (``outer_decide``: a replica makes
the apply when it holds every named group's payload, so in a healthy round no control round
trip sits between the payloads' arrival and the apply), and asks every replica for its
gather of the round (the call waits on the replica for the span to make the send, then up to
a slice for the peers' payloads, which it files for the apply). Once every replica holds
every live group's payload the point is done and the walk goes on. It is side work of the
span's await (:func:`~geopipe.runtime.control.health.await_step`): its calls are awaited
beside the span's, so the driver takes no thread of its own, and the hang clock pauses while
a payload is overdue (the wait is the WAN's, which ``health.wan_outage_s`` bounds, not a
hang).

A payload still missing after a gather is asked for again in slices of ``health.heartbeat_s``
as :meth:`~geopipe.runtime.control.outerloop.OuterRounds._gather` does between spans: the
console names the silent link every 10 s. Past ``health.wan_outage_s`` (or at once, for a
group whose frames a replica refused) some groups must go, and the decision already given
must be taken back where it is not made yet: :meth:`Decisions._resolve`.

[Note: taking back a decision]
The driver first holds the point on every replica (``outer_decide(done, None)``), which tells
it, atomically with the replica's own apply, whether that replica already applied and over
which groups (a replica that applied counts as holding what it used; its gathers say so).
theta_global must stay bit-identical among the survivors *per (stage,
partition)*: where a replica of a partition already applied over the named set L, every
surviving replica of that partition must apply over L too, so only groups whose replica of
it holds every payload of L can stay; in a partition where none applied, the survivors
apply over the groups kept. A lost group's payload in L is fine: it reached every survivor
of that partition, and each averages the same bytes. Then the final groups go to every
survivor, and the walk goes on over the point until each survivor holds its final groups'
payloads (only gathers file them; a payload that still does not come is taken back again,
each take-back's words numbered after the last's, so a late one changes nothing), and
:class:`~geopipe.runtime.control.outerloop.GroupsLost` leaves for the recovery
(:mod:`.outerfail`), which finishes the survivors' spans walking on over them
(:meth:`Decisions.over`: the point in flight, if not taken back yet, is taken back the same
way).

The outage clock of a point starts when every replica has made its send and answered once:
a group that simply reaches the send later than another (its steps ran slower) is no
silence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from geopipe.runtime.control.outerloop import GroupsLost, kept_groups
from geopipe.runtime.control.workers import CallTimeout, WorkerFailed, WorkerLost, Workers

__all__ = ["Decisions", "Point", "points_of", "wait_deciding"]


@dataclass(frozen=True)
class Point:
    """An apply point of a span: after ``done`` inner steps, fragment ``fragment``, whose
    round was sent after ``sent_done`` steps (``done - overlap``)."""

    done: int
    fragment: int
    sent_done: int


def points_of(schedule: Any, start: int, count: int) -> list[Point]:
    """The apply points of the span of steps ``start .. start + count - 1`` (a
    :class:`~geopipe.outer.fragments.StreamingSchedule`), in order."""
    out = []
    for done in range(start + 1, start + count + 1):
        f = schedule.applies_at(done)
        if f is not None:
            out.append(Point(done, f, done - schedule.overlap))
    return out


class Decisions:
    """The apply points of a span (or several spans in turn) and the driver's walk over them:
    see the module's docstring. ``rounds`` is the run's
    :class:`~geopipe.runtime.control.outerloop.OuterRounds` (its workers, live groups,
    console and each actor's group and partition); ``send_wait_s`` bounds how long a gather
    call waits on its replica for the span to make the send before answering (it is asked
    again)."""

    def __init__(
        self, rounds: Any, actors: list[Any], points: list[Point], send_wait_s: float
    ) -> None:
        self.rounds = rounds
        self.points = list(points)
        self.send_wait_s = send_wait_s
        self.actors = list(actors)
        self._asked: dict[Any, int] = {}  # gather call in flight -> actor index
        self._answers: dict[int, dict] = {}  # actor index -> its last gather's answer
        self._since: float | None = None  # the outage clock of the current point
        self._said: float | None = None  # at what wait the console last named the link
        self.made: set[int] = set()  # the apply points done
        # once the current point is taken back: each kept actor's final groups (by id), and
        # how many times it was (each take-back's words come after the last's)
        self.final: dict[int, list[int]] | None = None
        self._takes = 0
        self._open()

    @property
    def workers(self) -> Workers:
        return self.rounds.workers

    def over(self, actors: list[Any]) -> Decisions:
        """Walk on over ``actors`` (after a loss: the survivors, their groups the live
        ones): the point in flight is taken back and decided over them ([Note: taking back
        a decision]; raises :class:`GroupsLost` when that loses more groups)."""
        self.actors = list(actors)
        self._asked, self._answers = {}, {}
        if not self.points:
            return self
        if self.final is None:  # may raise GroupsLost for more groups
            self._resolve(set(self.rounds.live), "", silent=False)
        else:  # taken back already: walk the survivors on to their final groups
            self.final = {id(a): self.final[id(a)] for a in self.actors if id(a) in self.final}
            self._ask(range(len(self.actors)))
        return self

    def add(self, points: list[Point]) -> None:
        """Walk on into the points of a span queued behind the one in flight."""
        idle = not self.points
        self.points += [p for p in points if p not in self.points and p.done not in self.made]
        if idle:
            self._open()

    def refs(self) -> list:
        """The gather calls in flight (the await waits on them beside the span's)."""
        return list(self._asked)

    def stalled(self) -> bool:
        """Whether the current point waits on a payload past its replicas' sends (the hang
        clock pauses: the WAN's outage clock runs)."""
        return self._since is not None

    def ready(self, ref: Any) -> None:
        """A gather call answered: once every replica has, go on or ask again."""
        i = self._asked.pop(ref, None)
        if i is None:  # a Ray ref may come back as an equal object; else a dropped call
            key = next((k for k in self._asked if k == ref), None)
            if key is None:
                return
            i = self._asked.pop(key)
        try:
            self._answers[i] = self.workers.get([ref])[0]
        except (WorkerLost, WorkerFailed) as exc:  # its group goes, not the one awaited
            g = self.rounds.group_of[id(self.actors[i])]
            raise GroupsLost([g], f"outer_gather: an actor died or failed ({exc})") from exc
        if not self._asked:
            self._settle()

    # -- the walk ------------------------------------------------------------------------------
    def _open(self) -> None:
        """The current point comes up: name the live groups to every replica, ask its
        gathers."""
        if not self.points:
            return
        p, live = self.points[0], sorted(self.rounds.live)
        for a in self.actors:
            self.workers.call(a, "outer_decide", p.done, live, 0)
        self._ask(range(len(self.actors)))

    def _ask(self, indices: Any) -> None:
        if not self.points:
            return
        p, h = self.points[0], self.rounds.spec.health
        slice_s = max(0.05, min(h.heartbeat_s, h.wan_outage_s))
        for i in indices:
            ref = self.workers.call(
                self.actors[i], "outer_gather", p.fragment, slice_s, p.sent_done, self.send_wait_s
            )
            self._asked[ref] = i

    def _settle(self) -> None:
        """Every replica answered the current point's gather: done when each holds every
        live group's payload; else ask again those missing one (not yet sent, or a payload
        overdue), naming a silent link, or resolve the point past the outage (a refused
        group: at once)."""
        r, p = self.rounds, self.points[0]
        unsent = [i for i, a in self._answers.items() if not a.get("sent", True)]
        if unsent:  # the span has not sent yet there: no silence so far
            self._ask(unsent)
            return
        answers = [(self.actors[i], a) for i, a in sorted(self._answers.items())]
        refused = {
            int(g): str(why)
            for _, a in answers
            for g, why in (a.get("refused") or {}).items()
            if int(g) in r.live
        }
        have = r._holding(answers)
        if refused:
            g, why = sorted(refused.items())[0]
            self._resolve(
                r.live - set(refused), f"its outer frames were refused (group {g}: {why[:200]})"
            )
            return
        if self._complete(answers, have):
            self._next(p)
            return
        now = r.clock()
        if self._since is None:
            self._since, self._said = now, None
        try:
            if r.silent_round(p.fragment, have, now - self._since, self._said):
                self._said = now - self._since
        except GroupsLost as lost:  # past the outage: the groups that heard each other
            self._resolve(set(), str(lost).split(": ", 1)[-1], silent=True, have=have)
        self._ask([i for i, a in self._answers.items() if r.live - set(a["have"])])

    def _complete(self, answers: list[tuple[Any, dict]], have: dict[int, set[int]]) -> bool:
        """Whether every replica holds (or applied) what it is to apply: every live group's
        payload, or once taken back its final groups'."""
        if self.final is None:
            return all(have[g] >= self.rounds.live for g in self.rounds.live)
        return all(set(ans["have"]) >= set(self.final.get(id(a), ())) for a, ans in answers)

    def _next(self, p: Point) -> None:
        self.made.add(p.done)
        self.points.pop(0)
        self._answers, self._since, self.final, self._takes = {}, None, None, 0
        self._open()

    def _resolve(
        self, keep: set[int], why: str, silent: bool = False, have: dict | None = None
    ) -> None:
        """Take the current point's decision back where it is not made, and give each
        survivor its final groups ([Note: taking back a decision]): of the groups able to
        apply what was applied, ``keep`` (or, given ``have``, the largest set of them that
        heard each other: :func:`kept_groups`). The walk goes on over the kept replicas
        until each holds its final groups' payloads (a point can be taken back again).
        Raises :class:`GroupsLost` for the live groups that do not stay (none: returns)."""
        r, p = self.rounds, self.points[0]
        self._takes += 1
        hold, final_seq = 2 * self._takes - 1, 2 * self._takes
        made = self._each("outer_decide", p.done, None, hold)  # hold: nothing changes now
        holds = self._each("outer_gather", p.fragment, 0.0, p.sent_done, 0.0)
        used: dict[tuple[int, int], list[int]] = {}  # (stage, partition) -> the set applied
        for a, ans in made.items():
            if ans and ans.get("made"):
                used.setdefault(r._part[a], list(ans["made"]))
        able = set(r.live) - {r.group_of[a] for a in self._ids() if a not in made}  # died
        for a, ans in made.items():
            part = r._part[a]
            if ans and ans.get("made"):
                continue  # applied: what it used binds its partition
            if part in used and not set(used[part]) <= {r.group_of[a], *holds.get(a, ())}:
                able.discard(r.group_of[a])  # cannot apply what the others of its part did
        if have is not None:
            kept = set(kept_groups({g: have[g] & able for g in able}))
        else:
            kept = set(keep) & able
        self.final = {}
        for x in self.actors:
            if r.group_of[id(x)] in kept:
                self.final[id(x)] = used.get(r._part[id(x)], sorted(kept))
                self.workers.call(x, "outer_decide", p.done, self.final[id(x)], final_seq)
        self.actors = [x for x in self.actors if id(x) in self.final]
        self._asked, self._answers, self._since = {}, {}, None
        self._ask(range(len(self.actors)))  # on until each holds its final groups' payloads
        lost = r.live - kept
        if lost:
            raise GroupsLost(lost, why or "taken back at the outer apply", silent=silent)

    def _ids(self) -> list[int]:
        return [id(a) for a in self.actors]

    def _each(self, method: str, *args: Any) -> dict[int, Any]:
        """``method(*args)`` on every actor, by ``id(actor)``: its answer (for a gather, the
        groups held), or absent when the actor died or failed (its group is not kept)."""
        refs = [(a, self.workers.call(a, method, *args)) for a in self.actors]
        out: dict[int, Any] = {}
        h = self.rounds.spec.health
        for a, ref in refs:
            try:
                ans = self.workers.get([ref], timeout=h.unresponsive_s)[0]
            except (WorkerLost, WorkerFailed, CallTimeout):
                continue
            out[id(a)] = set(ans.get("have", [])) if method == "outer_gather" else ans
        return out


def wait_deciding(workers: Workers, ref: Any, timeout: float, decisions: Decisions | None) -> Any:
    """``ref``'s answer (a span's call), walking ``decisions`` meanwhile (its span may wait
    for them): what recovery waits with for the survivors' spans. Raises
    :class:`~geopipe.runtime.control.workers.CallTimeout` after ``timeout`` seconds (not
    counting a stalled point's), the call's own error, or
    :class:`~geopipe.runtime.control.outerloop.GroupsLost` from the walk."""
    deadline = time.monotonic() + timeout
    while True:
        side = decisions.refs() if decisions is not None else []
        t0 = time.monotonic()
        ready, _ = workers.wait([ref, *side], num_returns=1, timeout=max(0.0, deadline - t0))
        if decisions is not None and decisions.stalled():
            deadline += time.monotonic() - t0
        if not ready:
            if time.monotonic() >= deadline:
                raise CallTimeout(f"a span unanswered after {timeout:.0f} s")
            continue
        for r in ready:
            if r is ref or r == ref:
                return workers.get([ref], timeout=0)[0]
            decisions.ready(r)
