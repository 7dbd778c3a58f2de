"""The outer exchange takes only the frames its partition layout expects (issue 33, item 3,
the outer loop's part): `OuterFrames` on an `OuterExchange`'s listener, on 127.0.0.1 with the
run's credentials and real sockets, without Ray.

An authenticated peer of the run sends an outer frame this replica cannot be waiting for — a
payload of the wrong size, the wrong dtype, a shape whose product wraps, a round far ahead, a
fragment, chunk or group that does not exist — and each is refused on its header (nothing
allocated for its payload), logged naming the peer, and its connection dropped; the inbox
stays open, so the same peer's correct frame on a new connection is still filed, and a
gather reports the group the frame claims missing at once (naming the refusal), for the
driver's group-loss path. Expected sizes are checked against real encodings of every codec;
payloads' values in tests/unit/test_outer_values.py."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import socket
import time
import zlib

import pytest
import torch

from geopipe.outer import ROW_LEN
from geopipe.outer.exchange import encode_delta
from geopipe.runtime.actor.outer_wire import (
    EncodedSender,
    OuterExchange,
    OuterFrames,
    OuterPeer,
    OuterSettings,
)
from geopipe.transport import frames, wire
from geopipe.transport.codec import make_codec
from geopipe.transport.dial import dial
from geopipe.transport.frames import FrameInfo, FrameRefusedError, StreamCorruptError
from geopipe.transport.security import make_credentials

pytestmark = pytest.mark.timeout(60)

CREDS = make_credentials("outer-frames", encrypt=False)
TAG = ("O", 1, 0)  # stage 1, ZeRO-1 partition 0
CHUNK = 4 * ROW_LEN
NUMELS = [6 * ROW_LEN + 17, 2 * ROW_LEN]  # fragment 0: chunks of 1024 and 553; fragment 1: 512
ROUNDS = {0: 3, 1: 0}  # this replica's round of each fragment


def settings(codec: str = "int8") -> OuterSettings:
    return OuterSettings(fragments=2, codec=codec, chunk_elems=CHUNK, topk_ratio=0.05)


def delta(numel: int, codec: str = "int8"):
    seed = {"seed": 7} if codec in wire.GROUPED else {}
    return encode_delta(torch.randn(numel), make_codec(codec, topk_ratio=0.05, **seed))


@pytest.fixture
def net():
    """This replica (group 0), its one peer (group 1) connected, and its frame plan."""
    a = OuterExchange("127.0.0.1", "127.0.0.1", CREDS, settings().max_payload, 10)
    b = OuterExchange("127.0.0.1", "127.0.0.1", CREDS, settings().max_payload, 10)
    a.connect([OuterPeer(1, b.address, "L")])
    a.expect(OuterFrames(settings(), TAG, NUMELS, ROUNDS.__getitem__))
    yield a
    a.close()
    b.close()


def header_bytes(key, codec="int8", shape=(3, ROW_LEN), dtype="float32", arrays=None) -> bytes:
    """A frame's prefix and header, announcing what the test says (no payload follows)."""
    arrays = [["|i1", [shape[0], ROW_LEN]], ["<f4", [shape[0]]]] if arrays is None else arrays
    plen = sum((4 if a[0] == "<f4" else 1) * math.prod(a[1]) for a in arrays) % (1 << 64)
    header = json.dumps(
        {
            "key": list(key),
            "codec": codec,
            "shape": list(shape),
            "dtype": dtype,
            "dir": "backward",
            "arrays": arrays,
        }
    ).encode()
    prefix = frames._PREFIX.pack(
        frames._MAGIC, frames._VERSION, 0, len(header), plen, 0, 0.0, 0.0, 0
    )
    return prefix + frames._HCRC.pack(zlib.crc32(header, zlib.crc32(prefix))) + header


def dropped(sock: socket.socket) -> bool:
    """Whether the receiver closed this connection (EOF, or a reset for unread bytes)."""
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


