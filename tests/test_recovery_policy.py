"""The recovery policy, exhaustively over small clusters plus hand-checked cases.

Every subset of failed actors of a running plan (D = 1 and 2) on 2 sites × {1..3} devices,
3–4 layers, roomy and tight memory, devices lost with their actors or not, with and
without buddy copies of the ZeRO-1 shards, with and without a checkpoint: the decision's
kind must follow from (fits, recoverable, checkpoint) and its layout and sources must obey
the invariants.
"""

from __future__ import annotations

import itertools
import math

import pytest

from geopipe.pipeline.templates import TemplateSet, best_uniform, build_templates
from geopipe.plan import Plan
from geopipe.runtime.recovery import (
    Fail,
    Failure,
    Reconfigure,
    RestoreFromCheckpoint,
    Slot,
    decide,
    placement_for,
    zero1_state,
)
from tests.test_templates import SMALL, brute_uniform, small_spec


def running_plan(ts: TemplateSet, d: int) -> Plan | None:
    """What the planner would run with ``d`` pipelines: its deepest shape (if it fits)."""
    v = ts.max_vector(ts.devices, d)
    if v is None or ts.num_microbatches % d:
        return None
    pr = ts.predict(v, d, ts.num_microbatches // d)
    if pr is None or not pr.feasible:
        return None
    tmpl = ts.template(v)
    return ts.plan_for(tmpl, d, ts.num_microbatches // d)


def owners(plan: Plan) -> list[int]:
    return [k for k, (a, z) in enumerate(plan.partition) for _ in range(a, z)]


def check_layout(dec: Reconfigure | RestoreFromCheckpoint, f: Failure, ts: TemplateSet) -> None:
    new = dec.plan
    alive = f.devices_alive
    assert new.pipelines * new.num_microbatches == f.plan.pipelines * f.plan.num_microbatches
    assert new.micro_batch_size == f.plan.micro_batch_size
    assert new.partition[0][0] == 0 and new.partition[-1][1] == ts.num_layers
    assert all(a < z for a, z in new.partition)
    assert all(new.partition[i][1] == new.partition[i + 1][0] for i in range(new.num_stages - 1))
    assert dec.template.stage_sites == new.stage_sites
    # Uses exactly the sites with devices, each a contiguous run of ≥ 1 stages.
    assert set(new.stage_sites) == {s for s, n in alive.items() if n > 0}
    runs = [s for i, s in enumerate(new.stage_sites) if i == 0 or new.stage_sites[i - 1] != s]
    assert len(runs) == len(set(runs))
    # One slot per actor, in its stage's site, never shared, within the alive devices.
    want = {(k, r) for k in range(new.num_stages) for r in range(new.pipelines)}
    assert set(dec.placement) == want
    assert len(set(dec.placement.values())) == len(want)
    for (k, _), slot in dec.placement.items():
        assert slot.site == new.stage_sites[k]
        assert 0 <= slot.index < alive[slot.site]
    for s, n in alive.items():
        assert new.pipelines * new.stage_sites.count(s) <= n


def check_sources(dec: Reconfigure, f: Failure) -> None:
    old_owner = owners(f.plan)
    for (k, r), entries in dec.sources.items():
        a, z = dec.plan.partition[k]
        assert [e.layer for e in entries] == list(range(a, z))
        assert r < dec.plan.pipelines
        for e in entries:
            k_old = old_owner[e.layer]
            assert e.params[0] == k_old and e.params not in f.dead
            assert e.optimizer and all(x[0] == k_old and x not in f.dead for x in e.optimizer)
    assert set(dec.sources) == set(dec.placement)


def expected_kind(f: Failure, ts: TemplateSet) -> type:
    alive = tuple(f.devices_alive.get(s, 0) for s in ts.sites)
    fits = brute_uniform(ts, alive, f.plan.pipelines * f.plan.num_microbatches) < math.inf
    live = {k for k in range(f.plan.num_stages) if f.live_replicas(k)}
    ok = f.params_available & f.optimizer_available & live
    recoverable = all(k in ok for k in owners(f.plan))
    if fits and recoverable:
        return Reconfigure
    if fits and f.checkpoint_step is not None:
        return RestoreFromCheckpoint
    return Fail


@pytest.mark.parametrize(("devices", "n_layer", "mem"), SMALL)
def test_every_failure_subset(devices, n_layer, mem) -> None:
    spec = small_spec(devices, n_layer, mem)
    ts = build_templates(spec)
    counts = dict(zip(ts.sites, ts.devices, strict=True))
    seen: set[type] = set()
    for d in (1, 2):
        plan = running_plan(ts, d)
        if plan is None:
            continue
        actors = [(k, r) for k in range(plan.num_stages) for r in range(d)]
        for n_dead in range(len(actors) + 1):
            for dead in itertools.combinations(actors, n_dead):
                for devices_die, buddy, ckpt in itertools.product(
                    (True, False), (True, False), (None, 12)
                ):
                    alive = dict(counts)
                    if devices_die:  # the node went down with the actor
                        for k, _ in dead:
                            alive[plan.stage_sites[k]] -= 1
                    params, opt = zero1_state(plan, dead, buddy_copies=buddy)
                    f = Failure(plan, frozenset(dead), alive, params, opt, ckpt)
                    dec = decide(f, ts)
                    kind = expected_kind(f, ts)
                    assert isinstance(dec, kind), (plan, dead, alive, buddy, ckpt, dec)
                    seen.add(kind)
                    if isinstance(dec, Reconfigure):
                        check_layout(dec, f, ts)
                        check_sources(dec, f)
                    elif isinstance(dec, RestoreFromCheckpoint):
                        assert dec.step == ckpt
                        assert dec.reason
                        check_layout(dec, f, ts)
                    else:
                        assert dec.reason
    if seen:  # some plan runs: losing nothing always reconfigures (to an equal layout)
        assert Reconfigure in seen


# ---------------------------------------------------------------------------------------------
# Hand-checked cases


def _local_2x2() -> tuple[TemplateSet, Plan]:
    ts = build_templates(small_spec((2, 2), n_layer=2))
    plan = running_plan(ts, 2)
    assert plan is not None and plan.stage_sites == ("s0", "s1") and plan.pipelines == 2
    return ts, plan


def test_one_replica_lost_with_buddy_copies_reconfigures() -> None:
    ts, plan = _local_2x2()
    dead = frozenset({(0, 1)})
    params, opt = zero1_state(plan, dead, buddy_copies=True)
    assert params == opt == frozenset({0, 1})  # replica 0 holds shard 1's copy
    f = Failure(plan, dead, {"s0": 1, "s1": 2}, params, opt, checkpoint_step=None)
    dec = decide(f, ts)
    assert isinstance(dec, Reconfigure)
    assert dec.pipelines == 1  # s0 has one device left: one pipeline
    for entries in dec.sources.values():
        for e in entries:
            if e.layer < plan.partition[0][1]:  # held by old stage 0: only replica 0 lives
                assert e.params == (0, 0) and e.optimizer == ((0, 0),)
            else:
                assert e.params[0] == 1 and set(e.optimizer) == {(1, 0), (1, 1)}


def test_one_replica_lost_without_buddy_copies_restores() -> None:
    ts, plan = _local_2x2()
    dead = frozenset({(0, 1)})
    params, opt = zero1_state(plan, dead, buddy_copies=False)
    assert params == frozenset({0, 1}) and opt == frozenset({1})
    f = Failure(plan, dead, {"s0": 1, "s1": 2}, params, opt, checkpoint_step=20)
    dec = decide(f, ts)
    assert isinstance(dec, RestoreFromCheckpoint) and dec.step == 20
    assert "optimizer state" in dec.reason and dec.plan.pipelines == 1
    no_ckpt = decide(Failure(plan, dead, {"s0": 1, "s1": 2}, params, opt, None), ts)
    assert isinstance(no_ckpt, Fail)
    assert "optimizer state" in no_ckpt.reason and "no complete checkpoint" in no_ckpt.reason


def test_a_whole_stage_lost_needs_the_checkpoint() -> None:
    ts, plan = _local_2x2()
    dead = frozenset({(1, 0), (1, 1)})
    params, opt = zero1_state(plan, dead, buddy_copies=True)
    assert params == opt == frozenset({0})
    dec = decide(Failure(plan, dead, {"s0": 2, "s1": 0}, params, opt, 40), ts)
    # s1 is gone: the new layout lives in s0 alone, restored from the checkpoint.
    assert isinstance(dec, RestoreFromCheckpoint)
    assert set(dec.plan.stage_sites) == {"s0"} and "parameters" in dec.reason
    assert all(slot.site == "s0" for slot in dec.placement.values())


def test_process_crash_keeps_the_device() -> None:
    """A crashed actor whose device lives on: the layout is the full cluster's best."""
    ts, plan = _local_2x2()
    dead = frozenset({(1, 1)})
    params, opt = zero1_state(plan, dead, buddy_copies=True)
    full = {"s0": 2, "s1": 2}
    dec = decide(Failure(plan, dead, full, params, opt, None), ts)
    assert isinstance(dec, Reconfigure)
    tmpl, d = best_uniform(ts, full)
    assert dec.template == tmpl and dec.pipelines == d
    # Nothing lost at all: the same answer (the policy has no memory of the old layout).
    params, opt = zero1_state(plan, (), buddy_copies=False)
    same = decide(Failure(plan, frozenset(), full, params, opt, None), ts)
    assert isinstance(same, Reconfigure) and same.plan == dec.plan


def test_model_no_longer_fits() -> None:
    ts = build_templates(small_spec((2, 2), n_layer=2, mem_factor=0.75))
    plan = running_plan(ts, 1)
    assert plan is not None
    dead = frozenset((k, 0) for k in range(plan.num_stages) if plan.stage_sites[k] == "s0")
    params, opt = zero1_state(plan, dead, buddy_copies=True)
    dec = decide(Failure(plan, dead, {"s0": 0, "s1": 1}, params, opt, 5), ts)
    assert isinstance(dec, Fail) and "no longer fits" in dec.reason


def test_zero1_state_rings() -> None:
    ts = build_templates(small_spec((3, 3), n_layer=2, global_batch=6))
    plan = running_plan(ts, 3)
    assert plan is not None and plan.pipelines == 3 and plan.num_stages == 2
    # Buddy copies: shard r lives on r and r+1 mod 3.
    assert zero1_state(plan, {(0, 0)}, buddy_copies=True) == ({0, 1}, {0, 1})
    assert zero1_state(plan, {(0, 0), (0, 1)}, buddy_copies=True) == ({0, 1}, {1})
    assert zero1_state(plan, {(0, 0), (0, 2)}, buddy_copies=True) == ({0, 1}, {1})
    assert zero1_state(plan, {(0, 0), (0, 1), (0, 2)}, buddy_copies=True) == ({1}, {1})
    # Plain ZeRO-1: any lost replica loses its shard.
    assert zero1_state(plan, {(0, 0)}, buddy_copies=False) == ({0, 1}, {1})
    assert zero1_state(plan, set(), buddy_copies=False) == ({0, 1}, {0, 1})


def test_failure_input_is_validated() -> None:
    _, plan = _local_2x2()
    ok = frozenset({0, 1})
    with pytest.raises(ValueError, match="dead actors"):
        Failure(plan, frozenset({(5, 0)}), {"s0": 2, "s1": 2}, ok, ok, None)
    with pytest.raises(ValueError, match="params_available"):
        Failure(plan, frozenset(), {"s0": 2, "s1": 2}, frozenset({7}), ok, None)
    with pytest.raises(ValueError, match="negative"):
        Failure(plan, frozenset(), {"s0": -1, "s1": 2}, ok, ok, None)


def test_availability_claims_for_dead_stages_are_ignored() -> None:
    """A caller claiming state for a stage with no live replica cannot make the policy
    point at a dead actor."""
    ts, plan = _local_2x2()
    dead = frozenset({(1, 0), (1, 1)})
    everything = frozenset({0, 1})
    dec = decide(Failure(plan, dead, {"s0": 2, "s1": 2}, everything, everything, None), ts)
    assert isinstance(dec, Fail) and "parameters" in dec.reason


def test_placement_for_rejects_too_few_devices() -> None:
    _, plan = _local_2x2()
    assert placement_for(plan, {"s0": 2, "s1": 2})[(1, 1)] == Slot("s1", 1)
    with pytest.raises(ValueError, match="too few devices"):
        placement_for(plan, {"s0": 2, "s1": 1})
