"""The group-wise low-bit codecs (int4, int4h, int2h): error bounds over random shapes and
scales (hypothesis), exact byte counts against the planner's wire sizes, the Hadamard
rotation's exact inversion by any receiver, refusals, stochastic rounding's unbiasedness,
and a round trip through the real data plane."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geopipe.transport import wire
from geopipe.transport.codec import decode, make_codec, rotate, unrotate

GROUPED = ("int4", "int4h", "int2h")

shapes = st.lists(st.integers(1, 130), min_size=1, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, log_scale=st.floats(-3, 3), seed=st.integers(0, 2**31))
def test_int4_error_is_at_most_half_a_step_per_element(shape, log_scale, seed) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10**log_scale
    enc = make_codec("int4").encode(x)
    y = decode(enc)
    assert y.shape == x.shape and enc.payload_nbytes == wire.wire_bytes("int4", x.numel(), 1)
    flat = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % 64)).reshape(-1, 64)
    step = flat.abs().amax(1) / 7  # the group's scale; the element's error is ≤ half of it
    bound = (step / 2 * 1.002 + 1e-7).repeat_interleave(64)[: x.numel()]
    assert bool(((y - x).reshape(-1).abs() <= bound).all())


@settings(max_examples=40, deadline=None)
@given(shape=shapes, codec=st.sampled_from(GROUPED), seed=st.integers(0, 2**40))
def test_bytes_match_the_planners_wire_sizes(shape, codec, seed) -> None:
    x = torch.randn(shape)
    enc = make_codec(codec, seed=seed).encode(x)
    assert enc.payload_nbytes == wire.wire_bytes(codec, x.numel(), shape[-1])
    assert decode(enc).shape == x.shape


def test_ratios_and_errors_on_an_activation_with_an_outlier_channel() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, 4096, generator=g)
    x[..., 7] *= 100
    err = {}
    for codec in GROUPED:
        enc = make_codec(codec, seed=3).encode(x)
        err[codec] = ((decode(enc) - x).norm() / x.norm()).item()
        ratio = x.numel() * 4 / enc.payload_nbytes
        if codec.startswith("int4"):
            assert ratio >= 7.0  # 4 bits + a 16-bit scale per 64: 7.53x fp32
        else:
            assert ratio >= 14.0
    assert err["int4h"] < err["int4"] < 0.1  # the rotation spreads the outlier
    gauss = torch.randn(64, 4096, generator=g)
    e2 = ((decode(make_codec("int2h").encode(gauss)) - gauss).norm() / gauss.norm()).item()
    assert e2 < 0.4  # Lloyd-Max's 2-bit optimum for a Gaussian is 0.34


def test_the_rotation_is_inverted_exactly_by_any_receiver() -> None:
    x = torch.randn(100, 64, dtype=torch.float32)
    for seed in (0, 1, 2**40 + 7):
        y = rotate(x, seed)
        assert torch.allclose(unrotate(y, seed), x, atol=1e-5, rtol=0)
        assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-5)  # orthonormal
    assert not torch.allclose(rotate(x, 1), rotate(x, 2))  # the seed matters
    enc = make_codec("int4h", seed=12345).encode(torch.randn(4, 64))
    assert int(enc.arrays[2][0]) == 12345  # the seed travels: decode needs no link state
    a, b = decode(enc), make_codec("int4h", seed=999).decode(enc)
    assert torch.equal(a, b)


@pytest.mark.parametrize("codec", GROUPED)
def test_refusals_and_exact_zeros(codec: str) -> None:
    c = make_codec(codec)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(3, 70)
        x[1, 5] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            c.encode(x)
    with pytest.raises(ValueError, match="exceeds fp16's range"):
        c.encode(torch.full((2, 64), 1e7))
    z = torch.zeros(5, 64)
    assert torch.equal(decode(c.encode(z)), z)
    assert decode(c.encode(torch.zeros(0))).shape == (0,)


def test_huge_dynamic_range_across_groups_keeps_each_groups_precision() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.randn(64, generator=g) * 1e-4,
            torch.randn(64, generator=g) * 1e4,
            torch.randn(64, generator=g),
        ]
    )
    for codec in ("int4", "int4h"):
        y = decode(make_codec(codec).encode(x))
        for k in range(3):
            part = slice(64 * k, 64 * (k + 1))
            rel = ((y[part] - x[part]).norm() / x[part].norm()).item()
            assert rel < 0.2, (codec, k, rel)  # int4 on a Gaussian group: ~0.1


def test_stochastic_rounding_of_gradients_is_unbiased() -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    det = make_codec("int4h", seed=4)
    sto = make_codec("int4h", seed=4, stochastic=True)
    bias_det = (decode(det.encode(x, direction="backward")) - x).abs().mean().item()
    mean = sum(decode(sto.encode(x, direction="backward")) for _ in range(400)) / 400
    assert (mean - x).abs().mean().item() < 0.25 * bias_det
    again = make_codec("int4h", seed=4, stochastic=True)  # seeded: reproducible
    assert torch.equal(
        decode(again.encode(x, direction="backward")),
        decode(make_codec("int4h", seed=4, stochastic=True).encode(x, direction="backward")),
    )
    state = sto.state_dict()
    a = decode(sto.encode(x, direction="backward"))
    sto.load_state_dict(state)
    assert torch.equal(decode(sto.encode(x, direction="backward")), a)


def test_through_the_data_plane() -> None:
    from geopipe.transport.channel import Inbox
    from geopipe.transport.direct import DirectReceiver, DirectSender

    inbox = Inbox()
    rx = DirectReceiver(inbox)
    try:
        for codec in GROUPED:
            tx = DirectSender(rx.address, codec, "forward", seed=77)
            x = torch.randn(2, 16, 128)
            tx.send((codec, 0, 0), x, "s")
            tx.flush(timeout=10)
            got = inbox.get((codec, 0, 0), timeout=10)
            want = decode(make_codec(codec, seed=77).encode(x))
            assert torch.equal(got, want)
            tx.close()
    finally:
        rx.close()
    assert math.isclose(np.float16(65504.0), 65504.0)


def test_codec_error_is_measured_on_sampled_messages() -> None:
    """The sender decodes the first message and every 32nd after it and keeps the relative
    error; a lossless codec reports none; the metrics keep the worst per direction."""
    from geopipe.runtime.actor.executor import IterationResult
    from geopipe.runtime.control.metrics import aggregate
    from geopipe.transport.channel import Inbox
    from geopipe.transport.direct import DirectReceiver, DirectSender, relative_error

    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    for codec, lo, hi in (("int8", 0.0, 0.01), ("int4h", 0.03, 0.12), ("int2h", 0.25, 0.45)):
        err = relative_error(x, make_codec(codec, seed=1).encode(x))
        assert lo < err < hi, (codec, err)
    assert relative_error(torch.zeros(3), make_codec("int4").encode(torch.zeros(3))) == 0.0
    inbox = Inbox()
    rx = DirectReceiver(inbox)
    try:
        lossy = DirectSender(rx.address, "int4h", "forward", seed=1)
        exact = DirectSender(rx.address, "none", "backward")
        for i in range(3):
            lossy.send(("F", i, 0), x, "s")
            exact.send(("B", i, 0), x, "s")
        lossy.flush(timeout=10)
        exact.flush(timeout=10)
        want = relative_error(x, make_codec("int4h", seed=1).encode(x))
        assert lossy.codec_error == pytest.approx(want) and exact.codec_error is None
        lossy.close()
        exact.close()
    finally:
        rx.close()

    def result(stage: int, errors: dict) -> IterationResult:
        return IterationResult(
            stage=stage,
            replica=0,
            step=0,
            losses=[1.0],
            busy_s=1.0,
            wait_s=0.0,
            duration_s=1.0,
            start=0.0,
            wan_bytes=0,
            micro_batches=1,
            optimizer_steps=1,
            codec_error=errors,
        )

    m = aggregate(
        [result(0, {"forward": 0.05}), result(1, {"backward": 0.2}), result(0, {"forward": 0.07})],
        2,
        10,
    )
    assert m.codec_error == {"forward": 0.07, "backward": 0.2}
    assert m.to_json()["codec_error"] == {"forward": 0.07, "backward": 0.2}
