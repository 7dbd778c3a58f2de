"""The outer optimizer: theta_global and Nesterov momentum, stepped on averaged pseudo-gradients.

Every ``H`` inner steps (per fragment, see :mod:`geopipe.outer.fragments`) each replica group
computes its pseudo-gradient ``theta_global - theta_local``, the groups average them
(:func:`geopipe.outer.exchange.average_encoded`), and every group applies the *same* outer
step to its own copy of theta_global. The step is exactly
``torch.optim.SGD(lr, momentum, nesterov=True)`` with the averaged pseudo-gradient as the
gradient (DiLoCo's defaults: lr 0.7, momentum 0.9), written out elementwise here so that one
fragment (a slice of every tensor) can be stepped on its own, and with the same operations in
the same order as torch's single-tensor SGD, so the results are bit-identical to it.

Why fp32 and a copy of its own: the pseudo-gradient must come from the fp32 master weights
(under ZeRO-1, DeepSpeed's partitions), and theta_global must be identical in every group, so
it is held here, in fp32, apart from the weights the inner optimizer moves.

[Note: the outer state lives on the host]
theta_global, the outer momentum and every flat vector this class returns (:meth:`gather`,
:meth:`pseudo_gradient`) are CPU tensors, whatever device the weights are on; :meth:`scatter`
and :meth:`copy_to` write into each target tensor on its own device. Why the host: the state is
8 B per parameter (theta_global and the momentum, fp32), two thirds of what ZeRO-1's masters
and Adam moments take again, touched once per round (every ``H`` inner steps) and never by the
inner steps, and everything it meets is on the host anyway: the pseudo-gradient is encoded and
the peers' payloads are decoded there (:mod:`geopipe.transport.codec` works on CPU tensors).
On the device it would cost that memory for the whole run to save one device-to-host copy of
the partition per round, a copy small beside the WAN transfer it feeds. torchft's DiLoCo
keeps its backup of the global parameters on the host for the same reason (its outer
momentum sits with the model, since its outer step runs on the model's parameters; here the
step is elementwise on flat host vectors, so the momentum goes with theta_global). Not
pinned: pinning needs CUDA, and the copies are once per round. The planner's memory model
counts none of it in device memory
(:func:`geopipe.optimizer.memory.outer_state_bytes_per_param`).

The inner optimizer's state (Adam's moments and step count) is *not* reset at a round: after
an outer step the local weights are set to theta_global and the inner optimizer goes on from
its state, as DiLoCo and torchft do. Resetting it would re-run Adam's bias-corrected early
steps (a burst of large updates) after every round.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from geopipe.outer.fragments import fragment_bounds

__all__ = ["HOME", "OuterOptimizer", "pseudo_gradient"]

# where the outer state lives ([Note: the outer state lives on the host])
HOME = torch.device("cpu")


def pseudo_gradient(theta_global: Tensor, theta_local: Tensor) -> Tensor:
    """``theta_global - theta_local`` in fp32: the direction the inner steps moved, negated,
    so that an SGD step along it (``theta - lr * delta``) moves toward the local weights.
    torchft flipped this sign once (its PR #233); the unit tests pin it against SGD. On the
    host, wherever either operand is ([Note: the outer state lives on the host])."""
    a = theta_global.detach().to(HOME, torch.float32)
    return a - theta_local.detach().to(HOME, torch.float32)


def _home_copy(t: Tensor) -> Tensor:
    """A contiguous fp32 copy of ``t`` on the host, owning its memory."""
    return t.detach().to(HOME, torch.float32, copy=True).contiguous()


def _as_list(tensors: Tensor | Sequence[Tensor]) -> list[Tensor]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


class OuterOptimizer:
    """theta_global (fp32 tensors: one flat partition, or a list) and the outer momentum, kept
    on the host whatever device ``theta`` is given on ([Note: the outer state lives on the
    host]).

    ``fragments`` splits every tensor into that many equal contiguous slices; fragment ``f``
    is slice ``f`` of each tensor, flattened and concatenated in tensor order
    (:meth:`gather`). Each fragment keeps its own momentum buffer and step count, as
    torchft's per-fragment outer optimizers do. With ``momentum = 0`` the step is plain SGD
    (torch refuses Nesterov without momentum; with none it would equal plain SGD anyway).
    """

    def __init__(
        self,
        theta: Tensor | Sequence[Tensor],
        lr: float = 0.7,
        momentum: float = 0.9,
        fragments: int = 1,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"plan.outer.lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"plan.outer.momentum must be in [0, 1), got {momentum}")
        tensors = _as_list(theta)
        if not tensors:
            raise ValueError("theta_global needs at least one tensor")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.fragments = int(fragments)
        self.theta: list[Tensor] = [_home_copy(t) for t in tensors]
        self._bounds = [fragment_bounds(t.numel(), self.fragments) for t in self.theta]
        self._buf: list[Tensor | None] = [None] * self.fragments
        self._steps = [0] * self.fragments

    # ------------------------------------------------------------------ fragments

    def fragment_numel(self, fragment: int) -> int:
        """Elements in ``fragment`` (the length of its flat pseudo-gradient)."""
        self._check_fragment(fragment)
        return sum(b[fragment][1] - b[fragment][0] for b in self._bounds)

    def gather(self, tensors: Tensor | Sequence[Tensor], fragment: int) -> Tensor:
        """Slice ``fragment`` of each tensor (shaped like theta), flattened and concatenated
        into a new fp32 vector on the host (copied from the tensors' device)."""
        parts = self._parts(tensors, fragment)
        return torch.cat([p.detach().to(HOME, torch.float32) for p in parts])

    def scatter(self, flat: Tensor, tensors: Tensor | Sequence[Tensor], fragment: int) -> None:
        """Write the flat vector ``flat`` into slice ``fragment`` of each tensor, in place and
        on each tensor's own device and dtype (``copy_`` moves and casts)."""
        parts = self._parts(tensors, fragment)
        if flat.numel() != sum(p.numel() for p in parts):
            raise ValueError(
                f"fragment {fragment} holds {sum(p.numel() for p in parts)} elements, "
                f"got {flat.numel()}"
            )
        offset = 0
        with torch.no_grad():
            for p in parts:
                p.copy_(flat[offset : offset + p.numel()])
                offset += p.numel()

    def pseudo_gradient(self, local: Tensor | Sequence[Tensor], fragment: int = 0) -> Tensor:
        """This group's flat pseudo-gradient of ``fragment``: theta_global - local weights."""
        return pseudo_gradient(self.gather(self.theta, fragment), self.gather(local, fragment))

    def copy_to(self, local: Tensor | Sequence[Tensor], fragment: int = 0) -> None:
        """Set ``fragment`` of the local weights to theta_global (torchft's
        ``fragment_update_alpha = 0``: the inner steps taken since the send are discarded)."""
        self.scatter(self.gather(self.theta, fragment), local, fragment)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, avg_pseudo_grad: Tensor, fragment: int = 0) -> None:
        """One outer step of ``fragment`` with the groups' averaged pseudo-gradient (flat, as
        :meth:`pseudo_gradient` returns it). The operations are torch's single-tensor SGD's:
        ``buf = g`` on the first step, else ``buf = momentum * buf + g``;
        ``g = g + momentum * buf`` (Nesterov); ``theta -= lr * g``."""
        self._check_fragment(fragment)
        g = avg_pseudo_grad.detach().to(HOME, torch.float32).reshape(-1)
        if g.numel() != self.fragment_numel(fragment):
            raise ValueError(
                f"fragment {fragment} holds {self.fragment_numel(fragment)} elements, "
                f"got a pseudo-gradient of {g.numel()}"
            )
        if not bool(torch.isfinite(g).all()):
            raise ValueError(f"the averaged pseudo-gradient of fragment {fragment} is not finite")
        p = self.gather(self.theta, fragment)
        if self.momentum != 0.0:
            buf = self._buf[fragment]
            if buf is None:
                buf = torch.clone(g).detach()
                self._buf[fragment] = buf
            else:
                buf.mul_(self.momentum).add_(g, alpha=1.0)
            g = g.add(buf, alpha=self.momentum)
        p.add_(g, alpha=-self.lr)
        self.scatter(p, self.theta, fragment)
        self._steps[fragment] += 1

    def steps(self, fragment: int = 0) -> int:
        """Outer steps applied to ``fragment`` so far."""
        self._check_fragment(fragment)
        return self._steps[fragment]

    # ------------------------------------------------------------------ state

    def digest(self, fragment: int | None = None) -> str:
        """sha256 over theta_global's shapes and bytes (of ``fragment``'s slices only, when
        given): equal in every group after each round.

        A round changes only its fragment, so its check hashes that fragment: the whole
        theta_global took ~4 ms to hash on a 2-core host, paid by every replica at every
        apply, F times per H under streaming (where the steps beside it pay for every
        CPU-millisecond). The slices are hashed in place (no byte copy)."""
        h = hashlib.sha256()
        parts = self.theta if fragment is None else self._parts(self.theta, fragment)
        for t in parts:
            h.update(repr(tuple(t.shape)).encode())
            h.update(memoryview(t.detach().to(HOME).contiguous().view(torch.uint8).numpy()))
        return h.hexdigest()

    def state_dict(self) -> dict[str, Any]:
        """Settings, theta_global, per-fragment momentum and step counts (copies)."""
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "fragments": self.fragments,
            "theta": [t.clone() for t in self.theta],
            "momentum_buffer": [None if b is None else b.clone() for b in self._buf],
            "steps": list(self._steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` bit-exactly; the shapes and fragments must match."""
        if int(state["fragments"]) != self.fragments:
            raise ValueError(
                f"outer state has {state['fragments']} fragments, this optimizer {self.fragments}"
            )
        theta = list(state["theta"])
        if [tuple(t.shape) for t in theta] != [tuple(t.shape) for t in self.theta]:
            raise ValueError("outer state's theta_global shapes differ from this optimizer's")
        bufs = list(state["momentum_buffer"])
        for f, b in enumerate(bufs):
            if b is not None and b.numel() != self.fragment_numel(f):
                raise ValueError(f"outer momentum of fragment {f} has {b.numel()} elements")
        self.lr = float(state["lr"])
        self.momentum = float(state["momentum"])
        self.theta = [_home_copy(t) for t in theta]
        self._buf = [None if b is None else _home_copy(b) for b in bufs]
        self._steps = [int(s) for s in state["steps"]]

    # ------------------------------------------------------------------ helpers

    def _parts(self, tensors: Tensor | Sequence[Tensor], fragment: int) -> list[Tensor]:
        self._check_fragment(fragment)
        tensors = _as_list(tensors)
        if [t.numel() for t in tensors] != [t.numel() for t in self.theta]:
            raise ValueError(
                "tensors do not match theta_global's layout: "
                f"{[t.numel() for t in tensors]} vs {[t.numel() for t in self.theta]}"
            )
        return [
            t.view(-1)[b[fragment][0] : b[fragment][1]]
            for t, b in zip(tensors, self._bounds, strict=True)
        ]

    def _check_fragment(self, fragment: int) -> None:
        if not 0 <= fragment < self.fragments:
            raise ValueError(f"fragment {fragment} out of range [0, {self.fragments})")
