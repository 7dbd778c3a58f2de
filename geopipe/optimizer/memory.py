"""Per-device memory model of one stage replica under ZeRO-1.

``total = weights + gradients + optimizer_shard + activations × in_flight``

* fp32 training: 4 B weights + 4 B gradients per parameter, Adam ``m`` and ``v`` (8 B)
  sharded over the stage's ``d`` replicas (ZeRO-1 partitions only optimizer state);
* bf16/fp16 mixed precision: 2 B + 2 B, and fp32 master weights + ``m`` + ``v`` (12 B)
  sharded over ``d``;
* activations: what each layer keeps for backward per micro-batch
  (:func:`geopipe.optimizer.costs.activation_bytes`), times the peak number of micro-batches
  in flight on that stage (which the schedule fixes: ``m`` for GPipe, ``p-k`` for 1F1B, ΔN
  more for look-ahead), plus one received input buffer per in-flight micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from geopipe.optimizer.costs import activation_bytes, elem_bytes, layer_param_counts

__all__ = ["SNAPSHOTS_KEPT", "MemoryBreakdown", "snapshot_bytes", "stage_memory"]

SNAPSHOTS_KEPT = 2  # step boundaries each replica keeps for recovery (the runtime's choice)


@dataclass(frozen=True)
class MemoryBreakdown:
    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def stage_memory(
    model,
    precision: str,
    layers: tuple[int, int],
    replicas: int,
    micro_batch: int,
    seq_len: int,
    in_flight: int,
) -> MemoryBreakdown:
    """Peak bytes on one device holding layers ``[a, b)`` as one of ``replicas`` replicas."""
    a, b = layers
    params = sum(layer_param_counts(model)[a:b])
    e = elem_bytes(precision)
    opt_bytes = 8 if precision == "fp32" else 12
    per_mb = sum(activation_bytes(model, i, micro_batch, seq_len, precision) for i in range(a, b))
    if a > 0:  # the received activation this stage must keep for its backward
        per_mb += micro_batch * seq_len * model.n_embd * e
    return MemoryBreakdown(
        weights=float(params * e),
        gradients=float(params * e),
        optimizer=float(params * opt_bytes) / replicas,
        activations=per_mb * in_flight,
    )


def snapshot_bytes(model, layers: tuple[int, int], kept: int = SNAPSHOTS_KEPT) -> float:
    """Host RAM one replica of layers ``[a, b)`` uses for its recovery snapshots: the full
    (unsharded) fp32 weights and both Adam moments, 12 B per parameter, per kept boundary.
    Independent of precision: the snapshots hold the fp32 master state."""
    a, b = layers
    return float(sum(layer_param_counts(model)[a:b]) * 12 * kept)
