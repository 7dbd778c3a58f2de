"""The authenticated (and encrypted) data plane, on 127.0.0.1 without Ray: a peer holding
the run's secret gets through, in plain and TLS mode; a stranger — random bytes, a valid
frame without the handshake, a length of 2^63, a replayed handshake, another run's secret
or certificate, plaintext to a TLS port — gets nothing, changes nothing (the inbox keeps
only the run's messages and stays healthy), and is counted. The same at the checkpoint
chunk server. Then a fuzz of 1,000 malformed connections at both servers."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import pytest
import torch

from geopipe.transport.bulk import ChunkClient, ChunkError, ChunkServer
from geopipe.transport.channel import Inbox
from geopipe.transport.codec import make_codec
from geopipe.transport.direct import DirectReceiver, DirectSender, PeerLostError
from geopipe.transport.frames import encode_frame
from geopipe.transport.seal import CorruptPayloadError, seal
from geopipe.transport.security import (
    HandshakeError,
    RunCredentials,
    client_handshake,
    link_id,
    make_credentials,
)

pytestmark = pytest.mark.timeout(120)

PLAIN = make_credentials("run-a", encrypt=False)
TLS = make_credentials("run-a", encrypt=True)
OTHER_TLS = make_credentials("run-b", encrypt=True)  # another run: its own CA


def test_credentials_never_print_their_secrets() -> None:
    for creds in (PLAIN, TLS):
        text = repr(creds) + str(creds)
        assert creds.secret.hex() not in text and "PRIVATE KEY" not in text
        assert creds.run_id in text
    assert TLS.encrypt and not PLAIN.encrypt and b"PRIVATE KEY" in TLS.key_pem


def frame_bytes(key=("F", 0, 0), seq: int = 0) -> bytes:
    enc = make_codec("none").encode(torch.ones(4, 8), key="s", direction="forward")
    return b"".join(bytes(b) for b in encode_frame(key, seal(enc), seq, 0.0))


def stranger(address, payload: bytes, hello: bytes = b"", reply_first: int = 0) -> bytes:
    """Connect, send ``payload``, return whatever comes back before the server closes.
    With ``hello``: send it first and read ``reply_first`` bytes of the answer before the
    payload (a server closing with bytes unread resets the connection, which can drop a
    reply not yet read)."""
    got = b""
    with socket.create_connection(address, timeout=5) as s:
        if hello:
            s.sendall(hello)
            while len(got) < reply_first and (chunk := s.recv(reply_first - len(got))):
                got += chunk
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(4096):
                got += chunk
        except OSError:
            pass
    return got


def replayed_handshake(address, creds: RunCredentials) -> bytes:
    """A genuine client's hello and answer from one connection, replayed on another."""
    from geopipe.transport import security

    cn = os.urandom(32)
    hello = b"GPAU" + bytes([1]) + cn
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(hello)
        sn = s.recv(32)
        answer = security._mac(creds, b"client", link_id(address), cn, sn)
        s.sendall(answer)
        assert s.recv(32) == security._mac(creds, b"server", link_id(address), cn, sn)
    # The replay: the same hello, the server's fresh nonce, then the same answer and a frame.
    return stranger(address, answer + frame_bytes(), hello=hello, reply_first=32)


@pytest.mark.parametrize("creds", [PLAIN, TLS], ids=["plain", "tls"])
def test_strangers_get_nothing_and_change_nothing(creds: RunCredentials) -> None:
    inbox = Inbox()
    rx = DirectReceiver(inbox, creds=creds, max_payload=1 << 20)
    try:
        tx = DirectSender(rx.address, "none", "forward", creds=creds)
        x = torch.randn(4, 16, 32)
        tx.send(("F", 0, 0), x, "a")
        attacks = [
            os.urandom(4096),
            frame_bytes(("F", 1, 0)),  # a valid-looking frame, no handshake
            b"GPDC" + bytes([2, 0]) + struct.pack("<HQ", 10, 2**63) + bytes(40),
            b"GPAU" + bytes([9]) + os.urandom(32),  # unknown handshake version
        ]
        for payload in attacks:
            assert stranger(rx.address, payload) in (b"",) or not creds.encrypt
        if not creds.encrypt:  # over TLS a replay cannot even start: it needs the run's cert
            assert len(replayed_handshake(rx.address, creds)) == 32  # a fresh nonce, no more
        with pytest.raises(PeerLostError, match="cannot authenticate"):
            DirectSender(
                rx.address,
                "none",
                "forward",
                creds=make_credentials("run-a", False),
                connect_timeout_s=5,
            )
        if creds.encrypt:
            with pytest.raises(PeerLostError, match="cannot authenticate"):
                DirectSender(rx.address, "none", "forward", creds=OTHER_TLS, connect_timeout_s=5)
        tx.send(("F", 1, 0), 2 * x, "a")  # the run's connection carries on, unharmed
        tx.flush(timeout=10)
        assert torch.equal(inbox.get(("F", 0, 0), timeout=10), x)
        assert torch.equal(inbox.get(("F", 1, 0), timeout=10), 2 * x)
        assert rx.errors == [] and rx.messages == 2
        # Refused: the four attacks, the other secret (and the other CA), the replay.
        want = 5 + (not creds.encrypt) + creds.encrypt
        deadline = time.monotonic() + 10
        while rx.rejected.count < want and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rx.rejected.count == want
        tx.close()
    finally:
        rx.close()
        inbox.close()


