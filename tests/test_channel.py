"""Channels without Ray: the inbox refuses corrupt payloads; the WAN sender's bytes and
delivery stamps follow the link model."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from geopipe.transport.channel import Inbox, WanSender
from geopipe.transport.codec import CorruptPayloadError, make_codec, seal
from geopipe.transport.link import LinkParams
from geopipe.transport.wire import wire_bytes


def test_corrupt_payload_is_detected_not_used():
    inbox = Inbox()
    enc = make_codec("int8").encode(torch.randn(4, 16))
    sealed = seal(enc)
    enc.arrays[0].reshape(-1).view(np.uint8)[3] ^= 0x10  # damaged in transit
    inbox.deliver_sealed(("F", 0, 0), sealed, 0.0)
    with pytest.raises(CorruptPayloadError):
        inbox.get(("F", 0, 0), timeout=1)


def test_intact_payload_round_trips():
    inbox = Inbox()
    x = torch.randn(2, 3, 8)
    inbox.deliver_sealed(("B", 1, 2), seal(make_codec("none").encode(x)), 0.0)
    assert torch.equal(inbox.get(("B", 1, 2), timeout=1), x)


@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "topk"])
def test_wan_sender_counts_wire_bytes_and_stamps_fifo(codec):
    posted = []
    link = LinkParams(bandwidth_bps=1e9, latency_s=0.01)
    sender = WanSender(lambda *a: posted.append(a), codec, "backward", link)
    x = torch.randn(4, 64, 32)
    t0 = time.monotonic()
    n1 = sender.send(("B", 0, 0), x, stream="B/mb0")
    n2 = sender.send(("B", 0, 1), x, stream="B/mb1")
    sender.flush()
    assert n1 == n2 == wire_bytes(codec, x.numel(), 32, 4, "backward")
    (k1, s1, d1), (k2, _s2, d2) = posted
    assert (k1, k2) == (("B", 0, 0), ("B", 0, 1))
    ser = n1 * 8 / 1e9
    # The second message queues behind the first on the link: one serialisation later.
    assert d2 - d1 == pytest.approx(ser, abs=2e-3)
    assert d1 - t0 >= 0.01 + ser
    assert s1.enc.payload_nbytes == n1
