"""An outer-loop run's spans of inner steps ([Note: many inner steps per driver call] in
geopipe.runtime.actor.inner_run): where a span ends (the points where the driver must act),
and the driver's round record when the actors made the sends themselves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geopipe.optimizer.outer_cost import steps_per_call
from geopipe.outer.fragments import StreamingSchedule
from geopipe.runtime.actor.inner_run import run_span
from geopipe.runtime.control.innerrun import MAX_SPAN, SPAN_S, record_span, span_of
from geopipe.runtime.control.outerdecide import points_of
from tests.unit.test_outer_rounds import Recorder, _rounds


def _never(_: int) -> bool:
    return False


def _spans(total: int, schedule: StreamingSchedule, **kw) -> list[tuple[int, int]]:
    """Every span of a run of ``total`` steps, as (first step, steps)."""
    out, step = [], 0
    args = dict(predicted_s=0.1, every=0, eval_due=_never, recorded=_never)
    args.update(kw)
    while step < total:
        n = span_of(step, total, schedule=schedule, **args)
        out.append((step, n))
        step += n
    return out


def test_applies_fall_inside_a_span_which_covers_each_step_once() -> None:
    """[Note: applies decided inside a span]: a span runs its applies; the span's apply
    points are the schedule's, each with the step its round was sent after."""
    sched = StreamingSchedule(8, 2, 1)  # applies after 4, 8, 12, 16; sends after 3, 7, ...
    assert _spans(16, sched) == [(0, 16)]
    points = points_of(sched, 6, 6)  # steps 6..11: the applies after 8 and 12
    assert [(p.done, p.fragment, p.sent_done) for p in points] == [(8, 1, 7), (12, 0, 11)]
    for cap in (3, 6, 9):
        whole = [p for s, n in _spans(16, sched, max_span=cap) for p in points_of(sched, s, n)]
        assert [p.done for p in whole] == [4, 8, 12, 16]  # each once, whatever the spans


def test_a_span_its_length_cuts_ends_at_an_apply_point() -> None:
    """[Note: spans end at applies]: at the last apply point within the cap, or, when the
    next lies beyond it, after one of the equal spans that reach it."""
    sched = StreamingSchedule(8, 2, 1)  # an apply every 4 steps
    assert _spans(16, sched, max_span=6) == [(0, 4), (4, 4), (8, 4), (12, 4)]
    assert _spans(16, sched, max_span=9) == [(0, 8), (8, 8)]
    assert _spans(16, sched, max_span=3) == [
        (0, 2),
        (2, 2),
        (4, 2),
        (6, 2),
        (8, 2),
        (10, 2),
        (12, 2),
        (14, 2),
    ]
    # from a step between two apply points (after calibration's single steps): to the next
    assert _spans(16, sched, max_span=6, recorded=lambda s: s < 3) == [
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 5),
        (8, 4),
        (12, 4),
    ]
    # 100 steps a round, spans of 90 at most: two of 50 per round
    assert _spans(300, StreamingSchedule(100), max_span=90)[:4] == [
        (0, 50),
        (50, 50),
        (100, 50),
        (150, 50),
    ]
    # what the planner counts is what the runtime runs
    for cap, h, f in ((6, 8, 2), (3, 8, 2), (90, 100, 1), (7, 50, 5), (1, 10, 1)):
        runs = _spans(10 * h, StreamingSchedule(h, f), max_span=cap)
        assert steps_per_call(10 * h, cap=cap, period=h // f) == pytest.approx(10 * h / len(runs))


def test_recorded_steps_checkpoints_evals_and_the_end_cut_a_span() -> None:
    sched = StreamingSchedule(6)  # one apply every 6 steps
    spans = _spans(
        20,
        sched,
        recorded=lambda s: s < 3,  # calibration's first steps: one step per call
        eval_due=lambda d: d % 4 == 0,
        every=12,
    )
    # recorded 0-2, then ends at the evals after 4, 8, 16, the checkpoint after 12 and the
    # end (20); the applies after 6, 12 and 18 end none
    assert spans == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 4), (8, 4), (12, 4), (16, 4)]


