"""Stages of Hugging Face families against `transformers`' own model (no Ray, no DeepSpeed).

The pipeline's stages are copies of the family's modules, so chained stages must give the
model's logits exactly; parameter names and seeded initial values must not depend on the
partition; a stage loading pretrained weights reads its own layers' tensors only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _hffamilies import SMALL  # the unit tier's small model (every family test's)
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from geopipe.model.family import ModelDesc, build_stage, stage_param_names
from geopipe.model.hf import EMBED, HEAD, HFStage, hf_layer_of, load_stage_weights

FAMILIES = {
    "llama-gqa-tied": (LlamaConfig, {"tie_word_embeddings": True}),
    "llama-gqa-untied": (
        LlamaConfig,
        {"tie_word_embeddings": False, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": False}),
    "mistral": (MistralConfig, {"tie_word_embeddings": False, "sliding_window": 32}),
}


def _saved(tmp_path: Path, name: str) -> tuple[torch.nn.Module, Path]:
    cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**SMALL, **extra)).eval()
    out = tmp_path / name
    model.save_pretrained(out)
    return model, out


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_chained_stages_equal_the_transformers_model(tmp_path: Path, name: str) -> None:
    model, path = _saved(tmp_path, name)
    cfg = _config(path)
    cuts = [(0, 2), (2, 4), (4, 5)]  # embed + layer 0 | layers 1-2 | norm + head
    stages = [HFStage(cfg, a, b) for a, b in cuts]
    for s in stages:
        load_stage_weights(s, path)
    x = torch.randint(0, SMALL["vocab_size"], (2, 24))
    h = x
    for s in stages:
        h = s(h)
    with torch.no_grad():
        ref = model(input_ids=x).logits
    torch.testing.assert_close(h, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_chained_stages_backpropagate_the_transformers_gradients(tmp_path: Path, name: str) -> None:
    """Each family's training step through the stages: the loss and every parameter's
    gradient equal `transformers`' (the tied head's copy holds the head's share of the
    embedding's gradient: the two summed are the model's). The integration tier trains two
    of these families across two sites against `transformers`; the runtime around a stage
    is the same for every family, so what differs per family is checked here."""
    model, path = _saved(tmp_path, name)
    model.train()
    cfg = _config(path)
    stages = [HFStage(cfg, a, b) for a, b in [(0, 2), (2, 4), (4, 5)]]
    for s in stages:
        load_stage_weights(s, path)
    x = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    h = x
    for s in stages:
        h = s(h)
    loss = torch.nn.functional.cross_entropy(h[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    ref = model(input_ids=x, labels=x).loss
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
    loss.backward()
    ref.backward()
    got: dict[str, torch.Tensor] = {}
    for s in stages:
        for n, p in s.named_parameters():
            got[n] = got[n] + p.grad if n in got else p.grad
    if HEAD in got and HEAD not in dict(model.named_parameters()):  # tied: one tensor there
        got[EMBED] = got[EMBED] + got.pop(HEAD)
    want = {n: p.grad for n, p in model.named_parameters()}
    assert got.keys() == want.keys()
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=n)


def test_seeded_init_is_independent_of_the_partition(tmp_path: Path) -> None:
    _, path = _saved(tmp_path, "llama-gqa-tied")
    cfg = _config(path)
    whole = dict(HFStage(cfg, 0, 5, seed=11).named_parameters())
    parts = {}
    for a, b in [(0, 1), (1, 3), (3, 5)]:
        parts.update(HFStage(cfg, a, b, seed=11).named_parameters())
    assert set(parts) == set(whole) | {HEAD}  # the head keeps its own copy of the tie
    for n, p in whole.items():
        assert torch.equal(p, parts[n]), n
    assert torch.equal(parts[HEAD], parts[EMBED])
    other = dict(HFStage(cfg, 0, 5, seed=12).named_parameters())
    assert not torch.equal(other[EMBED], whole[EMBED])


def test_names_match_transformers_and_map_to_layers(tmp_path: Path) -> None:
    model, path = _saved(tmp_path, "qwen2")
    desc = ModelDesc.from_hf(_config(path), weights_dir=str(path))
    names = set().union(*(stage_param_names(desc, a, b) for a, b in [(0, 2), (2, 5)]))
    assert names == {n for n, _ in model.named_parameters()}
    assert hf_layer_of("model.embed_tokens.weight", 3) == 0
    assert hf_layer_of("model.layers.2.mlp.up_proj.weight", 3) == 3
    assert hf_layer_of("lm_head.weight", 3) == 4
    stage = build_stage(desc, 2, 5)
    assert all(2 <= stage.layer_of(n) < 5 for n, _ in stage.named_parameters())
    with pytest.raises(ValueError, match="no layer"):
        hf_layer_of("rotary.inv_freq", 3)


def test_a_stage_reads_only_its_own_tensors(tmp_path: Path, monkeypatch) -> None:
    _, path = _saved(tmp_path, "llama-gqa-untied")
    import safetensors

    read: list[str] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self._f = real_open(*a, **k)

        def __enter__(self):
            self._h = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._h.keys()

        def get_tensor(self, name):
            read.append(name)
            return self._h.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    stage = HFStage(_config(path), 2, 3)
    load_stage_weights(stage, path)
    assert read and all(n.startswith("model.layers.1.") for n in read)


def test_tied_head_alone_loads_the_embedding_and_aliases_it(tmp_path: Path) -> None:
    model, path = _saved(tmp_path, "llama-gqa-tied")
    head = HFStage(_config(path), 4, 5)
    load_stage_weights(head, path)
    assert torch.equal(head.lm_head.weight, model.model.embed_tokens.weight)
    assert head.tied_parameter() is head.lm_head.weight
    assert head.state_aliases() == {HEAD: EMBED}
    whole = HFStage(_config(path), 0, 5)
    assert whole.tied_parameter() is None  # one stage holds both ends: one shared parameter
    assert whole.lm_head.weight is whole.model.embed_tokens.weight


def test_missing_tensor_and_unsupported_family_are_named(tmp_path: Path) -> None:
    _, path = _saved(tmp_path, "llama-gqa-untied")
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_stage_weights(HFStage(_config(path), 2, 3), path)
    with pytest.raises(ValueError, match="'bert' is not a supported"):
        HFStage({**_config(path), "model_type": "bert"}, 0, 1)


def test_sequences_longer_than_a_sliding_window_equal_transformers(tmp_path: Path) -> None:
    """Mistral's window is 32: a 40-token sequence gets the model's own sliding-window mask
    in every stage, so the logits are the model's (before, such sequences were refused)."""
    model, path = _saved(tmp_path, "mistral")
    stages = [HFStage(_config(path), a, b) for a, b in [(0, 2), (2, 5)]]
    for s in stages:
        load_stage_weights(s, path)
    x = torch.randint(0, SMALL["vocab_size"], (2, 40))
    with torch.no_grad():
        got, ref = stages[1](stages[0](x)), model(input_ids=x).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
