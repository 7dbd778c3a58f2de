"""The strategy table's chosen outer loop as launch runs it: one mixed plan whose pipelines are
listed group by group, each group on its own sites, its gradients a mean over its own slice."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from geopipe.config import parse_cluster
from geopipe.optimizer.penalty import PenaltyModel, parse_table
from geopipe.optimizer.runplan import plan_run
from geopipe.plan import Plan
from geopipe.runtime.actor.sitegroups import grad_scale, site_worlds

LOCAL = Path(__file__).resolve().parents[2] / "clusters" / "local-2dc.yaml"


def _table(gap: float = 0.001) -> PenaltyModel:
    rows = [
        {"replicas": 2, "h": h, "fragments": 1, "codec": "none", "rel_gap": gap} for h in (1, 5, 10)
    ]
    doc = {
        "source": "test",
        "model": "test",
        "steps": 600,
        "tokens_per_step": 1,
        "sync_noise": 0.0,
        "rows": rows,
    }
    return PenaltyModel(parse_table(doc), "test.json")


def _outer_doc(**outer) -> dict:
    doc = yaml.safe_load(LOCAL.read_text())
    doc["plan"]["strategy"] = "outer"
    doc["plan"]["outer"] = {"h": 5, "codec": "none", **outer}
    doc["training"]["checkpoint"] = {"every_steps": 10}
    return doc


def test_the_chosen_outer_loop_runs_as_groups_on_their_own_sites() -> None:
    spec = parse_cluster(_outer_doc(), "outer")
    rp = plan_run(spec, penalty=_table())
    assert rp.outer is not None and rp.outer_refused is None, rp.outer_refused
    plan = rp.plan
    assert plan is rp.outer.plan and plan.num_groups == 2 and rp.outer.h == 5
    sites = {
        g: {
            plan.site_of(k, r)
            for r in range(plan.pipelines)
            if plan.group_of(r) == g
            for k in range(plan.depth(r))
        }
        for g in range(2)
    }
    assert sites[0].isdisjoint(sites[1]) and all(len(s) == 1 for s in sites.values())
    # one contiguous slice of the global batch per group, covering it once
    per_group = [plan.group_microbatches(g) for g in range(2)]
    assert per_group[0] == per_group[1] and sum(per_group) == plan.total_microbatches
    firsts = [plan.first_microbatch(r) for r in range(plan.pipelines)]
    assert firsts == sorted(firsts) and plan.group_of(plan.pipelines - 1) == 1
    # each actor's gradient is the mean over its own group's micro-batches: the factors
    # of one ZeRO-1 group add up to its size (identical pipelines: exactly 1 each)
    for world in site_worlds(plan):
        for ranks in world.groups:
            keys = [world.members[i] for i in ranks]
            assert {plan.group_of(r) for _, r in keys} == {plan.group_of(keys[0][1])}
            assert all(grad_scale(plan, key) == pytest.approx(1.0) for key in keys)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert rp.predicted.iteration_time_s > 0 and rp.outer.to_dict()["groups"] == 2


def test_a_synchronous_plan_keeps_its_json_and_its_gradient_scale() -> None:
    spec = parse_cluster(yaml.safe_load(LOCAL.read_text()), "sync")
    rp = plan_run(spec)
    assert rp.outer is None and "groups" not in rp.plan.to_dict()
    assert rp.plan.num_groups == 1 and rp.plan.group_microbatches(0) == rp.plan.total_microbatches


def test_groups_must_sit_on_different_sites() -> None:
    spec = parse_cluster(_outer_doc(), "outer")
    plan = plan_run(spec, penalty=_table()).plan
    same = plan.mix[0]
    with pytest.raises(ValueError, match="different sites"):
        Plan(**{**plan.__dict__, "mix": (same,) * plan.pipelines})


def test_groups_of_different_layouts_and_split_tied_embeddings_are_refused() -> None:
    """What launch cannot run yet comes back as a reason naming it (the table still prices
    it); the candidate here is the real one, its group plans changed at the seam."""
    from dataclasses import replace
    from types import SimpleNamespace

    from geopipe.optimizer.errors import PlanningError
    from geopipe.optimizer.outerplan import outer_run

    spec = parse_cluster(_outer_doc(), "outer")
    chosen = plan_run(spec, penalty=_table()).strategy.chosen
    e0, e1 = chosen.evaluations
    other = replace(e1, plan=replace(e1.plan, micro_batch_size=e1.plan.micro_batch_size + 1))
    odd = SimpleNamespace(**{**chosen.__dict__, "evaluations": (e0, other), "label": chosen.label})
    with pytest.raises(PlanningError, match=r"group 1's plan .* differs from group 0's"):
        outer_run(spec, odd)
    two = [
        replace(
            e.plan,
            stage_sites=e.plan.stage_sites * 2,
            partition=((0, 2), (2, 4)),
            delta_n=(0, 0),
            codecs=("none", "none"),
            pipelines=1,
        )
        for e in (e0, e1)
    ]
    tied_spec = spec.model_copy(
        update={"model": spec.model.model_copy(update={"tie_embeddings": True})}
    )
    split = SimpleNamespace(
        **{
            **chosen.__dict__,
            "label": chosen.label,
            "evaluations": tuple(replace(e, plan=p) for e, p in zip((e0, e1), two, strict=True)),
        }
    )
    with pytest.raises(PlanningError, match="tie_embeddings"):
        outer_run(tied_spec, split)
    assert outer_run(spec, split).plan.num_stages == 2  # untied: the same layout runs
