"""The precision refusals made before any actor starts (runtime.control.cluster)."""

from __future__ import annotations

import pytest

from geopipe.runtime.control.cluster import LaunchError, check_precision


def test_fp16_needs_gpus() -> None:
    with pytest.raises(LaunchError, match=r"training\.precision: fp16 needs GPUs"):
        check_precision("fp16", use_gpu=False)


@pytest.mark.parametrize("stages", [2, 8])
def test_fp16_is_refused_across_stages(stages: int) -> None:
    """Each stage's DeepSpeed loss scaler is its own: fp16 across stages would be wrong."""
    with pytest.raises(LaunchError, match=rf"fp16 runs on one-stage .* {stages} stages"):
        check_precision("fp16", use_gpu=True, stages=stages)


@pytest.mark.parametrize(
    ("precision", "gpu", "stages"),
    [("fp16", True, 1), ("bf16", False, 4), ("bf16", True, 4), ("fp32", False, 3)],
)
def test_what_runs_is_accepted(precision: str, gpu: bool, stages: int) -> None:
    check_precision(precision, use_gpu=gpu, stages=stages)  # no exception
