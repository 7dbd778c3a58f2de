"""The actor side of the outer loop without Ray or DeepSpeed: the replica groups' data slices
and the exchange of encoded pseudo-gradients over the data plane (authenticated, encrypted,
bounded frames). The rounds on real engines: tests/integration/test_outer_actor.py."""

from __future__ import annotations

import re
import socket
from types import SimpleNamespace

import pytest
import torch

from geopipe.model.data import group_sample_indices, sample_indices
from geopipe.outer import ROW_LEN, average_encoded, encode_delta
from geopipe.plan import Plan
from geopipe.runtime.actor.outer_wire import (
    EncodedInbox,
    EncodedSender,
    OuterExchange,
    OuterPeer,
    OuterSettings,
)
from geopipe.runtime.actor.stage import StageWorker
from geopipe.transport.codec import make_codec
from geopipe.transport.direct import DirectReceiver, PeerLostError
from geopipe.transport.security import make_credentials


# -- data: disjoint group slices whose union is the global batch ---------------------------------
@pytest.mark.parametrize(
    ("groups", "pipelines", "mbs"), [(1, 1, 2), (2, 2, 2), (4, 1, 1), (2, 3, 2), (3, 2, 1)]
)
def test_groups_and_pipelines_cover_the_global_batch_once(groups, pipelines, mbs) -> None:
    batch = 2 * groups * pipelines * mbs
    per_pipe = batch // groups // pipelines // mbs
    for step in (0, 3):
        seen = []
        for g in range(groups):
            for r in range(pipelines):
                for mb in range(per_pipe):
                    idx = group_sample_indices(step, batch, g, groups, r * per_pipe + mb, mbs)
                    assert all(
                        g * batch // groups <= i - step * batch < (g + 1) * batch // groups
                        for i in idx
                    )
                    seen += idx
        assert sorted(seen) == list(range(step * batch, (step + 1) * batch))
        assert len(set(seen)) == len(seen)


def test_one_group_is_the_single_group_layout() -> None:
    for mb in range(4):
        assert group_sample_indices(5, 8, 0, 1, mb, 2) == sample_indices(5, 8, mb, 2)


def test_group_slices_are_checked() -> None:
    with pytest.raises(ValueError, match="replica group 2 out of range"):
        group_sample_indices(0, 8, 2, 2, 0, 2)
    with pytest.raises(ValueError, match="does not split into 3 replica groups"):
        group_sample_indices(0, 8, 0, 3, 0, 2)
    with pytest.raises(ValueError, match="out of range \\[0, 2\\) of a group's slice"):
        group_sample_indices(0, 8, 0, 2, 2, 2)


def test_stage_actor_reads_its_groups_slice() -> None:
    """StageWorker._batch: group offset, then the pipeline's run of micro-batches in it."""
    plan = Plan(
        pipelines=1,
        stage_sites=("a",),
        partition=((0, 4),),
        micro_batch_size=2,
        seq_len=4,
        num_microbatches=2,
        schedule="1f1b",
        delta_n=(),
        codecs=(),
    )
    seen = []
    for g in range(2):
        for r in range(2):
            spec = SimpleNamespace(
                global_batch=16,
                group=g,
                groups=2,
                replica=r,
                first_microbatch=None,
                group_start=None,
            )
            stream = SimpleNamespace(batch=lambda idx, n: list(idx))
            worker = SimpleNamespace(plan=plan, spec=spec, stream=stream)
            seen += [StageWorker._batch(worker, 1, mb) for mb in range(2)]
    flat = [i for idx in seen for i in idx]
    assert flat == list(range(16, 32))  # groups in order, pipelines in order inside each


# -- settings -----------------------------------------------------------------------------------
def test_outer_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="outer codec 'int9'"):
        OuterSettings(codec="int9")
    with pytest.raises(ValueError, match="multiple of 256"):
        OuterSettings(chunk_elems=1000)
    assert OuterSettings(chunk_elems=ROW_LEN).max_payload >= 4 * ROW_LEN


# -- the wire -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def creds():
    return make_credentials("outer-unit", encrypt=True)


def _listener(creds, max_payload: int = 1 << 20) -> tuple[EncodedInbox, DirectReceiver]:
    inbox = EncodedInbox()
    return inbox, DirectReceiver(inbox, creds=creds, max_payload=max_payload)


