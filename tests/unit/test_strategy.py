"""The strategy planner: groupings of the sites, batch shares, the price of an outer round
against a hand computation, the outer state in the memory model, and the choice between
the pipeline across sites and the outer loop (geopipe.optimizer.strategy, .outer_cost)."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import fields, replace
from typing import Any

import pytest

from geopipe.config import ClusterSpec, ConfigError, OuterSetting, parse_cluster
from geopipe.model.sizes import param_totals, stage_param_count
from geopipe.optimizer.evaluate import plan_peak_memory
from geopipe.optimizer.grouplayout import plan_like, with_partition
from geopipe.optimizer.groups import balanced_shares, group_spec, site_groupings
from geopipe.optimizer.memory import outer_state_bytes_per_param, stage_memory
from geopipe.optimizer.outer_cost import (
    CALL_OVERHEAD_S,
    DELTA_ROW_LEN,
    OUTER_CALLS_PER_FRAGMENT,
    block_bytes,
    price_round,
    ring_hops,
    span_cap,
    steps_per_call,
)
from geopipe.optimizer.outerplan import outer_run, unlaunchable
from geopipe.optimizer.penalty import PenaltyModel, parse_table
from geopipe.optimizer.planner import plan_cluster
from geopipe.optimizer.shapes import build_plan
from geopipe.optimizer.strategy import as_pipeline, plan_strategy
from geopipe.plan import PipelineLayout, Plan

MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 256, "max_seq_len": 128}


def _site(name: str, tflops: float = 0.05) -> dict:
    return {
        "name": name,
        "nodes": 1,
        "devices_per_node": 1,
        "device_memory_gb": 2,
        "device_tflops": tflops,
        "device_efficiency": 0.5,
        "device_mem_bw_gb_per_s": 10,
        "intra_bandwidth_gbps": 20,
    }


def _doc(sites: list[dict], links: list[dict], **plan: Any) -> dict:
    return {
        "name": "t",
        "sites": sites,
        "links": links,
        "model": dict(MODEL),
        "training": {
            "global_batch_size": 8,
            "steps": 100,
            "lr": 0.001,
            "checkpoint": {"every_steps": 0},
        },
        "plan": {
            "micro_batch_size": 1,
            "seq_len": 128,
            "delta_n": {"min": 0, "max": 8},
            "ga": {"population": 8, "generations": 2},
            **plan,
        },
    }


def _two_sites(gbps: float = 0.1, **plan: Any) -> ClusterSpec:
    link = {"from": "a", "to": "b", "bandwidth_gbps": gbps, "latency_ms": 10}
    return parse_cluster(_doc([_site("a"), _site("b", 0.025)], [link], **plan))


def _table(rows: list[tuple], codec: str = "none") -> PenaltyModel:
    """A table of ``(M, H, gap)`` rows, or ``(M, H, gap, seed)``."""
    listed = [
        {"replicas": r[0], "h": r[1], "fragments": 1, "codec": codec, "rel_gap": r[2]}
        | ({"seed": r[3]} if len(r) > 3 else {})
        for r in rows
    ]
    doc = {
        "source": "test",
        "model": "toy",
        "steps": 10,
        "tokens_per_step": 8,
        "sync_noise": 0.0,
        "rows": listed,
    }
    return PenaltyModel(parse_table(doc), "test.json")


def test_groupings_are_contiguous_runs_for_every_m_dividing_the_batch() -> None:
    order = ["a", "b", "c", "d", "e"]
    got = site_groupings(order, 4)  # M = 2 and 4 divide the batch; 3 and 5 do not
    assert (("a", "b", "c"), ("d", "e")) in got and (("a", "b"), ("c", "d", "e")) in got
    assert (("a", "b"), ("c",), ("d",), ("e",)) in got
    assert all(len(g) in (2, 4) for g in got)
    assert all([s for run in g for s in run] == order for g in got)
    assert site_groupings(order, 5) == [tuple((s,) for s in order)]  # one group per site


def test_balanced_shares_follow_speed_in_grains_and_sum_to_the_batch() -> None:
    assert balanced_shares(64, [3.0, 1.0], [1, 1]) == (48, 16)
    assert balanced_shares(64, [3.0, 1.0], [8, 8]) == (48, 16)
    shares = balanced_shares(512, [396.0, 140.0, 396.0, 140.0], [4, 4, 4, 2])
    assert sum(shares) == 512 and shares[0] > 2.5 * shares[1]
    assert all(s % g == 0 for s, g in zip(shares, [4, 4, 4, 2], strict=True))
    assert balanced_shares(10, [1.0, 1.0], [4, 4]) is None  # grains of 4 cannot make 10


def test_the_round_matches_a_hand_computation() -> None:
    spec = _two_sites(gbps=0.05, strategy="outer", outer={"h": 8, "fragments": 2, "overlap": 1})
    groups = (("a",), ("b",))
    evals = [plan_cluster(group_spec(spec, g, 4)).best for g in groups]
    assert all(e.feasible and e.plan.pipelines == 1 and e.plan.num_stages == 1 for e in evals)
    s = OuterSetting(h=8, fragments=2, overlap=1, codec="none")
    cost = price_round(spec, groups, evals, s)
    params = param_totals(spec.model)[0]
    # One fragment: half the parameters, as rows of 256 fp32 values.
    elems = math.ceil(math.ceil(params / 2) / DELTA_ROW_LEN) * DELTA_ROW_LEN
    assert block_bytes(spec, evals[0].plan, s) == elems * 4
    exchange = 0.010 + elems * 4 * 8 / 0.05e9  # M = 2: one ring step over the one link
    t_a, t_b = (e.iteration_time_s for e in evals)
    assert t_b > 1.5 * t_a  # b's device is half as fast: it sets the pace
    assert cost.step_s == t_b and cost.exchange_s == pytest.approx(exchange)
    exposed = 2 * (exchange - 1 * t_b)
    assert 0 < exposed < 2 * exchange  # partly hidden behind the overlapped step
    assert cost.exposed_s == pytest.approx(exposed)
    assert cost.codec_s == 0.0  # codec none
    outer = params * (40 + 4 * 2) / 10e9  # elementwise over the fp32 master, one device
    assert cost.outer_step_s == pytest.approx(outer)
    # The driver's calls: one per span of SPAN_S seconds of steps (up to a checkpoint), the
    # applies inside them, each span ending at one (every H / F = 4 steps); emulated links:
    # no round trip, the nominal overhead.
    per_call = steps_per_call(spec.training.checkpoint.every_steps, cap=span_cap(t_b), period=4)
    assert per_call > 8  # longer than a round
    control = (8 / per_call + 2 * OUTER_CALLS_PER_FRAGMENT) * (0.0 + CALL_OVERHEAD_S)
    assert cost.control_s == pytest.approx(control)
    round_s = 8 * t_b + exposed + outer + control
    assert cost.round_s == pytest.approx(round_s)
    assert cost.tokens == 8 * 2 * 4 * 128
    busy = sum(8 * (1 - e.bubble_ratio) * e.iteration_time_s for e in evals)
    assert cost.device_utilization == pytest.approx(busy / (2 * round_s))
    assert cost.bound == "waiting for the slowest group"


def test_int8_blocks_carry_one_scale_per_row() -> None:
    spec = _two_sites()
    e = plan_cluster(group_spec(spec, ("a",), 4)).best
    n = math.ceil(math.ceil(param_totals(spec.model)[0] / 4) / DELTA_ROW_LEN) * DELTA_ROW_LEN
    assert block_bytes(spec, e.plan, OuterSetting(4, 4, 0, "int8")) == n + n // DELTA_ROW_LEN * 4


def test_the_planners_row_length_is_the_runtimes() -> None:
    from geopipe.outer.exchange import ROW_LEN  # imports torch: the planner must not

    assert ROW_LEN == DELTA_ROW_LEN


def test_a_ring_without_a_closing_link_routes_back_along_the_chain() -> None:
    links = [
        {"from": "a", "to": "b", "bandwidth_gbps": 1, "latency_ms": 5},
        {"from": "b", "to": "c", "bandwidth_gbps": 2, "latency_ms": 7},
    ]
    spec = parse_cluster(_doc([_site("a"), _site("b"), _site("c")], links))
    hops = ring_hops(spec, [("a",), ("b",), ("c",)])
    assert [(h.src, h.dst, h.routed) for h in hops] == [
        ("a", "b", False),
        ("b", "c", False),
        ("c", "a", True),
    ]
    assert hops[2].latency_s == pytest.approx(0.012) and hops[2].bandwidth_bps == 1e9


def test_a_group_holds_the_outer_state_on_the_host_not_on_its_devices() -> None:
    """The outer state is host RAM ([Note: the outer state lives on the host]): its size per
    parameter is still counted, but a group's device peaks equal the same pipeline's."""
    spec = _two_sites(strategy="auto", outer={"fragments": [1, 2], "codec": ["int8", "topk"]})
    assert outer_state_bytes_per_param(spec) == 0.0  # not a group's spec
    group = group_spec(spec, ("a", "b"), 4)
    assert outer_state_bytes_per_param(group) == 8 + 4 + 8 / 1  # theta + momentum, EF, F = 1
    mem = stage_memory(spec.model, "fp32", (1, 3), 4, 1, 16, 1, outer_per_param=20.0)
    assert mem.outer_state == stage_param_count(spec.model, (1, 3)) * 20.0 / 4
    plan = plan_cluster(group).best.plan
    with_outer = plan_peak_memory(group, plan)
    without = plan_peak_memory(as_pipeline(group), plan)
    assert [x.total for x in with_outer] == [y.total for y in without]
    assert all(x.outer_state == 0.0 for x in with_outer)


def _strategy(spec: ClusterSpec, penalty: PenaltyModel) -> Any:
    return plan_strategy(spec, plan_cluster(as_pipeline(spec)), penalty, source="t.yaml")


def test_auto_takes_the_outer_loop_when_it_wins_after_its_penalty() -> None:
    spec = _two_sites(gbps=0.01, strategy="auto", outer={"h": [10, 20, 40]})
    report = _strategy(spec, _table([(2, 10, 0.01), (2, 20, 0.02)]))
    c = report.chosen
    assert c.kind == "outer" and c.setting.h in (10, 20) and c.replicas == 2
    pipe = report.candidates[0]
    assert pipe.kind == "pipeline" and c.score < pipe.score
    assert c.effective_tokens_per_s == pytest.approx(c.tokens_per_s / (1 + c.penalty.value))
    h40 = next(x for x in report.candidates if x.setting and x.setting.h == 40)
    assert not h40.penalty.priced and "beyond the largest H measured" in h40.reason
    assert "assumed loss penalty" in report.why and report.chosen.device_utilization > 0
    doc = report.to_json()
    assert doc["chosen"]["device_utilization"] == c.device_utilization
    assert doc["chosen"]["group_plans"][0]["sites"] == ["a"]
    assert {x["kind"] for x in doc["candidates"]} == {"pipeline", "outer"}


def test_a_tie_goes_to_the_synchronous_pipeline() -> None:
    spec = _two_sites(gbps=0.01, strategy="auto", outer={"h": [10, 20]}, min_gain={"outer": 1.0})
    report = _strategy(spec, _table([(2, 10, 0.01), (2, 20, 0.02)]))
    best_outer = min((c for c in report.candidates[1:]), key=lambda c: c.score)
    assert best_outer.score < report.candidates[0].score  # faster, but not 2x
    assert report.chosen.kind == "pipeline" and "tie goes to the synchronous" in report.why


def test_overlaps_that_hide_the_whole_transfer_tie_and_the_larger_is_kept() -> None:
    """[Note: an overlap with slack]: the table prices overlaps up to 4 alike and a fast
    link's transfer hides behind one step, so overlaps 1-4 score the same; the planner keeps
    4, which hides a transfer that runs longer than the link model says."""
    row = {"replicas": 2, "h": 20, "fragments": 1, "codec": "none", "rel_gap": 0.01}
    doc = {"source": "t", "model": "t", "steps": 10, "tokens_per_step": 8, "sync_noise": 0.0}
    table = PenaltyModel(parse_table({**doc, "rows": [{**row, "overlap": 4}]}), "t.json")

    def chosen(overlap: Any) -> Any:
        spec = _two_sites(gbps=10, strategy="outer", outer={"h": 20, "overlap": overlap})
        return _strategy(spec, table).chosen

    one, four = chosen(1), chosen(4)
    assert (one.setting.overlap, four.setting.overlap) == (1, 4)
    assert one.round.exposed_s == four.round.exposed_s == 0 and one.score == four.score
    assert chosen(0).score > one.score  # no overlap: the transfer is exposed
    assert chosen([0, 1, 2, 3, 4]).setting.overlap == 4


def test_max_loss_penalty_excludes_candidates() -> None:
    spec = _two_sites(gbps=0.01, strategy="auto", outer={"h": [10, 20]}, max_loss_penalty=0.015)
    report = _strategy(spec, _table([(2, 10, 0.01), (2, 20, 0.02)]))
    h20 = next(c for c in report.candidates if c.setting and c.setting.h == 20)
    assert "above plan.max_loss_penalty" in h20.reason
    assert report.chosen.setting.h == 10
    spec = _two_sites(gbps=0.01, strategy="outer", outer={"h": [10, 20]}, max_loss_penalty=0.001)
    with pytest.raises(ConfigError, match=r"t\.yaml: plan\.max_loss_penalty: no outer"):
        _strategy(spec, _table([(2, 10, 0.01), (2, 20, 0.02)]))


def test_max_loss_penalty_holds_at_the_mean_plus_its_standard_error() -> None:
    """A setting whose mean is within the bound but whose measurement is too noisy to say so
    (mean + standard error above it) is not chosen; measured at more seeds, it is."""
    plan = {"outer": {"h": [10, 20]}, "max_loss_penalty": 0.015}
    spec = _two_sites(gbps=0.01, strategy="outer", **plan)

    def seeds(gaps10: list[float]) -> PenaltyModel:
        rows = [(2, 10, g, i) for i, g in enumerate(gaps10)] + [(2, 20, 0.05, 0), (2, 20, 0.07, 1)]
        return _table(rows)

    # H=10: mean 1 %, per-run deviation pooled with H=20's: sqrt((2e-4 + 2e-4) / 2) = 1.41 %
    noisy = seeds([0.0, 0.02])
    with pytest.raises(ConfigError, match=r"plan\.max_loss_penalty: no outer candidate"):
        _strategy(spec, noisy)
    auto = _strategy(_two_sites(gbps=0.01, strategy="auto", **plan), noisy)
    h10 = next(c for c in auto.candidates if c.setting and c.setting.h == 10)
    assert "1.00% ± 1.00% above plan.max_loss_penalty" in h10.reason
    assert auto.chosen.kind == "pipeline"
    # the same mean and deviation over 8 seeds: a standard error of 0.5 %, within the bound
    report = _strategy(spec, seeds([0.0, 0.02] * 4))
    assert report.chosen.setting.h == 10 and report.chosen.penalty.value == pytest.approx(0.01)
    assert report.chosen.penalty.upper <= 0.015


def test_without_a_table_auto_keeps_the_pipeline_and_outer_says_the_penalty_is_unknown() -> None:
    none = PenaltyModel(None, "absent.json")
    auto = _strategy(_two_sites(gbps=0.01, strategy="auto"), none)
    assert auto.chosen.kind == "pipeline" and "no measured loss-penalty table" in auto.why
    assert all(not c.penalty.priced for c in auto.candidates[1:])
    outer = _strategy(_two_sites(gbps=0.01, strategy="outer"), none)
    assert outer.chosen.kind == "outer" and "chosen by time alone" in outer.why


def test_outer_with_no_group_that_fits_is_a_config_error() -> None:
    # Each device holds half the model beside its activations, not the whole model: the
    # pipeline over both sites fits, a group of one site does not (the outer state, in
    # host RAM, plays no part: [Note: a replica group's spec]).
    doc = _doc(
        [_site("a"), _site("b")],
        [{"from": "a", "to": "b", "bandwidth_gbps": 1, "latency_ms": 5}],
        strategy="outer",
    )
    for s in doc["sites"]:
        s["device_memory_gb"] = 0.016
    spec = parse_cluster(copy.deepcopy(doc))
    assert plan_cluster(as_pipeline(spec)).best.feasible
    assert not plan_cluster(as_pipeline(group_spec(spec, ("a",), 4))).best.feasible
    with pytest.raises(ConfigError, match=r"plan\.strategy: outer: no grouping .* fits"):
        _strategy(spec, _table([(2, 10, 0.01)]))


def _unlike(devices_a: int, **plan: Any) -> ClusterSpec:
    """Site ``a`` (2 GB devices) and site ``b`` (2 devices of 12 MB: the model fits only
    split over both). Planned apart, ``a`` runs its devices as pipelines of one stage and
    ``b`` as one pipeline of two."""
    a, b = _site("a"), _site("b")
    a["devices_per_node"], b["devices_per_node"] = devices_a, 2
    b["device_memory_gb"] = 0.012
    link = {"from": "a", "to": "b", "bandwidth_gbps": 0.01, "latency_ms": 10}
    return parse_cluster(_doc([a, b], [link], outer={"h": [10]}, **plan))


def test_groups_planned_in_different_layouts_run_in_one_common_layout() -> None:
    """[Note: one layout]: each group planned on its own comes out in another layout (launch
    would refuse them); the strategy table re-plans ``a`` in ``b``'s — the only one ``b``
    fits — and chooses that: launchable, and ``a``'s plan is exactly the planner's own plan
    of ``a`` with its pipelines fixed to 1 (same speeds, so the same balanced split)."""
    spec = _unlike(2, strategy="auto")
    own = [plan_cluster(group_spec(spec, (s,), 4)).best.plan for s in "ab"]
    assert [(p.pipelines, p.num_stages) for p in own] == [(2, 1), (1, 2)]
    assert "launch runs groups of one layout only" in unlaunchable(own)
    report = _strategy(spec, _table([(2, 10, 0.01)]))
    c = report.chosen
    assert c.kind == "outer" and not c.unlaunchable and not c.reason
    plans = [e.plan for e in c.evaluations]
    assert unlaunchable(plans) == ""
    assert [(p.pipelines, p.num_stages, p.partition) for p in plans] == [
        (1, 2, own[1].partition)
    ] * 2
    fixed = spec.model_copy(update={"plan": spec.plan.model_copy(update={"pipelines": 1})})
    ref = plan_cluster(group_spec(fixed, ("a",), c.shares[0])).best
    assert c.evaluations[0].iteration_time_s == pytest.approx(ref.iteration_time_s)
    alone = plan_cluster(group_spec(spec, ("a",), c.shares[0])).best
    assert alone.plan.pipelines == 2 and alone.iteration_time_s < ref.iteration_time_s
    assert outer_run(spec, c).plan.num_groups == 2  # what launch builds from it
    doc = report.to_json()
    assert doc["chosen"]["launchable"] is True and doc["chosen"]["launch_refused"] == ""


def test_groups_that_fit_no_common_layout_are_listed_and_never_chosen() -> None:
    """``a`` has one device (one stage), ``b`` needs two: no layout fits both. The outer
    candidate is faster than the pipeline but stays in the table with the reason; ``auto``
    keeps the pipeline and ``outer`` is a ConfigError naming plan.strategy."""
    spec = _unlike(1, strategy="auto")
    report = _strategy(spec, _table([(2, 10, 0.01)]))
    assert report.chosen.kind == "pipeline"
    outer = report.candidates[1:]
    assert outer and all(c.feasible and c.tokens_per_s > 0 for c in outer)
    assert max(c.tokens_per_s for c in outer) > report.candidates[0].tokens_per_s
    for c in outer:
        assert "no one layout fits every group" in c.unlaunchable
        assert "have 2 stages, not 1" in c.unlaunchable
        assert c.reason.startswith("launch cannot run it")
    rows = report.to_json()["candidates"]
    assert rows[0]["launchable"] and not any(r["launchable"] for r in rows[1:])
    assert "launch cannot run it" in report.why
    with pytest.raises(ConfigError, match=r"t\.yaml: plan\.strategy: outer: launch can run no"):
        _strategy(_unlike(1, strategy="outer"), _table([(2, 10, 0.01)]))


def test_a_forced_layout_imposes_its_layer_split_on_a_group_of_unequal_sites() -> None:
    """A group of two sites of unequal speed, given the split balanced for equal ones: the
    plan keeps that split (the launchable one), fits, and is slower than the group's own
    balanced plan at the same settings; a layout of more stages than the sites make is
    refused with the reason."""
    spec = group_spec(_two_sites(gbps=1.0), ("a", "b"), 8)  # b has half a's FLOP/s
    own = plan_cluster(spec).best
    link = {"from": "a", "to": "b", "bandwidth_gbps": 1.0, "latency_ms": 10}
    equal = parse_cluster(_doc([_site("a"), _site("b")], [link]))
    like = plan_cluster(group_spec(equal, ("a", "b"), 8)).best.plan
    assert own.plan.num_stages == like.num_stages and own.plan.partition != like.partition
    forced = plan_like(spec, like)
    assert not isinstance(forced, str) and forced.feasible
    assert forced.plan.partition == like.partition
    assert forced.plan.stage_sites == own.plan.stage_sites
    assert forced.iteration_time_s > own.iteration_time_s
    deeper = plan_cluster(_unlike(2)).best.plan  # 1 pipeline of 4 stages over a and b
    assert "have 2 stages, not 4" in plan_like(spec, deeper)


def test_a_forced_split_keeps_every_plan_field_it_does_not_derive() -> None:
    """``with_partition`` (the forced layout's plans) changes the split and the in-flight
    caps that follow from it — the same caps ``build_plan`` gives that split — and keeps
    every other field, those the planner leaves at their defaults included: here a
    one-pipeline mixed plan's ``mix`` and ``groups``, which a field-by-field copy drops."""
    spec = group_spec(_two_sites(gbps=1.0), ("a", "b"), 8)
    own = plan_cluster(spec).best.plan
    split = ((0, 1), (1, own.partition[-1][1]))
    assert own.num_stages == 2 and own.partition != split
    kw = {f: getattr(own, f) for f in ("pipelines", "micro_batch_size", "seq_len")}
    kw.update(num_microbatches=own.num_microbatches, delta_n=own.delta_n, codecs=own.codecs)
    zb = build_plan(spec, own.stage_sites, schedule="lookahead-zb", **kw)
    ref = build_plan(spec, own.stage_sites, schedule="lookahead-zb", partition=split, **kw)
    assert zb.inflight_caps != ref.inflight_caps  # the caps do follow from the split
    assert with_partition(spec, zb, split) == ref
    lay = PipelineLayout(zb.stage_sites, zb.partition, zb.num_microbatches, zb.delta_n, zb.codecs)
    marked = replace(zb, pipelines=1, mix=(lay,), groups=(0,))
    forced = with_partition(spec, marked, split)
    derived = {"partition", "inflight_caps"}
    for f in fields(Plan):
        if f.name not in derived:
            assert getattr(forced, f.name) == getattr(marked, f.name), f.name
    assert forced.partition == split and forced.mix == (lay,) and forced.groups == (0,)


def test_worldwide_64_chooses_a_strategy_that_keeps_its_devices_computing(capsys) -> None:
    """The issue's check on the shipped cluster and the shipped, measured table: auto leaves
    the pipeline across 8 regions (about a fifth of the devices' time computing) for an outer
    loop that keeps far more busy, and says what loss penalty it assumed and from where."""
    from geopipe.cli import main

    assert main(["plan", "clusters/worldwide-64.yaml", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    chosen = doc["strategy"]["chosen"]
    assert chosen["kind"] != "pipeline" and chosen["priced"]
    assert chosen["device_utilization"] > 0.5 > doc["best"]["device_utilization"]
    assert chosen["loss_penalty"] is not None and "measured at" in chosen["loss_penalty_basis"]
    assert main(["plan", "clusters/worldwide-64.yaml"]) == 0
    text = capsys.readouterr().out
    assert "assumed loss penalty" in text and "loss_penalty.json" in text


def test_worldwide_64_keeps_80_percent_of_its_device_time_computing(capsys) -> None:
    """The issue's threshold (`geopipe plan clusters/worldwide-64.yaml --json`: the chosen
    plan's device_utilization >= 0.80), with the driver's calls priced: 218 ms from the
    driver's site to the farthest region, paid once per apply interval (the apply and its
    gather ride on the span calls; the second span of an interval is queued behind the
    first), the overhead per call."""
    from geopipe.cli import main

    assert main(["plan", "clusters/worldwide-64.yaml", "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["strategy"]["chosen"]
    assert chosen["device_utilization"] >= 0.80
    r = chosen["round"]
    assert r["control_rtt_s"] > 0.2 and r["steps_per_wait"] > r["steps_per_call"]
