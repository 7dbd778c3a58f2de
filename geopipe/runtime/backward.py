"""The split backward of one stage (``I`` then ``W``), and a meter of the activations it holds.

[Note: split backward]
    A zero-bubble schedule splits a micro-batch's backward into ``I`` (the gradient w.r.t.
    the stage input, sent upstream at once) and ``W`` (the weight gradients, later).
    ``I`` runs ``torch.distributed.pipelining``'s ``stage_backward_input``: autograd w.r.t.
    the input only, keeping the graph and the gradients at the weights' consumers; ``W`` runs
    its ``stage_backward_weight`` from those, giving each parameter's gradient ``dw`` for the
    micro-batch without recomputing the input-gradient chain. (These are private torch
    functions, pinned with torch 2.13 and checked by the parity tests; writing our own graph
    surgery would be the same code, less tested.)

    DeepSpeed must still see exactly one ``engine.backward`` per micro-batch carrying those
    gradients — its ZeRO-1 hooks accumulate them, reduce at the accumulation boundary and
    step — so ``W`` ends with ``engine.backward(Σ (p·dw).sum(), scale_wrt_gas=False)``,
    whose gradient w.r.t. ``p`` is ``dw`` exactly. ``dw`` is taken with every ``p.grad`` set
    aside and put back, so DeepSpeed's buffers change only inside its own backward.

    The last stage's ``I`` divides the loss by ``micro_batches`` exactly as ``engine.backward``
    would ([Note: loss scaling] in :mod:`.engine`). DeepSpeed 0.19 hooks the engine's output
    so that a plain ``out.backward(grad)`` runs its backward prologue and scales by 1/M;
    ``I`` passes through ``out`` outside any engine backward, so a split micro-batch's output
    loses those hooks (:func:`drop_output_hooks`). The first stage has no input gradient to
    send: its ``I`` does nothing and its ``W`` is the usual full backward, as in torch's
    pipelining.

[Note: activation meter]
    :class:`ActivationMeter` counts the bytes autograd keeps for backward (saved tensors,
    deduplicated by storage, parameters excluded) per micro-batch, from its forward until its
    graph is released — at ``B``, or at ``W`` for a split backward, when the gradients ``I``
    kept for ``W`` are released too. Its peak is the stage's measured activation memory, the
    quantity the planner's memory model predicts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

__all__ = [
    "ActivationMeter",
    "drop_output_hooks",
    "input_backward",
    "weight_gradients",
    "weight_surrogate",
]


def drop_output_hooks(out: Tensor) -> None:
    """Remove the backward hooks DeepSpeed's ``engine.forward`` put on ``out`` (see note).

    DeepSpeed 0.19 keeps them in ``out._backward_hook_managers``; without that attribute
    there is nothing to remove."""
    for manager in getattr(out, "_backward_hook_managers", ()):
        manager.remove_hooks()


def input_backward(
    root: Tensor, grad: Tensor | None, x: Tensor, params: list[nn.Parameter]
) -> list[dict[str, Any]]:
    """``I``: the gradient of ``root`` (the stage output with its received gradient ``grad``,
    or the scaled loss with ``grad`` None) w.r.t. ``x``, left in ``x.grad``; returns the
    state :func:`weight_gradients` needs."""
    grads = None if grad is None else [grad]
    _, param_groups = stage_backward_input([root], grads, [x], iter(params))
    return param_groups


def weight_gradients(
    params: list[nn.Parameter], param_groups: list[dict[str, Any]]
) -> list[Tensor | None]:
    """``W``: each parameter's gradient for the micro-batch whose ``I`` gave
    ``param_groups`` (None for parameters it does not reach); ``p.grad`` is left as it was."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        stage_backward_weight(iter(params), param_groups)
        return [p.grad for p in params]
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g


def weight_surrogate(params: list[nn.Parameter], dws: list[Tensor | None]) -> Tensor:
    """A scalar whose gradient w.r.t. each parameter is its ``dw``: ``Σ (p·dw).sum()``."""
    terms = [(p * dw).sum() for p, dw in zip(params, dws, strict=True) if dw is not None]
    if not terms:
        raise RuntimeError("the weight-gradient pass reached no parameter")
    return torch.stack(terms).sum()


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
