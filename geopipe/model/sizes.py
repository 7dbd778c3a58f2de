"""Sizes of the GPT in closed form: layers, parameters, FLOPs and bytes per parameter.

The one home of these facts: the model (:mod:`geopipe.model.gpt`), config validation and the
planner's cost and memory models all read them here, so they agree. Pure arithmetic; imports
nothing from geopipe (nor torch), so any layer may use it.

Global layer indexing: layer ``0`` is the embedding (token + position), layers
``1 .. n_layer`` the transformer blocks, layer ``n_layer + 1`` the head (final LayerNorm +
LM head) — :func:`num_layers` pipeline layers in all.
"""

from __future__ import annotations

from typing import Protocol

__all__ = [
    "ModelShape",
    "adam_bytes_per_param",
    "elem_bytes",
    "embed_block_head_params",
    "layer_forward_flops",
    "layer_param_counts",
    "num_layers",
    "param_totals",
    "train_bytes_per_param",
]


class ModelShape(Protocol):
    """What the formulas read (:class:`geopipe.config.ModelSpec` has these fields)."""

    n_layer: int
    n_embd: int
    vocab_size: int
    max_seq_len: int


def num_layers(n_layer: int) -> int:
    """Pipeline layers of a model with ``n_layer`` blocks: embedding + blocks + head."""
    return n_layer + 2


def embed_block_head_params(n_embd: int, vocab_size: int, max_seq_len: int) -> tuple[int, int, int]:
    """Parameters of the embedding, of one block and of the head."""
    h, v = n_embd, vocab_size
    embed = v * h + max_seq_len * h  # token + learned position embedding
    # ln_1 (2h) + qkv (3h^2 + 3h) + attn proj (h^2 + h) + ln_2 (2h) + fc (4h^2 + 4h)
    # + mlp proj (4h^2 + h)
    block = 12 * h * h + 13 * h
    head = 2 * h + v * h  # ln_f + lm_head (no bias)
    return embed, block, head


def layer_param_counts(m: ModelShape) -> list[int]:
    """Parameters per layer: embed (token + position), blocks, head (final LN + LM head)."""
    embed, block, head = embed_block_head_params(m.n_embd, m.vocab_size, m.max_seq_len)
    return [embed] + [block] * m.n_layer + [head]


def param_totals(m: ModelShape) -> tuple[int, int]:
    """(all parameters, the largest layer's) in closed form.

    Config validation needs these for any ``n_layer`` a user may type, so no per-layer list.
    """
    embed, block, head = embed_block_head_params(m.n_embd, m.vocab_size, m.max_seq_len)
    return embed + block * m.n_layer + head, max(embed, block, head)


def layer_forward_flops(m: ModelShape, seq_len: int) -> list[float]:
    """Forward FLOPs per token for each layer at a given sequence length.

    Matmuls cost 2 FLOPs per multiply-add; attention adds QK^T and AV (4·s·h per token).
    The embedding is a lookup; we charge it one add per element so it is not free.
    """
    h, v = m.n_embd, m.vocab_size
    block = 24.0 * h * h + 4.0 * seq_len * h
    head = 2.0 * h * v
    return [float(h)] + [block] * m.n_layer + [head]


def elem_bytes(precision: str) -> int:
    """Bytes of one weight, gradient or activation element in the training precision."""
    return 4 if precision == "fp32" else 2


def adam_bytes_per_param(precision: str) -> int:
    """Adam state per parameter before ZeRO-1 shards it: ``m`` and ``v`` (fp32: 8 B), plus
    the fp32 master weights under mixed precision (12 B)."""
    return 8 if precision == "fp32" else 12


def train_bytes_per_param(precision: str) -> int:
    """Weights + gradients + Adam state per parameter, unsharded: 16 B in every precision."""
    return 2 * elem_bytes(precision) + adam_bytes_per_param(precision)
