"""The recovery and grow-back policies, exhaustively over small clusters plus hand-checked
cases (pure: no Ray, no DeepSpeed).

Every subset of failed actors of a running plan (D = 1 and 2) on 2 sites × {1..3} devices,
3–4 layers, roomy and tight memory, devices lost with their actors or not, with and
without recovery snapshots (with them every replica holds its stage's full state; without,
the Adam state is ZeRO-1 sharded), with and without a checkpoint: the decision's kind must
follow from (fits, recoverable, checkpoint) and its layout must obey the invariants.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import pytest

from geopipe.optimizer.policies import (
    Actor,
    Fail,
    Failure,
    GrowBack,
    Reconfigure,
    RestoreFromCheckpoint,
    Stay,
    decide,
    decide_grow,
)
from geopipe.optimizer.templates import TemplateSet, best_uniform, build_templates
from geopipe.plan import Plan
from tests.unit.test_templates import SMALL, brute_uniform, small_spec


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


def availability(
    plan: Plan, dead: Iterable[Actor], *, snapshots: bool
) -> tuple[frozenset[int], frozenset[int]]:
    """``(params_available, adam_state_available)`` per stage. With recovery snapshots every
    replica holds its stage's full state; without, each holds one ZeRO-1 shard of the Adam
    state, so the state survives only if every replica of the stage lives."""
    gone = set(dead)
    params, adam = set(), set()
    for k in range(plan.num_stages):
        alive = [(k, r) not in gone for r in range(plan.pipelines)]
        if any(alive):
            params.add(k)
        if all(alive) or (snapshots and any(alive)):
            adam.add(k)
    return frozenset(params), frozenset(adam)


def owners(plan: Plan) -> list[int]:
    return [k for k, (a, z) in enumerate(plan.partition) for _ in range(a, z)]


def check_layout(dec: Reconfigure | RestoreFromCheckpoint, f: Failure, ts: TemplateSet) -> None:
    """Invariants of the new layout, identical pipelines or a mix of templates."""
    new = dec.plan
    alive = f.devices_alive
    assert new.total_microbatches == f.plan.total_microbatches  # the global batch stays
    assert new.micro_batch_size == f.plan.micro_batch_size
    assert dec.template.stage_sites == new.stage_sites
    layer_sites = None
    for r in range(new.pipelines):
        one = new.pipeline(r)
        assert one.partition[0][0] == 0 and one.partition[-1][1] == ts.num_layers
        assert all(a < z for a, z in one.partition)
        assert all(
            one.partition[i][1] == one.partition[i + 1][0] for i in range(one.num_stages - 1)
        )
        # Uses exactly the sites with devices, each a contiguous run of ≥ 1 stages.
        assert set(one.stage_sites) == {s for s, n in alive.items() if n > 0}
        runs = [s for i, s in enumerate(one.stage_sites) if i == 0 or one.stage_sites[i - 1] != s]
        assert len(runs) == len(set(runs))
        # Every pipeline puts each layer in the same site (no reduction crosses a WAN link).
        sites = [
            s for (a, z), s in zip(one.partition, one.stage_sites, strict=True) for _ in range(a, z)
        ]
        assert layer_sites in (None, sites)
        layer_sites = sites
    # Within the alive devices.
    for s, n in alive.items():
        assert sum(1 for key in new.actors() if new.site_of(*key) == s) <= n


def expected_kind(f: Failure, ts: TemplateSet) -> type:
    alive = tuple(f.devices_alive.get(s, 0) for s in ts.sites)
    fits = brute_uniform(ts, alive, f.plan.total_microbatches) < math.inf
    live = {k for k in range(f.plan.num_stages) if f.live_replicas(k)}
    ok = f.params_available & f.adam_state_available & live
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
                for devices_die, snapshots, ckpt in itertools.product(
                    (True, False), (True, False), (None, 12)
                ):
                    alive = dict(counts)
                    if devices_die:  # the node went down with the actor
                        for k, _ in dead:
                            alive[plan.stage_sites[k]] -= 1
                    params, adam = availability(plan, dead, snapshots=snapshots)
                    f = Failure(plan, frozenset(dead), alive, params, adam, ckpt)
                    dec = decide(f, ts)
                    kind = expected_kind(f, ts)
                    assert isinstance(dec, kind), (plan, dead, alive, snapshots, ckpt, dec)
                    seen.add(kind)
                    if isinstance(dec, Reconfigure):
                        check_layout(dec, f, ts)
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


def test_one_replica_lost_with_snapshots_reconfigures() -> None:
    ts, plan = _local_2x2()
    dead = frozenset({(0, 1)})
    params, adam = availability(plan, dead, snapshots=True)
    assert params == adam == frozenset({0, 1})  # replica 0 holds stage 0's full state
    f = Failure(plan, dead, {"s0": 1, "s1": 2}, params, adam, checkpoint_step=None)
    dec = decide(f, ts)
    assert isinstance(dec, Reconfigure)
    assert dec.pipelines == 1  # s0 has one device left: one pipeline
    assert dec.plan.stage_sites.count("s0") <= 1


def test_one_replica_lost_without_snapshots_restores() -> None:
    ts, plan = _local_2x2()
    dead = frozenset({(0, 1)})
    params, adam = availability(plan, dead, snapshots=False)
    assert params == frozenset({0, 1}) and adam == frozenset({1})
    f = Failure(plan, dead, {"s0": 1, "s1": 2}, params, adam, checkpoint_step=20)
    dec = decide(f, ts)
    assert isinstance(dec, RestoreFromCheckpoint) and dec.step == 20
    assert "optimizer state" in dec.reason and dec.plan.pipelines == 1
    no_ckpt = decide(Failure(plan, dead, {"s0": 1, "s1": 2}, params, adam, None), ts)
    assert isinstance(no_ckpt, Fail)
    assert "optimizer state" in no_ckpt.reason and "no complete checkpoint" in no_ckpt.reason


def test_a_whole_stage_lost_needs_the_checkpoint() -> None:
    ts, plan = _local_2x2()
    dead = frozenset({(1, 0), (1, 1)})
    params, adam = availability(plan, dead, snapshots=True)
    assert params == adam == frozenset({0})
    dec = decide(Failure(plan, dead, {"s0": 2, "s1": 0}, params, adam, 40), ts)
    # s1 is gone: the new layout lives in s0 alone, restored from the checkpoint.
    assert isinstance(dec, RestoreFromCheckpoint)
    assert set(dec.plan.stage_sites) == {"s0"} and "parameters" in dec.reason


def test_process_crash_keeps_the_device() -> None:
    """A crashed actor whose device lives on: the layout is the full cluster's best."""
    ts, plan = _local_2x2()
    dead = frozenset({(1, 1)})
    params, adam = availability(plan, dead, snapshots=True)
    full = {"s0": 2, "s1": 2}
    dec = decide(Failure(plan, dead, full, params, adam, None), ts)
    assert isinstance(dec, Reconfigure)
    tmpl, d = best_uniform(ts, full)
    assert dec.template == tmpl and dec.pipelines == d
    # Nothing lost at all: the same answer (the policy has no memory of the old layout).
    params, adam = availability(plan, (), snapshots=False)
    same = decide(Failure(plan, frozenset(), full, params, adam, None), ts)
    assert isinstance(same, Reconfigure) and same.plan == dec.plan


