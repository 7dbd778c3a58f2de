"""The families beyond Llama, Qwen2 and Mistral at YAML load and in the planner's sizes:
a saved Qwen3, Gemma 2, Gemma 3 (text), Phi-3 or OLMo 2 directory fills the spec; parameter
counts and FLOPs equal the `transformers` model's; every RoPE variant the stages support is
exact against `transformers`; every limit a family imposes (RoPE settings, layer kinds and
windows, padding row, Gemma's head split, causal attention) is refused at ``model.hf`` when
the YAML is validated — where `transformers` itself would fail only when a stage is built —
and every other ``model_type`` is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _hffamilies import CASES, SMALL, config_of, saved, tokens
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from geopipe.cli import main
from geopipe.config import ConfigError, ModelSpec, parse_cluster
from geopipe.model.family import ModelDesc, build_stage
from geopipe.model.hf import HFStage, load_stage_weights
from geopipe.model.hfarch import ROPE_REQUIRED, SUPPORTED_FAMILIES, tensor_shapes
from geopipe.model.sizes import (
    layer_forward_flops,
    layer_param_counts,
    num_layers,
    param_totals,
    stage_param_count,
)

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "clusters" / "local-2dc.yaml"


def _doc(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(LOCAL.read_text())
    doc["model"] = {"hf": str(path)}
    doc["plan"]["seq_len"] = 16
    return doc


def _config_dir(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        parse_cluster(_doc(path), "c.yaml")
    found = [msg for field, msg in info.value.problems if field == "model.hf"]
    assert found, info.value.problems
    return found[0]


# -- a saved directory fills the spec; sizes equal the model's ----------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_saved_family_fills_the_spec(tmp_path: Path, name: str) -> None:
    model, path = saved(tmp_path, name)
    m = parse_cluster(_doc(path), "c.yaml").model
    cfg = model.config
    assert (m.family, m.n_layer, m.n_embd, m.n_head) == (cfg.model_type, 3, 32, 4)
    assert m.head_dim == (getattr(cfg, "head_dim", None) or 8)
    assert m.tie_embeddings == cfg.tie_word_embeddings and m.hf_weights
    assert m.attention_bias == bool(getattr(cfg, "attention_bias", False))
    assert param_totals(m)[0] == sum(p.numel() for p in model.parameters())
    assert tensor_shapes(m) == {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_stage_counts_and_flops_equal_the_modules(tmp_path: Path, name: str) -> None:
    model, path = saved(tmp_path, name)
    m = ModelSpec(hf=str(path), max_seq_len=32)
    desc = ModelDesc.from_hf(json.loads((path / "config.json").read_text()))
    counts, last = layer_param_counts(m), num_layers(m.n_layer)
    for a, b in [(0, 2), (2, 3), (3, last), (0, 1), (1, last), (0, last)]:
        held = sum(p.numel() for p in build_stage(desc, a, b, load_weights=False).parameters())
        assert stage_param_count(m, (a, b)) == held, (a, b)
        if (a, b) != (0, last) or not m.tie_embeddings:
            assert sum(counts[a:b]) == held, (a, b)
    layer = model.model.layers[0]
    matmul = sum(x.weight.numel() for x in layer.modules() if isinstance(x, torch.nn.Linear))
    assert layer_forward_flops(m, 32)[1] == 2 * matmul + 4 * 32 * m.n_head * m.head_dim


# -- RoPE: every supported variant exact; what transformers requires, required here ------------

ROPE_VALUES = {
    "factor": 2.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "short_factor": [1.0, 1.5, 2.0, 2.5],
    "long_factor": [2.0, 3.0, 4.0, 5.0],
    "original_max_position_embeddings": 16,
}


def _rope(kind: str) -> dict[str, Any]:
    extra = ("original_max_position_embeddings",) if kind in ("yarn", "longrope", "llama3") else ()
    return {"rope_type": kind, **{k: ROPE_VALUES[k] for k in (*ROPE_REQUIRED[kind], *extra)}}


def test_rope_variants_are_transformers_own() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_REQUIRED) <= {"default", *ROPE_INIT_FUNCTIONS}


@pytest.mark.parametrize("kind", sorted(ROPE_REQUIRED))
def test_each_rope_variant_is_exact_and_its_keys_required(tmp_path: Path, kind: str) -> None:
    llama = CONFIG_MAPPING["llama"]
    fields = {**SMALL, "head_dim": 8, "tie_word_embeddings": False}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama(**fields, rope_parameters=_rope(kind)))
    model.save_pretrained(tmp_path / "m")
    stages = [
        HFStage(json.loads((tmp_path / "m" / "config.json").read_text()), a, b)
        for a, b in [(0, 3), (3, 5)]
    ]
    for s in stages:
        load_stage_weights(s, tmp_path / "m")
    x = tokens(seq=40)  # past the original 16 positions: the scaled frequencies are used
    with torch.no_grad():
        assert torch.equal(stages[1](stages[0](x)), model(input_ids=x).logits)
    assert ModelSpec(hf=str(tmp_path / "m")).family == "llama"
    for key in ROPE_REQUIRED[kind]:
        rope = {k: v for k, v in _rope(kind).items() if k != key}
        with pytest.raises(KeyError):
            llama(**fields, rope_parameters=rope)
        path = _config_dir(tmp_path / key, {**llama(**fields).to_dict(), "rope_parameters": rope})
        assert f"of rope_type {kind!r} lacks {key}" in _refusal(path)


# -- limits refused at model.hf ----------------------------------------------------------------

# (case, config.json change, what the refusal says, whether transformers fails on it too
# when the model is built and run)
LIMITS: dict[str, tuple[str, dict[str, Any], str, bool]] = {
    "unknown-rope": (
        "qwen3-tied",
        {"rope_parameters": {"rope_type": "ntk-magic"}},
        "rope_parameters.rope_type 'ntk-magic' is not a RoPE variant",
        True,
    ),
    "legacy-rope-key": (
        "olmo2-untied",
        {"rope_parameters": None, "rope_scaling": {"type": "ntk-magic", "factor": 2}},
        "rope_scaling.rope_type 'ntk-magic'",
        True,
    ),
    "phi3-linear-rope": (
        "phi3-untied-window",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
        "'linear' is not a RoPE variant geopipe's phi3 stages support",
        True,
    ),
    "longrope-length": (
        "phi3-tied-longrope",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "short_factor": [1.0],
                "long_factor": [1.0, 2.0],
                "partial_rotary_factor": 0.5,
            }
        },
        "short_factor must be a list of 2 numbers",
        True,
    ),
    "gemma3-nested-rope": (
        "gemma3-tied",
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default"},
                "full_attention": {"rope_type": "x"},
            }
        },
        "rope_parameters.full_attention.rope_type 'x'",
        True,
    ),
    "partial-rotary": (
        "qwen3-tied",
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}},
        "partial_rotary_factor must be a number in (0, 1]",
        False,
    ),
    "layer-types-length": (
        "gemma2-tied",
        {"layer_types": ["full_attention"]},
        "layer_types must list 3 attention kinds",
        True,
    ),
    "layer-types-kind": (
        "qwen3-tied",
        {"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
        "layer_types must list 3",
        True,
    ),
    "sliding-without-window": (
        "qwen3-untied-window",
        {"use_sliding_window": False, "sliding_window": None},
        "sliding_attention layers but no sliding window",
        True,
    ),
    "window-zero": (
        "gemma2-untied",
        {"sliding_window": 0},
        "sliding_window must be null or an integer >= 1",
        True,
    ),
    "bidirectional": (
        "gemma3-untied",
        {"use_bidirectional_attention": True},
        "use_bidirectional_attention is true: geopipe trains causal LMs",
        False,
    ),
    "pad-outside-vocab": (
        "phi3-untied-window",
        {"pad_token_id": 32000},
        "pad_token_id 32000 is not a row of the embedding",
        True,
    ),
    "gemma-head-split": (
        "gemma2-tied",
        {"hidden_size": 36, "num_attention_heads": 8, "num_key_value_heads": 4},
        "hidden_size (36) must be divisible by num_attention_heads (8)",
        True,
    ),
    "softcap-negative": (
        "gemma2-tied",
        {"final_logit_softcapping": -1.0},
        "final_logit_softcapping must be null or a number > 0",
        False,
    ),
}


def _transformers_fails(config: dict[str, Any]) -> bool:
    try:
        cfg = CONFIG_MAPPING[config["model_type"]].from_dict(config)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            model(input_ids=tokens(seq=12))
    except Exception:  # any failure: the model cannot be built or run
        return True
    return False


@pytest.mark.parametrize("limit", sorted(LIMITS))
def test_family_limits_are_refused_when_the_yaml_is_validated(tmp_path: Path, limit: str):
    name, change, says, fails = LIMITS[limit]
    config = {**config_of(name).to_dict(), **change}
    assert says in _refusal(_config_dir(tmp_path / limit, config))
    if fails:
        assert _transformers_fails(config)
        assert not _transformers_fails(config_of(name).to_dict())  # the unchanged one runs


def test_phi3_old_rope_names_are_longrope(tmp_path: Path) -> None:
    """Phi-3's config renames ``su`` and ``yarn`` to longrope: accepted as such."""
    for old in ("su", "yarn"):
        rope = {**config_of("phi3-tied-longrope").to_dict()["rope_parameters"], "rope_type": old}
        config = {**config_of("phi3-tied-longrope").to_dict(), "rope_parameters": rope}
        path = _config_dir(tmp_path / old, config)
        assert ModelSpec(hf=str(path), max_seq_len=32).family == "phi3"
        assert CONFIG_MAPPING["phi3"].from_dict(config).rope_parameters["rope_type"] == "longrope"


