"""An outer-loop run's checkpoint: every replica group's inner state and the outer state.

[Note: the outer-loop checkpoint]
An outer-loop run (``plan.strategy: outer``, :mod:`geopipe.outer`) has ``M`` replica groups
of one layout, ``S`` stages each. Its checkpoint is an ordinary one
(:mod:`geopipe.checkpoint.format`) of ``M * S`` shards: shard ``g * S + k`` is group ``g``'s
stage ``k``, written by that group's first replica of the stage. The manifest's ``outer``
entry (:func:`outer_entry`) says so. In each shard:

* ``inner/params/<name>``, ``inner/exp_avg/<name>``, ``inner/exp_avg_sq/<name>``: the
  group's own fp32 weights and Adam moments (they differ between groups: each trained on
  its own slice of the batches since the last outer step, and Adam's state is never reset);
  its RNG and link codec state as any shard's, and ``outer/codec/p<rank>/<key>``: the
  top-k error feedback of each ZeRO-1 partition's pseudo-gradient (per group);
* group 0's shards only: ``params/<name>``, theta_global, and ``outer/momentum/<name>``,
  the outer Nesterov momentum, both by parameter name (gathered from the ZeRO-1
  partitions, so any partition layout reads them back), and the ``outer`` metadata (each
  fragment's outer step count — the round counter — and whether its momentum exists yet).
  theta_global and the momentum are bit-identical in every group (every group averages the
  same bytes, :mod:`geopipe.outer.exchange`), so one copy per stage suffices; storing them
  once per (stage, partition) would be the same bytes cut differently.

No fragment is ever in flight at a checkpoint: ``training.checkpoint.every_steps`` must be
a multiple of ``plan.outer.h`` (:mod:`geopipe.config.checks`), a round's last fragment is
applied at every multiple of ``h``, and the next one is sent ``h / F - tau > 0`` steps later;
a run's end (``training.steps``) must not fall while one is in flight
(:mod:`geopipe.runtime.control.outerckpt`), and a Ctrl-C runs on to the apply (at most
``tau`` steps) before it saves.

Because theta_global is stored as the ordinary ``params/`` of shards ``0 .. S-1`` and the
group shards hold no ``params/`` key, everything that reads a checkpoint's parameters by
name (``geopipe export``, a pipeline run resuming it) reads theta_global.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from geopipe.checkpoint.format import ADAM_STATE_GROUPS
from geopipe.checkpoint.store import CheckpointError, LoadedCheckpoint, StageShard

if TYPE_CHECKING:
    import torch

__all__ = [
    "INNER",
    "MOMENTUM",
    "OUTER_CODEC",
    "OUTER_KEY",
    "group_position",
    "group_shards",
    "group_state",
    "named",
    "outer_entry",
    "outer_layout",
    "shard_index",
]

OUTER_KEY = "outer"  # the manifest's and the canonical shards' metadata key
INNER = "inner/"  # a group's own weights and Adam moments: inner/params/<name>, ...
MOMENTUM = "outer/momentum/"  # the outer momentum by parameter name (group 0's shards)
OUTER_CODEC = "outer/codec/"  # outer/codec/p<rank>/<key>: top-k residuals (every group)


def shard_index(group: int, stage: int, stages: int) -> int:
    """The shard holding group ``group``'s stage ``stage`` ([Note: the outer-loop checkpoint])."""
    return group * stages + stage


def outer_entry(groups: int, stages: int, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``outer`` entry: the layout of the shards and the run's outer knobs."""
    return {"groups": int(groups), "stages": int(stages), **dict(settings)}


def outer_layout(manifest: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(groups, stages)`` of an outer-loop checkpoint, None for any other."""
    entry = manifest.get(OUTER_KEY)
    if not isinstance(entry, Mapping):
        return None
    m, s = entry.get("groups"), entry.get("stages")
    if not (isinstance(m, int) and isinstance(s, int) and m >= 1 and s >= 1):
        raise CheckpointError(f"manifest 'outer' entry is malformed: {dict(entry)!r}"[:200])
    if m * s != int(manifest.get("num_stages", -1)):
        raise CheckpointError(
            f"manifest 'outer' says {m} groups x {s} stages, but there are "
            f"{manifest.get('num_stages')} shards"
        )
    return m, s


def group_position(manifest: Mapping[str, Any], group: int) -> int:
    """The position of the group with stable id ``group`` among a checkpoint's groups (its
    ``group_ids``: a run that lost a group saves only the others)."""
    ids = (manifest.get(OUTER_KEY) or {}).get("group_ids")
    if ids is None:
        return group
    if group not in ids:
        raise CheckpointError(f"the checkpoint holds replica groups {ids}, not group {group}")
    return list(ids).index(group)


def group_shards(ckpt: LoadedCheckpoint, group: int) -> list[StageShard]:
    """Group ``group``'s shards, stage order (every shard of a checkpoint of another kind)."""
    layout = outer_layout(ckpt.manifest)
    if layout is None:
        return list(ckpt.stages)
    m, s = layout
    if not 0 <= group < m:
        raise CheckpointError(f"{ckpt.path.name} holds groups 0..{m - 1}, not group {group}")
    return [ckpt.stages[shard_index(group, k, s)] for k in range(s)]


def named(
    shards: Iterable[StageShard], prefix: str, names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """The tensors ``prefix + name`` of ``names``, from whichever of ``shards`` holds each."""
    shards = list(shards)
    out: dict[str, torch.Tensor] = {}
    wanted = list(dict.fromkeys(names))
    for shard in shards:
        here = [n for n in wanted if prefix + n in shard.keys and n not in out]
        if here:
            got = shard.tensors_for([prefix + n for n in here])
            out.update({n: got[prefix + n] for n in here})
    missing = [n for n in wanted if n not in out]
    if missing:
        where = shards[0].path.parent.name if shards else "the checkpoint"
        raise CheckpointError(f"{where} has no {prefix}{missing[0]} (and {len(missing) - 1} more)")
    return out


def group_state(ckpt: LoadedCheckpoint, group: int, names: Iterable[str]) -> dict[str, Any]:
    """Group ``group``'s own weights and Adam state of ``names`` (a full state, as
    :func:`geopipe.runtime.actor.zero_state.full_state` returns it), by name, so any stage
    split of the same model loads it."""
    shards = group_shards(ckpt, group)
    names = list(names)
    out: dict[str, Any] = {g: named(shards, f"{INNER}{g}/", names) for g in ADAM_STATE_GROUPS}
    meta = shards[0].meta
    out["step"], out["lr_step"] = int(meta["adam_step"]), int(meta["lr_step"])
    return out
