"""Per-group identity for outer-loop payloads (issue 33, the outer loop's data plane): each
replica group signs its chunks with its own Ed25519 key, and a listener files a chunk under
group g only if group g's signature verifies ([Note: why outer payloads are signed per
group] in geopipe.runtime.actor.outer_sign). On 127.0.0.1 with the run's credentials and
real sockets, without Ray; the same plan and payloads as tests/unit/test_outer_values.py.

* three groups, each signing, exchange a round: every chunk is gathered as sent, nothing
  refused (a valid run is unchanged);
* group 0's insider sends a chunk under group 1's key signed with group 0's key (it holds no
  other key): refused, logged naming the peer, its connection dropped, never filed, and the
  gather reports group 0 -- the group whose signature it carries -- refused; group 1's
  genuine chunk is still taken;
* a genuine signature moved to another fragment's or round's key, or over other payload
  bytes, and a frame with no signature: refused the same way, pinned on no group (bytes no
  group signed prove nothing about who sent them), so the claimed group is not written off;
* the driver's keys: one pair per group, fresh per run, kept across a recovery; each actor
  gets its own group's private key and every group's public key (Placement.stage_spec).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from geopipe.outer import ROW_LEN, average_encoded
from geopipe.runtime.actor import outer_wire
from geopipe.runtime.actor.outer_sign import GroupKeyring, signed_digest
from geopipe.runtime.actor.outer_wire import (
    EncodedSender,
    OuterExchange,
    OuterFrames,
    OuterPeer,
    OuterSettings,
)
from geopipe.transport.seal import Sealed
from geopipe.transport.security import make_credentials
from tests.unit.test_outer_values import chunk, dropped, wait_refused

pytestmark = pytest.mark.timeout(120)

CREDS = make_credentials("outer-signing", encrypt=False)
TAG = ("O", 1, 0)  # stage 1, ZeRO-1 partition 0
CHUNK = 4 * ROW_LEN
NUMEL = CHUNK + 3 * ROW_LEN  # each fragment: two chunks, of 1024 and 768 elements
CODEC = "int8"
ROOT = Path(__file__).resolve().parents[2]


def settings() -> OuterSettings:
    return OuterSettings(fragments=2, codec=CODEC, chunk_elems=CHUNK)


@pytest.fixture(scope="module")
def keys():
    """Three groups' keys, as the driver hands them out (one per actor's group)."""
    ring = GroupKeyring()
    plan = SimpleNamespace(num_groups=3, group_of=lambda r: r)
    return {g: ring.key_of(plan, g) for g in range(3)}


@pytest.fixture
def mesh(keys):
    """Three replicas (groups 0, 1, 2) of one (stage, partition), each signing with its
    group's key, every one connected to the other two, each with its frame plan."""
    nets = {
        g: OuterExchange("127.0.0.1", "127.0.0.1", CREDS, settings().max_payload, 10)
        for g in range(3)
    }
    for g, net in nets.items():
        net.identify(keys[g])
        net.expect(OuterFrames(settings(), TAG, [NUMEL, NUMEL], lambda f: 0))
    for g, net in nets.items():
        net.connect([OuterPeer(h, nets[h].address, "L") for h in nets if h != g])
    yield nets
    for net in nets.values():
        net.close()


def signed_key(keys, signer: int, key: tuple, enc) -> tuple:
    """``key`` with ``signer``'s signature over ``key`` and ``enc`` as its last item."""
    return (*key, keys[signer].signer().sign(signed_digest(key, enc)).hex())


def wait_failure(net: OuterExchange) -> str:
    deadline = time.monotonic() + 10
    while not net.inbox.failures and time.monotonic() < deadline:
        time.sleep(0.01)
    return str(net.inbox.failures[-1])


def same(a, b) -> bool:
    return all((x == y).all() for x, y in zip(a.arrays, b.arrays, strict=True))


def test_every_groups_signed_chunks_are_gathered_as_sent(mesh) -> None:
    sent = {g: [chunk(CHUNK, CODEC), chunk(NUMEL - CHUNK, CODEC)] for g in mesh}
    for g, net in mesh.items():
        net.post((*TAG, 1, 0), g, sent[g])
    for g, net in mesh.items():
        got, missing, nbytes = net.gather((*TAG, 1, 0), 2, timeout_s=30)
        assert missing == {} and net.refused == {} and sorted(got) == sorted(set(mesh) - {g})
        assert all(same(x, y) for h in got for x, y in zip(got[h], sent[h], strict=True))
        assert nbytes > 0 and net.receiver.refused.count == 0