def test_plan_exits_2_naming_the_field(tmp_path: Path, capsys) -> None:
    config = {**config_of("gemma3-tied").to_dict(), "use_bidirectional_attention": True}
    path = _config_dir(tmp_path / "m", config)
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text(yaml.safe_dump(_doc(path)))
    assert main(["plan", str(yaml_path)]) == 2
    err = capsys.readouterr().err
    assert f"{yaml_path}: model.hf: config.json: use_bidirectional_attention is true" in err
    assert "Traceback" not in err


# -- every other model_type is refused by name ---------------------------------------------------


@pytest.mark.parametrize(
    "family",
    [
        "gemma",
        "gemma3",
        "phi",
        "olmo",
        "olmoe",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "gpt_neox",
        "falcon",
        "cohere",
        "starcoder2",
    ],
)
def test_other_model_types_are_refused_by_name(tmp_path: Path, family: str) -> None:
    config = {"model_type": family, "architectures": [f"{family.title()}ForCausalLM"]}
    msg = _refusal(_config_dir(tmp_path / family, config))
    assert f"model_type {family!r} is not supported" in msg
    assert ", ".join(SUPPORTED_FAMILIES) in msg
    if family == "gemma3":
        assert "gemma3_text" in msg.split("(supported")[0]


# -- configs as the Hub holds them (transformers 4's format) -----------------------------------

