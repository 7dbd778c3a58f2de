"""An outer-loop run's spans of inner steps ([Note: many inner steps per driver call] in
geopipe.runtime.actor.inner_run): where a span ends (the points where the driver must act),
and the driver's round record when the actors made the sends themselves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geopipe.outer.fragments import StreamingSchedule
from geopipe.runtime.actor.inner_run import run_span
from geopipe.runtime.control.innerrun import MAX_SPAN, SPAN_S, span_of
from tests.unit.test_outer_rounds import _rounds


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


def test_a_span_ends_at_every_apply_and_covers_each_step_once() -> None:
    sched = StreamingSchedule(8, 2, 1)  # applies after 4, 8, 12, 16
    spans = _spans(16, sched)
    assert spans == [(0, 4), (4, 4), (8, 4), (12, 4)]
    # the sends (after 3, 7, 11, 15) fall inside the spans: the actors make them
    assert all(sched.applies_at(s + n) is not None for s, n in spans)


def test_recorded_steps_checkpoints_evals_and_the_end_cut_a_span() -> None:
    sched = StreamingSchedule(6)  # one apply every 6 steps
    spans = _spans(
        20,
        sched,
        recorded=lambda s: s < 3,  # calibration's first steps: one step per call
        eval_due=lambda d: d % 4 == 0,
        every=12,
    )
    # recorded 0-2, then ends at the eval after 4, the applies after 6, 12, 18, the evals
    # after 8, 16 and the end (20)
    assert spans == [
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 1),
        (4, 2),
        (6, 2),
        (8, 4),
        (12, 4),
        (16, 2),
        (18, 2),
    ]


def test_a_span_lasts_a_few_predicted_seconds_at_most() -> None:
    sched = StreamingSchedule(1000)
    assert span_of(0, 10_000, 1.0, sched, 0, _never, _never) == int(SPAN_S)
    assert span_of(0, 10_000, 0.0, sched, 0, _never, _never) == 1  # no prediction: 1
    assert span_of(0, 10_000, 1e-6, sched, 0, _never, _never) == MAX_SPAN
    assert span_of(0, 10_000, 100.0, sched, 0, _never, _never) == 1  # slow steps: one a call
    assert span_of(0, 10_000, 0.1, sched, 0, _never, _never, max_span=3) == 3


class _Worker:
    """A stage replica's two methods a span calls, recording their order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def run_iteration(self, step: int, record: bool = False) -> SimpleNamespace:
        self.calls.append(("step", step, record))
        return SimpleNamespace(step=step, outer_sent=None)

    def outer_send(self, fragment: int) -> dict:
        self.calls.append(("send", fragment))
        return {"fragment": fragment, "payload_bytes": 7}

    def outer_apply(self, fragment: int, groups: list[int]) -> dict:
        self.calls.append(("apply", fragment, groups))
        return {"fragment": fragment, "round": 0, "wait_s": 0.0, "digest": "d"}

    def outer_gather(self, fragment: int, timeout_s: float) -> dict:
        self.calls.append(("gather", fragment, timeout_s))
        return {"fragment": fragment, "have": [0, 1], "missing": {}, "wait_s": 0.25}


def test_the_apply_rides_on_the_next_span_and_the_gather_closes_this_one() -> None:
    """Where the driver's own calls used to land: the apply after the last span's send and
    step, before this span's first step; the gather after the span's last step (and its
    send), so the weights and the round are those of the per-step driver's order."""
    w = _Worker()
    out = run_span(w, 8, 4, sends={12: 0}, apply=(1, [0, 1]), gather=(0, 2.5))
    assert w.calls == [
        ("apply", 1, [0, 1]),
        ("step", 8, False),
        ("step", 9, False),
        ("step", 10, False),
        ("step", 11, False),
        ("send", 0),
        ("gather", 0, 2.5),
    ]
    assert out[0].outer_applied["fragment"] == 1
    assert all(getattr(r, "outer_applied", None) is None for r in out[1:])
    assert out[-1].outer_gathered["have"] == [0, 1]
    assert all(getattr(r, "outer_gathered", None) is None for r in out[:-1])
    assert out[-1].outer_sent["before_end_s"] >= 0  # dated from the end, after the gather


