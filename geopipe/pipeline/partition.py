"""Contiguous layer partitions and the order of sites along a pipeline.

Pure functions; the planner calls them once per candidate shape (results are cached there).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence

__all__ = ["balanced_partition", "order_sites", "stage_time_bottleneck"]

_REL_TOL = 1e-12  # rounding slack of prefix sums; the answer is optimal to this precision
_MAX_STEPS = 200  # bisection steps; ~45 suffice unless speeds span many orders of magnitude


def stage_time_bottleneck(
    layer_costs: Sequence[float], speeds: Sequence[float], parts: Sequence[tuple[int, int]]
) -> float:
    """The slowest stage's time: max over stages of (sum of its layer costs) / speed."""
    return max(sum(layer_costs[a:b]) / v for (a, b), v in zip(parts, speeds, strict=True))


def _feasible(prefix: Sequence[float], speeds: Sequence[float], limit: float) -> list[int] | None:
    """Cut points of a partition whose every stage takes at most ``limit`` (None if none does).

    Exact for any speeds: a greedy "fill each stage" cut is not (a big layer may land on a
    slow stage), so stage by stage we keep every position where the stage can end, as sorted
    disjoint intervals. A stage may run from ``i`` to any ``j`` with
    ``prefix[j] <= prefix[i] + budget``; the largest such ``j`` grows with ``i``, so a run of
    starts whose first layer fits reaches one contiguous range of ends. Typically the sets
    stay a single interval, making a test O(p log n) instead of O(p n).
    """
    n, p = len(prefix) - 1, len(speeds)
    budgets = [limit * v * (1 + _REL_TOL) for v in speeds]
    too_big: dict[float, list[int]] = {}  # per budget: starts whose first layer alone exceeds it
    history: list[list[tuple[int, int]]] = [[(0, 0)]]
    for k in range(p - 1):
        budget = budgets[k]
        big = too_big.get(budget)
        if big is None:
            big = too_big[budget] = [i for i in range(n) if not prefix[i + 1] <= prefix[i] + budget]
        last_end = n - (p - k - 1)  # leave at least one layer for every later stage
        ends: list[tuple[int, int]] = []
        for a, b in history[-1]:
            b = min(b, last_end - 1)
            cur = a
            idx = bisect.bisect_left(big, a)
            while cur <= b:
                if idx < len(big) and big[idx] <= b:
                    run_end, nxt = big[idx] - 1, big[idx] + 1
                    idx += 1
                else:
                    run_end, nxt = b, b + 1
                if run_end >= cur:
                    r = bisect.bisect_right(prefix, prefix[run_end] + budget) - 1
                    lo, hi = cur + 1, min(r, last_end)
                    if ends and lo <= ends[-1][1] + 1:
                        ends[-1] = (ends[-1][0], max(ends[-1][1], hi))
                    else:
                        ends.append((lo, hi))
                cur = nxt
        if not ends:
            return None
        history.append(ends)
    # Walk back from the end: each stage takes the latest reachable start that fits.
    cuts = [n]
    j = n
    for k in range(p - 1, -1, -1):
        budget, pj = budgets[k], prefix[j]
        first = bisect.bisect_left(prefix, True, 0, j, key=lambda v, pj=pj, b=budget: pj <= v + b)
        reach = history[k]
        pos = bisect.bisect_right(reach, (j - 1, n + 1)) - 1  # last interval starting < j
        if pos < 0 or reach[pos][1] < first:
            return None
        j = min(reach[pos][1], j - 1)
        cuts.append(j)
    cuts.reverse()
    return cuts


def balanced_partition(
    layer_costs: Sequence[float], speeds: Sequence[float]
) -> list[tuple[int, int]]:
    """Split layers into ``len(speeds)`` contiguous non-empty stages minimising the slowest.

    ``speeds[k]`` is stage k's device speed (any unit); a stage's time is its cost / speed.
    Geometric bisection on the bottleneck with the exact test :func:`_feasible`; every
    feasible answer snaps the upper end down to a bottleneck some partition really has, and
    we stop when the bracket is within rounding (relative 1e-12) of the optimum.
    """
    n, p = len(layer_costs), len(speeds)
    if p < 1 or p > n:
        raise ValueError(f"cannot split {n} layers into {p} non-empty stages")
    if any(not v > 0 or not math.isfinite(v) for v in speeds):
        raise ValueError("stage speeds must be positive")
    if any(not c >= 0 or not math.isfinite(c) for c in layer_costs):
        raise ValueError("layer costs must be finite and non-negative")
    prefix = [0.0, *itertools.accumulate(layer_costs)]
    total = prefix[-1]
    # Every stage's cost is at most the total, so this limit always admits a partition.
    best = _feasible(prefix, speeds, total / min(speeds))
    if best is None:  # unreachable, but never return nothing: one layer per stage
        best = [*range(p), n]
    hi = best_t = _bottleneck(layer_costs, speeds, best)
    # No partition beats the biggest layer on the fastest device or perfect balance.
    lo = max(max(layer_costs) / max(speeds), total / sum(speeds))
    for _ in range(_MAX_STEPS):
        if hi <= lo * (1 + _REL_TOL) or lo <= 0:
            break
        mid = math.sqrt(lo * hi)
        cuts = _feasible(prefix, speeds, mid)
        if cuts is None:
            lo = mid
            continue
        t = _bottleneck(layer_costs, speeds, cuts)
        if t < best_t:
            best, best_t = cuts, t
        hi = min(t, mid)
    return [(best[k], best[k + 1]) for k in range(p)]


def _bottleneck(costs: Sequence[float], speeds: Sequence[float], cuts: Sequence[int]) -> float:
    return max(sum(costs[cuts[k] : cuts[k + 1]]) / v for k, v in enumerate(speeds))


def order_sites(names: Sequence[str], hop_cost: Callable[[str, str], float | None]) -> list[str]:
    """The order of sites along the pipeline that minimises the summed hop cost.

    ``hop_cost(a, b)`` is the cost of one hop between adjacent sites (both directions
    together) or None where no link exists. An open travelling-salesman path (as DT-FM
    frames the pipeline's site order), solved exactly with Held–Karp: sites are few.
    Ties resolve to the lexicographically smallest order, so plans are deterministic.
    """
    n = len(names)
    if n <= 1:
        return list(names)
    inf = float("inf")
    cost = [[inf] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j:
                c = hop_cost(names[i], names[j])
                cost[i][j] = inf if c is None else c
    # best[mask][j] = (cost, path) of the cheapest path visiting `mask` and ending at j.
    best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
    for i in range(n):
        best[(1 << i, i)] = (0.0, (i,))
    for mask in range(1, 1 << n):
        for j in range(n):
            cur = best.get((mask, j))
            if cur is None:
                continue
            for nxt in range(n):
                if mask & (1 << nxt) or cost[j][nxt] == inf:
                    continue
                cand = (cur[0] + cost[j][nxt], (*cur[1], nxt))
                key = (mask | (1 << nxt), nxt)
                old = best.get(key)
                if old is None or cand < old:
                    best[key] = cand
    full = (1 << n) - 1
    ends = [best[(full, j)] for j in range(n) if (full, j) in best]
    if not ends:
        raise ValueError("the links do not connect the sites into one chain")
    _, path = min(ends)
    return [names[i] for i in path]
