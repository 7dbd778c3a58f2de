"""Handing a stage's state from surviving replicas to the actors of a new layout.

After a recovery or a grow-back every actor of the new layout must hold its layers'
parameters and Adam moments as of one step boundary. Who has what: each surviving replica
kept full snapshots of its *old* stage; the new layout may give an actor other layers.

:func:`plan_handoff` (pure logic) decides, per parameter name, where it comes from:

1. the actor's own snapshot, when it already holds that name;
2. else a holder **in the same site and in the new layout**: a point-to-point transfer on
   the site's freshly re-formed ``torch.distributed`` world (NCCL on GPUs, gloo on CPU) —
   the intra-site, RDMA-class path;
3. else any other holder through Ray's object store (a holder in another site, where no
   process group reaches by design, or a left-over replica outside the new layout).

Among equal candidates the one with the fewest bytes assigned so far is chosen, so several
receivers spread over the holders. :func:`pack` and :func:`unpack` turn a name list into
one flat buffer per (sender, receiver) pair, so a transfer is one message, not 3 × names.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from geopipe.checkpoint.format import ADAM_STATE_GROUPS as GROUPS
from geopipe.checkpoint.format import PARAMS_GROUP

__all__ = [
    "Holder",
    "Receiver",
    "Restore",
    "pack",
    "plan_handoff",
    "restore_boundary",
    "unpack",
]

_STATE_TAG = 7 << 20  # p2p tags of the hand-off; an iteration's tags are small


@dataclass(frozen=True)
class Holder:
    """A surviving replica with a snapshot of the boundary: the names it holds, and where it
    sits (``rank`` in its site's new world; None when it is not part of the new layout)."""

    key: Hashable
    site: str
    rank: int | None
    names: frozenset[str]


@dataclass(frozen=True)
class Receiver:
    """An actor of the new layout and the parameters (name → shape) its stage needs."""

    key: Hashable
    site: str
    rank: int
    shapes: dict[str, tuple[int, ...]]


@dataclass
class Restore:
    """What one new-layout actor does: keep ``own`` names from its snapshot, ``sends`` to
    and ``recvs`` from site ranks, and ``fetch`` from holders through the object store."""

    own: list[str] = field(default_factory=list)
    sends: list[tuple[int, list[str]]] = field(default_factory=list)  # (dst rank, names)
    recvs: list[tuple[int, list[str]]] = field(default_factory=list)  # (src rank, names)
    fetch: list[tuple[Hashable, list[str]]] = field(default_factory=list)  # (holder, names)


def plan_handoff(
    receivers: Sequence[Receiver],
    holders: Sequence[Holder],
    aliases: Mapping[str, str] | None = None,
) -> dict:
    """``{receiver or holder key: Restore}`` covering every name every receiver needs.

    A name no holder has is taken under its alias when one holds that (a tied head's copy is
    the embedding, which a layout with one stage holding both ends kept alone); the
    receiver's :meth:`~geopipe.runtime.actor.engine.StageEngine.load_full_state` resolves it.
    Raises KeyError naming the first parameter no holder has (the caller decides whether
    that means a checkpoint fallback). Deterministic: same inputs, same plan, and the
    pairs' name lists are in the receiver's parameter order on both sides.
    """
    load: dict[Hashable, int] = {h.key: 0 for h in holders}
    out: dict[Hashable, Restore] = {}
    own_names = {h.key: h.names for h in holders}
    held = frozenset().union(*own_names.values()) if holders else frozenset()
    aliases = aliases or {}
    for rc in receivers:
        mine = out.setdefault(rc.key, Restore())
        by_src: dict[Hashable, list[str]] = {}
        for wanted, shape in rc.shapes.items():
            name = wanted if wanted in held else aliases.get(wanted, wanted)
            if name in own_names.get(rc.key, ()):
                mine.own.append(name)
                continue
            cands = [h for h in holders if name in h.names and h.key != rc.key]
            if not cands:
                raise KeyError(name)
            local = [h for h in cands if h.site == rc.site and h.rank is not None]
            src = min(local or cands, key=lambda h: load[h.key])
            load[src.key] += 3 * math.prod(shape)
            by_src.setdefault(src.key, []).append(name)
        for h in holders:
            names = by_src.get(h.key)
            if not names:
                continue
            if h.site == rc.site and h.rank is not None:
                mine.recvs.append((h.rank, names))
                out.setdefault(h.key, Restore()).sends.append((rc.rank, names))
            else:
                mine.fetch.append((h.key, names))
    return out


def pack(state: dict, names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header, flat)``: the int64 header holds the Adam and LR step; ``flat`` the fp32
    parameters, then first and second moments, of ``names`` in order."""
    header = torch.tensor([int(state["step"]), int(state["lr_step"])], dtype=torch.int64)
    parts = [state[g][n].detach().reshape(-1).to(torch.float32) for g in GROUPS for n in names]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)
    return header, flat


def flat_size(shapes: dict[str, tuple[int, ...]], names: Sequence[str]) -> int:
    return len(GROUPS) * sum(math.prod(shapes[n]) for n in names)


def unpack(header: torch.Tensor, flat: torch.Tensor, names: Sequence[str], shapes: dict) -> dict:
    """The inverse of :func:`pack` given the receiver's shapes: a partial full-state dict."""
    if flat.numel() != flat_size(shapes, names):
        raise ValueError(
            f"state buffer has {flat.numel()} values, expected {flat_size(shapes, names)}"
        )
    out: dict = {g: {} for g in GROUPS}
    offset = 0
    for g in GROUPS:
        for n in names:
            size = math.prod(shapes[n])
            out[g][n] = flat[offset : offset + size].reshape(shapes[n]).clone()
            offset += size
    out["step"], out["lr_step"] = int(header[0]), int(header[1])
    return out


def restore_boundary(
    engine: Any,
    keeper: Any,
    step: int,
    todo: Restore,
    fetch: list[tuple[Any, list[str]]],
) -> dict[str, int]:
    """Take part, inside a stage actor, in the hand-off :func:`plan_handoff` planned.

    Keep ``todo.own`` names from this replica's snapshot (``keeper``, a
    :class:`~geopipe.runtime.actor.snapshots.BoundaryKeeper`), send to and receive from site ranks
    over the re-formed ``torch.distributed`` world — all posted at once, so no order of
    calls across actors can deadlock — fetch the rest from holder actors through the object
    store (``fetch``: (actor handle, names)), then load the merged step-``step`` state.
    Returns the bytes moved per path."""
    import ray
    import torch.distributed as dist

    shapes = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    for name, alias in engine.module.state_aliases().items():  # sent under the alias
        if name in shapes:
            shapes.setdefault(alias, shapes[name])
    dev = engine.device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = keeper.state(step) if todo.sends else None
    ops, received, p2p = [], [], 0
    for dst, names in todo.sends:
        header, flat = pack(mine, names)
        ops += [
            dist.P2POp(dist.isend, header.to(dev), dst, tag=_STATE_TAG),
            dist.P2POp(dist.isend, flat.to(dev), dst, tag=_STATE_TAG + 1),
        ]
    for src, names in todo.recvs:
        header = torch.empty(2, dtype=torch.int64, device=dev)
        flat = torch.empty(flat_size(shapes, names), dtype=torch.float32, device=dev)
        ops += [
            dist.P2POp(dist.irecv, header, src, tag=_STATE_TAG),
            dist.P2POp(dist.irecv, flat, src, tag=_STATE_TAG + 1),
        ]
        received.append((names, header, flat))
        p2p += flat.numel() * flat.element_size()
    works = dist.batch_isend_irecv(ops) if ops else []
    parts = ray.get([a.boundary_subset.remote(step, names) for a, names in fetch])
    fetched = sum(t.numel() * t.element_size() for p in parts for t in p[PARAMS_GROUP].values())
    for work in works:
        work.wait()
    if todo.own:
        parts.append(keeper.subset(step, todo.own))
    parts += [unpack(h.cpu(), f.cpu(), names, shapes) for names, h, f in received]
    merged: dict[str, Any] = {g: {} for g in GROUPS}
    for part in parts:
        for g in GROUPS:
            merged[g].update(part[g])
        if merged.setdefault("step", part["step"]) != part["step"]:
            raise RuntimeError(f"hand-off mixes Adam steps {merged['step']} and {part['step']}")
        merged["lr_step"] = part["lr_step"]
    engine.load_full_state(merged)
    return {"own": len(todo.own), "p2p_bytes": p2p, "object_store_bytes": 3 * fetched}
