"""Losing a replica group of an outer-loop run: the driver's decisions, against a scripted
worker seam (the real exchange is tests/integration/test_outer_failures_runtime.py's).

* which groups a round goes on with when some did not hear each other (``kept_groups``);
* the layout without a lost group's pipelines (``without_groups``);
* a round interrupted by a death: ``GroupsLost`` names the group, and asked again over the
  survivors the round sends nothing twice and averages over the survivors only;
* a silent peer: the round waits ``health.wan_outage_s``, the console names the link, then
  the peer group is written off (``silent``);
* on the real data plane (no Ray): a gather waiting on a dead peer ends when the peer is
  dropped, with the survivors' payloads, and reports the dead one missing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from geopipe.config import parse_cluster
from geopipe.optimizer.penalty import PenaltyModel, parse_table
from geopipe.optimizer.runplan import plan_run
from geopipe.outer import ROW_LEN, encode_delta
from geopipe.plan import PipelineLayout, Plan
from geopipe.runtime.actor.outer_wire import OuterExchange, OuterPeer
from geopipe.runtime.control.outerfail import without_groups
from geopipe.runtime.control.outerloop import GroupsLost, OuterRounds, kept_groups
from geopipe.runtime.control.workers import CallTimeout, WorkerLost
from geopipe.transport.codec import make_codec
from geopipe.transport.security import make_credentials

LOCAL = Path(__file__).resolve().parents[2] / "clusters" / "local-2dc.yaml"


def test_two_groups_cut_apart_keep_group_0() -> None:
    assert kept_groups({0: {0}, 1: {1}}) == [0]


def test_the_largest_set_that_heard_each_other_is_kept() -> None:
    # group 1 heard nobody and nobody heard it; 0 and 2 heard each other
    assert kept_groups({0: {0, 2}, 1: {1}, 2: {0, 2}}) == [0, 2]
    # a one-way silence (2 did not hear 0) splits 0 from 2: {0, 1} and {1, 2} tie, lower ids
    assert kept_groups({0: {0, 1, 2}, 1: {0, 1, 2}, 2: {1, 2}}) == [0, 1]
    assert kept_groups({0: {0, 1, 2}, 1: {0, 1, 2}, 2: {0, 1, 2}}) == [0, 1, 2]


def _plan(groups: int, per_group: int = 2) -> Plan:
    """``groups`` replica groups of ``per_group`` pipelines of two stages, group ``g`` in
    the ``g``-th of east, west, south."""
    sites = ["east", "west", "south"][:groups]
    mix = tuple(
        PipelineLayout((s, s), ((0, 1), (1, 2)), 2, (0,), ("none",))
        for s in sites
        for _ in range(per_group)
    )
    return Plan(
        pipelines=per_group * groups,
        stage_sites=mix[0].stage_sites,
        partition=mix[0].partition,
        micro_batch_size=1,
        seq_len=8,
        num_microbatches=2,
        schedule="1f1b",
        delta_n=(0,),
        codecs=("none",),
        mix=mix,
        groups=tuple(g for g in range(groups) for _ in range(per_group)),
    )


def test_the_layout_without_a_lost_group_keeps_the_others_stable_ids() -> None:
    """The survivors' plan names each pipeline's group by the id its actors keep (their data
    slice, their outer key): never renumbered 0.., so ``group_of`` cannot answer another
    group's id after a loss."""
    plan = _plan(3)
    left = without_groups(plan, {0})
    assert left.pipelines == 4 and left.groups == (1, 1, 2, 2) and left.num_groups == 2
    assert left.group_ids == (1, 2) and [left.group_of(r) for r in range(4)] == [1, 1, 2, 2]
    assert [p.stage_sites[0] for p in left.mix] == ["west", "west", "south", "south"]
    assert left.stage_sites == ("west", "west")  # pipeline 0's, as any mixed plan's
    assert left.total_microbatches == 8  # the survivors' slices: the global batch shrinks
    assert left.group_microbatches(1) == left.group_microbatches(2) == 4
    assert Plan.from_dict(left.to_dict()) == left  # as status.json and events carry it
    middle = without_groups(plan, {1})
    assert middle.groups == (0, 0, 2, 2) and middle.group_ids == (0, 2)
    assert without_groups(middle, {0}).groups == (2, 2)  # a second loss: still stable
    with pytest.raises(ValueError, match="no replica group"):
        without_groups(plan, {0, 1, 2})


