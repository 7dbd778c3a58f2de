"""The state hand-off plan after a recovery or grow-back (pure logic) and its wire format."""

from __future__ import annotations

import random

import pytest
import torch

from geopipe.runtime.actor.handoff import Holder, Receiver, pack, plan_handoff, unpack

SHAPES = {f"h.{i}.w": (4, 3) for i in range(6)}  # six "layers" of 12 values each


def names(*idx: int) -> frozenset[str]:
    return frozenset(f"h.{i}.w" for i in idx)


def shapes(*idx: int) -> dict:
    return {f"h.{i}.w": SHAPES[f"h.{i}.w"] for i in idx}


def test_pack_unpack_round_trip_is_exact():
    g = torch.Generator().manual_seed(0)
    state = {
        grp: {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
        for grp in ("params", "exp_avg", "exp_avg_sq")
    }
    state |= {"step": 17, "lr_step": 16}
    order = ["h.3.w", "h.0.w", "h.5.w"]
    header, flat = pack(state, order)
    assert flat.numel() == 3 * 3 * 12 and header.tolist() == [17, 16]
    out = unpack(header, flat, order, SHAPES)
    assert out["step"] == 17 and out["lr_step"] == 16
    for grp in ("params", "exp_avg", "exp_avg_sq"):
        assert list(out[grp]) == order
        for n in order:
            assert torch.equal(out[grp][n], state[grp][n])
    with pytest.raises(ValueError, match="expected"):
        unpack(header, flat[:-1], order, SHAPES)


def test_own_then_same_site_then_object_store():
    hs = [
        Holder("me", "west", 0, names(0, 1)),
        Holder("west-peer", "west", 1, names(2, 3)),
        Holder("east-peer", "east", 0, names(2, 3, 4)),
        Holder("spare", "west", None, names(4, 5)),  # outside the new layout: no rank
    ]
    rc = Receiver("me", "west", 0, shapes(0, 1, 2, 3, 4, 5))
    plan = plan_handoff([rc], hs)
    me = plan["me"]
    assert me.own == ["h.0.w", "h.1.w"]
    assert me.recvs == [(1, ["h.2.w", "h.3.w"])]  # the intra-site path wins over east
    assert plan["west-peer"].sends == [(0, ["h.2.w", "h.3.w"])]
    assert me.fetch == [("east-peer", ["h.4.w"]), ("spare", ["h.5.w"])]  # least loaded first
    assert "east-peer" not in plan and "spare" not in plan  # they only answer fetches


def test_equal_holders_share_the_load():
    hs = [Holder("a", "west", 0, names(0, 1, 2, 3)), Holder("b", "west", 1, names(0, 1, 2, 3))]
    rc = [Receiver(f"r{i}", "west", 2 + i, shapes(0, 1, 2, 3)) for i in range(2)]
    plan = plan_handoff(rc, hs)
    sent = {h: sum(len(n) for _, n in plan[h].sends) for h in ("a", "b")}
    assert sent == {"a": 4, "b": 4}


def test_missing_state_names_the_parameter():
    with pytest.raises(KeyError, match=r"h\.5\.w"):
        plan_handoff([Receiver("r", "west", 0, shapes(4, 5))], [Holder("a", "west", 1, names(4))])


def test_random_layouts_are_covered_once_and_pairs_agree():
    """Over many random layouts: every receiver gets every name exactly once, from a holder
    that has it; each receive is matched by the sender's send with the same name order;
    the torch.distributed path is only used inside one site and only by ranked holders."""
    rng = random.Random(0)
    planned = 0
    for _ in range(500):
        sites = ["west", "east"]
        holders, receivers = [], []
        rank = dict.fromkeys(sites, 0)
        for i in range(rng.randint(1, 5)):
            site = rng.choice(sites)
            ranked = rng.random() < 0.7
            lo = rng.randrange(6)
            held = names(*range(lo, rng.randint(lo + 1, 6)))
            holders.append(Holder(f"h{i}", site, rank[site] if ranked else None, held))
            if ranked:
                need = rng.sample(range(6), rng.randint(1, 3))
                receivers.append(Receiver(f"h{i}", site, rank[site], shapes(*need)))
                rank[site] += 1
        for j in range(rng.randint(0, 2)):
            site = rng.choice(sites)
            need = rng.sample(range(6), rng.randint(1, 3))
            receivers.append(Receiver(f"new{j}", site, rank[site], shapes(*need)))
            rank[site] += 1
        have = set().union(*(h.names for h in holders))
        if not all(set(r.shapes) <= have for r in receivers):
            with pytest.raises(KeyError):
                plan_handoff(receivers, holders)
            continue
        plan = plan_handoff(receivers, holders)
        planned += 1
        by_key = {h.key: h for h in holders}
        by_rank = {(h.site, h.rank): h for h in holders if h.rank is not None}
        for r in receivers:
            got = list(plan[r.key].own)
            assert set(got) <= by_key[r.key].names if r.key in by_key else not got
            for src, ns in plan[r.key].recvs:
                h = by_rank[(r.site, src)]
                assert set(ns) <= h.names
                assert (r.rank, ns) in plan[h.key].sends
                got += ns
            for key, ns in plan[r.key].fetch:
                h = by_key[key]
                assert set(ns) <= h.names
                assert h.site != r.site or h.rank is None  # never the slow path needlessly
                got += ns
            assert sorted(got) == sorted(r.shapes)
        for h in holders:  # every send is someone's receive
            for dst, ns in plan[h.key].sends if h.key in plan else []:
                r = next(x for x in receivers if x.site == h.site and x.rank == dst)
                assert (h.rank, ns) in plan[r.key].recvs
    assert planned > 100  # the loop checked plans, not only errors


def test_a_tied_heads_copy_comes_from_the_embedding_under_its_alias():
    """A layout where one stage held both ends of a tied embedding kept only the embedding;
    a new head stage receives it under that name (its engine resolves the alias)."""
    holder = Holder("old", "east", 0, frozenset({"model.embed_tokens.weight", "model.norm.weight"}))
    head = Receiver("head", "east", 1, {"lm_head.weight": (8, 4), "model.norm.weight": (4,)})
    with pytest.raises(KeyError, match="lm_head"):
        plan_handoff([head], [holder])
    todo = plan_handoff([head], [holder], {"lm_head.weight": "model.embed_tokens.weight"})
    assert todo["head"].recvs == [(0, ["model.embed_tokens.weight", "model.norm.weight"])]
    assert todo["old"].sends == [(1, ["model.embed_tokens.weight", "model.norm.weight"])]
