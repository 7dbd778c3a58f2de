"""Architecture facts of the `transformers` decoder-only families geopipe trains, without
`transformers`: which families, the defaults their config classes fill in, how each family's
layers differ from Llama's (:data:`FAMILIES`), which RoPE variants its rotary embedding
takes, and every tensor a ``save_pretrained`` checkpoint of one holds, with its shape.

Pure data and arithmetic (no torch, no `transformers`, no file access), so config validation
and the planner's size formulas (:mod:`geopipe.model.sizes`) can read it; the stage modules
(:mod:`geopipe.model.hf`) take :data:`SUPPORTED_FAMILIES` and :data:`FAMILIES` from here, so
there is one list.

[Note: what a stage must do that the modules do not]
    A stage copies the family's decoder layers, norm, embedding and head, so whatever lives
    inside a module comes for free (Gemma's sqrt(hidden) embedding scale is in its embedding
    module, its (1 + weight) RMSNorm, the query pre-attention scalar, Qwen3's and OLMo 2's
    q/k norms, OLMo 2's norms after attention and MLP, Phi-3's fused projections). What the
    *model's* forward does around the modules is what a stage must redo, and :class:`Family`
    records it: which attention mask each layer gets (``masks``), whether the rotary
    embedding differs per attention kind (``rope_per_layer_type``), whether the logits are
    soft-capped after the head (``final_softcap``); and, for geopipe's own seeded init, the
    neutral value of a norm weight (``norm_offset``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "ATTENTION_KINDS",
    "CONFIG_DEFAULTS",
    "FAMILIES",
    "ROPE_REQUIRED",
    "SUPPORTED_FAMILIES",
    "Family",
    "GatedShape",
    "attention_biases",
    "block_shapes",
    "tensor_shapes",
]

# The RoPE variants a stage supports, with the keys `transformers`' config validation requires
# beside ``rope_type`` and what the config fills itself (``rope_theta``, and
# ``original_max_position_embeddings`` from the config's own field or max_position_embeddings):
# a missing one is a KeyError when the config is built, so the YAML check refuses it first.
# The stage builds the family's own rotary embedding, so each is computed as `transformers`
# computes it (tests compare every one). Left out: "proportional", written for Gemma 4's
# per-layer configs, which none of these families has.
ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
ATTENTION_KINDS = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Family:
    """How one family departs from Llama (see [Note: what a stage must do that the modules
    do not]).

    ``norms``: ``"pre"`` (input_layernorm before attention, post_attention_layernorm before
    the MLP), ``"sandwich"`` (Gemma: those two plus pre_feedforward and post_feedforward), or
    ``"post"`` (OLMo 2: post_attention and post_feedforward, after each sub-block).
    ``qk_norm``: None, ``"head"`` (RMSNorm over head_dim: Qwen3, Gemma 3) or ``"proj"`` (over
    the whole q / k projection: OLMo 2). ``fused``: q/k/v in one ``qkv_proj`` and gate/up in
    one ``gate_up_proj`` (Phi-3). ``biases``: ``"llama"`` (attention_bias on q/k/v/o,
    mlp_bias on the MLP), ``"qkv"`` (q/k/v always, Qwen2), ``"config"`` (attention_bias on
    q/k/v/o) or ``"none"``. ``masks``: ``"causal"`` (every layer), ``"window"`` (every layer
    sliding when ``sliding_window`` is set: Mistral, Phi-3) or ``"layer_types"`` (the config's
    ``layer_types``). ``norm_offset``: RMSNorm scales by ``1 + weight`` (Gemma), so a neutral
    weight is 0. ``rope_per_layer_type``: one rotary table per attention kind (Gemma 3).
    ``final_softcap``: ``tanh`` soft-capping of the logits after the head (Gemma).
    ``heads_divide_hidden``: the config class requires ``hidden_size % num_attention_heads
    == 0`` even with an explicit head_dim (Gemma). ``rope_types``: the RoPE variants the
    family's config accepts (Phi-3: default and longrope only).
    """

    norms: str = "pre"
    qk_norm: str | None = None
    fused: bool = False
    biases: str = "none"
    masks: str = "causal"
    norm_offset: bool = False
    rope_per_layer_type: bool = False
    final_softcap: bool = False
    heads_divide_hidden: bool = False
    rope_types: tuple[str, ...] = tuple(ROPE_REQUIRED)


_GEMMA = dict(
    norms="sandwich",
    biases="config",
    masks="layer_types",
    norm_offset=True,
    final_softcap=True,
    heads_divide_hidden=True,
)
FAMILIES: dict[str, Family] = {
    "llama": Family(biases="llama"),
    "mistral": Family(masks="window"),
    "qwen2": Family(biases="qkv", masks="layer_types"),
    "qwen3": Family(biases="config", qk_norm="head", masks="layer_types"),
    "gemma2": Family(**_GEMMA),
    "gemma3_text": Family(**_GEMMA, qk_norm="head", rope_per_layer_type=True),
    "phi3": Family(fused=True, masks="window", rope_types=("default", "longrope")),
    "olmo2": Family(norms="post", qk_norm="proj", biases="config"),
}
SUPPORTED_FAMILIES = tuple(FAMILIES)

# What each family's config class (transformers 5) assumes for a key config.json omits; the
# unit tests compare this table against the classes themselves. ``None`` for
# num_key_value_heads means "num_attention_heads"; head_dim is hidden // heads when absent
# unless the family's class has its own default here.
_COMMON = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "pad_token_id": None}
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mistral": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
    },
    "qwen2": {
        **_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
    },
    "qwen3": {
        **_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "attention_bias": False,
    },
    "gemma2": {
        **_COMMON,
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 8192,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
    },
    "gemma3_text": {
        **_COMMON,
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
    },
    "phi3": {
        **_COMMON,
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "pad_token_id": 32000,
    },
    "olmo2": {
        **_COMMON,
        "vocab_size": 50304,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "pad_token_id": 1,
    },
}


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
    none on o_proj; Llama, Qwen3, Gemma and OLMo 2 put ``attention_bias`` on all four;
    Mistral and Phi-3 have none."""
    rule = FAMILIES[family].biases
    if rule == "qkv":
        return True, False
    if rule in ("llama", "config"):
        return bool(attention_bias), bool(attention_bias)
    return False, False


