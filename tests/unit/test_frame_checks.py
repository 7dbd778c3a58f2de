"""Frames from an authenticated peer are checked before anything is allocated (issue 33,
item 3, the transport's part), on 127.0.0.1 without Ray.

A peer of the run (it passed the handshake) writes raw frames: a wrong shape, a shape whose
product wraps to 0 in 64 bits, a wrong dtype, a future key, NaNs. Each is refused before its
payload is allocated, and the consumer learns it at once with a message naming the peer —
never by waiting out its receive timeout. Without a plan, a frame filed early under a future
key no longer makes the genuine one be dropped as a duplicate in silence."""

from __future__ import annotations

import json
import threading
import time
import zlib

import numpy as np
import pytest
import torch

from geopipe.transport import frames, receiver
from geopipe.transport.channel import Inbox
from geopipe.transport.codec import make_codec
from geopipe.transport.dial import dial
from geopipe.transport.direct import DirectReceiver, DirectSender
from geopipe.transport.expect import ExpectedFrames, FrameSpec, all_finite
from geopipe.transport.frames import StreamCorruptError, encode_frame
from geopipe.transport.seal import CorruptPayloadError, seal
from geopipe.transport.security import make_credentials

pytestmark = pytest.mark.timeout(60)

CREDS = make_credentials("run-f", encrypt=False)
SHAPE = (2, 4, 8)
SPEC = FrameSpec(shapes=frozenset({SHAPE}), dtypes=frozenset({"float32"}), key_len=3, step_at=1)


def plan(finite: bool = False) -> ExpectedFrames:
    expect = ExpectedFrames({"F": SPEC, "B": SPEC}, ahead=1, finite=finite)
    expect.at_step(0)
    return expect


def frame(key, x: torch.Tensor, seq: int = 0, codec: str = "none") -> bytes:
    enc = make_codec(codec).encode(x, key="s", direction="forward")
    return b"".join(bytes(b) for b in encode_frame(key, seal(enc), seq, 0.0))


def raw_frame(meta: dict, payload: bytes = b"", seq: int = 0) -> bytes:
    """A frame with any header at all, its checksums right (as a peer of the run can)."""
    header = json.dumps(meta).encode()
    prefix = frames._PREFIX.pack(
        frames._MAGIC, frames._VERSION, 0, len(header), len(payload), seq, 0.0, 0.0, 0
    )
    hcrc = frames._HCRC.pack(zlib.crc32(header, zlib.crc32(prefix)))
    return prefix + hcrc + header + payload


def meta(**changes) -> dict:
    base = {
        "key": ["F", 0, 0],
        "codec": "none",
        "shape": list(SHAPE),
        "dtype": "float32",
        "dir": "forward",
        "arrays": [["<f4", [64]]],
    }
    return {**base, **changes}


@pytest.fixture
def rx():
    inbox = Inbox()
    r = DirectReceiver(inbox, creds=CREDS, max_payload=1 << 20, expect=plan())
    yield r
    r.close()
    inbox.close()


def peer(rx: DirectReceiver):
    """An authenticated connection to ``rx`` (plain run: writes go straight out)."""
    sock, _ = dial(rx.address, CREDS, timeout_s=10, sealed=True)
    return sock


def dropped(sock) -> bool:
    """The receiver closed the connection (a reset when the refused payload went unread)."""
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def refused_at_once(rx: DirectReceiver, data: bytes, match: str) -> None:
    sock = peer(rx)
    try:
        sock.sendall(data)
        t0 = time.monotonic()
        with pytest.raises(StreamCorruptError, match=match) as info:
            rx.inbox.get(("F", 0, 0), timeout=30)
        assert time.monotonic() - t0 < 20  # failed by the reader, not the consumer's timeout
        assert "peer ('127.0.0.1'," in str(info.value)
        assert dropped(sock)
    finally:
        sock.close()
    assert rx.refused.count >= 1


def test_a_frame_of_the_plan_is_filed(rx) -> None:
    sock = peer(rx)
    x = torch.randn(SHAPE)
    sock.sendall(frame(("F", 0, 0), x) + frame(("F", 1, 0), 2 * x, seq=1))
    assert torch.equal(rx.inbox.get(("F", 0, 0), timeout=10), x)
    assert torch.equal(rx.inbox.get(("F", 1, 0), timeout=10), 2 * x)
    sock.close()


def test_a_wrong_shape_is_refused(rx) -> None:
    refused_at_once(rx, frame(("F", 0, 0), torch.randn(2, 4, 9)), r"shape \[2, 4, 9\]")


def test_a_shape_whose_product_wraps_is_refused_before_allocation(rx) -> None:
    # 2^32 * 2^32 = 2^64 wraps to 0 in int64: the old check let an empty payload through
    wrap = [2**32, 2**32]
    assert int(np.prod(wrap, dtype=np.int64)) == 0
    refused_at_once(rx, raw_frame(meta(arrays=[["<f4", wrap]])), "malformed frame header")
    assert rx.messages == 0


def test_a_tensor_shape_beyond_the_payload_bound_is_refused_without_a_plan() -> None:
    inbox = Inbox()
    r = DirectReceiver(inbox, creds=CREDS, max_payload=1 << 20)  # no plan, only the bound
    try:
        # a top-k frame says little on the wire, but its decoding is 4 * numel bytes
        data = raw_frame(
            meta(codec="topk", shape=[2**21, 2**21, 2**21], arrays=[["<f4", [0]], ["<i4", [0]]])
        )
        refused_at_once(r, data, "over the bound")
    finally:
        r.close()
        inbox.close()


