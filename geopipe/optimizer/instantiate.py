"""Heterogeneous instantiation: pipelines of possibly different templates over the alive
devices, with the global batch split so they finish together (Oobleck's instantiation).

[Note: heterogeneous pipelines] Templates may be mixed, but only templates that put every
layer in the same site: then each layer's replicas sit in one site and gradient reduction
never crosses a WAN link — the invariant the cost model assumes. The runtime runs such
mixes (:mod:`geopipe.optimizer.mixes` builds template sets that share a layer split and
picks the mix; :mod:`geopipe.runtime.actor.sitegroups` forms their ZeRO-1 groups).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from geopipe.optimizer.templates import (
    Template,
    TemplateSet,
    Vector,
    best_uniform,
    check_batch,
    copies,
)

__all__ = ["Instantiation", "PipelineAssignment", "instantiate", "split_microbatches"]

# Exhaustive while it needs at most this many (vector, pipelines) predictions (each a
# simulation), else a hill climb of at most this many steps.
_MAX_EXHAUSTIVE_PREDICTIONS = 96
_MAX_CLIMB_STEPS = 32


@dataclass(frozen=True)
class PipelineAssignment:
    """One instantiated pipeline: its template and its share of the micro-batches."""

    template: Template
    num_microbatches: int
    predicted_time_s: float  # as one of this instantiation's pipelines
    per_microbatch_s: float  # its steady-state time per extra micro-batch, likewise


@dataclass(frozen=True)
class Instantiation:
    """Pipelines covering the alive devices, with the global batch split among them."""

    pipelines: tuple[PipelineAssignment, ...]
    micro_batch_size: int
    iteration_time_s: float  # the slowest pipeline's predicted time
    devices_used: dict[str, int]

    @property
    def uniform(self) -> bool:
        """True when all pipelines share one template (their shares may still differ)."""
        return len({p.template.stages_per_site for p in self.pipelines}) == 1


def split_microbatches(lines: list[tuple[float, float]], total: int) -> list[int]:
    """Split ``total`` micro-batches over pipelines so they finish together.

    ``lines[i] = (fixed_s, per_microbatch_s)``: pipeline i takes ``fixed + per·m`` seconds.
    Every pipeline gets ≥ 1 and the shares sum to ``total``; the slowest finish is minimal
    (water-filling: each next micro-batch goes where it ends earliest), so shares are
    proportional to speed up to rounding.
    """
    k = len(lines)
    if k < 1 or total < k:
        raise ValueError(f"cannot give {k} pipelines at least one of {total} micro-batches")
    if any(not g > 0 for _, g in lines):
        raise ValueError("per-micro-batch times must be positive")
    # Continuous water level first (bisection), then hand out the rest one by one.
    lo, hi = 0.0, max(f + g * total for f, g in lines)
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(max(1.0, (mid - f) / g) for f, g in lines) >= total:
            hi = mid
        else:
            lo = mid
    shares = [max(1, math.floor((lo - f) / g)) for f, g in lines]
    while sum(shares) > total:  # rounding slack: take back from the latest finisher
        i = max((i for i in range(k) if shares[i] > 1), key=lambda i: _finish(lines, shares, i))
        shares[i] -= 1
    heap = [(lines[i][0] + lines[i][1] * (shares[i] + 1), i) for i in range(k)]
    heapq.heapify(heap)
    for _ in range(total - sum(shares)):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, (lines[i][0] + lines[i][1] * (shares[i] + 1), i))
    return shares


def _finish(lines: list[tuple[float, float]], shares: list[int], i: int) -> float:
    return lines[i][0] + lines[i][1] * shares[i]


Combo = tuple[tuple[Vector, int], ...]  # (vector, copies) pairs, sorted


class _Scorer:
    """Predicted iteration time of template combinations (lines memoised per (v, k))."""

    def __init__(self, ts: TemplateSet, total: int) -> None:
        self.ts = ts
        self.total = total
        self.lines: dict[tuple[Vector, int], tuple[float, float] | None] = {}

    def line(self, v: Vector, k: int) -> tuple[float, float] | None:
        """(fixed, per-micro-batch) seconds of ``v`` as one of ``k`` pipelines, or None."""
        key = (v, k)
        if key not in self.lines:
            m = max(1, self.total // k)
            pr = self.ts.predict(v, k, m)
            if pr is None or not pr.feasible:
                self.lines[key] = None
            else:
                g = max(pr.per_microbatch_s, 1e-12)
                self.lines[key] = (pr.iteration_time_s - g * m, g)
        return self.lines[key]

    def time(self, combo: Combo) -> float:
        """The slowest pipeline's time once the micro-batches are split (inf: infeasible)."""
        k = sum(n for _, n in combo)
        if k < 1 or k > self.total:
            return math.inf
        lines: list[tuple[float, float]] = []
        for v, n in combo:
            ln = self.line(v, k)
            if ln is None:
                return math.inf
            lines += [ln] * n
        shares = split_microbatches(lines, self.total)
        return max(f + g * m for (f, g), m in zip(lines, shares, strict=True))


