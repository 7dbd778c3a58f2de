"""Sizes of the models in closed form: layers, parameters, FLOPs and bytes per parameter.

The one home of these facts: the model (:mod:`geopipe.model.gpt`), config validation and the
planner's cost and memory models all read them here, so they agree. Pure arithmetic; imports
nothing from geopipe (nor torch), so any layer may use it.

Global layer indexing: layer ``0`` is the embedding (token + position), layers
``1 .. n_layer`` the transformer blocks, layer ``n_layer + 1`` the head (final LayerNorm +
LM head) — :func:`num_layers` pipeline layers in all.

Two architectures: the built-in GPT (``family == "gpt"``: learned positions, LayerNorm, a 4h
GELU MLP, biases everywhere, untied head) and the Llama-like `transformers` families
(:data:`geopipe.model.hfarch.SUPPORTED_FAMILIES`: rotary positions, RMSNorm, grouped-query
attention, a gated MLP of ``intermediate_size``, the family's own biases, q/k norms and
extra norms, maybe a tied head).
Every function dispatches on ``family``; the GPT formulas are unchanged.

[Note: a tied head's copy]
    With ``tie_embeddings`` the head's ``lm_head`` is the embedding matrix: the model has it
    once (:func:`param_totals`, :func:`stage_param_count` of a stage holding both ends), but
    a pipeline that puts the embedding and the head on different stages holds two copies,
    one per stage, kept equal by exchanging their gradients every step. So the per-layer list
    (:func:`layer_param_counts`) counts the head's copy in the head layer.
"""

from __future__ import annotations

import math
from typing import Protocol

from geopipe.model.hfarch import block_shapes

__all__ = [
    "ModelShape",
    "adam_bytes_per_param",
    "elem_bytes",
    "embed_block_head_params",
    "gated_embed_block_head_params",
    "is_gated",
    "layer_forward_flops",
    "layer_param_counts",
    "num_layers",
    "param_totals",
    "stage_param_count",
    "tied_embedding_elems",
    "train_bytes_per_param",
]


class ModelShape(Protocol):
    """What the formulas read (:class:`geopipe.config.ModelSpec` has these fields)."""

    n_layer: int
    n_embd: int
    vocab_size: int
    max_seq_len: int
    # ModelSpec also has family, n_head, n_kv_head, head_dim, intermediate_size,
    # tie_embeddings, attention_bias and mlp_bias, which the gated families' formulas read
    # (GatedShape in geopipe.model.hfarch); a shape without ``family`` is the GPT.


def is_gated(m: object) -> bool:
    """Whether ``m`` is a Llama-like `transformers` family (else the built-in GPT)."""
    return getattr(m, "family", "gpt") != "gpt"


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


def _gated_dims(m) -> tuple[int, int, int, int, int]:
    """(hidden, heads, kv heads, head dim, MLP width) of a gated family's ModelSpec."""
    h, heads = m.n_embd, m.n_head
    return h, heads, m.n_kv_head or heads, m.head_dim or h // heads, m.intermediate_size or 0


def _gated_block_matmul_params(m) -> int:
    """Weights of one gated block's matmuls: q, k, v, o and gate, up, down."""
    h, heads, kv, hd, inter = _gated_dims(m)
    return h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter


def gated_embed_block_head_params(m) -> tuple[int, int, int]:
    """Parameters of a `transformers` family's embedding, one block and head (with its own
    copy of a tied embedding: [Note: a tied head's copy]).

    embed ``V·h`` (rotary positions have no parameters); block: every tensor of
    :func:`geopipe.model.hfarch.block_shapes` — q ``h·(H·hd)``, k and v ``h·(kv·hd)`` each
    (Phi-3 fuses them into one matrix of the same size), o ``(H·hd)·h``, the family's
    attention biases, q/k norms (Qwen3 and Gemma 3: ``hd`` each; OLMo 2: ``H·hd`` and
    ``kv·hd``), the gated MLP ``3·h·I`` (+ biases with Llama's ``mlp_bias``) and its RMSNorm
    weights (``h`` each: two, Gemma's four); head: the final RMSNorm ``h`` + ``lm_head``
    ``V·h`` (no bias).
    """
    block = sum(math.prod(shape) for shape in block_shapes(m).values())
    return m.vocab_size * m.n_embd, block, m.n_embd + m.vocab_size * m.n_embd


def _embed_block_head(m) -> tuple[int, int, int]:
    if is_gated(m):
        return gated_embed_block_head_params(m)
    return embed_block_head_params(m.n_embd, m.vocab_size, m.max_seq_len)


def tied_embedding_elems(m: object) -> int:
    """Elements of a tied embedding matrix (``V·h``; 0 when the head is not tied): what the
    two copies' stages exchange as gradients every step when the pipeline splits them."""
    if not getattr(m, "tie_embeddings", False):
        return 0
    return m.vocab_size * m.n_embd  # type: ignore[attr-defined]


def layer_param_counts(m: ModelShape) -> list[int]:
    """Parameters per layer: embed (token + position), blocks, head (final LN + LM head; a
    tied head counts its copy: [Note: a tied head's copy])."""
    embed, block, head = _embed_block_head(m)
    return [embed] + [block] * m.n_layer + [head]


def stage_param_count(m: ModelShape, layers: tuple[int, int]) -> int:
    """Parameters a stage of layers ``[a, b)`` holds: one copy of a tied embedding when it
    holds both ends, else the sum of its layers."""
    a, b = layers
    embed, block, head = _embed_block_head(m)
    last = num_layers(m.n_layer) - 1
    blocks = max(0, min(b, last) - max(a, 1))
    n = (embed if a == 0 else 0) + block * blocks + (head if b > last else 0)
    if a == 0 and b > last:
        n -= tied_embedding_elems(m)
    return n


def param_totals(m: ModelShape) -> tuple[int, int]:
    """(all parameters, the largest layer's) in closed form; a tied embedding counts once.

    Config validation needs these for any ``n_layer`` a user may type, so no per-layer list.
    """
    embed, block, head = _embed_block_head(m)
    total = embed + block * m.n_layer + head - tied_embedding_elems(m)
    return total, max(embed, block, head)


def layer_forward_flops(m: ModelShape, seq_len: int) -> list[float]:
    """Forward FLOPs per token for each layer at a given sequence length.

    Matmuls cost 2 FLOPs per multiply-add; attention adds QK^T and AV (4·s·h per token,
    ``h = heads · head_dim``). The embedding is a lookup; we charge it one add per element so
    it is not free. Biases, norms (q/k norms too), Gemma's embedding scale and soft-capping
    are not counted. A sliding-window layer is charged the full ``s`` too: the stage runs
    attention with a mask, which computes the masked scores as well.
    """
    h, v = m.n_embd, m.vocab_size
    if is_gated(m):
        _, heads, _, hd, _ = _gated_dims(m)
        block = 2.0 * _gated_block_matmul_params(m) + 4.0 * seq_len * heads * hd
    else:
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