def test_the_actor_sends_right_after_the_step_that_calls_for_it() -> None:
    w = _Worker()
    out = run_span(w, 4, 4, record=[5], sends={6: 1})
    assert w.calls == [
        ("step", 4, False),
        ("step", 5, True),
        ("send", 1),  # after 6 steps done, before step 6 starts
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


def test_an_apply_decided_from_the_spans_gathers_is_made_by_the_next_span() -> None:
    """The driver's half: a span's closing gathers that show every payload everywhere make
    no gather or apply call; the apply is handed to the next span and recorded from its
    answers; one the driver must make itself (a checkpoint next) is flushed as a call."""
    rounds, rec, events = _rounds(h=8, fragments=2, overlap=1)
    actors = list(range(6))
    rounds.begin(actors, ["east"] * 3 + ["west"] * 3)
    rec.calls.clear()
    everyone = [{"have": [0, 1], "wait_s": 0.1} for _ in actors]
    rounds.note_sends(
        3, [SimpleNamespace(outer_sent={"fragment": 0, "payload_bytes": 50})] * 6, 1.0
    )
    rounds.after_step(4, actors, everyone, defer=True)
    assert rec.calls == [] and rounds.span_apply() == (0, [0, 1])
    assert not [f for kind, f in events if kind == "outer_round"]
    applied = {"fragment": 0, "round": 0, "wait_s": 0.0, "digest": "x"}
    answers = [[SimpleNamespace(outer_applied=applied)] for _ in actors]
    rounds.note_applied(answers, actors)
    assert rounds.deferred is None and rounds.span_apply() is None
    rows = [f for kind, f in events if kind == "outer_round"]
    assert [(r["step"], r["fragment"], r["bytes"]) for r in rows] == [(4, 0, 300)]
    assert rows[0]["exposed_s"] == 0.1  # the spans' gathers waited that long
    # a gather that misses a payload goes on in the driver's slices; the next deferred
    # apply is made by a call when the driver must act first (flush)
    short = [{"have": [0] if a < 3 else [0, 1], "wait_s": 2.0} for a in actors]
    rounds.note_sends(
        7, [SimpleNamespace(outer_sent={"fragment": 1, "payload_bytes": 50})] * 6, 2.0
    )
    rounds.after_step(8, actors, short, defer=True)
    assert [m for _, m, _ in rec.calls] == ["outer_gather"] * 6
    rounds.flush(actors)
    assert [m for _, m, _ in rec.calls][6:] == ["outer_apply"] * 6
    assert rounds.deferred is None
    assert [r["step"] for kind, r in events if kind == "outer_round"] == [4, 8]
    rounds.after_step(8, actors)  # asked again: nothing is made twice
    assert len(rec.calls) == 12


def test_a_group_whose_frames_were_refused_is_lost_at_once() -> None:
    """A replica that refused a group's frames (NaN, a frame off the plan) says so in its
    gather: the driver writes that group off there, not after health.wan_outage_s."""
    from geopipe.runtime.control.outerloop import GroupsLost

    rounds, rec, _ = _rounds(h=4, fragments=1, overlap=0)
    actors = list(range(6))
    rounds.begin(actors, ["east"] * 3 + ["west"] * 3)
    rec.calls.clear()
    answers = [{"have": [0], "wait_s": 0.0} for _ in actors]
    answers[0] = {"have": [0], "wait_s": 0.0, "refused": {1: "refused: NaN in the payload"}}
    with pytest.raises(GroupsLost, match="refused") as lost:
        rounds.after_step(4, actors, answers, defer=True)
    assert lost.value.groups == [1] and not lost.value.silent
    assert [m for _, m, _ in rec.calls] == ["outer_send"] * 6  # no gather, no apply
