"""The split backward of one stage (``I`` then ``W``), and a meter of the activations it holds.

[Note: I and W in autograd]
    A zero-bubble schedule splits a micro-batch's backward into ``I`` (the gradient w.r.t.
    the stage input, sent upstream at once) and ``W`` (the weight gradients, later). As in
    Qi et al.'s own implementation, the deferred part is the matmul weight gradients:
    :class:`WeightGradStore` keeps, for every ``nn.Linear`` call of the micro-batch, its
    input (autograd saves it anyway) and — caught by a tensor hook during ``I`` — the
    gradient at its output. ``I`` is one ``torch.autograd.grad`` w.r.t. the stage input and
    every parameter that is not a Linear weight (biases, norms: cheap), which skips the
    Linear weight gradients (autograd computes only what the requested inputs need) and frees
    the graph; ``W`` is one matmul per Linear call, ``dW = g^T x``, bitwise what autograd's
    full backward computes.

    ``torch.distributed.pipelining``'s ``stage_backward_input``/``stage_backward_weight``
    do the same for any module by walking the autograd graph in Python on every
    micro-batch; on the demo stage that walk made ``I`` alone slower than the whole
    backward (measured 17 ms vs 12 ms; ``I`` + ``W`` 2.3× ``B``), which would defeat the
    point. Here ``I`` + ``W`` ≈ ``B``.

    DeepSpeed must still see exactly one ``engine.backward`` per micro-batch carrying its
    gradients — its ZeRO-1 hooks accumulate them, reduce at the accumulation boundary and
    step — so ``W`` ends with ``engine.backward(Σ (p·g).sum(), scale_wrt_gas=False)``, whose
    gradient w.r.t. ``p`` is ``g`` exactly (:func:`weight_surrogate`), with the gradients of
    both passes. The last stage's ``I`` divides the loss by ``micro_batches`` exactly as
    ``engine.backward`` would ([Note: loss scaling] in :mod:`.engine`). DeepSpeed 0.19 hooks
    the engine's output so that a plain ``out.backward(grad)`` runs its backward prologue
    and scales by 1/M; ``I`` passes through ``out`` outside any engine backward, so a split
    micro-batch's output loses those hooks (:func:`drop_output_hooks`). The first stage has
    no input gradient to send: its ``I`` does nothing and its ``W`` is the usual full
    backward (as torch's pipelining does).

[Note: W accumulates in place]
    ``W`` makes no fresh gradient for autograd to add to ``p.grad`` in a pass of its own: it
    takes each parameter's accumulated ``.grad`` (leaving None), adds the micro-batch's
    gradient into it — ``addmm_`` for the Linear weights, so the sum is made by the matmul
    itself — and the surrogate hands that buffer back: autograd's AccumulateGrad, finding
    ``p.grad`` None and the tensor otherwise unreferenced, adopts it without a copy, and
    DeepSpeed's per-parameter hooks fire exactly as for a full backward (at the accumulation
    boundary they reduce what ``.grad`` holds). The engine drops its own references before
    the backward so the adoption can happen; a referenced tensor would be cloned, correct
    but slower. A replica's weight-gradient factor is applied here (``scale``), the
    surrogate then runs unscaled. So ``I`` + ``W`` costs 1.02 × the fused backward (a
    separate accumulation pass would add 8-9 %; ``benchmarks/wsplit.py --testbed``, the
    calibrated costs it prints).

[Note: activation meter]
    :class:`ActivationMeter` counts the bytes autograd keeps for backward (saved tensors,
    deduplicated by storage, parameters excluded) per micro-batch, from its forward until its
    graph is released at ``B`` or ``I``; after ``I`` it counts what the weight-gradient
    store keeps for ``W`` (Linear inputs and output gradients) until ``W``. Its peak is the
    stage's measured activation memory, the quantity the planner's memory model predicts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ActivationMeter", "WeightGradStore", "drop_output_hooks", "weight_surrogate"]


def drop_output_hooks(out: Tensor) -> None:
    """Remove the backward hooks DeepSpeed's ``engine.forward`` put on ``out`` (see note).

    DeepSpeed 0.19 keeps them in ``out._backward_hook_managers``; without that attribute
    there is nothing to remove."""
    for manager in getattr(out, "_backward_hook_managers", ()):
        manager.remove_hooks()


class WeightGradStore:
    """Per micro-batch, what ``W`` needs: each Linear call's input and output gradient, and
    the other parameters' gradients from ``I`` (see [Note: I and W in autograd])."""

    def __init__(self, module: nn.Module) -> None:
        self._linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        linear_weights = {id(m.weight) for m in self._linears}
        params = [p for p in module.parameters() if p.requires_grad]
        self.params = params
        self.others = [p for p in params if id(p) not in linear_weights]
        self._calls: dict[int, list[list[Any]]] = {}  # mb -> [module, input, output grad]
        self._other_grads: dict[int, tuple[Tensor | None, ...]] = {}
        self._recording: int | None = None  # the micro-batch running forward
        self._capturing: int | None = None  # the micro-batch running I
        for m in self._linears:
            m.register_forward_hook(self._on_forward)

    def _on_forward(self, mod: nn.Module, inputs: tuple[Any, ...], out: Tensor) -> None:
        mb = self._recording
        if mb is None or not out.requires_grad:
            return
        call: list[Any] = [mod, inputs[0], None]
        self._calls.setdefault(mb, []).append(call)

        def grab(grad: Tensor) -> None:
            if self._capturing == mb:
                call[2] = grad

        out.register_hook(grab)

    @contextmanager
    def forward(self, mb: int) -> Iterator[None]:
        self._recording = mb
        try:
            yield
        finally:
            self._recording = None

    def input_backward(self, mb: int, root: Tensor, grad: Tensor | None, x: Tensor) -> Tensor:
        """``I``: the gradient of ``root`` (the stage output with its received gradient
        ``grad``, or the scaled loss with ``grad`` None) w.r.t. ``x``; frees the graph and
        keeps what ``W`` needs. Returns ``x``'s gradient."""
        self._capturing = mb
        try:
            grads = torch.autograd.grad(
                [root], [x, *self.others], None if grad is None else [grad], allow_unused=True
            )
        finally:
            self._capturing = None
        self._other_grads[mb] = grads[1:]
        return grads[0]

    def kept(self, mb: int) -> list[Tensor]:
        """The tensors held for ``W`` of ``mb`` (for the activation meter)."""
        out = [t for call in self._calls.get(mb, ()) for t in call[1:] if t is not None]
        return out + [g for g in self._other_grads.get(mb, ()) if g is not None]

    def weight_gradients(self, mb: int, scale: float = 1.0) -> list[Tensor | None]:
        """``W``: per parameter (in :attr:`params` order) its accumulated gradient plus
        ``scale`` times micro-batch ``mb``'s, or None if ``mb`` gave it none.

        The sums are made in the parameters' own ``.grad`` buffers, which are taken from
        them (set to None): see [Note: W accumulates in place]."""
        calls = self._calls.pop(mb, ())
        others = self._other_grads.pop(mb)
        for mod, _, g in calls:  # before any gradient is taken: nothing is lost on error
            if g is None:
                raise RuntimeError(f"no output gradient reached {mod} in micro-batch {mb}'s I")
        out: dict[int, Tensor] = {}

        def taken(p: Tensor) -> Tensor | None:
            if id(p) not in out and p.grad is not None:
                out[id(p)], p.grad = p.grad, None
            return out.get(id(p))

        with torch.no_grad():  # the inputs are part of the freed graph: no autograd here
            for mod, inp, g in calls:
                g2, x2 = g.reshape(-1, g.shape[-1]).t(), inp.reshape(-1, inp.shape[-1])
                acc = taken(mod.weight)
                if acc is None:
                    out[id(mod.weight)] = g2.mm(x2) if scale == 1.0 else g2.mm(x2).mul_(scale)
                else:
                    acc.addmm_(g2, x2, alpha=scale)
            for p, g in zip(self.others, others, strict=True):
                if g is None:
                    continue
                acc = taken(p)
                if acc is None:
                    out[id(p)] = g if scale == 1.0 else g * scale
                else:
                    acc.add_(g, alpha=scale)
        return [out.get(id(p)) for p in self.params]

    def drop(self, mb: int) -> None:
        """Forget ``mb`` (its backward ran whole, or the step was abandoned)."""
        self._calls.pop(mb, None)
        self._other_grads.pop(mb, None)