def test_encoded_payload_arrives_bytewise_and_encoded(creds) -> None:
    """What a peer averages is the bytes the sender encoded, not a re-encoding."""
    inbox, recv = _listener(creds)
    try:
        delta = torch.randn(3 * ROW_LEN + 17)
        enc = encode_delta(delta, make_codec("int8"))
        sender = EncodedSender(recv.address, creds)
        sender.send(("O", 0, 1), enc)
        got = inbox.get(("O", 0, 1), timeout=10)
        assert got.codec == "int8" and got.shape == enc.shape
        assert all((a == b).all() for a, b in zip(got.arrays, enc.arrays, strict=True))
        assert torch.equal(
            average_encoded([got], delta.numel()), average_encoded([enc], delta.numel())
        )
        sender.close()
    finally:
        recv.close()


def test_a_sender_without_the_runs_secret_is_refused(creds) -> None:
    inbox, recv = _listener(creds)
    try:
        stranger = make_credentials("outer-unit", encrypt=True)  # another secret and CA
        with pytest.raises(PeerLostError, match="cannot authenticate"):
            EncodedSender(recv.address, stranger, connect_timeout_s=5)
        with socket.create_connection(recv.address) as raw:  # no handshake at all
            raw.sendall(b"GPDC" + bytes(60))
        with pytest.raises(TimeoutError):
            inbox.get(("O", 0, 0), timeout=0.3)
    finally:
        recv.close()


def test_a_frame_over_the_bound_fails_the_stream(creds) -> None:
    inbox, recv = _listener(creds, max_payload=ROW_LEN * 4)
    try:
        sender = EncodedSender(recv.address, creds)
        sender.send(("O", 0, 0), encode_delta(torch.ones(4 * ROW_LEN), make_codec("none")))
        with pytest.raises(Exception, match="exceeds the bound"):
            inbox.get(("O", 0, 0), timeout=10)
        sender.close()
    finally:
        recv.close()


def _exchange(creds) -> OuterExchange:
    return OuterExchange("127.0.0.1", "127.0.0.1", creds, 1 << 20, user_timeout_s=10)


def test_exchange_all_gathers_every_groups_chunks(creds) -> None:
    """Three groups, two chunks each: every group collects the others' chunks by group."""
    nets = [_exchange(creds) for _ in range(3)]
    try:
        for g, net in enumerate(nets):
            net.connect(
                [OuterPeer(h, other.address, "L") for h, other in enumerate(nets) if h != g]
            )
        payloads = {
            g: [
                encode_delta(torch.full((ROW_LEN,), float(10 * g + c)), make_codec("none"))
                for c in range(2)
            ]
            for g in range(3)
        }
        tag = ("O", 0, 0, 0, 0)
        for g, net in enumerate(nets):
            net.post(tag, g, payloads[g])
        for g, net in enumerate(nets):
            got, sent = net.collect(tag, 2, timeout_s=10)
            assert sorted(got) == [h for h in range(3) if h != g]
            assert sent > 0
            for h, chunks in got.items():
                for c, enc in enumerate(chunks):
                    assert float(average_encoded([enc], ROW_LEN)[0]) == 10 * h + c
    finally:
        for net in nets:
            net.close()


def test_a_silent_peer_is_named(creds) -> None:
    a, b = _exchange(creds), _exchange(creds)
    try:
        a.connect([OuterPeer(1, b.address, "L")])
        why = re.escape(f"no payload from group 1 at {b.address} in 0.3s")
        with pytest.raises(TimeoutError, match=why):
            a.collect(("O", 0, 0, 0, 0), 1, timeout_s=0.3)
    finally:
        a.close()
        b.close()


def test_a_stage_holding_a_tied_copy_is_refused() -> None:
    """Lossy codecs would let the two copies of a tied embedding drift apart ([Note: tied
    embeddings and the outer loop]): refused before anything is read from the engine."""
    from geopipe.runtime.actor.outer import OuterState

    with pytest.raises(ValueError, match="tied embedding split over two stages"):
        OuterState(SimpleNamespace(has_tied=True), 0, OuterSettings())