def test_an_oversized_frame_from_the_run_fails_the_link_not_the_process() -> None:
    inbox = Inbox()
    rx = DirectReceiver(inbox, creds=PLAIN, max_payload=4096)
    try:
        tx = DirectSender(rx.address, "none", "forward", creds=PLAIN)
        tx.send(("F", 0, 0), torch.zeros(2048), "a")  # 8 KiB > the bound
        with pytest.raises(CorruptPayloadError, match="exceeds the bound 4096"):
            inbox.get(("F", 0, 0), timeout=10)
        tx.close()
    finally:
        rx.close()


def test_tls_frames_written_in_parts_arrive_whole_and_in_order() -> None:
    """The sender seals frames into TLS records in memory and writes them like plain
    frames: inline writes the socket takes only in part (a small send buffer, a receiver
    that reads late) are finished by the writer thread, and large frames go through the
    encoder and writer threads, all in one TLS stream the receiver decrypts in order."""
    inbox = Inbox()
    rx = DirectReceiver(inbox, creds=TLS)
    tx = DirectSender(rx.address, "none", "forward", creds=TLS)
    try:
        tx._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        g = torch.Generator().manual_seed(0)
        sent = [torch.randn(n, generator=g) for n in [1 << 16] * 12 + [1 << 19] * 2 + [7]]
        for i, x in enumerate(sent):
            tx.send(("F", i, 0), x, "a")
        tx.flush(timeout=60)
        for i, x in enumerate(sent):
            assert torch.equal(inbox.get(("F", i, 0), timeout=30), x)
        assert tx.inline_messages > 0 and tx.inline_partial > 0  # both paths were taken
        assert tx.bytes_written > sum(x.numel() * 4 for x in sent)  # TLS records, not clear
    finally:
        tx.close()
        rx.close()


def test_plaintext_client_cannot_handshake_with_a_tls_server() -> None:
    rx = DirectReceiver(Inbox(), creds=TLS)
    try:
        with socket.create_connection(rx.address, timeout=5) as s, pytest.raises(HandshakeError):
            client_handshake(s, PLAIN.__class__(TLS.run_id, TLS.secret), link_id(rx.address))
    finally:
        rx.close()


@pytest.mark.parametrize("creds", [PLAIN, TLS], ids=["plain", "tls"])
def test_chunk_server_serves_only_the_run(creds: RunCredentials, tmp_path) -> None:
    blob = os.urandom(10_000)

    def read(step: int, file: str, offset: int, size: int) -> bytes:
        if file != "stage-0.safetensors":
            raise ValueError(f"not a checkpoint file: {file!r}")
        return blob[offset : offset + size]

    server = ChunkServer(read, creds=creds)
    try:
        request = b'{"step": 1, "file": "stage-0.safetensors", "offset": 0, "size": 100}'
        assert stranger(server.address, struct.pack("<I", len(request)) + request) == b""
        assert stranger(server.address, os.urandom(4096)) == b""
        other = make_credentials("run-b", encrypt=creds.encrypt)
        with pytest.raises(ChunkError):
            next(
                ChunkClient(server.address, creds=other, timeout_s=5).read_all(
                    1, "stage-0.safetensors", [(0, 10)]
                )
            )
        client = ChunkClient(server.address, creds=creds)
        got = b"".join(client.read_all(1, "stage-0.safetensors", [(0, 5000), (5000, 5000)]))
        assert got == blob
        with pytest.raises(ChunkError, match="not a checkpoint file"):
            next(client.read_all(1, "../../etc/passwd", [(0, 10)]))
        client.close()
        assert server.rejected.count >= 3
    finally:
        server.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_fuzz_a_thousand_malformed_connections_at_both_servers() -> None:
    """1,000 connections of malformed handshakes, frames and requests (seeded): no error
    reaches the inbox, no thread or descriptor is left behind, memory stays bounded, and
    the run's own connection works throughout."""
    import tracemalloc

    rng = random.Random(0)
    inbox = Inbox()
    rx = DirectReceiver(inbox, creds=PLAIN, max_payload=1 << 20)
    server = ChunkServer(lambda *a: b"x", creds=PLAIN)
    tx = DirectSender(rx.address, "none", "forward", creds=PLAIN)
    fds, threads = _open_fds(), threading.active_count()
    good = frame_bytes()
    tracemalloc.start()
    try:
        for i in range(1000):
            kind = rng.randrange(6)
            if kind == 0:
                payload = os.urandom(rng.randrange(1, 3000))
            elif kind == 1:
                payload = good[: rng.randrange(len(good))]
            elif kind == 2:  # a frame with random bytes flipped
                b = bytearray(good)
                for _ in range(rng.randrange(1, 8)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
                payload = bytes(b)
            elif kind == 3:  # a handshake hello then garbage for the answer
                payload = b"GPAU\x01" + os.urandom(32) + os.urandom(rng.randrange(0, 64))
            elif kind == 4:  # huge length prefixes
                payload = struct.pack("<IQ", 0xFFFFFFFF, 2**63) + os.urandom(16)
            else:
                payload = b""
            stranger(rx.address if i % 2 else server.address, payload)
            if i % 250 == 0:
                tx.send(("F", i, 0), torch.full((8,), float(i)), "a")
        tx.flush(timeout=10)
        for i in range(0, 1000, 250):
            assert torch.equal(inbox.get(("F", i, 0), timeout=10), torch.full((8,), float(i)))
        deadline = time.monotonic() + 20
        while (threading.active_count() > threads or _open_fds() > fds) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        tx.close()
        server.close()
        rx.close()
    assert rx.errors == [] and rx.messages == 4
    assert rx.rejected.count + server.rejected.count >= 990
    assert threading.active_count() <= threads and _open_fds() <= fds
    assert peak < 64 << 20, peak  # stated bound: 64 MiB of Python allocations at the peak
