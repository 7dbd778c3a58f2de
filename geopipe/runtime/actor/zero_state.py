"""Reading and writing a DeepSpeed ZeRO-1 engine's private state: the fp32 master shards,
Adam's moments, the step counters — what checkpoints, boundary snapshots and state
hand-offs need and DeepSpeed has no public API for.

Written against DeepSpeed 0.19.x's ZeRO stage 1/2 optimizer; every private attribute used
is named here and nowhere else, so an upgrade is checked in one file (the engine tests
compare these against a single-process reference, bitwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from torch import Tensor, nn

from geopipe.checkpoint.format import ADAM_MOMENTS, ADAM_STATE_GROUPS, PARAMS_GROUP

__all__ = [
    "adam_partition_states",
    "all_gather_host",
    "assemble_snapshot",
    "collective_device",
    "full_state",
    "load_full_state",
    "local_snapshot",
    "master_partitions",
    "partition_layout",
    "set_lr_step",
    "sync_working_params",
]


def adam_partition_states(zero_optimizer: Any) -> list[dict[str, Tensor]]:
    """The inner Adam's state of each flat fp32 partition, created if still lazy, and linked.

    Private DeepSpeed internals (ZeRO stage 1/2 optimizer of 0.19.x), kept to this function:
    torch Adam creates its state at the first ``step()``, and only then does DeepSpeed link
    each parameter's ``_hp_mapping`` to slices of it, so ``safe_{get,set}_full_optimizer_state``
    fail on a fresh engine (``NoneType is not iterable``). Creating the same zero state Adam
    would create (step 0) and re-linking makes them work; Adam then finds the state non-empty
    and updates it in place, which keeps the links valid.
    """
    inner = zero_optimizer.optimizer
    states = []
    for flat in zero_optimizer.single_partition_of_fp32_groups:
        state = inner.state[flat]
        if not state:
            state["step"] = torch.tensor(0.0)
            for key in ADAM_MOMENTS:
                state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        states.append(state)
    zero_optimizer._hp_optimizer_states_linked = False
    zero_optimizer._lazy_init_hp_params_optimizer_state()
    return states


def collective_device(group: Any, device: Any) -> torch.device:
    """Where the tensors of a collective on ``group`` must be: on the engine's ``device``
    under NCCL (which moves CUDA tensors only), on the host under gloo (this module's
    gathers are of host copies: snapshots, the outer state)."""
    if dist.get_backend(group) == "nccl":
        return torch.device(device)
    return torch.device("cpu")


def all_gather_host(local: Tensor, group: Any, replicas: int, device: Any) -> list[Tensor]:
    """Every replica's ``local`` (a host tensor), gathered on ``group`` and returned on the
    host, in rank order; through ``device`` when the backend is NCCL
    (:func:`collective_device`). COLLECTIVE on ``group`` unless ``replicas`` is 1."""
    local = local.contiguous()
    if replicas == 1:
        return [local]
    dev = collective_device(group, device)
    sent = local.to(dev)
    parts = [torch.empty_like(sent) for _ in range(replicas)]
    dist.all_gather(parts, sent, group=group)
    return [p.cpu() for p in parts]


def assemble_snapshot(
    snap: dict[str, Any], group: Any, replicas: int, moments_of: Future | None = None
) -> dict[str, Any]:
    """Gather the replicas' :func:`local_snapshot` into a full state (on the host).

    COLLECTIVE on ``group`` (every replica calls it, same order); safe on a background
    thread when ``group`` is the engine's ``ckpt_group``. Returns the same dictionary as
    :func:`full_state`. The snapshot is on the host; under NCCL the gather goes through the
    engine's device (``snap["device"]``) and comes back.

    ``moments_of``: the future of the full state of the same boundary before an outer
    apply, which changes the weights alone: its Adam moments are taken as they are and only
    the weights gathered (``snap`` then holds the weights alone:
    :meth:`~geopipe.runtime.actor.snapshots.BoundaryKeeper.retake_weights`).
    """
    out: dict[str, Any] = {g: {} for g in ADAM_STATE_GROUPS}
    device = snap.get("device", "cpu")
    keys = ADAM_STATE_GROUPS
    if moments_of is not None:
        before = moments_of.result()  # done: submitted earlier to the same one thread
        out.update({k: before[k] for k in ADAM_MOMENTS})
        keys = (PARAMS_GROUP,)
    for g in snap["groups"]:
        for key in keys:
            flat = torch.cat(all_gather_host(g[key], group, replicas, device))
            for name, off, shape in g["layout"]:
                numel = math.prod(shape)
                out[key][name] = flat[off : off + numel].view(shape).clone()
    out["step"], out["lr_step"] = snap["step"], snap["lr_step"]
    return out


def full_state(engine: Any, module: nn.Module) -> dict[str, Any]:
    """Unsharded fp32 parameters and Adam state, keyed by partition-independent names.

    COLLECTIVE inside the stage's ZeRO-1 group: every replica must call it (each gets the
    whole state). On an engine that has not stepped yet the moments are zeros, step 0.
    """
    states = adam_partition_states(engine.optimizer)
    out: dict[str, Any] = {g: {} for g in ADAM_STATE_GROUPS}
    for name, p in module.named_parameters():
        out[PARAMS_GROUP][name] = safe_get_full_fp32_param(p).detach().to("cpu", copy=True)
        for key in ADAM_MOMENTS:
            out[key][name] = safe_get_full_optimizer_state(p, key).detach().to("cpu", copy=True)
    out["step"] = int(states[0]["step"].item())
    out["lr_step"] = int(engine.lr_scheduler.last_epoch)
    return out


def local_snapshot(engine: Any, module: nn.Module, weights_only: bool = False) -> dict[str, Any]:
    """This replica's ZeRO-1 partitions (fp32 weights, Adam moments) copied to memory.

    No communication, so training stalls only for the copy; :func:`assemble_snapshot`
    later turns the replicas' snapshots into a :func:`full_state` on a background thread.
    Layout (DeepSpeed 0.19 ZeRO 1/2, private): per parameter group one flat buffer holds
    the parameters in ``round_robin_bit16_groups`` order at ``round_robin_bit16_offsets``;
    replica ``r`` owns the r-th of ``R`` equal slices. Checked against ``full_state`` in
    the tests (bitwise).

    ``weights_only``: the moments are left out (an outer apply's re-take of a boundary,
    which takes them from the first take's full state: :func:`assemble_snapshot`).
    """
    zo = engine.optimizer
    states = adam_partition_states(zo)
    names = {id(p): n for n, p in module.named_parameters()}
    groups = []
    for i, part in enumerate(zo.single_partition_of_fp32_groups):
        moments = (
            {}
            if weights_only
            else {k: states[i][k].detach().to("cpu", copy=True) for k in ADAM_MOMENTS}
        )
        groups.append(
            {
                PARAMS_GROUP: part.detach().to("cpu", copy=True),
                **moments,
                "layout": [
                    (names[id(p)], int(off), tuple(p.shape))
                    for p, off in zip(
                        zo.round_robin_bit16_groups[i],
                        zo.round_robin_bit16_offsets[i],
                        strict=True,
                    )
                ],
            }
        )
    return {
        "groups": groups,
        "step": int(states[0]["step"].item()),
        "lr_step": int(engine.lr_scheduler.last_epoch),
        "device": str(engine.device),  # where an NCCL gather of it must go (assemble_snapshot)
    }


def load_full_state(engine: Any, module: nn.Module, state: dict[str, Any], device: Any) -> None:
    """Load a :func:`full_state` (taken with any replica count) into ``engine``'s shards.

    Every replica of the group loads the same full state and keeps its own shard. Names
    in ``state`` that this stage does not hold are ignored, so a whole-model state can be
    handed to every stage. A tied head's copy missing from ``state`` (saved by a layout
    where one stage held both ends) is taken from the embedding it equals.
    """
    aliases = module.state_aliases()
    source = {
        n: n if n in state[PARAMS_GROUP] else aliases.get(n, n)
        for n, _ in module.named_parameters()
    }
    missing = [n for n, src in source.items() if src not in state[PARAMS_GROUP]]
    if missing:
        raise KeyError(f"state lacks parameters of this stage: {missing}")
    states = adam_partition_states(engine.optimizer)
    with torch.no_grad():
        for name, p in module.named_parameters():
            value = state[PARAMS_GROUP][source[name]]
            if value.shape != p.shape:
                raise ValueError(f"{name}: state shape {tuple(value.shape)} != {p.shape}")
            safe_set_full_fp32_param(p, value.to(device, torch.float32))
            # ZeRO-1 keeps a full working copy of the stage on every replica; the fp32
            # master shard above does not write back to it until the next step.
            p.copy_(value)
            for key in ADAM_MOMENTS:
                safe_set_full_optimizer_state(
                    p, state[key][source[name]].to(device, torch.float32), key
                )
    for partition_state in states:
        partition_state["step"].fill_(float(state["step"]))


def set_lr_step(engine: Any, lr_lambda: Callable[[int], float], lr_step: int) -> None:
    """Put the LambdaLR at ``lr_step`` and apply that step's LR to the optimizer groups."""
    sched = engine.lr_scheduler
    lrs = [base * lr_lambda(lr_step) for base in sched.base_lrs]
    sched.load_state_dict({**sched.state_dict(), "last_epoch": lr_step, "_last_lr": lrs})
    for group, lr in zip(sched.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


# -- the fp32 master partitions, for the outer loop (geopipe.runtime.actor.outer) -------------


def master_partitions(engine: Any) -> list[Tensor]:
    """This replica's flat fp32 master partitions, one per parameter group: the live tensors
    DeepSpeed's Adam steps (``single_partition_of_fp32_groups``), not copies.

    Writing into them in place changes what the next inner step starts from, but not the
    weights the forward reads: those are the 16-bit (or, in fp32, the separate flat working)
    copies, so a writer must call :func:`sync_working_params` afterwards. Adam's state is
    keyed by these same tensors, so writing in place keeps it (the outer loop must not reset
    it)."""
    return list(engine.optimizer.single_partition_of_fp32_groups)


def partition_layout(engine: Any) -> dict[str, Any]:
    """Which partition of its ZeRO-1 group this replica owns and how the partitions are cut:
    ``{"rank", "size", "numels"}`` (``numels``: this replica's partition of each parameter
    group). Replicas of different groups can exchange partition slices elementwise only when
    their layouts are equal; the outer loop checks it before the first round."""
    zo = engine.optimizer
    group = zo.real_dp_process_group[0]
    return {
        "rank": int(dist.get_rank(group=group)),
        "size": int(dist.get_world_size(group=group)),
        "numels": [int(p.numel()) for p in zo.single_partition_of_fp32_groups],
    }


def sync_working_params(engine: Any) -> None:
    """Make the module's working weights equal the fp32 masters again, as DeepSpeed does at
    the end of its own step: each replica copies its master partition into its slice of the
    flat working buffer, then the slices are all-gathered in the group (the model's
    parameters are views of that buffer).

    COLLECTIVE on the ZeRO-1 group: every replica calls it, between iterations (it uses the
    training communicator, which must not interleave with a step's reduction). DeepSpeed
    0.19's ``update_lp_params`` is exactly that copy plus ``all_gather_dp_groups``; the views
    are re-pointed as its ``step`` does (``_update_model_bit16_weights``) in case a load
    replaced a parameter's storage."""
    zo = engine.optimizer
    zo.update_lp_params()
    for i in range(len(zo.bit16_groups)):
        zo._update_model_bit16_weights(i)
