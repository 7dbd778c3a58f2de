"""The direct cross-site channel over real TCP on 127.0.0.1, without Ray: order, integrity,
codecs, emulated pacing, reconnection after a peer is replaced, and failing fast."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Hashable, Iterator

import numpy as np
import pytest
import torch

from geopipe.transport.channel import Inbox
from geopipe.transport.codec import CODECS, decode, make_codec
from geopipe.transport.direct import DirectReceiver, DirectSender, PeerLostError
from geopipe.transport.frames import encode_frame, read_frame
from geopipe.transport.link import LinkParams, MailboxClosedError
from geopipe.transport.seal import CorruptPayloadError, open_sealed, seal
from geopipe.transport.wire import wire_bytes

pytestmark = pytest.mark.timeout(30)


class RecordingInbox(Inbox):
    """An inbox that remembers the order messages were filed in."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[Hashable] = []

    def deliver_sealed(self, key, sealed, deliver_at, sent_at=0.0) -> None:
        self.order.append(key)
        super().deliver_sealed(key, sealed, deliver_at)


@pytest.fixture
def pair() -> Iterator[tuple[RecordingInbox, DirectReceiver]]:
    inbox = RecordingInbox()
    rx = DirectReceiver(inbox, host="127.0.0.1")
    yield inbox, rx
    rx.close()
    inbox.close()


def _raw_connect(rx: DirectReceiver) -> socket.socket:
    return socket.create_connection(rx.address, timeout=5)


def test_mixed_sizes_arrive_in_program_order_bit_exact(pair):
    inbox, rx = pair
    tx = DirectSender(rx.address, "none", "forward")
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 7, 1000, 3, 300_000, 17, 1 << 20, 0, 64 * 1024]
    sent = []
    for i in range(45):
        n = sizes[i % len(sizes)]
        dtype = torch.bfloat16 if i % 5 == 4 else torch.float32
        x = torch.randn(n, generator=gen).to(dtype).reshape(-1, 1) if n else torch.zeros(0, 3)
        key = ("F", i // 10, i % 10)
        assert tx.send(key, x, stream="s") == wire_bytes(
            "none", x.numel(), x.shape[-1], x.element_size(), "forward"
        )
        sent.append((key, x))
    tx.flush(timeout=10)
    for key, x in sent:
        y = inbox.get(key, timeout=10)
        assert y.dtype == torch.float32 and y.shape == x.shape
        assert torch.equal(y, x.float())
    assert inbox.order == [k for k, _ in sent]
    assert rx.errors == []
    tx.close()


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_every_codec_round_trips(pair, codec, direction):
    inbox, rx = pair
    tx = DirectSender(rx.address, codec, direction, topk_ratio=0.1)
    ref = make_codec(codec, topk_ratio=0.1)  # same state evolution as the sender's codec
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 8, 16, generator=gen) for _ in range(3)]
    for i, x in enumerate(xs):
        tx.send(("B", 0, i), x, stream="mb0")
    for i, x in enumerate(xs):
        expect = decode(ref.encode(x, key="mb0", direction=direction))
        assert torch.equal(inbox.get(("B", 0, i), timeout=10), expect)
    if codec == "topk" and direction == "backward":
        assert set(tx.codec_state()) == {"mb0"}
    tx.close()


def test_corrupt_payload_reaches_the_consumer_as_an_error(pair):
    inbox, rx = pair
    good = seal(make_codec("int8").encode(torch.randn(4, 16)))
    with _raw_connect(rx) as s:
        bad = encode_frame(("F", 0, 0), good, seq=0, deliver_at=0.0)
        payload = bytearray(bad[1])
        payload[3] ^= 0x10  # one bit flipped in flight
        s.sendall(b"".join([bytes(bad[0]), bytes(payload), *map(bytes, bad[2:])]))
        # The stream stays in sync: the next frame on the same connection is fine.
        s.sendall(b"".join(map(bytes, encode_frame(("F", 0, 1), good, seq=1, deliver_at=0.0))))
        with pytest.raises(CorruptPayloadError):
            inbox.get(("F", 0, 0), timeout=5)
        assert torch.equal(inbox.get(("F", 0, 1), timeout=5), decode(good.enc))


