"""The planner's sizes of `transformers` families against the models themselves: parameter
counts (whole model, per layer, per stage module) exactly equal `transformers`' and the
stages'; FLOPs and activation memory from the real architecture by hand; the tied-embedding
gradient exchange priced in the plan; Llama-3-8B's plan reports its real size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from geopipe.cli import main
from geopipe.cli.render import format_model
from geopipe.config import ModelSpec, load_cluster, parse_cluster
from geopipe.model.family import ModelDesc, build_stage
from geopipe.model.hfarch import tensor_shapes
from geopipe.model.sizes import (
    layer_forward_flops,
    layer_param_counts,
    num_layers,
    param_totals,
    stage_param_count,
)
from geopipe.optimizer.costs import activation_bytes
from geopipe.optimizer.evaluate import Candidate, Evaluator
from geopipe.optimizer.pipecosts import tie_exchange

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "clusters" / "local-2dc.yaml"
LLAMA3 = ROOT / "clusters" / "llama3-8b-2dc.yaml"
SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama-gqa-tied": (LlamaConfig, {"tie_word_embeddings": True}),
    "llama-untied": (LlamaConfig, {}),
    "llama-mha": (LlamaConfig, {"num_key_value_heads": 4}),
    "llama-biases-head-dim": (
        LlamaConfig,
        {"attention_bias": True, "mlp_bias": True, "head_dim": 16},
    ),
    "qwen2": (Qwen2Config, {}),
    "qwen2-tied": (Qwen2Config, {"tie_word_embeddings": True}),
    "mistral": (MistralConfig, {}),
}


def _spec(tmp_path: Path, name: str) -> tuple[ModelSpec, Any]:
    cls, extra = CASES[name]
    cfg = cls(**{**SMALL, **extra})
    cfg.save_pretrained(tmp_path / name)  # config.json only
    return ModelSpec(hf=str(tmp_path / name), max_seq_len=32), cfg


def _meta(cfg: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name", sorted(CASES))
def test_parameter_count_equals_transformers(tmp_path: Path, name: str) -> None:
    m, cfg = _spec(tmp_path, name)
    model = _meta(cfg)
    assert param_totals(m)[0] == sum(p.numel() for p in model.parameters())
    assert tensor_shapes(m) == {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_layer_counts_equal_the_stage_modules(tmp_path: Path, name: str) -> None:
    m, _ = _spec(tmp_path, name)
    desc = ModelDesc.from_hf(json.loads((Path(m.hf) / "config.json").read_text()))
    counts = layer_param_counts(m)
    last = num_layers(m.n_layer)
    for a, b in [(0, 2), (2, 3), (3, last), (0, 1), (1, last), (0, last)]:
        stage = build_stage(desc, a, b, seed=0, load_weights=False)
        held = sum(p.numel() for p in stage.parameters())
        assert stage_param_count(m, (a, b)) == held, (a, b)
        if (a, b) != (0, last) or not m.tie_embeddings:
            assert sum(counts[a:b]) == held, (a, b)
    # split stages of a tied model hold two copies; the whole model one
    split = sum(counts)
    assert split - param_totals(m)[0] == (m.vocab_size * m.n_embd if m.tie_embeddings else 0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_block_flops_are_twice_the_matmul_weights_plus_attention(tmp_path: Path, name: str):
    m, cfg = _spec(tmp_path, name)
    layer = _meta(cfg).model.layers[0]
    matmul = sum(mod.weight.numel() for mod in layer.modules() if isinstance(mod, torch.nn.Linear))
    heads, hd, s = m.n_head, m.head_dim, 32
    flops = layer_forward_flops(m, s)
    assert flops[1] == 2 * matmul + 4 * s * heads * hd
    assert flops[0] == m.n_embd and flops[-1] == 2 * m.n_embd * m.vocab_size


def test_flops_and_activations_by_hand(tmp_path: Path) -> None:
    m, _ = _spec(tmp_path, "llama-biases-head-dim")  # h 32, 4 heads of 16, 2 kv, I 48
    # q 32·64 + k, v 32·32 each + o 64·32 + MLP 3·32·48 = 10752 weights; attention 4·32·64
    assert layer_forward_flops(m, 32)[1] == 2 * 10752 + 4 * 32 * 64
    # 4h + (2·4 + 2·2)·16 + 4·48 = 512 elements per token, b 2, s 32, fp32
    assert activation_bytes(m, 1, 2, 32, "fp32") == 2 * 32 * 512 * 4
    assert activation_bytes(m, 0, 2, 32, "bf16") == 2 * 32 * 32 * 2  # the embedding output


# -- the tied embedding's exchange ----------------------------------------------------------------


def _tied_cluster(tmp_path: Path, **plan: Any):
    cls, extra = CASES["llama-gqa-tied"]
    cls(**{**SMALL, **extra}).save_pretrained(tmp_path / "tied")
    doc = yaml.safe_load(LOCAL.read_text())
    doc["model"] = {"hf": str(tmp_path / "tied"), "max_seq_len": 32}
    doc["plan"].update(seq_len=32, **plan)
    spec = parse_cluster(doc, "c.yaml")
    untied = spec.model_copy(
        update={"model": spec.model.model_copy(update={"tie_embeddings": False})}
    )
    return spec, untied


def test_tie_exchange_over_the_wan_by_hand(tmp_path: Path) -> None:
    spec, untied = _tied_cluster(tmp_path)  # 2 pipelines, one stage in east, one in west
    c = Candidate(pipelines=2, micro_batch_size=1, seq_len=32, delta_n=(0,), codecs=("none",))
    tied_ev, plain_ev = Evaluator(spec), Evaluator(untied)
    tied, plain = tied_ev.evaluate(c), plain_ev.evaluate(c)
    assert tied.plan.stage_sites == ("east", "west") and tied.feasible
    # V·h = 96·32 fp32 elements = 12288 B each way, per pipeline (2) over 0.2 Gbit/s, 25 ms
    nbytes = 96 * 32 * 4
    one_way = 0.025 + nbytes * 8 * 2 / 0.2e9
    assert tie_exchange(spec, tied.plan) == pytest.approx((one_way, 2 * nbytes * 2))
    assert tied.wan_bytes - plain.wan_bytes == 2 * nbytes * 2
    tc, pc = tied_ev.costs(tied.plan), plain_ev.costs(plain.plan)
    assert tc.step_s[0] - pc.step_s[0] == pytest.approx(one_way)
    assert tc.step_s[-1] - pc.step_s[-1] == pytest.approx(one_way)
    assert tied.iteration_time_s > plain.iteration_time_s


def test_tie_exchange_inside_one_site(tmp_path: Path) -> None:
    spec, _ = _tied_cluster(tmp_path, pipelines=1)
    one_site = spec.model_copy(update={"sites": spec.sites[:1], "links": []})
    ev = Evaluator(one_site)
    c = Candidate(pipelines=1, micro_batch_size=1, seq_len=32, delta_n=(), codecs=())
    plan = ev.evaluate(c).plan
    assert plan.stage_sites == ("east", "east")
    nbytes = 96 * 32 * 4  # over east's network: 20 Gbit/s, 0.05 ms; no WAN bytes
    assert tie_exchange(one_site, plan) == pytest.approx((0.05e-3 + nbytes * 8 / 20e9, 0.0))


def test_tie_exchange_between_unlinked_sites_goes_hop_by_hop(tmp_path: Path) -> None:
    spec, _ = _tied_cluster(tmp_path)
    north = spec.sites[1].model_copy(update={"name": "north"})
    hop = spec.links[0].model_copy(update={"src": "west", "dst": "north", "latency_ms": 5.0})
    three = spec.model_copy(update={"sites": [*spec.sites, north], "links": [*spec.links, hop]})
    ev = Evaluator(three)
    c = Candidate(
        pipelines=2, micro_batch_size=1, seq_len=32, delta_n=(0, 0), codecs=("none", "none")
    )
    plan = ev.evaluate(c).plan
    assert {plan.stage_sites[0], plan.stage_sites[-1]} == {"east", "north"}
    nbytes = 96 * 32 * 4
    per_hop = nbytes * 8 * 2 / 0.2e9
    assert tie_exchange(three, plan) == pytest.approx(
        (0.025 + 0.005 + 2 * per_hop, 2 * 2 * nbytes * 2)
    )


def test_no_exchange_without_a_tie_or_for_the_gpt(tmp_path: Path) -> None:
    _, untied = _tied_cluster(tmp_path)
    c = Candidate(pipelines=2, micro_batch_size=1, seq_len=128, delta_n=(0,), codecs=("none",))
    gpt = Evaluator(load_cluster(LOCAL))
    assert tie_exchange(gpt.spec, gpt.evaluate(c).plan) == (0.0, 0.0)
    ev = Evaluator(untied)
    c32 = Candidate(pipelines=2, micro_batch_size=1, seq_len=32, delta_n=(0,), codecs=("none",))
    assert tie_exchange(untied, ev.evaluate(c32).plan) == (0.0, 0.0)


# -- Llama-3-8B ---------------------------------------------------------------------------------


def test_llama3_8b_plan_reports_the_transformers_parameter_count(capsys) -> None:
    spec = load_cluster(LLAMA3)
    cfg = LlamaConfig.from_dict(json.loads((Path(spec.model.hf) / "config.json").read_text()))
    real = sum(p.numel() for p in _meta(cfg).parameters())
    assert real == 8_030_261_248
    ours = param_totals(spec.model)[0]
    assert abs(ours - real) <= 0.001 * real
    assert ours == real
    line = format_model(spec)
    assert line.startswith("model: llama, 8.03 B parameters (32 layers, hidden 4096")
    assert main(["plan", str(LLAMA3)]) == 0
    assert "model: llama, 8.03 B parameters (32 layers, hidden 4096" in capsys.readouterr().out
    assert main(["plan", str(LLAMA3), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["parameters"] == real and doc["best"]["feasible"]
