"""The pipeline's global gradient norm (the stages' norms exchanged), and model errors.

[Note: global gradient clipping]
    ``training.grad_clip`` clips by the norm of the whole model's gradient, as
    ``torch.nn.utils.clip_grad_norm_`` over one process's parameters does: the square root of
    the sum over the pipeline's stages of each stage's squared norm. DeepSpeed computes a
    stage's norm over its ZeRO-1 partitions (all-reduced in the stage's group) inside its
    optimizer step, then clips and steps; :func:`install_global_norm` wraps that one call
    (``scaled_global_norm``) so that it returns the pipeline's norm, and DeepSpeed's own clip
    (``gradient_clipping``) applies it. Per stage clipping remains (``grad_clip_scope:
    stage``) for whoever asks by name.

    The exchange: each stage sends its norm (one 3-float frame: the layers its ZeRO-1 group
    holds, the norm) to every other stage of its pipeline over the data plane's direct,
    authenticated channels (:class:`~geopipe.transport.direct.DirectSender`, codec none, the
    emulated link's pacing where the sites differ), and waits for theirs: one one-way
    latency per step, all pairs at once, no hop in series (a chain along the neighbours
    would cost 2(S-1) latencies; a round through the driver two Ray calls per step and a
    controller waiting inside every step). Inside a site it is the same channel over the
    site's network; ``torch.distributed`` would need one more group per pipeline, made by
    every rank of the site at setup, for a 12-byte message. The planner prices it
    (:func:`geopipe.optimizer.costs.norm_exchange_s`).

    Every stage sums the same values in the same order (by layer range, each ZeRO-1 group
    once: in a mixed plan two stages of a pipeline may share a group), so all stages, and
    all pipelines, clip by bitwise the same factor. A stage whose norm is not finite (
    DeepSpeed's -1 sentinel) makes the pipeline's norm invalid: every stage then skips the
    step, as DeepSpeed skips an overflowing one. A tied embedding split over the first and
    last stage is counted once (the engine marks the head's copy). Under fp16 loss scaling
    the exchanged norms are unscaled and each stage rescales by its own loss scale.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from geopipe.runtime.actor.links import WanPeer
from geopipe.transport.channel import Inbox
from geopipe.transport.direct import DirectSender
from geopipe.transport.security import RunCredentials

__all__ = ["ModelError", "NormExchange", "install_global_norm"]

NORM_KIND = "N"  # the inbox key of a stage's norm: ("N", step, stage)


class ModelError(RuntimeError):
    """An exception raised by the model itself in a stage's forward or backward (a bug, a
    shape it refuses): not a lost process, so the run ends with it, no recovery
    (:func:`geopipe.runtime.control.health.model_error`). The message starts with
    :data:`MARK` so that the driver can tell it from a peer's failure."""

    MARK = "[model error]"

    @staticmethod
    @contextmanager
    def wrap(what: str, mb: int, where: str = "") -> Iterator[None]:
        try:
            yield
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(
                f"{ModelError.MARK} {where}{what} of micro-batch {mb} raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc


class NormExchange:
    """This stage's part in the pipeline's norm (see the note): its ZeRO-1 group's layers
    ``hold``, senders to the pipeline's other stages, the inbox their norms arrive in."""

    def __init__(
        self,
        stage: int,
        hold: tuple[int, int],
        peers: list[int],
        senders: list[DirectSender],
        inbox: Inbox | None,
        timeout_s: float,
    ) -> None:
        self.stage, self.hold, self.peers = stage, tuple(hold), list(peers)
        self.senders, self.inbox, self.timeout_s = senders, inbox, timeout_s
        self.stage_norm: float | None = None  # this stage's own norm of the last step
        self.global_norm: float | None = None

    @classmethod
    def local(cls, hold: tuple[int, int]) -> NormExchange:
        """No peers: the norm is the stage's own (one stage, or none connected)."""
        return cls(0, hold, [], [], None, 0.0)

    @classmethod
    def connect(
        cls,
        stage: int,
        hold: tuple[int, int],
        peers: list[tuple[int, tuple[str, int], WanPeer | None]],
        inbox: Inbox,
        creds: RunCredentials | None,
        user_timeout_s: float,
        timeout_s: float,
    ) -> NormExchange:
        """Connect to every other stage of the pipeline: ``(stage, receiver address, how
        it is reached)`` each (codec none whatever the peer's codec says: a norm is exact)."""
        senders = []
        for _, addr, peer in peers:
            link = peer.link if peer is not None else None
            senders.append(
                DirectSender(
                    tuple(addr),
                    "none",
                    "backward",
                    link,
                    0.0,
                    user_timeout_s=user_timeout_s,
                    creds=creds,
                )
            )
        return cls(stage, hold, [k for k, _, _ in peers], senders, inbox, timeout_s)

    def combine(self, norm: torch.Tensor, step: int, loss_scale: float) -> torch.Tensor:
        """The pipeline's norm (scaled as DeepSpeed's ``norm`` is) from this stage's."""
        value = float(norm)
        own = value / loss_scale if value >= 0 and math.isfinite(value) else -1.0
        self.stage_norm = own if own >= 0 else math.inf
        if not self.peers:
            self.global_norm = self.stage_norm
            return norm
        parts = {self.hold: own, **self._swap(step, own)}
        if any(v < 0 or not math.isfinite(v) for v in parts.values()):
            self.global_norm = math.inf
            return torch.full_like(norm, -1.0)  # DeepSpeed's invalid-norm sentinel
        total = math.sqrt(sum(parts[h] ** 2 for h in sorted(parts)))
        self.global_norm = total
        return torch.full_like(norm, total * loss_scale)

    def _swap(self, step: int, own: float) -> dict[tuple[int, int], float]:
        payload = torch.tensor([*self.hold, own], dtype=torch.float32)
        key = (NORM_KIND, step, self.stage)
        for s in self.senders:
            s.send(key, payload, stream="norm")
        out: dict[tuple[int, int], float] = {}
        for k in self.peers:
            got = self.inbox.get((NORM_KIND, step, k), timeout=self.timeout_s)
            out[(int(got[0]), int(got[1]))] = float(got[2])
        return out

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self.senders = []


def install_global_norm(optimizer: Any, owner: Any) -> None:
    """Make DeepSpeed's ZeRO optimizer clip and report with the pipeline's norm: its
    ``scaled_global_norm`` (called once per step, before the clip) goes through
    ``owner.norms.combine`` with the step being taken (``owner.step_count``)."""
    local = optimizer.scaled_global_norm

    def scaled_global_norm(norm_type: int = 2) -> torch.Tensor:
        norm = local(norm_type)
        return owner.norms.combine(norm, owner.step_count, float(optimizer.loss_scale))

    optimizer.scaled_global_norm = scaled_global_norm
