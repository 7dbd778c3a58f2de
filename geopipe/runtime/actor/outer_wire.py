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
handshake, payload bound and checks; :class:`~.outer_frames.OuterReceiver`) filing into an
:class:`EncodedInbox`, which keeps the verified payload encoded instead of decoding it; it
takes only the frames the replica's partition layout lets its peers send, refusing the rest
before anything is allocated, and only payloads whose values the average can take
(:mod:`.outer_frames`). Each group signs its chunks and a listener files a chunk under group
``g`` only if group ``g``'s key signed it (:meth:`OuterExchange.identify`,
:mod:`.outer_sign`): the run's one secret proves only "a peer of this run".
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from geopipe.outer import ROW_LEN
from geopipe.runtime.actor.outer_frames import (
    MAX_ABS,
    OuterFrames,
    OuterReceiver,
    OuterRefusedError,
    bad_values,
)
from geopipe.runtime.actor.outer_sign import ChunkSigner, GroupKey
from geopipe.transport import wire
from geopipe.transport.codec import Encoded
from geopipe.transport.dial import DialError, dial
from geopipe.transport.direct import CONGESTION, PeerLostError
from geopipe.transport.frames import encode_frame, key_to_json, sendmsg_all
from geopipe.transport.link import DelayedMailbox, LinkEmulator, LinkParams
from geopipe.transport.seal import CorruptPayloadError, Sealed, open_sealed, seal
from geopipe.transport.security import (
    HandshakeError,
    RunCredentials,
    TlsSealer,
)
from geopipe.transport.sockets import shutdown_socket, tune_stream