def test_a_span_is_recorded_step_by_step_its_applies_first_its_status_once() -> None:
    """record_span: each step's send and apply are noted before the step is recorded (the
    calibration that closes the span at its apply prices it as measured), and status.json
    is rewritten at the span's last step only."""
    seen: list = []
    outer = SimpleNamespace(
        done_through=0,
        recording=None,
        note_sends=lambda done, res, at: seen.append(("sends", done)),
        note_applied=lambda done, res, actors: seen.append(("applied", done)),
    )

    def record(step: int, results: list, at: float, status: bool = True) -> None:
        seen.append(("record", step, status))

    ctl = SimpleNamespace(plan=SimpleNamespace(codecs=[]), outer=outer, _record=record)
    answers = [[SimpleNamespace(codec_error={}) for _ in range(3)]]  # one actor, 3 steps
    assert record_span(ctl, 6, answers, ["actor"]) == 9
    assert seen == [
        ("sends", 7), ("applied", 7), ("record", 6, False),
        ("sends", 8), ("applied", 8), ("record", 7, False),
        ("sends", 9), ("applied", 9), ("record", 8, True),
    ]  # fmt: skip
    assert outer.done_through == 9 and outer.recording is None


def test_a_span_lasts_a_few_predicted_seconds_at_most() -> None:
    sched = StreamingSchedule(1000)
    assert span_of(0, 10_000, 1.0, sched, 0, _never, _never) == int(SPAN_S)
    assert span_of(0, 10_000, 0.0, sched, 0, _never, _never) == 1  # no prediction: 1
    assert span_of(0, 10_000, 1e-6, sched, 0, _never, _never) == MAX_SPAN
    assert span_of(0, 10_000, 100.0, sched, 0, _never, _never) == 1  # slow steps: one a call
    assert span_of(0, 10_000, 0.1, sched, 0, _never, _never, max_span=3) == 3


class _Worker:
    """A stage replica's methods a span calls, recording their order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def run_iteration(self, step: int, record: bool = False) -> SimpleNamespace:
        self.calls.append(("step", step, record))
        return SimpleNamespace(step=step, outer_sent=None, outer_applied=None)

    def outer_send(self, fragment: int, done: int) -> dict:
        self.calls.append(("send", fragment, done))
        return {"fragment": fragment, "payload_bytes": 7}

    def outer_decision(self, done: int, fragment: int, wait_s: float) -> list[int]:
        self.calls.append(("decision", done, fragment))
        return [0, 1]

    def outer_apply(self, fragment: int, groups: list[int]) -> dict:
        self.calls.append(("apply", fragment, groups))
        return {"fragment": fragment, "round": 0, "apply_s": 0.0, "digest": "d"}


def test_an_apply_is_made_inside_the_span_after_its_send_and_step() -> None:
    """Where the driver's own calls used to land: the send after the step that calls for
    it, then (overlap 0) the apply over the groups the driver named, before the next step,
    so the weights and the round are those of the per-step driver's order."""
    w = _Worker()
    out = run_span(w, 8, 4, sends={10: 1}, applies={10: 1})
    assert w.calls == [
        ("step", 8, False),
        ("step", 9, False),
        ("send", 1, 10),
        ("decision", 10, 1),
        ("apply", 1, [0, 1]),
        ("step", 10, False),
        ("step", 11, False),
    ]
    assert out[1].outer_applied["fragment"] == 1 and out[1].outer_applied["decide_wait_s"] >= 0
    assert all(r.outer_applied is None for i, r in enumerate(out) if i != 1)
    assert out[1].outer_sent["before_end_s"] >= 0


