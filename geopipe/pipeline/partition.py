"""Contiguous layer partitions and the order of sites along a pipeline.

Pure functions; the planner calls them once per candidate shape (results are cached there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["balanced_partition", "order_sites", "stage_time_bottleneck"]


def stage_time_bottleneck(
    layer_costs: Sequence[float], speeds: Sequence[float], parts: Sequence[tuple[int, int]]
) -> float:
    """The slowest stage's time: max over stages of (sum of its layer costs) / speed."""
    return max(sum(layer_costs[a:b]) / v for (a, b), v in zip(parts, speeds, strict=True))


def _greedy(costs: Sequence[float], speeds: Sequence[float], limit: float) -> list[int] | None:
    """Cut points packing each stage as full as ``limit`` allows (None if impossible).

    Packing the earliest stage as full as possible never hurts the later ones (they get a
    suffix of fewer layers), so greedy decides feasibility exactly; we only keep at least
    one layer for every later stage.
    """
    n, p = len(costs), len(speeds)
    cuts = [0]
    i = 0
    for k in range(p):
        budget = limit * speeds[k]
        must_leave = p - k - 1
        load = 0.0
        j = i
        while j < n - must_leave and load + costs[j] <= budget * (1 + 1e-12):
            load += costs[j]
            j += 1
        if j == i:
            return None
        cuts.append(j)
        i = j
    return cuts if i == n else None


def balanced_partition(
    layer_costs: Sequence[float], speeds: Sequence[float]
) -> list[tuple[int, int]]:
    """Split layers into ``len(speeds)`` contiguous non-empty stages minimising the slowest.

    ``speeds[k]`` is stage k's device speed (any unit); a stage's time is its cost / speed.
    Bisection on the bottleneck with an exact greedy feasibility test.
    """
    n, p = len(layer_costs), len(speeds)
    if p < 1 or p > n:
        raise ValueError(f"cannot split {n} layers into {p} non-empty stages")
    if any(v <= 0 for v in speeds):
        raise ValueError("stage speeds must be positive")
    lo = max(max(layer_costs) / max(speeds), sum(layer_costs) / sum(speeds)) * (1 - 1e-9)
    hi = sum(layer_costs) / min(speeds)
    best = _greedy(layer_costs, speeds, hi)
    if best is None:  # every layer on the slowest device still fails: one layer per stage
        best = [*range(p), n]
    for _ in range(100):
        if hi - lo <= hi * 1e-9:
            break
        mid = (lo + hi) / 2
        cuts = _greedy(layer_costs, speeds, mid)
        if cuts is None:
            lo = mid
        else:
            hi, best = mid, cuts
    return [(best[k], best[k + 1]) for k in range(p)]


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
