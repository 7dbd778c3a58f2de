"""The data plane for checkpoint copies (geopipe.transport.bulk): a chunk server and a
pipelined client over real TCP sockets on loopback."""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading

import pytest

from geopipe.transport.bulk import ChunkClient, ChunkError, ChunkServer

FILES = {(3, "stage-0.safetensors"): os.urandom(9 << 20), (3, "manifest.json"): b"{}"}


def read(step: int, file: str, offset: int, size: int) -> bytes:
    if (step, file) not in FILES:
        raise FileNotFoundError(f"no {file} of step {step} here")
    return FILES[(step, file)][offset : offset + size]


@pytest.fixture
def server():
    srv = ChunkServer(read, "127.0.0.1")
    yield srv
    srv.close()


def pieces(n: int, size: int) -> list[tuple[int, int]]:
    return [(off, min(size, n - off)) for off in range(0, n, size)]


def test_pipelined_reads_return_every_piece_in_order(server) -> None:
    data = FILES[(3, "stage-0.safetensors")]
    client = ChunkClient(server.address)
    try:
        got = list(client.read_all(3, "stage-0.safetensors", pieces(len(data), 4 << 20), 2))
        assert [len(g) for g in got] == [4 << 20, 4 << 20, 1 << 20]
        assert hashlib.sha256(b"".join(got)).digest() == hashlib.sha256(data).digest()
        # the same connection serves the next file
        assert list(client.read_all(3, "manifest.json", [(0, 2)])) == [b"{}"]
    finally:
        client.close()


def test_concurrent_clients(server) -> None:
    data = FILES[(3, "stage-0.safetensors")]
    out: dict[int, bytes] = {}

    def fetch(i: int) -> None:
        c = ChunkClient(server.address)
        try:
            out[i] = b"".join(c.read_all(3, "stage-0.safetensors", pieces(len(data), 1 << 20), 3))
        finally:
            c.close()

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(out[i] == data for i in range(3))


def test_a_read_the_server_cannot_serve_names_the_cause(server) -> None:
    client = ChunkClient(server.address)
    try:
        with pytest.raises(ChunkError, match=r"no stage-9\.safetensors of step 3 here"):
            list(client.read_all(3, "stage-9.safetensors", [(0, 10)]))
        with pytest.raises(ChunkError, match="got 2 bytes, asked 10"):  # short file
            list(client.read_all(3, "manifest.json", [(0, 10)]))
    finally:
        client.close()


def test_unreachable_server_and_dropped_connection_are_chunk_errors(server) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(ChunkError, match="cannot reach"):
        ChunkClient(("127.0.0.1", port), timeout_s=2)
    # a hostile request (absurd length) makes the server drop that connection only
    with socket.create_connection(server.address) as raw:
        raw.sendall(struct.pack("<I", 1 << 30))
        assert raw.recv(1) == b""
    client = ChunkClient(server.address)
    try:
        assert list(client.read_all(3, "manifest.json", [(0, 2)])) == [b"{}"]
    finally:
        client.close()
    server.close()  # a closed server refuses new readers
    with pytest.raises(ChunkError, match="cannot reach"):
        ChunkClient(server.address, timeout_s=2)
