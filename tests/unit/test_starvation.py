"""No stranger can starve the data plane's listeners (issue 33, items 1 and 7), on
127.0.0.1 with real sockets, plain and TLS.

A stranger holds 48 idle sockets per listener (the direct receiver and the chunk server)
and reopens each one the server closes; meanwhile a peer of the run connects again and
again and exchanges frames and chunks: every time it gets through. Before the gate, 32
idle sockets were enough for the next authenticated client to fail at once with "peer
closed during the handshake". Then the gate's bounds one by one: a stranger over the
per-source bound (the oldest idle connection is shed, not the newcomer), one that starts
handshakes it cannot finish (the rate limit parks, never closes), and the clients' side:
a shed connection (reset) is tried again, a refusal (wrong secret) is not."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest
import torch
from _stranger import IdleStranger

from geopipe.transport import security
from geopipe.transport.bulk import ChunkClient, ChunkServer
from geopipe.transport.channel import Inbox
from geopipe.transport.dial import DialError, dial
from geopipe.transport.direct import DirectReceiver, DirectSender, PeerLostError
from geopipe.transport.security import RunCredentials, make_credentials

pytestmark = pytest.mark.timeout(120)

PLAIN = make_credentials("run-s", encrypt=False)
TLS = make_credentials("run-s", encrypt=True)
BLOB = os.urandom(1 << 16)


def read_blob(step: int, file: str, offset: int, size: int) -> bytes:
    return BLOB[offset : offset + size]


def exchange(rx: DirectReceiver, inbox: Inbox, creds: RunCredentials, round_: int) -> None:
    """One authenticated sender connects, sends three frames, and they all arrive."""
    tx = DirectSender(rx.address, "none", "forward", creds=creds, connect_timeout_s=20)
    try:
        xs = [torch.full((64,), float(round_ * 3 + i)) for i in range(3)]
        for i, x in enumerate(xs):
            tx.send(("F", round_, i), x, "a")
        tx.flush(timeout=20)
        for i, x in enumerate(xs):
            assert torch.equal(inbox.get(("F", round_, i), timeout=20), x)
        assert tx.clock_skew is not None and abs(tx.clock_skew.offset_s) < 5
    finally:
        tx.close()


@pytest.mark.parametrize("creds", [PLAIN, TLS], ids=["plain", "tls"])
def test_a_stranger_holding_48_idle_sockets_per_listener_starves_nobody(creds) -> None:
    inbox = Inbox()
    rx = DirectReceiver(inbox, creds=creds, max_payload=1 << 20)
    server = ChunkServer(read_blob, creds=creds)
    for gate in (rx.gate, server.gate):
        gate.FIRST_BYTES_S = 0.5  # shed sooner than the default, so the stranger reopens
    try:
        with IdleStranger(rx.address, 48) as s1, IdleStranger(server.address, 48) as s2:
            assert s1.opened >= 48 and s2.opened >= 48
            rounds, end = 0, time.monotonic() + 3.0
            while time.monotonic() < end or rounds < 3:
                exchange(rx, inbox, creds, rounds)
                client = ChunkClient(server.address, creds=creds, timeout_s=20)
                try:
                    got = b"".join(client.read_all(1, "f", [(0, 1 << 15), (1 << 15, 1 << 15)]))
                    assert got == BLOB
                finally:
                    client.close()
                rounds += 1
            # the stranger was shed (reset) and came back, and never got a thread
            deadline = time.monotonic() + 10
            while min(s1.reopened, s2.reopened) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert s1.reopened > 0 and s2.reopened > 0
            assert rx.gate.shed > 0 and server.gate.shed > 0
        assert rx.errors == [] and rx.messages == 3 * rounds
    finally:
        server.close()
        rx.close()
        inbox.close()


def test_over_the_per_source_bound_the_oldest_idle_is_shed_not_the_newcomer() -> None:
    inbox = Inbox()
    rx = DirectReceiver(inbox, creds=TLS)
    rx.gate.MAX_PENDING_PER_SOURCE = 16  # the stranger holds three times that
    rx.gate.MAX_PENDING = 24
    try:
        with IdleStranger(rx.address, 48, seconds=30) as stranger:
            for r in range(3):
                exchange(rx, inbox, TLS, r)
            assert stranger.reopened > 0  # shed to make room, over and over
            assert rx.gate.pending <= 24
    finally:
        rx.close()
        inbox.close()


def test_a_stranger_starting_handshakes_it_cannot_finish_is_rate_limited_not_served() -> None:
    """Each stranger connection sends a hello at once (so it is never idle): the source's
    budget runs out, later connections wait unread; the peer still gets through."""
    inbox = Inbox()
    rx = DirectReceiver(inbox, creds=PLAIN)
    rx.gate.RATE, rx.gate.BURST = 20.0, 20.0
    rx.gate._budget.rate, rx.gate._budget.burst = 20.0, 20.0
    rx.gate.HANDSHAKE_S = 1.0
    hello = b"GPAU\x01" + os.urandom(32)
    try:
        with IdleStranger(rx.address, 48, seconds=30, hello=hello):
            time.sleep(0.5)
            for r in range(2):
                exchange(rx, inbox, PLAIN, r)
        assert rx.messages == 6
        assert rx.gate.waited > 0  # the budget ran out: connections waited, unread
    finally:
        rx.close()
        inbox.close()


def _resetting_then_serving(resets: int, creds: RunCredentials, served: list[int]):
    """A listener that resets its first ``resets`` connections (as a gate shedding load
    does), then runs the blocking server handshake on the next."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(20)  # ends by itself even if the client gave up
    link = security.link_id(srv.getsockname())

    def run() -> None:
        for i in range(resets + 1):
            try:
                conn, _ = srv.accept()
            except OSError:
                break
            if i < resets:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
                continue
            try:
                security.server_handshake(conn, creds, link).close()
                served.append(i)
            except security.HandshakeError:
                conn.close()
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()


@pytest.mark.parametrize("creds", [PLAIN, TLS], ids=["plain", "tls"])
def test_a_shed_handshake_is_tried_again_with_backoff(creds) -> None:
    served: list[int] = []
    address = _resetting_then_serving(3, creds, served)
    sock, _ = dial(address, creds, timeout_s=20)
    sock.close()
    deadline = time.monotonic() + 5
    while not served and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served == [3]


def test_a_refusal_is_not_tried_again() -> None:
    inbox = Inbox()
    rx = DirectReceiver(inbox, creds=PLAIN)
    try:
        with pytest.raises(PeerLostError, match="cannot authenticate"):
            other = make_credentials("run-s", encrypt=False)  # another secret
            DirectSender(rx.address, "none", "forward", creds=other, connect_timeout_s=20)
        time.sleep(0.3)
        assert rx.rejected.count == 1  # one try, one line in the log
        with pytest.raises(DialError, match="cannot connect"):  # nothing listens: at once
            dial(("127.0.0.1", _closed_port()), PLAIN, timeout_s=20, retry_refused=False)
    finally:
        rx.close()
        inbox.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_closing_a_listener_resets_pending_handshakes_and_frees_everything() -> None:
    fds = len(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    rx = DirectReceiver(Inbox(), creds=TLS)
    with IdleStranger(rx.address, 20, seconds=30) as stranger:
        deadline = time.monotonic() + 5
        while rx.gate.pending < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx.gate.pending == 20  # twenty idle sockets, no thread for any
        assert threading.active_count() <= threads + 2  # the gate and the stranger
        rx.close()
        deadline = time.monotonic() + 5
        while stranger.reopened < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stranger.reopened >= 20
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/fd")) > fds and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) <= fds
