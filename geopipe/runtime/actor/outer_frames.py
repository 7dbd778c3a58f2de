"""What an outer listener takes from its peers (issue 33's frame plan, for the outer exchange
of :mod:`geopipe.runtime.actor.outer_wire`): the frames its partition layout lets them send,
checked on their header before anything is allocated (:class:`OuterFrames`), and payloads
whose values the average can take, checked once decoded before they are filed
(:class:`OuterReceiver`). Whatever else arrives is refused like any frame the data plane's
plan refuses (:mod:`geopipe.transport.receiver`): logged naming the peer, the connection
dropped; the refusal is also handed to the exchange with the key it is pinned on, so a
round stops waiting for that group at once. When the run's groups sign their payloads
(:mod:`.outer_sign`), the receiver takes a payload filed under group ``g`` only if group
``g``'s signature verifies, and pins a refusal on a group only when that group's key
verified the bytes refused, never on the group a frame merely claims; a second frame
whose signed bytes equal the first's is dropped (a replay changes nothing).
"""

from __future__ import annotations

import dataclasses
import math
import socket
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from geopipe.outer import ROW_LEN, decode_delta
from geopipe.runtime.actor.outer_sign import GroupVerifier, is_signature, signed_digest
from geopipe.transport import wire
from geopipe.transport.codec import Encoded
from geopipe.transport.frames import FrameInfo, FrameRefusedError
from geopipe.transport.receiver import DirectReceiver
from geopipe.transport.seal import CorruptPayloadError, Sealed, open_sealed

if TYPE_CHECKING:
    from geopipe.runtime.actor.outer_wire import OuterSettings

__all__ = ["MAX_ABS", "OuterFrames", "OuterReceiver", "OuterRefusedError", "bad_values"]

# [Note: what an outer payload may hold]
# Every group averages every payload it holds, so one payload holding NaN or inf, from a peer
# with a bug, a hostile one, or one whose model diverged, would make theta_global NaN in
# every group at once. So each payload's values are checked where they are known, decoded:
# a peer's on the reader's thread, after its seal and before it is filed (the apply never
# sees it; `OuterReceiver`), this replica's own before it is sent (`OuterState.delta`).
# Decoded, not encoded: an int8 or int4h scale that is finite may still decode to inf, and
# a payload whose arrays do not decode at all is refused the same way. Finite is not
# enough either: two payloads of 3e38 average to inf, so a value must stay within MAX_ABS
# = 2^100, which no pseudo-gradient of a model that trains comes near, and under which the
# sum of up to 2^27 groups' payloads cannot overflow fp32 (2^128). The price is one more
# decode per chunk, on the reader's thread, while the inner steps run.
MAX_ABS = 2.0**100


def bad_values(x: torch.Tensor) -> str | None:
    """Why the decoded pseudo-gradient ``x`` may not be averaged, or None if it may
    ([Note: what an outer payload may hold]): NaN, inf, or beyond :data:`MAX_ABS`."""
    if x.numel() == 0:
        return None
    peak = float(x.abs().max())  # NaN if any value is NaN
    if not math.isfinite(peak):
        return "holds NaN or inf"
    if peak > MAX_ABS:
        return f"holds a value of magnitude {peak:.3g}, over the bound 2^100 (MAX_ABS)"
    return None


class OuterRefusedError(FrameRefusedError):
    """An outer frame refused by the plan (its header, its signature, or its values);
    ``key``: the key the refusal is pinned on, so the exchange can tell which group's payload
    will not come (`OuterExchange`). Signed: a key under the group whose key verified the
    frame's bytes, else None (:mod:`.outer_sign`); unsigned: the key the frame claims."""

    def __init__(self, key: Hashable, message: str) -> None:
        super().__init__(message)
        self.key = key