class _InjectGrads(torch.autograd.Function):
    """A zero scalar whose backward hands each parameter a given gradient. The gradients
    are accumulated sums ([Note: W accumulates in place]), so the incoming gradient must be
    1: a loss scaler's factor would rescale every earlier micro-batch again."""

    @staticmethod
    def forward(ctx: Any, grads: tuple[Tensor | None, ...], *params: Tensor) -> Tensor:
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, out: Tensor) -> tuple[Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, ()
        if out.item() != 1.0:
            raise RuntimeError(f"the weight-gradient surrogate was scaled by {out.item()}")
        return (None, *grads)


def weight_surrogate(params: list[nn.Parameter], grads: list[Tensor | None]) -> Tensor:
    """A scalar whose gradient w.r.t. each parameter is exactly its ``g`` (behaves like
    ``Σ (p·g).sum()`` without computing the products); parameters with no ``g`` get none."""
    used = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
    if not used:
        raise RuntimeError("the weight-gradient pass reached no parameter")
    return _InjectGrads.apply(tuple(g for _, g in used), *(p for p, _ in used))


def _storage_bytes(tensors: Iterator[Tensor], skip: set[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, Tensor):
            continue
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr and ptr not in skip:
            out[ptr] = st.nbytes()
    return out


class ActivationMeter:
    """Bytes held for backward per micro-batch, and their running total (see note)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._held: dict[int, dict[int, int]] = {}  # mb -> storage -> bytes
        self.current = 0
        self.peak = 0

    @contextmanager
    def forward(self, mb: int) -> Iterator[None]:
        """Count the tensors autograd saves while micro-batch ``mb`` runs forward."""
        seen: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor:
            seen.update(_storage_bytes(iter((t,)), self._params))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._held[mb] = seen
        self.current += sum(seen.values())
        self.peak = max(self.peak, self.current)

    def keep(self, mb: int, tensors: list[Tensor]) -> None:
        """Also count ``tensors`` (the gradients ``I`` keeps for ``W``) under ``mb``."""
        new = _storage_bytes(iter(tensors), self._params)
        held = self._held.setdefault(mb, {})
        added = {k: v for k, v in new.items() if k not in held}
        held.update(added)
        self.current += sum(added.values())
        self.peak = max(self.peak, self.current)

    def release(self, mb: int) -> None:
        """Micro-batch ``mb``'s graph is gone."""
        self.current -= sum(self._held.pop(mb, {}).values())

    def reset_peak(self) -> None:
        self.peak = self.current
