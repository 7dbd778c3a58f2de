"""``model: {hf: PATH}``: a `transformers` directory validates into a ModelSpec (shape from its
config.json, weights checked from their safetensors headers), and every way it can be
unusable is refused at ``model.hf`` (or the field at fault) with a message naming the
problem — through the CLI as one line and exit 2, never a traceback."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from geopipe.cli import main
from geopipe.config import ConfigError, ModelSpec, load_cluster, parse_cluster
from geopipe.config.hfdir import safetensors_header
from geopipe.model.hfarch import CONFIG_DEFAULTS, SUPPORTED_FAMILIES

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "clusters" / "local-2dc.yaml"
SOURCE = "c.yaml"
SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _doc(model: dict[str, Any]) -> dict[str, Any]:
    doc = yaml.safe_load(LOCAL.read_text())
    doc["model"] = model
    doc["plan"]["seq_len"] = 32
    return doc


def _problems(model: dict[str, Any], base_dir: Path | None = None) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        parse_cluster(_doc(model), SOURCE, base_dir=base_dir)
    return info.value.problems


def _find(problems: list[tuple[str, str]], path: str) -> str:
    for p, msg in problems:
        if p == path:
            return msg
    raise AssertionError(f"no problem at {path!r}; got {problems}")


def _config_dir(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _saved(path: Path, cls=LlamaConfig, **extra: Any) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**SMALL, **extra}))
    model.save_pretrained(path)
    return model, path


def _llama_config(**extra: Any) -> dict[str, Any]:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **SMALL, **extra}


# -- what a good directory gives ----------------------------------------------------------------


def test_a_saved_llama_fills_the_spec(tmp_path: Path) -> None:
    _, path = _saved(tmp_path / "m", tie_word_embeddings=True)
    spec = parse_cluster(_doc({"hf": str(path)}), SOURCE)
    m = spec.model
    assert (m.family, m.n_layer, m.n_embd, m.n_head, m.n_kv_head) == ("llama", 2, 32, 4, 2)
    assert (m.head_dim, m.intermediate_size, m.vocab_size) == (8, 48, 96)
    assert m.max_seq_len == 64  # max_position_embeddings by default
    assert m.tie_embeddings and m.hf_weights and m.is_hf
    assert (m.attention_bias, m.mlp_bias) == (False, False)
    assert m.hf == str(path) and Path(m.hf).is_absolute()
    raw = (path / "config.json").read_bytes()
    assert m.hf_config_digest == hashlib.sha256(raw).hexdigest()


def test_family_specific_fields(tmp_path: Path) -> None:
    _, q = _saved(tmp_path / "q", Qwen2Config)
    _, mi = _saved(tmp_path / "mi", MistralConfig)
    _, ll = _saved(tmp_path / "ll", attention_bias=True, mlp_bias=True, head_dim=16)
    qm = ModelSpec(hf=str(q))
    assert (qm.family, qm.attention_bias, qm.mlp_bias, qm.tie_embeddings) == (
        "qwen2",
        True,
        False,
        False,
    )
    mm = ModelSpec(hf=str(mi))
    assert (mm.family, mm.attention_bias, mm.mlp_bias) == ("mistral", False, False)
    lm = ModelSpec(hf=str(ll))
    assert (lm.attention_bias, lm.mlp_bias, lm.head_dim) == (True, True, 16)


def test_config_only_directory_has_no_weights(tmp_path: Path) -> None:
    path = _config_dir(tmp_path / "m", _llama_config())
    m = ModelSpec(hf=str(path), max_seq_len=32)
    assert not m.hf_weights and m.max_seq_len == 32
    assert m.n_kv_head == 2 and not m.tie_embeddings  # llama's default: untied


def test_absent_keys_take_the_family_defaults(tmp_path: Path) -> None:
    cfg = {
        "model_type": "mistral",
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "vocab_size": 100,
        "intermediate_size": 96,
    }
    m = ModelSpec(hf=str(_config_dir(tmp_path / "m", cfg)), max_seq_len=128)
    assert m.n_kv_head == 8  # mistral's own default, as transformers fills it
    assert m.rms_norm_eps == 1e-6 and m.head_dim == 8


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_defaults_table_matches_transformers(family: str) -> None:
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[family]()
    for key, value in CONFIG_DEFAULTS[family].items():
        if key == "num_key_value_heads" and value is None:
            assert cfg.num_key_value_heads == cfg.num_attention_heads
        else:
            assert getattr(cfg, key) == value, key


def test_relative_path_is_taken_from_the_yaml_directory(tmp_path: Path, monkeypatch) -> None:
    _config_dir(tmp_path / "cfg" / "models" / "tiny", _llama_config())
    yaml_path = tmp_path / "cfg" / "c.yaml"
    yaml_path.write_text(yaml.safe_dump(_doc({"hf": "models/tiny"})))
    monkeypatch.chdir(tmp_path)  # not the YAML's directory
    spec = load_cluster(yaml_path)
    assert spec.model.hf == str(tmp_path / "cfg" / "models" / "tiny")
    again = parse_cluster(_doc({"hf": "models/tiny"}), "x", base_dir=tmp_path / "cfg")
    assert again == spec


def test_gpt_yaml_unchanged_and_its_digest_too() -> None:
    spec = load_cluster(LOCAL)
    assert spec.model.family == "gpt" and not spec.model.is_hf
    assert spec.model.hf is None and spec.model.n_kv_head is None
    assert spec.digest == "011b9dab715affbe"  # the digest before the hf fields existed
    # keys added since count once set away from their defaults; recompute changes no number
    doc = yaml.safe_load(LOCAL.read_text())
    doc["training"]["recompute"] = "full"
    assert parse_cluster(doc, "t").digest == spec.digest
    doc["training"]["lr_schedule"] = "linear"
    assert parse_cluster(doc, "t").digest != spec.digest


def test_shipped_llama3_config() -> None:
    spec = load_cluster(ROOT / "clusters" / "llama3-8b-2dc.yaml")
    m = spec.model
    assert (m.family, m.n_layer, m.n_embd, m.n_head, m.n_kv_head) == ("llama", 32, 4096, 32, 8)
    assert (m.head_dim, m.intermediate_size, m.vocab_size) == (128, 14336, 128256)
    assert (m.max_seq_len, m.tie_embeddings, m.hf_weights) == (4096, False, False)
    assert spec.training.precision == "bf16"


# -- refusals -------------------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    msg = _find(_problems({"hf": str(tmp_path / "nope")}), "model.hf")
    assert "is not a directory" in msg and "nope" in msg


def test_missing_config_json(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    assert "has no config.json" in _find(_problems({"hf": str(tmp_path / "m")}), "model.hf")


def test_broken_config_json(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    assert "not valid JSON" in _find(_problems({"hf": str(tmp_path / "m")}), "model.hf")


def test_unsupported_family_names_the_supported_ones(tmp_path: Path) -> None:
    path = _config_dir(tmp_path / "m", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    msg = _find(_problems({"hf": str(path)}), "model.hf")
    assert "GPT2LMHeadModel" in msg  # not a *ForCausalLM class name
    path = _config_dir(
        tmp_path / "n", {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}
    )
    msg = _find(_problems({"hf": str(path)}), "model.hf")
    assert "model_type 'gpt_neox' is not supported" in msg
    assert "llama, mistral, qwen2" in msg


def test_encoder_and_encoder_decoder_are_refused(tmp_path: Path) -> None:
    bert = _config_dir(tmp_path / "b", {"model_type": "bert", "architectures": ["BertForMaskedLM"]})
    msg = _find(_problems({"hf": str(bert)}), "model.hf")
    assert "BertForMaskedLM" in msg and "not a decoder-only causal LM" in msg
    t5 = _config_dir(
        tmp_path / "t",
        {
            "model_type": "t5",
            "is_encoder_decoder": True,
            "architectures": ["T5ForConditionalGeneration"],
        },
    )
    assert "encoder-decoder" in _find(_problems({"hf": str(t5)}), "model.hf")


def test_pickle_weights_are_refused(tmp_path: Path) -> None:
    path = _config_dir(tmp_path / "m", _llama_config())
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    msg = _find(_problems({"hf": str(path)}), "model.hf")
    assert "pickle weights are not loaded; save with safe_serialization=True" in msg


def test_shape_fields_beside_hf_are_refused(tmp_path: Path) -> None:
    path = _config_dir(tmp_path / "m", _llama_config())
    problems = _problems({"hf": str(path), "n_layer": 2, "vocab_size": 96})
    assert "comes from config.json" in _find(problems, "model.n_layer")
    assert "comes from config.json" in _find(problems, "model.vocab_size")


def test_hf_only_fields_without_hf_are_refused() -> None:
    model = yaml.safe_load(LOCAL.read_text())["model"]
    problems = _problems({**model, "intermediate_size": 512, "family": "llama"})
    assert "only a model.hf" in _find(problems, "model.intermediate_size")
    assert "only a model.hf" in _find(problems, "model.family")
    parse_cluster(_doc({**model, "family": "gpt"}), SOURCE)  # saying gpt is fine


def test_max_seq_len_above_the_config_is_refused(tmp_path: Path) -> None:
    path = _config_dir(tmp_path / "m", _llama_config())
    msg = _find(_problems({"hf": str(path), "max_seq_len": 128}), "model.max_seq_len")
    assert "max_position_embeddings (64)" in msg


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


def test_missing_tensors_are_named(tmp_path: Path) -> None:
    model, path = _saved(tmp_path / "m")  # untied: lm_head is needed
    state = model.state_dict()
    del state["model.layers.1.mlp.up_proj.weight"], state["lm_head.weight"]
    _save_tensors(path, state)
    msg = _find(_problems({"hf": str(path)}), "model.hf")
    assert "lack 2 tensors" in msg
    assert "model.layers.1.mlp.up_proj.weight" in msg and "lm_head.weight" in msg


def test_missing_qwen2_bias_is_named(tmp_path: Path) -> None:
    model, path = _saved(tmp_path / "q", Qwen2Config)
    state = model.state_dict()
    del state["model.layers.0.self_attn.k_proj.bias"]
    _save_tensors(path, state)
    msg = _find(_problems({"hf": str(path)}), "model.hf")
    assert "model.layers.0.self_attn.k_proj.bias" in msg


def test_tied_model_needs_no_lm_head(tmp_path: Path) -> None:
    model, path = _saved(tmp_path / "m", tie_word_embeddings=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    _save_tensors(path, state)
    assert ModelSpec(hf=str(path)).hf_weights


def test_wrong_shapes_are_named(tmp_path: Path) -> None:
    model, path = _saved(tmp_path / "m")
    state = model.state_dict()
    state["model.embed_tokens.weight"] = torch.zeros(95, 32)
    _save_tensors(path, state)
    msg = _find(_problems({"hf": str(path)}), "model.hf")
    assert "model.embed_tokens.weight has shape [95, 32]" in msg and "[96, 32]" in msg


def test_sharded_weights_via_the_index(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL))
    path = tmp_path / "m"
    model.save_pretrained(path, max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert ModelSpec(hf=str(path)).hf_weights
    (path / shards[-1]).unlink()
    assert f"names {shards[-1]}, which is missing" in _find(
        _problems({"hf": str(path)}), "model.hf"
    )


def test_safetensors_header_is_parsed_without_torch(tmp_path: Path) -> None:
    model, path = _saved(tmp_path / "m")
    header = safetensors_header(path / "model.safetensors")
    assert header == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    blob = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    assert "truncated" in _find(_problems({"hf": str(path)}), "model.hf")


# -- through the CLI: one line, exit 2 ----------------------------------------------------------


def test_cli_reports_a_bad_hf_directory_in_one_line(tmp_path: Path, capsys) -> None:
    path = _config_dir(tmp_path / "m", {"model_type": "gpt_neox"})
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text(yaml.safe_dump(_doc({"hf": "m"})))
    code = main(["plan", str(yaml_path)])
    out, err = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in out + err
    assert f"{yaml_path}: model.hf: config.json: model_type 'gpt_neox' is not supported" in err
    assert path.is_dir()


def test_spec_survives_a_deep_copy(tmp_path: Path) -> None:
    path = _config_dir(tmp_path / "m", _llama_config())
    spec = parse_cluster(_doc({"hf": str(path)}), SOURCE)
    assert copy.deepcopy(spec) == spec and len(spec.digest) == 16
