"""The integrity seal of an encoded payload: a CRC32 over its header and payload bytes, so a
receiver detects a payload corrupted in transit (an accident, not an attack: the data plane's
TLS or the outer loop's signatures answer attacks). Its own module: the codecs
(:mod:`.codec`) encode, the transports seal and open.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from geopipe.transport.codec import Encoded

__all__ = ["CorruptPayloadError", "Sealed", "open_sealed", "seal"]


class CorruptPayloadError(ValueError):
    """Raised when a sealed payload's checksum does not match its contents."""


@dataclass(frozen=True)
class Sealed:
    """An `Encoded` plus a CRC32 over its header and payload, to detect corruption in transit."""

    enc: Encoded
    checksum: int


def _checksum(enc: Encoded) -> int:
    """CRC32 over a header string and the raw payload bytes (detects accidents, not attacks)."""
    header = repr(
        (
            enc.codec,
            enc.shape,
            enc.dtype,
            enc.direction,
            tuple((a.dtype.str, a.shape) for a in enc.arrays),
        )
    )
    crc = zlib.crc32(header.encode())
    for a in enc.arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8), crc)
    return crc


def seal(enc: Encoded) -> Sealed:
    """Attach a checksum so the receiver can detect a payload corrupted in transit."""
    return Sealed(enc, _checksum(enc))


def open_sealed(sealed: Sealed) -> Encoded:
    """Verify the checksum and return the payload; raise `CorruptPayloadError` on mismatch."""
    actual = _checksum(sealed.enc)
    if actual != sealed.checksum:
        raise CorruptPayloadError(
            f"{sealed.enc.codec} payload of shape {sealed.enc.shape}: checksum "
            f"{actual:#010x} != expected {sealed.checksum:#010x}"
        )
    return sealed.enc