def test_a_group_posts_only_under_its_own_key(mesh) -> None:
    with pytest.raises(ValueError, match="posting as group 1 with group 0's key"):
        mesh[0].post((*TAG, 0, 0), 1, [chunk(CHUNK, CODEC)])


def test_a_chunk_group_0_signed_under_group_1s_key_is_refused_naming_group_0(
    mesh, keys, caplog
) -> None:
    """Group 0's insider, a peer of the run (it passes the handshake), forges group 1's
    chunk: it can sign only with group 0's key. Group 2 refuses it and writes off group 0,
    whose key signed it; group 1's own chunk, on its own connection, is still taken."""
    me = mesh[2]
    forged = chunk(CHUNK, CODEC)
    insider = EncodedSender(me.address, CREDS)
    try:
        with caplog.at_level(logging.WARNING, "geopipe.transport.security"):
            insider.send(signed_key(keys, 0, (*TAG, 0, 0, 1, 0), forged), forged)
            assert dropped(insider)  # the connection is dropped
            why = wait_failure(me)
    finally:
        insider.close()
    assert "filed as group 1 is signed by group 0 (a forgery by group 0)" in why
    assert "peer ('127.0.0.1'," in why
    assert list(me.refused) == [0] and "signed by group 0" in me.refused[0]
    (record,) = [r for r in caplog.records if "refused" in r.getMessage()]
    assert "('127.0.0.1'," in record.getMessage()
    genuine = [chunk(CHUNK, CODEC), chunk(NUMEL - CHUNK, CODEC)]
    mesh[1].post((*TAG, 0, 0), 1, genuine)
    got, missing, _ = me.gather((*TAG, 0, 0), 2, timeout_s=30)
    assert sorted(got) == [1] and all(same(x, y) for x, y in zip(got[1], genuine, strict=True))
    assert missing[0].startswith("refused: ") and "forgery by group 0" in missing[0]
    assert not same(got[1][0], forged)  # the forged chunk was never filed


REPLAYS = ["fragment", "round", "payload", "unsigned"]


@pytest.mark.parametrize("how", REPLAYS)
def test_a_signature_over_other_bytes_is_refused_and_pinned_on_no_group(
    mesh, keys, caplog, how
) -> None:
    """Group 1's genuine signature of (fragment 0, round 0, chunk 0) over one payload,
    replayed under fragment 1's or round 1's key (both in the plan's window, same chunk
    size), or over another payload; or no signature at all. No group's key verifies it, so
    nothing proves who sent it: refused and dropped, but group 1 is not blamed -- its own
    chunks still arrive and are gathered."""
    me = mesh[2]
    genuine = [chunk(CHUNK, CODEC), chunk(NUMEL - CHUNK, CODEC)]
    key = (*TAG, 0, 0, 1, 0)
    sig = signed_key(keys, 1, key, genuine[0])[-1]
    frame = {
        "fragment": ((*TAG, 1, 0, 1, 0, sig), genuine[0]),
        "round": ((*TAG, 0, 1, 1, 0, sig), genuine[0]),
        "payload": ((*key, sig), chunk(CHUNK, CODEC)),
        "unsigned": (key, genuine[0]),
    }[how]
    replayer = EncodedSender(me.address, CREDS)
    try:
        with caplog.at_level(logging.WARNING, "geopipe.transport.security"):
            replayer.send(*frame)
            assert dropped(replayer)
            why = wait_failure(me)
    finally:
        replayer.close()
    want = "is not signed" if how == "unsigned" else "no group's signature verifies"
    assert want in why and "peer ('127.0.0.1'," in why, why
    assert me.refused == {} and me.receiver.messages == 0
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    with pytest.raises(TimeoutError):  # never filed
        me.inbox.get(frame[0][:7], 0.2, strict=False)
    mesh[0].post((*TAG, 0, 0), 0, [chunk(CHUNK, CODEC), chunk(NUMEL - CHUNK, CODEC)])
    mesh[1].post((*TAG, 0, 0), 1, genuine)
    got, missing, _ = me.gather((*TAG, 0, 0), 2, timeout_s=30)
    assert missing == {} and me.refused == {} and sorted(got) == [0, 1]
    assert all(same(x, y) for x, y in zip(got[1], genuine, strict=True))


