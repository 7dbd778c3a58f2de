"""Asynchronous stage-to-stage channels: intra-site over torch.distributed, inter-site coded.

Every channel has the same shape: ``send(key, tensor)`` returns at once (the transfer
overlaps the compute that follows) and the receiving stage calls ``inbox.get(key)`` right
before the compute that needs the data.

* **Intra-site** (the RDMA-class path): ``torch.distributed`` point-to-point inside the
  site's process group (gloo on CPU, NCCL on GPU). A receiver thread per inbound
  neighbour posts the receives in program order and files each tensor in the inbox, so
  data flows while the stage computes.
* **Inter-site**: the tensor is encoded by the link's codec, sealed with a checksum and
  handed to ``post`` (the runtime wires it to the peer actor's ``deliver`` over Ray). With
  link emulation the sender stamps a delivery time from the link's token bucket and the
  receiving inbox holds the data until then, while its transport keeps draining.

A payload whose checksum fails is filed as a failure: the receiver raises
:class:`CorruptPayloadError` instead of training on it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from geopipe.transport.codec import (
    CorruptPayloadError,
    Sealed,
    decode,
    make_codec,
    open_sealed,
    seal,
)
from geopipe.transport.link import DelayedMailbox, LinkEmulator, LinkParams
from geopipe.transport.wire import wire_bytes

__all__ = ["Inbox", "P2PReceiver", "P2PSender", "WanSender"]


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

    def deliver_sealed(self, key: Hashable, sealed: Sealed, deliver_at: float) -> None:
        """Inter-site arrival (runs on the transport's thread): verify, decode, hold."""
        try:
            enc = open_sealed(sealed)
            payload: Any = decode(enc)
        except CorruptPayloadError as exc:
            payload = _Failure(exc)
        if deliver_at > 0:
            self.transfers.append((key, max(0.0, time.monotonic() - deliver_at)))
        self._box.put(key, payload, deliver_at)

    def deliver_tensor(self, key: Hashable, tensor: torch.Tensor) -> None:
        self._box.put(key, tensor, 0.0)

    def deliver_error(self, key: Hashable, error: BaseException) -> None:
        self._box.put(key, _Failure(error), 0.0)

    def get(self, key: Hashable, timeout: float | None = None) -> torch.Tensor:
        item = self._box.get(key, timeout=timeout)
        if isinstance(item, _Failure):
            raise item.error
        return item

    def close(self) -> None:
        self._box.close()


class WanSender:
    """Encode, seal, stamp and post tensors to a stage in another site.

    ``send`` only enqueues: a background thread encodes and posts, so neither the codec nor
    the transport's submission cost sits on the compute thread. With emulation the link's
    token bucket is stamped with the time ``send`` was called: encoding overlaps the
    emulated transmission, as it streams on a real NIC; if encoding (or the real transport)
    takes longer, the data is simply usable later than the stamp.
    """

    def __init__(
        self,
        post: Callable[[Hashable, Sealed, float], Any],
        codec: str,
        direction: str,
        link: LinkParams | None,
        topk_ratio: float = 0.01,
    ) -> None:
        self._post = post
        self._codec_name = codec
        self._codec = make_codec(codec, topk_ratio=topk_ratio)
        self._topk_ratio = topk_ratio
        self._direction = direction
        self._emulator = LinkEmulator(link) if link is not None else None
        self.pending: list[Any] = []
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="wan-send", daemon=True)
        self._thread.start()

    def send(self, key: Hashable, tensor: torch.Tensor, stream: str) -> int:
        """Queue one message; returns its bytes on the wire. ``stream`` names the top-k
        error-feedback slot."""
        if self._error is not None:
            raise self._error
        t = tensor.detach()
        nbytes = wire_bytes(
            self._codec_name, t.numel(), t.shape[-1] if t.dim() else 1, t.element_size(),
            self._direction,
            self._topk_ratio,
        )  # fmt: skip
        self._queue.put((key, t, stream, time.monotonic()))
        return nbytes

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, t, stream, sent_at = item
                enc = self._codec.encode(t, key=stream, direction=self._direction)
                sealed = seal(enc)
                deliver_at = (
                    self._emulator.stamp(enc.payload_nbytes, sent_at) if self._emulator else 0.0
                )
                self.pending.append(self._post(key, sealed, deliver_at))
            except BaseException as exc:  # surfaced to the compute thread on flush/send
                self._error = exc
            finally:
                self._queue.task_done()

    def flush(self) -> list[Any]:
        """Wait until every queued message was posted; returns the transport's handles."""
        self._queue.join()
        if self._error is not None:
            raise self._error
        refs, self.pending = self.pending, []
        return refs

    def close(self) -> None:
        self._queue.put(None)

    def codec_state(self) -> dict:
        return self._codec.state_dict() if hasattr(self._codec, "state_dict") else {}

    def load_codec_state(self, state: dict) -> None:
        if state and hasattr(self._codec, "load_state_dict"):
            self._codec.load_state_dict(state)


class P2PSender:
    """Non-blocking sends to a rank of the site's process group."""

    def __init__(self, dst: int, group: Any = None) -> None:
        self.dst = dst
        self.group = group
        self._works: list[Any] = []

    def send(self, tag: int, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous()
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

    def start(self, expected: Sequence[tuple[Hashable, int, tuple[int, ...]]]) -> None:
        """Receive ``(key, tag, shape)`` messages in this order on a background thread."""
        self.join()

        def run() -> None:
            for key, tag, shape in expected:
                buf = torch.empty(shape, dtype=torch.float32)
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
