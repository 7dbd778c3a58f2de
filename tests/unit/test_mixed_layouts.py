"""Mixed pipelines (heterogeneous plans), pure parts: the plan's shape, each site's ZeRO-1
groups and gradient scales, the samples each pipeline reads, the template mixes the
planner offers and the recovery decision that uses them, and what `geopipe status` shows.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import yaml

from geopipe.cli.render import format_status
from geopipe.config import parse_cluster
from geopipe.model.data import global_indices, sample_indices
from geopipe.optimizer.instantiate import instantiate
from geopipe.optimizer.mixes import SplitTemplateSet, best_mix, layer_split
from geopipe.optimizer.planner import plan_cluster
from geopipe.optimizer.policies import Failure, Reconfigure, decide, decide_grow
from geopipe.optimizer.templates import best_uniform, build_templates
from geopipe.plan import PipelineLayout, Plan
from geopipe.runtime.actor.sitegroups import grad_scale, site_worlds
from geopipe.runtime.control.reporting import Reporter

ROOT = Path(__file__).resolve().parents[2]
A = PipelineLayout(
    ("e", "e", "w", "w"), ((0, 3), (3, 5), (5, 7), (7, 10)), 18, (0, 2, 0), ("none", "none", "none")
)
B = PipelineLayout(("e", "w", "w"), ((0, 5), (5, 7), (7, 10)), 14, (2, 0), ("none", "none"))
MIX = Plan(2, A.stage_sites, A.partition, 1, 64, 18, "1f1b", A.delta_n, A.codecs, mix=(A, B))
UNIFORM = Plan(
    2, ("e", "e", "w"), ((0, 2), (2, 4), (4, 6)), 1, 64, 4, "1f1b", (0, 1), ("none", "none")
)


def test_plan_addresses_every_actor_of_a_mix() -> None:
    assert MIX.heterogeneous and not UNIFORM.heterogeneous
    assert MIX.actors() == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]
    assert [MIX.replicas(k) for k in range(4)] == [2, 2, 2, 1]
    assert MIX.site_of(1, 1) == "w" and MIX.layers_of(1, 1) == (5, 7)
    assert MIX.total_microbatches == 32 and MIX.first_microbatch(1) == 18
    assert MIX.pipeline(1).stage_sites == B.stage_sites and MIX.pipeline(1).pipelines == 1
    assert Plan.from_dict(json.loads(MIX.to_json())) == MIX
    # uniform plans keep their JSON (no "mix" key) and answer the same questions
    assert "mix" not in UNIFORM.to_dict() and Plan.from_dict(UNIFORM.to_dict()) == UNIFORM
    assert UNIFORM.actors() == [(k, r) for k in range(3) for r in range(2)]
    assert UNIFORM.total_microbatches == 8 and UNIFORM.first_microbatch(1) == 4
    with pytest.raises(ValueError, match="deepest first"):
        Plan(2, B.stage_sites, B.partition, 1, 64, 14, "1f1b", B.delta_n, B.codecs, mix=(B, A))


def test_uniform_site_worlds_are_the_per_stage_groups() -> None:
    """Identical pipelines: rank = stage-in-site · D + replica, one group per stage, each
    engine holds its own layers, gradient scale exactly 1 (what DeepSpeed alone does)."""
    east, west = site_worlds(UNIFORM)
    assert east.members == ((0, 0), (0, 1), (1, 0), (1, 1)) and west.members == ((2, 0), (2, 1))
    assert east.groups == ((0, 1), (2, 3)) and west.groups == ((0, 1),)
    for w in (east, west):
        for key, held in w.hold.items():
            assert held == UNIFORM.layers_of(*key)
            assert grad_scale(UNIFORM, key) == 1.0


def test_mixed_site_worlds_group_the_actors_that_share_layers() -> None:
    east, west = site_worlds(MIX)
    # east: A cuts 0-3 | 3-5, B runs 0-5: all three share layers -> one group, union 0-5
    assert east.members == ((0, 0), (0, 1), (1, 0)) and east.groups == ((0, 1, 2),)
    assert set(east.hold.values()) == {(0, 5)}
    # west: both pipelines cut 5-7 | 7-10 the same way -> per-stage groups, own layers
    assert west.members == ((1, 1), (2, 0), (2, 1), (3, 0))  # stage by stage
    assert west.groups == ((0, 1), (2, 3))
    assert all(west.hold[k] == MIX.layers_of(*k) for k in west.members)
    # M_r · R / M: every layer's contributions add up to the mean over the global batch
    for w in (east, west):
        for g in w.groups:
            members = [w.members[i] for i in g]
            for key in members:
                assert grad_scale(MIX, key) == pytest.approx(
                    MIX.microbatches_of(key[1]) * len(g) / MIX.total_microbatches
                )
            by_layer = {}
            for key in members:
                a, z = MIX.layers_of(*key)
                for x in range(a, z):
                    by_layer.setdefault(x, []).append(key[1])
            # each layer of the group is run once by every pipeline
            assert all(sorted(v) == [0, 1] for v in by_layer.values())


def test_pipelines_read_consecutive_slices_of_the_global_batch() -> None:
    """Any shares cover each step's samples exactly once; equal shares are the old order."""
    gb, b = 64, 2
    for shares in ([32], [18, 14], [11, 11, 10]):
        seen = []
        for r, m in enumerate(shares):
            first = sum(shares[:r])
            seen += [i for mb in range(m) for i in sample_indices(3, gb, first + mb, b)]
        assert seen == list(range(3 * gb, 4 * gb))
    for r in range(4):
        for mb in range(8):
            assert sample_indices(2, gb, r * 8 + mb, b) == global_indices(2, gb, r, 4, mb, b)