def test_corrupt_header_fails_the_inbox(pair):
    inbox, rx = pair
    frame = encode_frame(("F", 0, 0), seal(make_codec("none").encode(torch.ones(8))), 0, 0.0)
    head = bytearray(frame[0])
    head[-5] ^= 0x01  # inside the JSON header (the key)
    with _raw_connect(rx) as s:
        s.sendall(bytes(head) + b"".join(map(bytes, frame[1:])))
        with pytest.raises(CorruptPayloadError, match="header"):
            inbox.get(("F", 0, 0), timeout=5)
        with pytest.raises(CorruptPayloadError):  # and everything after it
            inbox.get(("F", 0, 1), timeout=5)


def test_link_emulator_paces_delivery(pair):
    inbox, rx = pair
    link = LinkParams(bandwidth_bps=100e6, latency_s=0.02)
    tx = DirectSender(rx.address, "none", "forward", link=link)
    x = torch.randn(64 * 1024)  # 256 KiB: 21 ms at 100 Mbit/s
    ser = x.numel() * 4 * 8 / link.bandwidth_bps
    t0 = time.monotonic()
    for i in range(3):
        tx.send(("F", 0, i), x, stream="s")
    for i in range(3):
        inbox.get(("F", 0, i), timeout=5)
        due = t0 + link.latency_s + (i + 1) * ser
        now = time.monotonic()
        assert now >= due - 1e-3
        assert now <= due + 0.1  # the transport kept draining while data was held back
    tx.close()


def test_reconnect_to_a_replaced_peer():
    inbox_a = Inbox()
    rx_a = DirectReceiver(inbox_a, host="127.0.0.1")
    tx = DirectSender(rx_a.address, "topk", "backward", topk_ratio=0.25)
    x = torch.randn(4, 32)
    tx.send(("B", 0, 0), x, stream="mb0")
    inbox_a.get(("B", 0, 0), timeout=5)
    state = tx.codec_state()
    rx_a.close()  # the peer actor died; recovery builds a new one
    inbox_a.close()
    inbox_b = Inbox()
    rx_b = DirectReceiver(inbox_b, host="127.0.0.1")
    try:
        tx.reconnect(rx_b.address)
        tx.send(("B", 1, 0), x, stream="mb0")
        tx.flush(timeout=5)
        got = inbox_b.get(("B", 1, 0), timeout=5)
        ref = make_codec("topk", topk_ratio=0.25)
        ref.load_state_dict(state)  # error feedback survived the reconnection
        assert torch.equal(got, decode(ref.encode(x, key="mb0", direction="backward")))
        # A brand-new sender to the same receiver works too (its frames restart at 0).
        tx2 = DirectSender(rx_b.address, "none", "backward")
        tx2.send(("B", 1, 1), x, stream="mb1")
        assert torch.equal(inbox_b.get(("B", 1, 1), timeout=5), x)
        tx2.close()
        tx.close()
    finally:
        rx_b.close()
        inbox_b.close()


def _silent_peer() -> tuple[socket.socket, tuple[str, int], list[socket.socket]]:
    """A peer that accepts but never reads, as a hung or frozen actor would."""
    srv = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []
    threading.Thread(target=lambda: conns.append(srv.accept()[0]), daemon=True).start()
    return srv, srv.getsockname()[:2], conns


