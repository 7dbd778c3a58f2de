"""geopipe export: a checkpoint (written by the real checkpoint writer) becomes a directory
that `transformers` loads with no missing or unexpected keys and whose logits equal
geopipe's own model's — Llama tied (split over two stages and on one), Qwen2, Mistral, and
the built-in GPT as GPT-2; sharding with an index; the tokenizer copied; one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _hffamilies import SMALL  # the unit tier's small model (every family test's)
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from geopipe.checkpoint.writer import CheckpointWriter
from geopipe.cli import main
from geopipe.model.family import ModelDesc, build_stage
from geopipe.model.gpt import GPTConfig

CASES = {
    "llama-tied-split": (LlamaConfig, {"tie_word_embeddings": True}, [(0, 2), (2, 5)]),
    "llama-tied-one-stage": (LlamaConfig, {"tie_word_embeddings": True}, [(0, 5)]),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": False}, [(0, 3), (3, 5)]),
    "mistral": (
        MistralConfig,
        {"tie_word_embeddings": False, "sliding_window": 64},
        [(0, 1), (1, 4), (4, 5)],
    ),
}


def hf_entry(cfg: dict, desc: ModelDesc) -> dict:
    """A checkpoint manifest's ``model`` for a transformers model (as runtime.models writes)."""
    return {
        "n_layer": cfg["num_hidden_layers"],
        "n_embd": cfg["hidden_size"],
        "n_head": cfg["num_attention_heads"],
        "vocab_size": cfg["vocab_size"],
        "max_seq_len": cfg["max_position_embeddings"],
        "family": cfg["model_type"],
        "tie_embeddings": desc.tie,
        "hf_config": cfg,
    }


def write_checkpoint(
    root: Path, desc: ModelDesc, split: list[tuple[int, int]], model: dict, data: str = "stdlib"
) -> list:
    """Stages built with seed 3 and perturbed (so no tensor keeps its init), saved as a
    checkpoint of step 7 the way the runtime saves it (``params/<name>`` per stage)."""
    stages = []
    for a, b in split:
        stage = build_stage(desc, a, b, seed=3, active=(a, b), load_weights=False)
        with torch.no_grad():
            for p in stage.parameters():
                p.add_(0.01 * torch.randn_like(p))
        stages.append(stage)
    head_copy = stages[-1].tied_parameter() if len(stages) > 1 else None
    if head_copy is not None:  # training keeps a tied weight's two copies equal
        head_copy.data.copy_(stages[0].tied_parameter().data)
    with CheckpointWriter(root, 7) as w:
        for k, stage in enumerate(stages):
            w.write_shard(k, {f"params/{n}": p.detach() for n, p in stage.named_parameters()})
        manifest = {"config_hash": "test", "plan": {}, "model": model, "data": {"source": data}}
        w.commit(manifest, num_stages=len(stages))
    return stages


def geopipe_logits(stages: list, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        h = x
        for s in stages:
            h = s(h)
    return h


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_export_loads_in_transformers_with_equal_logits(tmp_path: Path, case: str) -> None:
    cls, extra, split = CASES[case]
    cfg = cls(**SMALL, **extra).to_dict()
    desc = ModelDesc.from_hf(cfg)
    model = hf_entry(cfg, desc)
    stages = write_checkpoint(tmp_path / "run" / "checkpoints", desc, split, model)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "model.safetensors"} <= files
    if cfg.get("eos_token_id") is not None:
        gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
        assert gen["eos_token_id"] == cfg["eos_token_id"]
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    x = torch.randint(0, SMALL["vocab_size"], (2, 16))
    with torch.no_grad():
        got = hf(input_ids=x).logits
    want = geopipe_logits(stages, x)
    assert (got - want).abs().max().item() <= 1e-5
    if desc.tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_gpt_exports_as_gpt2_with_equal_logits(tmp_path: Path) -> None:
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=256, block_size=64)
    desc = ModelDesc.from_gpt(cfg)
    model = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256, "max_seq_len": 64}
    stages = write_checkpoint(tmp_path / "ck", desc, [(0, 2), (2, 4)], model)
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 0
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(hf).__name__ == "GPT2LMHeadModel" and not any(info.values()), info
    x = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        got = hf(input_ids=x).logits
    assert (got - geopipe_logits(stages, x)).abs().max().item() <= 1e-5


def test_sharded_bf16_export_with_the_runs_tokenizer(tmp_path: Path) -> None:
    from _tokdata import stdlib_sources, train_small_tokenizer
    from transformers import AutoTokenizer

    from geopipe.model.prepare import prepare_data

    tok = train_small_tokenizer(tmp_path / "tok", vocab=300)
    prepare_data(stdlib_sources(2), tok, tmp_path / "ds", progress=False)
    cfg = LlamaConfig(**{**SMALL, "vocab_size": 300}).to_dict()
    desc = ModelDesc.from_hf(cfg)
    model = hf_entry(cfg, desc)
    stages = write_checkpoint(tmp_path / "ck", desc, [(0, 5)], model, data=str(tmp_path / "ds"))
    out = tmp_path / "out"
    args = [
        "export",
        str(tmp_path / "ck"),
        "--out",
        str(out),
        "--dtype",
        "bf16",
        "--max-shard-bytes",
        "20000",
    ]
    assert main(args) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((out / f).is_file() for f in shards)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16
    want = dict(stages[0].named_parameters())
    for name, p in hf.named_parameters():
        assert torch.equal(p, want[name].detach().to(torch.bfloat16)), name
    text = "def f(x):\n    return x\n"
    assert (
        AutoTokenizer.from_pretrained(out)(text)["input_ids"]
        == AutoTokenizer.from_pretrained(tok)(text)["input_ids"]
    )


def test_errors_are_one_line_and_leave_nothing(tmp_path: Path, capsys) -> None:
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no complete checkpoint under" in capsys.readouterr().err
    cfg = LlamaConfig(**SMALL).to_dict()
    desc = ModelDesc.from_hf(cfg)
    model = hf_entry(cfg, desc)
    write_checkpoint(tmp_path / "checkpoints", desc, [(0, 5)], model)
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o"), "--step", "3"]) == 2
    assert "no complete checkpoint of step 3 under" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("mine")
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "busy")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "busy" / "x").read_text() == "mine"
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "busy"), "--force"]) == 0
    assert not list(tmp_path.glob(".busy.*")) and not (tmp_path / "o").exists()
