"""Where tensors from the wire, the host-side outer state and the engine's device meet.

The first GPU run failed with "Expected all tensors to be on the same device, but found at
least two devices, cuda:0 and cpu!": a tied embedding's gradient from the wire (a CPU tensor)
was added into the CUDA gradient. This machine has no CUDA, and nothing here pretends it
has. What can be checked honestly on a CPU:

* device propagation, with ``torch.device("meta")`` standing for "not the host": a meta
  tensor has a device and no data, so an operation that needs only to *write into* it (an
  add, a ``copy_``) runs, and :class:`OneDevice` fails every operation whose tensor operands
  sit on two devices, the rule CUDA kernels enforce and meta kernels do not (a meta tensor
  ``add_`` of a CPU tensor passes silently without it: the control test shows the checker
  catches exactly the first run's expression). Paths that must *read* the device's data
  (the pseudo-gradient, a snapshot) cannot run on meta and are not claimed here;
* dtypes (a bf16 gradient plus the fp32 tensor the wire decodes to) and where the outer
  state lives (the host), with the outer step still bit-equal to torch's Nesterov SGD.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from geopipe.outer import OuterOptimizer, encode_delta, pseudo_gradient
from geopipe.runtime.actor.engine import add_received, add_tied_gradient
from geopipe.transport.codec import decode, make_codec

META = torch.device("meta")
CPU = torch.device("cpu")
# the operations that move data between devices (``Tensor.to``, ``copy_``): the only ones
# whose operands may legitimately sit on two devices
_MOVES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


class OneDevice(TorchDispatchMode):
    """Fail any aten operation but a move whose tensor operands sit on two devices (a 0-dim
    CPU tensor excepted: CUDA kernels take those as scalars)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set[torch.device]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {
            t.device
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not (t.device == CPU and t.dim() == 0)
        }
        self.ops.append((str(func), devices))
        if len(devices) > 1 and func not in _MOVES:
            raise AssertionError(f"{func} mixes devices {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it arrives over the direct channel with codec none: fp32 on the host."""
    return decode(make_codec("none").encode(t, direction="backward"))


# --------------------------------------------------------------------------- tied embeddings


def test_the_checker_catches_the_first_gpu_runs_expression() -> None:
    """The control: a gradient on another device plus a wire tensor cast only in dtype (the
    code the GPU run failed in) is refused by the checker; meta alone lets it through."""
    grad = torch.zeros(6, 4, dtype=torch.bfloat16, device=META)
    other = _wire(torch.ones(6, 4, dtype=torch.bfloat16))
    grad.add_(other.to(grad.dtype))  # meta's own kernels do not check devices
    with pytest.raises(AssertionError, match="mixes devices"), OneDevice():
        grad.add_(other.to(grad.dtype))


def test_a_received_tied_gradient_is_moved_to_the_gradients_device_and_dtype() -> None:
    grad = torch.zeros(6, 4, dtype=torch.bfloat16, device=META)
    other = _wire(torch.ones(6, 4, dtype=torch.bfloat16))
    assert other.device == CPU and other.dtype == torch.float32
    with OneDevice() as mode:
        add_received(grad, other)
    assert ("aten.add_.Tensor", {META}) in mode.ops
    assert grad.device == META and grad.dtype == torch.bfloat16


def test_both_copies_of_a_tied_embedding_add_bitwise_the_same_gradient() -> None:
    """Two stages' bf16 copies swap gradients through the wire's fp32: both end with the same
    bits, bf16(a + b); what each sent is the gradient before the add (not a view the add
    changed) and a host tensor, as the encoder reads it."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8, 5, generator=gen).to(torch.bfloat16)
    b = torch.randn(8, 5, generator=gen).to(torch.bfloat16)
    want = a + b
    ga, gb = a.clone(), b.clone()
    sent: dict[str, torch.Tensor] = {}

    def swap(name: str, other: torch.Tensor):
        def exchange(mine: torch.Tensor) -> torch.Tensor:
            assert mine.device == CPU and mine.dtype == torch.bfloat16
            sent[name] = mine
            return _wire(other)

        return exchange

    add_tied_gradient(ga, swap("a", b))
    add_tied_gradient(gb, swap("b", a))
    assert ga.dtype == gb.dtype == torch.bfloat16
    assert torch.equal(ga, gb) and torch.equal(ga, want)
    assert torch.equal(sent["a"], a) and torch.equal(sent["b"], b)  # not changed by the add
    assert sent["a"].data_ptr() != ga.data_ptr()


# --------------------------------------------------------------------------- the outer state


def _masters(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in (37, 11)]


def test_the_outer_state_lives_on_the_host_and_steps_as_torch_sgd_nesterov() -> None:
    """theta_global, the momentum, every vector handed out and a loaded state are fp32 host
    tensors; two fragments stepped in turn still equal torch's SGD (nesterov) bitwise."""
    outer = OuterOptimizer(_masters(), lr=0.7, momentum=0.9, fragments=2)
    ref = [torch.nn.Parameter(t.clone()) for t in _masters()]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for r in range(3):
        local = [t + 0.1 * _masters(10 + r)[i] for i, t in enumerate(outer.theta)]
        for p, loc in zip(ref, local, strict=True):
            p.grad = pseudo_gradient(p.detach(), loc)
        sgd.step()
        for f in range(2):
            delta = outer.pseudo_gradient(local, f)
            assert delta.device == CPU and delta.dtype == torch.float32
            outer.step(delta, f)
        assert all(torch.equal(p.detach(), t) for p, t in zip(ref, outer.theta, strict=True))
    state = outer.state_dict()
    tensors = [*state["theta"], *state["momentum_buffer"]]
    assert all(t.device == CPU and t.dtype == torch.float32 for t in tensors)
    again = OuterOptimizer([torch.zeros(37), torch.zeros(11)], fragments=2)
    again.load_state_dict(state)
    assert again.digest() == outer.digest()
    assert all(t.device == CPU for t in [*again.theta, *again._buf])


def test_writing_theta_global_back_mixes_no_devices_and_keeps_the_targets() -> None:
    """``copy_to`` writes host theta_global into masters on another device (meta standing
    for the GPU): only moves cross devices, and each target keeps its device and dtype."""
    outer = OuterOptimizer(_masters(), fragments=2)
    masters = [torch.empty(37, device=META), torch.empty(11, device=META)]
    with OneDevice() as mode:
        for f in range(2):
            outer.copy_to(masters, f)
    assert any(op == "aten.copy_.default" and devs == {META, CPU} for op, devs in mode.ops)
    assert all(m.device == META and m.dtype == torch.float32 for m in masters)
    assert all(t.device == CPU for t in outer.theta)


def test_copy_to_and_gather_keep_the_callers_dtype() -> None:
    """A bf16 target gets theta_global rounded into its own dtype; ``gather`` hands back fp32
    on the host whatever the target's dtype."""
    outer = OuterOptimizer(_masters(), fragments=1)
    targets = [torch.zeros(37, dtype=torch.bfloat16), torch.zeros(11, dtype=torch.bfloat16)]
    outer.copy_to(targets)
    assert all(t.dtype == torch.bfloat16 for t in targets)
    pairs = zip(targets, outer.theta, strict=True)
    assert all(torch.equal(t, th.to(torch.bfloat16)) for t, th in pairs)
    flat = outer.gather(targets, 0)
    assert flat.dtype == torch.float32 and flat.device == CPU


def test_an_outer_apply_onto_masters_on_another_device_mixes_no_devices(monkeypatch) -> None:
    """:meth:`OuterState.apply` (decode the groups' payloads, average, step, write back) on a
    replica whose masters are on another device (meta): the average and the step run on the
    host, only the write-back crosses, and the masters keep their device."""
    from geopipe.runtime.actor import outer as outer_mod
    from geopipe.runtime.actor.outer_wire import OuterSettings

    host = _masters()
    masters = [torch.empty(37, device=META), torch.empty(11, device=META)]
    calls = {"synced": 0}
    fake_zero = SimpleNamespace(
        partition_layout=lambda eng: {"rank": 0, "size": 1, "numels": [37, 11]},
        master_partitions=lambda eng: eng.masters,
        sync_working_params=lambda eng: calls.__setitem__("synced", calls["synced"] + 1),
    )
    monkeypatch.setattr(outer_mod, "zero_state", fake_zero)
    engine = SimpleNamespace(has_tied=False, engine=SimpleNamespace(masters=host))
    state = outer_mod.OuterState(engine, 0, OuterSettings(lr=0.7, momentum=0.9))
    assert all(t.device == CPU for t in state.opt.theta)
    local = [t - 0.01 for t in host]  # the masters moved by the inner steps (on the host)
    codec = make_codec("none")
    payloads = [[encode_delta(state.opt.pseudo_gradient(local, 0), codec)]] * 2
    engine.engine.masters = masters
    with OneDevice():
        state.apply(0, payloads)
    assert calls["synced"] == 1 and state.opt.steps(0) == 1
    assert all(m.device == META for m in masters)
    assert all(t.device == CPU for t in [*state.opt.theta, *state.opt._buf])
