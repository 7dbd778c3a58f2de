"""Asynchronous stage-to-stage channels: intra-site over torch.distributed, inter-site coded.

Every channel has the same shape: ``send(key, tensor)`` returns at once (the transfer
overlaps the compute that follows) and the receiving stage calls ``inbox.get(key)`` right
before the compute that needs the data.

* **Intra-site** (the RDMA-class path): ``torch.distributed`` point-to-point inside the
  site's process group (gloo on CPU, NCCL on GPU). A receiver thread per inbound
  neighbour posts the receives in program order and files each tensor in the inbox, so
  data flows while the stage computes.
* **Inter-site** (:mod:`geopipe.transport.direct`): the tensor is encoded by the link's
  codec, sealed with a checksum and written to a direct TCP connection to the neighbour.
  With link emulation the sender stamps a delivery time from the link's token bucket and
  the receiving inbox holds the data until then, while its transport keeps draining.

A payload whose checksum fails is filed as a failure: the receiver raises
:class:`CorruptPayloadError` instead of training on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from geopipe.transport.codec import decode
from geopipe.transport.link import DelayedMailbox, MailboxClosedError
from geopipe.transport.seal import CorruptPayloadError, Sealed, open_sealed

__all__ = ["Inbox", "P2PReceiver", "P2PSender", "p2p_device"]


def p2p_device(group: Any = None) -> torch.device:
    """Where a point-to-point message on ``group`` (None: the default group) must be: NCCL
    moves CUDA tensors only, on this process's current device (the one DeepSpeed set for
    the engine: a Ray actor sees only its own GPU), gloo host tensors. A receive buffer
    allocated elsewhere fails under NCCL ("No backend type associated with device type
    cpu"), so the receiver allocates here and the sender moves what it is handed here."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class _Failure:
    error: BaseException


class Inbox:
    """Where a stage's inbound activations and gradients wait until they are needed."""

    def __init__(self) -> None:
        self._box = DelayedMailbox()
        # (key, delay) of emulated inter-site messages: how much later than the link model
        # the data became usable (encoding plus real transport beyond the emulated delivery;
        # same-host clocks).
        self.transfers: list[tuple[Hashable, float]] = []
        self._error: BaseException | None = None
        self.decode_s = 0.0  # seconds spent verifying and decoding arrivals, cumulative
        # When each message of a watched kind (``key[0]`` in the set) was in: read off the wire, and
        # not before its emulated delivery time. Stamped on the transport's thread, so a
        # consumer that gets to the message late (a busy host) does not skew the timing.
        self.watched: set[str] = set()
        self.arrived_at: dict[Hashable, float] = {}
        # (key, sent_at on the sender's clock, usable at on this clock) of messages over a
        # real link (no emulated delivery time): calibration turns them into one-way times
        # with the clock offset the launch-time probe measured.
        self.stamped: list[tuple[Hashable, float, float]] = []
        # (called, returned) of each ``get``: a consumer that waited sees a message only
        # once its thread is woken and scheduled, which on a busy host is part of the
        # transfer as the computation experiences it.
        self.got_at: dict[Hashable, tuple[float, float]] = {}

    def deliver_sealed(
        self, key: Hashable, sealed: Sealed, deliver_at: float, sent_at: float = 0.0
    ) -> None:
        """Inter-site arrival (runs on the transport's thread): verify, decode, hold."""
        if self.watched and isinstance(key, tuple) and key[0] in self.watched:
            self.arrived_at[key] = max(time.monotonic(), deliver_at)
        t0 = time.perf_counter()
        try:
            enc = open_sealed(sealed)
            payload: Any = decode(enc)
        except CorruptPayloadError as exc:
            payload = _Failure(exc)
        self.decode_s += time.perf_counter() - t0
        if deliver_at > 0:
            self.transfers.append((key, max(0.0, time.monotonic() - deliver_at)))
        elif sent_at > 0:
            self.stamped.append((key, sent_at, time.monotonic()))
        self._box.put(key, payload, deliver_at)

    def deliver_tensor(self, key: Hashable, tensor: torch.Tensor) -> None:
        self._box.put(key, tensor, 0.0)

    def deliver_error(self, key: Hashable, error: BaseException) -> None:
        self._box.put(key, _Failure(error), 0.0)

    def refuse(self, key: Hashable, error: BaseException) -> None:
        """File ``error`` for ``key`` in place of anything held for it: the consumer gets the
        error, never a message the transport could not vouch for (e.g. one of two frames
        that came under the same key)."""
        self._box.put(key, _Failure(error), 0.0, replace=True)

    def get(self, key: Hashable, timeout: float | None = None) -> torch.Tensor:
        called = time.monotonic()
        try:
            item = self._box.get(key, timeout=timeout)
            self.got_at[key] = (called, time.monotonic())
        except MailboxClosedError:
            if self._error is not None:
                raise self._error from None
            raise
        if isinstance(item, _Failure):
            raise item.error
        return item

    def fail(self, error: BaseException) -> None:
        """Make every waiting and later ``get`` raise ``error``: the transport broke in a way
        no single key can be blamed for (e.g. a corrupt frame header), so nothing held or
        still to come can be trusted."""
        self._error = error
        self._box.close()

    def close(self) -> None:
        self._box.close()


class P2PSender:
    """Non-blocking sends to a rank of the site's process group."""

    def __init__(self, dst: int, group: Any = None) -> None:
        self.dst = dst
        self.group = group
        self._works: list[Any] = []

    def send(self, tag: int, tensor: torch.Tensor) -> None:
        t = tensor.detach().to(p2p_device(self.group)).contiguous()
        self._works.append((dist.isend(t, self.dst, group=self.group, tag=tag), t))

    def wait_all(self) -> None:
        for work, _ in self._works:
            work.wait()
        self._works.clear()


class P2PReceiver:
    """A thread that receives an iteration's messages from one rank in program order."""

    def __init__(self, src: int, inbox: Inbox, group: Any = None) -> None:
        self.src = src
        self.inbox = inbox
        self.group = group
        self._thread: threading.Thread | None = None
        self.busy_s = 0.0

    def start(
        self,
        expected: Sequence[tuple[Hashable, int, tuple[int, ...]]],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Receive ``(key, tag, shape)`` messages of ``dtype`` in this order on a background
        thread, into buffers on the backend's device (:func:`p2p_device`, found here, on
        the caller's thread: a CUDA current device is per thread)."""
        self.join()
        device = p2p_device(self.group)

        def run() -> None:
            for key, tag, shape in expected:
                buf = torch.empty(shape, dtype=dtype, device=device)
                try:
                    t0 = time.perf_counter()
                    dist.recv(buf, self.src, group=self.group, tag=tag)
                    self.busy_s += time.perf_counter() - t0
                except Exception as exc:  # a dead peer: fail the waiting stage, not hang it
                    self.inbox.deliver_error(key, exc)
                    return
                self.inbox.deliver_tensor(key, buf)

        self._thread = threading.Thread(target=run, name=f"p2p-recv-{self.src}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
