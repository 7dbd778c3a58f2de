"""The direct channel's frame: encoding, the checked read, and a whole-buffer send.

The format (prefix, JSON header, payload; both checksums) is documented in
:mod:`geopipe.transport.direct`, which owns the connections; this module is the byte
layout alone, so it can be tested and reasoned about without sockets' threads. Keys are
JSON (tuples of str/int/float/bool/None): nothing read from the network is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import struct
import zlib
from collections import deque
from collections.abc import Hashable
from typing import Any

import numpy as np

from geopipe.transport.codec import CorruptPayloadError, Encoded, Sealed

__all__ = [
    "StreamCorruptError",
    "encode_frame",
    "key_to_json",
    "read_frame",
    "send_without_waiting",
    "sendmsg_all",
]

_MAGIC = b"GPDC"
_VERSION = 2
# magic, version, flags, header_len, payload_len, seq, deliver_at, sent_at, payload_crc
_PREFIX = struct.Struct("<4sBBHQQddI")
_HCRC = struct.Struct("<I")
_FIXED = _PREFIX.size + _HCRC.size
# Array dtypes a frame may carry: what the codecs produce (and nothing numpy could make
# surprising from a string read off the network).
_DTYPES = frozenset({"<f4", "<f2", "<u2", "|i1", "<i4", "<f8", "<i2", "<i8", "|u1"})


def key_to_json(key: Hashable) -> Any:
    """Keys are tuples of scalars; JSON keeps them compact and safe to parse."""
    if isinstance(key, tuple):
        return [key_to_json(k) for k in key]
    if key is None or isinstance(key, (str, int, float, bool)):
        return key
    raise TypeError(f"direct channel keys are tuples of str/int/float/bool/None, got {key!r}")


def key_from_json(obj: Any) -> Hashable:
    return tuple(key_from_json(o) for o in obj) if isinstance(obj, list) else obj


def encode_frame(
    key: Hashable, sealed: Sealed, seq: int, deliver_at: float, sent_at: float = 0.0
) -> list[memoryview]:
    """Header and payload buffers of one frame, for one scatter-gather ``sendmsg``."""
    enc = sealed.enc
    arrays = [np.ascontiguousarray(a) for a in enc.arrays]
    header = json.dumps(
        {
            "key": key_to_json(key),
            "codec": enc.codec,
            "shape": list(enc.shape),
            "dtype": enc.dtype,
            "dir": enc.direction,
            "arrays": [[a.dtype.str, list(a.shape)] for a in arrays],
        },
        separators=(",", ":"),
    ).encode()
    if len(header) > 0xFFFF:
        raise ValueError(f"frame header of {len(header)} bytes is too long")
    plen = sum(a.nbytes for a in arrays)
    prefix = _PREFIX.pack(
        _MAGIC, _VERSION, 0, len(header), plen, seq, deliver_at, sent_at, sealed.checksum
    )
    hcrc = _HCRC.pack(zlib.crc32(header, zlib.crc32(prefix)))
    bufs = [memoryview(prefix + hcrc + header)]
    bufs += [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays if a.nbytes]
    return bufs


def sendmsg_all(sock: socket.socket, bufs: list[memoryview]) -> int:
    """Write every buffer (zero copy, few syscalls); ``sendmsg`` may write only a part.
    A TLS socket has no ``sendmsg``: each buffer goes through ``sendall`` (TLS records)."""
    total = sum(b.nbytes for b in bufs)
    if isinstance(sock, ssl.SSLSocket):
        for b in bufs:
            sock.sendall(b.cast("B"))
        return total
    pending = deque(b.cast("B") for b in bufs)
    while pending:
        _advance(pending, sock.sendmsg(list(pending)[:512]))  # IOV_MAX is 1024
    return total


def send_without_waiting(sock: socket.socket, bufs: list[memoryview]) -> list[memoryview]:
    """Write what the socket's buffer takes now (one non-blocking ``sendmsg``); returns the
    part not written, empty when all was.

    A TLS socket cannot take a partial non-blocking write and a later retry from another
    thread (OpenSSL wants the same call repeated), so there the whole frame is written
    with a blocking ``sendall``: it waits only when the kernel's send buffer (autotuned to
    megabytes) is full, and the caller writes inline only small frames with nothing queued
    before them."""
    if isinstance(sock, ssl.SSLSocket):
        sendmsg_all(sock, bufs)
        return []
    pending = deque(b.cast("B") for b in bufs)
    with contextlib.suppress(BlockingIOError, InterruptedError):  # the buffer is full
        _advance(pending, sock.sendmsg(list(pending)[:512], [], socket.MSG_DONTWAIT))
    return list(pending)


def _advance(pending: deque[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes written from ``pending``."""
    while n:
        head = pending[0]
        if n >= head.nbytes:
            n -= head.nbytes
            pending.popleft()
        else:
            pending[0] = head[n:]
            n = 0
    while pending and pending[0].nbytes == 0:
        pending.popleft()


