"""Small models of the families beyond Llama, Qwen2 and Mistral (Qwen3, Gemma 2, Gemma 3's
text model, Phi-3, OLMo 2), tied and untied, each with the particularities the stages must
reproduce switched on where a tiny model can show them: sliding windows shorter than the
test sequences, Gemma's soft-capping at values that bite, per-kind RoPE, longrope past its
original length, q/k norms and biases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

# The unit tier's small model of every family (test_hf_stage and test_export use it too);
# its vocabulary differs from tests/_hfdoc.py's LLAMA (256: the stdlib data's bytes), as
# these tests feed random token ids, never the data.
SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
SEQ = 25  # longer than every window below (8) and Phi-3's longrope original length (16)
NO_TOKENS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
# the short and long factors of a rotary dimension 4 (head_dim 8, partial factor 0.5)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5],
    "long_factor": [2.0, 3.0],
    "partial_rotary_factor": 0.5,
    "rope_theta": 10000.0,
}
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
}
# name -> (model_type, config fields beyond SMALL)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-tied": ("qwen3", {"head_dim": 16, "tie_word_embeddings": True}),
    "qwen3-untied-window": (
        "qwen3",
        {
            "head_dim": 8,
            "tie_word_embeddings": False,
            "attention_bias": True,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        },
    ),
    "gemma2-tied": (
        "gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 12,
            "sliding_window": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 1.5,
            "tie_word_embeddings": True,
        },
    ),
    "gemma2-untied": (
        "gemma2",
        {"head_dim": 8, "sliding_window": 8, "attention_bias": True, "tie_word_embeddings": False},
    ),
    "gemma3-tied": (
        "gemma3_text",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 10,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": GEMMA3_ROPE,
            "final_logit_softcapping": 3.0,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3-untied": (
        "gemma3_text",
        {
            "head_dim": 8,
            "sliding_window": 8,
            "attn_logit_softcapping": 2.0,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
            "tie_word_embeddings": False,
        },
    ),
    "phi3-untied-window": (
        "phi3",
        {**NO_TOKENS, "sliding_window": 8, "tie_word_embeddings": False},
    ),
    "phi3-tied-longrope": (
        "phi3",
        {
            **NO_TOKENS,
            "original_max_position_embeddings": 16,
            "rope_parameters": LONGROPE,
            "tie_word_embeddings": True,
        },
    ),
    "olmo2-untied": ("olmo2", {**NO_TOKENS, "tie_word_embeddings": False}),
    "olmo2-tied": ("olmo2", {**NO_TOKENS, "attention_bias": True, "tie_word_embeddings": True}),
}


def config_of(name: str, **override: Any) -> Any:
    family, extra = CASES[name]
    fields = {**SMALL, **extra, **override}
    if "rope_parameters" in fields:  # the config class keeps (and fills) the dict it is given
        fields["rope_parameters"] = _copy(fields["rope_parameters"])
    return CONFIG_MAPPING[family](**fields)


def _copy(value: Any) -> Any:
    return {k: _copy(v) for k, v in value.items()} if isinstance(value, dict) else value


def saved(tmp_path: Path, name: str, **override: Any) -> tuple[torch.nn.Module, Path]:
    """The transformers model of a case, every parameter moved off its init (norms too, so
    Gemma's ``1 + weight`` and OLMo 2's norm placement matter), saved with save_pretrained."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(name, **override)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    out = tmp_path / name
    model.save_pretrained(out)
    return model, out


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=gen)