def test_model_no_longer_fits() -> None:
    ts = build_templates(small_spec((2, 2), n_layer=2, mem_factor=0.75))
    plan = running_plan(ts, 1)
    assert plan is not None
    dead = frozenset((k, 0) for k in range(plan.num_stages) if plan.stage_sites[k] == "s0")
    params, adam = availability(plan, dead, snapshots=True)
    dec = decide(Failure(plan, dead, {"s0": 0, "s1": 1}, params, adam, 5), ts)
    assert isinstance(dec, Fail) and "no longer fits" in dec.reason


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


# ---------------------------------------------------------------------------------------------
# Grow-back


def test_grow_back_when_devices_return() -> None:
    """A run shrunk to one pipeline by a lost device grows back to two once the device
    returns, with both predictions in the decision."""
    ts = build_templates(small_spec((2, 2), n_layer=2, global_batch=8))
    full, d = best_uniform(ts, {"s0": 2, "s1": 2})
    assert d == 2
    plan = ts.plan_for(full, d, ts.num_microbatches // d)
    lost = frozenset({(0, 1)})
    shrunk = decide(
        Failure(plan, lost, {"s0": 1, "s1": 2}, frozenset({0, 1}), frozenset({0, 1}), None), ts
    )
    assert isinstance(shrunk, Reconfigure) and shrunk.pipelines == 1
    small = shrunk.plan
    dec = decide_grow(ts, small, {"s0": 2, "s1": 2}, 8, small.micro_batch_size)
    assert isinstance(dec, GrowBack)
    assert dec.plan == plan
    assert dec.predicted_new_s <= 0.95 * dec.predicted_now_s
    # Demanding more gain than the layout offers keeps the running one.
    gain = 1 - dec.predicted_new_s / dec.predicted_now_s
    stay = decide_grow(ts, small, {"s0": 2, "s1": 2}, 8, 1, min_gain=gain + 0.01)
    assert isinstance(stay, Stay) and "gain below" in stay.reason
    # The running layout is already the best for these devices: stay.
    same = decide_grow(ts, plan, {"s0": 2, "s1": 2}, 8, 1)
    assert isinstance(same, Stay) and "gain below" in same.reason


def test_no_grow_back_when_nothing_fits() -> None:
    ts = build_templates(small_spec((2, 2), n_layer=2, mem_factor=0.75))
    plan = running_plan(ts, 1)
    assert plan is not None
    gbs = plan.num_microbatches * plan.micro_batch_size
    dec = decide_grow(ts, plan, {"s0": 1, "s1": 0}, gbs, plan.micro_batch_size)
    assert isinstance(dec, Stay) and "no layout fits" in dec.reason


def test_newest_common_boundary_never_passes_the_failed_step():
    from geopipe.optimizer.policies import newest_common_boundary

    # Every survivor finished step 2 (holds boundary 3), but step 2's results never
    # reached the controller: redo it from boundary 2.
    have = {(0, 1): {2, 3}, (1, 0): {2, 3}, (1, 1): {2, 3}}
    assert newest_common_boundary(have, 2, failed_step=2) == (2, {0: [(0, 1)], 1: [(1, 0), (1, 1)]})
    # A stage whose only survivor lost boundary 2 falls back to an older common one …
    have = {(0, 0): {1, 2}, (1, 0): {1}}
    assert newest_common_boundary(have, 2, failed_step=2)[0] == 1
    # … and a stage with no survivor at all has none.
    assert newest_common_boundary({(0, 0): {1, 2}}, 2, failed_step=2) == (None, {})
