"""The driver's control calls in the price of an outer round, against hand computations, and
an outer run's calibrated forecast from measured figures (geopipe.optimizer.outer_cost's
[Note: the driver's control calls], geopipe.runtime.control.outercal).

The calibration test drives :class:`OuterCalibrator` with a fake run whose timeline is built
the way the runtime spends time (a call per span, recorded steps alone, spans ending at
checkpoints or for their length, the applies inside them, each call costing a known
overhead and, unless queued behind the span before, a known round trip): the calibrator
must recover that overhead from the timeline alone and forecast the wall time per inner step
the timeline shows."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from geopipe.config import OuterSetting, parse_cluster
from geopipe.optimizer.groups import group_spec
from geopipe.optimizer.outer_cost import (
    CALL_OVERHEAD_S,
    MAX_SPAN,
    OUTER_CALLS_PER_FRAGMENT,
    SPAN_S,
    Control,
    block_bytes,
    driver_rtt_s,
    planned_control,
    price_round,
    span_cap,
    span_end,
    steps_per_call,
)
from geopipe.optimizer.penalty import PenaltyModel, parse_table
from geopipe.optimizer.planner import plan_cluster
from geopipe.optimizer.runplan import plan_run
from geopipe.outer.fragments import StreamingSchedule
from geopipe.runtime.control.calibration import CALIBRATION_STEPS, Calibrator
from geopipe.runtime.control.outercal import RECORDED

LOCAL = Path(__file__).resolve().parents[2] / "clusters" / "local-2dc.yaml"
LATENCY_S = 0.025  # local-2dc's east <-> west, one way


def _doc(real_links: bool = True, every: int = 0, **outer) -> dict:
    doc = copy.deepcopy(yaml.safe_load(LOCAL.read_text()))
    doc["ray"]["emulate_links"] = not real_links
    doc["plan"]["strategy"] = "outer"
    doc["plan"]["outer"] = {"h": 10, "fragments": 2, "overlap": 1, "codec": "none", **outer}
    doc["training"]["checkpoint"] = {"every_steps": every}
    return doc


def _table() -> PenaltyModel:
    rows = [
        {"replicas": 2, "h": h, "fragments": f, "codec": "none", "rel_gap": 0.001}
        for h in (2, 10, 20, 40)
        for f in (1, 2)
    ]
    doc = {"source": "t", "model": "t", "steps": 1, "tokens_per_step": 1, "sync_noise": 0.0}
    return PenaltyModel(parse_table({**doc, "rows": rows}), "t.json")


# -- the pricing function -------------------------------------------------------------------
def test_steps_per_call_counts_the_spans_exactly() -> None:
    assert steps_per_call(10) == 10 == steps_per_call(10, 0, 0)
    # checkpoints every 10, evaluations every 25: over 50 steps calls end at 10 20 25 30 40 50
    assert steps_per_call(10, 25) == pytest.approx(50 / 6)
    # ... at most 4 steps a call: gaps 10 10 5 5 10 10 take 3 3 2 2 3 3 calls
    assert steps_per_call(10, 25, cap=4) == pytest.approx(50 / 16)
    assert steps_per_call(10, 20, 5) == 5  # an evaluation every 5 bounds every call
    assert steps_per_call(10, cap=3) == 2.5  # 3 + 3 + 3 + 1
    assert steps_per_call(10, cap=1) == 1  # one call per step: the old driver
    # no boundary at all: spans of the cap (the applies fall inside them)
    assert steps_per_call(cap=12) == pytest.approx(12, rel=1e-3) and steps_per_call(0) > 999
    assert span_cap(0.3) == 16 and span_cap(0.0) == 1 and span_cap(1e-9) == MAX_SPAN
    with pytest.raises(ValueError, match="cap >= 1"):
        steps_per_call(10, cap=0)


def test_the_round_trip_is_to_the_farthest_site_over_the_fastest_path() -> None:
    site = yaml.safe_load(LOCAL.read_text())["sites"][0]
    doc = _doc()
    doc["sites"] = [dict(site, name=n) for n in "abc"]
    doc["links"] = [
        {"from": "a", "to": "b", "bandwidth_gbps": 1, "latency_ms": 10},
        {"from": "b", "to": "c", "bandwidth_gbps": 1, "latency_ms": 20},
        {"from": "a", "to": "c", "bandwidth_gbps": 1, "latency_ms": 50},
    ]
    spec = parse_cluster(doc, "t")
    assert driver_rtt_s(spec, ["a", "b", "c"]) == pytest.approx(2 * (0.010 + 0.020))
    assert driver_rtt_s(spec, ["b"]) == pytest.approx(0.020)
    assert driver_rtt_s(spec, ["a", "b"], driver="c") == pytest.approx(2 * 0.030)
    doc["links"].append({"from": "c", "to": "b", "bandwidth_gbps": 1, "latency_ms": 40})
    asymmetric = parse_cluster(doc, "t")  # c -> b is its own link now: a -> c -> a 30 + 50
    assert driver_rtt_s(asymmetric, ["c"]) == pytest.approx(0.030 + 0.050)
    emulated = parse_cluster({**doc, "ray": {**doc["ray"], "emulate_links": True}}, "t")
    assert driver_rtt_s(emulated, ["a", "b", "c"]) == 0.0  # every actor answers locally


def test_an_outer_round_matches_the_analytic_formula_with_its_control_calls() -> None:
    """H = 10, F = 2, overlap 1, codec none over one 25 ms, 0.2 Gbit/s link: the round is
    H·t + F·max(0, T_x − tau·t) + t_outer + (H / steps_per_call)·overhead
    + (H / steps_per_wait)·RTT (the applies are made inside the span calls, their groups
    named before the payloads arrive; a span queued behind another hides its round
    trip)."""
    spec = parse_cluster(_doc(), "t")
    groups = (("east",), ("west",))
    evals = [plan_cluster(group_spec(spec, g, 16)).best for g in groups]
    s = OuterSetting(h=10, fragments=2, overlap=1, codec="none")
    t = max(e.iteration_time_s for e in evals)
    payload = block_bytes(spec, evals[0].plan, s)
    exchange = LATENCY_S + math.ceil(payload) * 8 / 0.2e9  # M = 2: one ring step
    assert OUTER_CALLS_PER_FRAGMENT == 0
    cases = ((0.05, 0.003, 5.0, None), (0.05, 0.003, 1.0, None), (0.2, 0.0, 2.5, 5.0))
    for rtt, overhead, per_call, per_wait in cases:
        control_ = Control(rtt, overhead, per_call, steps_per_wait=per_wait)
        cost = price_round(spec, groups, evals, s, control_)
        control = 10 / per_call * overhead + 10 / (per_wait or per_call) * rtt
        exposed = 2 * max(0.0, exchange - 1 * t)  # no round trip: decided beforehand
        assert cost.exposed_s == pytest.approx(exposed)
        assert cost.exchange_s == pytest.approx(exchange)
        assert cost.control_s == pytest.approx(control)
        expected = 10 * t + exposed + cost.codec_s + cost.outer_step_s + control
        assert cost.round_s == pytest.approx(expected)
        assert cost.to_json()["control_s"] == pytest.approx(control)
    alone = price_round(spec, groups[:1], evals[:1], s, Control(0.05, 0.0, 5.0))
    assert alone.exchange_s == 0 and alone.control_s == pytest.approx(2 * 0.05)
    assert alone.exposed_s == 0  # one group: nothing to exchange, no decision to wait for
    # The default is the runtime's: spans up to each checkpoint (every 20 steps) or of
    # SPAN_S seconds of steps, whichever comes first; the applies ride inside them; the
    # links' round trip once per checkpoint interval (the later spans are queued).
    spec = parse_cluster(_doc(every=20), "t")
    cost = price_round(spec, groups, evals, s)
    cap = span_cap(t)
    assert cost.control.rtt_s == pytest.approx(0.05)
    assert cost.control.steps_per_call == pytest.approx(20 / -(-20 // cap))
    assert cost.control.steps_per_wait == 20
    per_call = cost.control.steps_per_call
    assert cost.control_s == pytest.approx(10 / per_call * CALL_OVERHEAD_S + 10 / 20 * 0.05)
    # Spans capped at 2 steps end at the applies (every H / F = 5 steps): 2 + 2 + 1, twelve
    # calls per checkpoint interval, one of them waited on.
    capped = price_round(spec, groups, evals, s, planned_control(spec, groups, s, t, cap=2))
    assert capped.control.steps_per_call == 5 / 3 and capped.control.steps_per_wait == 20
    assert capped.control_s == pytest.approx(6 * CALL_OVERHEAD_S + 0.5 * 0.05)


def test_the_launch_forecast_of_an_outer_run_carries_its_control_calls() -> None:
    spec = parse_cluster(_doc(every=20), "t")
    rp = plan_run(spec, penalty=_table())
    run = rp.outer
    assert run is not None and run.groups and len(run.evaluations) == 2
    cost = rp.strategy.chosen.round
    assert run.control_s == cost.control_s > 0 and run.to_dict()["control_s"] == cost.control_s
    assert rp.predicted.iteration_time_s == pytest.approx(run.round_s / run.h)
    cap = span_cap(cost.step_s)
    assert cost.control.steps_per_call == pytest.approx(steps_per_call(20, cap=cap))
    emulated = plan_run(parse_cluster(_doc(real_links=False, every=20), "t"), penalty=_table())
    assert emulated.outer.control_s < run.control_s  # no round trip to price


def test_the_planners_span_rule_is_the_runtimes() -> None:
    from geopipe.runtime.control import innerrun

    assert (SPAN_S, MAX_SPAN) == (innerrun.SPAN_S, innerrun.MAX_SPAN)
    assert RECORDED == CALIBRATION_STEPS


# -- the calibrated forecast ----------------------------------------------------------------
STEP_S = {0: 0.20, 1: 0.30}  # each group's measured inner step (west's the slower)
OVERHEAD_S = 0.012  # the driver's true overhead per call, beyond the round trip


def _step_s(group: int, step: int, jitter: bool) -> float:
    """Group ``group``'s inner step ``step``: steady, or on a shared host, the groups taking
    turns to be slow (0.35 s, the other 0.15 s) every 3 steps, across the spans' ends (at
    the applies, every 5 steps): both average 0.25 s, but a span waits for the group that
    was slow more often in it."""
    if not jitter:
        return STEP_S[group]
    return 0.25 + (0.1 if (step // 3 + group) % 2 == 0 else -0.1)


def _results(plan, step: int, jitter: bool = False) -> list:
    return [
        SimpleNamespace(
            replica=r, stage=0, step=step, duration_s=_step_s(plan.group_of(r), step, jitter)
        )
        for r in range(plan.pipelines)
    ]


def _timeline(
    run,
    spec,
    steps: int,
    cap: int,
    every: int,
    jitter: bool,
    exposed: float = 0.0,
    unseen: float = 0.0,
) -> list[tuple[int, float, tuple[int, int, bool]]]:
    """``(step, when the driver recorded it, its span (first step, end, queued))`` of a run
    that spends time as the runtime does ([Note: the driver's control calls]): spans end at
    checkpoints (which cost 1 s more) or for their length, a layout's first steps alone;
    each apply inside a span waits ``exposed`` seconds for the payloads and the decision,
    which the link model does not foresee (a real network's slow start after idle), and
    ``unseen`` seconds more that no round reports (the driver's calls queued behind a
    payload on a saturated link)."""
    sched = StreamingSchedule(run.h, run.setting.fragments, run.setting.overlap)
    call_s = 2 * LATENCY_S + OVERHEAD_S
    out, t, step, queued = [], 0.0, 0, False
    while step < steps:
        limit = step + every - step % every if every else 10**9  # span_of's, a long run
        n = 1 if step < RECORDED else span_end(step, limit, cap, sched.period) - step
        # the groups run the span side by side; the driver waits for the slower; a span
        # queued behind one that ended for its length waits for no round trip
        span = range(step, step + n)
        t += (OVERHEAD_S if queued else call_s) + max(
            sum(_step_s(g, s, jitter) for s in span) for g in (0, 1)
        )
        applies = sum(1 for s in span if sched.applies_at(s + 1) is not None)
        t += applies * (OUTER_CALLS_PER_FRAGMENT * call_s + _apply_s(run, spec) + exposed + unseen)
        out += [(s, t, (step, step + n, queued)) for s in span]
        step += n
        queued = step > RECORDED and not (every and step % every == 0)
        if every and step % every == 0:
            t += 1.0
    return out


def _apply_s(run, spec) -> float:
    """The modelled codec and outer step of one apply (its transfer hides behind the
    overlapped step at any step time here, so the price is the same for every step)."""
    evals = [replace(e, iteration_time_s=0.15) for e in run.evaluations]
    bare = price_round(spec, run.groups, evals, run.setting, Control(0.0, 0.0))
    assert bare.exposed_s == 0  # a tiny model's pseudo-gradient over 0.2 Gbit/s: hidden
    return (bare.codec_s + bare.outer_step_s) / run.setting.fragments


@pytest.mark.parametrize(
    ("every", "jitter", "short", "exposed"),
    [
        (0, False, False, 0.0),
        (20, False, False, 0.0),
        (0, True, False, 0.0),
        (20, False, True, 0.0),
        (0, False, False, 0.35),
    ],
)
def test_calibration_recovers_the_call_overhead_and_forecasts_the_wall_time(
    every: int, jitter: bool, short: bool, exposed: float
) -> None:
    spec = parse_cluster(_doc(every=every), "t")
    run = plan_run(spec, penalty=_table()).outer
    rounds = SimpleNamespace(run=run, max_span=4 if short else None, rounds=[], recording=None)
    cal = Calibrator(spec, False, 1.0, [], rounds)
    predicted = 0.4
    cap = 4 if short else span_cap(predicted)  # 12 steps: two or three applies a span
    assert cal.outer._cap(predicted) == cap
    steps = 140  # from step 20 on, two whole periods of the spans' pattern
    seen = _timeline(run, spec, steps, cap, every, jitter, exposed)
    sched = StreamingSchedule(run.h, run.setting.fragments, run.setting.overlap)
    forecasts, events = {}, []
    for step, at, span in seen:
        if step and sched.applies_at(step) is not None:  # applied before this step ran
            rounds.rounds.append({"exposed_s": exposed, "groups": 2})
        rounds.recording = span
        got = cal.outer.observe(step, run.plan, _results(run.plan, step, jitter), predicted, at)
        if got is not None:
            forecasts[step] = got[0]
            events.append(got[1])
    assert 0 not in forecasts  # the first step runs cold
    # Each span is a stretch: the first warm step (alone, as calibration records it) is
    # measured already.
    c1 = events[0]["round"]
    assert c1["inner_step_s"] == max(_step_s(g, 1, jitter) for g in (0, 1))
    assert c1["control_overhead_s"] == pytest.approx(OVERHEAD_S)
    # After: the overhead the timeline holds, and the wall time per step it shows.
    control = cal.outer.cost.control
    assert control.rtt_s == pytest.approx(2 * LATENCY_S)
    assert control.overhead_s == pytest.approx(OVERHEAD_S)
    at = dict((step, t) for step, t, _ in seen)
    checkpoints = sum(1 for d in range(21, steps + 1) if every and d % every == 0)
    plain = (at[steps - 1] - at[19] - 1.0 * checkpoints) / (steps - 20)
    if not jitter:
        assert events[-1]["group_step_s"] == pytest.approx([STEP_S[0], STEP_S[1]])
        assert forecasts[steps - 1] == pytest.approx(plain, rel=1e-5)  # a wait in 1e5 steps
    else:  # the slower group as a span sees it (the larger sum), not the mean (0.25 s)
        assert forecasts[steps - 1] == pytest.approx(plain, rel=0.02)
        assert 0.26 < max(events[-1]["group_step_s"]) < 0.35


def test_the_calibrator_hands_an_outer_run_its_plan_and_forecast() -> None:
    spec = parse_cluster(_doc(), "t")
    run = plan_run(spec, penalty=_table()).outer
    cal = Calibrator(spec, False, 1.0, [], SimpleNamespace(run=run, max_span=0))
    first = cal.observe(0, run.plan, _results(run.plan, 0))
    assert first.plan is run.plan and first.predicted_s == 1.0 and not cal.calibrated
    second = cal.observe(1, run.plan, _results(run.plan, 1))
    assert second.plan is run.plan and cal.calibrated and second.event["outer"]
    assert cal.predicted_s == second.predicted_s != 1.0
    # one call per step (max_span 0): the old driver's calls, priced as such
    assert cal.outer.cost.control.steps_per_call == 1
    cal.restart(5)
    assert cal.observe(5, run.plan, _results(run.plan, 5)).event is None  # cold again
    # west's group lost: the survivor's layout, re-priced with one group (no exchange)
    from geopipe.runtime.control.outerfail import without_groups

    east = without_groups(run.plan, {1})
    cal.restart(7)
    cal.observe(7, east, _results(east, 7))
    alone = cal.observe(8, east, _results(east, 8))
    assert alone.plan is east and alone.event["group_step_s"] == [STEP_S[0]]
    assert cal.outer.cost.exchange_s == 0 and cal.outer.cost.control.rtt_s == 0
    # east's group lost instead: the survivors report their launch positions (their actors
    # are not reconfigured), past the shrunk plan's pipelines
    west = without_groups(run.plan, {0})
    kept = [r for r in range(run.plan.pipelines) if run.plan.group_of(r) == 1]
    assert kept[0] >= west.pipelines or len(kept) < run.plan.pipelines
    launch_results = [SimpleNamespace(replica=r, stage=0, duration_s=STEP_S[1]) for r in kept]
    cal.restart(9)
    cal.observe(9, west, launch_results)
    lone = cal.observe(10, west, launch_results)
    assert lone.plan is west and lone.event["group_step_s"] == [STEP_S[1]]


def test_the_exposed_transfer_is_the_mean_of_the_latest_rounds() -> None:
    """One round's exposure moves a lot on a real network (a transfer after idle restarts
    TCP's window): the forecast takes the mean over the latest EXPOSED_ROUNDS rounds of the
    present layout's applies, per round F of them, its first round only until a later one
    is measured; before F applies, the link model's."""
    from geopipe.runtime.control.outercal import EXPOSED_ROUNDS

    spec = parse_cluster(_doc(), "t")
    run = plan_run(spec, penalty=_table()).outer
    f = run.setting.fragments
    assert f > 1  # the second round's fragments arrive one at a time
    rounds = SimpleNamespace(run=run, max_span=None, rounds=[], recording=None)
    cal = Calibrator(spec, False, 1.0, [], rounds)
    groups, evals = cal.outer._groups(run.plan)
    modelled = cal.outer._price(groups, evals, Control(0.0, 0.0)).exposed_s
    rounds.rounds = [{"exposed_s": 9.0, "groups": 2}] * (f - 1)
    assert cal.outer._price(groups, evals, Control(0.0, 0.0)).exposed_s == modelled

    def priced() -> float:
        return cal.outer._price(groups, evals, Control(0.0, 0.0)).exposed_s

    # [Note: the layout's first round runs cold]: alone, it is the measure; once a later
    # round is measured, it no longer counts
    rounds.rounds = [{"exposed_s": 0.9, "groups": 2}] * f
    assert priced() == pytest.approx(f * 0.9)
    for i in range(1, f):  # the second round's fragments: the first round stays the measure
        rounds.rounds = [{"exposed_s": 0.9, "groups": 2}] * f + [
            {"exposed_s": 0.4, "groups": 2}
        ] * i
        assert priced() == pytest.approx(f * (0.9 * f + 0.4 * i) / (f + i))
    rounds.rounds = [{"exposed_s": 0.9, "groups": 2}] * f + [{"exposed_s": 0.4, "groups": 2}] * f
    assert priced() == pytest.approx(f * 0.4)
    waits = [0.9, 0.6, 0.1, 0.2, 0.3, 0.05, 0.15, 0.25, 0.35, 0.45][: f * (EXPOSED_ROUNDS + 2)]
    rounds.rounds = [{"exposed_s": w, "groups": 2} for w in waits]
    latest = waits[-f * EXPOSED_ROUNDS :]  # the second round's 0.6 has left the window too
    assert priced() == pytest.approx(f * sum(latest) / len(latest))
    rounds.rounds.append({"exposed_s": 5.0, "groups": 1})  # another layout's: not counted
    assert priced() == pytest.approx(f * sum(latest) / len(latest))
    # a new layout (a group lost or grown back) measures afresh: its own first round alone
    cal.outer.restart(40)
    assert priced() == modelled
    rounds.rounds += [{"exposed_s": 0.7, "groups": 2}] * f
    assert priced() == pytest.approx(f * 0.7)


def test_what_an_apply_costs_unseen_is_forecast_over_whole_rounds() -> None:
    """[Note: whole periods of stretches]: each apply costs 0.5 s that no round reports; a
    round of H = 40 runs in spans of 4 steps, one of the ten holding the apply. Once a
    round is measured, every forecast is the wall time per step over whole rounds; over
    the latest 20 steps alone it swung with whether the apply's span was among them."""
    spec = parse_cluster(_doc(h=40, fragments=1, overlap=2), "t")
    run = plan_run(spec, penalty=_table()).outer
    assert (run.h, run.setting.fragments) == (40, 1)
    rounds = SimpleNamespace(run=run, max_span=4, rounds=[], recording=None)
    cal = Calibrator(spec, False, 1.0, [], rounds)
    seen = _timeline(run, spec, 200, 4, 0, False, unseen=0.5)
    sched = StreamingSchedule(run.h)
    forecasts = {}
    for step, at, span in seen:
        if step and sched.applies_at(step) is not None:
            rounds.rounds.append({"exposed_s": 0.0, "groups": 2})
        rounds.recording = span
        got = cal.outer.observe(step, run.plan, _results(run.plan, step), 0.4, at)
        if got is not None:
            forecasts[step] = got[0]
    at = {step: t for step, t, _ in seen}
    plain = (at[199] - at[79]) / 120  # three whole rounds
    late = sorted({round(f, 9) for s, f in forecasts.items() if s >= 80})
    assert late[0] == pytest.approx(plain, rel=1e-4) and late[-1] == pytest.approx(plain, rel=1e-4)
