"""Qwen3, Gemma 2, Gemma 3 (text), Phi-3 and OLMo 2 as geopipe stages against `transformers`'
own model on the same weights: logits and loss, and three training steps (SGD and Adam, in
one process) with the stages chained as a pipeline would chain them, tied and untied; what
the model's forward does around its modules (Gemma's embedding scale, soft-capping, sliding
windows, per-kind RoPE) shown to matter; seeded init as `transformers` inits; export loads
back with the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _hffamilies import CASES, saved, tokens
from test_export import hf_entry, write_checkpoint
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

import geopipe.model.hf as hfmod
from geopipe.cli import main
from geopipe.model.family import ModelDesc, build_stage, stage_param_names
from geopipe.model.gpt import lm_loss
from geopipe.model.hf import EMBED, HEAD, HFStage, load_stage_weights

TIED = sorted(n for n in CASES if "-tied" in n)
CUTS = [(0, 2), (2, 4), (4, 5)]  # embed + layer 0 | layers 1-2 | norm + head: a tie is split


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _stages(path: Path, cuts=CUTS) -> list[HFStage]:
    stages = [HFStage(_config(path), a, b) for a, b in cuts]
    for s in stages:
        load_stage_weights(s, path)
    return stages


def _chain(stages: list[HFStage], x: torch.Tensor) -> torch.Tensor:
    h = x
    for s in stages:
        h = s(h)
    return h


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_loss_equal_transformers(tmp_path: Path, name: str) -> None:
    model, path = saved(tmp_path, name)
    x = tokens()
    with torch.no_grad():
        ref = model(input_ids=x, labels=x)
        for cuts in (CUTS, [(0, 5)]):
            stages = _stages(path, cuts)
            got = _chain(stages, x)
            assert (got - ref.logits).abs().max().item() <= 1e-5, cuts
            loss = lm_loss(got[:, :-1], x[:, 1:])  # geopipe's loss on next tokens
            assert abs(loss.item() - ref.loss.item()) <= 1e-5, cuts
    if model.config.tie_word_embeddings:
        assert stages[0].lm_head.weight is stages[0].model.embed_tokens.weight


def _train(name: str, tmp_path: Path, opt_name: str) -> tuple[list[float], list[float], float]:
    """Three steps of the same optimizer on the stages (a tie split over two of them: the
    copies' gradients summed before the step, as the runtime does) and on the model."""
    model, path = saved(tmp_path, name)
    model.train()
    stages = _stages(path)
    for s in stages:
        s.train()
    params = [p for s in stages for p in s.parameters()]
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    }[opt_name]
    ours, theirs = make(params), make(model.parameters())
    copies = [t for t in (s.tied_parameter() for s in stages) if t is not None]
    got, want = [], []
    for step in range(3):
        x = tokens(seed=step + 1)
        ours.zero_grad()
        loss = lm_loss(_chain(stages, x)[:, :-1], x[:, 1:])
        loss.backward()
        if copies:
            total = sum(c.grad for c in copies)
            for c in copies:
                c.grad = total.clone()
        ours.step()
        theirs.zero_grad()
        ref = model(input_ids=x, labels=x).loss
        ref.backward()
        theirs.step()
        got.append(loss.item())
        want.append(ref.item())
    x = tokens(seed=9)
    with torch.no_grad():
        drift = (_chain(stages, x) - model(input_ids=x).logits).abs().max().item()
    return got, want, drift


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_three_training_steps_equal_transformers(tmp_path: Path, name: str, opt_name: str):
    got, want, drift = _train(name, tmp_path, opt_name)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5, (got, want)
    assert drift <= 1e-5
    assert got[0] != got[-1]  # it trained


def test_what_the_model_forward_adds_is_not_skipped(tmp_path: Path, monkeypatch) -> None:
    """Each thing a Gemma 3 stage redoes outside the modules moves the logits well past the
    tolerance when left out: the checks above would catch a stage that skipped one."""
    model, path = saved(tmp_path, "gemma3-tied")
    x = tokens()
    with torch.no_grad():
        ref = model(input_ids=x).logits

        def gap(stages: list[HFStage]) -> float:
            with torch.no_grad():
                return (_chain(stages, x) - ref).abs().max().item()

        assert gap(_stages(path)) <= 1e-5
        unscaled = _stages(path)
        unscaled[0].model.embed_tokens.embed_scale.fill_(1.0)
        uncapped = _stages(path)
        uncapped[-1]._softcap = None
        assert gap(unscaled) > 1e-2 and gap(uncapped) > 1e-2
        with monkeypatch.context() as m:  # every layer global: no sliding-window mask
            m.setattr(hfmod, "_attention_kind", lambda cfg, fam, i: "full_attention")
            assert gap(_stages(path)) > 1e-3


@pytest.mark.parametrize("name", sorted(CASES))
def test_seeded_init_is_transformers_init(tmp_path: Path, name: str) -> None:
    """Without weights: norms start neutral as the family's own init leaves them (Gemma's
    ``1 + weight`` at 0), Gemma's embedding scale is the model's, and a stage's names are
    `transformers`' names."""
    model, path = saved(tmp_path, name)
    fresh = AutoModelForCausalLM.from_config(model.config)
    stage = HFStage(_config(path), 0, 5, seed=4)
    mine = dict(stage.named_parameters())
    for n, p in fresh.named_parameters():
        if p.dim() == 1 and "norm" in n:
            assert torch.equal(mine[n], p.detach()), n
    for n, b in fresh.named_buffers():
        if n.endswith("embed_scale"):
            assert torch.equal(dict(stage.named_buffers())[n], b), n
    desc = ModelDesc.from_hf(_config(path))
    names = set().union(*(stage_param_names(desc, a, b) for a, b in [(0, 2), (2, 5)]))
    assert names - {HEAD} == {n for n, _ in model.named_parameters()} - {HEAD}
    assert desc.tie == model.config.tie_word_embeddings


@pytest.mark.parametrize("name", TIED)
def test_a_tied_config_without_the_key_is_tied(tmp_path: Path, name: str) -> None:
    """Gemma ties by default: a config.json without tie_word_embeddings is tied for the
    stages' description as for `transformers`."""
    _, path = saved(tmp_path, name)
    cfg = {k: v for k, v in _config(path).items() if k != "tie_word_embeddings"}
    default = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg).tie_word_embeddings
    assert ModelDesc.from_hf(cfg).tie == default


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_loads_in_transformers_with_equal_logits(tmp_path: Path, name: str) -> None:
    _, path = saved(tmp_path, name)
    cfg = _config(path)
    desc = ModelDesc.from_hf(cfg)
    stages = write_checkpoint(
        tmp_path / "run" / "checkpoints", desc, [(0, 2), (2, 5)], hf_entry(cfg, desc)
    )
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    x = tokens()
    with torch.no_grad():
        got = hf(input_ids=x).logits
    assert (got - _chain(stages, x)).abs().max().item() <= 1e-5
    if desc.tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    built = build_stage(desc, 0, 5, load_weights=False)
    assert (EMBED in dict(built.named_parameters())) and type(hf).__name__.endswith("ForCausalLM")