def test_the_actor_sends_right_after_the_step_that_calls_for_it() -> None:
    w = _Worker()
    out = run_span(w, 4, 4, record=[5], sends={6: 1})
    assert w.calls == [
        ("step", 4, False),
        ("step", 5, True),
        ("send", 1, 6),  # after 6 steps done, before step 6 starts
        ("step", 6, False),
        ("step", 7, False),
    ]
    assert [r.step for r in out] == [4, 5, 6, 7]
    assert out[1].outer_sent["fragment"] == 1 and out[1].outer_sent["before_end_s"] >= 0
    assert all(r.outer_sent is None for i, r in enumerate(out) if i != 1)


def test_sends_the_actors_made_are_not_made_again_and_are_counted_in_the_round() -> None:
    rounds, rec, events = _rounds(h=8, fragments=2, overlap=1)
    actors = list(range(6))
    rounds.begin(actors, ["east"] * 3 + ["west"] * 3)
    rec.calls.clear()
    for start in (0, 4, 8, 12):  # spans of 4 steps; the send after step start + 3
        sent = [
            SimpleNamespace(outer_sent={"fragment": (start // 4) % 2, "payload_bytes": 50})
            for _ in actors
        ]
        rounds.note_sends(start + 3, sent, received=100.0 + start)
        rounds.after_step(start + 4, actors)
    methods = [m for _, m, _ in rec.calls]
    assert "outer_send" not in methods  # every send was the actors'
    assert methods.count("outer_apply") == 4 * 6
    rows = [f for kind, f in events if kind == "outer_round"]
    assert [r["step"] for r in rows] == [4, 8, 12, 16]
    assert [r["fragment"] for r in rows] == [0, 1, 0, 1]
    assert all(r["bytes"] == 300 and r["digests_equal"] for r in rows)


class _Ref:
    """A pending call of :class:`_Seam`: its answer, already known."""

    def __init__(self, value) -> None:
        self.value = value


class _Seam:
    """The worker seam for :class:`Decisions`: each actor answers ``outer_gather`` from
    ``gather(actor, call number)`` and ``outer_decide`` with the groups ``made[actor]`` its
    apply already used (None: not made); every call is recorded."""

    def __init__(self, rec, gather, made=None) -> None:
        self.rec, self.gather, self.asked = rec, gather, {}
        self.made = made or {}
        self.calls: list[tuple] = []

    def call(self, actor: int, method: str, *args):
        self.calls.append((actor, method, args))
        if method == "outer_gather":
            n = self.asked[actor] = self.asked.get(actor, 0) + 1
            return _Ref(self.gather(actor, n))
        if method == "outer_decide":
            return _Ref({"made": self.made.get(actor)})
        return _Ref(self.rec.call(actor, method, *args))

    def get(self, pendings, timeout=None):
        return [p.value for p in pendings]

    def decided(self, seq: int) -> list[tuple]:
        """The ``outer_decide`` calls of word ``seq`` (0: as a point comes up; 1: hold;
        2: the final groups), as (actor, steps done, groups)."""
        return [(a, x[0], x[1]) for a, m, x in self.calls if m == "outer_decide" and x[2] == seq]


def _walk(d) -> None:
    """Answer the walk's gathers until it has none in flight."""
    while d.refs():
        d.ready(d.refs()[0])


def test_the_driver_names_the_groups_as_each_point_comes_up() -> None:
    """The driver's half: as each apply point comes up every replica is told its groups,
    the live ones (it applies once it holds their payloads: no round trip after they
    arrive), and asked for its gather of the round (which waits for the span's send); a
    replica whose span has not sent yet is asked again, with no silence counted; once all
    hold all, the walk goes to the next point. The apply the span then makes is recorded
    with its wait."""
    from geopipe.runtime.control.outerdecide import Decisions

    rounds, rec, events = _rounds(h=8, fragments=2, overlap=1)
    actors = list(range(6))
    rounds.begin(actors, ["east"] * 3 + ["west"] * 3)
    late = {5}  # actor 5's span sends later than the others
    seam = _Seam(
        rec,
        lambda a, n: (
            {"sent": False, "have": []} if a in late and n == 1 else {"have": [0, 1], "wait_s": 0.2}
        ),
    )
    rounds.workers = seam
    d = Decisions(rounds, actors, points_of(rounds.schedule, 0, 8), send_wait_s=5.0)
    assert seam.decided(0) == [(a, 4, [0, 1]) for a in actors]  # at once, before any gather
    _walk(d)
    assert seam.decided(0) == [(a, 4, [0, 1]) for a in actors] + [(a, 8, [0, 1]) for a in actors]
    assert not seam.decided(1) and not seam.decided(2)  # nothing taken back
    gathers = [(a, args) for a, m, args in seam.calls if m == "outer_gather"]
    assert gathers[:6] == [(a, (0, 1.0, 3, 5.0)) for a in actors]  # fragment 0, sent after 3
    assert sum(1 for a, _ in gathers if a == 5) == 3 and not d.stalled()  # asked again once
    assert d.points == [] and d.made == {4, 8}
    # the span's apply after 4 steps, recorded from its results
    rounds.note_sends(
        3, [SimpleNamespace(outer_sent={"fragment": 0, "payload_bytes": 50})] * 6, 1.0
    )
    applied = {"fragment": 0, "round": 0, "apply_s": 0.1, "since_send_s": 0.5, "digest": "x"}
    results = [SimpleNamespace(outer_applied={**applied, "decide_wait_s": 0.05})] * 6
    rounds.note_applied(4, results, actors)
    rows = [f for kind, f in events if kind == "outer_round"]
    assert [(r["step"], r["fragment"], r["bytes"]) for r in rows] == [(4, 0, 300)]
    assert rows[0]["exposed_s"] == 0.05 and rows[0]["overlapped_s"] == 0.45


def test_a_missing_payload_stalls_the_point_names_the_link_and_loses_the_group() -> None:
    """A payload that does not come: the point stalls (the hang clock pauses), its
    gathers are asked again of the replicas missing it, the console names the link, and
    past health.wan_outage_s the decision is taken back: every replica holds, none had
    applied (none held every payload), so group 0's side is told its own group alone and
    group 1 is lost."""
    from geopipe.runtime.control.outerdecide import Decisions
    from geopipe.runtime.control.outerloop import GroupsLost

    rounds, rec, _ = _rounds(h=4, fragments=1, overlap=0)
    said: list[str] = []
    rounds.say = said.append
    actors = list(range(6))
    rounds.begin(actors, ["east"] * 3 + ["west"] * 3)
    now = [0.0]
    rounds.clock = lambda: now[0]

    def gather(a, n):
        now[0] += 1.0  # each answer a second later on the virtual clock
        return {"have": [0] if a < 3 else [0, 1], "wait_s": 1.0}  # group 0 never hears 1

    seam = rounds.workers = _Seam(rec, gather)
    d = Decisions(rounds, actors, points_of(rounds.schedule, 0, 4), send_wait_s=5.0)
    with pytest.raises(GroupsLost) as lost:
        _walk(d)
    assert lost.value.groups == [1] and lost.value.silent  # group 0's side stays
    assert d.stalled() is False and "group 0 <- 1 (sites east <-> west)" in said[0]
    assert seam.decided(1) == [(a, 4, None) for a in actors]  # held everywhere first
    assert seam.decided(2) == [(a, 4, [0]) for a in range(3)]  # then group 0 alone


def _three_groups():
    """An outer run of three groups of one replica each (east, west, west) on a scripted
    seam: the rounds, and the seam's recorder."""
    rounds, _, _ = _rounds(h=4, fragments=1, overlap=0)
    eps = [
        {"group": g, "stage": 0, "partition": 0, "address": ("h", g), "layout": "0/0"}
        for g in range(3)
    ]
    rec = Recorder(eps)
    rounds.workers = rec
    rounds.begin([0, 1, 2], ["east", "west", "west"])
    return rounds, rec


def test_a_decision_already_made_binds_the_survivors_of_its_partition() -> None:
    """[Note: taking back a decision]: three groups of one replica each; group 2 stays
    silent to group 1 alone. Group 0's replica already applied over all three (it held
    every payload); group 1's cannot (it lacks group 2's), so it is lost although it heard
    group 0: the survivors are groups 0 and 2, and group 2 applies over all three too, the
    same bytes as group 0. Without the hold, kept_groups alone would keep 0 and 1, and
    theta_global would split."""
    from geopipe.runtime.control.outerdecide import Decisions
    from geopipe.runtime.control.outerloop import GroupsLost

    rounds, rec = _three_groups()
    now = [0.0]
    rounds.clock = lambda: now[0]
    holds = {0: [0, 1, 2], 1: [0, 1], 2: [0, 1, 2]}

    def gather(a, n):
        now[0] += 1.0
        return {"have": holds[a], "wait_s": 1.0}

    seam = rounds.workers = _Seam(rec, gather, made={0: [0, 1, 2]})
    d = Decisions(rounds, [0, 1, 2], points_of(rounds.schedule, 0, 4), send_wait_s=5.0)
    with pytest.raises(GroupsLost) as lost:
        _walk(d)
    assert lost.value.groups == [1]
    assert seam.decided(2) == [(0, 4, [0, 1, 2]), (2, 4, [0, 1, 2])]


def test_a_group_whose_frames_were_refused_is_lost_at_once() -> None:
    """A replica that refused a group's frames (NaN, a frame off the plan) says so in its
    gather: the driver writes that group off there, not after health.wan_outage_s, and
    tells the others their final groups."""
    from geopipe.runtime.control.outerdecide import Decisions
    from geopipe.runtime.control.outerloop import GroupsLost

    rounds, rec, _ = _rounds(h=4, fragments=1, overlap=0)
    actors = list(range(6))
    rounds.begin(actors, ["east"] * 3 + ["west"] * 3)

    def gather(a, n):
        if a == 0:
            return {"have": [0], "wait_s": 0.0, "refused": {1: "refused: NaN in the payload"}}
        return {"have": [0, 1], "wait_s": 0.0}

    seam = rounds.workers = _Seam(rec, gather)
    d = Decisions(rounds, actors, points_of(rounds.schedule, 0, 4), send_wait_s=5.0)
    with pytest.raises(GroupsLost, match="refused") as lost:
        _walk(d)
    assert lost.value.groups == [1] and not lost.value.silent
    assert seam.decided(2) == [(a, 4, [0]) for a in range(3)]


def test_a_replica_applies_once_it_holds_the_named_payloads_and_a_made_apply_stands() -> None:
    """The replica's half ([Note: taking back a decision]): the apply waits for the driver's
    groups *and* their payloads; once it is made, a hold changes nothing and says so; before
    it, the driver's latest word wins, an older one arriving late changes nothing."""
    import threading

    from geopipe.runtime.actor.outer import OuterLoop

    o = object.__new__(OuterLoop)  # the decision's state alone: no engine, no exchange
    o.group, o._sync = 0, threading.Condition()
    o._decided, o._made, o._seq, o._got = {}, {}, {}, {}
    o._pending = {3: (0, [], {})}  # fragment 3 sent
    assert o.decide(10, [0, 1]) == {"made": None}
    with pytest.raises(TimeoutError):
        o.decision(10, 3, 0.01)  # group 1's payload not held yet

    def arrives() -> None:
        with o._sync:
            o._got.setdefault(3, {})[1] = []
            o._sync.notify_all()

    threading.Timer(0.05, arrives).start()
    assert o.decision(10, 3, 5.0) == [0, 1]
    assert o.decide(10, None, 1) == {"made": [0, 1]}  # made: the hold changes nothing
    assert o.decide(20, [0, 1], 0) == {"made": None}
    assert o.decide(20, None, 1) == {"made": None}  # held: no apply until the next word
    o.decide(20, [0, 1], 0)  # the first word, arriving late: older, ignored
    with pytest.raises(TimeoutError):
        o.decision(20, 3, 0.01)
    o.decide(20, [0], 2)
    assert o.decision(20, 3, 1.0) == [0]


def test_a_rounds_exposure_is_the_midrange_of_the_groups_waits() -> None:
    """Two groups, a transfer of T = 1.5 s past the later arrival: the group there 0.5 s
    first waits 2.0 s, the later 1.0 s; the round exposed 1.5 s beyond the later group's
    steps (each group's wait is its slowest replica's)."""
    from geopipe.runtime.control.outerloop import _exposed

    assert _exposed([(0, 2.0), (0, 1.2), (1, 1.0), (1, 0.4)]) == pytest.approx(1.5)
    assert _exposed([(0, 0.3), (1, 0.3)]) == pytest.approx(0.3)
    assert _exposed([]) == 0.0


def test_a_point_taken_back_is_walked_on_until_the_survivors_hold_their_final_groups() -> None:
    """A take-back (here: group 2's frames refused while group 1's payload is still on its
    way to group 0) names the survivors' final groups, then keeps asking their gathers: a
    replica applies only once it holds its final groups' payloads, and only gathers file
    them. The recovery walking on over the survivors does not take the point back again."""
    from geopipe.runtime.control.outerdecide import Decisions
    from geopipe.runtime.control.outerloop import GroupsLost

    rounds, rec = _three_groups()

    def gather(a, n):
        if a == 0 and n == 1:  # group 2's frames refused; group 1's not in yet
            return {"have": [0], "refused": {2: "refused: NaN in the payload"}}
        if a == 0 and n <= 3:
            return {"have": [0]}
        return {"have": [0, 1] if a < 2 else [0, 1, 2]}

    seam = rounds.workers = _Seam(rec, gather)
    d = Decisions(rounds, [0, 1, 2], points_of(rounds.schedule, 0, 8), send_wait_s=5.0)
    with pytest.raises(GroupsLost, match="refused") as lost:
        _walk(d)
    assert lost.value.groups == [2]
    assert seam.decided(2) == [(0, 4, [0, 1]), (1, 4, [0, 1])]
    assert d.points[0].done == 4 and d.refs()  # still walked: gathers asked of 0 and 1
    rounds.drop([2], [0, 1])  # what the recovery does, then it walks on over the survivors
    _walk(d.over([0, 1]))
    assert not seam.decided(3)  # not taken back a second time
    assert d.made == {4, 8} and d.final is None
    assert seam.decided(0)[-2:] == [(0, 8, [0, 1]), (1, 8, [0, 1])]  # the next point: 2 left


def test_a_replica_that_applied_answers_its_gather_with_the_groups_it_used() -> None:
    """The hold's and the walk's gathers reach a replica whose span already applied the
    round: it answers as holding what it applied (never "not sent" for ever)."""
    import threading

    from geopipe.runtime.actor.outer import OuterLoop

    o = object.__new__(OuterLoop)
    o.group, o._sync = 1, threading.Condition()
    o._decided, o._made, o._seq, o._got, o._pending = {}, {}, {}, {}, {}
    o._sent_done, o._applied = {}, {3: (9, [0, 1])}  # fragment 3's round sent after 9 applied
    ans = o.gather(3, 0.0, sent_done=9, send_wait_s=0.0)
    assert ans["applied"] == [0, 1] and ans["have"] == [0, 1] and ans.get("sent", True)
    assert o.gather(3, 0.0, sent_done=19, send_wait_s=0.0)["sent"] is False  # next round
