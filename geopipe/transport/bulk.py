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
challenge–response, inside TLS when the run encrypts) at the listener's gate
(:mod:`.gate`, which no stranger can starve); a client that fails it is closed before a
request is read, and a client shed by the gate tries again (:mod:`.dial`).

Wire format (little endian): a request is ``u32 length`` + JSON ``{"step", "file",
"offset", "size"}``; the reply is ``u8 status`` (0 ok, 1 error) + ``u64 length`` + that
many bytes (the data, or a UTF-8 error message); the client checks the length against what
it asked before reading the reply. Nothing read from the network is unpickled.

A read may carry a deadline (:meth:`ChunkClient.read_all`): the socket's timeout is then
the time left before each receive, so a server that accepts and never answers, or answers
a trickle, ends the read at the deadline (`ChunkTimeout`), not after one idle timeout per
receive -- which a byte every few seconds would renew forever.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from geopipe.transport.dial import DialError, dial
from geopipe.transport.gate import Gate
from geopipe.transport.rejects import RejectLog
from geopipe.transport.security import RunCredentials, link_id
from geopipe.transport.sockets import advertised_host, set_congestion, shutdown_socket

__all__ = ["ChunkClient", "ChunkError", "ChunkServer", "ChunkTimeout"]

_REQ = struct.Struct("<I")
_REP = struct.Struct("<BQ")
_MAX_REQUEST = 4096
_MAX_ERROR = 4096  # an error reply's message, at most

Reader = Callable[[int, str, int, int], bytes]  # (step, file, offset, size) -> bytes


class ChunkError(OSError):
    """The server could not serve a piece (its message says why), or the stream broke."""


class ChunkTimeout(ChunkError):
    """A read's deadline passed before its replies were complete (a stalled or trickling
    server, or a link far slower than the caller planned for)."""


