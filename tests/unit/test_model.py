"""Partition independence of the GPT: names, initial weights, forward and gradients."""

from __future__ import annotations

import pytest
import torch

from geopipe.model.gpt import GPTConfig, GPTStage, layer_name, lm_loss, num_layers, param_count

CFG = GPTConfig(n_layer=3, n_embd=32, n_head=4, vocab_size=256, block_size=64)
PARTITIONS = [
    [(0, 2), (2, 5)],
    [(0, 1), (1, 3), (3, 5)],
    [(0, 4), (4, 5)],
    [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)],
]


def full_model(seed: int = 0) -> GPTStage:
    return GPTStage(CFG, 0, num_layers(CFG), seed=seed)


def test_num_layers_and_names() -> None:
    assert num_layers(CFG) == 5
    assert [layer_name(CFG, i) for i in range(5)] == [
        "embed",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "head",
    ]
    names = set(dict(full_model().named_parameters()))
    assert "blocks.2.attn.qkv.weight" in names
    assert "embed.wte.weight" in names and "head.lm_head.weight" in names


@pytest.mark.parametrize("partition", PARTITIONS)
def test_stage_names_and_init_match_full_model(partition: list[tuple[int, int]]) -> None:
    full = dict(full_model(seed=7).named_parameters())
    seen: set[str] = set()
    for start, end in partition:
        stage = GPTStage(CFG, start, end, seed=7)
        params = dict(stage.named_parameters())
        assert not seen & params.keys(), "stages must not share parameter names"
        seen |= params.keys()
        for name, p in params.items():
            assert torch.equal(p, full[name]), name
    assert seen == full.keys()


def test_seed_changes_init_and_layers_differ() -> None:
    a, b = full_model(seed=0), full_model(seed=1)
    assert not torch.equal(a.blocks["0"].attn.qkv.weight, b.blocks["0"].attn.qkv.weight)
    # Different layers draw from different generators.
    assert not torch.equal(a.blocks["0"].mlp.fc.weight, a.blocks["1"].mlp.fc.weight)


def test_init_statistics() -> None:
    model = GPTStage(
        GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=64), 0, 6
    )
    blk = model.blocks["0"]
    assert torch.count_nonzero(blk.attn.qkv.bias) == 0
    assert torch.all(blk.ln_1.weight == 1) and torch.count_nonzero(blk.ln_1.bias) == 0
    assert abs(blk.mlp.fc.weight.std().item() - 0.02) < 0.002
    assert abs(blk.mlp.proj.weight.std().item() - 0.02 / (2 * 4) ** 0.5) < 0.001


@pytest.mark.parametrize("partition", PARTITIONS)
def test_chained_forward_and_backward_match_full_model(
    partition: list[tuple[int, int]],
) -> None:
    torch.manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    y = torch.randint(0, CFG.vocab_size, (2, 16))

    full = full_model(seed=3)
    full_logits = full(x)
    lm_loss(full_logits, y).backward()
    full_grads = {n: p.grad for n, p in full.named_parameters()}

    stages = [GPTStage(CFG, s, e, seed=3) for s, e in partition]
    assert [s.has_embed for s in stages] == [True] + [False] * (len(stages) - 1)
    assert [s.has_head for s in stages] == [False] * (len(stages) - 1) + [True]
    # Forward: detach at every stage boundary, like the pipeline runtime does.
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    h: torch.Tensor = x
    for stage in stages:
        if not stage.has_embed:
            h = h.detach().requires_grad_(True)
        inputs.append(h)
        h = stage(h)
        outputs.append(h)
    torch.testing.assert_close(h, full_logits, rtol=1e-6, atol=1e-6)

    # Backward: loss on the last stage, then pass hidden.grad back manually.
    lm_loss(outputs[-1], y).backward()
    for i in range(len(stages) - 2, -1, -1):
        outputs[i].backward(inputs[i + 1].grad)

    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, full_grads[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("start", "end"), [(0, 5), (0, 1), (1, 2), (4, 5), (0, 2), (1, 4), (2, 5), (3, 4)]
)
def test_param_count_matches_modules(start: int, end: int) -> None:
    stage = GPTStage(CFG, start, end)
    assert param_count(CFG, start, end) == sum(p.numel() for p in stage.parameters())


def test_param_count_larger_config() -> None:
    cfg = GPTConfig(n_layer=2, n_embd=48, n_head=6, vocab_size=100, block_size=17)
    for start, end in [(0, 4), (1, 3), (0, 1), (3, 4)]:
        stage = GPTStage(cfg, start, end)
        assert param_count(cfg, start, end) == sum(p.numel() for p in stage.parameters())


def test_stage_flags_and_shapes() -> None:
    mid = GPTStage(CFG, 1, 3)
    assert not mid.has_embed and not mid.has_head
    assert list(mid.blocks.keys()) == ["0", "1"]
    h = torch.randn(2, 8, CFG.n_embd)
    assert mid(h).shape == (2, 8, CFG.n_embd)
    logits = GPTStage(CFG, 3, 5)(h)
    assert logits.shape == (2, 8, CFG.vocab_size)


def test_invalid_ranges_and_inputs() -> None:
    for start, end in [(0, 0), (-1, 2), (3, 2), (0, 6)]:
        with pytest.raises(ValueError, match="invalid layer range"):
            GPTStage(CFG, start, end)
    with pytest.raises(ValueError, match="block_size"):
        GPTStage(CFG, 0, 1)(torch.zeros(1, CFG.block_size + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden state"):
        GPTStage(CFG, 1, 2)(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_layer=1, n_embd=30, n_head=4, vocab_size=256, block_size=8)


def test_causality() -> None:
    model = full_model()
    x = torch.randint(0, 256, (1, 12))
    x2 = x.clone()
    x2[0, 8:] = (x2[0, 8:] + 1) % 256
    torch.testing.assert_close(model(x)[:, :8], model(x2)[:, :8])


def test_lm_loss_near_uniform_at_init() -> None:
    x = torch.randint(0, 256, (2, 16))
    loss = lm_loss(full_model()(x), x)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1