class OuterFrames:
    """The frames an outer listener takes (issue 33's frame plan, for the outer exchange):
    called with each frame's header on the reader's thread, before its payload is
    allocated, it raises `OuterRefusedError` for anything else, and the receiver drops
    that connection (see `OuterExchange` for what the exchange does then). Once a frame's
    payload is in, :meth:`why_not_values` checks what it decodes to (`OuterReceiver`).

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
            raise OuterRefusedError(info.key, f"outer frame {info.key!r} not expected: {reason}")

    def group_of(self, key: Hashable) -> int | None:
        """The connected peer group ``key`` claims to come from, or None when it claims none
        (not this plan's form, or a group that is not a peer). Only a claim: every peer holds
        the run's one secret; the claim is proved by the group's signature, checked on the
        payload (`OuterReceiver`, :mod:`.outer_sign`)."""
        n = len(self.tag)
        if not (isinstance(key, tuple) and len(key) == n + 4 and key[:n] == self.tag):
            return None
        group = key[n + 2]
        return group if type(group) is int and group in self.peers else None

    def why_not_values(self, key: tuple, enc: Encoded) -> str | None:
        """Why the payload ``enc`` of ``key`` (a key this plan admitted) may not be averaged,
        or None ([Note: what an outer payload may hold])."""
        n = len(self.tag)
        numel = self.chunks[key[n]][key[n + 3]]
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # what is checked, next
                x = decode_delta(enc, numel)
        except Exception as exc:  # arrays that add up to the size but not to the codec's
            return f"does not decode: {type(exc).__name__}: {exc}"
        return bad_values(x)

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


class OuterReceiver(DirectReceiver):
    """The direct channel's receiver (handshake, payload bound, header checks against
    ``expect``) with these additions for an :class:`OuterFrames` plan: with ``verifier``
    set (the run's groups sign: :mod:`.outer_sign`), a frame's key must end in a signature,
    and its payload is filed only if the group it claims signed it; each payload's values
    are checked after its seal and before it is filed (`OuterFrames.why_not_values`), so a
    payload holding NaN, inf or an overflowing value never reaches the inbox, let alone an
    apply; and every refusal, of a header, a signature or values, is reported to
    ``on_refused`` (the key it is pinned on, and why, naming the peer's address) before the
    receiver does what it does with any refused frame: log it (once per 30 s, naming the
    peer), drop the connection and note the failure in the inbox. They hook the receiver's
    per-frame steps (``_admit``, ``_read``, ``_file``) rather than copy its reader loop."""

    def __init__(self, inbox: Any, on_refused: Callable[[Hashable, str], None], **kw: Any) -> None:
        self.on_refused = on_refused  # before the listener starts: a frame may come at once
        self.verifier: GroupVerifier | None = None  # set before any peer connects
        # signed: each key filed -> the digest its signature covers, until its round is
        # applied (forget), to tell a replay (same bytes: dropped) from an equivocation
        self._digests: dict[tuple, bytes] = {}
        self._digests_lock = threading.Lock()
        super().__init__(inbox, **kw)

    def forget(self, tag: tuple) -> None:
        """Let go of the digests of ``tag``'s keys (its round is applied)."""
        n = len(tag)
        with self._digests_lock:
            for key in [k for k in self._digests if k[:n] == tag]:
                del self._digests[key]

    def _read(self, conn: socket.socket, peer: tuple) -> None:
        try:
            super()._read(conn, peer)
        except FrameRefusedError as exc:
            self.on_refused(getattr(exc, "key", None), f"frame from peer {peer}: {exc}")
            raise

    def _signed(self) -> bool:
        return self.verifier is not None and isinstance(self.expect, OuterFrames)

    def _admit(self, info: FrameInfo) -> None:
        """The plan's header check, on the key less its signature when groups sign: then a
        frame without one, or one the plan refuses, is pinned on no group (a header is read
        before any signature can be checked: nothing proves who sent it)."""
        if not self._signed():
            super()._admit(info)
            return
        key = info.key
        if not (isinstance(key, tuple) and key and is_signature(key[-1])):
            raise OuterRefusedError(None, f"outer frame {key!r} is not signed")
        try:
            super()._admit(dataclasses.replace(info, key=key[:-1]))
        except OuterRefusedError as exc:
            raise OuterRefusedError(None, str(exc)) from None

    def _file(
        self, key: Hashable, sealed: Sealed, deliver_at: float, sent_at: float, peer: tuple
    ) -> None:
        plan = self.expect
        if isinstance(plan, OuterFrames) and isinstance(key, tuple):
            digest = None
            if self._signed():
                key, digest = self._check_signature(plan, key, sealed)
            try:
                enc: Encoded | None = open_sealed(sealed)
            except CorruptPayloadError as exc:
                if digest is not None:  # signed bytes intact, their (unsigned) seal altered
                    raise OuterRefusedError(None, f"outer payload {key!r}: {exc}") from None
                enc = None  # damaged in transit: the inbox files that for its key, below
            why = None if enc is None else plan.why_not_values(key, enc)
            if why is not None:
                raise OuterRefusedError(key, f"outer payload {key!r} {why}")
            if digest is not None and not self._first(key, digest, peer):
                return
        super()._file(key, sealed, deliver_at, sent_at, peer)

    def _first(self, key: tuple, digest: bytes, peer: tuple) -> bool:
        """Whether ``key``'s signed payload (``digest``) is the first for it this round. A
        second with the same bytes is dropped (logged, the connection kept: it may be the
        group's own); one with other bytes, also signed by the group (both verified), is an
        equivocation: the key holds an error instead and the group is refused."""
        with self._digests_lock:
            first = self._digests.get(key)
            if first is None:
                self._digests[key] = digest
                return True
        if first == digest:
            self.refused.reject(peer, f"outer payload {key!r} arrived again, same bytes: dropped")
            return False
        err = CorruptPayloadError(
            f"outer payload {key!r}: group {key[len(self.expect.tag) + 2]} signed two "
            f"different payloads for it (the second from peer {peer})"
        )
        self.inbox.refuse(key, err)
        raise OuterRefusedError(key, str(err))

    def _check_signature(
        self, plan: OuterFrames, key: tuple, sealed: Sealed
    ) -> tuple[tuple, bytes]:
        """``key`` less its signature, and the digest signed, if the group it claims signed
        this payload under it; else raises `OuterRefusedError` pinned on the group that did
        sign it, if any (a forgery by that group's insider), or on none (see
        :mod:`.outer_sign`)."""
        assert self.verifier is not None
        key, sig = key[:-1], key[-1]
        n = len(plan.tag)
        claimed = key[n + 2]
        digest = signed_digest(key, sealed.enc)
        signer = self.verifier.signer(claimed, key, sig, sealed.enc, digest)
        if signer == claimed:
            return key, digest
        if signer is None:
            raise OuterRefusedError(
                None, f"outer payload {key!r}: no group's signature verifies (claims {claimed})"
            )
        raise OuterRefusedError(
            (*key[: n + 2], signer, *key[n + 3 :]),
            f"outer payload {key!r} filed as group {claimed} is signed by group {signer} "
            f"(a forgery by group {signer})",
        )
