"""Replica groups of the outer loop: which sites form them (the site order cut into ``M``
contiguous runs), the spec each one is planned on, and each group's plan at its share of the
global batch, equal or balanced by speed ([Note: batch shares] and [Note: one layout] in
:mod:`geopipe.optimizer.strategy`).

Its own module because this is the groups' planning, done before any outer setting is
priced: :mod:`.strategy` prices every ``(H, F, tau, codec)`` of the grid on the plans these
give and chooses among pipeline, outer and hybrid, while the memoised group plans and the
share re-balancing hold no state of that choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations, islice

from geopipe.config import ClusterSpec
from geopipe.optimizer.errors import PlanningError
from geopipe.optimizer.evaluate import Evaluation
from geopipe.optimizer.grouplayout import common_layout, layout_key, plan_like
from geopipe.optimizer.outerplan import split_tie
from geopipe.optimizer.planner import plan_cluster
from geopipe.plan import Plan

__all__ = [
    "BALANCE_PASSES",
    "MAX_ARRANGEMENTS",
    "GroupPlanner",
    "Grouping",
    "balanced_shares",
    "group_plans",
    "group_spec",
    "site_groupings",
]

MAX_ARRANGEMENTS = 8  # ways to place the longer runs when M does not divide the site count
BALANCE_PASSES = 3  # re-balancings of the groups' batch shares (group_plans)

Grouping = tuple[tuple[str, ...], ...]


def group_spec(spec: ClusterSpec, sites: Sequence[str], batch: int) -> ClusterSpec:
    """The spec one replica group is planned on: its sites and the links between them,
    ``batch`` sequences per inner step (its share of the global batch), strategy ``outer``
    (so its memory holds the outer state)."""
    keep = set(sites)
    training = spec.training.model_copy(update={"global_batch_size": batch})
    return spec.model_copy(
        update={
            "sites": [s for s in spec.sites if s.name in keep],
            "links": [lk for lk in spec.links if lk.src in keep and lk.dst in keep],
            "training": training,
            "plan": spec.plan.model_copy(update={"strategy": "outer"}),
        }
    )


def site_groupings(order: Sequence[str], global_batch: int) -> list[Grouping]:
    """``order`` cut into ``M >= 2`` contiguous runs of near-equal length, for every ``M``
    dividing ``global_batch`` (module docstring)."""
    n, out = len(order), []
    for m in range(2, n + 1):
        if global_batch % m:
            continue
        q, r = divmod(n, m)
        for longer in islice(combinations(range(m), r), MAX_ARRANGEMENTS):
            runs, at = [], 0
            for g in range(m):
                size = q + (g in longer)
                runs.append(tuple(order[at : at + size]))
                at += size
            out.append(tuple(runs))
    return out


class GroupPlanner:
    """Each group's best plan for a share of the global batch, memoised by (sites, batch),
    and in a given layout ([Note: one layout]), memoised by (sites, batch, layout)."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self._plans: dict[tuple[tuple[str, ...], int], Evaluation | str] = {}
        self._like: dict[tuple, Evaluation | str] = {}

    def plan(self, sites: tuple[str, ...], batch: int) -> Evaluation | str:
        """The group's plan, or why it has none."""
        key = (sites, batch)
        if key not in self._plans:
            try:
                best = plan_cluster(group_spec(self.spec, sites, batch)).best
                self._plans[key] = best if best.feasible else best.reason
            except PlanningError as exc:
                self._plans[key] = str(exc)
        return self._plans[key]

    def like(self, sites: tuple[str, ...], batch: int, like: Plan) -> Evaluation | str:
        """The group's plan in ``like``'s layout, or why it has none."""
        key = (sites, batch, layout_key(like))
        if key not in self._like:
            self._like[key] = plan_like(group_spec(self.spec, sites, batch), like)
        return self._like[key]

    def plans(self, grouping: Grouping, shares: Sequence[int]) -> tuple[list[Evaluation], str, str]:
        """Every group's plan, in one layout where launch needs it: ``(evaluations, why
        none, why launch cannot run them)``; ``([], why, "")`` names the first group that
        has no plan."""
        out = []
        for sites, batch in zip(grouping, shares, strict=True):
            e = self.plan(sites, batch)
            if isinstance(e, str):
                return [], f"group {'+'.join(sites)} ({batch} sequences per step): {e}", ""
            out.append(e)

        def replan(g: int, like: Plan) -> Evaluation | str:
            e = self.like(grouping[g], shares[g], like)
            name = "+".join(grouping[g])
            return (
                f"group {name} ({shares[g]} sequences per step): {e}" if isinstance(e, str) else e
            )

        out, stuck = common_layout(out, replan)
        return out, "", stuck or split_tie(self.spec, [e.plan for e in out])


def balanced_shares(
    global_batch: int, speeds: Sequence[float], grains: Sequence[int]
) -> tuple[int, ...] | None:
    """Shares of ``global_batch`` in proportion to the groups' ``speeds`` (sequences per
    second), each a positive multiple of its ``grain`` (the group's pipelines, so it keeps
    a divisible batch), summing to ``global_batch``; None if the grains cannot make it.

    Equal shares leave the fast groups waiting for the slowest at every exchange (a site of
    3× the FLOP/s idles two thirds of the time); shares in proportion to speed make the
    groups' inner steps equally long. Greedy: round every ideal share down to its grain, then
    give a grain at a time to the group whose step stays shortest with it.
    """
    total = sum(speeds)
    shares = [
        max(g, int(global_batch * v / total) // g * g) for v, g in zip(speeds, grains, strict=True)
    ]
    for _ in range(len(shares) * global_batch):  # bounded: each pass moves one grain
        rest = global_batch - sum(shares)
        if rest == 0:
            return tuple(shares)
        if rest > 0:
            options = [i for i, g in enumerate(grains) if g <= rest]
            if not options:
                return None
            i = min(options, key=lambda i: (shares[i] + grains[i]) / speeds[i])
            shares[i] += grains[i]
        else:
            options = [i for i, g in enumerate(grains) if shares[i] > g]
            if not options:
                return None
            i = max(options, key=lambda i: shares[i] / speeds[i])
            shares[i] -= grains[i]
    return None


def group_plans(
    spec: ClusterSpec, grouping: Grouping, groups: GroupPlanner
) -> list[tuple[list[Evaluation], str, str]]:
    """The groups' plans with equal shares (``global_batch / M``), then with shares in
    proportion to their speed (re-balanced from the plans they give, up to
    :data:`BALANCE_PASSES` times: a group's speed moves with its share, its optimizer step
    being paid once per step whatever the share), each share a multiple of its group's
    pipelines × micro-batch ([Note: one layout]): ``(evaluations, why not, why launch
    cannot run them)`` each."""
    gbs, m = spec.training.global_batch_size, len(grouping)
    plans, why, stuck = groups.plans(grouping, [gbs // m] * m)
    out, seen = [(plans, why, stuck)], {(gbs // m,) * m}
    for _ in range(BALANCE_PASSES):
        if why:
            break
        speeds = [e.tokens_per_iteration / e.plan.seq_len / e.iteration_time_s for e in plans]
        grains = [e.plan.pipelines * e.plan.micro_batch_size for e in plans]
        shares = balanced_shares(gbs, speeds, grains)
        if shares is None or shares in seen:
            break
        seen.add(shares)
        plans, why, stuck = groups.plans(grouping, shares)
        out.append((plans, why, stuck))
    return out
