"""A codec per boundary and direction: the settings (``"fwd/bwd"``), their bytes and costs,
and the planner's choice of each direction's codec — checked against exhaustive search."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from geopipe.config import parse_cluster
from geopipe.optimizer.evaluate import Evaluator, codec_space
from geopipe.optimizer.exhaustive import exhaustive_search
from geopipe.optimizer.genetic import genetic_search
from geopipe.transport.wire import CODECS, codec_pair, direction_codec, pair_name, wire_bytes

ROOT = Path(__file__).resolve().parents[2]
LOCAL = yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text())


def test_a_setting_names_each_direction_s_codec() -> None:
    assert codec_pair("int4h/int8") == ("int4h", "int8") and codec_pair("bf16") == ("bf16",) * 2
    assert direction_codec("int4h/int8", "forward") == "int4h"
    assert direction_codec("int4h/int8", "backward") == "int8"
    assert pair_name("int8", "int8") == "int8" and pair_name("none", "int8") == "none/int8"
    n, row = 4096, 64
    assert wire_bytes("int4h/none", n, row, 4, "forward") == wire_bytes("int4h", n, row, 4)
    assert wire_bytes("int4h/none", n, row, 4, "backward") == n * 4
    with pytest.raises(ValueError, match="unknown codec"):
        wire_bytes("int4h/int3", n, row)
    with pytest.raises(ValueError, match="unknown codec"):
        wire_bytes("int8/int8/int8", n, row)


def test_the_space_holds_every_direction_pair_listed_first() -> None:
    assert codec_space(["none", "int8"]) == ("none", "int8", "none/int8", "int8/none")
    # an explicit pair contributes its directions' codecs to the mixes
    assert set(codec_space(["int4h/int8"])) == {"int4h/int8"}
    assert set(codec_space(["bf16", "int4h/int8"])) == {
        "bf16",
        "int4h/int8",
        "bf16/int8",
        "int4h/bf16",
    }


def _spec(forward_gbps: float, backward_gbps: float, codecs: list[str]):
    doc = yaml.safe_load(yaml.safe_dump(LOCAL))
    doc["links"] = [
        {"from": "east", "to": "west", "bandwidth_gbps": forward_gbps, "latency_ms": 25},
        {"from": "west", "to": "east", "bandwidth_gbps": backward_gbps, "latency_ms": 25},
    ]
    doc["plan"]["codecs"] = codecs
    doc["plan"]["micro_batch_size"] = {"min": 2, "max": 4}
    return parse_cluster(doc, "directions")


@pytest.mark.parametrize(
    ("fwd", "bwd", "want"),
    [
        # fat both ways: int4h's nominal 1 GB/s costs more than 40 Gbit/s shared by the
        # two pipelines saves (it pays above bandwidth / (8 · D · (1 - 1/7.5)) = 2.9 GB/s)
        (40.0, 40.0, "none"),
        (0.02, 0.02, "int4h"),  # thin both ways: the smallest codec on offer
        (40.0, 0.02, "none/int4h"),  # gradients go upstream over the thin direction
        (0.02, 40.0, "int4h/none"),
    ],
)
def test_the_planner_compresses_only_the_direction_that_needs_it(fwd, bwd, want) -> None:
    spec = _spec(fwd, bwd, ["none", "int4h"])
    got = genetic_search(Evaluator(spec)).best
    exact = exhaustive_search(Evaluator(spec)).best
    assert got.candidate.codecs == (want,)
    assert got.fitness == pytest.approx(exact.fitness, rel=1e-9)
    assert exact.candidate.codecs == (want,)


def test_codec_speed_measured_for_a_site_is_what_the_planner_charges() -> None:
    spec = _spec(0.2, 0.2, ["int4h"])
    ev = Evaluator(spec)
    plan = ev.make_plan(ev.evaluate(replace(exhaustive_search(ev).best.candidate)).candidate)
    base = ev.costs(plan)
    slow_east = spec.sites[0].model_copy(update={"codec_gb_per_s": {"int4h": 0.01}})
    slow = spec.model_copy(update={"sites": [slow_east, spec.sites[1]]})
    costs = Evaluator(slow).costs(plan)
    raw = plan.micro_batch_size * plan.seq_len * spec.model.n_embd * 4
    # east encodes activations (forward); west's gradients (backward) keep the nominal speed
    assert costs.ser_f[0] - base.ser_f[0] == pytest.approx(raw / 1e7 - raw / 1e9, rel=1e-6)
    assert costs.ser_b == base.ser_b


def test_the_next_finer_codec_is_the_next_searched_one_or_exact() -> None:
    from geopipe.transport.wire import FINENESS, finer_codec

    assert set(FINENESS) == set(CODECS)
    assert finer_codec("int2h", {"int2h", "int8"}) == "int8"
    assert finer_codec("int4h") == "int8" and finer_codec("int8") == "bf16"
    assert finer_codec("int8", {"int8", "int4h"}) == "none"
    assert finer_codec("none") == "none"


def test_guard_moves_only_the_direction_and_hop_that_erred() -> None:
    from geopipe.optimizer.codec_guard import apply_fallbacks, codec_fallbacks
    from geopipe.plan import PipelineLayout, Plan

    three = ("a", "b", "c")
    parts = ((0, 1), (1, 2), (2, 3))
    plan = Plan(2, three, parts, 1, 8, 4, "lookahead", (1, 1), ("int2h", "int4h/int8"))
    samples = [
        (0, 0, "forward", 0.40),  # a->b activations: over the bound
        (0, 1, "forward", 0.45),  # the other pipeline's: the worst one is reported
        (1, 0, "backward", 0.40),  # b->a gradients: over
        (1, 0, "forward", 0.04),  # b->c activations: within
        (2, 1, "backward", 0.01),  # c->b gradients: within
    ]
    got = codec_fallbacks(plan, samples, 0.05, ["int2h", "int4h", "int8"])
    assert [(f.src, f.dst, f.direction, f.old, f.new, f.error) for f in got] == [
        ("a", "b", "backward", "int2h", "int4h", 0.40),
        ("a", "b", "forward", "int2h", "int4h", 0.45),
    ]
    assert apply_fallbacks(plan, got).codecs == ("int4h", "int4h/int8")
    assert codec_fallbacks(plan, samples, 0.5, ["int2h"]) == []
    # a mix: each pipeline's own boundaries on the hop change
    deep = PipelineLayout(three, parts, 3, (1, 1), ("int2h", "int8"))
    short = PipelineLayout(("a", "b"), ((0, 2), (2, 3)), 1, (1,), ("int2h",))
    mix = Plan(2, three, parts, 1, 8, 4, "lookahead", (1, 1), ("int2h", "int8"), mix=(deep, short))
    fb = codec_fallbacks(mix, [(0, 1, "forward", 0.3)], 0.05, ["int2h", "int8"])
    assert [(f.src, f.dst, f.new) for f in fb] == [("a", "b", "int8")]
    moved = apply_fallbacks(mix, fb)
    assert [p.codecs for p in moved.mix] == [("int8/int2h", "int8"), ("int8/int2h",)]
    assert moved.codecs == ("int8/int2h", "int8")


def test_plan_compares_each_codec_and_names_what_binds() -> None:
    """`geopipe plan`'s codec table: on a thin link compression moves the bottleneck from
    the WAN towards compute, and the chosen plan is the fastest row; on a fat link every
    codec leaves compute binding."""
    from geopipe.optimizer.planner import plan_cluster

    thin = plan_cluster(_spec(0.05, 0.05, ["none", "int8", "int4h"]))
    rows = {r.setting: r for r in thin.codecs}
    assert list(rows) == ["none", "int8", "int4h", "chosen: int4h"]
    assert rows["none"].wan_busy_s > rows["int8"].wan_busy_s > rows["int4h"].wan_busy_s
    none = rows["none"]
    assert none.bound == "WAN east→west" and none.wan_busy_s > none.compute_s
    fastest = min(r.evaluation.iteration_time_s for r in thin.codecs)
    assert rows["chosen: int4h"].evaluation.iteration_time_s == pytest.approx(fastest, rel=1e-9)
    assert thin.to_json()["codecs"]["int8"]["bound"] == rows["int8"].bound
    fat = plan_cluster(_spec(40.0, 40.0, ["none", "int8"]))
    assert all(r.bound.startswith("compute stage") for r in fat.codecs)
