"""The planner on split-backward schedules: memory-derived in-flight caps, memory that counts
deferred weight gradients, the ΔN search for ``lookahead-zb`` (checked exhaustively), the
calibration-time ΔN refinement, and the command line. Pure: no Ray."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from geopipe.cli import main
from geopipe.config import ClusterSpec, load_cluster
from geopipe.optimizer.evaluate import Candidate, Evaluator, plan_schedule
from geopipe.optimizer.memory import inflight_caps, stage_memory
from geopipe.optimizer.planner import plan_cluster
from geopipe.optimizer.refine import measured_costs, predict, refine_delta_n
from geopipe.optimizer.simulator import PipelineCosts, simulate
from geopipe.pipeline.schedule import lookahead, lookahead_zb
from geopipe.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
LOCAL_PATH = ROOT / "clusters" / "local-2dc.yaml"
LOCAL = load_cluster(LOCAL_PATH)
GiB = float(1 << 30)


def _with_memory(spec: ClusterSpec, gb: float) -> ClusterSpec:
    sites = [s.model_copy(update={"device_memory_gb": gb}) for s in spec.sites]
    return spec.model_copy(update={"sites": sites})


# 13 MiB-class devices: look-ahead's ΔN is capped by memory on the demo (see below).
TIGHT = _with_memory(LOCAL, 0.013)


def _mem(spec: ClusterSpec, plan: Plan, k: int, in_flight: float) -> float:
    return stage_memory(
        spec.model,
        spec.training.precision,
        plan.partition[k],
        plan.pipelines,
        plan.micro_batch_size,
        plan.seq_len,
        in_flight,
    ).total


@pytest.mark.parametrize("gb", [0.011, 0.013, 0.05, 2.0])
def test_inflight_caps_are_the_most_that_fit(gb: float) -> None:
    spec = _with_memory(LOCAL, gb)
    ev = Evaluator(spec, schedule="lookahead-zb")
    for b in (1, 2, 8):
        plan = ev.make_plan(Candidate(2, b, 128, (2,), ("int8",), "lookahead-zb"))
        assert plan is not None
        caps = inflight_caps(spec, plan)
        assert plan.inflight_caps == tuple(caps)
        for k, cap in enumerate(caps):
            if cap > 0:
                assert _mem(spec, plan, k, cap) <= gb * GiB
            assert _mem(spec, plan, k, cap + 1) > gb * GiB


def test_memory_counts_deferred_weight_gradients() -> None:
    ev = Evaluator(LOCAL, schedule="lookahead-zb")
    e = ev.evaluate(Candidate(2, 2, 128, (3,), ("none",), "lookahead-zb"))
    assert e.feasible and e.plan is not None
    sched = plan_schedule(e.plan)
    # the last stage defers W up to the first stage's peak: it holds that many micro-batches
    # though only one is between its F and its I at any time
    assert sched.max_in_flight[1] == sched.max_in_flight[0] > 1
    assert sched.hold_points[1] == ((1, sched.max_in_flight[1] - 1),)
    for k in range(2):
        assert e.memory[k].total == pytest.approx(_mem(LOCAL, e.plan, k, sched.max_in_flight[k]))


def test_lookahead_zb_beats_the_best_lookahead_when_memory_caps_delta_n() -> None:
    la = plan_cluster(TIGHT, exhaustive=True, schedule="lookahead")
    zb = plan_cluster(TIGHT, exhaustive=True, schedule="lookahead-zb")
    assert la.best.feasible and zb.best.feasible
    assert zb.best.plan.schedule == "lookahead-zb"
    # the GA found the exhaustive optimum of each space
    assert zb.exhaustive.best.fitness == pytest.approx(zb.best.fitness, rel=1e-9)
    assert la.exhaustive.best.fitness == pytest.approx(la.best.fitness, rel=1e-9)
    # memory keeps look-ahead's ΔN low (a larger one does not fit) ...
    lim = TIGHT.sites[0].device_memory_gb * GiB
    bigger = Evaluator(TIGHT, schedule="lookahead").evaluate(
        replace(la.best.candidate, delta_n=(la.best.candidate.delta_n[0] + 1,))
    )
    assert not bigger.feasible and max(bigger.peak_memory_bytes) > lim
    # ... and the split backward is faster within the same memory
    assert zb.best.iteration_time_s < la.best.iteration_time_s
    assert max(zb.best.peak_memory_bytes) <= lim
    assert set(zb.baselines) == {"1f1b", "gpipe", "lookahead", "zb-h1"}
    assert zb.baselines["lookahead"].candidate.delta_n == zb.best.candidate.delta_n


def test_split_with_w_right_after_i_is_never_slower_than_lookahead() -> None:
    # Caps of 1 leave no room to defer: each B becomes I, SEND_B, W with I + W = B, so every
    # event happens no later and the gradient leaves earlier.
    rng = random.Random(5)
    for _ in range(200):
        p, m = rng.randint(1, 5), rng.randint(1, 10)
        nb = p - 1
        fwd = tuple(rng.uniform(0.01, 2) for _ in range(p))
        bwd = tuple(rng.uniform(0.01, 4) for _ in range(p))
        shares = [0.0] + [rng.uniform(0.1, 0.9) for _ in range(p - 1)]  # I + W = B exactly
        parts = [(x * b, (1 - x) * b) for x, b in zip(shares, bwd, strict=True)]
        c = PipelineCosts(
            fwd,
            bwd,
            (0.0,) * p,
            *(tuple(rng.uniform(0, 5) for _ in range(nb)) for _ in range(4)),
            tuple(i for i, _ in parts),
            tuple(w for _, w in parts),
        )
        dn = [rng.choice([0, 1, 2, 5]) for _ in range(nb)]
        la = simulate(lookahead(p, m, dn), c).iteration_time_s
        zb = simulate(lookahead_zb(p, m, dn, [1] * p), c).iteration_time_s
        assert zb <= la * (1 + 1e-12)


def test_refine_delta_n_for_lookahead_zb_keeps_caps_and_fits() -> None:
    ev = Evaluator(TIGHT, schedule="lookahead-zb")
    plan = ev.make_plan(Candidate(2, 1, 128, (0,), ("int8",), "lookahead-zb"))
    assert plan is not None
    base = ev.costs(plan)
    measured = measured_costs(TIGHT, plan, list(base.fwd_s), list(base.bwd_s))
    assert measured.inp_s == base.inp_s and measured.wgt_s == base.wgt_s
    assert measured.inp_s[0] == 0.0  # the first stage's whole backward is W
    new, t = refine_delta_n(TIGHT, plan, measured, list(range(0, 9)))
    assert new.inflight_caps == plan.inflight_caps
    assert new.delta_n[0] > 0
    assert t == pytest.approx(predict(new, measured)) and t < predict(plan, measured)
    fits = Evaluator(TIGHT, schedule="lookahead-zb").evaluate(
        Candidate(2, 1, 128, (new.delta_n[0],), ("int8",), "lookahead-zb")
    )
    assert fits.feasible
    too_far = Evaluator(TIGHT, schedule="lookahead-zb").evaluate(
        Candidate(2, 1, 128, (new.delta_n[0] + 1,), ("int8",), "lookahead-zb")
    )
    assert not too_far.feasible or predict(too_far.plan, measured) >= t * (1 - 1e-9)
    # measured I/W override the nominal split
    split = measured_costs(
        TIGHT, plan, list(base.fwd_s), list(base.bwd_s), split_s=([0, 1], [2, 3])
    )
    assert split.inp_s == (0, 1) and split.wgt_s == (2, 3)


def test_plan_from_an_older_dict_has_no_caps() -> None:
    plan = Evaluator(LOCAL).make_plan(Candidate(2, 1, 128, (1,), ("none",)))
    assert plan is not None
    d = plan.to_dict()
    assert d["inflight_caps"] == ()
    del d["inflight_caps"]
    assert Plan.from_dict(d) == plan
    zb = Evaluator(LOCAL, "lookahead-zb").make_plan(
        Candidate(2, 1, 128, (1,), ("none",), "lookahead-zb")
    )
    assert zb is not None and Plan.from_dict(json.loads(zb.to_json())) == zb


def test_simulate_command_runs_the_split_schedules(capsys) -> None:
    common = ["--micro-batch-size", "1", "--seq-len", "128", "--pipelines", "2", "--json"]
    out = {}
    for name in ("lookahead", "lookahead-zb", "zb-h1", "1f1b"):
        assert (
            main(["simulate", str(LOCAL_PATH), "--schedule", name, "--delta-n", "2", *common]) == 0
        )
        out[name] = json.loads(capsys.readouterr().out)
    assert out["lookahead-zb"]["schedule"] == "lookahead-zb"
    assert out["lookahead-zb"]["delta_n"] == [2]
    assert out["lookahead-zb"]["iteration_time_s"] < out["lookahead"]["iteration_time_s"]
    assert out["zb-h1"]["iteration_time_s"] < out["1f1b"]["iteration_time_s"]