class StreamCorruptError(CorruptPayloadError):
    """A frame header failed its checks: the byte stream cannot be trusted any more."""


def _recv_exact(sock: socket.socket, buf: memoryview) -> bool:
    """Fill ``buf``; False on a clean EOF before the first byte, raise on EOF mid-way."""
    got = 0
    while got < buf.nbytes:
        n = sock.recv_into(buf[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"peer closed mid-frame ({got}/{buf.nbytes} bytes)")
        got += n
    return True


def read_frame(
    sock: socket.socket, max_payload: int | None = None
) -> tuple[Hashable, int, Sealed, float, float] | None:
    """Read one frame: ``(key, seq, sealed, deliver_at, sent_at)``, or None at a clean end of
    stream. A payload over ``max_payload`` bytes is refused before anything is allocated."""
    fixed = bytearray(_FIXED)
    if not _recv_exact(sock, memoryview(fixed)):
        return None
    magic, version, _flags, hlen, plen, seq, deliver_at, sent_at, pcrc = _PREFIX.unpack_from(fixed)
    if magic != _MAGIC:
        raise StreamCorruptError(f"bad frame magic {bytes(magic)!r}")
    if version != _VERSION:
        raise StreamCorruptError(f"frame version {version}, this end speaks {_VERSION}")
    if max_payload is not None and plen > max_payload:
        raise StreamCorruptError(f"frame payload of {plen} bytes exceeds the bound {max_payload}")
    header = bytearray(hlen)
    if not _recv_exact(sock, memoryview(header)) and hlen:
        raise ConnectionError("peer closed mid-frame")
    (hcrc,) = _HCRC.unpack_from(fixed, _PREFIX.size)
    if zlib.crc32(header, zlib.crc32(fixed[: _PREFIX.size])) != hcrc:
        raise StreamCorruptError("frame header checksum mismatch")
    try:
        meta = json.loads(header)
        key = key_from_json(meta["key"])
        specs = [(np.dtype(d), tuple(int(s) for s in shape)) for d, shape in meta["arrays"]]
        if any(dt.str not in _DTYPES for dt, _ in specs) or not all(
            isinstance(d, str) and d in _DTYPES for d, _ in meta["arrays"]
        ):
            raise ValueError(f"unexpected array dtype in {meta['arrays']}")
        sizes = [dt.itemsize * int(np.prod(shape, dtype=np.int64)) for dt, shape in specs]
        if sum(sizes) != plen or any(s < 0 for s in sizes):
            raise ValueError(f"array sizes {sizes} do not add up to payload {plen}")
        shape = tuple(int(s) for s in meta["shape"])
        codec, dtype, direction = str(meta["codec"]), str(meta["dtype"]), str(meta["dir"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StreamCorruptError(f"malformed frame header: {exc}") from exc
    arrays = []
    for (dt, ashape), size in zip(specs, sizes, strict=True):
        raw = np.empty(size, dtype=np.uint8)  # fresh and writable: decode may alias it
        if size and not _recv_exact(sock, memoryview(raw)):
            raise ConnectionError("peer closed mid-frame")
        arrays.append(raw.view(dt).reshape(ashape))
    enc = Encoded(codec, shape, dtype, direction, tuple(arrays))
    return key, seq, Sealed(enc, pcrc), deliver_at, sent_at