GOOD = (*TAG, 0, 3, 1, 1)  # fragment 0, round 3, group 1, chunk 1: 553 elements, 3 rows


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (  # the right shape, but arrays adding up to a payload larger than int8's
            header_bytes(GOOD, arrays=[["<f4", [3, ROW_LEN]], ["<f4", [3]]]),
            r"3084 payload bytes, expected 780",
        ),
        (header_bytes(GOOD, dtype="bfloat16"), "bfloat16 backward, expected float32"),
        (header_bytes(GOOD, shape=(4, ROW_LEN)), r"shape \[4, 256\], expected \[3, 256\]"),
        (  # 2^32 x 2^32 elements: 0 in numpy's int64 product, 2^64 in Python's
            header_bytes(GOOD, shape=(2**32, 2**32), arrays=[["|i1", [2**32, 2**32]]]),
            "over the bound|do not add up",
        ),
        (header_bytes((*TAG, 0, 9, 1, 1)), r"round 9 of fragment 0, expected 3 or 4"),
        (header_bytes((*TAG, 0, 2, 1, 1)), r"round 2 of fragment 0, expected 3 or 4"),
        (header_bytes((*TAG, 2, 0, 1, 0)), r"no fragment 2 \(of 2\)"),
        (header_bytes((*TAG, 0, 3, 1, 2)), "fragment 0 has no chunk 2"),
        (header_bytes((*TAG, 1, 0, 1, 1)), "fragment 1 has no chunk 1"),
        (header_bytes((*TAG, 0, 3, 5, 1)), r"group 5 is not a connected peer \(\[1\]\)"),
        (header_bytes((*TAG, 0, 3, 0, 1)), "group 0 is not a connected peer"),  # ours
        (header_bytes((*TAG, 0, 3, True, 1)), "must be integers"),
        (header_bytes(("O", 2, 0, 0, 3, 1, 1)), "not a key"),  # another stage's
        (header_bytes(GOOD, codec="int4"), "codec int4, expected int8"),
    ],
    ids=[
        "size",
        "dtype",
        "shape",
        "wrapping",
        "future",
        "past",
        "fragment",
        "chunk",
        "chunk-of-small-fragment",
        "group",
        "own-group",
        "bool",
        "stage",
        "codec",
    ],
)
def test_an_unexpected_outer_frame_is_refused_before_allocation(
    net, monkeypatch, request, raw, why
) -> None:
    allocated = []
    real_empty = frames.np.empty
    monkeypatch.setattr(
        frames.np, "empty", lambda n, **k: allocated.append(n) or real_empty(n, **k)
    )
    sock, _ = dial(net.address, CREDS, timeout_s=10, sealed=True)
    try:
        sock.sendall(raw)
        assert dropped(sock)  # the connection is dropped...
    finally:
        sock.close()
    assert allocated == []  # ...on the header: not a byte allocated for the payload
    deadline = time.monotonic() + 10
    while not net.inbox.failures and time.monotonic() < deadline:
        time.sleep(0.01)
    (failure,) = net.inbox.failures
    assert "peer ('127.0.0.1'," in str(failure)
    assert re.search(why, str(failure)), str(failure)
    assert net.receiver.refused.count == 1 and net.receiver.messages == 0
    # pinned on group 1 when the plan refused a frame claiming it (a connected peer); not
    # when it claims no peer, nor when the header failed the transport's own parse first
    claims_no_peer = request.node.callspec.id in {"group", "own-group", "bool", "stage"}
    claims_no_peer |= request.node.callspec.id == "wrapping"
    assert list(net.refused) == ([] if claims_no_peer else [1])
    # The same peer, on a new connection, with what the plan expects: filed.
    enc = delta(NUMELS[0] - CHUNK)
    sender = EncodedSender(net.address, CREDS)
    try:
        sender.send(GOOD, enc)
        got = net.inbox.get(GOOD, 10, strict=False)
    finally:
        sender.close()
    assert got.shape == (3, ROW_LEN)
    assert all((x == y).all() for x, y in zip(got.arrays, enc.arrays, strict=True))


