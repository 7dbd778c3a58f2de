"""The simulator on split backwards (``I``/``W``): the paper's ZB-H1 bubble, a step-by-step
reference on random costs, busy time, the pruning bound, and look-ahead's round trip
shortened by the split. No timing asserts."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from _refsim import reference_time

from geopipe.optimizer.costs import INPUT_GRAD_SHARE
from geopipe.optimizer.simulator import PipelineCosts, lower_bound, simulate
from geopipe.pipeline.schedule import (
    Schedule,
    lookahead,
    lookahead_zb,
    one_f_one_b,
    zb_h1,
)


def _costs(p: int, f: float, i: float, w: float, ser: float = 0.0, lat: float = 0.0):
    nb = p - 1
    return PipelineCosts(
        (f,) * p,
        (i + w,) * p,
        (0.0,) * p,
        (ser,) * nb,
        (lat,) * nb,
        (ser,) * nb,
        (lat,) * nb,
        (i,) * p,
        (w,) * p,
    )


@pytest.mark.parametrize("t", [1.0, 0.25, 3e-3])
def test_zb_h1_bubble_is_a_third_of_1f1b(t: float) -> None:
    # Qi et al. §2.1: with T_F = T_B = T_W and free links, ZB-H1's bubble is
    # (p-1)(T_F + T_B - T_W), a third of 1F1B's (p-1)(T_F + T_B + T_W).
    for p, m in itertools.product(range(1, 7), range(1, 13)):
        if m < p:
            continue
        c = _costs(p, t, t, t)
        zb, base = simulate(zb_h1(p, m), c), simulate(one_f_one_b(p, m), c)
        assert zb.iteration_time_s == pytest.approx(3 * m * t + (p - 1) * t, rel=1e-12)
        assert base.iteration_time_s == pytest.approx(3 * (m + p - 1) * t, rel=1e-12)
        idle_zb = p * zb.iteration_time_s - sum(zb.busy_s)
        idle_1f1b = p * base.iteration_time_s - sum(base.busy_s)
        assert idle_zb * 3 == pytest.approx(idle_1f1b, rel=1e-9, abs=1e-12)


def test_costs_split_default_and_explicit() -> None:
    c = PipelineCosts((1.0,), (2.0,), (0.0,), (), (), (), ())
    assert c.split() == ((2.0 * INPUT_GRAD_SHARE,), (2.0 * (1 - INPUT_GRAD_SHARE),))
    c2 = dataclasses.replace(c, inp_s=(0.0,), wgt_s=(2.5,))
    assert c2.split() == ((0.0,), (2.5,))
    # busy counts what ran: F + I + W per micro-batch for split schedules
    r = simulate(zb_h1(1, 3), c2)
    assert r.busy_s == pytest.approx([3 * (1.0 + 0.0 + 2.5)])
    assert r.iteration_time_s == pytest.approx(3 * 3.5)


def _random_costs(rng: random.Random, p: int) -> PipelineCosts:
    nb = p - 1

    def draw(lo: float, hi: float, n: int) -> tuple[float, ...]:
        return tuple(rng.uniform(lo, hi) if rng.random() > 0.15 else 0.0 for _ in range(n))

    inp = draw(0.01, 2, p)
    wgt = draw(0.01, 2, p)
    return PipelineCosts(
        draw(0.01, 2, p),
        tuple(a + b for a, b in zip(inp, wgt, strict=True)),
        draw(0, 1, p),
        draw(0, 3, nb),
        draw(0, 10, nb),
        draw(0, 3, nb),
        draw(0, 10, nb),
        inp,
        wgt,
    )


def _split_schedules(rng: random.Random, p: int, m: int) -> list[Schedule]:
    dn = [rng.choice([0, 0, 1, 3, 6]) for _ in range(p - 1)]
    caps = [rng.randint(1, m + 2) for _ in range(p)]
    return [zb_h1(p, m), lookahead_zb(p, m, dn), lookahead_zb(p, m, dn, caps)]


def test_matches_unfused_reference_on_random_costs() -> None:
    rng = random.Random(4321)
    for _ in range(150):
        p, m = rng.randint(1, 5), rng.randint(1, 9)
        c = _random_costs(rng, p)
        for sched in _split_schedules(rng, p, m):
            got = simulate(sched, c).iteration_time_s
            assert got == pytest.approx(reference_time(sched, c), rel=1e-12), sched.to_text()


def test_recorded_timeline_names_the_split() -> None:
    c = _costs(2, 1.0, 0.5, 0.75, ser=0.1, lat=2.0)
    r = simulate(zb_h1(2, 3), c, record=True)
    s1 = [e for e in r.events if e.row == "stage 1"]
    assert [e.name for e in s1] == ["F0", "I0", "F1", "I1", "W0", "F2", "I2", "W1", "W2"]
    assert all(e.end - e.start == pytest.approx(0.75) for e in s1 if e.name[0] == "W")
    assert all(e.end - e.start == pytest.approx(0.5) for e in s1 if e.name[0] == "I")


def test_lower_bound_with_split_never_above_simulation() -> None:
    rng = random.Random(77)
    tight = 0
    for _ in range(300):
        p, m = rng.randint(1, 6), rng.randint(1, 12)
        c = _random_costs(rng, p)
        lb = lower_bound(c, m, split=True)
        for sched in _split_schedules(rng, p, m):
            t = simulate(sched, c).iteration_time_s
            assert lb <= t * (1 + 1e-12), (sched.name, p, m, c)
            tight += lb >= t * (1 - 1e-9)
        # the split bound is never above the plain one (I <= B on the way back)
        assert lb <= lower_bound(c, m) * (1 + 1e-12)
    assert tight > 0


def test_split_shortens_the_round_trip_look_ahead_must_cover() -> None:
    # Two stages over a slow link, W as long as I: at every ΔN the split schedule is at
    # least as fast, and strictly faster while ΔN does not cover the round trip (the
    # gradient leaves after I, so the round trip is shorter by the last stage's W).
    c = _costs(2, 1.0, 1.0, 1.0, ser=0.5, lat=5.0)
    m = 16
    faster = 0
    for dn in range(0, 10):
        la = simulate(lookahead(2, m, [dn]), c).iteration_time_s
        zb = simulate(lookahead_zb(2, m, [dn], [dn + 2, dn + 2]), c).iteration_time_s
        assert zb <= la * (1 + 1e-12), dn
        faster += zb < la * (1 - 1e-9)
    assert faster >= 5