def test_a_step_after_losing_the_first_group_records_the_survivors() -> None:
    """After group 0 is lost the survivors' actors (not reconfigured) report their launch
    positions, past the shrunk plan's pipelines: the step's group losses are named by the
    launch plan's groups (the lost group's nan) and its tokens are the survivors' slices."""
    from geopipe.runtime.actor.executor import IterationResult
    from geopipe.runtime.control.metrics import aggregate
    from geopipe.runtime.control.outerfail import recorded_shape

    launched = _plan(3)
    left = without_groups(launched, {0})
    results = [
        IterationResult(
            stage=1,
            replica=r,
            step=5,
            losses=[float(r), float(r)],
            busy_s=0.1,
            wait_s=0.0,
            duration_s=0.2,
            start=0.0,
            wan_bytes=0,
            micro_batches=2,
            optimizer_steps=1,
        )
        for r in range(launched.pipelines)
        if launched.group_of(r) != 0  # launch positions 2..5
    ]
    tokens, groups = recorded_shape(12, left, launched)
    assert tokens == 8 * 1 * 8  # 8 of the launch's 12 micro-batches of 1 sequence of 8
    m = aggregate(results, left.num_stages, tokens, groups)
    assert m.group_loss[1:] == [2.5, 4.5] and m.group_loss[0] != m.group_loss[0]  # nan
    assert m.tokens == 64 and m.loss == pytest.approx(3.5)
    # a run without an outer loop records the global batch, its plan's groups
    assert recorded_shape(12, launched, None) == (12 * 8, launched.groups)


FROZEN = object()  # a call that never answers


