"""Discrete-event simulator: closed forms, monotonicity, look-ahead vs 1F1B, the synchronous
lower bound, recorded timelines and deadlocks. No timing asserts: speed is not tested here.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from pathlib import Path

import pytest
from _hand1f1b import hand_1f1b
from _refsim import reference_time

from geopipe.config import ClusterSpec, load_cluster
from geopipe.optimizer.evaluate import Candidate, Evaluator
from geopipe.optimizer.genetic import genetic_search
from geopipe.optimizer.ladder import delta_n_estimate
from geopipe.optimizer.simulator import PipelineCosts, lower_bound, simulate
from geopipe.pipeline.schedule import (
    Schedule,
    ScheduleError,
    gpipe,
    lookahead,
    one_f_one_b,
)

ROOT = Path(__file__).resolve().parents[2]
LOCAL = load_cluster(ROOT / "clusters" / "local-2dc.yaml")
THREE = load_cluster(ROOT / "clusters" / "three-dc-wan.yaml")


def _uniform(
    p: int, tf: float, tb: float, ser: float = 0.0, lat: float = 0.0, step: float = 0.0
) -> PipelineCosts:
    nb = p - 1
    return PipelineCosts(
        (tf,) * p, (tb,) * p, (step,) * p, (ser,) * nb, (lat,) * nb, (ser,) * nb, (lat,) * nb
    )


def _with_links(spec: ClusterSpec, **update: float) -> ClusterSpec:
    return spec.model_copy(update={"links": [lk.model_copy(update=update) for lk in spec.links]})


def _scale_bandwidth(spec: ClusterSpec, factor: float) -> ClusterSpec:
    links = [
        lk.model_copy(update={"bandwidth_gbps": lk.bandwidth_gbps * factor}) for lk in spec.links
    ]
    return spec.model_copy(update={"links": links})


# --------------------------------------------------------------------------------------------
# Closed forms on uniform stages with free links


@pytest.mark.parametrize("tf,tb", [(1.0, 2.0), (0.3, 0.7), (1e-3, 2.5e-3)])
def test_uniform_free_links_closed_form(tf: float, tb: float) -> None:
    for p, m in itertools.product(range(1, 7), range(1, 11)):
        bubble = (p - 1) / (m + p - 1)
        ideal = (m + p - 1) * (tf + tb)
        for sched in (one_f_one_b(p, m), gpipe(p, m)):
            r = simulate(sched, _uniform(p, tf, tb))
            assert r.iteration_time_s == pytest.approx(ideal, rel=1e-12, abs=0), (sched.name, p, m)
            assert r.pipeline_time_s == pytest.approx(ideal, rel=1e-12, abs=0)
            assert r.bubble_ratio == pytest.approx(bubble, rel=1e-12, abs=1e-15), (p, m)
            assert r.busy_s == pytest.approx([m * (tf + tb)] * p, rel=1e-12)
            assert r.link_busy_s == [0.0] * (p - 1)


def test_lookahead_free_links_matches_1f1b() -> None:
    # With nothing to hide, extra warm-up forwards neither help nor hurt.
    for p, m in itertools.product(range(2, 6), range(1, 10)):
        for dn in ([1] * (p - 1), [0] * (p - 2) + [4]):
            r = simulate(lookahead(p, m, dn), _uniform(p, 0.3, 0.7))
            assert r.iteration_time_s == pytest.approx(m + p - 1, rel=1e-12)


def test_step_cost_adds_to_iteration() -> None:
    p, m = 3, 4
    base = simulate(one_f_one_b(p, m), _uniform(p, 1.0, 2.0))
    r = simulate(one_f_one_b(p, m), _uniform(p, 1.0, 2.0, step=0.5))
    assert r.pipeline_time_s == pytest.approx(base.pipeline_time_s)
    assert r.iteration_time_s == pytest.approx(base.iteration_time_s + 0.5)
    assert r.busy_s == pytest.approx([m * 3.0 + 0.5] * p)
    assert r.bubble_ratio == pytest.approx(1 - sum(r.busy_s) / (p * r.iteration_time_s))


def test_link_costs_one_stage_pair_by_hand() -> None:
    # p=2, m=1: F on stage 0, ship (ser + lat), F and B on stage 1, ship back, B on stage 0.
    c = PipelineCosts((1.0, 2.0), (3.0, 4.0), (0.0, 0.0), (0.5,), (10.0,), (0.25,), (20.0,))
    for sched in (gpipe(2, 1), one_f_one_b(2, 1), lookahead(2, 1, [3])):
        r = simulate(sched, c)
        assert r.iteration_time_s == pytest.approx(1 + 0.5 + 10 + 2 + 4 + 0.25 + 20 + 3)
        assert r.link_busy_s == pytest.approx([0.75])


def test_link_is_a_fifo_server() -> None:
    # GPipe on 2 stages: stage 0 emits activations every tf, but the link needs ser > tf per
    # message, so arrivals are paced by serialisation: arrival_i = tf + (i+1)*ser + lat.
    tf, tb, ser, lat, m = 1.0, 1.0, 3.0, 5.0, 4
    c = PipelineCosts((tf, tf), (tb, tb), (0.0, 0.0), (ser,), (lat,), (0.0,), (0.0,))
    r = simulate(gpipe(2, m), c, record=True)
    stage1_f = [e for e in r.events if e.row == "stage 1" and e.name.startswith("F")]
    starts = [e.start for e in stage1_f]
    assert starts == pytest.approx([tf + (i + 1) * ser + lat for i in range(m)])
    assert r.link_busy_s == pytest.approx([m * ser])


# --------------------------------------------------------------------------------------------
# A straightforward reference: the unfused action lists, one action at a time


def test_matches_unfused_reference_on_random_costs() -> None:
    rng = random.Random(1234)
    for _ in range(150):
        p, m = rng.randint(1, 5), rng.randint(1, 9)
        nb = p - 1
        c = PipelineCosts(
            tuple(rng.uniform(0.1, 2) for _ in range(p)),
            tuple(rng.uniform(0.1, 4) for _ in range(p)),
            tuple(rng.uniform(0, 1) for _ in range(p)),
            tuple(rng.uniform(0, 3) for _ in range(nb)),
            tuple(rng.uniform(0, 10) for _ in range(nb)),
            tuple(rng.uniform(0, 3) for _ in range(nb)),
            tuple(rng.uniform(0, 10) for _ in range(nb)),
        )
        dn = [rng.choice([0, 0, 1, 3, 6]) for _ in range(nb)]
        for sched in (gpipe(p, m), one_f_one_b(p, m), lookahead(p, m, dn)):
            got = simulate(sched, c).iteration_time_s
            assert got == pytest.approx(reference_time(sched, c), rel=1e-12), (sched.to_text(), c)


# --------------------------------------------------------------------------------------------
# The lower bound the searches prune with


def test_lower_bound_never_above_simulation() -> None:
    rng = random.Random(99)
    tight = 0
    for _ in range(400):
        p, m = rng.randint(1, 6), rng.randint(1, 12)
        nb = p - 1

        def draw(lo: float, hi: float, n: int) -> tuple[float, ...]:
            return tuple(rng.uniform(lo, hi) if rng.random() > 0.2 else 0.0 for _ in range(n))

        c = PipelineCosts(
            draw(0.01, 2, p),
            draw(0.01, 4, p),
            draw(0, 1, p),
            draw(0, 3, nb),
            draw(0, 10, nb),
            draw(0, 3, nb),
            draw(0, 10, nb),
        )
        dn = [rng.choice([0, 1, 3, 8]) for _ in range(nb)]
        lb = lower_bound(c, m)
        for sched in (gpipe(p, m), one_f_one_b(p, m), lookahead(p, m, dn)):
            t = simulate(sched, c).iteration_time_s
            assert lb <= t * (1 + 1e-12), (sched.name, p, m, c)
            tight += lb >= t * (1 - 1e-9)
    assert tight > 0


def test_lower_bound_is_tight_for_uniform_free_links() -> None:
    for p, m in itertools.product(range(1, 6), range(1, 9)):
        assert lower_bound(_uniform(p, 0.3, 0.7), m) == pytest.approx(m + p - 1, rel=1e-12)


# --------------------------------------------------------------------------------------------
# Monotonicity in link latency and bandwidth (through the Evaluator)

LATENCIES_MS = [0.0, 0.1, 1.0, 5.0, 25.0, 80.0, 250.0, 1000.0]
BW_FACTORS = [10.0, 1.0, 0.5, 0.2, 0.05, 0.01]

LOCAL_CANDIDATES = [
    Candidate(2, b, 128, (dn,), (codec,), sched)
    for (b, dn, codec, sched) in [
        (1, 0, "none", "lookahead"),
        (1, 4, "int8", "lookahead"),
        (2, 16, "none", "lookahead"),
        (8, 2, "int8", "lookahead"),
        (1, 0, "none", "1f1b"),
        (4, 0, "int8", "1f1b"),
        (1, 0, "none", "gpipe"),
        (8, 0, "none", "gpipe"),
    ]
]


def _times(spec_for, candidates, values) -> list[list[float]]:
    out = []
    for c in candidates:
        row = []
        plan0 = None
        for v in values:
            ev = Evaluator(spec_for(v))
            e = ev.evaluate(c)
            assert e.plan is not None
            plan0 = plan0 or e.plan
            assert e.plan == plan0  # the layout must not move under our feet
            row.append(e.iteration_time_s)
        out.append(row)
    return out


def _assert_non_decreasing(rows: list[list[float]]) -> None:
    for row in rows:
        for a, b in itertools.pairwise(row):
            assert b >= a * (1 - 1e-12), row


def test_iteration_time_grows_with_latency_local() -> None:
    rows = _times(lambda v: _with_links(LOCAL, latency_ms=v), LOCAL_CANDIDATES, LATENCIES_MS)
    _assert_non_decreasing(rows)
    assert all(row[-1] > row[0] for row in rows)


def test_iteration_time_grows_as_bandwidth_shrinks_local() -> None:
    rows = _times(lambda f: _scale_bandwidth(LOCAL, f), LOCAL_CANDIDATES, BW_FACTORS)
    _assert_non_decreasing(rows)
    assert all(row[-1] > row[0] for row in rows)


THREE_CANDIDATES = [
    Candidate(8, 1, 2048, (3, 3), ("int8", "int8")),
    Candidate(8, 4, 1024, (0, 0), ("none", "bf16")),
    Candidate(16, 2, 512, (8, 1), ("bf16", "none")),
    Candidate(8, 1, 2048, (0, 0), ("int8", "int8"), "1f1b"),
]


def test_iteration_time_monotone_three_sites() -> None:
    # Same latency on every link (and bandwidth scaled uniformly) keeps the site order fixed.
    rows = _times(lambda v: _with_links(THREE, latency_ms=v), THREE_CANDIDATES, LATENCIES_MS)
    _assert_non_decreasing(rows)
    rows = _times(lambda f: _scale_bandwidth(THREE, f), THREE_CANDIDATES, BW_FACTORS)
    _assert_non_decreasing(rows)


# --------------------------------------------------------------------------------------------
# Look-ahead is never slower than 1F1B


@pytest.mark.parametrize("latency_ms", [0.0, 2.0, 25.0, 100.0, 400.0])
def test_planner_lookahead_not_slower_than_1f1b(latency_ms: float) -> None:
    spec = _with_links(LOCAL, latency_ms=latency_ms)
    best = genetic_search(Evaluator(spec)).best
    assert best.feasible
    c = best.candidate
    ev = Evaluator(spec)  # fresh: the search's cache holds lower bounds of pruned candidates
    assert ev.evaluate(c).iteration_time_s == best.iteration_time_s
    one = ev.evaluate(dataclasses.replace(c, schedule="1f1b"))
    assert best.iteration_time_s <= one.iteration_time_s * (1 + 1e-12)
    if latency_ms >= 25:
        assert c.delta_n[0] > 0
        assert best.iteration_time_s < 0.8 * one.iteration_time_s
    # and at the analytic estimate, for every micro-batch size and codec
    for b, codec in itertools.product(ev.space.micro_batch_sizes, ev.space.codecs):
        cand = Candidate(2, b, 128, (0,), (codec,))
        plan = ev.make_plan(cand)
        est = tuple(delta_n_estimate(ev.costs(plan), j) for j in plan.wan_boundaries)
        la = ev.evaluate(dataclasses.replace(cand, delta_n=est)).iteration_time_s
        ref = ev.evaluate(dataclasses.replace(cand, schedule="1f1b")).iteration_time_s
        assert la <= ref * (1 + 1e-12), (b, codec, est)


@pytest.mark.parametrize("latency_ms", [1.0, 25.0, 250.0])
def test_any_lookahead_not_slower_than_1f1b(latency_ms: float) -> None:
    ev = Evaluator(_with_links(LOCAL, latency_ms=latency_ms))
    for b, codec in itertools.product((1, 4), ("none", "int8")):
        ref = ev.evaluate(Candidate(2, b, 128, (0,), (codec,), "1f1b")).iteration_time_s
        for dn in range(0, 17):
            t = ev.evaluate(Candidate(2, b, 128, (dn,), (codec,))).iteration_time_s
            assert t <= ref * (1 + 1e-12), (b, codec, dn)


# --------------------------------------------------------------------------------------------
# The synchronous lower bound


@pytest.mark.parametrize("latency", [0.05, 0.1, 0.4])
@pytest.mark.parametrize("margin", [0, 1, 3])
def test_lookahead_reaches_synchronous_bound(latency: float, margin: int) -> None:
    tf, tb, ser, m = 0.01, 0.02, 0.002, 32
    assert latency > tf + tb
    t_x = latency + ser
    dn = math.ceil(2 * t_x / (tf + tb)) + margin
    costs = _uniform(2, tf, tb, ser=ser, lat=latency)
    bound = (m + 1) * (tf + tb) + 2 * latency + 2 * ser
    la = simulate(lookahead(2, m, [dn]), costs).iteration_time_s
    assert la >= bound * (1 - 1e-12)
    assert la == pytest.approx(bound, rel=0.01)
    one = simulate(one_f_one_b(2, m), costs).iteration_time_s
    assert one > 1.5 * la
    # 1F1B keeps two micro-batches in flight on stage 0: one round trip per two of them
    assert one >= (m / 2) * 2 * latency


def test_too_little_lookahead_misses_the_bound() -> None:
    tf, tb, ser, latency, m = 0.01, 0.02, 0.002, 0.1, 32
    costs = _uniform(2, tf, tb, ser=ser, lat=latency)
    bound = (m + 1) * (tf + tb) + 2 * latency + 2 * ser
    need = math.ceil(2 * (latency + ser) / (tf + tb))
    times = [simulate(lookahead(2, m, [d]), costs).iteration_time_s for d in range(need + 3)]
    assert times[0] > 1.5 * bound
    assert times[need // 2] > 1.05 * bound
    # more look-ahead never hurts here, and the estimate is enough
    assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(times))
    assert times[need] == pytest.approx(bound, rel=0.01)


# --------------------------------------------------------------------------------------------
# Recorded timelines


@pytest.mark.parametrize(
    "sched",
    [gpipe(3, 5), one_f_one_b(4, 7), lookahead(3, 6, [2, 0]), lookahead(4, 8, [0, 3, 0])],
    ids=lambda s: f"{s.name}-p{s.num_stages}-m{s.num_microbatches}",
)
@pytest.mark.parametrize("step", [0.0, 0.2])
def test_recorded_events_consistent(sched: Schedule, step: float) -> None:
    p, m = sched.num_stages, sched.num_microbatches
    rng = random.Random(p * 100 + m)
    nb = p - 1
    c = PipelineCosts(
        tuple(rng.uniform(0.5, 1.5) for _ in range(p)),
        tuple(rng.uniform(1, 3) for _ in range(p)),
        (step,) * p,
        tuple(rng.uniform(0.1, 1) for _ in range(nb)),
        tuple(rng.uniform(0, 4) for _ in range(nb)),
        tuple(rng.uniform(0.1, 1) for _ in range(nb)),
        tuple(rng.uniform(0, 4) for _ in range(nb)),
    )
    plain = simulate(sched, c)
    rec = simulate(sched, c, record=True)
    assert rec.iteration_time_s == plain.iteration_time_s
    assert rec.pipeline_time_s == plain.pipeline_time_s
    assert rec.bubble_ratio == plain.bubble_ratio
    assert plain.events == []
    ev = rec.events
    compute = [e for e in ev if e.row.startswith("stage") and e.name != "step"]
    assert max(e.end for e in compute) == pytest.approx(rec.pipeline_time_s, rel=1e-12)
    assert max(e.end for e in ev) == pytest.approx(rec.iteration_time_s, rel=1e-12)
    assert min(e.start for e in ev) == 0.0
    assert all(e.end >= e.start for e in ev)
    for k in range(p):
        mine = sorted((e for e in compute if e.row == f"stage {k}"), key=lambda e: e.start)
        assert len(mine) == 2 * m
        assert sorted(e.name for e in mine) == sorted(
            [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
        )
        for a, b in itertools.pairwise(mine):
            assert b.start >= a.end - 1e-12, (k, a, b)
        assert sum(e.end - e.start for e in mine) == pytest.approx(m * (c.fwd_s[k] + c.bwd_s[k]))
        steps = [e for e in ev if e.row == f"stage {k}" and e.name == "step"]
        assert len(steps) == (1 if step > 0 else 0)
    links = [e for e in ev if e.row.startswith("link")]
    assert len(links) == 2 * m * nb
    # each message arrives before the compute that needs it starts
    start_of = {(e.row, e.name): e.start for e in compute}
    for e in links:
        dst = int(e.row.split("->")[1])
        assert start_of[(f"stage {dst}", e.name)] >= e.end - 1e-12, e


# --------------------------------------------------------------------------------------------
# Deadlocks


def test_simulate_raises_on_deadlock() -> None:
    # Stage 1 wants F3 before its first backward; stage 0 sends only F0..F2 before waiting.
    p, m = 3, 6
    sched = hand_1f1b(p, m, [2, 3, 0], name="bad")
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(sched, _uniform(p, 1.0, 2.0))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(sched, _uniform(p, 1.0, 2.0, ser=0.1, lat=5.0), record=True)
