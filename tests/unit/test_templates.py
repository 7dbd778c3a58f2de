"""Pipeline templates: enumeration and best choices against brute force on small clusters,
agreement with the planner's Evaluator, the micro-batch split, and the shipped clusters.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from geopipe.cli.render import format_templates
from geopipe.config import ClusterSpec, load_cluster, parse_cluster
from geopipe.model.sizes import param_totals
from geopipe.optimizer.evaluate import Candidate, Evaluator
from geopipe.optimizer.instantiate import instantiate, split_microbatches
from geopipe.optimizer.shapes import candidate_shapes
from geopipe.optimizer.simulator import simulate
from geopipe.optimizer.templates import TemplateSet, Vector, best_uniform, build_templates
from geopipe.pipeline.schedule import make_schedule

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def small_spec(
    devices: tuple[int, ...],
    n_layer: int = 2,
    mem_factor: float | None = None,
    links: list[tuple[int, int]] | None = None,
    global_batch: int = 4,
) -> ClusterSpec:
    """Sites s0, s1, … with ``devices[i]`` devices; s1 is faster. ``mem_factor`` sizes each
    device to that fraction of the whole model's weights + gradients + Adam state."""
    n = len(devices)
    mem = 2.0
    if mem_factor is not None:
        total, _ = param_totals(
            type(
                "M",
                (),
                {
                    "n_layer": n_layer,
                    "n_embd": 64,
                    "n_head": 4,
                    "vocab_size": 256,
                    "max_seq_len": 16,
                },
            )
        )
        mem = mem_factor * 16 * total / GIB
    sites = [
        {
            "name": f"s{i}",
            "nodes": 1,
            "devices_per_node": d,
            "device_memory_gb": mem,
            "device_tflops": 0.08 if i == 1 else 0.05,
            "device_efficiency": 0.5,
            "device_mem_bw_gb_per_s": 10,
            "intra_bandwidth_gbps": 20,
        }
        for i, d in enumerate(devices)
    ]
    pairs = links if links is not None else [(i, i + 1) for i in range(n - 1)]
    doc = {
        "name": "small",
        "sites": sites,
        "links": [
            {"from": f"s{a}", "to": f"s{b}", "bandwidth_gbps": 0.2, "latency_ms": 20 + 5 * a}
            for a, b in pairs
        ],
        "model": {
            "n_layer": n_layer,
            "n_embd": 64,
            "n_head": 4,
            "vocab_size": 256,
            "max_seq_len": 16,
        },
        "training": {"global_batch_size": global_batch, "steps": 1, "lr": 0.001},
        "plan": {
            "micro_batch_size": 1,
            "seq_len": 16,
            "delta_n": {"min": 0, "max": 4},
            "codecs": ["none"],
        },
    }
    return parse_cluster(doc, "small")


SMALL = [
    ((a, b), n_layer, mem)
    for a, b in itertools.product((1, 2, 3), repeat=2)
    for n_layer in (1, 2)
    for mem in (None, 0.75)
]


def valid_vectors(ts: TemplateSet, limits: Vector) -> list[Vector]:
    """Brute force: every vector within ``limits`` that has a layout."""
    ranges = [range(n + 1) for n in limits]
    return [v for v in itertools.product(*ranges) if ts.stage_sites(v) is not None]


def same_sites(v: Vector, c: Vector) -> bool:
    return all((a > 0) == (b > 0) for a, b in zip(v, c, strict=True))


