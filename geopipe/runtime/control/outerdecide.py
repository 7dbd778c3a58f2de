"""The driver's decisions of the outer applies inside a span ([Note: applies decided inside a
span] in :mod:`geopipe.runtime.actor.inner_run`).

While a span runs, :class:`Decisions` walks its apply points in order. For each it asks every
replica for its gather of the round (the call waits on the replica for the span to make the
send, then up to a slice for the peers' payloads); once every replica of every live group
holds every live group's payload it names those groups to every replica (``outer_decide``)
and goes on to the next point. It is side work of the span's await
(:func:`~geopipe.runtime.control.health.await_step`): its calls are awaited beside the
span's, so the driver takes no thread of its own, and the hang clock pauses while a payload
is overdue (the wait is the WAN's, which ``health.wan_outage_s`` bounds, not a hang).

A payload still missing after a gather is asked for again in slices of ``health.heartbeat_s``
as :meth:`~geopipe.runtime.control.outerloop.OuterRounds._gather` does between spans: the
console names the silent link every 10 s, and past ``health.wan_outage_s`` the groups that
did not hear each other are split by :func:`~geopipe.runtime.control.outerloop.kept_groups`
and :class:`~geopipe.runtime.control.outerloop.GroupsLost` leaves the await for the
recovery (:mod:`.outerfail`), which drops them and finishes the survivors' spans with the
same walk over the survivors (:func:`wait_deciding`). A group whose frames a replica refused
is lost at once, as between spans.

The outage clock of a point starts when every replica has made its send and answered once:
a group that simply reaches the send later than another (its steps ran slower) is no
silence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from geopipe.runtime.control.workers import CallTimeout, Workers

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
    console and the record of each decision); ``send_wait_s`` bounds how long a gather call
    waits on its replica for the span to make the send."""

    def __init__(
        self, rounds: Any, actors: list[Any], points: list[Point], send_wait_s: float
    ) -> None:
        self.rounds = rounds
        self.points = list(points)
        self.send_wait_s = send_wait_s
        self.actors: list[Any] = []
        self._asked: dict[Any, int] = {}  # gather call in flight -> actor index
        self._answers: dict[int, dict] = {}  # actor index -> its last gather's answer
        self._since: float | None = None  # the outage clock of the current point
        self._said: float | None = None  # at what wait the console last named the link
        self.made: set[int] = set()  # the apply points decided
        self.over(actors)

    @property
    def workers(self) -> Workers:
        return self.rounds.workers

    def over(self, actors: list[Any]) -> Decisions:
        """Walk on over ``actors`` (after a loss: the survivors); the current point's
        gathers are asked again of them (the outage clock goes on)."""
        self.actors = list(actors)
        self._asked, self._answers = {}, {}
        self._ask(range(len(self.actors)))
        return self

    def add(self, points: list[Point]) -> None:
        """Walk on into the points of a span queued behind the one in flight."""
        idle = not self.points
        self.points += [p for p in points if p not in self.points and p.done not in self.made]
        if idle:
            self._ask(range(len(self.actors)))

    def refs(self) -> list:
        """The gather calls in flight (the await waits on them beside the span's)."""
        return list(self._asked)

    def stalled(self) -> bool:
        """Whether the current point waits on a payload past its replicas' sends (the hang
        clock pauses: the WAN's outage clock runs)."""
        return self._since is not None

    def ready(self, ref: Any) -> None:
        """A gather call answered: once every replica has, decide or ask again."""
        i = self._asked.pop(ref, None)
        if i is None:  # a Ray ref may come back as an equal object
            key = next(k for k in self._asked if k == ref)
            i = self._asked.pop(key)
        self._answers[i] = self.workers.get([ref])[0]  # an actor that died: WorkerLost
        if not self._asked:
            self._settle()

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
        """Every replica answered the current point's gather: name the groups to all when
        each holds every live group's payload; else ask again those missing one (not yet
        sent, or a payload overdue), naming a silent link, or losing groups past the
        outage."""
        r, p = self.rounds, self.points[0]
        answers = [(self.actors[i], a) for i, a in sorted(self._answers.items())]
        unsent = [i for i, a in self._answers.items() if not a.get("sent", True)]
        if unsent:  # the span has not sent yet there: no silence so far
            self._ask(unsent)
            return
        r._refused([a for _, a in answers])
        have = r._holding(answers)
        if all(have[g] >= r.live for g in r.live):
            self._decide(p, sorted(r.live), answers)
            return
        now = r.clock()
        if self._since is None:
            self._since, self._said = now, None
        if r.silent_round(p.fragment, have, now - self._since, self._said):
            self._said = now - self._since
        self._ask([i for i, a in self._answers.items() if r.live - set(a["have"])])

    def _decide(self, p: Point, groups: list[int], answers: list[tuple[Any, dict]]) -> None:
        for a in self.actors:
            self.workers.call(a, "outer_decide", p.done, groups)
        waited = max((a.get("wait_s", 0.0) for _, a in answers), default=0.0)
        self.rounds.decided[p.done] = (groups, waited)
        self.made.add(p.done)
        self.points.pop(0)
        self._answers, self._since = {}, None
        self._ask(range(len(self.actors)))


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
