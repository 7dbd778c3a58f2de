"""The ΔN the steady state needs (``delta_n_cover``) and how the GA uses it: the sweep that
opens the search, ΔN re-tuning, and the stop after ``patience`` generations without a
faster plan.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from geopipe.config import load_cluster, parse_cluster
from geopipe.optimizer import genetic
from geopipe.optimizer.evaluate import Evaluator
from geopipe.optimizer.exhaustive import exhaustive_search
from geopipe.optimizer.ladder import delta_n_cover
from geopipe.optimizer.simulator import PipelineCosts, simulate
from geopipe.optimizer.steady import predict
from geopipe.pipeline.schedule import lookahead

ROOT = Path(__file__).resolve().parents[2]


def _random_costs(rng: random.Random, p: int, max_latency: float = 5.0) -> PipelineCosts:
    f = [rng.uniform(0.1, 1.0) for _ in range(p)]
    b = [x * rng.uniform(1.5, 2.5) for x in f]
    ser_f = [rng.uniform(0.0, 1.0) for _ in range(p - 1)]
    ser_b = [rng.uniform(0.0, 1.0) for _ in range(p - 1)]
    lat = [rng.uniform(0.0, max_latency) for _ in range(p - 1)]
    return PipelineCosts(
        tuple(f), tuple(b), (0.0,) * p, tuple(ser_f), tuple(lat), tuple(ser_b), tuple(lat)
    )


def _slope(costs: PipelineCosts, dn: list[int], m: int = 240) -> float:
    """Iteration time per extra micro-batch (full replays at m and 2m: steady by then)."""
    p = len(costs.fwd_s)
    a = simulate(lookahead(p, m, dn), costs).iteration_time_s
    return (simulate(lookahead(p, 2 * m, dn), costs).iteration_time_s - a) / m


@pytest.mark.parametrize("seed", range(40))
def test_cover_is_the_least_delta_n_at_the_pipelines_pace(seed: int) -> None:
    # The reference is the replay itself: with the estimate the steady state runs at the
    # slowest server's period, and one ΔN less at any boundary makes every round slower.
    rng = random.Random(seed)
    p = rng.randint(2, 5)
    costs = _random_costs(rng, p)
    period = max(
        [
            *(x + y for x, y in zip(costs.fwd_s, costs.bwd_s, strict=True)),
            *costs.ser_f,
            *costs.ser_b,
        ]
    )
    dn = list(delta_n_cover(costs, range(p - 1)))
    assert _slope(costs, dn) == pytest.approx(period, rel=1e-6)
    for j in range(p - 1):
        if dn[j]:
            less = [x - (k == j) for k, x in enumerate(dn)]
            assert _slope(costs, less) > period * (1 + 1e-6), (j, dn)


def _fast_slope(costs: PipelineCosts, dn: list[int], m: int = 240) -> float:
    """:func:`_slope` through the steady-state extrapolation (exact, tested against full
    replays in test_steady): fast enough to try every ΔN vector of a box."""
    p = len(costs.fwd_s)
    a = predict("lookahead", p, m, tuple(dn), costs).iteration_time_s
    return (predict("lookahead", p, 2 * m, tuple(dn), costs).iteration_time_s - a) / m


@pytest.mark.parametrize("seed", range(25))
def test_cover_is_the_least_total_by_brute_force(seed: int) -> None:
    # Every ΔN vector of a box, timed: none that runs at the pipeline's pace has a smaller
    # total than the cover (ΔN on every boundary, as when each crosses a WAN link).
    rng = random.Random(100 + seed)
    p = rng.randint(2, 4)
    costs = _random_costs(rng, p, max_latency=1.5)
    period = max(
        [
            *(x + y for x, y in zip(costs.fwd_s, costs.bwd_s, strict=True)),
            *costs.ser_f,
            *costs.ser_b,
        ]
    )
    got = delta_n_cover(costs, range(p - 1))
    box = itertools.product(range(max(got) + 2), repeat=p - 1)
    fast = [v for v in box if _fast_slope(costs, list(v)) <= period * (1 + 1e-6)]
    assert min(sum(v) for v in fast) == sum(got) and tuple(got) in fast


def test_cover_matches_exhaustive_search_on_shipped_clusters() -> None:
    # At the exhaustive optimum's structure the estimate is the optimum's ΔN exactly.
    for name in ("three-dc-wan", "local-2dc"):
        spec = load_cluster(ROOT / "clusters" / f"{name}.yaml")
        ev = Evaluator(spec)
        sp = ev.space  # each listed codec both ways (mixes would make three-dc-wan 9x larger)
        ev.space = replace(sp, codecs=sp.codecs[: sp.listed_codecs])
        best = exhaustive_search(ev).best
        plan = ev.make_plan(best.candidate)
        assert delta_n_cover(ev.costs(plan), plan.wan_boundaries) == best.candidate.delta_n


def test_cover_is_near_the_best_where_the_old_estimate_overshoots() -> None:
    # worldwide-64 at 512 sequences/step: the best plan the GA finds (every seed, and the
    # structure the sweep ranks first) runs at the estimate's ΔN, while the per-boundary
    # estimate (round trip over the upstream stage's compute) is 2–8× larger and ≥ 30 %
    # slower.
    from geopipe.optimizer.ladder import delta_n_estimate

    spec = load_cluster(ROOT / "clusters" / "worldwide-64.yaml")
    ev = Evaluator(spec)
    best = genetic.genetic_search(ev).best
    plan = ev.make_plan(best.candidate)
    costs = ev.costs(plan)
    cover = delta_n_cover(costs, plan.wan_boundaries)
    old = tuple(min(32, delta_n_estimate(costs, j)) for j in plan.wan_boundaries)
    fresh = Evaluator(spec)
    at_cover = fresh.evaluate(replace(best.candidate, delta_n=cover))
    at_old = fresh.evaluate(replace(best.candidate, delta_n=old))
    assert at_cover.fitness <= best.fitness * 1.005
    assert at_old.fitness > 1.3 * best.fitness


# --------------------------------------------------------------------------------------------
# The GA's sweep and its stop


def _local(latency_ms: float = 25.0):
    doc = yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text())
    doc["links"][0]["latency_ms"] = latency_ms
    doc["plan"]["codecs"] = ["none", "int8"]
    return parse_cluster(doc, "local-2dc-variant")


def test_sweep_covers_every_structure_at_its_estimate() -> None:
    spec = _local()
    ev = Evaluator(spec)
    genes = genetic._Genes(ev)
    sp = ev.space
    gbs = spec.training.global_batch_size
    sweep = genetic._sweep(genes)
    structures = {
        (d, b, s, c)
        for d in sp.pipelines
        for b in sp.micro_batch_sizes
        for s in sp.seq_lens
        for c in sp.codecs[: sp.listed_codecs]  # the sweep tries each listed codec both ways
        if sp.valid(d, b, gbs)
    }
    got = {}
    for g in sweep:
        cand = genes.candidate(g)
        assert len(set(cand.codecs)) == 1
        got[(cand.pipelines, cand.micro_batch_size, cand.seq_len, cand.codecs[0])] = cand
    assert set(got) == structures and len(sweep) == len(structures)
    for cand in got.values():
        plan = ev.make_plan(cand)
        assert cand.delta_n == delta_n_cover(ev.costs(plan), plan.wan_boundaries)


def test_initial_population_keeps_the_best_of_the_sweep() -> None:
    spec = _local()
    genes = genetic._Genes(Evaluator(spec))
    random.seed(0)
    pop = genetic._initial_population(genes, 16)
    assert len(pop) == 16
    best_sweep = min(genes.fitness(list(g)) for g in genetic._sweep(genes))
    assert min(ind.fitness.values for ind in pop) == best_sweep


@pytest.mark.parametrize("patience", [1, 3])
def test_evolution_stops_patience_generations_after_the_last_faster_plan(patience) -> None:
    spec = _local(60.0)
    genes = genetic._Genes(Evaluator(spec))
    random.seed(1)
    pop = genetic._initial_population(genes, 12)
    trace: list[tuple[float, float]] = []
    start = min(ind.fitness.values for ind in pop)
    _, _, gen = genetic._evolve(genes, pop, 12, 200, patience, trace)
    assert gen == len(trace) < 200
    times = [start[0]] + [t for t, _ in trace]
    # the last `patience` generations brought no faster time bucket, the one before did
    # (or it is the start)
    assert all(t >= times[-patience - 1] for t in times[-patience:])
    k = len(times) - patience - 1
    assert k == 0 or times[k] < times[k - 1]
