"""Split-backward schedules (``I``/``W``): generators, golden files, the validator's rules,
the memory they hold, and ZB-H1 against ``torch.distributed.pipelining``'s own order.

Regenerate the golden files (after checking the new text by hand) with
``GEOPIPE_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_zerobubble.py``.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

from geopipe.pipeline.schedule import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    lookahead,
    lookahead_zb,
    make_schedule,
    parse_schedule,
    validate,
    warmup_counts,
    zb_h1,
)
from geopipe.pipeline.zerobubble import default_caps, split_order

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
UPDATE = os.environ.get("GEOPIPE_UPDATE_GOLDEN") == "1"
SPLIT = (Kind.F, Kind.I, Kind.W)


def _computes(s: Schedule) -> list[list[str]]:
    return [
        [str(a) for a in acts if a.kind in (Kind.F, Kind.B, Kind.I, Kind.W)] for acts in s.stages
    ]


def _grid() -> list[Schedule]:
    out = []
    for p, m in itertools.product(range(1, 6), range(1, 11)):
        out.append(zb_h1(p, m))
        for j, d in itertools.product(range(p - 1), range(4)):
            dn = [0] * (p - 1)
            dn[j] = d
            out.append(lookahead_zb(p, m, dn))
            for c in (1, 2, p + 1, m + 5):
                out.append(lookahead_zb(p, m, dn, [c] * p))
    return out


def test_generators_validate_and_round_trip_over_grid() -> None:
    scheds = _grid()
    assert len(scheds) > 500
    for s in scheds:
        validate(s)
        assert parse_schedule(s.to_text()) == s
        # every micro-batch takes the split path on every stage
        for acts in s.stages:
            kinds = [a.kind for a in acts]
            assert Kind.B not in kinds
            assert kinds.count(Kind.I) == kinds.count(Kind.W) == s.num_microbatches
        assert s.caps == s.max_in_flight


def test_zb_h1_is_lookahead_zb_without_look_ahead() -> None:
    # ZB-H1's rule (every stage may hold what the first stage holds) is lookahead-zb's
    # default cap, so with ΔN = 0 the two coincide (whenever m >= p: with fewer
    # micro-batches than stages the lag no longer matters and the lists differ in name only).
    for p, m in itertools.product(range(1, 7), range(1, 13)):
        if m < p:
            continue
        a, b = zb_h1(p, m), lookahead_zb(p, m, [0] * (p - 1))
        assert a.programs == b.programs
        assert a.caps == b.caps == (p,) * p


def test_zb_h1_published_order_by_hand() -> None:
    # Qi et al. 2024, fig. 3 (ZB-H1, p=4): 1F1B warm-ups, worker k's W trailing its I by k
    # micro-batches, every worker holding at most p micro-batches. Typed out by hand.
    s = zb_h1(4, 8)
    got = [" ".join(a[1:] for a in row) for row in _computes(s)]
    assert got == [
        "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7",
        "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7",
        "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7",
        "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7",
    ]
    assert s.caps == (4, 4, 4, 4)


def _torch_zb_order(p: int, m: int) -> list[list[str]] | None:
    """torch's ScheduleInterleavedZeroBubble with one stage per rank (ZB1P = ZB-H1): its own
    order-building code, run on the attributes its constructor derives (building the
    schedule object needs live pipeline stages and a process group). None where torch
    refuses the micro-batch count (not a multiple of its rounds)."""
    rounds = max(1, m // p)
    if m % rounds:
        return None
    self = SimpleNamespace(
        n_local_stages=1, pp_group_size=p, microbatches_per_round=m // rounds, _n_microbatches=m
    )
    calc = ScheduleInterleavedZeroBubble._calculate_single_rank_operations
    self.pipeline_order = {r: calc(self, r) for r in range(p)}
    order = ScheduleInterleavedZeroBubble._add_bubbles_to_actions(self, p)
    return [[str(a) for a in order[r] if a is not None] for r in range(p)]


@pytest.mark.parametrize("p", range(1, 7))
def test_zb_h1_matches_torch_pipelining(p: int) -> None:
    compared = 0
    for m in range(1, 25):
        theirs = _torch_zb_order(p, m)
        if theirs is None:
            continue
        assert _computes(zb_h1(p, m)) == theirs, (p, m)
        compared += 1
    assert compared >= 12


def test_lookahead_zb_keeps_look_ahead_warm_ups() -> None:
    for p, m, dn in ((3, 8, [0, 2]), (4, 10, [0, 3, 0]), (2, 6, [4])):
        la, zb = lookahead(p, m, dn), lookahead_zb(p, m, dn)
        for k in range(p):
            lead = _computes(zb)[k]
            first_back = next(i for i, a in enumerate(lead) if "I" in a)
            # warm-up forwards, then one more forward before the first I (unless all ran)
            assert first_back == min(warmup_counts(p, m, dn)[k] + 1, m)
            # the forward and input-gradient order is look-ahead's, B renamed I
            assert [a.replace("B", "I") for a in _computes(la)[k]] == [
                a for a in lead if "W" not in a
            ]


def test_lookahead_zb_caps_bound_the_deferral() -> None:
    p, m, dn = 3, 10, [0, 2]
    warm = warmup_counts(p, m, dn)
    assert warm == [4, 3, 0]
    assert default_caps(p, m, dn) == [5, 5, 5]
    s = lookahead_zb(p, m, dn)
    assert s.max_in_flight == (5, 5, 5)
    tight = lookahead_zb(p, m, dn, [1, 2, 3])
    # a cap below warm-up + 1 cannot be honoured (look-ahead needs it): W follows I at once
    assert tight.max_in_flight == (warm[0] + 1, warm[1] + 1, 3)
    assert "0I0 0W0" in tight.to_text()
    # caps above the default are lowered to it
    assert lookahead_zb(p, m, dn, [9, 9, 9]).programs == s.programs
    with pytest.raises(ValueError, match="one entry per stage"):
        lookahead_zb(p, m, dn, [5, 5])


def test_split_order_lag() -> None:
    f = lambda o: " ".join(f"{k.name}{mb}" for k, mb in o)  # noqa: E731
    assert f(split_order(3, 1, 0)) == "F0 F1 I0 W0 F2 I1 W1 I2 W2"
    assert f(split_order(3, 1, 1)) == "F0 F1 I0 F2 I1 W0 I2 W1 W2"
    assert f(split_order(3, 0, 5)) == "F0 I0 F1 I1 F2 I2 W0 W1 W2"
    with pytest.raises(ValueError, match="lag"):
        split_order(3, 0, -1)


def test_make_schedule_knows_the_split_families() -> None:
    assert make_schedule("zb-h1", 3, 6) == zb_h1(3, 6)
    assert make_schedule("lookahead-zb", 3, 6, [0, 2]) == lookahead_zb(3, 6, [0, 2])
    assert make_schedule("lookahead-zb", 3, 6, [0, 2], [4, 3, 3]) == lookahead_zb(
        3, 6, [0, 2], [4, 3, 3]
    )
    with pytest.raises(ValueError, match="zb-h1"):
        make_schedule("zbv", 3, 6)


def test_hold_points_and_peak_held() -> None:
    # Stage 1 of lookahead-zb(2, 8, [2]) defers W by 3: right after F3 it holds one
    # micro-batch whole (3 are past I), which is its peak whatever the W fraction.
    s = lookahead_zb(2, 8, [2])
    assert s.hold_points[0] == ((4, 0),)
    assert s.hold_points[1] == ((1, 3),)
    assert s.peak_held(1.0) == (4.0, 4.0)
    assert s.peak_held(0.5) == (4.0, 2.5)
    assert s.peak_held(0.0) == (4.0, 1.0)
    # without a split the profile is the in-flight count
    la = lookahead(3, 6, [2, 0])
    assert la.peak_held(0.3) == tuple(float(x) for x in la.max_in_flight)


def _brute_peak(s: Schedule, frac: float) -> list[float]:
    out = []
    for acts in s.stages:
        full = part = 0
        peak = 0.0
        for a in acts:
            full += (a.kind == Kind.F) - (a.kind in (Kind.B, Kind.I))
            part += (a.kind == Kind.I) - (a.kind == Kind.W)
            peak = max(peak, full + frac * part)
        out.append(peak)
    return out


def test_peak_held_matches_a_step_by_step_count() -> None:
    for s in _grid()[::7]:
        for frac in (0.0, 0.25, 0.9, 1.0):
            assert list(s.peak_held(frac)) == pytest.approx(_brute_peak(s, frac))


# --------------------------------------------------------------------------------------------
# Golden files

GOLDEN_CASES = {
    "zb-h1_p4_m8.txt": lambda: zb_h1(4, 8),
    "lookahead-zb_p3_m8_dn0-2.txt": lambda: lookahead_zb(3, 8, [0, 2]),
    "lookahead-zb_p3_m8_dn0-2_caps5-3-2.txt": lambda: lookahead_zb(3, 8, [0, 2], [5, 3, 2]),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden(name: str) -> None:
    s = GOLDEN_CASES[name]()
    validate(s)
    path = GOLDEN / name
    if UPDATE:
        path.write_text(s.to_text())
    assert path.exists(), f"missing {path}; run with GEOPIPE_UPDATE_GOLDEN=1"
    assert s.to_text() == path.read_text()
    assert parse_schedule(path.read_text()) == s


# --------------------------------------------------------------------------------------------
# The validator's rules for split backwards


def _edit(s: Schedule, stage: int, acts: list[Action]) -> Schedule:
    stages = [list(a) for a in s.stages]
    stages[stage] = acts
    return Schedule.from_actions(s.name, s.num_stages, s.num_microbatches, stages, s.caps)


def _raises(s: Schedule, *fragments: str) -> None:
    with pytest.raises(ScheduleError) as info:
        validate(s)
    for f in fragments:
        assert f in str(info.value), str(info.value)


def test_w_before_i_is_caught() -> None:
    s = zb_h1(3, 4)
    acts = list(s.stages[0])
    i, j = acts.index(Action(0, Kind.I, 1)), acts.index(Action(0, Kind.W, 1))
    acts[i], acts[j] = acts[j], acts[i]
    _raises(_edit(s, 0, acts), "0W1 runs before its input-gradient backward 0I1", "[0W1]")


def test_i_before_f_and_recv_after_i_are_caught() -> None:
    s = zb_h1(3, 4)
    acts = [a for a in s.stages[2] if a != Action(2, Kind.F, 1)]
    acts.insert(acts.index(Action(2, Kind.I, 1)) + 1, Action(2, Kind.F, 1))
    _raises(_edit(s, 2, acts), "2I1 runs before its forward", "[2I1]")
    acts = list(s.stages[1])
    i = acts.index(Action(1, Kind.RECV_B, 2))
    acts[i], acts[i + 1] = acts[i + 1], acts[i]
    _raises(_edit(s, 1, acts), "I2 on stage 1 runs before RECV_B2", "[1I2]")


def test_send_before_i_is_caught() -> None:
    s = zb_h1(3, 4)
    acts = list(s.stages[1])
    i = acts.index(Action(1, Kind.SEND_B, 2))
    acts[i - 1], acts[i] = acts[i], acts[i - 1]
    _raises(_edit(s, 1, acts), "1SEND_B2 sends before the backward ran", "[1SEND_B2]")


def test_missing_w_and_mixed_backward_are_caught() -> None:
    s = zb_h1(2, 3)
    acts = [a for a in s.stages[0] if a != Action(0, Kind.W, 2)]
    _raises(_edit(s, 0, acts), "stage 0 never runs W2", "beside 0I2")
    acts = [*s.stages[1], Action(1, Kind.B, 0)]
    _raises(_edit(s, 1, acts), "full backward B0 and a split one")
    acts = [Action(0, Kind.B, 0) if a == Action(0, Kind.I, 0) else a for a in s.stages[0]]
    acts = [a for a in acts if a != Action(0, Kind.W, 0)]
    validate(_edit(s, 0, acts))  # one micro-batch with a full backward, the rest split: fine


def test_deferred_w_counts_against_the_cap() -> None:
    s = zb_h1(3, 6)
    bad = Schedule(s.name, 3, 6, s.programs, (3, 3, 2))
    _raises(bad, "stage 2 holds 3 micro-batches, above its cap 2")
