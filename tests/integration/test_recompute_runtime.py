"""Activation recompute in the runtime (real Ray, DeepSpeed, torch; two emulated sites):
``training.recompute`` reaches every stage actor's module, the losses equal a run without it
bitwise (<= 1e-6 asserted), with 1F1B over ZeRO-1 replicas in bf16, and the activation
meters of both stages see less held. ZB-H1's split backward (I then W) with recompute is
tests/integration/test_runtime.py's
(``test_recompute_under_split_backward_gives_the_losses_of_no_recompute``): its run without
recompute is also that module's split-backward parity run, so it is launched once there."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_runtime import tiny_doc

from geopipe.config import parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def _run(doc: dict, tmp: Path) -> tuple[list[float], list[int]]:
    """Per-step losses and, per stage, the most bytes its activation meter saw held."""
    ctl = Controller(parse_cluster(doc, "test"), LaunchOptions(run_dir=str(tmp), progress=False))
    try:
        ctl.launch()
        assert ctl.plan.num_stages == 2 and ctl.plan.schedule == doc["plan"]["schedule"]
        res = ctl.train()
    finally:
        ctl.close()
    held: dict[int, int] = {}
    for step in res.steps:
        for k, b in enumerate(step.peak_activation_bytes):
            held[k] = max(held.get(k, 0), b)
    return [m.loss for m in res.steps], [held[k] for k in sorted(held)]


CASES = {
    # schedule, devices per site (= pipelines: a ZeRO-1 group of that many per stage), precision
    "1f1b-zero1-bf16": ("1f1b", 2, "bf16"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recompute_gives_the_losses_of_no_recompute(tmp_path: Path, case: str) -> None:
    schedule, devices, precision = CASES[case]
    out = {}
    for recompute in ("none", "full"):
        doc = tiny_doc(devices, devices)
        doc["name"] = f"rc-{case}-{recompute}"
        doc["training"].update(precision=precision, recompute=recompute)
        doc["plan"].update(schedule=schedule, delta_n=0)
        out[recompute] = _run(doc, tmp_path / recompute)
    (base, base_held), (again, again_held) = out["none"], out["full"]
    assert len(base) == 3 and base[0] > base[-1]  # it trains
    assert again == pytest.approx(base, abs=1e-6, rel=0)
    # Measured: bitwise equal (the same kernels on the same inputs).
    assert again == base
    # The meter counts what autograd saves; a checkpointed block saves nothing in its
    # forward, so both stages (each holds one of the two blocks) hold less under 1F1B.
    assert again_held[0] < base_held[0], (again_held, base_held)
    assert again_held[1] < base_held[1], (again_held, base_held)
