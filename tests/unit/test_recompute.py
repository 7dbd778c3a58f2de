"""Activation recompute on a stage module alone (torch only): the same loss and bitwise the
same gradients with and without it, for the built-in GPT and a tiny `transformers` Llama,
through a full backward and through the split backward's I then W; and the setting's rule."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from geopipe.model.family import ModelDesc, build_stage
from geopipe.model.gpt import GPTConfig, lm_loss
from geopipe.model.recompute import checkpointed, checkpointed_blocks, interval
from geopipe.runtime.actor.backward import WeightGradStore

GPT = ModelDesc.from_gpt(GPTConfig(n_layer=4, n_embd=32, n_head=2, vocab_size=64, block_size=16))
LLAMA = ModelDesc.from_hf(
    LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    ).to_dict()
)
MODELS = {"gpt": GPT, "llama": LLAMA}


def test_the_setting_names_its_blocks() -> None:
    assert [interval(s) for s in ("none", "full", "every-3")] == [0, 1, 3]
    for bad in ("every-0", "every-", "every-2x", "half", "Full", "every-99999999"):
        with pytest.raises(ValueError, match="'none', 'full' or 'every-N'"):
            interval(bad)
    # layers: 0 embed, 1..6 blocks, 7 head; every-2 takes the 2nd, 4th and 6th blocks
    assert [i for i in range(8) if checkpointed("every-2", i, 6)] == [2, 4, 6]
    assert [i for i in range(8) if checkpointed("full", i, 6)] == [1, 2, 3, 4, 5, 6]
    assert checkpointed_blocks("every-2", (3, 8), 6) == 2
    assert checkpointed_blocks("none", (0, 8), 6) == 0


def _full_backward(desc: ModelDesc, recompute: str, ids, y):
    stage = build_stage(desc, 0, desc.num_layers, seed=5, recompute=recompute)
    blocks = stage.blocks if desc.is_gpt else stage.model.layers
    runs = dict.fromkeys(blocks, 0)
    for key, block in blocks.items():  # (checkpoint's rerun skips the block's own hooks)
        first = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))
        first.register_forward_hook(lambda *_, key=key: runs.__setitem__(key, runs[key] + 1))
    loss = lm_loss(stage(ids), y)
    loss.backward()
    # a checkpointed block ran its forward a second time, in the backward; the others once
    want = {str(i - 1): 1 + checkpointed(recompute, i, desc.n_layer) for i in range(1, 5)}
    assert runs == want
    return loss.detach(), {n: p.grad for n, p in stage.named_parameters()}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("recompute", ["full", "every-2"])
def test_whole_model_loss_and_grads_are_bitwise_unchanged(name: str, recompute: str) -> None:
    desc = MODELS[name]
    ids = torch.randint(0, desc.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    y = torch.roll(ids, -1, 1)
    loss0, grads0 = _full_backward(desc, "none", ids, y)
    loss1, grads1 = _full_backward(desc, recompute, ids, y)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for n in grads0:
        assert torch.equal(grads0[n], grads1[n]), n


def _split(desc: ModelDesc, recompute: str, x0, y):
    """The last stage (blocks 2..4 and the head) through I then W, as the engine runs it."""
    stage = build_stage(desc, 2, desc.num_layers, seed=5, recompute=recompute)
    store = WeightGradStore(stage)
    x = x0.clone().requires_grad_(True)
    with store.forward(0):
        loss = lm_loss(stage(x), y)
    gx = store.input_backward(0, loss, None, x)
    grads = store.weight_gradients(0)
    names = [n for n, p in stage.named_parameters() if p.requires_grad]
    return loss.detach(), gx, dict(zip(names, grads, strict=True))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_split_backward_recomputes_in_i_and_w_is_unchanged(name: str) -> None:
    # I (torch.autograd.grad w.r.t. the input and the non-Linear parameters) unpacks the
    # checkpointed blocks' saved tensors, so the recompute runs there; W then uses the
    # Linear inputs and output gradients the store caught, bitwise as without recompute.
    desc = MODELS[name]
    gen = torch.Generator().manual_seed(2)
    x0 = torch.randn(2, 16, desc.hidden, generator=gen)
    y = torch.randint(0, desc.vocab_size, (2, 16), generator=gen)
    loss0, gx0, w0 = _split(desc, "none", x0, y)
    loss1, gx1, w1 = _split(desc, "full", x0, y)
    assert torch.equal(loss0, loss1)
    assert torch.equal(gx0, gx1)
    for n in w0:
        assert w0[n] is not None and torch.equal(w0[n], w1[n]), n


def test_no_grad_forward_checkpoints_nothing() -> None:
    # Evaluation runs without gradients: no checkpoint frames, the same logits.
    ids = torch.randint(0, GPT.vocab_size, (1, 8))
    plain = build_stage(GPT, 0, GPT.num_layers, seed=1)
    again = build_stage(GPT, 0, GPT.num_layers, seed=1, recompute="full")
    with torch.no_grad():
        assert torch.equal(plain(ids), again(ids))


def test_a_bad_setting_is_refused_by_the_stage() -> None:
    with pytest.raises(ValueError, match="every-N"):
        build_stage(GPT, 0, GPT.num_layers, recompute="every-0")