_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}


def block_shapes(m: GatedShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of one decoder layer, named under ``model.layers.{i}.``, with its shape:
    the one description the checkpoint check, the parameter counts and the FLOPs share."""
    fam = FAMILIES[m.family]
    h, heads, kv = m.n_embd, m.n_head, m.n_kv_head or m.n_head
    hd = m.head_dim or h // heads
    inter = m.intermediate_size or 0
    qkv_bias, o_bias = attention_biases(m.family, m.attention_bias)
    a = "self_attn."
    if fam.fused:
        out = {a + "qkv_proj.weight": ((heads + 2 * kv) * hd, h)}
    else:
        out = {
            a + "q_proj.weight": (heads * hd, h),
            a + "k_proj.weight": (kv * hd, h),
            a + "v_proj.weight": (kv * hd, h),
        }
    out[a + "o_proj.weight"] = (h, heads * hd)
    if qkv_bias:
        out.update(
            {
                a + "q_proj.bias": (heads * hd,),
                a + "k_proj.bias": (kv * hd,),
                a + "v_proj.bias": (kv * hd,),
            }
        )
    if o_bias:
        out[a + "o_proj.bias"] = (h,)
    if fam.qk_norm == "head":
        out.update({a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
    elif fam.qk_norm == "proj":
        out.update({a + "q_norm.weight": (heads * hd,), a + "k_norm.weight": (kv * hd,)})
    if fam.fused:
        out["mlp.gate_up_proj.weight"] = (2 * inter, h)
    else:
        out.update({"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h)})
    out["mlp.down_proj.weight"] = (h, inter)
    if bool(m.mlp_bias) and fam.biases == "llama":
        out.update(
            {
                "mlp.gate_proj.bias": (inter,),
                "mlp.up_proj.bias": (inter,),
                "mlp.down_proj.bias": (h,),
            }
        )
    out.update({f"{n}.weight": (h,) for n in _NORMS[fam.norms]})
    return out


def tensor_shapes(m: GatedShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the family's ``*ForCausalLM`` (as ``save_pretrained`` names them), with
    its shape; ``lm_head.weight`` only when the embeddings are not tied."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m.vocab_size, m.n_embd)}
    block = block_shapes(m)
    for i in range(m.n_layer):
        out.update({f"model.layers.{i}.{k}": s for k, s in block.items()})
    out["model.norm.weight"] = (m.n_embd,)
    if not m.tie_embeddings:
        out["lm_head.weight"] = (m.vocab_size, m.n_embd)
    return out
