"""A stage replica's outer state into and out of checkpoints ([Note: the outer-loop
checkpoint] in :mod:`geopipe.checkpoint.outer`).

The outer state lives per ZeRO-1 partition (:mod:`geopipe.runtime.actor.outer`): theta_global
and the momentum as flat fp32 partitions, the momentum per fragment. A checkpoint stores
them by parameter name instead, gathered over the ZeRO-1 group exactly as the boundary
snapshot gathers the masters (:func:`~geopipe.runtime.actor.zero_state.assemble_snapshot`,
the same layout of names in the flat buffer): so the shard is written by one replica, and a
resume with another partition layout cuts them again. Pure copies and an all-gather; the
numbers are never recomputed, so the restore is bit-exact. Everything here is on the host,
as the outer state is ([Note: the outer state lives on the host] in
:mod:`geopipe.outer.optimizer`); only an NCCL all-gather passes through the engine's device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from geopipe.checkpoint.format import PARAMS
from geopipe.checkpoint.outer import (
    MOMENTUM,
    OUTER_CODEC,
    OUTER_KEY,
    group_position,
    group_shards,
    named,
    outer_layout,
)
from geopipe.checkpoint.store import CheckpointError, load_checkpoint
from geopipe.runtime.actor import zero_state

__all__ = [
    "Layouts",
    "gather_outer",
    "live_position",
    "restore_outer",
    "submit_outer",
    "take_outer",
]

Layouts = list[list[tuple[str, int, tuple[int, ...]]]]  # per parameter group: (name, off, shape)


def live_position(loop: Any) -> int:
    """Where this replica's group is among the groups still in the run (its own and its
    peers', by stable id): its shards are ``position * S + k``, and the first writes the
    outer state (the controller orders the shards the same way:
    :func:`geopipe.runtime.control.outerckpt.shard_rows`)."""
    return sorted({loop.group, *loop.net.peers}).index(loop.group)


def submit_outer(loop: Any, keeper: Any, engine: Any) -> tuple[Any, int]:
    """A save's outer part: (the future of :func:`gather_outer`, submitted to the state
    keeper after the boundary's own gather, and this group's :func:`live_position`); (None,
    0) for a pipeline run (``loop`` None). ``keeper``: the replica's
    :class:`~geopipe.runtime.actor.snapshots.BoundaryKeeper`."""
    if loop is None:
        return None, 0
    pos = live_position(loop)
    taken = take_outer(loop, canonical=pos == 0)
    return keeper.submit(
        gather_outer, taken, keeper.layouts, engine.ckpt_group, engine.replicas, engine.device
    ), pos


def take_outer(loop: Any, canonical: bool) -> dict[str, Any]:
    """Copies of this replica's outer state now (the only stall of a save): the first live
    group's replicas (``canonical``) take theta_global and the momentum (one copy per stage
    is kept), every replica its top-k residuals. ``loop`` is the
    :class:`~geopipe.runtime.actor.outer.OuterLoop`."""
    st = loop.state
    sd = st.state_dict()  # copies (OuterOptimizer.state_dict clones)
    parts: dict[str, list[Tensor]] = {}
    if canonical:
        parts[PARAMS] = sd["theta"]
        momentum = [torch.zeros_like(t) for t in sd["theta"]]
        for f, buf in enumerate(sd["momentum_buffer"]):
            if buf is not None:
                st.opt.scatter(buf, momentum, f)
        parts[MOMENTUM] = momentum
    meta = {
        "steps": list(sd["steps"]),
        "momentum_set": [b is not None for b in sd["momentum_buffer"]],
        "lr": sd["lr"],
        "momentum": sd["momentum"],
        "fragments": sd["fragments"],
        "partitions": st.partitions,
        "codec": sd["codec"],
    }
    codec = {k: v.detach().clone() for k, v in (sd.get("codec_state") or {}).items()}
    return {"parts": parts, "codec": codec, "meta": meta}


def gather_outer(
    taken: dict[str, Any], layouts: Layouts, group: Any, replicas: int, device: Any = "cpu"
) -> dict:
    """The shard's outer tensors from every replica's :func:`take_outer`: theta_global and
    momentum by name, the residuals by partition, on the host. COLLECTIVE on ``group`` (the
    engine's checkpoint communicator), run on the state keeper's thread in submission order;
    ``device``: the engine's, which an NCCL gather goes through."""
    out: dict[str, Tensor] = {}

    def every(local: Tensor) -> list[Tensor]:
        return zero_state.all_gather_host(local.cpu(), group, replicas, device)

    for prefix, parts in sorted(taken["parts"].items()):
        for i, local in enumerate(parts):
            flat = torch.cat(every(local))
            for name, off, shape in layouts[i]:
                out[prefix + name] = flat[off : off + math.prod(shape)].view(shape).clone()
    for key in sorted(taken["codec"]):
        for rank, t in enumerate(every(taken["codec"][key])):
            out[f"{OUTER_CODEC}p{rank}/{key}"] = t.clone()
    return {"tensors": out, "meta": taken["meta"]}


def _cut(
    by_name: dict[str, Tensor], layouts: Layouts, base: Sequence[Tensor], rank: int
) -> list[Tensor]:
    """This replica's partitions of the named tensors (``base``'s values where no name
    lies: the flat buffer's padding), on the host, where the outer state lives, whatever
    device ``base`` (the masters) is on."""
    out = []
    for lay, b in zip(layouts, base, strict=True):
        t = b.detach().to("cpu", torch.float32, copy=True).reshape(-1)
        lo, hi = rank * t.numel(), (rank + 1) * t.numel()
        for name, off, shape in lay:
            a, z = max(off, lo), min(off + math.prod(shape), hi)
            if a < z:
                t[a - lo : z - lo] = by_name[name].reshape(-1)[a - off : z - off]
        out.append(t.view(b.shape))
    return out


def restore_outer(loop: Any, path: str, group: int, stage: int) -> str:
    """Load theta_global, momentum, round counters and this replica's top-k residuals of
    the checkpoint at ``path`` into ``loop`` (built by ``outer_begin`` after the inner state
    was loaded); returns theta_global's digest. A checkpoint of a pipeline run has no outer
    state: theta_global stays the loaded weights, as at the start of a run."""
    st = loop.state
    ckpt = load_checkpoint(path, verify=False)  # the controller verified the checksums
    layout = outer_layout(ckpt.manifest)
    if layout is None:
        return st.digest()
    canon = group_shards(ckpt, 0)
    meta = canon[0].meta.get(OUTER_KEY)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{ckpt.path.name}: stage 0 of group 0 holds no outer state")
    layouts: Layouts = [g["layout"] for g in st.engine.local_snapshot()["groups"]]
    names = [n for lay in layouts for n, _, _ in lay]
    masters = zero_state.master_partitions(st.engine.engine)
    theta = _cut(named(canon, PARAMS, names), layouts, masters, st.partition)
    zeros = [torch.zeros(m.shape, dtype=torch.float32) for m in masters]  # on the host
    momentum = _cut(named(canon, MOMENTUM, names), layouts, zeros, st.partition)
    bufs = [st.opt.gather(momentum, f) if s else None for f, s in enumerate(meta["momentum_set"])]
    codec = {}
    own = group_shards(ckpt, group_position(ckpt.manifest, group))
    if stage < len(own) and meta.get("partitions") == st.partitions:
        shard = own[stage]
        prefix = f"{OUTER_CODEC}p{st.partition}/"
        codec = shard.tensors(prefix) if any(k.startswith(prefix) for k in shard.keys) else {}
    elif meta.get("codec") == "topk":
        raise CheckpointError(
            f"{ckpt.path.name}: the top-k residuals were saved for another stage split or "
            f"ZeRO-1 size ({meta.get('partitions')} partitions, this replica's "
            f"{st.partitions}): resume with the layout that saved it"
        )
    st.load_state_dict(
        {
            "lr": meta["lr"],
            "momentum": meta["momentum"],
            "fragments": meta["fragments"],
            "theta": theta,
            "momentum_buffer": bufs,
            "steps": meta["steps"],
            "layout": st.layout,
            "stage": st.stage,
            "partition": st.partition,
            "partitions": st.partitions,
            "codec_state": codec,
        }
    )
    return st.digest()
