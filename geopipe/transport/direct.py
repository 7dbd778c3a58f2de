"""Direct cross-site data plane: one-way, in-order, pipelined frames over one TCP stream.

A `DirectSender` writes frames on one TCP connection to the peer's `DirectReceiver` (the
runtime exchanges the receiver's ``address`` over Ray): one-way, pipelined (nothing waits
for an acknowledgement), in order, checksummed, coded. Not Ray's actor calls: above
100 KiB their arguments go through the object store, ~7 one-way latencies per transfer
over a real link. This module knows nothing of Ray. It holds the sending end; the
receiving end is :mod:`.receiver` (re-exported here), whose listener is :mod:`.gate`, and
a sender connects through :mod:`.dial` (retries while a listener is not up or sheds it).

[Note: why one TCP stream, plain sockets]
One stream with kernel buffer autotuning fills 95.9 % of a 200 Mbit/s, 80 ms-RTT link with
4 MiB messages (the IP/TCP headers cap goodput at 96.5 %); striping over 4 streams gains
nothing in steady state and loses at start-up, when the streams overflow the bottleneck's
queue together (`benchmarks/direct_channel.py`). A stream carries at most
``net.ipv4.tcp_wmem[2]`` / RTT: on a faster or longer link raise
``tcp_wmem``/``tcp_rmem`` rather than set SO_SNDBUF/SO_RCVBUF, which switches autotuning
off. With ``net.ipv4.tcp_slow_start_after_idle=0`` a connection idle between steps keeps
its window (97 % of the link after an idle second, against 83 % with the kernel's
default); the test bed sets it and the README tells real clusters to. gloo send/recv
reaches the link rate only with every receive pre-posted at its exact size (37 % posted
one at a time), has no room for the codec header or the key, and cannot be re-made with
one side replaced; blocking sockets with a thread per direction need no event loop.
TCP_NODELAY is on: frames are written whole, and Nagle could only delay a frame's tail.

Frame (little endian)::

    prefix  magic "GPDC" | version u8 | flags u8 | header_len u16 | payload_len u64
            | seq u64 | deliver_at f64 (0 = no emulation) | sent_at f64 | payload_crc u32
            | header_crc u32

``sent_at`` is the sender's ``time.monotonic()`` when the compute thread handed the tensor
over: with the clock offset the launch-time probe measures, the receiver's arrival time
gives each message's real one-way time, which calibration compares with the link model.
    header  header_len bytes of JSON: key, codec, shape, dtype, direction, [array dtype, shape]
    payload the raw bytes of each ``Encoded.arrays`` entry, back to back

``payload_crc`` is the codec seal (`seal.seal`: CRC32 over the codec metadata and the
arrays); ``header_crc`` is a CRC32 over the prefix (up to itself) and the JSON header, checked
before any length in it is trusted. A payload that fails its seal is filed as a failure for its
key, so the consumer gets `CorruptPayloadError` and the stream stays in sync; a header that
fails its CRC cannot be attributed to a key nor skipped, so the connection is dropped and the
inbox is failed as a whole (`Inbox.fail`). Keys are JSON (tuples of str/int/float/bool/None),
never pickle: nothing read from the network is unpickled.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Hashable
from typing import Any

import torch

from geopipe.transport.codec import Encoded, decode, make_codec
from geopipe.transport.dial import DialError, dial
from geopipe.transport.frames import (
    encode_frame,
    key_to_json,
    send_without_waiting,
    sendmsg_all,
)
from geopipe.transport.link import LinkEmulator, LinkParams
from geopipe.transport.receiver import USER_TIMEOUT_S, DirectReceiver
from geopipe.transport.seal import seal
from geopipe.transport.security import ClockSkew, RunCredentials, TlsSealer
from geopipe.transport.sockets import shutdown_socket, tune_stream
from geopipe.transport.wire import direction_codec, wire_bytes

__all__ = ["CONGESTION", "DirectReceiver", "DirectSender", "PeerLostError"]

_USER_TIMEOUT_S = USER_TIMEOUT_S  # the receiver's (:mod:`.receiver`), for the sender too


def relative_error(t: torch.Tensor, enc: Encoded) -> float:
    """How far a message's decoding is from the tensor sent: ||x̂ - x|| / ||x|| (0 for x = 0
    sent exactly). Top-k's error is that of the message, not of the error-fed sum. On the
    host, where the decoding is, whatever device ``t`` is on."""
    x = t.detach().to("cpu", torch.float32).reshape(-1)
    norm = float(x.norm())
    diff = float((decode(enc).reshape(-1) - x).norm())
    return diff / norm if norm > 0 else diff


class PeerLostError(ConnectionError):
    """The connection to the peer failed; queued messages were dropped (not delivered)."""


# --------------------------------------------------------------------------- congestion


# [Note: cubic, not the host's default]
# The senders' congestion control, set per socket. Pipeline traffic is application-limited
# (1F1B sends one message per round trip): BBR's bandwidth estimate decays between messages
# and it paces each one out slower than the link allows — a 128 KiB activation took 51-58 ms
# one way with BBR against 41-42 ms with cubic on the test bed (ideal 47 ms), a step 2.5-2.8 s
# against 2.1 s (`benchmarks/real_wan.py`). Cubic's price is back-to-back bulk: 82 % of the
# link with 4 MiB messages against BBR's 96 % (`benchmarks/direct_channel.py`). "" keeps
# the host's choice.
CONGESTION = "cubic"


# --------------------------------------------------------------------------- sender


class DirectSender:
    """Encode, seal, stamp and write tensors to a peer's `DirectReceiver`.

    Same surface as `channel.WanSender`: ``send`` never waits for the network and returns
    the message's wire bytes. Two background threads form a pipeline: one encodes, seals and
    stamps (with ``link``: the user-space emulator's delivery time, for one-host runs), the
    other writes frames, so encoding message n+1 overlaps writing message n (the codecs, CRC
    and socket calls release the GIL). Nothing is ever acknowledged: a send never waits for
    an earlier one, and ``flush`` returns once every queued frame is in the kernel's send
    buffer.

    [Note: small messages are written inline]
    A message of at most ``INLINE_BYTES`` on the wire, sent while nothing is queued, is
    encoded and handed to the kernel by the calling thread itself (one non-blocking
    ``sendmsg``; whatever the socket buffer does not take goes to the writer thread, in
    order). Through the threads each message costs two hand-offs between Python threads, and
    on a machine whose cores are busy with training each hand-off waits for the GIL and a
    core: over the test bed at zero added latency geopipe's 1F1B runs 1.02× torch's inline
    against 1.10× through the threads (``benchmarks/real_wan.py``). Large messages keep the
    pipeline: their encoding would hold up the compute thread longer than a hand-off costs.
    """

    # Encoded frames waiting for the writer: enough to keep it busy, few enough to bound the
    # memory held twice (tensor and its encoding).
    _MAX_ENCODED = 2
    INLINE_BYTES = 1 << 20
    # A lossy codec's error is measured on the first message and every ERROR_EVERY-th after
    # it (decode what was sent, compare): one decode per 32 messages, on the encoding thread.
    ERROR_EVERY = 32

    def __init__(
        self,
        address: tuple[str, int],
        codec: str,
        direction: str,
        link: LinkParams | None = None,
        topk_ratio: float = 0.01,
        connect_timeout_s: float = 30.0,
        user_timeout_s: float = _USER_TIMEOUT_S,
        creds: RunCredentials | None = None,
        seed: int = 0,
    ) -> None:
        self._creds = creds
        # The receiver's wall clock minus ours, as the latest handshake measured it (None
        # without credentials): for the runtime to report, certificates to be checked by.
        self.clock_skew: ClockSkew | None = None
        codec = direction_codec(codec, direction)  # a boundary's "forward/backward" setting
        self._codec_name = codec
        # seed: the link's Hadamard rotation (int4h, int2h), stable across runs and resumes
        self._codec = make_codec(codec, topk_ratio=topk_ratio, seed=seed)
        self._seed = seed
        self._lossy = codec != "none"
        self._encoded = 0
        # the latest sampled relative error ||decode(encode(x)) - x|| / ||x|| (None: none yet)
        self.codec_error: float | None = None
        self.encode_s = 0.0  # seconds spent encoding (on the encoder thread), cumulative
        self._topk_ratio = topk_ratio
        self._direction = direction
        self._emulator = LinkEmulator(link) if link is not None else None
        self._connect_timeout_s = connect_timeout_s
        self._user_timeout_s = user_timeout_s
        self._cond = threading.Condition()
        self._queue: deque[tuple[Hashable, torch.Tensor, str, float]] = deque()
        self._frames: deque[tuple[list[memoryview], int]] = deque()  # (buffers, generation)
        self._unwritten = 0  # accepted by send(), neither written nor dropped yet
        self._writing = False
        self._inline = False  # the calling thread owns the socket (see the class note)
        self._error: BaseException | None = None
        self._closed = False
        self._gen = 0  # bumped by reconnect(): work of an older connection is dropped
        self._seq = 0
        self.bytes_written = 0
        self.messages = 0
        self.inline_messages = 0  # written (or begun) on the caller's thread
        self.inline_partial = 0  # of those, finished by the writer thread
        self._sock, self._tls = self._connect(address)
        self.address = address
        self._threads = [
            threading.Thread(target=self._encode_loop, name="direct-encode", daemon=True),
            threading.Thread(target=self._write_loop, name="direct-write", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _connect(self, address: tuple[str, int]) -> tuple[socket.socket, TlsSealer | None]:
        """Connect and authenticate, trying again within ``connect_timeout_s`` while the
        receiver is not listening yet or sheds the connection (`dial`)."""
        try:
            sock, tls = dial(
                address,
                self._creds,
                self._connect_timeout_s,
                sealed=True,
                congestion=CONGESTION,
                on_skew=self._measured,
            )
        except DialError as exc:
            raise PeerLostError(str(exc)) from exc
        tune_stream(sock, self._user_timeout_s)
        return sock, tls

    def _measured(self, skew: ClockSkew) -> None:
        self.clock_skew = skew

    def send(self, key: Hashable, tensor: torch.Tensor, stream: str) -> int:
        """Queue one message; returns its bytes on the wire. ``stream`` names the top-k
        error-feedback slot. Raises `PeerLostError` if the connection already failed."""
        key_to_json(key)  # reject unserialisable keys here, not on the thread
        t = tensor.detach()
        nbytes = wire_bytes(
            self._codec_name,
            t.numel(),
            t.shape[-1] if t.dim() else 1,
            t.element_size(),
            self._direction,
            self._topk_ratio,
        )
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise PeerLostError("sender is closed")
            # Inline only when every earlier message is written (none queued, being
            # encoded or written): frames must go out in program order.
            # Both sizes: a top-k or int8 encoding is small, but computing it is not.
            small = max(nbytes, t.numel() * t.element_size()) <= self.INLINE_BYTES
            inline = small and self._unwritten == 0 and not self._inline
            self._unwritten += 1
            if not inline:
                self._queue.append((key, t, stream, time.monotonic()))
                self._cond.notify_all()
                return nbytes
            self._inline = True
            gen, seq, sock, tls = self._gen, self._seq, self._sock, self._tls
            self._seq += 1
        self._write_inline(key, t, stream, (gen, seq, sock, tls))
        return nbytes

    def _write_inline(
        self,
        key: Hashable,
        t: torch.Tensor,
        stream: str,
        conn: tuple[int, int, socket.socket, TlsSealer | None],
    ) -> None:
        """Encode and write one frame on the calling thread; hand the writer what the socket
        did not take. Failures are recorded like the threads' (raised by send/flush)."""
        gen, seq, sock, tls = conn
        rest: list[memoryview] = []
        try:
            bufs = self._encode(key, t, stream, seq, time.monotonic(), tls)
            rest = send_without_waiting(sock, bufs)
        except BaseException as exc:
            self._fail(gen, exc)  # first: the writer must not send a later frame meanwhile
            with self._cond:
                self._inline = False
                self._cond.notify_all()
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and the like are the caller's, not the link's
            return
        with self._cond:
            self._inline = False
            if gen == self._gen and self._error is None:
                total = sum(b.nbytes for b in bufs)
                self.bytes_written += total - sum(b.nbytes for b in rest)
                self.inline_messages += 1
                self.inline_partial += bool(rest)
                if rest:  # before anything the encoder made meanwhile: frames stay in order
                    self._frames.appendleft((rest, gen))
                else:
                    self._unwritten -= 1
                    self.messages += 1
            self._cond.notify_all()

    def _encode(
        self,
        key: Hashable,
        t: torch.Tensor,
        stream: str,
        seq: int,
        sent_at: float,
        tls: TlsSealer | None,
    ) -> list[memoryview]:
        """The frame's buffers as written to the socket (TLS records when encrypted)."""
        t0 = time.perf_counter()
        enc = self._codec.encode(t, key=stream, direction=self._direction)
        self.encode_s += time.perf_counter() - t0
        self._encoded += 1
        if self._lossy and self._encoded % self.ERROR_EVERY == 1:
            self.codec_error = relative_error(t, enc)
        deliver_at = self._emulator.stamp(enc.payload_nbytes, sent_at) if self._emulator else 0.0
        bufs = encode_frame(key, seal(enc), seq, deliver_at, sent_at)
        return tls.seal(bufs) if tls is not None else bufs

    def _fail(self, gen: int, exc: BaseException) -> None:
        """Record the failure of connection ``gen`` and drop everything queued for it."""
        with self._cond:
            if gen != self._gen or self._closed:
                return  # an old connection, torn down on purpose
            if isinstance(exc, OSError) and not isinstance(exc, PeerLostError):
                err = PeerLostError(f"connection to {self.address} failed: {exc}")
                err.__cause__ = exc
                exc = err
            self._error = exc
            self._queue.clear()
            self._frames.clear()
            self._unwritten = 0
            self._cond.notify_all()

    def _encode_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (
                    not self._queue or len(self._frames) >= self._MAX_ENCODED
                ):
                    self._cond.wait()
                if self._closed:
                    return
                key, t, stream, sent_at = self._queue.popleft()
                gen, seq, tls = self._gen, self._seq, self._tls
                self._seq += 1
            try:
                bufs = self._encode(key, t, stream, seq, sent_at, tls)
            except BaseException as exc:  # surfaced to the compute thread on send/flush
                self._fail(gen, exc)
                continue
            with self._cond:
                if gen == self._gen:
                    self._frames.append((bufs, gen))
                    self._cond.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while (not self._frames or self._inline) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                bufs, gen = self._frames.popleft()
                sock = self._sock
                self._writing = True
                self._cond.notify_all()  # room for the encoder
            try:
                n = sendmsg_all(sock, bufs)
            except BaseException as exc:
                self._fail(gen, exc)
            else:
                with self._cond:
                    if gen == self._gen:
                        self._unwritten -= 1
                        self.bytes_written += n
                        self.messages += 1
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> list[Any]:
        """Wait until every queued message is written to the socket (not acknowledged).

        Raises `PeerLostError` if the connection failed and `TimeoutError` after
        ``timeout`` seconds. Returns ``[]`` (`WanSender.flush` returns transport handles).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._unwritten and self._error is None and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self._unwritten} messages unwritten after {timeout}s")
                self._cond.wait(remaining)
            if self._error is not None:
                raise self._error
        return []

    def reconnect(self, address: tuple[str, int]) -> None:
        """Connect to a new receiver (the peer was replaced) and clear a failure.

        Unsent messages are dropped: they belonged to the failed iteration, which the
        runtime replays. Frame numbers restart; the codec state (error feedback) is kept.
        """
        sock, tls = self._connect(address)
        with self._cond:
            old, self._sock, self._tls = self._sock, sock, tls
            self.address = address
            self._gen += 1
            self._seq = 0
            self._queue.clear()
            self._frames.clear()
            self._unwritten = 0
            self._error = None
            self._cond.notify_all()
        shutdown_socket(old)  # unblocks the writer if it was stuck on the old peer

    def close(self) -> None:
        """Stop the threads and drop the connection. Call `flush` first for a graceful end:
        frames already written are still delivered after close."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._frames.clear()
            self._cond.notify_all()
            self._cond.wait_for(lambda: not (self._writing or self._inline), timeout=0.2)
            sock, stuck = self._sock, self._writing
        if stuck:
            shutdown_socket(sock)  # the writer is blocked on a peer that does not read
        else:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)  # FIN after the buffered frames
            sock.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)

    def set_codec(self, codec: str) -> None:
        """Encode what is sent from now on with ``codec`` (a boundary's setting: this
        direction's part is used). Call between iterations, after `flush`: the receiver
        decodes any codec by the name each message carries."""
        codec = direction_codec(codec, self._direction)
        with self._cond:
            if codec == self._codec_name:
                return
            self._codec = make_codec(codec, topk_ratio=self._topk_ratio, seed=self._seed)
            self._codec_name, self._lossy = codec, codec != "none"
            self._encoded, self.codec_error = 0, None

    @property
    def codec(self) -> str:
        return self._codec_name

    def codec_state(self) -> dict:
        return self._codec.state_dict() if hasattr(self._codec, "state_dict") else {}

    def load_codec_state(self, state: dict) -> None:
        if state and hasattr(self._codec, "load_state_dict"):
            self._codec.load_state_dict(state)
