"""The receiving end of the direct data plane: frames from a peer's
:class:`~geopipe.transport.direct.DirectSender`, checked and filed in an inbox.

The frame format, and why one TCP stream, are in :mod:`geopipe.transport.direct`. A
connection reaches a reader thread only through the listener's gate (:mod:`.gate`: the
run's handshake, without a thread per pending connection); each frame's header is then
checked before its payload is allocated (`frames.read_frame`), against the plan's
expectations when the runtime gives them (``expect``, :mod:`.expect`). Anything a reader
thread cannot attribute to one key fails the inbox at once, naming the peer and the cause:
a consumer must never wait out its receive timeout for a reader that died.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Hashable
from typing import Any

from geopipe.transport.expect import ExpectedFrames, all_finite
from geopipe.transport.frames import (
    Admit,
    FrameInfo,
    FrameRefusedError,
    StreamCorruptError,
    read_frame,
)
from geopipe.transport.gate import Gate
from geopipe.transport.link import DuplicateKeyError
from geopipe.transport.rejects import RejectLog
from geopipe.transport.seal import CorruptPayloadError, Sealed
from geopipe.transport.security import RunCredentials, link_id
from geopipe.transport.sockets import advertised_host, shutdown_socket, tune_stream

__all__ = ["USER_TIMEOUT_S", "DirectReceiver", "NonFiniteError"]

# Sends that take longer than this without the peer acknowledging anything fail the
# connection (TCP_USER_TIMEOUT): a vanished host must not block flush() for ~15 minutes of
# TCP retransmissions.
USER_TIMEOUT_S = 30.0


class NonFiniteError(CorruptPayloadError):
    """A frame held NaN or inf where the plan expects finite values."""


class DirectReceiver:
    """Listens for a peer's `DirectSender` and files its messages in ``inbox``.

    The gate authenticates connections; one thread per authenticated connection reads
    frames in order, verifies them and calls ``inbox.deliver_sealed``, which never blocks:
    with link emulation the inbox holds a message back until its stamped delivery time while
    this thread keeps reading. A replaced sender simply connects again. ``inbox`` and
    ``expect`` may be swapped between iterations.

    ``expect`` (an `ExpectedFrames`, or any callable that raises `FrameRefusedError`)
    refuses frames the plan does not expect: the refusal is logged once per 30 s with the
    peer (``refused``), the connection dropped and the inbox failed with a message naming
    the peer. ``rejected`` counts connections refused at the gate (strangers).
    """

    def __init__(
        self,
        inbox: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        creds: RunCredentials | None = None,
        max_payload: int | None = None,
        user_timeout_s: float = USER_TIMEOUT_S,
        expect: Admit | None = None,
    ) -> None:
        self.inbox = inbox
        self.user_timeout_s = user_timeout_s  # keep-alive failure: longer than an outage
        # Stream-level problems (a peer lost mid-frame, a corrupt header), for diagnostics.
        self.errors: list[BaseException] = []
        self.messages = 0
        self.creds = creds  # None: no handshake (tests and benchmarks inside one process)
        self.max_payload = max_payload
        self.expect = expect
        self.rejected = RejectLog("data-plane receiver")
        self.refused = RejectLog("data-plane receiver, frames of the run refused")
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        listener = socket.create_server((host, port), backlog=128)
        bound_host, bound_port = listener.getsockname()[:2]
        self.address: tuple[str, int] = (advertise_host or advertised_host(bound_host), bound_port)
        self.link = link_id(self.address)
        self.gate = Gate(
            listener, creds, self.link, self._start_reader, self.rejected, name="direct-accept"
        )

    def _start_reader(self, conn: socket.socket, peer: tuple) -> None:
        """The gate's hand-over (on its thread): one reader thread per connection."""
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        threading.Thread(
            target=self._serve, args=(conn, peer), name="direct-recv", daemon=True
        ).start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        try:
            tune_stream(conn, self.user_timeout_s)
            self._read(conn, peer)
        except FrameRefusedError as exc:  # a run peer's frame the plan does not expect
            self._fail(StreamCorruptError(f"refused a frame from peer {peer}: {exc}"), peer)
        except StreamCorruptError as exc:
            # From an authenticated peer of this run: a real fault of the link or the peer.
            self._fail(StreamCorruptError(f"from peer {peer}: {exc}"), peer)
        except OSError as exc:  # peer lost mid-frame, or close(): the runtime decides
            with self._lock:
                if not self._closed:
                    self.errors.append(exc)
        except Exception as exc:  # anything no check anticipated: fail now, not at a timeout
            err = StreamCorruptError(f"reader of peer {peer} failed: {type(exc).__name__}: {exc}")
            self._fail(err, peer)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _read(self, conn: socket.socket, peer: tuple) -> None:
        expect = 0
        while True:
            frame = read_frame(conn, self.max_payload, self._admit)
            if frame is None:
                return  # the sender closed cleanly
            key, seq, sealed, deliver_at, sent_at = frame
            if seq != expect:
                raise StreamCorruptError(f"frame {seq} arrived, expected {expect}")
            expect += 1
            self._file(key, sealed, deliver_at, sent_at, peer)

    def _admit(self, info: FrameInfo) -> None:
        """The check of ``expect`` as it is when the frame's header is in: a read blocks
        waiting for the next frame, and the plan may have been swapped meanwhile."""
        expect = self.expect
        if expect is not None:
            expect(info)

    def _fail(self, err: StreamCorruptError, peer: tuple) -> None:
        """Nothing after this point of the stream can be attributed or trusted: every wait
        on the inbox raises ``err`` (the connection is dropped by the caller)."""
        self.inbox.fail(err)  # first: whoever sees ``errors`` must find the inbox failed
        self.errors.append(err)
        self.refused.reject(peer, err)

    def _file(
        self, key: Hashable, sealed: Sealed, deliver_at: float, sent_at: float, peer: tuple
    ) -> None:
        inbox = self.inbox
        expect = self.expect
        finite = isinstance(expect, ExpectedFrames) and expect.wants_finite(key)
        if finite and not all_finite(sealed.enc):
            err = NonFiniteError(f"message {key!r} from peer {peer} holds NaN or inf")
            _refuse_key(inbox, key, err)  # the stream is sound: only this key fails
            self.errors.append(err)
            self.refused.reject(peer, err)
            return
        try:
            # files a CorruptPayloadError itself
            inbox.deliver_sealed(key, sealed, deliver_at, sent_at)
            self.messages += 1
        except DuplicateKeyError:
            # Which of the two is genuine cannot be told (one may have come early under a
            # future key): the consumer gets an error for the key, never either payload.
            err = CorruptPayloadError(
                f"message {key!r}: a second frame for it arrived (from peer {peer})"
            )
            _refuse_key(inbox, key, err)
            self.errors.append(err)
            self.refused.reject(peer, err)
        except Exception as exc:  # e.g. metadata the codec cannot decode
            _refuse_key(inbox, key, CorruptPayloadError(f"message {key!r} from peer {peer}: {exc}"))
            self.errors.append(exc)

    def close(self) -> None:
        """Stop listening and drop every connection (the inbox is the caller's to close)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        self.gate.close()
        for c in conns:
            shutdown_socket(c)


def _refuse_key(inbox: Any, key: Hashable, err: BaseException) -> None:
    """File ``err`` for ``key`` in place of anything held for it (`Inbox.refuse`); an inbox
    without that (the outer loop's) is failed whole rather than left holding either."""
    refuse = getattr(inbox, "refuse", None)
    try:
        if refuse is not None:
            refuse(key, err)
        else:
            inbox.deliver_error(key, err)
    except Exception:  # a key already held: nothing held for it may be trusted
        inbox.fail(err)