__all__ = [
    "CHUNK_ELEMS",
    "MAX_ABS",
    "EncodedInbox",
    "EncodedSender",
    "GroupKey",
    "OuterExchange",
    "OuterFrames",
    "OuterPeer",
    "OuterReceiver",
    "OuterRefusedError",
    "OuterSettings",
    "bad_values",
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
    # Each group's weight in the average (by stable group id: its batch share, when the
    # shares differ); () = every group alike (geopipe.outer.exchange.average_encoded)
    weights: tuple[float, ...] = ()

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


class EncodedInbox:
    """Where a :class:`DirectReceiver` files the peers' payloads: verified against their
    seal, kept *encoded* (the average decodes every group's payload itself, in group order),
    and held until their emulated delivery time.

    A stream the receiver failed (a corrupt frame, or one the plan refused: that connection
    is dropped) does not close the inbox: the other peers' payloads keep arriving, and the
    same peer may connect again. A plain :meth:`get` raises the failure at once;
    :meth:`OuterExchange.gather` waits past it (``strict=False``). A refusal whose frame
    claims a peer group stops the gather waiting for that group (`OuterExchange`); one that
    claims none is named in why the silent groups are missing when the wait ends."""

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

    def refuse(self, key: Hashable, error: BaseException) -> None:
        """``error`` in place of whatever ``key`` holds: the receiver's answer to a second,
        different payload for a key (signed: the group signed both; unsigned: which of the
        two is genuine cannot be told), so neither is used."""
        self._box.put(key, _Failed(error), 0.0, replace=True)

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

    def discard(self, key: Hashable) -> None:
        """Drop what ``key`` holds, if anything is due (:meth:`OuterExchange.forget`)."""
        self._box.poll(key)

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
    transfer overlaps the inner steps that follow; ``gather`` joins those sends and waits
    for every peer's chunks. Keys are ``(tag, group, chunk)`` where ``tag`` names the
    stage, partition, fragment and round, so a late or early payload cannot be mistaken
    for another round's.

    ``refused``: the peer groups whose frames the listener refused, with why: signed, only a
    group whose own key verified the bytes refused (:mod:`.outer_sign`, "Who a refusal is
    pinned on"); unsigned, the group a refused frame claims, or the key an error was filed
    for. A refused group's stream is gone (the connection dropped, or its payload
    unusable), so no gather waits for it until
    :meth:`connect` pairs it again; the driver decides what follows ([Note: a round over
    the survivors] in :mod:`geopipe.runtime.actor.outer`).

    Signed (:meth:`identify`): each chunk's key carries this replica's group's signature as
    its last item, and the listener takes only chunks their claimed group signed."""

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
        self.peers: dict[int, OuterPeer] = {}
        self.refused: dict[int, str] = {}
        self.frames: OuterFrames | None = None
        self._senders: dict[int, EncodedSender] = {}
        self._posts: list[tuple[int, threading.Thread, list[Any]]] = []
        self._dropped: set[int] = set()  # groups written off: never waited for again
        # (tag, group) -> the chunks gathers took so far, until the round is applied
        self._held: dict[tuple, list[Encoded]] = {}
        self.receiver = OuterReceiver(
            self.inbox,
            self._refused_frame,
            host=host,
            advertise_host=advertise_host,
            creds=creds,
            max_payload=max_payload,
            user_timeout_s=user_timeout_s,
        )
        self.address = self.receiver.address
        self.key: GroupKey | None = None  # this group's signing key (identify)

    def identify(self, key: GroupKey | None) -> None:
        """Sign what :meth:`post` sends with ``key`` (this replica's group's), and take only
        payloads the group they claim signed, by ``key``'s public keys (:mod:`.outer_sign`).
        Called before :meth:`connect`; None: unsigned (a run of one group, or a test)."""
        self.key = key
        self.receiver.verifier = None if key is None else key.verifier()

    def expect(self, frames: OuterFrames) -> None:
        """Take only ``frames``' frames from now on (checked before allocation)."""
        self.frames = frames
        self._peers_changed()
        self.receiver.expect = frames

    def _peers_changed(self) -> None:
        if self.frames is not None:
            self.frames.peers = frozenset(g for g in self.peers if g not in self._dropped)

    def _refused_frame(self, key: Hashable, why: str) -> None:
        """The receiver refused a frame (on its reader's thread): pinned on the peer group
        of the key the receiver pinned it on, if any (signed: the group whose key verified
        the bytes; unsigned: the one the frame claims); the first refusal is kept, it is
        the cause. One pinned on no key is only logged (by the receiver, naming the peer)."""
        group = None if self.frames is None else self.frames.group_of(key)
        if group is not None:
            self.refused.setdefault(group, why)

    def connect(self, peers: Sequence[OuterPeer]) -> None:
        """(Re)connect to ``peers`` (drops connections to groups no longer listed)."""
        for s in self._senders.values():
            s.close()
        self._senders, self.peers = {}, {}
        self._dropped -= {p.group for p in peers}  # a group grown back is waited for again
        for p in peers:
            self.refused.pop(p.group, None)
            self._senders[p.group] = EncodedSender(
                p.address, self.creds, p.link, user_timeout_s=self.user_timeout_s
            )
            self.peers[p.group] = p
        self._peers_changed()

    def post(self, tag: tuple, group: int, chunks: Sequence[Encoded]) -> None:
        """Send ``chunks`` (this replica's payload, from group ``group``) to every peer,
        each chunk signed once (on the first send thread to reach it) when :meth:`identify`
        gave a key."""
        if self.key is not None and self.key.group != group:
            raise ValueError(f"posting as group {group} with group {self.key.group}'s key")
        signed = None if self.key is None else ChunkSigner(self.key, tag, chunks)

        def key_of(c: int) -> tuple:
            return (*tag, group, c) if signed is None else signed.key(c)

        for g, sender in sorted(self._senders.items()):
            box: list[Any] = []

            def run(sender: EncodedSender = sender, box: list[Any] = box) -> None:
                try:
                    box.append(sum(sender.send(key_of(c), enc) for c, enc in enumerate(chunks)))
                except BaseException as exc:  # surfaced by gather(), naming the peer
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

    def forget(self, tag: tuple, chunks: int) -> None:
        """Let go of everything held for ``tag``'s ``chunks`` chunks (its round is applied):
        the chunks gathers took, those the inbox still holds — a group's the round did not
        wait for, or (unsigned) a second frame for a key already taken, filed as its first
        is gone — and the digests the receiver keeps to know a replay. Frames for ``tag``
        that come later are off the plan's window and refused, so nothing of a round
        outlives it."""
        for key in [k for k in self._held if k[0] == tag]:
            del self._held[key]
        self.receiver.forget(tag)
        for g in {*self.peers, *self._dropped, *self.refused}:
            for c in range(chunks):
                self.inbox.discard((*tag, g, c))

    def gather(
        self, tag: tuple, chunks: int, timeout_s: float
    ) -> tuple[dict[int, list[Encoded]], dict[int, str], int]:
        """Every peer's ``chunks`` payload chunks of ``tag`` that arrive within ``timeout_s``
        (by group), why each other peer's did not (by group: its send failed, it was
        dropped, its frames were refused, or it stayed silent), and the bytes this replica
        sent for ``tag``. A refused peer is not waited for: it is missing at once, its
        refusal the reason. The chunks taken are kept until :meth:`forget`: the driver asks
        in slices, and a payload that arrived across two of them, or whole in an earlier
        one, is returned whole and at once. Raises nothing for a missing peer: the driver
        decides who a round averages over."""
        deadline = time.monotonic() + timeout_s
        missing, sent = self._joined(deadline, timeout_s)
        got: dict[int, list[Encoded]] = {}
        for g, peer in sorted(dict(self.peers).items()):
            if g in missing:
                continue
            why = self._take(tag, g, chunks, deadline)
            if why is None:
                got[g] = list(self._held[(tag, g)])
            elif why == "silent":
                missing[g] = f"no payload from group {g} at {peer.address} in {timeout_s:g}s"
                if self.inbox.failures:  # a stream refused, whose frame claimed no peer
                    missing[g] += f" (latest stream failure: {self.inbox.failures[-1]})"
            else:
                missing[g] = why
        return got, missing, sent

    def _joined(self, deadline: float, timeout_s: float) -> tuple[dict[int, str], int]:
        """Join the sends :meth:`post` started (until ``deadline``): why each peer's failed
        or is still running, and the bytes of those that finished."""
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
        return missing, sent

    def _take(self, tag: tuple, g: int, chunks: int, deadline: float) -> str | None:
        """Take group ``g``'s chunks of ``tag`` into ``_held`` until all ``chunks`` are there
        (None), ``deadline`` passes ("silent"), or why it is missing otherwise: dropped, or
        refused (then at once: its stream is gone, waiting would only delay the driver)."""
        have = self._held.setdefault((tag, g), [])
        while len(have) < chunks:
            if g in self._dropped:
                return "dropped"
            refused = self.refused.get(g)
            left = deadline - time.monotonic()
            try:
                wait = 0.0 if refused else max(0.0, min(_POLL_S, left))
                have.append(self.inbox.get((*tag, g, len(have)), wait, strict=False))
            except TimeoutError:
                if refused:
                    return f"refused: {refused}"
                if left <= 0:
                    return "silent"
            except CorruptPayloadError as exc:  # filed for this key: damaged, or a second
                # payload (signed: one the group signed too; unsigned: any)
                self.refused.setdefault(g, str(exc))
                return f"refused: {self.refused[g]}"
        return None

    def collect(
        self, tag: tuple, chunks: int, timeout_s: float
    ) -> tuple[dict[int, list[Encoded]], int]:
        """:meth:`gather` that insists on every peer: raises naming the first peer whose
        send failed, whose frames were refused (`PeerLostError`) or whose payload did not
        arrive within ``timeout_s`` (`TimeoutError`)."""
        got, missing, sent = self.gather(tag, chunks, timeout_s)
        for _, why in sorted(missing.items()):
            if why.startswith("refused") or (why.startswith("sending") and "failed" in why):
                raise PeerLostError(f"outer exchange: {why}")
            raise TimeoutError(f"outer exchange: {why}")
        return got, sent

    def close(self) -> None:
        for s in self._senders.values():
            s.close()
        self._senders = {}
        self.receiver.close()
        self.inbox.close()