class Script:
    """A worker seam whose actors (ints) answer the outer-loop calls from a script: actor
    ``i`` is group ``i // 2`` (two ZeRO-1 replicas per group), ``dead`` actors raise
    WorkerLost, ``deaf`` groups hold no payload of the groups listed. Time is virtual: a
    gather's wait and a frozen call's timeout advance :meth:`clock` (the rounds' clock)
    instead of sleeping, so how many slices fit in ``health.wan_outage_s`` is exact and
    no count depends on how late a loaded runner wakes a sleeper."""

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.calls: list[tuple[int, str, tuple]] = []
        self.dead: set[int] = set()
        self.doomed: dict[int, str] = {}  # actor -> the call it dies in
        self.frozen: set[int] = set()  # actors whose gathers never answer
        self.deaf: dict[int, set[int]] = {}  # group -> the groups it does not hear
        self.now = 0.0  # the virtual clock's seconds

    def clock(self) -> float:
        return self.now

    def call(self, actor: int, method: str, *args):
        self.calls.append((actor, method, args))
        if self.doomed.get(actor) == method:
            self.dead.add(actor)
        if actor in self.dead:
            return WorkerLost(f"actor {actor} died")
        g = actor // 2
        if method == "outer_begin":
            return {
                "group": g,
                "stage": 0,
                "partition": actor % 2,
                "address": ("h", actor),
                "layout": "L",
            }
        if method == "outer_send":
            return {"payload_bytes": 100, "codec_error": 0.0}
        if method == "outer_gather" and actor in self.frozen:
            return FROZEN
        if method == "outer_gather":  # the actor waits its slice while a peer is missing
            live = set(range(self.groups)) - {a // 2 for a in self.dead}
            if self.deaf and actor == 0:
                self.now += args[1]  # the slice it waited
            return {"have": sorted(live - self.deaf.get(g, set())), "missing": {}}
        if method == "outer_apply":
            return {"round": 0, "digest": f"{args[1]}/{actor % 2}"}
        return None

    def get(self, pendings, timeout=None):
        for p in pendings:
            if p is FROZEN:
                self.now += timeout or 0.0  # the driver waited its deadline out
                raise CallTimeout("no answer")
            if isinstance(p, BaseException):
                raise p
        return list(pendings)

    def of(self, method: str) -> list[tuple[int, tuple]]:
        return [(a, args) for a, m, args in self.calls if m == method]


def _rounds(groups: int, health: dict | None = None) -> tuple[OuterRounds, Script, list, list]:
    """The outer run local-2dc plans (H = 2), driven over ``groups`` sites: for three, a
    third site (south) is added to the spec the rounds pace their links by."""
    doc = yaml.safe_load(LOCAL.read_text())
    doc["plan"].update(strategy="outer", outer={"h": 2, "codec": "none"})
    doc["training"]["checkpoint"] = {"every_steps": 2}
    if health:
        doc["health"] = health
    spec = parse_cluster(doc, "t")
    row = {"replicas": 2, "h": 2, "fragments": 1, "codec": "none", "rel_gap": 0.01}
    table = {"source": "t", "model": "t", "steps": 1, "tokens_per_step": 1, "sync_noise": 0.0}
    run = plan_run(spec, penalty=PenaltyModel(parse_table({**table, "rows": [row]}), "t")).outer
    if groups == 3:
        doc["sites"].append({**doc["sites"][1], "name": "south"})
        doc["links"] += [
            {**doc["links"][0], "to": "south"},
            {**doc["links"][0], "from": "west", "to": "south"},
        ]
        spec = parse_cluster(doc, "t")
    script, events, said = Script(groups), [], []
    rounds = OuterRounds(spec, run, script, said.append, lambda k, **f: events.append((k, f)))
    rounds.clock = script.clock  # the gather's slices and deadlines run on the script's time
    sites = [s.name for s in spec.sites]
    rounds.begin(list(range(2 * groups)), [sites[a // 2] for a in range(2 * groups)])
    return rounds, script, events, said


def test_a_death_in_the_round_is_named_and_the_round_finishes_over_the_survivors() -> None:
    rounds, script, events, _ = _rounds(3)
    actors = list(range(6))
    rounds.after_step(1, actors)
    script.doomed = {3: "outer_gather"}  # group 1's second replica dies after its send
    with pytest.raises(GroupsLost) as err:
        rounds.after_step(2, actors)
    assert err.value.groups == [1] and not err.value.silent
    assert isinstance(err.value, WorkerLost)  # the controller's failure path catches it
    sends = len(script.of("outer_send"))
    survivors = [0, 1, 4, 5]
    rounds.drop([1], survivors)
    assert script.of("outer_drop") == [(a, ([1],)) for a in survivors]
    rounds.after_step(2, survivors)  # asked again: the send is not repeated
    assert len(script.of("outer_send")) == sends
    assert script.of("outer_apply") == [(a, (0, [0, 2])) for a in survivors]
    (_, row), *_ = [e for e in events if e[0] == "outer_round"]
    assert row["groups"] == 2 and row["digests_equal"] and row["step"] == 2
    rounds.after_step(2, survivors)  # and once done, nothing more
    assert len(script.of("outer_apply")) == 4
    rounds.after_step(3, survivors)
    rounds.after_step(4, survivors)
    assert script.of("outer_apply")[-4:] == [(a, (0, [0, 2])) for a in survivors]


def test_a_silent_peer_is_waited_for_named_then_written_off() -> None:
    health = {"wan_outage_s": 1.0, "heartbeat_s": 0.2}
    rounds, script, events, said = _rounds(2, health)
    actors = [0, 1, 2, 3]
    script.deaf = {0: {1}, 1: {0}}  # the link between the groups stalls, both sides live
    rounds.after_step(1, actors)
    with pytest.raises(GroupsLost) as err:
        rounds.after_step(2, actors)
    assert err.value.groups == [1] and err.value.silent
    assert "sites east <-> west" in said[0] and "health.wan_outage_s" in said[0]
    gathers = script.of("outer_gather")
    assert len(gathers) == 5 * 4  # asked in slices of heartbeat_s for a second (virtual)
    assert all(args[1] <= 0.2 for _, args in gathers)
    assert not script.of("outer_apply") and not events


def test_a_frozen_group_is_heard_from_by_no_one_and_written_off() -> None:
    health = {"wan_outage_s": 1.0, "heartbeat_s": 0.2, "unresponsive_s": 0.1}
    rounds, script, _, said = _rounds(2, health)
    actors = [0, 1, 2, 3]
    script.frozen = {3}  # group 1's second replica stops answering in the round
    rounds.after_step(1, actors)
    with pytest.raises(GroupsLost) as err:
        rounds.after_step(2, actors)
    assert err.value.groups == [1] and err.value.silent
    assert "group 0 <- 1 (sites east <-> west)" in said[0]
    assert "group 1 <- 1" not in said[0]  # a mute group is no link of its own
    # its call still in flight is not asked again each slice
    assert [a for a, _ in script.of("outer_gather")].count(3) == 1
    assert [a for a, _ in script.of("outer_gather")].count(0) >= 3


def test_a_gather_waiting_on_a_dead_peer_ends_when_it_is_dropped() -> None:
    creds = make_credentials("outer-failures", encrypt=True)
    nets = [OuterExchange("127.0.0.1", "127.0.0.1", creds, 1 << 20, 10) for _ in range(3)]
    try:
        for g, net in enumerate(nets):
            net.connect([OuterPeer(h, o.address, "L") for h, o in enumerate(nets) if h != g])
        tag = ("O", 0, 0, 0, 0)
        for g in (0, 2):
            nets[g].post(tag, g, [encode_delta(torch.full((ROW_LEN,), g), make_codec("none"))])
        nets[1].close()  # group 1 dies before sending
        out: list = []
        waiter = threading.Thread(target=lambda: out.append(nets[0].gather(tag, 1, 60.0)))
        t0 = time.monotonic()
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()  # still waiting for group 1
        nets[0].drop([1])  # the driver wrote it off, from another thread
        waiter.join(10)
        assert not waiter.is_alive() and time.monotonic() - t0 < 10
        got, missing, _ = out[0]
        assert sorted(got) == [2] and missing == {1: "dropped"}
        # not dropped: a silent peer is reported after the timeout, naming it
        got, missing, _ = nets[2].gather(tag, 1, 0.5)
        assert sorted(got) == [0] and list(missing) == [1]
        assert 1 not in nets[0].peers and 1 in nets[2].peers
    finally:
        for i in (0, 2):
            nets[i].close()
