"""The driver's side of an outer-loop run's checkpoints ([Note: the outer-loop checkpoint] in
:mod:`geopipe.checkpoint.outer`): which actor writes which shard, the manifest's ``outer``
entry, what a launch checks, and the outer state's restore on ``--resume``.

A save is the ordinary one (:mod:`.checkpointing`, :mod:`.sitecopies`) over *shard rows*:
row ``g * S + k`` is group ``g``'s replicas of stage ``k`` (its first writes, the others
stand in), so each group's shards are written inside the group's own sites and nothing of
one group's state travels to another's actors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from geopipe.checkpoint.outer import OUTER_KEY, outer_entry, outer_layout
from geopipe.checkpoint.store import CheckpointError, load_checkpoint
from geopipe.outer.fragments import StreamingSchedule
from geopipe.runtime.control.cluster import LaunchError
from geopipe.runtime.control.workers import Workers

__all__ = [
    "check_outer_launch",
    "in_flight",
    "outer_manifest",
    "restore_outer",
    "shard_rows",
    "shard_sites",
]


def in_flight(schedule: StreamingSchedule, step: int) -> bool:
    """Whether a fragment is in flight once ``step`` inner steps have run: its send has
    started (after step ``apply - overlap``) and its apply (after step ``apply``) has not."""
    nxt = (step // schedule.period + 1) * schedule.period  # the next apply after ``step``
    return schedule.overlap > 0 and nxt - schedule.overlap <= step


def shard_rows(rows: list[list[Any]], group_of: Callable[[Any], int] | None) -> list[list[Any]]:
    """The actors of each shard, ``[shard][replica]``, writer first: ``rows`` (``[stage]
    [pipeline]``) as they are for a pipeline run (``group_of`` None), regrouped as
    ``i * S + k`` for the ``i``-th of the groups present (by their stable ids, which is how
    each actor numbers its shard: :func:`~geopipe.runtime.actor.outer_ckpt.shard_of`)."""
    if group_of is None:
        return rows
    groups = sorted({group_of(a) for row in rows for a in row})
    return [[a for a in row if group_of(a) == g] for g in groups for row in rows]


def shard_sites(shards: list[list[Any]], actor_sites: list[tuple[Any, str]]) -> list[str]:
    """The site of each shard's writer (its first actor)."""
    site = {id(a): s for a, s in actor_sites}
    return [site[id(row[0])] for row in shards]


def outer_manifest(outer: Any, groups: list[int]) -> dict[str, Any]:
    """The manifest's ``outer`` entry of an :class:`~.outerloop.OuterRounds` run whose
    checkpoint holds ``groups`` (stable ids: the live ones)."""
    run = outer.run
    entry = outer_entry(len(groups), run.plan.num_stages, run.to_dict())
    return {OUTER_KEY: {**entry, "group_ids": list(groups)}}


def check_outer_launch(spec: Any, outer: Any, resume: Any) -> None:
    """Launch-time checks of an outer-loop run (``outer``: its
    :class:`~geopipe.optimizer.outerplan.OuterRun`, None for a pipeline run): its last step
    must not fall while a fragment is in flight (its final checkpoint could not hold it),
    and a resumed outer-loop checkpoint must have as many groups."""
    if outer is None:
        return
    s = outer.setting
    schedule = StreamingSchedule(s.h, s.fragments, s.overlap)
    steps = spec.training.steps
    if in_flight(schedule, steps):
        raise LaunchError(
            f"training.steps (or --steps): {steps} ends while a fragment of the outer loop "
            f"is in flight (plan.outer.overlap {s.overlap}: sent {s.overlap} step(s) before "
            f"its apply, every {schedule.period} steps), so the final checkpoint could not "
            "hold it; end at a step outside those windows, e.g. a multiple of plan.outer.h"
        )
    if resume is None:
        return
    try:
        manifest = load_checkpoint(Path(resume.path), verify=False).manifest
        layout = outer_layout(manifest)
    except CheckpointError as exc:
        raise LaunchError(f"--resume: {exc}") from None
    if layout is not None and layout[0] != outer.plan.num_groups:
        raise LaunchError(
            f"--resume: {resume.path} holds the state of {layout[0]} replica groups, this "
            f"outer-loop run has {outer.plan.num_groups}: each group's samples and inner "
            "state are its own, so the resume would not continue the same run"
        )


def restore_outer(
    workers: Workers, actor_sites: list[tuple[Any, str]], paths: dict[str, str]
) -> list[str]:
    """Every actor (with its site) loads theta_global, momentum and rounds from its site's
    copy ``paths[site]`` (after ``outer_begin``); returns their digests."""
    refs = [workers.call(a, "load_outer_checkpoint", paths[s]) for a, s in actor_sites]
    return workers.get(refs)
