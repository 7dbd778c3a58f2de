"""Calibration's arithmetic on recorded step results (no Ray): stage times from the step
breakdowns, the transport's excess over the simulator's FIFO link from stamped messages
(across clocks), and a Calibrator that predicts a run the simulator itself produced."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from geopipe.config import parse_cluster
from geopipe.optimizer.measurements import costed
from geopipe.optimizer.refine import measured_costs, predict
from geopipe.optimizer.simulator import simulate
from geopipe.pipeline.schedule import make_schedule
from geopipe.plan import Plan
from geopipe.runtime.actor.executor import IterationResult
from geopipe.runtime.control.calibration import (
    Calibrator,
    boundary_offsets,
    fifo_excess,
    measured_stage_times,
    profile_machine,
    searched_codecs,
    with_real_transport,
)
from geopipe.runtime.control.linkprobe import LinkMeasurement

M = 8


def _spec():
    doc = yaml.safe_load(Path("clusters/local-2dc.yaml").read_text())
    for s in doc["sites"]:
        s["devices_per_node"] = 1
    doc["training"]["global_batch_size"] = M
    doc["plan"].update(pipelines=1, micro_batch_size=1, delta_n={"min": 0, "max": 8})
    return parse_cluster(doc, "t")


def _plan(schedule: str = "lookahead", delta_n: int = 0) -> Plan:
    return Plan(
        pipelines=1,
        stage_sites=("east", "west"),
        partition=((0, 3), (3, 6)),
        micro_batch_size=1,
        seq_len=128,
        num_microbatches=M,
        schedule=schedule,
        delta_n=(delta_n,),
        codecs=("none",),
    )


def _result(stage: int, fwd: float, bwd: float, end: float, send: float = 0.0, **kw):
    bd = {
        "forward": fwd * M,
        "backward": bwd * M,
        "optimizer": end,
        "send": send,
        "snapshot": 0.0,
        "other": 0.0,
    }
    return IterationResult(
        stage=stage,
        replica=0,
        step=0,
        losses=[],
        busy_s=0.0,
        wait_s=0.0,
        duration_s=1.0,
        start=0.0,
        wan_bytes=0,
        micro_batches=M,
        optimizer_steps=1,
        breakdown=bd,
        **kw,
    )


def test_stage_times_come_from_the_breakdown_with_sends_folded_in():
    rs = [_result(0, 0.01, 0.02, 0.005, send=0.008), _result(1, 0.03, 0.04, 0.006, send=0.016)]
    f, b, end = measured_stage_times(rs, 2)
    # Stage 0 sends activations (after forwards), stage 1 gradients (after backwards).
    assert f == pytest.approx([0.01 + 0.001, 0.03])
    assert b == pytest.approx([0.02, 0.04 + 0.002])
    assert end == pytest.approx([0.005, 0.006])


def test_fifo_excess_is_zero_for_a_link_that_behaves_like_the_model():
    ser, lat = 0.005, 0.040
    sent = [0.0, 0.001, 0.020]
    # FIFO: the second message waits for the first; the third finds the link free.
    usable = [0.045, 0.050, 0.065]
    assert fifo_excess(list(zip(sent, usable, strict=True)), ser, lat) == pytest.approx([0] * 3)
    late = [u + 0.003 for u in usable]
    assert fifo_excess(list(zip(sent, late, strict=True)), ser, lat) == pytest.approx([0.003] * 3)


def test_real_transport_turns_stamps_across_clocks_into_link_latency():
    spec, plan = _spec(), _plan()
    costs = measured_costs(spec, plan, [0.01, 0.01], [0.02, 0.02], [0.0, 0.0])
    ser_f, ser_b = costs.ser_f[0], costs.ser_b[0]
    off, true_lat = 100.0, costs.lat_f[0] + 0.004  # west's clock is 100 s ahead
    # Activations: sent on east's clock, usable on west's; gradients the other way.
    fwd = [(mb, 0.1 * mb, 0.1 * mb + off + ser_f + true_lat) for mb in range(M)]
    bwd = [(mb, off + 0.1 * mb, 0.1 * mb + ser_b + true_lat) for mb in range(M)]
    rs = [
        _result(1, 0.01, 0.02, 0.0, transport_stamps={"F": fwd, "B": []}),
        _result(0, 0.01, 0.02, 0.0, transport_stamps={"F": [], "B": bwd}),
    ]
    links = [LinkMeasurement("east", "west", 0.08, 2e8, 0.04, 2e8, clock_offset_s=off)]
    offsets = boundary_offsets(plan, links)
    assert offsets == {0: off}
    got = with_real_transport(costs, rs, plan, offsets)
    assert got.lat_f[0] == pytest.approx(true_lat) and got.lat_b[0] == pytest.approx(true_lat)
    # Without a clock offset the stamps cannot be read: the probe's latency stays.
    assert with_real_transport(costs, rs, plan, {}).lat_f == costs.lat_f


def test_calibrator_predicts_what_the_simulator_ran():
    """Measurements taken from a simulated run of the plan: the calibrated prediction is
    that run's time, and ΔN is chosen (first steps) to hide the round trip."""
    spec = _spec()
    plan = _plan("lookahead", 0)
    truth = measured_costs(spec, plan, [0.010, 0.012], [0.020, 0.022], [0.004, 0.005])
    cal = Calibrator(spec, fixed_plan=False, predicted_s=1.0)
    for step in range(4):
        rs = [_result(k, truth.fwd_s[k], truth.bwd_s[k], truth.step_s[k]) for k in range(2)]
        out = cal.observe(step, plan, rs)
        plan = out.plan
        want = simulate(make_schedule(plan.schedule, 2, M, plan.delta_n), truth)
        assert out.predicted_s == pytest.approx(want.iteration_time_s)
        assert (out.event is not None) == (step < 3)  # events for the first steps only
    assert plan.delta_n[0] > 0  # the 25 ms link needs a look-ahead
    slower = replace(truth, lat_f=(truth.lat_f[0] * 1.25,), lat_b=(truth.lat_b[0] * 1.25,))
    assert predict(plan, slower) <= predict(replace(plan, delta_n=(0,)), slower)


def test_launch_profile_measures_each_searched_codec_and_keeps_the_yaml_s():
    """The codecs the search may choose (both directions of every listed setting) are timed
    on this machine and priced by the planner; a speed the YAML gives for a site stands."""
    doc = yaml.safe_load(Path("clusters/local-2dc.yaml").read_text())
    doc["plan"]["codecs"] = ["none", "int4h/int8"]
    doc["sites"][1]["codec_gb_per_s"] = {"int8": 123.0}
    spec = parse_cluster(doc, "t")
    assert searched_codecs(spec) == ["int4h", "int8"]
    measured = profile_machine(spec, 1, 64)
    got = costed(spec, measured)
    assert spec.sites[0].codec_gb_per_s == {}  # the spec as loaded is never patched
    east, west = (s.codec_gb_per_s for s in got.sites)
    assert set(east) == {"int4h", "int8"} and all(0 < v < 100 for v in east.values())
    assert west == {"int4h": east["int4h"], "int8": 123.0}
    # int8 is a round and a scale per row, int4h a rotation and packing per 64-group
    assert east["int8"] > east["int4h"]
