"""Architecture facts of the `transformers` decoder-only families geopipe trains, without
`transformers`: which families, the defaults their config classes fill in, where their
biases are, and every tensor a ``save_pretrained`` checkpoint of one holds, with its shape.

Pure data and arithmetic (no torch, no `transformers`, no file access), so config validation
and the planner's size formulas (:mod:`geopipe.model.sizes`) can read it; the stage modules
(:mod:`geopipe.model.hf`) take :data:`SUPPORTED_FAMILIES` from here, so there is one list.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = [
    "CONFIG_DEFAULTS",
    "SUPPORTED_FAMILIES",
    "GatedShape",
    "attention_biases",
    "tensor_shapes",
]

# Llama-like families: RMSNorm, rotary positions, a gated (SwiGLU) MLP, grouped-query
# attention, layers named model.embed_tokens / model.layers.{i} / model.norm / lm_head.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")

# What each family's config class (transformers 5) assumes for a key config.json omits; the
# unit tests compare this table against the classes themselves. ``None`` for
# num_key_value_heads means "num_attention_heads"; head_dim is always hidden // heads when
# absent.
_COMMON = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False}
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False,
    },
    "mistral": {
        **_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
    },
    "qwen2": {
        **_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
    },
}  # fmt: skip


class GatedShape(Protocol):
    """The fields of :class:`geopipe.config.ModelSpec` the formulas read for these families."""

    family: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int | None
    head_dim: int | None
    intermediate_size: int | None
    vocab_size: int
    tie_embeddings: bool
    attention_bias: bool | None
    mlp_bias: bool | None


def attention_biases(family: str, attention_bias: bool | None) -> tuple[bool, bool]:
    """(q/k/v projections have biases, o_proj has one). Qwen2 has q/k/v biases by design and
    none on o_proj; Llama puts ``attention_bias`` on all four; Mistral has none."""
    if family == "qwen2":
        return True, False
    if family == "llama":
        return bool(attention_bias), bool(attention_bias)
    return False, False


def tensor_shapes(m: GatedShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the family's ``*ForCausalLM`` (as ``save_pretrained`` names them), with
    its shape; ``lm_head.weight`` only when the embeddings are not tied."""
    h, v, heads, kv = m.n_embd, m.vocab_size, m.n_head, m.n_kv_head or m.n_head
    hd = m.head_dim or h // heads
    inter = m.intermediate_size or 0
    qkv_bias, o_bias = attention_biases(m.family, m.attention_bias)
    mlp_bias = bool(m.mlp_bias) and m.family == "llama"
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(m.n_layer):
        p = f"model.layers.{i}."
        layer = {
            "self_attn.q_proj.weight": (heads * hd, h),
            "self_attn.k_proj.weight": (kv * hd, h),
            "self_attn.v_proj.weight": (kv * hd, h),
            "self_attn.o_proj.weight": (h, heads * hd),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }
        if qkv_bias:
            layer.update({"self_attn.q_proj.bias": (heads * hd,),
                          "self_attn.k_proj.bias": (kv * hd,),
                          "self_attn.v_proj.bias": (kv * hd,)})  # fmt: skip
        if o_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if mlp_bias:
            layer.update({"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,),
                          "mlp.down_proj.bias": (h,)})  # fmt: skip
        out.update({p + k: s for k, s in layer.items()})
    out["model.norm.weight"] = (h,)
    if not m.tie_embeddings:
        out["lm_head.weight"] = (v, h)
    return out
