"""Per-step figures from the replicas' results (pure: no Ray)."""

from __future__ import annotations

import pytest

from geopipe.runtime.executor import IterationResult
from geopipe.runtime.metrics import aggregate


def result(stage: int, replica: int, busy: float, duration: float, losses=(), **parts):
    return IterationResult(
        stage=stage, replica=replica, step=3, losses=list(losses), busy_s=busy, wait_s=0.0,
        duration_s=duration, start=0.0, wan_bytes=10, micro_batches=2, optimizer_steps=1,
        breakdown=parts, peak_activation_bytes=100 * (stage + 1) + replica,
    )  # fmt: skip


def test_aggregate_means_replicas_per_stage_and_keeps_stage_order():
    results = [
        result(1, 0, 0.6, 1.0, losses=(2.0, 4.0), forward=0.2, optimizer=0.1),
        result(0, 0, 0.4, 0.9, forward=0.3, optimizer=0.2),
        result(0, 1, 0.2, 0.8, forward=0.1, optimizer=0.0),
    ]
    m = aggregate(results, num_stages=2, tokens=100)
    assert m.step == 3 and m.loss == 3.0 and m.iteration_time_s == 1.0
    assert m.bubble_ratio == pytest.approx(1 - (0.3 + 0.6) / 2.0)
    assert m.wan_bytes == 30 and m.tokens_per_s == 100.0
    assert m.breakdown == [
        pytest.approx({"forward": 0.2, "optimizer": 0.1}),
        pytest.approx({"forward": 0.2, "optimizer": 0.1}),
    ]
    assert m.to_json()["breakdown"][0] == {"forward": 0.2, "optimizer": 0.1}
    # the most any replica of the stage held, in stage order
    assert m.peak_activation_bytes == [101, 200]
    assert m.to_json()["peak_activation_bytes"] == [101, 200]
