"""Per-device memory model of one stage replica under ZeRO-1, and the feasibility rule.

``total = weights + gradients + adam_state_shard + activations × in_flight``

* fp32 training: 4 B weights + 4 B gradients per parameter, Adam ``m`` and ``v`` (8 B)
  sharded over the stage's ``d`` replicas (ZeRO-1 partitions only optimizer state);
* bf16/fp16 mixed precision: 2 B + 2 B, and fp32 master weights + ``m`` + ``v`` (12 B)
  sharded over ``d`` (bytes per parameter: :mod:`geopipe.model.sizes`);
* activations: what each layer keeps for backward per micro-batch
  (:func:`geopipe.optimizer.costs.activation_bytes`), times the peak number of micro-batches
  in flight on that stage (which the schedule fixes: ``m`` for GPipe, ``p-k`` for 1F1B, ΔN
  more for look-ahead), plus one received input buffer per in-flight micro-batch. With a
  split backward a micro-batch stays in flight until its ``W``, holding
  :data:`W_HELD_FRACTION` of its activations after its ``I``
  (:meth:`~geopipe.pipeline.schedule.Schedule.peak_held`).
* activation recompute (``training.recompute``, [Note: recompute in the memory model]).

A plan fits when no stage's peak exceeds its device (:func:`stages_over`, the one rule the
evaluator, ΔN refinement and the templates apply).

[Note: a replica group's spec] Under ``plan.strategy: outer`` a spec describes ONE replica
group of an outer loop (the strategy planner, :mod:`geopipe.optimizer.strategy`, hands each
group's sites to the search as such a spec). Every replica also holds its share of the
outer state (:func:`outer_state_bytes_per_param`): theta_global and the outer Nesterov
momentum in fp32, partitioned over the stage's ZeRO-1 group like the fp32 masters (the
pseudo-gradient is taken partition by partition); a top-k error-feedback buffer (fp32) when
the pseudo-gradient codec is ``topk``; and the fragment in flight, an fp32 accumulator of the
groups' decoded pseudo-gradients plus its own pseudo-gradient kept for the send (``8 / F``
bytes per parameter). All of it is in host RAM, not on the device ([Note: the outer state
lives on the host] in geopipe.outer.optimizer): the device model counts none of it
(``outer_per_param`` stays 0 in :func:`plan_memory` and :func:`inflight_caps`), so an
outer group fits exactly where the same pipeline does.

[Note: recompute in the memory model]
    A decoder block run under recompute (:mod:`geopipe.model.recompute`) keeps only its input,
    ``b·s·h`` elements, per micro-batch in flight instead of
    :func:`~geopipe.optimizer.costs.activation_bytes`; during its backward it rebuilds its
    full activations, one block at a time, so a stage with any such block holds one block's
    activations more at its peak (:attr:`MemoryBreakdown.recompute`, not multiplied by the
    micro-batches in flight). ``every-N`` counts the blocks it takes, so the saving is in
    proportion. A split backward (ZB-H1, look-ahead ZB) gets no per-micro-batch saving in
    this model: the runtime's weight-gradient store keeps every Linear's input from the
    forward until ``W`` (:mod:`geopipe.runtime.actor.backward`), which with the block's
    input is half a GPT block's activations before ``I`` (measured: 32.75 of 65.25 ``b·s·h``
    for four blocks) and all of them, with the output gradients, after it; counting the
    whole block keeps the model from promising a fit it would not get.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from geopipe.config import ClusterSpec, GiB, choice_values
from geopipe.model.recompute import checkpointed
from geopipe.model.sizes import adam_bytes_per_param, elem_bytes, stage_param_count
from geopipe.optimizer.costs import activation_bytes
from geopipe.pipeline.schedule import SPLIT_FAMILIES
from geopipe.plan import Plan

__all__ = [
    "W_HELD_FRACTION",
    "MemoryBreakdown",
    "device_limits",
    "inflight_caps",
    "outer_state_bytes_per_param",
    "plan_memory",
    "recompute_peak_bytes",
    "snapshot_bytes",
    "stage_memory",
    "stages_over",
]


# What a micro-batch past its input-gradient pass (I) still holds until its W, as a share
# of its activations. 1.0 because the runtime keeps the micro-batch's autograd graph whole
# until W (``torch.distributed.pipelining``'s stage_backward_input retains it). A runtime
# that freed the I-only tensors (softmax, GELU inputs, q/k/v) would hold about the matmul
# and norm inputs, ~0.55 of a block's; Qi et al. count ~0.94 with the gradients W needs.
W_HELD_FRACTION = 1.0

# The outer loop's state per parameter, fp32, in host RAM ([Note: a replica group's spec]).
OUTER_STATE_BYTES = 8.0  # theta_global + the outer momentum
OUTER_TOPK_FEEDBACK_BYTES = 4.0  # top-k's error feedback of the pseudo-gradient
OUTER_IN_FLIGHT_BYTES = 8.0  # the fragment in flight: accumulator + own pseudo-gradient, / F


@dataclass(frozen=True)
class MemoryBreakdown:
    weights: float
    gradients: float
    adam_state: float  # this replica's ZeRO-1 shard of the Adam state
    activations: float
    outer_state: float = 0.0  # this replica's share of the outer loop's state (or 0)
    # one recomputed block's activations during its backward ([Note: recompute in the
    # memory model]); apart from ``activations``, which scale with the micro-batches in flight
    recompute: float = 0.0

    @property
    def total(self) -> float:
        held = self.weights + self.gradients + self.adam_state + self.activations
        return held + self.outer_state + self.recompute


def stage_memory(
    model,
    precision: str,
    layers: tuple[int, int],
    replicas: int,
    micro_batch: int,
    seq_len: int,
    in_flight: float,
    outer_per_param: float = 0.0,
    *,
    recompute: str = "none",
    split: bool = False,
) -> MemoryBreakdown:
    """Peak bytes on one device holding layers ``[a, b)`` as one of ``replicas`` replicas
    with ``in_flight`` micro-batches' worth of activations held, and ``outer_per_param``
    bytes of outer-loop state per parameter partitioned over the replicas; ``recompute``
    the blocks run under recompute and ``split`` whether the schedule splits the backward
    ([Note: recompute in the memory model])."""
    params = stage_param_count(model, layers)
    e = elem_bytes(precision)
    shape = (micro_batch, seq_len)
    per_mb = _activations_per_micro_batch(
        model, precision, layers, *shape, "none" if split else recompute
    )
    return MemoryBreakdown(
        weights=float(params * e),
        gradients=float(params * e),
        adam_state=float(params * adam_bytes_per_param(precision)) / replicas,
        activations=per_mb * in_flight,
        outer_state=float(params * outer_per_param) / replicas,
        recompute=recompute_peak_bytes(model, precision, layers, *shape, recompute),
    )


def recompute_peak_bytes(
    model, precision: str, layers: tuple[int, int], micro_batch: int, seq_len: int, recompute: str
) -> float:
    """One recomputed block's activations, rebuilt during its backward (0 when the stage
    has no block under recompute): [Note: recompute in the memory model]."""
    blocks = [i for i in range(*layers) if checkpointed(recompute, i, model.n_layer)]
    if not blocks:
        return 0.0
    return max(activation_bytes(model, i, micro_batch, seq_len, precision) for i in blocks)


def outer_state_bytes_per_param(spec: ClusterSpec) -> float:
    """Bytes per parameter of outer-loop state a replica group's replicas hold in host RAM
    (not on their devices), before the ZeRO-1 partitioning ([Note: a replica group's
    spec]); 0 unless the strategy is outer. With a grid of ``fragments`` or codecs the
    largest share is counted."""
    pl = spec.plan
    if pl.strategy != "outer":
        return 0.0
    fragments = min(choice_values(pl.outer.fragments, default=[1]))
    topk = OUTER_TOPK_FEEDBACK_BYTES if "topk" in pl.outer.codecs else 0.0
    return OUTER_STATE_BYTES + topk + OUTER_IN_FLIGHT_BYTES / max(fragments, 1)


def _activations_per_micro_batch(
    model,
    precision: str,
    layers: tuple[int, int],
    micro_batch: int,
    seq_len: int,
    recompute: str = "none",
) -> float:
    """Bytes one micro-batch in flight holds on the stage: each layer's activations, or a
    recomputed block's input alone ([Note: recompute in the memory model])."""
    a, b = layers
    bsh = micro_batch * seq_len * model.n_embd * elem_bytes(precision)
    per_mb = sum(
        bsh
        if checkpointed(recompute, i, model.n_layer)
        else activation_bytes(model, i, micro_batch, seq_len, precision)
        for i in range(a, b)
    )
    if a > 0:  # the received activation this stage must keep for its backward
        per_mb += bsh
    return per_mb