@pytest.fixture(scope="module")
def demo():
    """2 sites × 4 devices, the 8-layer demo GPT, as planned (2 × (2 east, 2 west))."""
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text()))
    for s in doc["sites"]:
        s["devices_per_node"] = 4
    doc["model"]["n_layer"] = 8
    spec = parse_cluster(doc, "demo")  # the YAML's device speeds: no machine profiling
    plan = plan_cluster(spec).best.plan
    return spec, plan, build_templates(spec, plan=plan)


def test_split_templates_lay_every_vector_over_the_split(demo) -> None:
    ts = demo[2]
    split = (("east", 4), ("west", 6))
    sts = SplitTemplateSet(ts, split)
    for v in sts.candidate_vectors((3, 4)):
        t = sts.template(v)
        assert t is not None and layer_split(t.stage_sites, t.partition) == split
        assert t.stage_sites == tuple(s for s, n in zip(ts.sites, v, strict=True) for _ in range(n))
    assert sts.template((5, 1)) is None  # more east stages than east layers


def test_best_mix_matches_brute_force_over_every_split(demo) -> None:
    """Losing one east device of 2 × 4: the mix found from the templates' splits is as fast
    as the best instantiation over every possible east/west split, uses all 7 devices, and
    beats the best identical pipelines by more than plan.min_gain.mixed_pipelines."""
    spec, plan, ts = demo
    alive = {"east": 3, "west": 4}
    gb, b = spec.training.global_batch_size, plan.micro_batch_size
    got = best_mix(ts, alive, gb, b, running=plan)
    assert got is not None and got.plan.heterogeneous
    brute = math.inf
    for e in range(1, ts.num_layers):
        split = (("east", e), ("west", ts.num_layers - e))
        inst = instantiate(SplitTemplateSet(ts, split), alive, gb, b)
        if inst is not None:
            brute = min(brute, inst.iteration_time_s)
    assert got.iteration_time_s <= brute * (1 + 1e-9)
    assert sum(len(p.stage_sites) for p in got.plan.mix) == 7
    assert sum(p.num_microbatches for p in got.plan.mix) == gb // b
    t, d = best_uniform(ts, alive, gb, b)
    uniform = ts.predict(t.stages_per_site, d, gb // (b * d)).iteration_time_s
    assert got.iteration_time_s < (1 - spec.plan.min_gain.mixed_pipelines) * uniform


def test_recovery_decides_for_the_mix_and_grow_back_needs_its_time(demo) -> None:
    spec, plan, ts = demo
    dead = frozenset({(0, 1)})  # an east replica of stage 0
    stages = frozenset(range(plan.num_stages))
    failure = Failure(plan, dead, {"east": 3, "west": 4}, stages, stages, None)
    got = decide(failure, ts)
    assert isinstance(got, Reconfigure) and got.plan.heterogeneous
    assert got.predicted_s is not None and got.plan.total_microbatches == plan.total_microbatches
    back = decide_grow(
        ts,
        got.plan,
        {"east": 4, "west": 4},
        spec.training.global_batch_size,
        plan.micro_batch_size,
        now_s=got.predicted_s,
    )
    assert back.__class__.__name__ == "GrowBack" and not back.plan.heterogeneous
    with pytest.raises(ValueError, match="now_s"):
        decide_grow(
            ts,
            got.plan,
            {"east": 4, "west": 4},
            spec.training.global_batch_size,
            plan.micro_batch_size,
        )


def test_status_shows_each_pipeline_of_a_mix(tmp_path) -> None:
    rep = Reporter("demo", tmp_path, 10)
    names = [[f"a{k}{r}" for r in range(MIX.replicas(k))] for k in range(MIX.num_stages)]
    rep.status("running", 3, MIX, names)
    data = json.loads((tmp_path / "status.json").read_text())
    assert [len(p["stages"]) for p in data["pipelines"]] == [4, 3]
    text = format_status(data, "running")
    assert "2 pipelines of 4, 3 stages (mixed templates)" in text
    assert "pipeline 0: 2 e + 2 w stage(s), 18 micro-batches" in text
    assert "pipeline 1: 1 e + 2 w stage(s), 14 micro-batches" in text
    assert "layers [5, 7]  a11" in text  # pipeline 1's stage 1 runs in w


def test_uneven_devices_at_launch_run_a_mix() -> None:
    """local-2dc with 3 west devices: the planner's 2 identical pipelines leave one idle;
    a pipeline with two west stages beside one with one is predicted faster and launched.
    With even counts nothing is idle and the planner's plan stands."""
    from geopipe.optimizer.runplan import mixed_at_launch

    doc = yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text())
    spec = parse_cluster(doc, "even")
    assert mixed_at_launch(spec, plan_cluster(spec).best) is None
    doc["sites"][1]["devices_per_node"] = 3
    spec = parse_cluster(doc, "uneven")
    best = plan_cluster(spec).best
    got = mixed_at_launch(spec, best)
    assert got is not None and got.plan.heterogeneous
    assert got.iteration_time_s < (1 - spec.plan.min_gain.mixed_pipelines) * best.iteration_time_s
    # the threshold is the YAML's: demand more than the mix gains and identical pipelines stay
    doc["plan"]["min_gain"] = {
        "mixed_pipelines": 1 - got.iteration_time_s / best.iteration_time_s + 0.01
    }
    strict = parse_cluster(doc, "uneven")
    assert mixed_at_launch(strict, plan_cluster(strict).best) is None
    plan = got.plan
    assert sorted(plan.site_of(*k) for k in plan.actors()) == ["east"] * 2 + ["west"] * 3
    assert plan.total_microbatches == best.plan.total_microbatches
    assert json.loads(json.dumps(got.summary()))["pipelines"] == 2  # valid JSON, no NaN


