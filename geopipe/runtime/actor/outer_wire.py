"""The outer loop's exchange between replica groups, over the run's direct data plane.

Each stage replica sends the encoded pseudo-gradient of its ZeRO-1 partition to its *peers*
(the replicas holding the same stage and partition in the other groups) and receives theirs
(:mod:`geopipe.runtime.actor.outer`). The bytes go over the same authenticated, encrypted
TCP streams as the activations (:mod:`geopipe.transport.direct`): never gloo or TCPStore
across sites (unauthenticated), never Ray's object store (bulk bytes on the control plane,
several round trips per transfer over a long link). Ray only carries the listener's
address.

Why not :class:`~geopipe.transport.direct.DirectSender` itself: it encodes what it sends
with the link's own codec, and the outer loop must send bytes it has *already* encoded, the
same bytes to every peer, so that every group averages identical payloads
(:mod:`geopipe.outer.exchange`). :class:`EncodedSender` is the direct channel's frame
(:func:`~geopipe.transport.frames.encode_frame`, the codec seal, the run's handshake and TLS
records, the link emulator's delivery stamp) written for a pre-encoded payload; the receiving
side is the direct channel's own :class:`~geopipe.transport.direct.DirectReceiver` (its
handshake, payload bound and checks) filing into an :class:`EncodedInbox`, which keeps the
verified payload encoded instead of decoding it; it takes only the frames the replica's
partition layout lets its peers send (:class:`OuterFrames`), refusing the rest before
anything is allocated.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from geopipe.outer import ROW_LEN
from geopipe.transport import wire
from geopipe.transport.codec import CorruptPayloadError, Encoded, Sealed, open_sealed, seal
from geopipe.transport.dial import DialError, dial
from geopipe.transport.direct import CONGESTION, DirectReceiver, PeerLostError
from geopipe.transport.frames import (
    FrameInfo,
    FrameRefusedError,
    encode_frame,
    key_to_json,
    sendmsg_all,
)
from geopipe.transport.link import DelayedMailbox, LinkEmulator, LinkParams
from geopipe.transport.security import (
    HandshakeError,
    RunCredentials,
    TlsSealer,
)
from geopipe.transport.sockets import shutdown_socket, tune_stream

__all__ = [
    "CHUNK_ELEMS",
    "EncodedInbox",
    "EncodedSender",
    "OuterExchange",
    "OuterFrames",
    "OuterPeer",
    "OuterSettings",
]

CHUNK_ELEMS = ROW_LEN * 4096  # elements per frame: 4 MiB with codec none
_POLL_S = 0.1  # a gather's waits are cut this short so that a drop ends them soon


@dataclass(frozen=True)
class OuterSettings:
    """The outer optimizer and exchange of one run (``plan.outer`` once chosen): plain data
    the driver sends every actor. ``timeout_s``: how long an apply waits for a peer's payload
    (the driver passes ``health.wan_outage_s``); ``seed``: the run's, for codec seeds."""

    lr: float = 0.7
    momentum: float = 0.9
    fragments: int = 1
    codec: str = "none"
    topk_ratio: float = 0.01
    timeout_s: float = 600.0
    chunk_elems: int = CHUNK_ELEMS
    seed: int = 0

    def __post_init__(self) -> None:
        if self.codec not in wire.CODECS:
            raise ValueError(f"outer codec {self.codec!r} is not one of {wire.CODECS}")
        if self.chunk_elems < ROW_LEN or self.chunk_elems % ROW_LEN:
            raise ValueError(
                f"chunk_elems must be a positive multiple of {ROW_LEN}, got {self.chunk_elems}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def max_payload(self) -> int:
        """The largest frame an outer listener accepts: a chunk in fp32 twice over (top-k at
        a high ratio sends 6 bytes an element) plus 1 MiB."""
        return 8 * self.chunk_elems + (1 << 20)


@dataclass(frozen=True)
class OuterPeer:
    """A replica of another group holding the same (stage, ZeRO-1 partition) as this one:
    its group id, its outer listener, its partition layout's digest (must equal ours) and,
    on an emulated WAN, the link to it (None: the network is real)."""

    group: int
    address: tuple[str, int]
    layout: str
    link: LinkParams | None = None


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class OuterFrames:
    """The frames an outer listener takes (issue 33's frame plan, for the outer exchange):
    called with each frame's header on the reader's thread, before its payload is
    allocated, it raises `FrameRefusedError` for anything else, and the receiver drops
    that connection (see `EncodedInbox` for what the exchange does then).

    Every group splits its stages and ZeRO-1 partitions alike (the layout digest), so this
    replica knows every frame its peers may send: key ``("O", stage, partition, fragment,
    round, group, chunk)`` with ``tag = ("O", stage, partition)``, a fragment of
    ``fragment_numels``, a chunk of it (``chunk_elems`` each), the group of a connected,
    not dropped peer (``peers``, kept by `OuterExchange`) and a round that is this
    replica's own for the fragment (``round_of``) or the next (a peer one apply ahead: it
    cannot get two ahead, its next round needs this one's payload); shaped as
    `~geopipe.outer.exchange.encode_delta` rows, float32, the run's codec, and exactly the
    chunk's `wire.wire_bytes`. :mod:`geopipe.transport.expect`'s `ExpectedFrames` checks
    one window of steps for a kind and a set of shapes: the outer keys need a window per
    fragment and a size per chunk, hence this class."""

    def __init__(
        self,
        settings: OuterSettings,
        tag: tuple,
        fragment_numels: Sequence[int],
        round_of: Callable[[int], int],
    ) -> None:
        self.settings, self.tag, self.round_of = settings, tuple(tag), round_of
        size = settings.chunk_elems
        self.chunks = [  # per fragment, per chunk: its element count
            [min(size, n - s) for s in range(0, n, size)] or [0] for n in fragment_numels
        ]
        self.peers: frozenset[int] = frozenset()

    def __call__(self, info: FrameInfo) -> None:
        reason = self.why_not(info)
        if reason is not None:
            raise FrameRefusedError(f"outer frame {info.key!r} not expected: {reason}")

    def why_not(self, info: FrameInfo) -> str | None:
        """Why ``info`` is not an outer frame this replica expects, or None if it is."""
        key, n = info.key, len(self.tag)
        if not (isinstance(key, tuple) and len(key) == n + 4 and key[:n] == self.tag):
            return f"not a key {self.tag} + (fragment, round, group, chunk)"
        fragment, round_, group, chunk = key[n:]
        if any(type(k) is not int for k in key[n:]):
            return "fragment, round, group and chunk must be integers"
        if not 0 <= fragment < len(self.chunks):
            return f"no fragment {fragment} (of {len(self.chunks)})"
        if not 0 <= chunk < len(self.chunks[fragment]):
            return f"fragment {fragment} has no chunk {chunk} ({len(self.chunks[fragment])})"
        if group not in self.peers:
            return f"group {group} is not a connected peer ({sorted(self.peers)})"
        now = self.round_of(fragment)
        if not now <= round_ <= now + 1:
            return f"round {round_} of fragment {fragment}, expected {now} or {now + 1}"
        return self._wrong_payload(info, self.chunks[fragment][chunk])

    def _wrong_payload(self, info: FrameInfo, numel: int) -> str | None:
        s = self.settings
        shape = (-(-numel // ROW_LEN), ROW_LEN)
        nbytes = wire.wire_bytes(s.codec, shape[0] * ROW_LEN, ROW_LEN, 4, "backward", s.topk_ratio)
        if info.codec != s.codec:
            return f"codec {info.codec}, expected {s.codec}"
        if info.dtype != "float32" or info.direction != "backward":
            return f"{info.dtype} {info.direction}, expected float32 backward"
        if info.shape != shape:
            return f"shape {list(info.shape)}, expected {list(shape)}"
        if info.payload_nbytes != nbytes:
            return f"{info.payload_nbytes} payload bytes, expected {nbytes}"
        return None


class EncodedInbox:
    """Where a :class:`DirectReceiver` files the peers' payloads: verified against their
    seal, kept *encoded* (the average decodes every group's payload itself, in group order),
    and held until their emulated delivery time.

    A stream the receiver failed (a corrupt frame, or one `OuterFrames` refused: that
    connection is dropped) does not close the inbox: its failure cannot be pinned on a group
    (a peer's frame may claim any key), the other peers' payloads keep arriving, and the
    same peer may connect again. A plain :meth:`get` raises the failure at once;
    :meth:`OuterExchange.gather` waits past it (``strict=False``), so a peer that sent
    garbage is only missing when the wait (``health.wan_outage_s``) ends, and the driver's
    group-loss path decides, with the failure named in why it is missing."""

    def __init__(self) -> None:
        self._box = DelayedMailbox()
        self._error: BaseException | None = None
        self.failures: list[BaseException] = []  # the latest few, for the missing reason

    def deliver_sealed(
        self, key: Hashable, sealed: Sealed, deliver_at: float, sent_at: float = 0.0
    ) -> None:
        try:
            self._box.put(key, open_sealed(sealed), deliver_at)
        except CorruptPayloadError as exc:
            self._box.put(key, _Failed(exc), 0.0)

    def deliver_error(self, key: Hashable, error: BaseException) -> None:
        self._box.put(key, _Failed(error), 0.0)

    def fail(self, error: BaseException) -> None:
        """A stream broke in a way no key can be blamed for (see the class's note)."""
        self._error = error
        self.failures = [*self.failures[-3:], error]

    def get(self, key: Hashable, timeout: float | None, strict: bool = True) -> Encoded:
        """The payload of ``key``; ``strict``: a failed stream's error is raised at once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if strict and self._error is not None:
                raise self._error
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = left if not strict else (_POLL_S if left is None else min(_POLL_S, left))
            try:
                item = self._box.get(key, timeout=wait)
                break
            except TimeoutError:
                if not strict or (left is not None and left <= 0):
                    raise
        if isinstance(item, _Failed):
            raise item.error
        return item

    def close(self) -> None:
        self._box.close()


class EncodedSender:
    """One authenticated connection to a peer's outer listener; writes pre-encoded payloads
    as direct-channel frames, in order, on the calling thread (the exchange runs each peer's
    sends on a thread of its own)."""

    def __init__(
        self,
        address: tuple[str, int],
        creds: RunCredentials | None,
        link: LinkParams | None = None,
        user_timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
    ) -> None:
        self.address = tuple(address)
        self._emulator = LinkEmulator(link) if link is not None else None
        self._lock = threading.Lock()
        self._seq = 0
        self.bytes_written = 0
        self._sock, self._tls = _connect(self.address, creds, connect_timeout_s)
        tune_stream(self._sock, user_timeout_s)

    def send(self, key: Hashable, enc: Encoded) -> int:
        """Write one payload's frame; returns the bytes written. Raises PeerLostError."""
        key_to_json(key)
        with self._lock:
            sent_at = time.monotonic()
            deliver_at = 0.0
            if self._emulator is not None:
                deliver_at = self._emulator.stamp(enc.payload_nbytes, sent_at)
            bufs = encode_frame(key, seal(enc), self._seq, deliver_at, sent_at)
            if self._tls is not None:
                bufs = self._tls.seal(bufs)
            try:
                n = sendmsg_all(self._sock, bufs)
            except OSError as exc:
                raise PeerLostError(f"outer exchange to {self.address} failed: {exc}") from exc
            self._seq += 1
            self.bytes_written += n
            return n

    def close(self) -> None:
        shutdown_socket(self._sock)


def _connect(
    address: tuple[str, int], creds: RunCredentials | None, timeout_s: float
) -> tuple[socket.socket, TlsSealer | None]:
    """Connect and pass the run's handshake through the data plane's one dialer
    (:func:`geopipe.transport.dial.dial`: tried again with backoff while the listener is not
    up yet or sheds the connection, never after a refusal)."""
    try:
        sock, tls = dial(address, creds, timeout_s, sealed=True, congestion=CONGESTION)
    except (DialError, HandshakeError, OSError) as exc:
        raise PeerLostError(f"cannot connect to outer peer {address}: {exc}") from exc
    sock.settimeout(None)
    return sock, tls


class OuterExchange:
    """This replica's outer listener and its connections to its peers.

    ``post`` sends this replica's chunks of one (fragment, round) to every peer on
    background threads (one per peer) and returns at once, so a streaming fragment's
    transfer overlaps the inner steps that follow; ``collect`` joins those sends and waits
    for every peer's chunks. Keys are ``(tag, group, chunk)`` where ``tag`` names the
    stage, partition, fragment and round, so a late or early payload cannot be mistaken
    for another round's."""

    def __init__(
        self,
        host: str,
        advertise_host: str,
        creds: RunCredentials | None,
        max_payload: int,
        user_timeout_s: float,
    ) -> None:
        self.creds = creds
        self.user_timeout_s = user_timeout_s
        self.inbox = EncodedInbox()
        self.receiver = DirectReceiver(
            self.inbox,
            host=host,
            advertise_host=advertise_host,
            creds=creds,
            max_payload=max_payload,
            user_timeout_s=user_timeout_s,
        )
        self.address = self.receiver.address
        self.peers: dict[int, OuterPeer] = {}
        self._senders: dict[int, EncodedSender] = {}
        self._posts: list[tuple[int, threading.Thread, list[Any]]] = []
        self._dropped: set[int] = set()  # groups written off: never waited for again
        self.frames: OuterFrames | None = None

    def expect(self, frames: OuterFrames) -> None:
        """Take only ``frames``' frames from now on (checked before allocation)."""
        self.frames = frames
        self._peers_changed()
        self.receiver.expect = frames

    def _peers_changed(self) -> None:
        if self.frames is not None:
            self.frames.peers = frozenset(g for g in self.peers if g not in self._dropped)

    def connect(self, peers: Sequence[OuterPeer]) -> None:
        """(Re)connect to ``peers`` (drops connections to groups no longer listed)."""
        for s in self._senders.values():
            s.close()
        self._senders, self.peers = {}, {}
        self._dropped -= {p.group for p in peers}  # a group grown back is waited for again
        for p in peers:
            self._senders[p.group] = EncodedSender(
                p.address, self.creds, p.link, user_timeout_s=self.user_timeout_s
            )
            self.peers[p.group] = p
        self._peers_changed()

    def post(self, tag: tuple, group: int, chunks: Sequence[Encoded]) -> None:
        """Send ``chunks`` (this replica's payload, from group ``group``) to every peer."""
        for g, sender in sorted(self._senders.items()):
            box: list[Any] = []

            def run(sender: EncodedSender = sender, box: list[Any] = box) -> None:
                try:
                    box.append(
                        sum(sender.send((*tag, group, c), enc) for c, enc in enumerate(chunks))
                    )
                except BaseException as exc:  # surfaced by collect(), naming the peer
                    box.append(exc)

            t = threading.Thread(target=run, name=f"outer-send-{g}", daemon=True)
            t.start()
            self._posts.append((g, t, box))

    def drop(self, groups: Sequence[int]) -> None:
        """Stop exchanging with ``groups`` (the driver wrote them off): their connections
        close, and a :meth:`gather` waiting on them now, on another thread, stops waiting.
        [Note: a round over the survivors] in :mod:`geopipe.runtime.actor.outer`."""
        for g in groups:
            self._dropped.add(g)
            sender = self._senders.pop(g, None)
            if sender is not None:
                sender.close()
            self.peers.pop(g, None)
        self._peers_changed()

    def gather(
        self, tag: tuple, chunks: int, timeout_s: float
    ) -> tuple[dict[int, list[Encoded]], dict[int, str], int]:
        """Every peer's ``chunks`` payload chunks of ``tag`` that arrive within ``timeout_s``
        (by group), why each other peer's did not (by group: its send failed, it was
        dropped, or it stayed silent), and the bytes this replica sent for ``tag``. Raises
        nothing for a missing peer: the driver decides who a round averages over."""
        deadline = time.monotonic() + timeout_s
        sent, missing = 0, {}
        posts, self._posts = self._posts, []
        for g, t, box in posts:
            while t.is_alive() and g not in self._dropped and time.monotonic() < deadline:
                t.join(_POLL_S)
            where = f"sending to group {g}"
            if g in self._dropped:
                missing[g] = "dropped"
            elif t.is_alive() or not box:
                missing[g] = f"{where} took over {timeout_s:g}s"
            elif isinstance(box[0], BaseException):
                missing[g] = f"{where} failed: {box[0]}"
            else:
                sent += box[0]
        got: dict[int, list[Encoded]] = {}
        for g, peer in sorted(dict(self.peers).items()):
            if g in missing:
                continue
            have: list[Encoded] = []
            while len(have) < chunks and g not in self._dropped:
                left = deadline - time.monotonic()
                try:
                    wait = max(0.0, min(_POLL_S, left))
                    have.append(self.inbox.get((*tag, g, len(have)), wait, strict=False))
                except TimeoutError:
                    if left <= 0:
                        break
            if len(have) == chunks:
                got[g] = have
            elif g in self._dropped:
                missing[g] = "dropped"
            else:
                missing[g] = f"no payload from group {g} at {peer.address} in {timeout_s:g}s"
                if self.inbox.failures:  # a peer's frames refused: the likeliest why
                    missing[g] += f" (latest stream failure: {self.inbox.failures[-1]})"
        return got, missing, sent

    def collect(
        self, tag: tuple, chunks: int, timeout_s: float
    ) -> tuple[dict[int, list[Encoded]], int]:
        """:meth:`gather` that insists on every peer: raises naming the first peer whose
        send failed or whose payload did not arrive within ``timeout_s``."""
        got, missing, sent = self.gather(tag, chunks, timeout_s)
        for _, why in sorted(missing.items()):
            if why.startswith("sending") and "failed" in why:
                raise PeerLostError(f"outer exchange: {why}")
            raise TimeoutError(f"outer exchange: {why}")
        return got, sent

    def close(self) -> None:
        for s in self._senders.values():
            s.close()
        self._senders = {}
        self.receiver.close()
        self.inbox.close()