def brute_uniform(ts: TemplateSet, alive: Vector, total: int) -> float:
    """The best uniform time by brute force over every vector and pipeline count."""
    best = math.inf
    for v in valid_vectors(ts, alive):
        if not same_sites(v, alive):
            continue
        for d in range(1, total + 1):
            if total % d or any(d * x > a for x, a in zip(v, alive, strict=True)):
                continue
            pr = ts.predict(v, d, total // d)
            if pr is not None and pr.feasible:
                best = min(best, pr.iteration_time_s)
    return best


# ---------------------------------------------------------------------------------------------
# Enumeration and best choices


@pytest.mark.parametrize(("devices", "n_layer", "mem"), SMALL)
def test_build_templates_matches_brute_force(devices, n_layer, mem) -> None:
    spec = small_spec(devices, n_layer, mem)
    ts = build_templates(spec)
    assert ts.exhaustive
    every = valid_vectors(ts, ts.devices)
    assert sorted(ts.templates) == sorted(every)
    # An independent set that evaluates on demand only (no precomputation).
    fresh = build_templates(spec, exhaustive_limit=0)
    for v in every:
        a, b = ts.templates[v], fresh.template(v)
        assert b is not None
        assert (a.stage_sites, a.partition, a.feasible) == (b.stage_sites, b.partition, b.feasible)
        assert a.iteration_time_s == pytest.approx(b.iteration_time_s)
        assert a.num_devices == sum(v) == a.num_stages
        assert all(n >= 1 for n in a.devices.values())  # every used site hosts ≥ 1 stage
    # best(c) for every device count per site: the fastest feasible vector using its sites.
    for c in itertools.product(*(range(n + 1) for n in ts.devices)):
        if not any(c):
            continue
        want = [
            ts.templates[v]
            for v in every
            if all(x <= y for x, y in zip(v, c, strict=True)) and same_sites(v, c)
        ]
        want = [t for t in want if t.feasible]
        got = ts.best(dict(zip(ts.sites, c, strict=True)))
        if not want:
            assert got is None
        else:
            assert got is not None
            assert got.iteration_time_s == min(t.iteration_time_s for t in want)


@pytest.mark.parametrize(("devices", "n_layer", "mem"), SMALL)
def test_best_uniform_matches_brute_force(devices, n_layer, mem) -> None:
    spec = small_spec(devices, n_layer, mem)
    ts = build_templates(spec)
    total = ts.num_microbatches
    for alive in itertools.product(*(range(n + 1) for n in ts.devices)):
        got = best_uniform(ts, dict(zip(ts.sites, alive, strict=True)))
        want = brute_uniform(ts, alive, total)
        if got is None:
            assert want == math.inf, alive
            continue
        tmpl, d = got
        assert total % d == 0
        assert all(d * x <= a for x, a in zip(tmpl.stages_per_site, alive, strict=True))
        assert same_sites(tmpl.stages_per_site, alive)
        pr = ts.predict(tmpl.stages_per_site, d, total // d)
        assert pr is not None and pr.feasible
        assert pr.iteration_time_s == pytest.approx(want), alive


def test_memory_bounds_the_smallest_template() -> None:
    # Each device holds 75 % of the model's static state: one device alone cannot train it.
    ts = build_templates(small_spec((3, 3), n_layer=2, mem_factor=0.75))
    assert ts.smallest() is not None and ts.smallest().num_devices >= 2
    assert all(not t.feasible for t in ts.templates.values() if t.num_devices == 1)
    assert ts.best({"s0": 1, "s1": 0}) is None
    assert best_uniform(ts, {"s0": 1, "s1": 0}) is None
    # Roomy devices: one device (in either site) is a template.
    roomy = build_templates(small_spec((3, 3), n_layer=2))
    assert roomy.best({"s0": 1, "s1": 0}).stages_per_site == (1, 0)


def test_site_loss_needs_a_chain_of_links() -> None:
    # s0 - s1 - s2 with no s0-s2 link: losing s1 leaves no pipeline.
    chain = build_templates(small_spec((2, 2, 2)))
    assert chain.stage_sites((1, 0, 1)) is None
    assert chain.best({"s0": 2, "s1": 0, "s2": 2}) is None
    # With the s0-s2 link a pipeline skips the dead site.
    tri = build_templates(small_spec((2, 2, 2), links=[(0, 1), (1, 2), (0, 2)]))
    t = tri.best({"s0": 2, "s1": 0, "s2": 2})
    assert t is not None and "s1" not in t.stage_sites and set(t.stage_sites) == {"s0", "s2"}


def test_predictions_agree_with_the_planners_evaluator() -> None:
    """On the planner's own shapes a template prediction is the planner's evaluation."""
    for name in ("local-2dc.yaml", "three-dc-wan.yaml"):
        spec = load_cluster(ROOT / "clusters" / name)
        ts = build_templates(spec)
        ev = Evaluator(spec)
        gbs = spec.training.global_batch_size
        for d, shape in list(ev.shapes.items())[:3]:
            if gbs % (d * ts.micro_batch_size):
                continue
            v = tuple(shape.stage_sites.count(s) for s in ts.sites)
            assert ts.max_vector(ts.devices, d) == v  # the same shape rule
            m = gbs // (d * ts.micro_batch_size)
            pr = ts.predict(v, d, m)
            wan = shape.wan_boundaries
            c = Candidate(
                d,
                ts.micro_batch_size,
                ts.seq_len,
                tuple(pr.delta_n[j] for j in wan),
                tuple(pr.codecs[j] for j in wan),
                ts.schedule,
            )
            e = ev.evaluate(c)
            assert e.feasible == pr.feasible
            assert pr.iteration_time_s == pytest.approx(e.iteration_time_s, rel=1e-9)


def test_max_vector_is_the_planners_shape_on_shipped_clusters() -> None:
    for path in sorted((ROOT / "clusters").glob("*.yaml")):
        spec = load_cluster(path)
        ts = TemplateSet(spec, {s.name: s.devices for s in spec.sites}, 1, 16, "1f1b", {})
        for shape in candidate_shapes(spec):
            v = ts.max_vector(ts.devices, shape.pipelines)
            assert v is not None
            assert ts.stage_sites(v) == shape.stage_sites, (path.name, shape.pipelines)


def test_long_runs_are_predicted_exactly() -> None:
    spec = load_cluster(ROOT / "clusters" / "three-dc-wan.yaml")
    ts = build_templates(spec)
    v = ts.max_vector(ts.devices, 2)
    m = ts.num_microbatches // 2
    pr = ts.predict(v, 2, m)
    plan = ts.predictor.plan(ts.stage_sites(v), 2, m, pr.delta_n)
    sched = make_schedule(plan.schedule, plan.num_stages, m, plan.delta_n)
    full = simulate(sched, ts.predictor._ev.costs(plan))  # the full replay, no extrapolation
    assert pr.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-9)


def test_plan_for_builds_the_runtime_plan() -> None:
    ts = build_templates(small_spec((3, 3)))
    tmpl, d = best_uniform(ts, {"s0": 3, "s1": 3})
    plan = ts.plan_for(tmpl, d, ts.num_microbatches // d)
    assert plan.pipelines == d and plan.stage_sites == tmpl.stage_sites
    assert plan.partition == tmpl.partition
    assert plan.partition[0][0] == 0 and plan.partition[-1][1] == ts.num_layers
    assert plan.pipelines * plan.num_microbatches * plan.micro_batch_size == 4
    assert len(plan.delta_n) == len(plan.codecs) == plan.num_stages - 1
    assert all(
        plan.delta_n[j] == 0 for j in range(plan.num_stages - 1) if j not in plan.wan_boundaries
    )


def test_template_set_rejects_other_micro_batch_sizes() -> None:
    ts = build_templates(small_spec((2, 2)))
    with pytest.raises(ValueError, match="micro-batch 1"):
        best_uniform(ts, {"s0": 2, "s1": 2}, micro_batch=2)
    with pytest.raises(ValueError, match="unknown sites"):
        best_uniform(ts, {"nowhere": 2})


# ---------------------------------------------------------------------------------------------
# Splitting the batch and heterogeneous instantiation


def _makespan(lines, shares) -> float:
    return max(f + g * m for (f, g), m in zip(lines, shares, strict=True))


def test_split_hand_checked() -> None:
    assert split_microbatches([(0.0, 1.0), (0.0, 2.0)], 3) == [2, 1]
    assert sorted(split_microbatches([(0.0, 1.0)] * 3, 7)) == [2, 2, 3]
    assert split_microbatches([(0.0, 1.0), (0.0, 1.0)], 2) == [1, 1]
    # Twice as fast, twice the share.
    assert split_microbatches([(0.5, 1.0), (0.5, 2.0), (0.5, 2.0)], 40) == [20, 10, 10]
    with pytest.raises(ValueError):
        split_microbatches([(0.0, 1.0)] * 3, 2)


def test_split_is_optimal_against_brute_force() -> None:
    import random

    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(1, 4)
        total = rng.randint(k, 12)
        lines = [(rng.uniform(0, 3), rng.uniform(0.1, 2)) for _ in range(k)]
        shares = split_microbatches(lines, total)
        assert sum(shares) == total and min(shares) >= 1
        best = min(
            _makespan(lines, s)
            for s in itertools.product(range(1, total + 1), repeat=k)
            if sum(s) == total
        )
        assert _makespan(lines, shares) == pytest.approx(best)


@pytest.mark.parametrize(("devices", "n_layer", "mem"), SMALL[::3])
def test_instantiate_uses_alive_devices_and_splits_the_batch(devices, n_layer, mem) -> None:
    ts = build_templates(small_spec(devices, n_layer, mem, global_batch=6))
    total = ts.num_microbatches
    for alive in itertools.product(*(range(n + 1) for n in ts.devices)):
        have = dict(zip(ts.sites, alive, strict=True))
        inst = instantiate(ts, have)
        uni = best_uniform(ts, have)
        if inst is None:
            assert uni is None
            continue
        shares = [p.num_microbatches for p in inst.pipelines]
        assert sum(shares) == total and min(shares) >= 1
        for s, n in inst.devices_used.items():
            assert n <= have[s]
        assert {p.template.layer_sites for p in inst.pipelines} == {
            inst.pipelines[0].template.layer_sites
        }  # every layer's replicas in one site
        assert inst.iteration_time_s == max(p.predicted_time_s for p in inst.pipelines)
        if uni is not None:
            tmpl, d = uni
            t_uni = ts.predict(tmpl.stages_per_site, d, total // d).iteration_time_s
            assert inst.iteration_time_s <= t_uni * (1 + 0.02)  # never (really) worse
        # Balanced: the pipelines finish within about one micro-batch of each other.
        times = [p.predicted_time_s for p in inst.pipelines]
        step = max(p.per_microbatch_s for p in inst.pipelines)
        assert max(times) - min(times) <= step * 1.05 + 1e-9


# ---------------------------------------------------------------------------------------------
# The shipped clusters


@pytest.mark.parametrize("name", ["three-dc-wan.yaml", "eight-region-whatif.yaml"])
def test_format_templates_on_shipped_clusters(name) -> None:
    spec = load_cluster(ROOT / "clusters" / name)
    ts = build_templates(spec)
    assert not ts.exhaustive  # the bounded enumeration
    text = format_templates(ts)
    assert ts.sites[0] in text and "smallest:" in text
    smallest = ts.smallest()
    assert smallest is not None and set(smallest.devices) == set(ts.sites)
    assert len(text.splitlines()) == 5 + len(ts.feasible()) + (
        1 if len(ts.feasible()) < len(ts.templates) else 0
    )


def test_format_templates_without_any_fitting_template() -> None:
    ts = build_templates(small_spec((1, 1), mem_factor=0.51))  # fits only all together
    assert not ts.feasible()
    assert "no template fits" in format_templates(ts)