def test_mixes_whose_unions_overflow_a_device_are_dropped(demo) -> None:
    """An actor holding its group's union needs the other layers' weights and gradients too
    (and a different Adam shard): with the east devices just big enough for pipeline 0's
    first stage alone, that stage overflows once it holds layers 0-5 — checked against the
    per-actor arithmetic at several device sizes."""
    import copy as copy_

    from geopipe.model.sizes import layer_param_counts
    from geopipe.optimizer.mixes import union_overflow

    spec, plan, ts = demo
    got = best_mix(
        ts,
        {"east": 3, "west": 4},
        spec.training.global_batch_size,
        plan.micro_batch_size,
        running=plan,
    )
    mix = got.plan
    assert union_overflow(ts, mix) == []  # 2 GB devices: plenty
    held, counts = mix.held_layers(), layer_param_counts(spec.model)
    assert sorted(k for k in mix.actors() if held[k] != mix.layers_of(*k)) == [(0, 0), (1, 0)]
    size = {k: len(g) for gs in mix.shared_groups().values() for g in gs for k in g}
    need = {}  # fp32: weights + gradients 8 B, Adam 8 B sharded
    for r in range(mix.pipelines):
        one = mix.pipeline(r)
        v = tuple(one.stage_sites.count(x) for x in ts.sites)
        pr = ts.predict(v, mix.pipelines, one.num_microbatches)
        for j, (a, z) in enumerate(one.partition):
            if one.stage_sites[j] == "east":
                own, union = sum(counts[a:z]), sum(counts[slice(*held[(j, r)])])
                extra = 8 * (union - own) + 8 * (union / size[(j, r)] - own / mix.pipelines)
                need[(j, r)] = (pr.peak_memory_bytes[j], pr.peak_memory_bytes[j] + extra)
    assert need[(0, 0)][1] > need[(0, 0)][0]  # the union costs pipeline 0's first stage
    for limit in sorted({own + 1 for own, _ in need.values()}):
        tight = copy_.copy(ts)
        east = spec.sites[0].model_copy(update={"device_memory_gb": limit / (1 << 30)})
        tight.spec = spec.model_copy(update={"sites": [east, *spec.sites[1:]]})
        want = sorted(k for k, (_, total) in need.items() if total > limit)
        assert sorted(union_overflow(tight, mix)) == want
    # just above stage (0, 0)'s own peak it fits alone but not with the union
    limit = need[(0, 0)][0] + 1
    tight = copy_.copy(ts)
    east = spec.sites[0].model_copy(update={"device_memory_gb": limit / (1 << 30)})
    tight.spec = spec.model_copy(update={"sites": [east, *spec.sites[1:]]})
    assert (0, 0) in union_overflow(tight, mix)
