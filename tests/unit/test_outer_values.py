"""What an outer payload may hold (issue 33, item 3, the outer exchange's values): a peer's
payload holding NaN, inf or a value beyond ``MAX_ABS`` once decoded is refused before it is
filed, and this replica's own is never sent ([Note: what an outer payload may hold] in
geopipe.runtime.actor.outer_frames). On 127.0.0.1 with the run's credentials and real
sockets, without Ray.

* a peer (authenticated, sending well-formed frames of the plan's sizes) whose payload
  decodes to NaN or inf — codec none's values, an int8 scale that is inf or whose finite
  value overflows the decode, an int4h fp16 scale of inf — or to a value beyond 2^100: the
  receiver logs the refusal once naming the peer, drops the connection, never files the
  payload, and the gather reports that group missing, refused, at once (not after its wait);
* a refusal whose frame claims no peer group is waited out and named when the wait ends;
* chunks a gather took are kept until the round is applied (the driver asks in slices): a
  payload arriving across two slices is gathered whole, and asked again, at once;
* a replica whose own pseudo-gradient is not finite, overflows, or does not fit its codec
  raises a model error naming the fragment and sends nothing; the driver reads it as the
  model's error (`raise_model_error`), not a lost site;
* OuterLoop.gather: a refused peer is answered at once, then at the slice's pace.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from geopipe.outer import ROW_LEN, average_encoded
from geopipe.outer.exchange import encode_delta
from geopipe.runtime.actor import outer as outer_mod
from geopipe.runtime.actor.gradnorm import ModelError
from geopipe.runtime.actor.outer import OuterLoop
from geopipe.runtime.actor.outer_wire import (
    MAX_ABS,
    EncodedSender,
    OuterExchange,
    OuterFrames,
    OuterPeer,
    OuterSettings,
    bad_values,
)
from geopipe.runtime.control.health import ModelFailed, raise_model_error
from geopipe.runtime.control.workers import WorkerFailed
from geopipe.transport.codec import Encoded, make_codec
from geopipe.transport.security import make_credentials

pytestmark = pytest.mark.timeout(60)

CREDS = make_credentials("outer-values", encrypt=False)
TAG = ("O", 1, 0)  # stage 1, ZeRO-1 partition 0
CHUNK = 4 * ROW_LEN
NUMEL = CHUNK + 3 * ROW_LEN  # one fragment of two chunks: 1024 and 768 elements


def settings(codec: str) -> OuterSettings:
    return OuterSettings(fragments=1, codec=codec, chunk_elems=CHUNK)


def chunk(numel: int, codec: str, scale: float = 1.0) -> Encoded:
    seed = {"seed": 11} if codec == "int4h" else {}
    return encode_delta(scale * torch.randn(numel), make_codec(codec, **seed))


def swap(enc: Encoded, i: int, a: np.ndarray) -> Encoded:
    """``enc`` with array ``i`` replaced: the same sizes on the wire, so its header passes."""
    arrays = list(enc.arrays)
    assert a.dtype == arrays[i].dtype and a.shape == arrays[i].shape
    arrays[i] = a
    return dataclasses.replace(enc, arrays=tuple(arrays))


def poisoned(codec: str, how: str) -> Encoded:
    """A real chunk of ``codec`` (chunk 1: 768 elements, 3 rows) made to decode badly."""
    enc = chunk(NUMEL - CHUNK, codec)
    if codec == "none":
        v = enc.arrays[0].copy()
        v[5] = {"nan": np.nan, "inf": -np.inf, "huge": 3e30}[how]
        return swap(enc, 0, v)
    if codec == "int8":  # every row holds a code of +-127 (its absmax)
        s = enc.arrays[1].copy()
        s[1] = {"inf": np.inf, "overflow": 3e38}[how]  # 3e38 x 127 decodes to inf
        return swap(enc, 1, s)
    s = enc.arrays[1].copy()  # int4h: fp16 scales, one per group of 64
    s[2] = {"inf": np.float16(np.inf), "nan": np.float16(np.nan)}[how]
    return swap(enc, 1, s)


def dropped(sender: EncodedSender) -> bool:
    """Whether the receiver closed the sender's connection (EOF, or a reset for unread
    bytes)."""
    sender._sock.settimeout(10)
    try:
        return sender._sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def net():
    """This replica (group 0) with one connected peer (group 1) and its frame plan."""

    def make(codec: str) -> OuterExchange:
        a = OuterExchange("127.0.0.1", "127.0.0.1", CREDS, settings(codec).max_payload, 10)
        made.append(a)
        a.connect([OuterPeer(1, a.address, "L")])  # any listener: only the group matters
        a.expect(OuterFrames(settings(codec), TAG, [NUMEL], lambda f: 0))
        return a

    made: list[OuterExchange] = []
    yield make
    for a in made:
        a.close()


CASES = [
    ("none", "nan", "holds NaN or inf"),
    ("none", "inf", "holds NaN or inf"),
    ("none", "huge", "magnitude 3e[+]30, over the bound 2\\^100"),
    ("int8", "inf", "holds NaN or inf"),
    ("int8", "overflow", "holds NaN or inf"),  # a finite scale decoding to inf
    ("int4h", "inf", "holds NaN or inf"),
    ("int4h", "nan", "holds NaN or inf"),
]


@pytest.mark.parametrize(("codec", "how", "why"), CASES, ids=[f"{c}-{h}" for c, h, _ in CASES])
def test_a_payload_that_decodes_to_bad_values_is_refused(net, caplog, codec, how, why) -> None:
    a = net(codec)
    good = chunk(CHUNK, codec)
    sender = EncodedSender(a.address, CREDS)  # a real peer of the run, group 1
    try:
        with caplog.at_level(logging.WARNING, "geopipe.transport.security"):
            sender.send((*TAG, 0, 0, 1, 0), good)  # chunk 0: fine
            sender.send((*TAG, 0, 0, 1, 1), poisoned(codec, how))  # chunk 1: refused
            assert dropped(sender)  # the receiver dropped the connection
            t0 = time.monotonic()
            got, missing, _ = a.gather((*TAG, 0, 0), 2, timeout_s=20)
            waited = time.monotonic() - t0
    finally:
        sender.close()
    assert waited < 5  # at once, not after the round's wait
    assert got == {} and missing[1].startswith("refused: frame from peer ('127.0.0.1',")
    assert re.search(why, missing[1]), missing[1]
    assert a.refused == {1: missing[1].removeprefix("refused: ")}
    assert a.receiver.refused.count == 1 and a.receiver.messages == 1  # chunk 0 only
    (record,) = [r for r in caplog.records if "refused" in r.getMessage()]
    assert "('127.0.0.1'," in record.getMessage() and "outer payload" in record.getMessage()
    with pytest.raises(TimeoutError):  # never filed: no apply can average it
        a.inbox.get((*TAG, 0, 0, 1, 1), 0.2, strict=False)


@pytest.mark.parametrize("codec", ["none", "int8", "int4h"])
def test_the_same_payload_unpoisoned_is_gathered_and_averaged(net, codec) -> None:
    """The check refuses what it should only: real chunks pass and average as sent."""
    a = net(codec)
    chunks = [chunk(CHUNK, codec, 1e3), chunk(NUMEL - CHUNK, codec, 1e-3)]
    sender = EncodedSender(a.address, CREDS)
    try:
        for c, enc in enumerate(chunks):
            sender.send((*TAG, 0, 0, 1, c), enc)
        got, missing, _ = a.gather((*TAG, 0, 0), 2, timeout_s=10)
    finally:
        sender.close()
    assert missing == {} and a.refused == {}
    for enc, mine in zip(got[1], chunks, strict=True):
        n = mine.shape[0] * ROW_LEN
        assert torch.equal(average_encoded([enc], n), average_encoded([mine], n))


def test_a_refusal_that_claims_no_peer_is_waited_out_and_named(net) -> None:
    a = net("none")
    sender = EncodedSender(a.address, CREDS)
    try:  # a plan-shaped payload, but group 7 is no peer: refused on its header
        sender.send((*TAG, 0, 0, 7, 0), chunk(CHUNK, "none"))
        assert dropped(sender)
    finally:
        sender.close()
    t0 = time.monotonic()
    got, missing, _ = a.gather((*TAG, 0, 0), 2, timeout_s=0.5)
    assert time.monotonic() - t0 >= 0.5 and got == {} and a.refused == {}
    assert "no payload from group 1" in missing[1]
    assert "group 7 is not a connected peer" in missing[1]  # the latest stream failure


def test_chunks_taken_before_a_wait_ends_are_kept_for_the_next(net) -> None:
    """The driver gathers in slices of ``health.heartbeat_s``: a payload that arrives across
    two slices must be gathered whole, its first chunk not lost with the first slice."""
    a = net("int8")
    chunks = [chunk(CHUNK, "int8"), chunk(NUMEL - CHUNK, "int8")]
    sender = EncodedSender(a.address, CREDS)
    try:
        sender.send((*TAG, 0, 0, 1, 0), chunks[0])
        time.sleep(0.2)
        got, missing, _ = a.gather((*TAG, 0, 0), 2, timeout_s=0.3)
        assert got == {} and "no payload from group 1" in missing[1]
        assert len(a._held[((*TAG, 0, 0), 1)]) == 1  # chunk 0, taken and kept
        sender.send((*TAG, 0, 0, 1, 1), chunks[1])
        got, missing, _ = a.gather((*TAG, 0, 0), 2, timeout_s=10)
    finally:
        sender.close()
    assert missing == {}
    for enc, mine in zip(got[1], chunks, strict=True):
        assert all((x == y).all() for x, y in zip(enc.arrays, mine.arrays, strict=True))
    t0 = time.monotonic()  # asked again: whole, at once (not a wait for what was taken)
    assert a.gather((*TAG, 0, 0), 2, timeout_s=5)[0] == got
    assert time.monotonic() - t0 < 1
    sender = EncodedSender(a.address, CREDS)  # a second frame for a key already taken
    try:
        sender.send((*TAG, 0, 0, 1, 0), chunks[0])
        deadline = time.monotonic() + 10
        while len(a.inbox._box) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sender.close()
    assert len(a.inbox._box) == 1  # filed: its first is gone, so it is no duplicate
    a.forget((*TAG, 0, 0), 2)  # the round applied: nothing of it is held any more
    assert a._held == {} and len(a.inbox._box) == 0


def test_bad_values_names_what_is_wrong() -> None:
    assert bad_values(torch.zeros(0)) is None
    assert bad_values(torch.tensor([MAX_ABS, -MAX_ABS])) is None
    assert "NaN or inf" in bad_values(torch.tensor([1.0, float("nan")]))
    assert "NaN or inf" in bad_values(torch.tensor([float("-inf")]))
    assert "over the bound" in bad_values(torch.tensor([MAX_ABS * 2]))
    # the bound's promise: 2^27 payloads at the bound sum to a finite fp32
    assert torch.isfinite(torch.tensor(MAX_ABS) * 2.0**27).item()


# -- this replica's own pseudo-gradient, on an OuterLoop over a stand-in engine -----------------
class Masters:
    """A stand-in for the engine's fp32 master partitions (zero_state's two readers)."""

    def __init__(self, monkeypatch, numel: int) -> None:
        self.flat = torch.zeros(numel)
        layout = {"rank": 0, "size": 1, "numels": [numel]}
        monkeypatch.setattr(outer_mod.zero_state, "partition_layout", lambda e: layout)
        monkeypatch.setattr(outer_mod.zero_state, "master_partitions", lambda e: [self.flat])
        self.engine = SimpleNamespace(has_tied=False, engine=object())


def loop(masters: Masters, codec: str, group: int = 0) -> OuterLoop:
    s = OuterSettings(fragments=1, codec=codec, chunk_elems=CHUNK, timeout_s=10)
    return OuterLoop(masters.engine, 1, group, s, host="127.0.0.1", creds=CREDS, tag="t")


@pytest.mark.parametrize(
    ("codec", "value", "why"),
    [
        ("none", float("nan"), "its pseudo-gradient holds NaN or inf"),
        ("int8", float("inf"), "its pseudo-gradient holds NaN or inf"),
        ("none", 1e31, "over the bound 2\\^100"),
        ("int4h", 1e7, "cannot be encoded .*exceeds fp16's range"),
        ("fp16", 1e5, "decodes to a chunk that holds NaN or inf"),  # fp16 overflows at 65504
    ],
)
def test_a_diverged_replica_sends_nothing_and_the_driver_sees_a_model_error(
    monkeypatch, codec, value, why
) -> None:
    masters = Masters(monkeypatch, NUMEL)
    me, peer = loop(masters, codec, 0), loop(masters, codec, 1)
    try:
        me.connect([OuterPeer(1, peer.net.address, me.state.layout)])
        masters.flat[CHUNK + 7] = value  # theta_global is 0: the pseudo-gradient is -value
        with pytest.raises(ModelError, match=why) as err:
            me.send(0)
        msg = str(err.value)
        assert msg.startswith(ModelError.MARK) and "outer fragment 0 (round 0) of stage 1" in msg
        assert me._pending == {} and me.net._posts == []  # nothing sent, nothing to apply
        time.sleep(0.2)
        assert peer.net.receiver.messages == 0
        # what the driver does with the actor's error (a span's call, as Ray reports it)
        remote = WorkerFailed(f"ray::StageWorker.run_iterations()\n  ...\n{type(err.value)}: {msg}")
        with pytest.raises(ModelFailed, match="the model raised in outer fragment 0"):
            raise_model_error(remote)
    finally:
        me.close()
        peer.close()


def wait_refused(net: OuterExchange, timeout_s: float = 10.0) -> None:
    """Until ``net``'s listener has refused a frame (or ``timeout_s``): the assertions that
    follow say whether it did, and whom it was pinned on."""
    deadline = time.monotonic() + timeout_s
    while net.receiver.refused.count == 0 and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_refused_peer_is_answered_at_once_then_at_the_slices_pace(monkeypatch) -> None:
    masters = Masters(monkeypatch, NUMEL)
    me, peer = loop(masters, "int8", 0), loop(masters, "int8", 1)
    try:
        me.connect([OuterPeer(1, peer.net.address, me.state.layout)])
        peer.connect([OuterPeer(0, me.net.address, me.state.layout)])
        me.send(0)
        enc = chunk(CHUNK, "int8")
        bad = swap(enc, 1, np.full_like(enc.arrays[1], np.inf))
        sender = EncodedSender(me.net.address, CREDS)  # group 1's payload, poisoned
        sender.send((*TAG, 0, 0, 1, 0), bad)
        sender.close()
        t0 = time.monotonic()
        first = me.gather(0, 5.0)
        assert time.monotonic() - t0 < 2.5
        assert first["have"] == [0] and list(first["refused"]) == [1]
        assert "holds NaN or inf" in first["refused"][1]
        assert first["missing"][1] == f"refused: {first['refused'][1]}"
        t0 = time.monotonic()
        again = me.gather(0, 0.5)  # nothing new: answered after the slice, as a wait would
        assert time.monotonic() - t0 >= 0.5 and again["refused"] == first["refused"]
        with pytest.raises(RuntimeError, match=r"holds no payload of group\(s\) \[1\]"):
            me.apply(0, [0, 1])
    finally:
        me.close()
        peer.close()


def test_a_second_frame_for_a_key_leaves_neither_payload_to_average(net) -> None:
    """Which of the two is the group's own cannot be told (a peer's frame may claim any
    group): the key holds the receiver's error instead, and the group is refused."""
    a = net("none")
    first, second = chunk(CHUNK, "none"), chunk(CHUNK, "none")
    sender = EncodedSender(a.address, CREDS)
    try:
        sender.send((*TAG, 0, 0, 1, 0), first)
        sender.send((*TAG, 0, 0, 1, 0), second)
        wait_refused(a)
        got, missing, _ = a.gather((*TAG, 0, 0), 2, timeout_s=10)
    finally:
        sender.close()
    assert got == {} and "a second frame for it arrived" in missing[1]
    assert missing[1].startswith("refused: ") and 1 in a.refused
