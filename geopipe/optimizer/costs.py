"""Analytic costs of the model's layers for the planner: activation and message sizes.

Pure arithmetic on :class:`~geopipe.config.ModelSpec`; the simulator, the memory model and
the partitioner read their numbers from here and from :mod:`geopipe.model.sizes` (parameter
counts, FLOPs, bytes per element), so they agree.

Layer indexing matches :mod:`geopipe.model.gpt`: layer 0 is the embedding,
layers ``1..n_layer`` the transformer blocks, layer ``n_layer + 1`` the head.
"""

from __future__ import annotations

from typing import Protocol

from geopipe.model.sizes import elem_bytes, is_gated, num_layers

__all__ = [
    "INPUT_GRAD_SHARE",
    "activation_bytes",
    "boundary_message_elems",
    "gated_block_activation_elems",
    "split_backward",
]


class _Model(Protocol):
    n_layer: int
    n_embd: int
    vocab_size: int


def boundary_message_elems(m: _Model, micro_batch: int, seq_len: int) -> int:
    """Elements of one activation (or its gradient) crossing a stage boundary."""
    return micro_batch * seq_len * m.n_embd


def activation_bytes(
    m: _Model, layer: int, micro_batch: int, seq_len: int, precision: str
) -> float:
    """Bytes kept for backward by one layer for one micro-batch.

    Per GPT block ~16·b·s·h elements (LN inputs/outputs, qkv, attention output, MLP hidden
    4h twice, residuals) with a fused attention kernel that does not store the s×s matrix;
    the head keeps its logits and their softmax (2·b·s·V). A gated (Llama-like) block keeps
    :func:`gated_block_activation_elems` per token.
    """
    e = elem_bytes(precision)
    bsh = micro_batch * seq_len * m.n_embd
    if layer == 0:
        return float(bsh * e)
    if layer == num_layers(m.n_layer) - 1:
        return float(bsh * e + 2 * micro_batch * seq_len * m.vocab_size * e)
    if is_gated(m):
        return float(micro_batch * seq_len * gated_block_activation_elems(m) * e)
    return float(16 * bsh * e)


def gated_block_activation_elems(m) -> int:
    """Elements per token one gated (Llama-like) block keeps for backward, counted as the
    GPT's are: the block input and the residual (2h), both RMSNorm outputs (2h), the rotated
    q and k and v (``(H + 2·kv)·hd``), the attention output (``H·hd``, o_proj's input; fused
    SDPA keeps no s×s matrix), and the MLP's gate, up, SiLU(gate) and product (4·I)."""
    h, heads = m.n_embd, m.n_head
    kv, hd = m.n_kv_head or heads, m.head_dim or h // heads
    return 4 * h + (2 * heads + 2 * kv) * hd + 4 * (m.intermediate_size or 0)


# The input-gradient pass's share of a stage's backward when it is split (I + W = B). Qi et
# al. (ZB, ICLR 2024) find I ≈ W ≈ F for transformer layers: every matmul's backward is one
# matmul for the input gradient and one for the weight gradient.
INPUT_GRAD_SHARE = 0.5
# What splitting costs on top: I + W = (1 + SPLIT_OVERHEAD) · B on every stage but the first.
# Measured with the runtime's split (benchmarks/wsplit.py --testbed, the last stage's
# calibrated times): I + W = 1.02 × B, W adding into the accumulated gradients in place
# ([Note: W accumulates in place] in geopipe.runtime.actor.backward). What it pays is W's own
# entry into DeepSpeed's backward (its hooks run twice per micro-batch) and I's separate
# graph walk. The planner's choice between look-ahead and look-ahead with split
# backward (schedule: auto) hinges on it; calibration replaces it with the measured I and W
# once a split schedule runs.
SPLIT_OVERHEAD = 0.03


def split_backward(
    bwd_s: float, first: bool, share: float = INPUT_GRAD_SHARE
) -> tuple[float, float]:
    """``(I, W)`` seconds of a stage whose full backward takes ``bwd_s``. The first stage has
    no upstream to send a gradient to, so its ``I`` does nothing and ``W`` is the whole
    backward (what the runtime does, as ``torch.distributed.pipelining`` does)."""
    if first:
        return 0.0, bwd_s
    total = (1.0 + SPLIT_OVERHEAD) * bwd_s
    return share * total, (1.0 - share) * total
