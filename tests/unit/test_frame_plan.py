"""A stage replica's WAN receiver takes only the frames its plan expects (issue 33, item 3,
the runtime's part): `StageLinks.plan_frames`, as `StageWorker.listen` and `setup` call it,
on 127.0.0.1 with the run's credentials and real sockets, without Ray.

An authenticated peer of the run sends what the plan does not expect — a wrong shape, a
shape whose product wraps to 0, the wrong dtype, a future step's key, a NaN norm, a
link-probe message once training runs — and each is refused before its payload is
allocated (a NaN once read: that key only), the connection dropped, and the consumer told at
once with a message naming the peer (never by waiting out its receive timeout). What the
plan expects is still filed; a NaN activation too, for the NaN guard."""

from __future__ import annotations

import json
import time
import zlib

import pytest
import torch

from geopipe.runtime.actor.links import StageLinks, planned_frames
from geopipe.transport import frames
from geopipe.transport.dial import dial
from geopipe.transport.direct import DirectSender
from geopipe.transport.frames import StreamCorruptError
from geopipe.transport.receiver import NonFiniteError
from geopipe.transport.seal import CorruptPayloadError
from geopipe.transport.security import make_credentials

pytestmark = pytest.mark.timeout(60)

CREDS = make_credentials("run-p", encrypt=False)
SHAPE = (2, 8, 16)  # micro-batch, sequence, hidden
RECV_TIMEOUT_S = 30.0  # the consumer's own timeout: every refusal must come far sooner


def stage(dtype: torch.dtype = torch.float32, tied: torch.Tensor | None = None) -> StageLinks:
    links = StageLinks()
    links.creds, links.max_payload = CREDS, 1 << 22
    links.plan_frames(SHAPE, dtype)  # as StageWorker.listen
    links.listen("127.0.0.1")
    links.plan_frames(SHAPE, dtype, tied)  # as StageWorker.setup, once the engine is built
    return links


def begin_step(links: StageLinks, step: int) -> None:
    """What the executor does as a step begins (the intra-site side has no receivers)."""
    links.expect([("F", step, 0), ("F", step, 1)], [], SHAPE)


@pytest.fixture
def links():
    links = stage()
    yield links
    links.close()


def peer(links: StageLinks) -> DirectSender:
    """A neighbour of the run: it proved the secret, and sends whatever it is told."""
    return DirectSender(links.wan_recv.address, "none", "forward", creds=CREDS)


def refused_promptly(links: StageLinks, key: tuple, x: torch.Tensor, match: str) -> str:
    tx = peer(links)
    try:
        tx.send(key, x, "s")
        t0 = time.monotonic()
        with pytest.raises(CorruptPayloadError, match=match) as info:
            links.inbox.get(("F", 3, 0), timeout=RECV_TIMEOUT_S)
        assert time.monotonic() - t0 < 10
        assert "peer ('127.0.0.1'," in str(info.value)
        return str(info.value)
    finally:
        tx.close()


def test_the_plans_frames_are_filed(links) -> None:
    begin_step(links, 3)
    tx = peer(links)
    x, y = torch.randn(SHAPE), torch.randn(SHAPE)
    tx.send(("F", 3, 0), x, "s")
    tx.send(("F", 4, 0), y, "s")  # the neighbour may begin the next step first
    tx.flush(timeout=10)
    assert torch.equal(links.inbox.get(("F", 3, 0), timeout=10), x)
    assert torch.equal(links.inbox.get(("F", 4, 0), timeout=10), y)
    tx.close()
    assert links.wan_recv.messages == 2 and not links.wan_recv.errors


@pytest.mark.parametrize(
    ("key", "x", "match"),
    [
        (("F", 3, 0), torch.randn(2, 8, 17), r"shape \[2, 8, 17\]"),
        (("F", 3, 0), torch.randn(SHAPE, dtype=torch.float64), "dtype float64"),
        (("F", 3, 0), torch.randn(SHAPE).bfloat16(), "dtype bfloat16"),
        (("F", 5, 0), torch.randn(SHAPE), r"step 5 outside the window \[3, 4\]"),
        (("F", 2, 0), torch.randn(SHAPE), r"step 2 outside the window"),
        (("F", 3), torch.randn(SHAPE), "key of 2 items"),
        (("X", 3, 0), torch.randn(SHAPE), "no message of kind 'X'"),
        (("T", 3, 0), torch.randn(SHAPE), "no message of kind 'T'"),  # no tied embedding
    ],
    ids=["shape", "dtype", "precision", "future", "past", "key", "kind", "untied"],
)
def test_what_the_plan_does_not_expect_is_refused(links, key, x, match) -> None:
    begin_step(links, 3)
    refused_promptly(links, key, x, match)
    assert links.wan_recv.messages == 0 and links.wan_recv.refused.count == 1


