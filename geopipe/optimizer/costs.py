"""Analytic costs of the GPT layers: parameters, FLOPs, activation and message sizes.

Pure arithmetic on :class:`~geopipe.config.ModelSpec`; the simulator, the memory
model and the partitioner all read their numbers from here so they agree.

Layer indexing matches :mod:`geopipe.model.gpt`: layer 0 is the embedding,
layers ``1..n_layer`` the transformer blocks, layer ``n_layer + 1`` the head.
"""

from __future__ import annotations

from typing import Protocol

__all__ = [
    "activation_bytes",
    "boundary_message_elems",
    "elem_bytes",
    "layer_forward_flops",
    "layer_param_counts",
    "num_layers",
    "param_totals",
]


class _Model(Protocol):
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    max_seq_len: int


def num_layers(m: _Model) -> int:
    return m.n_layer + 2


def _embed_block_head_params(m: _Model) -> tuple[int, int, int]:
    h, v = m.n_embd, m.vocab_size
    embed = v * h + m.max_seq_len * h
    # ln_1 (2h) + qkv (3h^2 + 3h) + attn proj (h^2 + h) + ln_2 (2h) + fc (4h^2 + 4h)
    # + mlp proj (4h^2 + h)
    block = 12 * h * h + 13 * h
    head = 2 * h + v * h
    return embed, block, head


def layer_param_counts(m: _Model) -> list[int]:
    """Parameters per layer: embed (token + position), blocks, head (final LN + LM head)."""
    embed, block, head = _embed_block_head_params(m)
    return [embed] + [block] * m.n_layer + [head]


def param_totals(m: _Model) -> tuple[int, int]:
    """(all parameters, the largest layer's) in closed form.

    Config validation needs these for any ``n_layer`` a user may type, so no per-layer list.
    """
    embed, block, head = _embed_block_head_params(m)
    return embed + block * m.n_layer + head, max(embed, block, head)


def layer_forward_flops(m: _Model, seq_len: int) -> list[float]:
    """Forward FLOPs per token for each layer at a given sequence length.

    Matmuls cost 2 FLOPs per multiply-add; attention adds QK^T and AV (4·s·h per token).
    The embedding is a lookup; we charge it one add per element so it is not free.
    """
    h, v = m.n_embd, m.vocab_size
    block = 24.0 * h * h + 4.0 * seq_len * h
    head = 2.0 * h * v
    return [float(h)] + [block] * m.n_layer + [head]


def elem_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def boundary_message_elems(m: _Model, micro_batch: int, seq_len: int) -> int:
    """Elements of one activation (or its gradient) crossing a stage boundary."""
    return micro_batch * seq_len * m.n_embd


def activation_bytes(
    m: _Model, layer: int, micro_batch: int, seq_len: int, precision: str
) -> float:
    """Bytes kept for backward by one layer for one micro-batch.

    Per block ~16·b·s·h elements (LN inputs/outputs, qkv, attention output, MLP hidden 4h
    twice, residuals) with a fused attention kernel that does not store the s×s matrix;
    the head keeps its logits and their softmax (2·b·s·V).
    """
    e = elem_bytes(precision)
    bsh = micro_batch * seq_len * m.n_embd
    if layer == 0:
        return float(bsh * e)
    if layer == num_layers(m) - 1:
        return float(bsh * e + 2 * micro_batch * seq_len * m.vocab_size * e)
    return float(16 * bsh * e)
