"""User-space WAN emulator: paces messages on a link and holds them back until they are due.

The sender side calls `LinkEmulator.stamp(nbytes)` when it hands a message to the link and
ships the returned delivery time with the bytes over the real (fast, local) transport. The
receiving transport thread puts the message into a `DelayedMailbox`, which releases it to the
consumer only once `time.monotonic()` reaches that delivery time. Splitting it this way keeps
the transport draining at full speed while data is held back, so emulated slowness never
turns into real back-pressure or head-of-line blocking in the local transport.

Both sides compare `time.monotonic()` values, which on Linux is the system-wide
CLOCK_MONOTONIC, so sender and receiver may be different processes on one host.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PACKET_BYTES",
    "DelayedMailbox",
    "DuplicateKeyError",
    "LinkEmulator",
    "LinkParams",
    "MailboxClosedError",
]

# Granularity of loss: a lost packet of this size is re-sent.
PACKET_BYTES = 64 * 1024

# Below this much remaining time, `DelayedMailbox.get` busy-waits instead of sleeping, since a
# condition wait can overshoot by tens of microseconds to a millisecond.
_SPIN_S = 1e-3


@dataclass(frozen=True)
class LinkParams:
    """One direction of a WAN link: bandwidth (bit/s), one-way latency (s), packet loss."""

    bandwidth_bps: float
    latency_s: float
    loss: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps must be > 0, got {self.bandwidth_bps}")
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")


def _binomial(rng: random.Random, n: int, p: float) -> int:
    """Sample Binomial(n, p) by jumping between successes (O(n*p) draws, not O(n)).

    Python 3.11 has no `random.binomialvariate`; gaps between successes are geometric.
    """
    if n <= 0 or p <= 0.0:
        return 0
    log_q = math.log1p(-p)
    count = 0
    pos = 0
    while True:
        # 1 - random() lies in (0, 1], so the log is finite.
        pos += int(math.log(1.0 - rng.random()) / log_q) + 1
        if pos > n:
            return count
        count += 1


class LinkEmulator:
    """One direction of one link: a zero-burst token bucket plus latency and lossy retries.

    Messages are serialised one after another (a message handed over while the link is busy
    waits for it), so messages from one sender on one link are delivered in FIFO order.
    """

    def __init__(self, params: LinkParams) -> None:
        self.params = params
        self._rng = random.Random(params.seed)
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def _serialisation_s(self, nbytes: int) -> float:
        """Time to push `nbytes` through the link, including re-sends of lost packets.

        Every lost packet is re-sent and may be lost again, so each packet is transmitted a
        geometric number of times and the mean is nbytes*8/bandwidth/(1-loss), exactly as in
        `wire.transfer_time`. Re-sends are charged at the average packet size of the message.
        """
        base = nbytes * 8 / self.params.bandwidth_bps
        if self.params.loss == 0.0 or nbytes == 0:
            return base
        packets = math.ceil(nbytes / PACKET_BYTES)
        resent = 0
        lost = _binomial(self._rng, packets, self.params.loss)
        while lost:
            resent += lost
            lost = _binomial(self._rng, lost, self.params.loss)
        return base * (1.0 + resent / packets)

    def stamp(self, nbytes: int, now: float | None = None) -> float:
        """Reserve the link for a message handed over at `now`; return its delivery time.

        Times are on the `time.monotonic()` clock; `now` defaults to the current time.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            if now is None:
                now = time.monotonic()
            start = max(now, self._busy_until)
            self._busy_until = start + self._serialisation_s(nbytes)
            return self._busy_until + self.params.latency_s

    @property
    def busy_until(self) -> float:
        """When the link finishes serialising everything handed to it so far."""
        with self._lock:
            return self._busy_until


class MailboxClosedError(RuntimeError):
    """Raised by `DelayedMailbox.get` once the mailbox is closed (shutdown)."""


class DuplicateKeyError(ValueError):
    """A message was put under a key that already holds one."""


class DelayedMailbox:
    """Receiving side: holds delivered messages until their emulated delivery time.

    `put` is called by the transport thread and never blocks; `get` blocks the consumer until
    the message for a key is both present and due.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[Any, tuple[Any, float]] = {}
        self._closed = False

    def put(self, key: Any, payload: Any, deliver_at: float, replace: bool = False) -> None:
        """Store a message that becomes visible at `deliver_at` (monotonic clock).

        Returns immediately so the transport keeps draining. Messages put after `close()` are
        dropped: at shutdown nobody will read them. `None` payloads are rejected because
        `poll` uses `None` to mean "not ready". A key already held raises
        `DuplicateKeyError`, unless ``replace`` (a failure filed in place of a message).
        """
        if payload is None:
            raise ValueError("payload must not be None")
        with self._cond:
            if self._closed:
                return
            if key in self._items and not replace:
                raise DuplicateKeyError(f"duplicate message key {key!r}")
            self._items[key] = (payload, deliver_at)
            self._cond.notify_all()

    def poll(self, key: Any) -> Any | None:
        """Take the message for `key` if it is present and due, else return None."""
        with self._cond:
            if self._closed:
                raise MailboxClosedError("mailbox is closed")
            item = self._items.get(key)
            if item is None or time.monotonic() < item[1]:
                return None
            del self._items[key]
            return item[0]

    def get(self, key: Any, timeout: float | None = None) -> Any:
        """Block until the message for `key` is present and due, then take it.

        Sleeps on the condition for the remaining time and busy-waits only for the final
        millisecond, for sub-millisecond accuracy without burning a core.
        Raises `TimeoutError` after `timeout` seconds and `MailboxClosedError` on close.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise MailboxClosedError(f"mailbox closed while waiting for {key!r}")
                now = time.monotonic()
                item = self._items.get(key)
                if item is not None and now >= item[1]:
                    del self._items[key]
                    return item[0]
                if deadline is not None and now >= deadline:
                    state = (
                        "never arrived"
                        if item is None
                        else f"arrived but is due {item[1] - now:.3f}s later"
                    )
                    raise TimeoutError(
                        f"message {key!r} not delivered within {timeout}s (it {state})"
                    )
                if item is None:
                    wait = None
                else:
                    remaining = item[1] - now
                    if remaining <= _SPIN_S and (deadline is None or item[1] <= deadline):
                        # Release the lock while spinning so the transport can keep putting.
                        self._cond.release()
                        try:
                            while time.monotonic() < item[1]:
                                pass
                        finally:
                            self._cond.acquire()
                        continue
                    wait = max(remaining - _SPIN_S, 0.0)
                if deadline is not None:
                    wait = deadline - now if wait is None else min(wait, deadline - now)
                self._cond.wait(wait)

    def close(self) -> None:
        """Wake every blocked getter with `MailboxClosedError` and drop held messages."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """Whether `close()` has been called."""
        with self._cond:
            return self._closed

    def __len__(self) -> int:
        """Messages held (due or not), for diagnostics."""
        with self._cond:
            return len(self._items)
