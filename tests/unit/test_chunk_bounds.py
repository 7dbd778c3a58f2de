"""The checkpoint chunk plane's smaller bounds (issue 33, item 7), on 127.0.0.1: the client
compares a reply's length with what it asked before allocating, and closing a server drops
the connections it is serving."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from geopipe.transport import bulk
from geopipe.transport.bulk import ChunkClient, ChunkError, ChunkServer
from geopipe.transport.security import make_credentials

pytestmark = pytest.mark.timeout(60)

BLOB = os.urandom(1 << 16)


def lying_server(status: int, length: int) -> tuple[str, int]:
    """Answers the first request with a reply header announcing ``length`` bytes."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(20)  # ends by itself even if the client never came

    def run() -> None:
        try:
            conn, _ = srv.accept()
        except OSError:
            srv.close()
            return
        with conn:
            (n,) = struct.unpack("<I", conn.recv(4))
            conn.recv(n)
            conn.sendall(struct.pack("<BQ", status, length) + b"x" * 16)
            time.sleep(1)
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()


@pytest.mark.parametrize("status", [0, 1], ids=["data", "error"])
def test_a_reply_longer_than_asked_is_refused_before_allocation(status, monkeypatch) -> None:
    asked = []
    real = bulk._recv
    monkeypatch.setattr(bulk, "_recv", lambda s, n: asked.append(n) or real(s, n))
    client = ChunkClient(lying_server(status, 1 << 28), timeout_s=10)
    try:
        with pytest.raises(ChunkError, match="out of bounds"):
            list(client.read_all(1, "f", [(0, 10)]))
        assert max(asked) <= 16  # no 256 MiB buffer for a 10-byte request
    finally:
        client.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "tls"])
def test_closing_a_chunk_server_drops_the_connections_it_serves(encrypt) -> None:
    creds = make_credentials("run-b", encrypt=encrypt)
    threads = threading.active_count()
    server = ChunkServer(lambda step, f, off, n: BLOB[off : off + n], creds=creds)
    client = ChunkClient(server.address, creds=creds, timeout_s=20)
    try:
        assert list(client.read_all(1, "f", [(0, 100)])) == [BLOB[:100]]
        server.close()
        t0 = time.monotonic()
        with pytest.raises(ChunkError, match="closed the connection"):
            list(client.read_all(1, "f", [(0, 100)]))
        assert time.monotonic() - t0 < 10  # at once, not at the client's 20 s timeout
    finally:
        client.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.02)
    assert threading.active_count() <= threads  # its serving thread ended