def test_a_wrong_dtype_is_refused(rx) -> None:
    x = torch.randn(SHAPE, dtype=torch.float64)
    refused_at_once(rx, frame(("F", 0, 0), x), "dtype float64")
    with pytest.raises(ValueError, match="unknown dtype"):
        frames.parse_header(meta(dtype="int64"), 256)


def test_a_future_key_is_refused_and_the_genuine_one_is_not_its_duplicate(rx) -> None:
    refused_at_once(rx, frame(("F", 5, 0), torch.randn(SHAPE)), r"step 5 outside the window")
    # a fresh inbox: the genuine frame of step 5, once the consumer is there, is filed
    rx.inbox = Inbox()
    rx.expect.at_step(5)
    tx = DirectSender(rx.address, "none", "forward", creds=CREDS)
    x = torch.randn(SHAPE)
    tx.send(("F", 5, 0), x, "a")
    tx.flush(timeout=10)
    assert torch.equal(rx.inbox.get(("F", 5, 0), timeout=10), x)
    tx.close()


def test_without_a_plan_a_duplicate_key_fails_that_key_not_silently() -> None:
    inbox = Inbox()
    r = DirectReceiver(inbox, creds=CREDS, max_payload=1 << 20)
    try:
        bogus, genuine = peer(r), DirectSender(r.address, "none", "forward", creds=CREDS)
        bogus.sendall(frame(("F", 5, 0), torch.zeros(SHAPE)))  # early, under a future key
        wait_for(lambda: r.messages == 1)
        genuine.send(("F", 5, 0), torch.ones(SHAPE), "a")
        genuine.flush(timeout=10)
        wait_for(lambda: r.errors)  # both are in before the consumer comes to the key
        with pytest.raises(CorruptPayloadError, match="a second frame for it arrived"):
            inbox.get(("F", 5, 0), timeout=10)  # never the bogus zeros
        bogus.close()
        genuine.close()
    finally:
        r.close()
        inbox.close()


def wait_for(cond, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cond()


def test_nans_are_refused_only_when_the_plan_expects_finite_values() -> None:
    x = torch.randn(SHAPE)
    x[0, 0, 0] = float("nan")
    for finite in (False, True):
        inbox = Inbox()
        r = DirectReceiver(inbox, creds=CREDS, max_payload=1 << 20, expect=plan(finite))
        try:
            sock = peer(r)
            sock.sendall(frame(("F", 0, 0), x) + frame(("F", 0, 1), torch.ones(SHAPE), seq=1))
            if finite:
                with pytest.raises(receiver.NonFiniteError, match="NaN or inf"):
                    inbox.get(("F", 0, 0), timeout=10)
            else:
                assert torch.isnan(inbox.get(("F", 0, 0), timeout=10)).any()
            # the stream itself was sound: the next frame arrives either way
            assert torch.equal(inbox.get(("F", 0, 1), timeout=10), torch.ones(SHAPE))
            sock.close()
        finally:
            r.close()
            inbox.close()


@pytest.mark.parametrize("codec", ["none", "bf16", "fp16", "int8", "int4"])
def test_finiteness_is_read_from_every_codecs_encoding(codec) -> None:
    x = torch.randn(4, 256)
    enc = make_codec(codec).encode(x, key="s", direction="forward")
    assert all_finite(enc)
    if codec != "int4":  # int4 refuses to encode NaN at the sender
        x[1, 3] = float("inf")
        assert not all_finite(make_codec(codec).encode(x, key="s", direction="forward"))


def test_a_reader_thread_that_dies_fails_the_inbox_at_once(rx, monkeypatch) -> None:
    def broken(*a, **k):
        raise RuntimeError("a bug no check anticipated")

    monkeypatch.setattr(receiver, "read_frame", broken)
    sock = peer(rx)
    try:
        t0 = time.monotonic()
        with pytest.raises(StreamCorruptError, match="RuntimeError: a bug no check"):
            rx.inbox.get(("F", 0, 0), timeout=30)
        assert time.monotonic() - t0 < 20
    finally:
        sock.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"key": [[[["F"]]]]},  # too deep
        {"key": ["F"] * 40},  # too long
        {"key": ["F", float("nan"), 0]},
        {"codec": "zip"},
        {"dir": "sideways"},
        {"shape": [-1, 64]},
        {"shape": [True, 64]},
        {"arrays": [["<f4", [64]]] * 5},
        {"arrays": [["O", [64]]]},
    ],
)
def test_malformed_headers_are_refused_by_the_parser(bad) -> None:
    with pytest.raises((ValueError, TypeError)):
        frames.parse_header(meta(**bad), 256)


def test_a_deeply_nested_header_does_not_kill_the_reader(rx) -> None:
    header = ("[" * 20000 + "]" * 20000).encode()  # RecursionError in json, not ValueError
    prefix = frames._PREFIX.pack(frames._MAGIC, frames._VERSION, 0, len(header), 0, 0, 0.0, 0.0, 0)
    data = prefix + frames._HCRC.pack(zlib.crc32(header, zlib.crc32(prefix))) + header
    refused_at_once(rx, data, "malformed frame header")


def test_a_refusal_is_logged_once_per_interval(rx, caplog) -> None:
    caplog.set_level("WARNING", logger="geopipe.transport.security")
    threads = []
    for _ in range(3):
        t = threading.Thread(
            target=lambda: refused_at_once(rx, frame(("Z", 0, 0), torch.randn(SHAPE)), "kind 'Z'")
        )
        threads.append(t)
        t.start()
        t.join()
        rx.inbox = Inbox()
    assert rx.refused.count == 3
    lines = [r for r in caplog.records if "frames of the run refused" in r.getMessage()]
    assert len(lines) == 1 and "127.0.0.1" in lines[0].getMessage()
