"""Measured stage times from recorded events, with and without a split backward (pure)."""

from __future__ import annotations

import pytest

from geopipe.runtime.calibration import measured_split_times, measured_stage_times
from geopipe.runtime.executor import IterationResult


def _result(stage: int, events: list[tuple[str, float]]) -> IterationResult:
    t, evs = 0.0, []
    for i, (kind, d) in enumerate(events):
        evs.append((kind, i, t, t + d))
        t += d
    return IterationResult(
        stage=stage, replica=0, step=0, losses=[], busy_s=t, wait_s=0.0, duration_s=t,
        start=0.0, wan_bytes=0, micro_batches=2, optimizer_steps=1, events=evs,
    )  # fmt: skip


def test_full_backward_times_and_step_excess() -> None:
    r = _result(0, [("F", 1.0), ("F", 3.0), ("B", 2.0), ("B", 4.5)])
    fwd, bwd, extra = measured_stage_times([r], 1)
    assert fwd == [2.0] and bwd == [2.0] and extra == [2.5]
    assert measured_split_times([r], 1) is None


def test_split_backward_is_i_plus_w_and_the_last_w_carries_the_step() -> None:
    # stage 0: I ~0 (first stage), W the whole backward; stage 1: I 1.0, W 0.5 / 0.7 + step
    r0 = _result(0, [("F", 1.0), ("I", 0.0), ("F", 1.0), ("I", 0.0), ("W", 2.0), ("W", 2.6)])
    r1 = _result(1, [("F", 1.0), ("I", 1.0), ("W", 0.5), ("F", 1.0), ("I", 1.0), ("W", 0.9)])
    fwd, bwd, extra = measured_stage_times([r0, r1], 2)
    assert fwd == [1.0, 1.0]
    assert bwd == pytest.approx([2.0, 1.5])
    assert extra == pytest.approx([0.6, 0.4])
    inp, wgt = measured_split_times([r0, r1], 2)
    assert inp == [0.0, 1.0] and wgt == pytest.approx([2.0, 0.5])
