"""Schedule generators, their text form, golden files and the validator's error reports.

Regenerate the golden files (after checking the new text by hand) with
``GEOPIPE_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_schedule.py``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from _hand1f1b import hand_1f1b

from geopipe.pipeline.schedule import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    gpipe,
    lookahead,
    make_schedule,
    one_f_one_b,
    parse_action,
    parse_schedule,
    validate,
    warmup_counts,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden"  # tests/golden
UPDATE = os.environ.get("GEOPIPE_UPDATE_GOLDEN") == "1"


def _delta_patterns(p: int) -> Iterator[tuple[int, ...]]:
    """All zero; one WAN boundary with ΔN 0..5; two WAN boundaries with a few ΔN pairs."""
    nb = p - 1
    yield (0,) * nb
    for j in range(nb):
        for d in range(6):
            dn = [0] * nb
            dn[j] = d
            yield tuple(dn)
    for j1, j2 in itertools.combinations(range(nb), 2):
        for d1, d2 in ((1, 2), (3, 0), (2, 5), (4, 4)):
            dn = [0] * nb
            dn[j1], dn[j2] = d1, d2
            yield tuple(dn)


def _grid_schedules(p: int) -> Iterator[Schedule]:
    for m in range(1, 11):
        yield gpipe(p, m)
        yield one_f_one_b(p, m)
        for dn in _delta_patterns(p):
            yield lookahead(p, m, dn)


def _ops(text: str) -> list[str]:
    return text.split()


def _expected_warmup(p: int, m: int, dn: tuple[int, ...], k: int) -> int:
    return min(m, p - k - 1 + sum(dn[k:]))


# --------------------------------------------------------------------------------------------
# Generators over a grid


@pytest.mark.parametrize("p", range(1, 7))
def test_generators_validate_over_grid(p: int) -> None:
    count = 0
    for s in _grid_schedules(p):
        validate(s)
        count += 1
        m = s.num_microbatches
        assert s.num_stages == p
        assert len(s.stages) == p
        if s.name == "gpipe":
            assert s.max_in_flight == (m,) * p
            assert s.caps == (m,) * p
        else:
            assert s.max_in_flight == s.caps
            dn = s.delta_n or (0,) * (p - 1)
            for k in range(p):
                assert s.caps[k] == min(m, _expected_warmup(p, m, dn, k) + 1)
    assert count > 10


@pytest.mark.parametrize("p", range(1, 7))
def test_text_round_trips_over_grid(p: int) -> None:
    for s in _grid_schedules(p):
        text = s.to_text()
        back = parse_schedule(text)
        assert back == s
        assert back.to_text() == text
        assert back.stages == s.stages


def test_one_f_one_b_is_lookahead_with_zero_delta() -> None:
    for p, m in itertools.product(range(1, 6), range(1, 9)):
        a, b = one_f_one_b(p, m), lookahead(p, m, [0] * (p - 1))
        assert a.programs == b.programs
        assert a.caps == b.caps == tuple(min(m, p - k) for k in range(p))
        assert a.name == "1f1b" and a.delta_n == ()


def test_warmup_counts() -> None:
    assert warmup_counts(3, 4, [0, 0]) == [2, 1, 0]
    assert warmup_counts(3, 6, [2, 0]) == [4, 1, 0]
    assert warmup_counts(4, 8, [0, 3, 0]) == [6, 5, 1, 0]
    assert warmup_counts(4, 3, [0, 3, 0]) == [3, 3, 1, 0]  # capped at m
    assert warmup_counts(1, 5, []) == [0]
    with pytest.raises(ValueError, match="one entry per stage boundary"):
        warmup_counts(3, 4, [0])
    with pytest.raises(ValueError, match="non-negative"):
        warmup_counts(3, 4, [0, -1])


def test_compute_order_of_1f1b_stage() -> None:
    # Stage k of p runs p-k-1 warm-up forwards, then alternates F and B, then drains.
    s = one_f_one_b(4, 6)
    computes = [[str(a)[1:] for a in acts if a.kind in (Kind.F, Kind.B)] for acts in s.stages]
    assert computes[0] == _ops("F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5")
    assert computes[1] == _ops("F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5")
    assert computes[2] == _ops("F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5")
    assert computes[3] == _ops("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5")


def test_make_schedule_by_name() -> None:
    assert make_schedule("gpipe", 3, 4) == gpipe(3, 4)
    assert make_schedule("1f1b", 3, 4) == one_f_one_b(3, 4)
    assert make_schedule("lookahead", 3, 4, [1, 0]) == lookahead(3, 4, [1, 0])
    assert make_schedule("lookahead", 3, 4) == lookahead(3, 4, [0, 0])
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("zb-v", 3, 4)
    for bad in ((0, 4), (3, 0)):
        with pytest.raises(ValueError):
            gpipe(*bad)
        with pytest.raises(ValueError):
            one_f_one_b(*bad)


def test_parse_action_and_errors() -> None:
    assert parse_action("12SEND_F345") == Action(12, Kind.SEND_F, 345)
    assert parse_action(" 0B7 ") == Action(0, Kind.B, 7)
    for a in (Action(3, k, 9) for k in Kind):
        assert parse_action(str(a)) == a
    for bad in ("F0", "0X1", "0F", "0 F1", "", "-1F0"):
        with pytest.raises(ValueError, match="not an action"):
            parse_action(bad)
    with pytest.raises(ValueError, match="header"):
        parse_schedule("0F0 0B0\n")
    text = one_f_one_b(3, 2).to_text()
    with pytest.raises(ValueError, match="3 stages but 2 lines"):
        parse_schedule("\n".join(text.splitlines()[:-1]))


# --------------------------------------------------------------------------------------------
# Golden files

GOLDEN_CASES = {
    "gpipe_p3_m4.txt": lambda: gpipe(3, 4),
    "1f1b_p3_m4.txt": lambda: one_f_one_b(3, 4),
    "lookahead_p3_m6_dn2-0.txt": lambda: lookahead(3, 6, [2, 0]),
    "lookahead_p4_m8_dn0-3-0.txt": lambda: lookahead(4, 8, [0, 3, 0]),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden(name: str) -> None:
    s = GOLDEN_CASES[name]()
    validate(s)
    path = GOLDEN / name
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(s.to_text())
    assert path.exists(), f"missing {path}; run with GEOPIPE_UPDATE_GOLDEN=1"
    assert s.to_text() == path.read_text()
    assert parse_schedule(path.read_text()) == s


def test_golden_1f1b_by_hand() -> None:
    # Written out independently of the generator (the golden file must say the same).
    expected = [
        "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0F3 0SEND_F3 0RECV_B1 0B1 "
        "0RECV_B2 0B2 0RECV_B3 0B3",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_B0 1B0 1SEND_B0 1RECV_F2 1F2 "
        "1SEND_F2 1RECV_B1 1B1 1SEND_B1 1RECV_F3 1F3 1SEND_F3 1RECV_B2 1B2 1SEND_B2 "
        "1RECV_B3 1B3 1SEND_B3",
        "2RECV_F0 2F0 2B0 2SEND_B0 2RECV_F1 2F1 2B1 2SEND_B1 2RECV_F2 2F2 2B2 2SEND_B2 "
        "2RECV_F3 2F3 2B3 2SEND_B3",
    ]
    lines = (GOLDEN / "1f1b_p3_m4.txt").read_text().splitlines()
    assert lines[0] == "# 1f1b stages=3 microbatches=4 caps=3,2,1 delta_n=-"
    assert lines[1:] == expected


def test_golden_lookahead_by_hand() -> None:
    # p=4, ΔN=[0,3,0]: warm-ups 3+3, 2+3, 1, 0 -> caps 7, 6, 2, 1.
    lines = (GOLDEN / "lookahead_p4_m8_dn0-3-0.txt").read_text().splitlines()
    assert lines[0] == "# lookahead stages=4 microbatches=8 caps=7,6,2,1 delta_n=0,3,0"
    stage0 = [t[1:] for t in lines[1].split() if "SEND" not in t and "RECV" not in t]
    assert stage0 == _ops("F0 F1 F2 F3 F4 F5 F6 B0 F7 B1 B2 B3 B4 B5 B6 B7")
    stage1 = [t[1:] for t in lines[2].split() if "SEND" not in t and "RECV" not in t]
    assert stage1 == _ops("F0 F1 F2 F3 F4 F5 B0 F6 B1 F7 B2 B3 B4 B5 B6 B7")
    stage2 = [t[1:] for t in lines[3].split() if "SEND" not in t and "RECV" not in t]
    assert stage2 == _ops("F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7")


# --------------------------------------------------------------------------------------------
# The validator catches broken schedules


def _edit(s: Schedule, stage: int, new: list[Action], caps: tuple[int, ...] | None = None):
    stages = [list(a) for a in s.stages]
    stages[stage] = new
    return Schedule.from_actions(
        s.name, s.num_stages, s.num_microbatches, stages, caps or s.caps, s.delta_n
    )


def _raises(s: Schedule, *fragments: str) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(s)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, msg
    return msg


def test_hand_builder_matches_generator() -> None:
    s = lookahead(4, 8, [0, 3, 0])
    assert hand_1f1b(4, 8, warmup_counts(4, 8, [0, 3, 0])).programs == s.programs


def test_b_before_f_is_caught() -> None:
    s = one_f_one_b(3, 4)
    acts = list(s.stages[2])
    i, j = acts.index(Action(2, Kind.F, 0)), acts.index(Action(2, Kind.B, 0))
    acts[i], acts[j] = acts[j], acts[i]
    msg = _raises(_edit(s, 2, acts), "2B0 runs before its forward", "[2B0]")
    assert "stage  2" in msg


def test_missing_recv_is_caught() -> None:
    s = one_f_one_b(3, 4)
    acts = [a for a in s.stages[1] if a != Action(1, Kind.RECV_F, 2)]
    _raises(_edit(s, 1, acts), "stage 1 never runs RECV_F2", "stage  1 @")


def test_missing_recv_error_marks_the_grid() -> None:
    # The validator promises a stage × step grid with the failing step marked; for a
    # missing receive it prints the grid unmarked (`_grid(s, None)`).
    s = one_f_one_b(3, 4)
    acts = [a for a in s.stages[1] if a != Action(1, Kind.RECV_F, 2)]
    _raises(_edit(s, 1, acts), "RECV_F2", "[")


def test_recv_after_compute_is_caught() -> None:
    s = one_f_one_b(3, 4)
    acts = list(s.stages[1])
    i = acts.index(Action(1, Kind.RECV_F, 1))
    acts[i], acts[i + 1] = acts[i + 1], acts[i]
    _raises(_edit(s, 1, acts), "F1 on stage 1 runs before RECV_F1", "[1F1]")


def test_send_before_compute_is_caught() -> None:
    s = one_f_one_b(3, 4)
    acts = list(s.stages[0])
    i = acts.index(Action(0, Kind.SEND_F, 1))
    acts[i - 1], acts[i] = acts[i], acts[i - 1]
    _raises(_edit(s, 0, acts), "0SEND_F1 sends before the forward ran", "[0SEND_F1]")
    acts = list(s.stages[1])
    i = acts.index(Action(1, Kind.SEND_B, 2))
    acts[i - 1], acts[i] = acts[i], acts[i - 1]
    _raises(_edit(s, 1, acts), "1SEND_B2 sends before the backward ran", "[1SEND_B2]")


def test_over_cap_in_flight_is_caught() -> None:
    s = lookahead(3, 6, [2, 0])
    bad = Schedule(s.name, 3, 6, s.programs, (3, 2, 1), s.delta_n)
    _raises(bad, "stage 0 holds 4 micro-batches, above its cap 3", "[0F3]")


def test_duplicate_and_out_of_range_are_caught() -> None:
    s = one_f_one_b(2, 3)
    acts = list(s.stages[1])
    _raises(_edit(s, 1, [*acts, Action(1, Kind.B, 0)]), "appears twice", "[1B0]")
    _raises(_edit(s, 1, [*acts, Action(1, Kind.F, 3)]), "out of range", "[1F3]")


def test_missing_compute_is_caught() -> None:
    s = gpipe(2, 3)
    acts = [a for a in s.stages[0] if a != Action(0, Kind.B, 2)]
    _raises(_edit(s, 0, acts), "stage 0 never runs B2")


def test_talking_past_the_end_is_caught() -> None:
    s = gpipe(2, 2)
    acts = [*s.stages[1], Action(1, Kind.SEND_F, 0)]
    _raises(_edit(s, 1, acts), "talks past the pipeline's end")


def test_action_in_wrong_stage_list() -> None:
    s = gpipe(2, 2)
    stages = [list(s.stages[0]), [Action(0, Kind.F, 0), *s.stages[1]]]
    with pytest.raises(ScheduleError, match="sits in stage 1's list"):
        Schedule.from_actions("x", 2, 2, stages, s.caps)


def test_deadlock_downstream_lookahead_only() -> None:
    # ΔN given to the stage after the boundary but not the one before: stage 1 wants F3
    # before B0, stage 0 only sends F0..F2 before waiting for B0.
    warm = [2, 1 + 2, 0]
    msg = _raises(hand_1f1b(3, 6, warm), "deadlock", "[")
    assert "stage 0 at 0RECV_B0" in msg
    assert "stage 1 at 1RECV_F3" in msg


@pytest.mark.parametrize("p", [2, 3, 5])
def test_deadlock_whenever_downstream_warms_more(p: int) -> None:
    # A stage with more warm-up than its upstream neighbour + 1 always deadlocks;
    # neighbour + 1 (the 1F1B relation) or less is fine.
    m = 8
    for k in range(1, p):
        warm = [p - j - 1 for j in range(p)]
        warm[k] = warm[k - 1] + 1
        with pytest.raises(ScheduleError, match="deadlock"):
            validate(hand_1f1b(p, m, warm))
        warm[k] = warm[k - 1]
        validate(hand_1f1b(p, m, warm))


def test_deadlock_by_swapping_receives() -> None:
    # Stage 0 holds back its first activation until the very end, but waits for that
    # micro-batch's gradient first: stage 1 never gets F0.
    s = one_f_one_b(2, 2)
    acts = list(s.stages[0])  # 0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1
    i = acts.index(Action(0, Kind.SEND_F, 0))
    acts.insert(len(acts) - 1, acts.pop(i))  # send F0 only at the very end
    msg = _raises(_edit(s, 0, acts), "deadlock", "[")
    assert "stage 1 at 1RECV_F0" in msg
