"""Per-group identity for the outer loop's payloads: each replica group signs what it sends,
and a listener files a payload under group ``g`` only if group ``g``'s signature verifies.

[Note: why outer payloads are signed per group]
Every actor of a run holds the one run secret (:mod:`geopipe.transport.security`), so the
data plane's handshake and TLS prove "a peer of this run", never which replica group: a
compromised actor of group 0 could send a pseudo-gradient under group 1's key, and every
group would average it into theta_global. So the driver makes one Ed25519 key pair per
replica group at launch (:class:`GroupKeyring`: fresh per run, kept by a group through
recoveries and grow-backs) and hands each stage actor, beside the run secret, its own
group's private key and every group's public key (:class:`GroupKey`); no actor holds
another group's private key. Each chunk's frame carries its group's signature (hex, as the
last item of its key: a frame's header is the only place the direct channel's format leaves
for it) over a SHA-256 digest of a domain label, the frame's key (stage, partition,
fragment, round, group, chunk), its header fields (codec, shape, dtype, direction, the
arrays' dtypes and shapes) and its payload bytes, so a signature cannot be moved to another
key or payload. The listener checks it on the reader's thread, before the payload's values
are decoded or anything is filed (:class:`~.outer_frames.OuterReceiver`).

Who a refusal is pinned on (a refused group is written off by the driver): a group only
when its own key verified the bytes refused -- proof that it sent them -- and otherwise
nobody. Every actor of the run can reach every listener and relay what it received, so
anything a frame merely *claims* proves nothing about who sent it, and pinning on the claim
would let one insider get honest groups written off by replaying their genuine frames or
sending malformed ones in their name. So:

* pinned on the signer: a payload signed by group 0 and filed as group 1 (group 0's insider
  forged it); a payload group ``g`` signed whose values the average cannot take; and two
  *different* payloads both validly signed by ``g`` for one key (``g`` equivocated: neither
  is used, the key holds an error instead);
* pinned on no group, refused and logged naming the peer's address: a header the plan does
  not expect (a header is checked before its payload is read, so before any signature can
  be, and a genuine frame replayed out of its round's window would verify: being signed
  does not make a misplaced frame its signer's doing); an unsigned frame; a signature no
  group's key verifies (moved to another key, or over other bytes); a signed payload whose
  transport seal was altered; such a frame's connection is dropped, the claimed group's
  genuine frames on its own connection are still taken, and a gather that waits in vain
  names the latest failure;
* dropped, nothing else: a second frame for a key whose signed bytes are identical to the
  first's (a replay, or the same frame relayed twice) -- identical bytes average the same,
  so keeping the first is idempotent, and the connection it came on is kept (it may be the
  group's own, its next chunks behind it).

An unsigned exchange (:meth:`~.outer_wire.OuterExchange.identify` with None: a run of one
group, which exchanges nothing, and tests) has no proof of anything and takes a frame's
claim as its sender. The transport metadata (sequence number, the link emulator's delivery
stamp, the seal's CRC) is not signed: it orders, paces and checks frames, and the values
averaged never depend on it. Nor is an attempt number: a fragment's rounds only advance
within a run, and a resume is a new launch with new keys; were a round ever redone, its
first attempt's genuine payload would verify in the second.

Ed25519 over a digest, not over the payload itself: ``cryptography``'s Ed25519 hashes its
whole message twice to sign and once to verify (SHA-512) and takes it as one contiguous
``bytes`` (a copy of the chunk); the digest is one pass of ``hashlib``'s SHA-256 over the
arrays in place. Measured on this machine (2 cores, load ~5 from other jobs: upper bounds),
median of 15, per chunk of ``CHUNK_ELEMS`` (1 M elements): codec none (4 MiB) sign 5.4 ms,
verify 5.6 ms; int8 (1.06 MB) 1.0 ms and 1.0 ms; int4h (0.56 MB) 0.5 ms and 0.6 ms --
nearly all of it SHA-256 (Ed25519 itself: 0.05 ms to sign, 0.16 ms to verify); signing the
raw 4 MiB instead cost 34 ms to sign and 14 ms to verify. Each chunk is signed once however
many peers receive it (:class:`ChunkSigner`), on the exchange's send threads, which overlap
the inner steps; verified once, on the listener's reader thread, before its values are
decoded.

Not proved: that a payload signed by group ``g`` is a *good* pseudo-gradient. An insider of
group ``g`` holds ``g``'s key and can send finite garbage as ``g``; the values checks refuse
NaN, inf and overflow only ([Note: what an outer payload may hold] in :mod:`.outer_frames`),
and robust aggregation is not part of this.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from geopipe.transport.codec import Encoded
from geopipe.transport.frames import header_fields

if TYPE_CHECKING:
    from geopipe.plan import Plan

__all__ = [
    "SIG_HEX",
    "ChunkSigner",
    "GroupKey",
    "GroupKeyring",
    "GroupVerifier",
    "is_signature",
    "signed_digest",
]

_DOMAIN = b"geopipe outer payload v1\0"
SIG_HEX = 128  # an Ed25519 signature (64 bytes) in hex, as a frame key's last item


@dataclass(frozen=True)
class GroupKey:
    """What one stage actor holds: its group's id and raw Ed25519 private key, and every
    group's raw public key by group id. ``repr`` never shows the private key."""

    group: int
    private: bytes = field(repr=False)
    publics: tuple[tuple[int, bytes], ...] = ()

    def signer(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(self.private)

    def verifier(self) -> GroupVerifier:
        return GroupVerifier(dict(self.publics))


class GroupKeyring:
    """The driver's key pairs, one per replica group, made for every group of the plan when
    the first actor's key is asked for (at launch) and kept for the run, so a group that
    recovers or grows back signs with the key its peers already hold."""

    def __init__(self) -> None:
        self._keys: dict[int, Ed25519PrivateKey] = {}

    def key_of(self, plan: Plan, replica: int) -> GroupKey | None:
        """Pipeline ``replica``'s group's :class:`GroupKey` under ``plan`` (None for a plan
        of one group: nothing to exchange)."""
        if plan.num_groups <= 1:
            return None
        for g in range(plan.num_groups):
            if g not in self._keys:
                self._keys[g] = Ed25519PrivateKey.generate()
        return self.key(plan.group_of(replica))

    def key(self, group: int) -> GroupKey:
        publics = tuple((g, _raw_public(k.public_key())) for g, k in sorted(self._keys.items()))
        private = self._keys[group].private_bytes_raw()
        return GroupKey(group, private, publics)


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes_raw()


def signed_digest(key: Hashable, enc: Encoded) -> bytes:
    """SHA-256 over the domain label, ``key`` (without a signature) and ``enc``'s header
    fields, each length-prefixed, then its payload arrays' bytes in order: what a signature
    covers (see the module's note)."""
    header = json.dumps(header_fields(key, enc), separators=(",", ":"), sort_keys=True).encode()
    h = hashlib.sha256(_DOMAIN)
    h.update(len(header).to_bytes(4, "little"))
    h.update(header)
    for a in enc.arrays:
        h.update(memoryview(a.reshape(-1).view("u1")) if a.flags.c_contiguous else a.tobytes())
    return h.digest()


def is_signature(item: object) -> bool:
    """Whether a key's last item has a signature's form (lower-case hex, 128 digits)."""
    return (
        isinstance(item, str)
        and len(item) == SIG_HEX
        and all(c in "0123456789abcdef" for c in item)
    )


class GroupVerifier:
    """Every group's public key: checks a chunk's signature, and says whose it is."""

    def __init__(self, publics: dict[int, bytes]) -> None:
        self._keys = {g: Ed25519PublicKey.from_public_bytes(p) for g, p in publics.items()}

    def signer(
        self, claimed: int, key: Hashable, sig: str, enc: Encoded, digest: bytes | None = None
    ) -> int | None:
        """The group whose key signed ``enc`` under ``key``: ``claimed`` first, then any
        other (a forgery's author); None when no group's key verifies it. ``digest``:
        :func:`signed_digest` of ``key`` and ``enc`` when the caller has it already."""
        digest = signed_digest(key, enc) if digest is None else digest
        raw = bytes.fromhex(sig)
        order = [claimed, *sorted(g for g in self._keys if g != claimed)]
        for g in order:
            pub = self._keys.get(g)
            if pub is None:
                continue
            try:
                pub.verify(raw, digest)
            except InvalidSignature:
                continue
            return g
        return None


class ChunkSigner:
    """The signatures of one posted payload's chunks, each made once (on whichever send
    thread asks first) however many peers the chunks go to."""

    def __init__(self, key: GroupKey, tag: tuple, chunks: Sequence[Encoded]) -> None:
        self._priv, self._tag, self._group = key.signer(), tuple(tag), key.group
        self._chunks = list(chunks)
        self._sigs: list[str | None] = [None] * len(self._chunks)
        self._locks = [threading.Lock() for _ in self._chunks]

    def key(self, c: int) -> tuple:
        """Chunk ``c``'s frame key: ``(*tag, group, c, signature)``."""
        with self._locks[c]:
            if self._sigs[c] is None:
                key = (*self._tag, self._group, c)
                self._sigs[c] = self._priv.sign(signed_digest(key, self._chunks[c])).hex()
            return (*self._tag, self._group, c, self._sigs[c])