class ChunkServer:
    """Serves ``read(step, file, offset, size)`` to any number of authenticated clients, one
    thread each (``creds``: the run's; None only for tests inside one process).

    ``advertise_host``: the address peers dial, when listening on every interface (give the
    node's, as the data plane's receivers do: on a multi-homed node the default route's
    address, the fallback, may not be the one the other sites reach)."""

    def __init__(
        self,
        read: Reader,
        host: str = "127.0.0.1",
        creds: RunCredentials | None = None,
        advertise_host: str | None = None,
    ) -> None:
        self._read = read
        self._creds = creds
        listener = socket.create_server((host, 0), backlog=128)
        self.address = (advertise_host or advertised_host(host), listener.getsockname()[1])
        self._link = link_id(self.address)
        self.rejected = RejectLog("checkpoint chunk server")
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.gate = Gate(
            listener, creds, self._link, self._start, self.rejected, name="chunk-server"
        )

    def _start(self, conn: socket.socket, peer: tuple) -> None:
        """The gate's hand-over (on its thread): one serving thread per client."""
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        threading.Thread(target=self._serve, args=(conn,), name="chunk-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # This side sends the bulk. TCP-LP yields to other flows (it backs off as
                # soon as one-way delay grows), so copies would fill only the link's idle
                # time; where the kernel lacks it (here: reno, bbr, cubic) cubic, fair to
                # the training stream, with the reader's pacing leaving the activations
                # their share.
                set_congestion(conn, "lp") or set_congestion(conn, "cubic")
                while self._answer(conn):
                    pass
        except OSError:
            pass  # the client went away, or close() dropped it
        finally:
            with self._lock:
                self._conns.discard(conn)

    def _answer(self, conn: socket.socket) -> bool:
        """Read one request and send its reply; False once the connection is done."""
        head = _recv(conn, _REQ.size)
        if head is None:
            return False
        (n,) = _REQ.unpack(head)
        body = _recv(conn, n) if 0 < n <= _MAX_REQUEST else None
        if body is None:
            return False  # a broken or hostile request: drop the connection
        try:
            req = json.loads(body)
            data = self._read(
                int(req["step"]), str(req["file"]), int(req["offset"]), int(req["size"])
            )
            status, payload = 0, bytes(data)
        except Exception as exc:  # any reason: the client gets it as a message
            status, payload = 1, f"{type(exc).__name__}: {exc}".encode()[:_MAX_ERROR]
        conn.sendall(_REP.pack(status, len(payload)) + payload)
        return True

    def close(self) -> None:
        """Stop accepting and drop every connection, those being served included (a reply
        being sent is cut off: its client gets a `ChunkError`)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        self.gate.close()
        for c in conns:
            shutdown_socket(c)


class ChunkClient:
    """One connection to a :class:`ChunkServer`; :meth:`read_all` pipelines requests.

    Connecting tries again within ``connect_timeout_s`` when the server's gate sheds the
    handshake (`dial`), but not when nothing listens: the caller then falls back at once."""

    def __init__(
        self,
        address: tuple[str, int],
        timeout_s: float = 120.0,
        creds: RunCredentials | None = None,
        connect_timeout_s: float = 30.0,
    ) -> None:
        try:
            sock, _ = dial(address, creds, min(timeout_s, connect_timeout_s), retry_refused=False)
        except DialError as exc:
            raise ChunkError(f"cannot reach the chunk server at {address}: {exc}") from None
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock

    def read_all(
        self,
        step: int,
        file: str,
        pieces: list[tuple[int, int]],
        in_flight: int = 2,
        deadline: float | None = None,
    ) -> Iterator[bytes]:
        """The bytes of each ``(offset, size)`` piece, in order, ``in_flight`` asked ahead.
        ``deadline`` (a ``time.monotonic()`` instant): past it `ChunkTimeout`, however
        slowly the bytes still come (it replaces the idle ``timeout_s`` for these reads)."""
        todo, asked = deque(pieces), deque()
        while todo or asked:
            while todo and len(asked) < in_flight:
                off, n = todo.popleft()
                body = json.dumps({"step": step, "file": file, "offset": off, "size": n}).encode()
                _arm(self._sock, deadline)
                try:
                    self._sock.sendall(_REQ.pack(len(body)) + body)
                except OSError as exc:
                    if isinstance(exc, TimeoutError) and deadline is not None:
                        raise _late() from None
                    raise ChunkError(f"chunk request failed: {exc}") from None
                asked.append(n)
            yield self._reply(file, asked.popleft(), deadline)

    def _reply(self, file: str, n: int, deadline: float | None = None) -> bytes:
        """The reply to a request for ``n`` bytes; its length is checked against what was
        asked before anything is allocated for it (a short piece: the file ends there)."""
        by = () if deadline is None else (deadline,)  # without one: the call as it was
        head = _recv(self._sock, _REP.size, *by)
        if head is None:
            raise ChunkError("the chunk server closed the connection")
        status, length = _REP.unpack(head)
        if length > (_MAX_ERROR if status else n):
            what = "error message" if status else f"reply to a request for {n} bytes"
            raise ChunkError(f"{file}: a {what} of {length} bytes is out of bounds")
        data = _recv(self._sock, length, *by)
        if data is None:
            raise ChunkError("the chunk server closed the connection mid-reply")
        if status:
            raise ChunkError(data.decode(errors="replace"))
        if len(data) != n:
            raise ChunkError(f"{file}: got {len(data)} bytes, asked {n}")
        return data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def _arm(sock: socket.socket, deadline: float | None) -> None:
    """With a deadline: the socket's timeout becomes the time left (`ChunkTimeout` if none)."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise _late()
    sock.settimeout(left)


def _late() -> ChunkTimeout:
    return ChunkTimeout("the read's deadline passed before its replies were complete")


def _recv(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """Exactly ``n`` bytes, or None if the peer closed first (or went idle past the
    socket's timeout); past ``deadline``, `ChunkTimeout`."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        _arm(sock, deadline)
        try:
            k = sock.recv_into(view[got:])
        except OSError as exc:
            if isinstance(exc, TimeoutError) and deadline is not None:
                raise _late() from None  # the timeout was the time left
            return None
        if k == 0:
            return None
        got += k
    return bytes(buf)
