"""One layout for every replica group of an outer candidate ([Note: one layout] in
:mod:`.strategy`).

Launch runs replica groups whose plans share a layout — pipelines, stages, layer partition,
micro-batch size, sequence length, schedule — so that every ZeRO-1 partition has a peer of
its shape in every other group (:func:`~geopipe.optimizer.outerplan.unlaunchable` says when
they do not). Each group planned on its own may come out in another layout (a site of small
devices prefers deeper pipelines), so the strategy table re-plans them in one common layout:
every group's spec with ``plan.pipelines``, ``plan.micro_batch_size``, ``plan.seq_len`` and
``plan.schedule`` fixed to the layout's, its partition imposed on the plans the search builds
(:class:`_Forced`); ΔN and the codecs are still searched per group (they live in each
pipeline's entry of the mixed plan launch builds). Each distinct layout of the groups is
tried; the fastest that every group fits is kept — by the groups' sequences per second each
at its own pace, which the re-balanced shares that follow turn into one pace, not by the
slowest at the shares of the moment — ties within the planner's
:data:`~geopipe.optimizer.evaluate.TIE_TOLERANCE` going to the layout most groups chose.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

from geopipe.config import ClusterSpec
from geopipe.optimizer.errors import PlanningError
from geopipe.optimizer.evaluate import TIE_TOLERANCE, Candidate, Evaluation, Evaluator
from geopipe.optimizer.exhaustive import exhaustive_search
from geopipe.optimizer.genetic import genetic_search
from geopipe.optimizer.memory import inflight_caps
from geopipe.optimizer.outerplan import unlaunchable
from geopipe.pipeline.schedule import family
from geopipe.plan import Plan

__all__ = ["EXHAUSTIVE_UP_TO", "common_layout", "layout_key", "plan_like", "with_partition"]

# With pipelines, micro-batch and sequence length fixed only ΔN and the codecs are left:
# spaces this small are scored faster in bulk than evolved.
EXHAUSTIVE_UP_TO = 4096

LayoutKey = tuple


def layout_key(p: Plan) -> LayoutKey:
    """What groups of one layout share (``unlaunchable`` stays the judge)."""
    return (p.pipelines, p.num_stages, p.partition, p.micro_batch_size, p.seq_len, p.schedule)


class _Forced(Evaluator):
    """The planner's Evaluator with every plan's layer partition fixed to ``partition``
    (the balanced split of another group's sites); costs, memory and feasibility are the
    planner's own."""

    def __init__(self, spec: ClusterSpec, schedule: str, partition: tuple) -> None:
        super().__init__(spec, schedule=schedule)
        self.partition = partition

    def make_plan(self, c: Candidate) -> Plan | None:
        plan = super().make_plan(c)
        if plan is None or plan.partition == self.partition:
            return plan
        return with_partition(self.spec, plan, self.partition)


def with_partition(spec: ClusterSpec, plan: Plan, partition: Sequence[tuple[int, int]]) -> Plan:
    """``plan`` with its layer split replaced: every other field kept (``replace``, so a
    field added to :class:`~geopipe.plan.Plan` is never dropped here) except the in-flight
    caps, which follow from each stage's layers and are recomputed as
    :func:`~geopipe.optimizer.shapes.build_plan` computes them."""
    forced = replace(plan, partition=tuple(partition), inflight_caps=())
    if family(plan.schedule).memory_caps:
        forced = replace(forced, inflight_caps=tuple(inflight_caps(spec, forced)))
    return forced


def plan_like(spec: ClusterSpec, like: Plan) -> Evaluation | str:
    """The best plan of ``spec`` (a group's) in ``like``'s layout, or why it has none."""
    fixed = {
        "pipelines": like.pipelines,
        "micro_batch_size": like.micro_batch_size,
        "seq_len": like.seq_len,
        "schedule": like.schedule,
    }
    spec = spec.model_copy(update={"plan": spec.plan.model_copy(update=fixed)})
    d, b, batch = like.pipelines, like.micro_batch_size, spec.training.global_batch_size
    if batch % (d * b):
        return f"its share is not a multiple of {d} pipelines × micro-batch {b}"
    try:
        ev = _Forced(spec, like.schedule, like.partition)
    except PlanningError as exc:
        return str(exc)
    shape = ev.shapes.get(d)
    if shape is None:
        return f"its sites cannot hold {d} pipelines"
    if shape.num_stages != like.num_stages:
        return f"{d} pipeline(s) on its sites have {shape.num_stages} stages, not {like.num_stages}"
    small = ev.space.size(batch) <= EXHAUSTIVE_UP_TO
    best = (exhaustive_search(ev) if small else genetic_search(ev)).best
    return best if best.feasible else best.reason


def _speed(evals: Sequence[Evaluation]) -> float:
    """The groups' sequences per second, each at its own pace: what shares in proportion to
    speed make of them (:func:`~geopipe.optimizer.groups.balanced_shares` follows), not
    the pace of the slowest at these shares."""
    return sum(e.tokens_per_iteration / e.plan.seq_len / e.iteration_time_s for e in evals)


def common_layout(
    evals: list[Evaluation], replan: Callable[[int, Plan], Evaluation | str]
) -> tuple[list[Evaluation], str]:
    """``evals`` (one per group) if launch can run them, else the groups re-planned in one
    layout (module docstring) by ``replan(group, like)`` (an evaluation, or why the group
    has none, naming it); ``(evals, why)`` where no layout fits them all (``why`` names the
    layout most groups chose and the group it does not fit)."""
    why = unlaunchable([e.plan for e in evals])
    if not why:
        return evals, ""
    counts = Counter(layout_key(e.plan) for e in evals)
    order = sorted(counts, key=lambda k: -counts[k])  # stable: ties keep group order
    best: list[Evaluation] | None = None
    refusals = []
    for key in order:
        like = next(e.plan for e in evals if layout_key(e.plan) == key)
        forced, refused = [], ""
        for g, e in enumerate(evals):
            f = e if layout_key(e.plan) == key else replan(g, like)
            if isinstance(f, str):
                refused = f
                break
            forced.append(f)
        if refused or unlaunchable([f.plan for f in forced]):
            refusals.append(refused or unlaunchable([f.plan for f in forced]))
            continue
        if best is None or _speed(forced) > _speed(best) * (1 + TIE_TOLERANCE):
            best = forced
    if best is not None:
        return best, ""
    like = next(e.plan for e in evals if layout_key(e.plan) == order[0])
    return evals, (
        f"{why}; no one layout fits every group (in {like.describe()}, micro-batch "
        f"{like.micro_batch_size}, {refusals[0]})"
    )