def test_dead_peer_makes_a_blocked_flush_raise():
    srv, addr, conns = _silent_peer()
    tx = DirectSender(addr, "none", "forward")
    big = torch.randn(4 << 20)  # 16 MiB per message: far beyond the socket buffers
    for i in range(3):
        tx.send(("F", 0, i), big, stream="s")
    with pytest.raises(TimeoutError):
        tx.flush(timeout=0.5)  # blocked: the peer does not read
    killer = threading.Timer(0.2, lambda: conns[0].close())  # dies with unread data: RST
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(PeerLostError):
        tx.flush(timeout=10)
    assert time.monotonic() - t0 < 5
    with pytest.raises(PeerLostError):
        tx.send(("F", 0, 9), big, stream="s")  # later sends fail at once
    tx.close()
    srv.close()


def test_inline_writes_that_fill_the_buffer_stay_in_order():
    """Small messages sent while nothing is queued are written by the caller's thread (see
    DirectSender's note); when the socket buffer fills mid-frame the writer thread finishes
    that frame before any later one, so the peer reads every frame whole and in order."""
    srv, addr, conns = _silent_peer()
    tx = DirectSender(addr, "none", "forward")
    gen = torch.Generator().manual_seed(1)
    sent = [torch.randn(60_000 + 7 * i, generator=gen) for i in range(120)]  # ~29 MB in all
    for i, x in enumerate(sent):
        tx.send(("F", 0, i), x, stream="s")
        if i < 40:
            time.sleep(0.002)  # some idle moments: each next send finds the queue empty
    assert tx.inline_messages >= 1 and tx.inline_partial >= 1
    with pytest.raises(TimeoutError):
        tx.flush(timeout=0.3)  # the peer has not read yet: frames wait in order
    got: list[tuple] = []

    def read() -> None:
        while (frame := read_frame(conns[0])) is not None:
            got.append(frame)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    tx.flush(timeout=20)
    tx.close()
    reader.join(timeout=20)
    assert [key for key, *_ in got] == [("F", 0, i) for i in range(len(sent))]
    assert [seq for _, seq, *_ in got] == list(range(len(sent)))
    for (_, _, sealed, _, _), x in zip(got, sent, strict=True):
        assert torch.equal(decode(open_sealed(sealed)), x)
    codec = make_codec("none")
    frames = [
        encode_frame(("F", 0, i), seal(codec.encode(x, key="s", direction="forward")), i, 0, 0)
        for i, x in enumerate(sent)
    ]
    assert tx.bytes_written == sum(b.nbytes for f in frames for b in f)
    srv.close()


def test_closed_receiver_makes_flush_raise(pair):
    inbox, rx = pair
    tx = DirectSender(rx.address, "none", "forward")
    tx.send(("F", 0, 0), torch.ones(4), stream="s")
    inbox.get(("F", 0, 0), timeout=5)
    rx.close()
    with pytest.raises(PeerLostError):  # the first write may still land in the buffer
        for i in range(1, 200):
            tx.send(("F", 0, i), torch.ones(64 * 1024), stream="s")
            tx.flush(timeout=5)
            time.sleep(0.01)
    tx.close()


def test_waiting_receive_fails_fast_on_inbox_close(pair):
    inbox, _ = pair
    threading.Timer(0.1, inbox.close).start()
    t0 = time.monotonic()
    with pytest.raises(MailboxClosedError):
        inbox.get(("F", 0, 0))
    assert time.monotonic() - t0 < 2


def test_unserialisable_key_is_rejected_at_send(pair):
    _, rx = pair
    tx = DirectSender(rx.address, "none", "forward")
    with pytest.raises(TypeError):
        tx.send(("F", object()), torch.ones(1), stream="s")
    tx.close()


def test_header_is_compact_and_not_pickle():
    frame = encode_frame(("F", 12, 3), seal(make_codec("none").encode(torch.ones(2, 3))), 5, 0.0)
    head = bytes(frame[0])
    assert len(head) < 160 and b'"key":["F",12,3]' in head
    assert np.frombuffer(frame[1], dtype=np.float32).tolist() == [1.0] * 6
