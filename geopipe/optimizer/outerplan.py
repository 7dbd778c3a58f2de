"""From the strategy table's chosen outer loop to what a launch runs.

The strategy table (:mod:`.strategy`) plans each replica group with today's search; a launch
runs them as one plan: a mixed plan whose pipelines are listed group by group, with
:attr:`Plan.groups` naming each pipeline's group ([Note: replica groups] in
:mod:`geopipe.plan`), and the outer loop's settings beside it. Placement, wiring, ZeRO-1
groups (per site, so never across groups) and the data slices (each group one contiguous
slice of every global batch) are the mixed plan's as they are.

What the runtime runs today, and refuses otherwise with the reason (the planner still
prices every candidate):

* groups of one layout — the same stages, layer split, pipelines per group, micro-batch
  size, sequence length and schedule — so that every replica's ZeRO-1 partition has a peer
  of the same shape in every other group (the exchange goes partition by partition,
  :mod:`geopipe.runtime.actor.outer`); their batch shares (micro-batches per step) may
  differ, the outer average then weighted by share;
* no tied embedding split over two stages (its two copies sit at different offsets of two
  partitions, and a lossy codec would let them drift apart).
"""

from __future__ import annotations

from dataclasses import dataclass

from geopipe.config import ClusterSpec, OuterSetting
from geopipe.optimizer.errors import PlanningError
from geopipe.optimizer.evaluate import Evaluation
from geopipe.plan import PipelineLayout, Plan

__all__ = ["OuterRun", "outer_run", "split_tie", "unlaunchable"]


@dataclass(frozen=True)
class OuterRun:
    """The plan every group runs (one mixed plan with groups) and the outer loop's knobs."""

    plan: Plan
    setting: OuterSetting
    lr: float
    momentum: float
    round_s: float  # the planner's prediction of one round (H inner steps and the exchange)
    # Each group's sites and the evaluation its plan was chosen by (the strategy table's),
    # so that calibration re-prices the round with measured figures
    # (geopipe.runtime.control.outercal).
    groups: tuple[tuple[str, ...], ...] = ()
    evaluations: tuple[Evaluation, ...] = ()
    control_s: float = 0.0  # of round_s: the driver's calls (outer_cost)

    @property
    def h(self) -> int:
        return self.setting.h

    def to_dict(self) -> dict:
        s = self.setting
        return {
            "h": s.h,
            "fragments": s.fragments,
            "overlap": s.overlap,
            "codec": s.codec,
            "lr": self.lr,
            "momentum": self.momentum,
            "groups": self.plan.num_groups,
            "round_s": self.round_s,
            "control_s": self.control_s,
        }


def outer_run(spec: ClusterSpec, chosen: object) -> OuterRun:
    """The run of the strategy table's ``chosen`` outer candidate
    (:class:`~geopipe.optimizer.strategy.StrategyOption`); :class:`PlanningError` says why the
    runtime cannot run it yet."""
    plans = [e.plan for e in chosen.evaluations]
    if any(p is None for p in plans) or chosen.setting is None or chosen.round is None:
        raise PlanningError(f"{chosen.label}: not a feasible outer candidate")
    first = plans[0]
    why = unlaunchable(plans)
    if why:
        raise PlanningError(f"{chosen.label}: {why}")
    if why := split_tie(spec, plans):
        raise PlanningError(f"{chosen.label}: {why}")
    mix, groups = [], []
    for g, p in enumerate(plans):
        for _ in range(p.pipelines):
            mix.append(
                PipelineLayout(
                    p.stage_sites,
                    p.partition,
                    p.num_microbatches,
                    p.delta_n,
                    p.codecs,
                    p.inflight_caps,
                )
            )
            groups.append(g)
    plan = Plan(
        pipelines=len(mix),
        stage_sites=first.stage_sites,
        partition=first.partition,
        micro_batch_size=first.micro_batch_size,
        seq_len=first.seq_len,
        num_microbatches=first.num_microbatches,
        schedule=first.schedule,
        delta_n=first.delta_n,
        codecs=first.codecs,
        inflight_caps=first.inflight_caps,
        mix=tuple(mix),
        groups=tuple(groups),
    )
    s = chosen.setting
    cost = chosen.round
    groups = tuple(tuple(g) for g in chosen.groups)
    evals = tuple(chosen.evaluations)
    return OuterRun(plan, s, s.lr, s.momentum, cost.round_s, groups, evals, cost.control_s)


def unlaunchable(plans: list[Plan]) -> str:
    """Why launch cannot run replica groups of ``plans`` (one per group), or "": every
    group's stages, layers and ZeRO-1 partitions must be alike (each partition exchanges
    with its peer of the same shape in every other group); their batch shares (micro-batches
    per step) may differ ([Note: batch shares] in :mod:`geopipe.optimizer.strategy`)."""
    first = plans[0]
    for g, p in enumerate(plans[1:], start=1):
        if _layout(p) != _layout(first):
            return (
                f"group {g}'s plan ({p.describe()}, layers {list(p.partition)}, micro-batch "
                f"{p.micro_batch_size}) differs from group 0's ({first.describe()}, layers "
                f"{list(first.partition)}, micro-batch {first.micro_batch_size}): launch runs "
                "groups of one layout only (each ZeRO-1 partition needs a peer of its shape)"
            )
    return ""


def split_tie(spec: ClusterSpec, plans: list[Plan]) -> str:
    """Why launch cannot run ``plans`` for ``spec``'s model, or "": a tied embedding whose
    two copies sit on two stages (module docstring)."""
    if spec.model.tie_embeddings and plans and plans[0].num_stages > 1:
        return (
            "model.tie_embeddings with the embedding and the head on two stages: the outer "
            "loop does not yet keep a split tied embedding's copies equal"
        )
    return ""


def _layout(p: Plan) -> tuple:
    return (p.pipelines, p.num_stages, p.partition, p.micro_batch_size, p.seq_len, p.schedule)