def test_a_peer_whose_frame_was_refused_is_missing_at_once(net) -> None:
    """Its stream is gone (the connection dropped): the gather does not wait for it, and
    says why, for the driver's group-loss path; a strict get raises the failure at once.
    A refused frame that claims no peer is waited out instead
    (tests/unit/test_outer_values.py)."""
    sock, _ = dial(net.address, CREDS, timeout_s=10, sealed=True)
    try:
        sock.sendall(header_bytes((*TAG, 0, 40, 1, 0), shape=(4, ROW_LEN)))
        assert dropped(sock)
    finally:
        sock.close()
    t0 = time.monotonic()
    got, missing, _ = net.gather((*TAG, 0, 3), 2, timeout_s=30)
    assert time.monotonic() - t0 < 5
    assert got == {} and missing[1].startswith("refused: frame from peer ('127.0.0.1',")
    assert "round 40 of fragment 0, expected 3 or 4" in missing[1]
    with pytest.raises(StreamCorruptError, match="refused a frame from peer"):
        net.inbox.get(GOOD, 10)
    net.connect([OuterPeer(1, net.peers[1].address, "L")])  # paired again: waited for again
    assert net.refused == {}


@pytest.mark.parametrize("codec", wire.CODECS)
def test_every_codecs_real_chunks_are_expected(codec) -> None:
    """The sizes the plan expects are the codecs' own: every chunk of every fragment,
    encoded for real, passes; one byte more or a row less does not."""
    plan = OuterFrames(settings(codec), TAG, NUMELS, ROUNDS.__getitem__)
    plan.peers = frozenset({1, 2})
    for fragment, numel in enumerate(NUMELS):
        for c, start in enumerate(range(0, numel, CHUNK)):
            enc = delta(min(CHUNK, numel - start), codec)
            arrays = tuple((a.dtype, a.shape) for a in enc.arrays)
            for round_ in (ROUNDS[fragment], ROUNDS[fragment] + 1):
                key = (*TAG, fragment, round_, 2, c)
                info = FrameInfo(
                    key, codec, enc.shape, "float32", "backward", arrays, enc.payload_nbytes
                )
                assert plan.why_not(info) is None, (codec, key)
                more = dataclasses.replace(info, payload_nbytes=enc.payload_nbytes + 1)
                assert "payload bytes" in plan.why_not(more)
                rows = (enc.shape[0] - 1, ROW_LEN)
                assert "shape" in plan.why_not(dataclasses.replace(info, shape=rows))


def test_the_window_follows_this_replicas_round_and_its_peers() -> None:
    rounds = dict(ROUNDS)
    plan = OuterFrames(settings("none"), TAG, NUMELS, rounds.__getitem__)
    plan.peers = frozenset({1})
    enc = delta(2 * ROW_LEN, "none")
    arrays = tuple((a.dtype, a.shape) for a in enc.arrays)

    def info(round_: int) -> FrameInfo:
        key = (*TAG, 1, round_, 1, 0)
        return FrameInfo(key, "none", enc.shape, "float32", "backward", arrays, enc.payload_nbytes)

    assert plan.why_not(info(1)) is None
    with pytest.raises(FrameRefusedError, match="round 2 of fragment 1, expected 0 or 1"):
        plan(info(2))
    rounds[1] = 1  # this replica applied round 0
    assert plan.why_not(info(2)) is None
    assert "expected 1 or 2" in plan.why_not(info(0))  # a written-off group's late payload
    plan.peers = frozenset()  # group 1 dropped
    assert "not a connected peer" in plan.why_not(info(1))


def test_the_exchange_keeps_the_plans_peers(net) -> None:
    assert net.frames.peers == {1}
    net.drop([1])
    assert net.frames.peers == frozenset()
