"""Exhaustive search: every valid candidate scored, most of them by a bound in bulk.

The GA's check, and the planner's method for tiny spaces. Candidates differing only in ΔN
share their costs (ΔN changes the schedule, not the work), so for each *base* — pipelines,
micro-batch, sequence length and codecs — one cost vector serves every ΔN combination, and
numpy scores all of them at once: memory at the schedule's in-flight peak (which ΔN fixes,
:func:`~geopipe.optimizer.steady.peak_in_flight_batch`), activation bytes in flight, and a
lower bound on the iteration time that grows as ΔN shrinks
(:func:`~geopipe.optimizer.simulator.in_flight_bound`, with the ΔN-free
:func:`~geopipe.optimizer.simulator.lower_bound`). Candidates that fit are then simulated in
order of their bound until the bound exceeds the best time found by more than the tie
tolerance: every plan within that tolerance of the optimum is simulated, so
:func:`~geopipe.optimizer.evaluate.choose` sees all of them. A few million candidates take
seconds, nearly all in numpy.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

import numpy as np

from geopipe.optimizer.errors import PlanningError
from geopipe.optimizer.evaluate import (
    INFEASIBLE,
    TIE_TOLERANCE,
    Candidate,
    Evaluation,
    Evaluator,
    choose,
    plan_schedule,
)
from geopipe.optimizer.genetic import SearchResult
from geopipe.optimizer.memory import W_HELD_FRACTION, device_limits, plan_memory
from geopipe.optimizer.simulator import in_flight_bound, lower_bound
from geopipe.optimizer.steady import peak_in_flight_batch
from geopipe.pipeline.schedule import IN_ORDER_FAMILIES, LOOKAHEAD_FAMILIES, SPLIT_FAMILIES

__all__ = ["MAX_EXHAUSTIVE", "exhaustive_search"]

# Candidates exhaustive search accepts: a few million score in seconds; far more would only
# run out of memory (the bulk scores are arrays over every ΔN combination).
MAX_EXHAUSTIVE = 5_000_000


@dataclass
class _Scored:
    """Every ΔN row of the bases, scored in bulk (index ``i`` of each array: one candidate)."""

    base: np.ndarray  # index into the bases list
    dn: np.ndarray  # row of the ΔN grid
    bound: np.ndarray  # lower bound on seconds per token
    fits: np.ndarray  # memory (device and host) fits
    penalty: np.ndarray  # the infeasible fitness when it does not


def exhaustive_search(ev: Evaluator) -> SearchResult:
    """Score every valid candidate of ``ev.space`` (module docstring); the chosen plan."""
    sp = ev.space
    gbs = ev.spec.training.global_batch_size
    if sp.size(gbs) > MAX_EXHAUSTIVE:
        raise PlanningError(
            f"exhaustive search over {sp.size(gbs):,} candidates is not practical (at most "
            f"{MAX_EXHAUSTIVE:,}): narrow plan.delta_n, plan.codecs or plan.pipelines"
        )
    t0, start_evals = time.perf_counter(), ev.evaluations
    w = sp.wan_boundaries
    grid = np.array(list(itertools.product(sp.delta_ns, repeat=w)), dtype=np.int64)
    grid = grid.reshape(len(grid), w)
    bases: list[Candidate] = []
    parts: list[_Scored] = []
    unusable: list[Evaluation] = []
    for d, b, s in itertools.product(sp.pipelines, sp.micro_batch_sizes, sp.seq_lens):
        if not sp.valid(d, b, gbs):
            continue
        for codecs in itertools.product(sp.codecs, repeat=w):
            c0 = Candidate(d, b, s, (0,) * w, codecs, sp.schedule)
            scored = _score_base(ev, c0, grid, len(bases))
            if scored is None:
                unusable.append(ev.evaluate(c0))
                continue
            bases.append(c0)
            parts.append(scored)
    seen = _simulate_in_bound_order(ev, bases, grid, parts)
    chosen = choose([*seen, *unusable])
    assert chosen is not None, "the search space is empty"
    return SearchResult(
        best=ev.evaluate(chosen.candidate),
        evaluations=sp.size(gbs),
        seconds=time.perf_counter() - t0,
        method="exhaustive",
        space_size=sp.size(gbs),
        simulated=ev.evaluations - start_evals,
    )


def _score_base(ev: Evaluator, c0: Candidate, grid: np.ndarray, index: int) -> _Scored | None:
    """Bulk scores of every ΔN row of base ``c0``; None if its plans cannot run at all."""
    plan = ev.make_plan(c0)
    if plan is None or ev.unusable(plan):
        return None
    p, m = plan.num_stages, plan.num_microbatches
    costs = ev.costs(plan)
    one = plan_memory(ev.spec, plan, [1] * p)
    act = np.array([mb.activations for mb in one])
    static = np.array([mb.total for mb in one]) - act
    limits = np.array(device_limits(ev.spec, plan.stage_sites))
    host, host_limits = ev.host_memory(plan)
    host_ok = all(host[s] <= lim for s, lim in host_limits.items())
    host_ratio = max((host[s] / lim for s, lim in host_limits.items()), default=0.0)
    full = np.zeros((len(grid), max(p - 1, 0)), dtype=np.int64)
    if plan.schedule in LOOKAHEAD_FAMILIES:
        full[:, list(plan.wan_boundaries)] = grid
    split = plan.schedule in SPLIT_FAMILIES
    if split:  # memory-capped lists: each ΔN row's own schedule, what a deferred W holds
        in_flight = np.array(
            [
                plan_schedule(replace(plan, delta_n=tuple(int(x) for x in row))).peak_held(
                    W_HELD_FRACTION
                )
                for row in full
            ]
        )
    else:
        in_flight = peak_in_flight_batch(plan.schedule, p, m, full)
    ratio = (static + act * in_flight) / limits
    over = ratio.max(axis=1) if p else np.zeros(len(grid))
    tokens = ev.spec.training.global_batch_size * plan.seq_len
    bound = np.full(len(grid), lower_bound(costs, m, split))
    if plan.schedule in IN_ORDER_FAMILIES:
        bound = np.maximum(bound, in_flight_bound(costs, m, in_flight))
    return _Scored(
        base=np.full(len(grid), index),
        dn=np.arange(len(grid)),
        bound=bound / tokens,
        fits=(over <= 1.0) & host_ok,
        penalty=INFEASIBLE * (1.0 + np.maximum(over, host_ratio)),
    )


def _simulate_in_bound_order(
    ev: Evaluator, bases: list[Candidate], grid: np.ndarray, parts: list[_Scored]
) -> list[Evaluation]:
    """Simulate the candidates that fit, best bound first, until the bound loses by more than
    the tie tolerance; with none feasible, also the least infeasible one."""
    if not parts:
        return []
    base = np.concatenate([x.base for x in parts])
    dn = np.concatenate([x.dn for x in parts])
    bound = np.concatenate([x.bound for x in parts])
    fits = np.concatenate([x.fits for x in parts])
    penalty = np.concatenate([x.penalty for x in parts])

    def candidate(i: int) -> Candidate:
        c = bases[int(base[i])]
        return Candidate(
            c.pipelines,
            c.micro_batch_size,
            c.seq_len,
            tuple(int(x) for x in grid[int(dn[i])]),
            c.codecs,
            c.schedule,
        )

    seen: list[Evaluation] = []
    best = np.inf
    idx = np.flatnonzero(fits)
    for i in idx[np.argsort(bound[idx], kind="stable")]:
        if bound[i] > best * (1 + TIE_TOLERANCE) * (1 + 1e-9):
            break
        e = ev.evaluate(candidate(int(i)))
        seen.append(e)
        if e.feasible:
            best = min(best, e.fitness)
    if not np.isfinite(best) and len(penalty):
        seen.append(ev.evaluate(candidate(int(np.argmin(np.where(fits, np.inf, penalty))))))
    return seen