def test_the_driver_makes_one_key_pair_per_group_and_keeps_it() -> None:
    ring = GroupKeyring()
    plan = SimpleNamespace(num_groups=3, group_of=lambda r: r // 2)  # 2 pipelines a group
    keys = [ring.key_of(plan, r) for r in range(6)]
    assert [k.group for k in keys] == [0, 0, 1, 1, 2, 2]
    assert len({k.private for k in keys}) == 3 and keys[0] == keys[1]  # one pair per group
    assert len({k.publics for k in keys}) == 1 and [g for g, _ in keys[0].publics] == [0, 1, 2]
    for k in keys:  # each holds its own private key, none of another group's
        assert dict(k.publics)[k.group] == k.signer().public_key().public_bytes_raw()
        assert repr(k.private) not in repr(k) and "private" not in repr(k)
    assert ring.key_of(plan, 5) == keys[5]  # asked again (a recovery): the same key
    assert GroupKeyring().key_of(plan, 5).private != keys[5].private  # a new run: fresh
    assert ring.key_of(SimpleNamespace(num_groups=1, group_of=lambda r: 0), 0) is None


def test_each_stage_actor_is_told_its_groups_key() -> None:
    """Placement.stage_spec, as launch and a grow-back call it, on a shipped cluster the
    planner runs as an outer loop: each actor's spec holds its own group's key."""
    from geopipe.config import load_cluster
    from geopipe.optimizer.runplan import plan_run
    from geopipe.runtime.control.placement import Placement

    spec = load_cluster(ROOT / "clusters" / "worldwide-64.yaml")
    plan = plan_run(spec, strict=False).outer.plan
    pl = Placement(spec, 100, 0.0, CREDS, None)
    pl.plan = plan
    specs = [pl.stage_spec(0, r) for r in range(plan.pipelines)]
    assert plan.num_groups > 1
    assert all(s.outer_key.group == s.group == plan.group_of(s.replica) for s in specs)
    assert len({s.outer_key.private for s in specs}) == plan.num_groups
    assert len({s.outer_key.publics for s in specs}) == 1
    assert pl.stage_spec(0, 0).outer_key == specs[0].outer_key


# -- who a refusal is pinned on: only a group whose own key verified the bytes ------------------
def wait_messages(net: OuterExchange, n: int) -> None:
    deadline = time.monotonic() + 10
    while net.receiver.messages < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert net.receiver.messages >= n


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_honest_groups_frame_replayed_by_a_third_party_changes_nothing(
    mesh, keys, caplog, when
) -> None:
    """Group 0's insider relays group 1's genuine signed chunk 0 (the very bytes group 1
    sends) to group 2's listener a second time, before group 1's own frame arrives or after
    it was filed. Same signed bytes: the second copy is dropped, not held against group 1
    (whose own connection, its next chunk behind it, is kept), and the gather equals the
    one without the replay. (Before: the second frame poisoned the key, group 1 refused.)"""
    me = mesh[2]
    genuine = [chunk(CHUNK, CODEC), chunk(NUMEL - CHUNK, CODEC)]
    key = (*TAG, 0, 0, 1, 0)
    relayed = (signed_key(keys, 1, key, genuine[0]), genuine[0])
    relay = EncodedSender(me.address, CREDS)
    try:
        with caplog.at_level(logging.WARNING, "geopipe.transport.security"):
            if when == "before":
                relay.send(*relayed)
                wait_messages(me, 1)
            mesh[0].post((*TAG, 0, 0), 0, [chunk(CHUNK, CODEC), chunk(NUMEL - CHUNK, CODEC)])
            mesh[1].post((*TAG, 0, 0), 1, genuine)
            wait_messages(me, 4)  # the relayed copy, or group 1's own, is not filed
            if when == "after":
                relay.send(*relayed)
            wait_refused(me)
            got, missing, _ = me.gather((*TAG, 0, 0), 2, timeout_s=30)
    finally:
        relay.close()
    assert missing == {} and me.refused == {} and sorted(got) == [0, 1]
    assert all(same(x, y) for x, y in zip(got[1], genuine, strict=True))
    assert me.receiver.refused.count == 1 and me.inbox.failures == []
    (record,) = [r for r in caplog.records if "refused" in r.getMessage()]
    assert "arrived again, same bytes: dropped" in record.getMessage()
    assert "('127.0.0.1'," in record.getMessage()
    # the round averages exactly what it would have without the replay
    n = NUMEL - CHUNK
    assert torch.equal(
        average_encoded([got[0][1], got[1][1]], n), average_encoded([got[0][1], genuine[1]], n)
    )


MALFORMED = ["size", "round", "sealed"]


@pytest.mark.parametrize("how", MALFORMED)
def test_a_malformed_frame_in_an_honest_groups_name_is_pinned_on_no_group(
    mesh, keys, caplog, how, monkeypatch
) -> None:
    """Frames claiming group 1 that the listener refuses without group 1's key having
    verified them: a header of the wrong size (signed by the insider's own group 0, but
    refused on its header, before any signature is checked), group 1's genuine signed frame
    replayed out of its round's window (round 2: a signature does not make a misplaced
    frame its signer's doing), and group 1's genuine frame with its seal's CRC altered.
    Each is refused, logged naming the peer, its connection dropped, and pinned on no
    group: group 1 is not written off, and its own chunks are gathered as sent. (Before:
    the header refusals were pinned on group 1, and the altered seal filed an error for
    group 1's key.)"""
    me = mesh[2]
    genuine = [chunk(CHUNK, CODEC), chunk(NUMEL - CHUNK, CODEC)]
    if how == "size":
        wrong = chunk(CHUNK + ROW_LEN, CODEC)
        frame = (signed_key(keys, 0, (*TAG, 0, 0, 1, 0), wrong), wrong)
    elif how == "round":
        frame = (signed_key(keys, 1, (*TAG, 0, 2, 1, 0), genuine[0]), genuine[0])
    else:
        frame = (signed_key(keys, 1, (*TAG, 0, 0, 1, 0), genuine[0]), genuine[0])
    sender = EncodedSender(me.address, CREDS)
    try:
        with caplog.at_level(logging.WARNING, "geopipe.transport.security"):
            with monkeypatch.context() as m:
                if how == "sealed":
                    m.setattr(outer_wire, "seal", lambda enc: Sealed(enc, 12345))
                sender.send(*frame)
            assert dropped(sender)
            why = wait_failure(me)
    finally:
        sender.close()
    want = {"size": "not expected", "round": "not expected", "sealed": "checksum"}[how]
    assert want in why and "peer ('127.0.0.1'," in why, why
    assert me.refused == {} and me.receiver.messages == 0
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    mesh[0].post((*TAG, 0, 0), 0, [chunk(CHUNK, CODEC), chunk(NUMEL - CHUNK, CODEC)])
    mesh[1].post((*TAG, 0, 0), 1, genuine)
    got, missing, _ = me.gather((*TAG, 0, 0), 2, timeout_s=30)
    assert missing == {} and me.refused == {} and sorted(got) == [0, 1]
    assert all(same(x, y) for x, y in zip(got[1], genuine, strict=True))


def test_two_different_payloads_a_group_signed_for_one_key_are_pinned_on_it(mesh, keys) -> None:
    """Group 1 itself (its key) signs two different payloads for one key: both verify, so
    group 1 provably sent both. Neither is averaged (the key holds an error), and group 1
    is refused, at once, naming the equivocation."""
    me = mesh[2]
    key = (*TAG, 0, 0, 1, 0)
    first, second = chunk(CHUNK, CODEC), chunk(CHUNK, CODEC)
    sender = EncodedSender(me.address, CREDS)
    try:
        sender.send(signed_key(keys, 1, key, first), first)
        sender.send(signed_key(keys, 1, key, second), second)
        assert dropped(sender)
        wait_failure(me)
    finally:
        sender.close()
    assert list(me.refused) == [1] and "group 1 signed two different payloads" in me.refused[1]
    mesh[0].post((*TAG, 0, 0), 0, [chunk(CHUNK, CODEC), chunk(NUMEL - CHUNK, CODEC)])
    t0 = time.monotonic()
    got, missing, _ = me.gather((*TAG, 0, 0), 2, timeout_s=20)
    assert time.monotonic() - t0 < 10 and sorted(got) == [0]
    assert missing[1].startswith("refused: ") and "signed two different" in missing[1]
