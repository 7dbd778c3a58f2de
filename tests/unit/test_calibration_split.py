"""Calibration of a split backward (pure): I and W from recorded events, and the
calibrator's costs splitting each step's measured backward by those shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from geopipe.config import load_cluster
from geopipe.optimizer.evaluate import Candidate, Evaluator
from geopipe.runtime.actor.executor import IterationResult
from geopipe.runtime.control.calibration import Calibrator, measured_split_times

LOCAL = load_cluster(Path(__file__).resolve().parents[2] / "clusters" / "local-2dc.yaml")


def _result(stage: int, events: list[tuple[str, float]], **breakdown: float) -> IterationResult:
    t, evs = 0.0, []
    for i, (kind, d) in enumerate(events):
        evs.append((kind, i, t, t + d))
        t += d
    return IterationResult(
        stage=stage,
        replica=0,
        step=0,
        losses=[],
        busy_s=t,
        wait_s=0.0,
        duration_s=t,
        start=0.0,
        wan_bytes=0,
        micro_batches=2,
        optimizer_steps=1,
        events=evs,
        breakdown=breakdown,
    )


# stage 0: I ~0 (first stage), W the whole backward; stage 1: I 1.0, W 0.5 then 0.9. No W
# carries the optimizer step (the runtime steps after the sends), so every W counts.
R0 = _result(
    0,
    [("F", 1.0), ("I", 0.0), ("F", 1.0), ("I", 0.0), ("W", 2.0), ("W", 2.6)],
    forward=2.0,
    backward=4.0,
)
R1 = _result(
    1,
    [("F", 1.0), ("I", 1.0), ("W", 0.5), ("F", 1.0), ("I", 1.0), ("W", 0.9)],
    forward=2.0,
    backward=3.0,
)


# the same with steady W times: the shares are 0 : 1 and 1 : 0.5
R0S = _result(
    0,
    [("F", 1.0), ("I", 0.0), ("F", 1.0), ("I", 0.0), ("W", 2.0), ("W", 2.0)],
    forward=2.0,
    backward=4.0,
)
R1S = _result(
    1,
    [("F", 1.0), ("I", 1.0), ("W", 0.5), ("F", 1.0), ("I", 1.0), ("W", 0.5)],
    forward=2.0,
    backward=3.0,
)


def test_split_times_average_every_i_and_w() -> None:
    inp, wgt = measured_split_times([R0, R1], 2)
    assert inp == [0.0, 1.0] and wgt == pytest.approx([2.3, 0.7])
    plain = _result(0, [("F", 1.0), ("B", 2.0)])
    assert measured_split_times([plain], 1) is None


def test_calibrator_splits_the_measured_backward_by_the_recorded_shares() -> None:
    ev = Evaluator(LOCAL, schedule="lookahead-zb")
    plan = ev.make_plan(Candidate(2, 8, 128, (1,), ("none",), "lookahead-zb"))
    assert plan is not None and plan.num_microbatches == 2
    cal = Calibrator(LOCAL, fixed_plan=True, predicted_s=1.0)
    out = cal.observe(0, plan, [R0S, R1S])
    c = cal.costs
    assert c is not None and out.event is not None
    # per micro-batch backward from the breakdowns, split 0 : 1 and 1 : 0.5
    assert c.bwd_s == pytest.approx((2.0, 1.5))
    assert c.inp_s == pytest.approx((0.0, 1.0)) and c.wgt_s == pytest.approx((2.0, 0.5))
    assert out.event["input_s"] == pytest.approx([0.0, 1.0])
    # a later step without a timeline keeps the shares on its own backward times
    later = [_result(0, [], forward=2.0, backward=8.0), _result(1, [], forward=2.0, backward=6.0)]
    for r in later:
        r.step = 1
    cal.observe(1, plan, later)
    assert cal.costs.inp_s[1] / cal.costs.bwd_s[1] == pytest.approx(2 / 3)
    assert cal.costs.inp_s[0] == 0.0
