"""Per-step figures from the replicas' results (pure: no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from geopipe.runtime.actor.executor import IterationResult
from geopipe.runtime.control.metrics import aggregate


def result(stage: int, replica: int, busy: float, duration: float, losses=(), **parts):
    return IterationResult(
        stage=stage,
        replica=replica,
        step=3,
        losses=list(losses),
        busy_s=busy,
        wait_s=0.0,
        duration_s=duration,
        start=0.0,
        wan_bytes=10,
        micro_batches=2,
        optimizer_steps=1,
        breakdown=parts,
        peak_activation_bytes=100 * (stage + 1) + replica,
    )


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


def test_tensorboard_gets_every_step_scalar(tmp_path) -> None:
    """The metrics sink writes TensorBoard event files that TensorBoard's own reader parses:
    each scalar at each step, the values written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from geopipe.runtime.control.metrics import TENSORBOARD_SCALARS, MetricsSink, StepMetrics

    sink = MetricsSink(tmp_path / "m.jsonl", "r", use_ray=False, tensorboard=tmp_path / "tb")
    for step in range(3):
        m = StepMetrics(
            step=step,
            loss=5.0 - step,
            iteration_time_s=0.5,
            tokens=100,
            bubble_ratio=0.25,
            wan_bytes=1000 * (step + 1),
            tokens_per_s=200.0,
            lr=1e-3 * (step + 1),
            grad_norm=2.0 + step,
        )
        sink.write(m, {"predicted_iteration_time_s": 0.4})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {f"train/{k}" for k in TENSORBOARD_SCALARS}
    loss = acc.Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(0, 5.0), (1, 4.0), (2, 3.0)]
    assert [e.value for e in acc.Scalars("train/wan_bytes")] == [1000, 2000, 3000]
    assert [e.value for e in acc.Scalars("train/grad_norm")] == [2.0, 3.0, 4.0]


def test_the_control_plane_speaks_through_one_function(capsys) -> None:
    """Every console line of the driver goes through ``say`` (the reporter's): one prefix,
    warnings marked, a leading newline kept ahead of the prefix (after a ^C)."""
    from geopipe.runtime.control.reporting import Reporter

    rep = Reporter("r", Path("/nonexistent"), 1)
    rep.say("step 3 failed")
    rep.say("disk full", warning=True)
    rep.say("\nfinishing the step in flight")
    assert capsys.readouterr().err.splitlines() == [
        "geopipe: step 3 failed",
        "geopipe: warning: disk full",
        "",
        "geopipe: finishing the step in flight",
    ]