_LEGACY_BASE = {**SMALL, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
LEGACY: dict[str, dict[str, Any]] = {
    "gemma2": {
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        "head_dim": 8,
        "rope_theta": 10000.0,
        "sliding_window": 8,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
        "query_pre_attn_scalar": 8,
        "cache_implementation": "hybrid",
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "head_dim": 8,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 8,
        "sliding_window_pattern": 2,
    },
    "phi3": {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 16,
        "sliding_window": 8,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.1, 1.2, 1.3],
            "long_factor": [2.0, 3.0, 4.0, 5.0],
        },
    },
    "qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "head_dim": 8,
        "rope_theta": 1e6,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
    },
    "olmo2": {
        "model_type": "olmo2",
        "architectures": ["Olmo2ForCausalLM"],
        "rope_theta": 500000.0,
        "rope_scaling": None,
    },
}


@pytest.mark.parametrize("family", sorted(LEGACY))
def test_hub_format_configs_validate_and_equal_transformers(tmp_path: Path, family: str):
    """No layer_types, rope_theta beside rope_scaling, Gemma 3's local base and pattern,
    Phi-3's ``type: longrope``: the YAML accepts them and the stages read them as
    `transformers` does (the sequence passes the window and the longrope original length)."""
    legacy = {**_LEGACY_BASE, **LEGACY[family]}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        CONFIG_MAPPING[family].from_dict(json.loads(json.dumps(legacy)))
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(legacy))
    assert ModelSpec(hf=str(tmp_path / "m")).family == family
    stages = [HFStage(json.loads(json.dumps(legacy)), a, b) for a, b in [(0, 2), (2, 5)]]
    for s in stages:
        load_stage_weights(s, tmp_path / "m")
    x = tokens()
    with torch.no_grad():
        got, want = stages[1](stages[0](x)), model(input_ids=x).logits
    assert (got - want).abs().max().item() <= 1e-5