def test_a_wrapping_shape_is_refused_before_allocation(links, monkeypatch) -> None:
    """The neighbour announces 2^32 x 2^32 elements (0 in int64) and an empty payload."""
    begin_step(links, 3)
    header = json.dumps(
        {
            "key": ["F", 3, 0],
            "codec": "none",
            "shape": [2**32, 2**32],
            "dtype": "float32",
            "dir": "forward",
            "arrays": [["<f4", [2**32, 2**32]]],
        }
    ).encode()
    prefix = frames._PREFIX.pack(frames._MAGIC, frames._VERSION, 0, len(header), 0, 0, 0.0, 0.0, 0)
    hcrc = frames._HCRC.pack(zlib.crc32(header, zlib.crc32(prefix)))
    allocated = []
    real_empty = frames.np.empty
    monkeypatch.setattr(
        frames.np, "empty", lambda n, **k: allocated.append(n) or real_empty(n, **k)
    )
    sock, _ = dial(links.wan_recv.address, CREDS, timeout_s=10, sealed=True)
    try:
        sock.sendall(prefix + hcrc + header)
        t0 = time.monotonic()
        with pytest.raises(StreamCorruptError, match=r"peer \('127.0.0.1'"):
            links.inbox.get(("F", 3, 0), timeout=RECV_TIMEOUT_S)
        assert time.monotonic() - t0 < 10
    finally:
        sock.close()
    assert allocated == []  # refused on its header: not a byte allocated for it


def test_a_non_finite_norm_or_probe_is_refused_naming_the_peer(links) -> None:
    begin_step(links, 3)
    tx = peer(links)
    tx.send(("N", 3, 1), torch.tensor([0.0, 2.0, float("nan")]), "norm")
    t0 = time.monotonic()
    with pytest.raises(NonFiniteError, match=r"from peer \('127.0.0.1', \d+\) holds NaN or inf"):
        links.inbox.get(("N", 3, 1), timeout=RECV_TIMEOUT_S)
    assert time.monotonic() - t0 < 10
    x = torch.randn(SHAPE)  # only that key failed: the stream was sound
    tx.send(("F", 3, 0), x, "s")
    assert torch.equal(links.inbox.get(("F", 3, 0), timeout=10), x)
    tx.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_activations_go_to_the_nan_guard(dtype) -> None:
    """A NaN or inf in an activation or gradient is the model's (fp16's loss scaling
    overflows by design): it is delivered, and the NaN guard (training.nan_policy) skips
    the step or stops the run naming step, stage and tensor."""
    links = stage(dtype)
    try:
        begin_step(links, 3)
        x = torch.randn(SHAPE, dtype=dtype)
        x[0, 0, 0] = float("inf")
        x[1, 2, 3] = float("nan")
        tx = peer(links)
        tx.send(("F", 3, 0), x, "s")
        got = links.inbox.get(("F", 3, 0), timeout=10)
        assert torch.isinf(got).any() and torch.isnan(got).any()
        tx.close()
    finally:
        links.close()


def test_the_link_probe_is_expected_until_training_begins(links) -> None:
    tx = peer(links)
    tx.send(("probe-ping", 0), torch.zeros(256), "probe")
    assert links.inbox.get(("probe-ping", 0), timeout=10).shape == (256,)
    tx.close()
    begin_step(links, 3)
    refused_promptly(links, ("probe-bulk", 0), torch.zeros(1024), "kind 'probe-bulk'")


def test_a_tied_embeddings_gradient_is_expected_as_this_copy() -> None:
    emb = torch.nn.Parameter(torch.randn(64, 16))
    links = stage(tied=emb)
    try:
        begin_step(links, 3)
        tx = peer(links)
        g = torch.randn(64, 16)
        tx.send(("T", 3, 0), g, "tied")
        assert torch.equal(links.inbox.get(("T", 3, 0), timeout=10), g)
        tx.close()
        refused_promptly(links, ("T", 3, 1), torch.randn(64, 17), r"shape \[64, 17\]")
    finally:
        links.close()


def test_the_plan_of_a_stage_reads_as_its_messages() -> None:
    plan = planned_frames(SHAPE, torch.bfloat16, torch.zeros(10, 16))
    assert plan.kinds["F"].shapes == {SHAPE} and plan.kinds["B"].dtypes == {"bfloat16"}
    assert plan.kinds["T"].shapes == {(10, 16)} and plan.kinds["T"].dtypes == {"float32"}
    assert plan.wants_finite(("N", 3, 1)) and plan.wants_finite(("probe-ping", 0))
    assert not plan.wants_finite(("F", 3, 0)) and not plan.wants_finite(("B", 3, 0))


def test_a_plan_swapped_while_a_read_waits_applies_to_its_next_frame() -> None:
    """The tied peer connects at setup, before this stage's setup adds the tied gradient
    to the plan: its reader already waits for the first frame, and that frame is checked
    against the plan as it is when the frame comes (once a stale plan refused it)."""
    links = StageLinks()
    links.creds, links.max_payload = CREDS, 1 << 22
    links.plan_frames(SHAPE, torch.float32)  # listen: no tied embedding known yet
    links.listen("127.0.0.1")
    try:
        tx = peer(links)
        tx.send(("F", 3, 0), torch.randn(SHAPE), "s")
        links.inbox.get(("F", 3, 0), timeout=10)  # the reader is up, now waiting in a read
        links.plan_frames(SHAPE, torch.float32, torch.zeros(64, 16))  # setup
        g = torch.randn(64, 16)
        tx.send(("T", 3, 0), g, "tied")
        assert torch.equal(links.inbox.get(("T", 3, 0), timeout=10), g)
        tx.close()
    finally:
        links.close()