def _combos(group: list[Vector], left: Vector, room: int) -> Iterator[Combo]:
    """Every non-empty combination of ``group``'s templates within ``left`` devices and
    at most ``room`` pipelines."""
    if not group:
        return
    v, rest = group[0], group[1:]
    for n in range(min(copies(v, left), room), -1, -1):
        if n:
            yield ((v, n),)
        rem = tuple(a - n * x for a, x in zip(left, v, strict=True))
        for tail in _combos(rest, rem, room - n):
            yield ((v, n), *tail) if n else tail


def _exhaustive_cost(groups: list[list[Vector]], alive: Vector, total: int) -> int:
    """An upper bound on the (vector, pipelines) predictions an exhaustive search needs."""
    cost = 0
    for group in groups:
        k_max = min(total, sum(copies(v, alive) for v in group))
        cost += len(group) * k_max
    return cost


def _hill_climb(
    sc: _Scorer, group: list[Vector], alive: Vector, start: Combo
) -> tuple[float, Combo]:
    """Improve ``start`` by adding, removing or swapping one pipeline while that helps."""
    best, best_t = dict(start), sc.time(start)
    for _ in range(_MAX_CLIMB_STEPS):
        used = tuple(sum(n * v[j] for v, n in best.items()) for j in range(len(alive)))
        moves: list[dict[Vector, int]] = []
        for w in group:
            if all(u + x <= a for u, x, a in zip(used, w, alive, strict=True)):
                moves.append({**best, w: best.get(w, 0) + 1})
        for v in best:
            less = {**best, v: best[v] - 1}
            moves.append(less)
            freed = tuple(u - x for u, x in zip(used, v, strict=True))
            for w in group:
                fits = all(u + x <= a for u, x, a in zip(freed, w, alive, strict=True))
                if w != v and fits:
                    moves.append({**less, w: less.get(w, 0) + 1})
        step_t, step = best_t, None
        for mv in moves:
            t = sc.time(tuple(sorted((v, n) for v, n in mv.items() if n)))
            if t < step_t * (1 - 1e-12):
                step_t, step = t, mv
        if step is None:
            break
        best, best_t = {v: n for v, n in step.items() if n}, step_t
    return best_t, tuple(sorted(best.items()))


def instantiate(
    templates: TemplateSet,
    devices_alive: Mapping[str, int],
    global_batch: int | None = None,
    micro_batch: int | None = None,
) -> Instantiation | None:
    """Pipelines (possibly of different templates) with the best predicted throughput.

    Templates in one instantiation must agree on every layer's site (see the module note),
    so combinations are drawn from one group of such templates at a time, and scored with
    their micro-batches split by :func:`split_microbatches`. With ``k`` pipelines each is
    costed as one of ``k`` (ZeRO-1 over the ``k`` replicas of a layer, WAN links shared
    ``k`` ways), so every pipeline count needs its own simulation: when all combinations
    need at most :data:`_MAX_EXHAUSTIVE_PREDICTIONS` of them the search is exhaustive (small
    clusters), otherwise it hill-climbs from the best uniform choice by adding, removing or
    swapping one pipeline. The best uniform choice is always a candidate. None if nothing
    fits.
    """
    ts = templates
    total = check_batch(ts, global_batch, micro_batch)
    alive = ts.vector(devices_alive)
    groups: dict[tuple[str, ...], list[Vector]] = {}
    for v in ts.candidate_vectors(alive):
        t = ts.template(v)
        if t is not None:
            groups.setdefault(t.layer_sites, []).append(v)
    sc = _Scorer(ts, total)
    best_t, best_combo = math.inf, ()
    uni = best_uniform(ts, devices_alive, total * ts.micro_batch_size)
    if uni is not None:
        best_combo = ((uni[0].stages_per_site, uni[1]),)
        best_t = sc.time(best_combo)
    if _exhaustive_cost(list(groups.values()), alive, total) <= _MAX_EXHAUSTIVE_PREDICTIONS:
        for group in groups.values():
            for combo in _combos(sorted(group), alive, total):
                t = sc.time(combo)
                if t < best_t * (1 - 1e-12):
                    best_t, best_combo = t, combo
    elif uni is not None:
        group = groups.get(uni[0].layer_sites, [uni[0].stages_per_site])
        best_t, best_combo = _hill_climb(sc, group, alive, best_combo)
    if not best_combo or not math.isfinite(best_t):
        return None
    return _instantiation(ts, sc, dict(best_combo), total)


def _instantiation(
    ts: TemplateSet, sc: _Scorer, combo: dict[Vector, int], total: int
) -> Instantiation:
    k = sum(combo.values())
    order = sorted(combo)
    lines = []
    for v in order:
        ln = sc.line(v, k)
        assert ln is not None
        lines += [ln] * combo[v]
    shares = split_microbatches(lines, total)
    pipes: list[PipelineAssignment] = []
    i = 0
    for v in order:
        tmpl = ts.template(v)
        assert tmpl is not None
        for _ in range(combo[v]):
            pr = ts.predict(v, k, shares[i])
            assert pr is not None
            pipes.append(
                PipelineAssignment(tmpl, shares[i], pr.iteration_time_s, pr.per_microbatch_s)
            )
            i += 1
    used = {s: sum(n * v[j] for v, n in combo.items()) for j, s in enumerate(ts.sites)}
    return Instantiation(
        pipelines=tuple(pipes),
        micro_batch_size=ts.micro_batch_size,
        iteration_time_s=max(p.predicted_time_s for p in pipes),
        devices_used={s: n for s, n in used.items() if n},
    )
