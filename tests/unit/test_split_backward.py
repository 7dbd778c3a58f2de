"""The split backward's pieces on a real GPT stage, against plain autograd (torch only):
I + W give a full backward's gradients, W's surrogate carries them exactly, and the
activation meter counts what autograd and the store hold."""

from __future__ import annotations

import pytest
import torch

from geopipe.model.gpt import GPTConfig, GPTStage, lm_loss
from geopipe.runtime.actor.backward import ActivationMeter, WeightGradStore, weight_surrogate

CFG = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)


def _stage(a: int, b: int) -> GPTStage:
    torch.manual_seed(0)
    return GPTStage(CFG, a, b, seed=3)


def _reference(
    stage: GPTStage, x: torch.Tensor, tail
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    stage.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    tail(stage(x)).backward()
    return x.grad, {n: p.grad.clone() for n, p in stage.named_parameters()}


@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
def test_input_then_weight_gradients_equal_a_full_backward(last: bool) -> None:
    stage = _stage(1, 4) if last else _stage(1, 3)
    store = WeightGradStore(stage)
    assert store.others and len(store.others) < len(store.params)  # biases and norms
    x0 = torch.randn(2, 16, CFG.n_embd)
    y = torch.randint(0, CFG.vocab_size, (2, 16))
    g_out = torch.randn(2, 16, CFG.n_embd)

    def tail(out: torch.Tensor) -> torch.Tensor:
        return lm_loss(out, y) / 4 if last else (out * g_out).sum()

    want_x, want = _reference(stage, x0, tail)
    stage.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    with store.forward(7):
        out = stage(x)
    root, grad = (lm_loss(out, y) / 4, None) if last else (out, g_out)
    got_x = store.input_backward(7, root, grad, x)
    assert all(p.grad is None for p in stage.parameters())  # I leaves parameters alone
    assert torch.equal(got_x, want_x)
    grads = store.weight_gradients(7)
    names = [n for n, p in stage.named_parameters() if p.requires_grad]
    for name, g in zip(names, grads, strict=True):
        assert g is not None, name
        assert torch.allclose(g, want[name], rtol=0, atol=1e-6), name
    # W's surrogate hands exactly those gradients to whoever runs its backward
    weight_surrogate(store.params, grads).backward()
    for name, p, g in zip(names, store.params, grads, strict=True):
        assert torch.equal(p.grad, g), name
    with pytest.raises(KeyError):
        store.weight_gradients(7)  # consumed


def test_weight_gradients_accumulate_in_place_and_are_adopted() -> None:
    # [Note: W accumulates in place]: W adds scale x the micro-batch's gradients into the
    # gradients already accumulated, in their own buffers, and autograd adopts those
    # buffers from the surrogate without a copy.
    stage = _stage(1, 3)
    store = WeightGradStore(stage)
    x0, g_out = torch.randn(2, 16, CFG.n_embd), torch.randn(2, 16, CFG.n_embd)
    _, want = _reference(stage, x0, lambda out: (out * g_out).sum())
    names = [n for n, p in stage.named_parameters() if p.requires_grad]
    before = {n: torch.randn_like(p) for n, p in stage.named_parameters()}
    for n, p in stage.named_parameters():
        p.grad = before[n].clone()
    buffers = {n: p.grad.data_ptr() for n, p in stage.named_parameters()}
    x = x0.clone().requires_grad_(True)
    with store.forward(3):
        out = stage(x)
    store.input_backward(3, out, g_out, x)
    grads = store.weight_gradients(3, scale=0.5)
    assert all(p.grad is None for p in stage.parameters())  # taken, to be handed back
    surrogate = weight_surrogate(store.params, grads)
    del grads
    surrogate.backward()
    for name, p in zip(names, store.params, strict=True):
        assert torch.allclose(p.grad, before[name] + 0.5 * want[name], rtol=0, atol=1e-6), name
        assert p.grad.data_ptr() == buffers[name], f"{name}'s gradient was copied, not adopted"


def test_store_forgets_full_backwards_and_records_only_inside_forward() -> None:
    stage = _stage(1, 3)
    store = WeightGradStore(stage)
    stage(torch.randn(1, 4, CFG.n_embd))  # outside store.forward: nothing kept
    assert store.kept(0) == []
    with store.forward(0):
        stage(torch.randn(1, 4, CFG.n_embd, requires_grad=True))
    assert len(store.kept(0)) == 8  # the inputs of the 2 blocks' 4 Linear calls each
    store.drop(0)
    assert store.kept(0) == []


def test_activation_meter_counts_saved_tensors_and_releases() -> None:
    stage = _stage(1, 2)
    meter = ActivationMeter([p for p in stage.parameters()])
    sizes = []
    for mb in range(2):
        with meter.forward(mb):
            out = stage(torch.randn(2, 16, CFG.n_embd, requires_grad=True))
        sizes.append(meter.current - sum(sizes))
        assert out.requires_grad
    bsh = 2 * 16 * CFG.n_embd * 4  # bytes of one fp32 activation
    # a block keeps several activations' worth (LN, qkv, attention, MLP 4h twice), no weights
    assert sizes[0] == sizes[1] and 6 * bsh < sizes[0] < 40 * bsh
    assert meter.peak == meter.current == 2 * sizes[0]
    meter.release(0)
    assert meter.current == sizes[0] and meter.peak == 2 * sizes[0]
    meter.keep(1, [torch.zeros(10)])
    assert meter.current == sizes[0] + 40
    meter.reset_peak()
    meter.release(1)
    assert meter.current == 0 and meter.peak == sizes[0] + 40


def test_a_scaled_weight_surrogate_is_refused() -> None:
    # W hands over accumulated sums: scaling them would rescale earlier micro-batches too.
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="scaled by 2"):
        (weight_surrogate([p], [torch.ones(3)]) * 2).backward()
