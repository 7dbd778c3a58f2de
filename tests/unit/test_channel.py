"""The inbox refuses corrupt payloads and round-trips intact ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from geopipe.transport.channel import Inbox
from geopipe.transport.codec import make_codec
from geopipe.transport.seal import CorruptPayloadError, seal


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
