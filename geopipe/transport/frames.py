"""The direct channel's frame: encoding, the checked read, and a whole-buffer send.

The format (prefix, JSON header, payload; both checksums) is documented in
:mod:`geopipe.transport.direct`, which owns the connections; this module is the byte
layout alone, so it can be tested and reasoned about without sockets' threads. Keys are
JSON (tuples of str/int/float/bool/None): nothing read from the network is unpickled.

[Note: a header is checked whole before anything is allocated]
Every length, shape and name in a header is checked before a byte of its payload is
allocated or read (`parse_header`): sizes are products of Python integers, which cannot
wrap (numpy's int64 product wrapped ``[2**32, 2**32]`` to 0, which then passed the size
check and failed later, outside every handler); the tensor's shape is bounded too (the
decoders allocate its float32 result: ``4 * numel`` must fit the payload bound); codec,
dtype, direction and key are validated; and the receiver's own check of what its plan
expects (`FrameInfo`, ``admit``) runs last, still before allocation.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import ssl
import struct
import zlib
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from geopipe.transport import wire
from geopipe.transport.codec import Encoded
from geopipe.transport.seal import CorruptPayloadError, Sealed

__all__ = [
    "FrameInfo",
    "FrameRefusedError",
    "StreamCorruptError",
    "encode_frame",
    "key_to_json",
    "parse_header",
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
# The tensor dtypes a codec is given (floating: `codec._prepare`) and the directions.
_TENSOR_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
_DIRECTIONS = frozenset({"forward", "backward"})
_MAX_DIMS, _MAX_ARRAYS = 8, 4
_MAX_ELEMS = 1 << 40  # no tensor this plane carries comes near; bounds sizes without a bound
_MAX_KEY_ITEMS, _MAX_KEY_DEPTH, _MAX_KEY_STR = 16, 3, 256


def key_to_json(key: Hashable) -> Any:
    """Keys are tuples of scalars; JSON keeps them compact and safe to parse."""
    if isinstance(key, tuple):
        return [key_to_json(k) for k in key]
    if key is None or isinstance(key, (str, int, float, bool)):
        return key
    raise TypeError(f"direct channel keys are tuples of str/int/float/bool/None, got {key!r}")


def key_from_json(obj: Any) -> Hashable:
    return tuple(key_from_json(o) for o in obj) if isinstance(obj, list) else obj


def header_fields(key: Hashable, enc: Encoded, arrays: Any = None) -> dict[str, Any]:
    """A frame's header as JSON-ready fields: its key and what the payload's arrays are
    (``arrays``: as sent, default ``enc.arrays``; also what an outer chunk's signature
    covers: geopipe.runtime.actor.outer_sign)."""
    return {
        "key": key_to_json(key),
        "codec": enc.codec,
        "shape": list(enc.shape),
        "dtype": enc.dtype,
        "dir": enc.direction,
        "arrays": [
            [a.dtype.str, list(a.shape)] for a in (enc.arrays if arrays is None else arrays)
        ],
    }


def encode_frame(
    key: Hashable, sealed: Sealed, seq: int, deliver_at: float, sent_at: float = 0.0
) -> list[memoryview]:
    """Header and payload buffers of one frame, for one scatter-gather ``sendmsg``."""
    enc = sealed.enc
    arrays = [np.ascontiguousarray(a) for a in enc.arrays]
    header = json.dumps(header_fields(key, enc, arrays), separators=(",", ":")).encode()
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


class FrameRefusedError(StreamCorruptError):
    """A well-formed frame its receiver does not expect (its plan's keys, dtypes, shapes),
    refused before its payload is read: the connection is dropped."""


@dataclass(frozen=True)
class FrameInfo:
    """What a frame's header announces, checked, before its payload is read."""

    key: Hashable
    codec: str
    shape: tuple[int, ...]
    dtype: str  # the tensor's torch dtype name ("float32", "bfloat16", ...)
    direction: str
    arrays: tuple[tuple[np.dtype, tuple[int, ...]], ...]
    payload_nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


Admit = Callable[[FrameInfo], None]  # raises FrameRefusedError for a frame not expected


def _key(obj: Any, depth: int = 0, count: list[int] | None = None) -> Hashable:
    """``key_from_json`` for a key read off the network: bounded depth, items and strings,
    finite numbers (a NaN key would never equal itself, so its frame could not be got)."""
    count = [0] if count is None else count
    count[0] += 1
    if count[0] > _MAX_KEY_ITEMS or depth > _MAX_KEY_DEPTH:
        raise ValueError("key too large or too deep")
    if isinstance(obj, list):
        return tuple(_key(o, depth + 1, count) for o in obj)
    if isinstance(obj, str) and len(obj) > _MAX_KEY_STR:
        raise ValueError("key string too long")
    if isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError("non-finite number in key")
    if isinstance(obj, int) and not -(1 << 63) <= obj < (1 << 63):
        raise ValueError("key integer out of range")
    if obj is not None and not isinstance(obj, (str, int, float, bool)):
        raise ValueError(f"key item of type {type(obj).__name__}")
    return obj


def _dims(obj: Any, what: str) -> tuple[int, ...]:
    if not isinstance(obj, list) or len(obj) > _MAX_DIMS:
        raise ValueError(f"{what} is not a list of at most {_MAX_DIMS} sizes")
    if not all(type(d) is int and 0 <= d <= _MAX_ELEMS for d in obj):
        raise ValueError(f"{what} {obj} has a size that is not an integer in [0, 2^40]")
    return tuple(obj)


def _one_of(meta: dict, field: str, allowed: frozenset[str] | tuple[str, ...]) -> str:
    value = meta[field]
    if value not in allowed:
        raise ValueError(f"unknown {field} {value!r}")
    return value


def parse_header(meta: Any, plen: int, max_payload: int | None = None) -> FrameInfo:
    """Check a decoded JSON header against the payload length ``plen`` and the bound
    ``max_payload`` (see the module's note). Raises ValueError naming what is wrong."""
    if not isinstance(meta, dict):
        raise ValueError("header is not an object")
    key = _key(meta["key"])
    codec = _one_of(meta, "codec", wire.CODECS)
    dtype = _one_of(meta, "dtype", _TENSOR_DTYPES)
    direction = _one_of(meta, "dir", _DIRECTIONS)
    shape = _dims(meta["shape"], "shape")
    numel = math.prod(shape)  # Python integers: no wrap-around
    if numel > _MAX_ELEMS or (max_payload is not None and 4 * numel > max_payload):
        raise ValueError(f"shape {list(shape)} decodes to {4 * numel} bytes, over the bound")
    raw = meta["arrays"]
    if not isinstance(raw, list) or len(raw) > _MAX_ARRAYS:
        raise ValueError(f"not a list of at most {_MAX_ARRAYS} arrays")
    arrays = []
    for spec in raw:
        if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in _DTYPES):
            raise ValueError(f"unexpected array {spec!r}")
        arrays.append((np.dtype(spec[0]), _dims(spec[1], "array shape")))
    sizes = [dt.itemsize * math.prod(ashape) for dt, ashape in arrays]
    if sum(sizes) != plen:
        raise ValueError(f"array sizes {sizes} do not add up to payload {plen}")
    return FrameInfo(key, codec, shape, dtype, direction, tuple(arrays), plen)


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
    sock: socket.socket, max_payload: int | None = None, admit: Admit | None = None
) -> tuple[Hashable, int, Sealed, float, float] | None:
    """Read one frame: ``(key, seq, sealed, deliver_at, sent_at)``, or None at a clean end of
    stream. A payload over ``max_payload`` bytes, a header that fails `parse_header`, or one
    ``admit`` refuses (it raises `FrameRefusedError`) is refused before anything is
    allocated."""
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
        info = parse_header(json.loads(header), plen, max_payload)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise StreamCorruptError(f"malformed frame header: {exc}") from exc
    if admit is not None:
        admit(info)
    arrays = []
    for dt, ashape in info.arrays:
        size = dt.itemsize * math.prod(ashape)
        raw = np.empty(size, dtype=np.uint8)  # fresh and writable: decode may alias it
        if size and not _recv_exact(sock, memoryview(raw)):
            raise ConnectionError("peer closed mid-frame")
        arrays.append(raw.view(dt).reshape(ashape))
    enc = Encoded(info.codec, info.shape, info.dtype, info.direction, tuple(arrays))
    return info.key, seq, Sealed(enc, pcrc), deliver_at, sent_at
