"""The data plane's listener: a connection gets a thread only once it has proved the run's
secret, and no stranger can hold the door shut.

[Note: the gate]
Both data-plane servers (:class:`~geopipe.transport.receiver.DirectReceiver`,
:class:`~geopipe.transport.bulk.ChunkServer`) used to give each accepted connection a
thread for its handshake and to cap those at 32, closing the 33rd on arrival: a stranger
holding 32 idle sockets, reopening each one the server closed, left no slot for a peer of
the run. Here one thread per listener accepts every connection and runs every pending
handshake itself, non-blocking (TLS with ``do_handshake_on_connect=False``, the run's
exchange through `security.ServerExchange`); the owner's ``on_ready`` gets a connection
only once it is authenticated. What a stranger can hold is bounded and cheap:

* an idle connection costs a descriptor, no thread; it is shed (reset) after
  ``FIRST_BYTES_S`` without a byte, a handshake after ``HANDSHAKE_S`` in all;
* at most ``MAX_PENDING`` connections wait per listener and ``MAX_PENDING_PER_SOURCE`` per
  source address; an arrival over either bound sheds the oldest connection of its source
  (of the source holding the most, for the listener's bound), idle ones first, instead of
  being refused: a peer's connection sends its hello at once and finishes in a few round
  trips, so it is neither the idle one nor the oldest, while refusing newcomers is exactly
  what let a stranger starve the peer;
* work is rate-limited per source address (`SourceBudget`): each handshake begun costs a
  token (ten with TLS: its key exchange is the one expensive step); a connection over the
  budget waits, unread, for its turn — it is not closed, because a stranger that reopens
  whatever is closed would turn closes into a loop that starves a peer sharing its
  address (a NAT).

A shed connection is reset (SO_LINGER 0) and a refused one closed normally after its input
is drained, so a client (`dial`) tries again after a reset and not after a refusal: a wrong
secret or certificate is not retried into the reject log.

Measured on a 2-core machine shared with other jobs, loopback (``tests/unit/_stranger.py``;
the peer connects, authenticates and sends a frame 20 times): with the old accept path a
stranger holding 32 or 48 idle sockets made every try fail ("peer closed during the
handshake"); through the gate every try succeeded, plain and TLS, with 48 idle sockets, 48
shed every 0.5 s and reopened, 300 (over the per-source bound: the stranger sheds its own),
and 48 handshakes started and left hanging; the peer's connect-and-handshake stayed at its
undisturbed 1.5 ms (plain) and 5-6 ms (TLS) at the median, and the gate thread spent 0.5-7 %
of a core on the strangers. A stranger flooding TLS ClientHellos from 4 threads got 915 key
exchanges a second and 78 % of a core out of the gate without the budget; with it, 17.5 a
second and 2.4 % of a core, while a peer at the same address waited ~0.2 s in the queue
(a peer at another address does not wait: the budgets are per address).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import ssl
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from geopipe.transport.rejects import RejectLog
from geopipe.transport.security import (
    HANDSHAKE_TIMEOUT_S,
    HandshakeError,
    RunCredentials,
    ServerExchange,
    server_context,
    tls_reason,
)

__all__ = ["Gate", "SourceBudget"]

log = logging.getLogger(__name__)

OnReady = Callable[[socket.socket, tuple], None]
_LISTENER, _WAKE = object(), object()
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


class SourceBudget:
    """A token bucket per source address: ``rate`` tokens a second, at most ``burst`` held.
    Buckets that are full again are forgotten once more than ``max_sources`` exist (a full
    bucket is what a new one starts as)."""

    def __init__(self, rate: float, burst: float, max_sources: int = 4096) -> None:
        self.rate, self.burst, self.max_sources = rate, burst, max_sources
        self._tokens: dict[str, tuple[float, float]] = {}  # source -> (tokens, at)

    def _level(self, source: str, now: float) -> float:
        tokens, at = self._tokens.get(source, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def take(self, source: str, cost: float, now: float) -> bool:
        """Spend ``cost`` tokens of ``source`` if it has them."""
        level = self._level(source, now)
        if level < cost:
            return False
        self._tokens[source] = (level - cost, now)
        if len(self._tokens) > self.max_sources:
            self._tokens = {
                s: v for s, v in self._tokens.items() if self._level(s, now) < self.burst
            }
        return True


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    peer: tuple
    born: float
    exchange: ServerExchange | None
    buf: bytearray = field(default_factory=bytearray)
    seen: bool = False  # a byte arrived: not idle any more
    paid: bool = False  # its handshake began (a token spent)
    tls_done: bool = False
    events: int = selectors.EVENT_READ  # 0: parked, not in the selector

    @property
    def source(self) -> str:
        return str(self.peer[0])


class Gate:
    """Accepts on ``listener`` and authenticates each connection on one thread (see the
    module's note); ``on_ready(conn, peer)`` gets each that passed, in blocking mode and
    TLS-wrapped when the run encrypts, on the gate's thread: it must hand it off at once.
    Without ``creds`` (tests inside one process) every connection is ready on arrival."""

    MAX_PENDING = 256
    MAX_PENDING_PER_SOURCE = 64
    FIRST_BYTES_S = 3.0  # a peer's hello follows its connect by half a round trip
    HANDSHAKE_S = HANDSHAKE_TIMEOUT_S
    RATE, BURST = 200.0, 400.0  # handshake tokens per source: 20 TLS handshakes a second
    COST_PLAIN, COST_TLS = 1.0, 10.0

    def __init__(
        self,
        listener: socket.socket,
        creds: RunCredentials | None,
        link: str,
        on_ready: OnReady,
        rejected: RejectLog,
        name: str = "gate",
    ) -> None:
        self.rejected = rejected
        self.shed = 0  # connections reset: idle too long, over a bound, or at close
        self.waited = 0  # connections that waited for their source's budget
        self._listener, self._creds, self._link, self._on_ready = listener, creds, link, on_ready
        self._tls = server_context(creds) if creds is not None and creds.encrypt else None
        self._cost = self.COST_TLS if self._tls is not None else self.COST_PLAIN
        self._budget = SourceBudget(self.RATE, self.BURST)
        self._pending: dict[int, _Pending] = {}  # by descriptor, in arrival order
        self._per_source: Counter[str] = Counter()
        self._parked: deque[_Pending] = deque()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._sel.select(self._timeout()):
                    if key.data is _LISTENER:
                        self._accept_all()
                    elif key.data is _WAKE:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    elif key.data.sock.fileno() in self._pending:
                        self._ready_or_drop(key.data)
                now = time.monotonic()
                self._expire(now)
                self._unpark(now)
        except Exception:  # a bug here must not leave the listener open and deaf
            log.exception("data-plane gate failed; the listener is closed")
        finally:
            self._teardown()

    def _timeout(self) -> float:
        if self._parked:
            return self._cost / self.RATE  # the next token
        if not self._pending:
            return 1.0
        now = time.monotonic()
        return max(0.0, min(min(self._deadline(e) for e in self._pending.values()) - now, 1.0))

    def _deadline(self, e: _Pending) -> float:
        return e.born + (self.HANDSHAKE_S if e.seen else self.FIRST_BYTES_S)

    def _accept_all(self) -> None:
        for _ in range(64):  # then serve the pending ones: the loop must not starve them
            try:
                conn, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._per_source:  # make room, then go on
                        busiest = self._per_source.most_common(1)[0][0]
                        self._shed_oldest(busiest, "out of descriptors")
                    time.sleep(0.01)
                elif exc.errno != errno.ECONNABORTED:
                    raise  # the listener is closed
                return
            if self._creds is None:
                conn.setblocking(True)
                self._hand_over(conn, peer)
                continue
            conn.setblocking(False)
            exchange = ServerExchange(self._creds, self._link)
            self._admit(_Pending(conn, peer, time.monotonic(), exchange))

    def _admit(self, e: _Pending) -> None:
        """Make room (shed the oldest connection of the source over a bound), then wait for
        ``e``: a newcomer is never the one refused."""
        while self._per_source[e.source] >= max(1, self.MAX_PENDING_PER_SOURCE):
            self._shed_oldest(e.source, "too many connections from its address")
        while len(self._pending) >= max(1, self.MAX_PENDING):
            busiest = self._per_source.most_common(1)[0][0]
            self._shed_oldest(busiest, "too many pending connections")
        self._pending[e.sock.fileno()] = e
        self._per_source[e.source] += 1
        self._sel.register(e.sock, selectors.EVENT_READ, e)

    def _shed_oldest(self, source: str, why: str) -> None:
        """Reset the oldest connection of ``source`` that has sent nothing, else its oldest
        (a handshake that outlived its peers': a peer's takes a few round trips)."""
        mine = [e for e in self._pending.values() if e.source == source]
        idle = next((e for e in mine if not e.seen and not _readable(e.sock)), None)
        self._close(idle or mine[0], why, reset=True)

    def _ready_or_drop(self, e: _Pending) -> None:
        try:
            self._ready(e)
        except Exception as exc:  # e.g. a TLS wrap of a socket reset meanwhile
            if e.sock.fileno() in self._pending:
                self._close(e, exc, reset=True)

    def _ready(self, e: _Pending) -> None:
        e.seen = True
        if not e.paid:
            if not self._budget.take(e.source, self._cost, time.monotonic()):
                self._sel.unregister(e.sock)  # parked: read once the source has a token
                e.events = 0
                self._parked.append(e)
                self.waited += 1
                return
            self._begin(e)
        self._advance(e)

    def _begin(self, e: _Pending) -> None:
        """``e`` paid for its handshake: (TLS-wrap and) watch it again."""
        e.paid = True
        if e.events:
            self._sel.unregister(e.sock)
        if self._tls is not None:
            e.sock = self._tls.wrap_socket(e.sock, server_side=True, do_handshake_on_connect=False)
        self._sel.register(e.sock, selectors.EVENT_READ, e)
        e.events = selectors.EVENT_READ

    def _unpark(self, now: float) -> None:
        for _ in range(len(self._parked)):
            e = self._parked.popleft()
            if e.sock.fileno() not in self._pending:
                continue  # shed or expired meanwhile
            if not self._budget.take(e.source, self._cost, now):
                self._parked.appendleft(e)  # in arrival order: the oldest waits first
                return
            try:
                self._begin(e)
            except OSError as exc:
                self._close(e, exc, reset=True)
                continue
            self._advance(e)

    def _expire(self, now: float) -> None:
        for e in [e for e in self._pending.values() if now >= self._deadline(e)]:
            why = "handshake not finished in time" if e.seen else "sent nothing in time"
            self._close(e, why, reset=True)

    # -- one connection's handshake ------------------------------------------------------------

    def _advance(self, e: _Pending) -> None:
        """Take ``e``'s handshake as far as the bytes in hand allow."""
        try:
            if self._tls is not None and not e.tls_done:
                e.sock.do_handshake()  # type: ignore[attr-defined]
                e.tls_done = True
                self._want(e, selectors.EVENT_READ)
            assert e.exchange is not None
            while True:
                data = e.sock.recv(e.exchange.wanted - len(e.buf))
                if not data:
                    raise HandshakeError("peer closed during the handshake")
                e.buf += data
                if len(e.buf) < e.exchange.wanted:
                    continue
                reply, e.buf = e.exchange.take(bytes(e.buf)), bytearray()
                _send_all_now(e.sock, reply)
                if e.exchange.done:
                    return self._promote(e)
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            self._want(e, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            self._want(e, selectors.EVENT_WRITE)
        except HandshakeError as exc:
            self._close(e, exc, reset=False)
        except ssl.SSLError as exc:
            self._close(e, f"TLS: {tls_reason(exc)}", reset=False)
        except OSError as exc:
            self._close(e, exc, reset=True)
        return None

    def _want(self, e: _Pending, events: int) -> None:
        if e.events != events:
            self._sel.modify(e.sock, events, e)
            e.events = events

    def _promote(self, e: _Pending) -> None:
        self._forget(e)
        e.sock.setblocking(True)
        self._hand_over(e.sock, e.peer)

    def _hand_over(self, conn: socket.socket, peer: tuple) -> None:
        try:
            self._on_ready(conn, peer)
        except Exception as exc:  # the owner is closing, or out of threads: drop this one
            log.warning("data-plane gate: could not hand over a connection from %s: %s", peer, exc)
            conn.close()

    def _forget(self, e: _Pending) -> None:
        fd = e.sock.fileno()
        if self._pending.pop(fd, None) is None:
            return
        self._per_source[e.source] -= 1
        if not self._per_source[e.source]:
            del self._per_source[e.source]
        if e.events:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(e.sock)

    def _close(self, e: _Pending, why: object, reset: bool) -> None:
        """Refuse (``reset`` False: drain what it sent, then a normal close) or shed
        (``reset``: a reset, which tells a client to try again) one connection."""
        self._forget(e)
        self.rejected.reject(e.peer, why)
        _close(e.sock, reset)
        self.shed += reset

    def _teardown(self) -> None:
        for e in list(self._pending.values()):
            self._forget(e)
            _close(e.sock, reset=True)
        self._parked.clear()
        with contextlib.suppress(OSError):
            self._sel.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        """Stop accepting and reset every connection still in its handshake."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


def _send_all_now(sock: socket.socket, data: bytes) -> None:
    """Write a 32-byte reply at once: a fresh connection's buffer always takes it, so a
    connection that cannot is one whose peer stopped reading."""
    try:
        if sock.send(data) == len(data):
            return
    except (ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
        pass
    raise ConnectionError("the peer does not read")


def _readable(sock: socket.socket) -> bool:
    """Bytes (or an end of stream) wait on ``sock``: its client is not idle."""
    try:
        return socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return False


def _close(sock: socket.socket, reset: bool) -> None:
    with contextlib.suppress(OSError):
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        else:  # read what the client sent: closing with unread bytes would reset, too
            for _ in range(16):
                if not socket.socket.recv(sock, 65536, socket.MSG_DONTWAIT):
                    break
    with contextlib.suppress(OSError):
        sock.close()