def _recompute_of(spec: ClusterSpec, plan: Plan) -> dict[str, Any]:
    """The memory model's recompute arguments for ``plan`` under ``spec``."""
    return {"recompute": spec.training.recompute, "split": plan.schedule in SPLIT_FAMILIES}


def inflight_caps(spec: ClusterSpec, plan: Plan) -> list[int]:
    """Per stage, the most micro-batches whose activations fit beside the stage's weights,
    gradients and Adam shard on its device (0 when not even one does): the bound a
    ``lookahead-zb`` stage defers its weight gradients within."""
    out = []
    for k, limit in enumerate(device_limits(spec, plan.stage_sites)):
        static = stage_memory(
            spec.model,
            spec.training.precision,
            plan.partition[k],
            plan.pipelines,
            plan.micro_batch_size,
            plan.seq_len,
            0,
            **_recompute_of(spec, plan),
        ).total
        per_mb = _activations_per_micro_batch(
            spec.model,
            spec.training.precision,
            plan.partition[k],
            plan.micro_batch_size,
            plan.seq_len,
            "none" if plan.schedule in SPLIT_FAMILIES else spec.training.recompute,
        )
        out.append(max(0, int((limit - static) // per_mb)) if per_mb > 0 else plan.num_microbatches)
    return out


def plan_memory(spec: ClusterSpec, plan: Plan, in_flight: Sequence[float]) -> list[MemoryBreakdown]:
    """Every stage's peak device memory under ``plan`` with ``in_flight[k]`` micro-batches in
    flight (a replica group's outer state is in host RAM: [Note: a replica group's spec])."""
    return [
        stage_memory(
            spec.model,
            spec.training.precision,
            plan.partition[k],
            plan.pipelines,
            plan.micro_batch_size,
            plan.seq_len,
            in_flight[k],
            **_recompute_of(spec, plan),
        )
        for k in range(plan.num_stages)
    ]


def device_limits(spec: ClusterSpec, stage_sites: Sequence[str]) -> list[float]:
    """Device memory (bytes) of each stage's site."""
    limit = {s.name: s.device_memory_gb * GiB for s in spec.sites}
    return [limit[s] for s in stage_sites]


def stages_over(memory: Sequence[MemoryBreakdown], limits: Sequence[float]) -> list[int]:
    """The stages whose peak exceeds their device's memory (a plan fits when there are none)."""
    return [k for k, (mb, lim) in enumerate(zip(memory, limits, strict=True)) if mb.total > lim]


def snapshot_bytes(model, layers: tuple[int, int], kept: int) -> float:
    """Host RAM one replica of layers ``[a, b)`` uses for its recovery snapshots: the full
    (unsharded) fp32 weights and both Adam moments, 12 B per parameter, per kept boundary
    (``kept`` is the runtime's choice, passed in from the spec). Independent of precision:
    the snapshots hold the fp32 master state."""
    return float(stage_param_count(model, layers) * 12 * kept)
