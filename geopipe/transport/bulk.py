"""Bulk reads over one TCP stream: the data plane for checkpoint copies between sites.

A site's checkpoint store copies each shard from the actor holding it (a stage replica's
in-memory shard, or another site's committed copy). Through Ray, each 4 MiB piece would be
an actor call whose reply goes through the object store and is pulled — several round
trips per piece over a long link, and bulk bytes on Ray's control plane, which the runtime
keeps for control (see :mod:`geopipe.transport.direct`). Here the holder runs a
:class:`ChunkServer` (a thread, plain sockets) and the store reads pieces with a
:class:`ChunkClient` over one connection: requests are pipelined, so the link stays busy
while the store writes, and pacing stays with the reader. This module knows nothing of Ray;
the runtime exchanges the server's address over Ray calls.

Every connection first passes the run's handshake (:mod:`.security`: a shared-secret
challenge–response, inside TLS when the run encrypts); a client that fails it is closed
before a request is read. Wire format (little endian): a request is ``u32 length`` + JSON
``{"step", "file", "offset", "size"}``; the reply is ``u8 status`` (0 ok, 1 error) +
``u64 length`` + that many bytes (the data, or a UTF-8 error message). Nothing read from
the network is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator

from geopipe.transport.security import (
    HandshakeError,
    RejectLog,
    RunCredentials,
    client_handshake,
    link_id,
    server_handshake,
)
from geopipe.transport.sockets import advertised_host, set_congestion, shutdown_socket

__all__ = ["ChunkClient", "ChunkError", "ChunkServer"]

_REQ = struct.Struct("<I")
_REP = struct.Struct("<BQ")
_MAX_REQUEST = 4096
_MAX_REPLY = 1 << 30

Reader = Callable[[int, str, int, int], bytes]  # (step, file, offset, size) -> bytes


class ChunkError(OSError):
    """The server could not serve a piece (its message says why), or the stream broke."""


class ChunkServer:
    """Serves ``read(step, file, offset, size)`` to any number of authenticated clients, one
    thread each (``creds``: the run's; None only for tests inside one process)."""

    MAX_PENDING = 32  # connections in their handshake at once (more are closed at once)

    def __init__(
        self, read: Reader, host: str = "127.0.0.1", creds: RunCredentials | None = None
    ) -> None:
        self._read = read
        self._creds = creds
        self._sock = socket.create_server((host, 0))
        self.address = (advertised_host(host), self._sock.getsockname()[1])
        self._link = link_id(self.address)
        self.rejected = RejectLog("checkpoint chunk server")
        self._pending = 0
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="chunk-server", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._lock:
                full = self._pending >= self.MAX_PENDING
                self._pending += not full
            if full:
                conn.close()
                self.rejected.reject(peer, "too many connections in their handshake")
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _authenticate(self, conn: socket.socket, peer: object) -> socket.socket | None:
        try:
            return conn if self._creds is None else server_handshake(conn, self._creds,
                                                                      self._link)  # fmt: skip
        except (HandshakeError, OSError, ValueError) as exc:
            self.rejected.reject(peer, exc)
            conn.close()
            return None
        finally:
            with self._lock:
                self._pending -= 1

    def _serve(self, raw: socket.socket, peer: object) -> None:
        conn = self._authenticate(raw, peer)
        if conn is None:
            return
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # This side sends the bulk. TCP-LP yields to other flows (it backs off as soon
            # as one-way delay grows), so copies would fill only the link's idle time; where
            # the kernel lacks it (here: reno, bbr, cubic) cubic, fair to the training
            # stream, with the reader's pacing leaving the activations their share.
            set_congestion(conn, "lp") or set_congestion(conn, "cubic")
            while True:
                head = _recv(conn, _REQ.size)
                if head is None:
                    return
                (n,) = _REQ.unpack(head)
                body = _recv(conn, n) if 0 < n <= _MAX_REQUEST else None
                if body is None:
                    return  # a broken or hostile request: drop the connection
                try:
                    req = json.loads(body)
                    data = self._read(int(req["step"]), str(req["file"]), int(req["offset"]),
                                      int(req["size"]))  # fmt: skip
                    status, payload = 0, bytes(data)
                except Exception as exc:  # any reason: the client gets it as a message
                    status, payload = 1, f"{type(exc).__name__}: {exc}".encode()[:4096]
                try:
                    conn.sendall(_REP.pack(status, len(payload)) + payload)
                except OSError:
                    return

    def close(self) -> None:
        """Stop accepting (connections being served finish their current reply)."""
        self._closed = True
        shutdown_socket(self._sock)  # wakes the thread blocked in accept()


class ChunkClient:
    """One connection to a :class:`ChunkServer`; :meth:`read_all` pipelines requests."""

    def __init__(
        self, address: tuple[str, int], timeout_s: float = 120.0,
        creds: RunCredentials | None = None,
    ) -> None:  # fmt: skip
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(tuple(address))
            if creds is not None:
                sock = client_handshake(sock, creds, link_id(address))
                sock.settimeout(timeout_s)
        except (HandshakeError, OSError) as exc:
            sock.close()
            raise ChunkError(f"cannot reach the chunk server at {address}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock

    def read_all(
        self, step: int, file: str, pieces: list[tuple[int, int]], in_flight: int = 2
    ) -> Iterator[bytes]:
        """The bytes of each ``(offset, size)`` piece, in order, ``in_flight`` asked ahead."""
        todo, asked = deque(pieces), deque()
        while todo or asked:
            while todo and len(asked) < in_flight:
                off, n = todo.popleft()
                body = json.dumps({"step": step, "file": file, "offset": off, "size": n}).encode()
                try:
                    self._sock.sendall(_REQ.pack(len(body)) + body)
                except OSError as exc:
                    raise ChunkError(f"chunk request failed: {exc}") from None
                asked.append(n)
            n = asked.popleft()
            head = _recv(self._sock, _REP.size)
            if head is None:
                raise ChunkError("the chunk server closed the connection")
            status, length = _REP.unpack(head)
            if length > _MAX_REPLY:
                raise ChunkError(f"chunk reply of {length} bytes is out of bounds")
            data = _recv(self._sock, length)
            if data is None:
                raise ChunkError("the chunk server closed the connection mid-reply")
            if status:
                raise ChunkError(data.decode(errors="replace"))
            if len(data) != n:
                raise ChunkError(f"{file}: got {len(data)} bytes, asked {n}")
            yield data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def _recv(sock: socket.socket, n: int) -> bytes | None:
    """Exactly ``n`` bytes, or None if the peer closed first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (TimeoutError, OSError):
            return None
        if k == 0:
            return None
        got += k
    return bytes(buf)
