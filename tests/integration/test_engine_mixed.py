"""Mixed pipelines in one site (heterogeneous plan) against the single-process reference.

Pipeline A runs the 4 layers of the tiny GPT on two devices ([0, 2) | [2, 4)), pipeline B
all four on one; A takes 5 micro-batches of the global batch, B the other 3. Their three
actors form one ZeRO-1 group holding the union of their layers
(:mod:`geopipe.runtime.actor.sitegroups`), each scaling its weight gradients so the step is the
mean over the whole global batch. Parameters, Adam moments and the per-step mean loss must
equal plain torch Adam on the full model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _dist_util import free_port, run_ranks
from test_engine import (
    CFG,
    GLOBAL_BATCH,
    MBS,
    MOMENT_RTOL,
    PLAIN_CFG,
    SEQ,
    STEPS,
    TOL,
    _max_diff,
    _reference,
    _rel_diff,
    _stream,
    run_actions,
)

from geopipe.model.data import sample_indices
from geopipe.pipeline.schedule import one_f_one_b, zb_h1
from geopipe.plan import PipelineLayout, Plan
from geopipe.runtime.actor.engine import StageEngine, destroy_process_group, init_process_group
from geopipe.runtime.actor.sitegroups import grad_scale, site_worlds

HOST = "127.0.0.1"
A = PipelineLayout(("s", "s"), ((0, 2), (2, 4)), 5, (0,), ("none",))
B = PipelineLayout(("s",), ((0, 4),), 3, (), ())
PLAN = Plan(2, A.stage_sites, A.partition, MBS, SEQ, 5, "1f1b", A.delta_n, A.codecs, mix=(A, B))


def _mixed_worker(rank: int, port: int, schedule: str) -> dict[str, Any]:
    (world,) = site_worlds(PLAN)
    k, r = world.members[rank]
    pipe = PLAN.pipeline(r)
    init_process_group(rank, len(world.members), HOST, port, timeout_s=60)
    cfg = dataclasses.replace(
        PLAIN_CFG,
        micro_batches=pipe.num_microbatches,
        grad_scale=grad_scale(PLAN, (k, r)),
        defer_step=True,
    )
    groups = [list(g) for g in world.groups]
    eng = StageEngine(
        CFG, pipe.partition[k], groups, world.group_of[(k, r)], cfg, world.hold[(k, r)]
    )
    p, m = pipe.num_stages, pipe.num_microbatches
    sched = zb_h1(p, m) if schedule == "zb-h1" and p > 1 else one_f_one_b(p, m)
    prev = world.rank((k - 1, r)) if k > 0 else None
    nxt = world.rank((k + 1, r)) if k < p - 1 else None
    stream = _stream()
    out: dict[str, Any] = {"losses": []}
    for step in range(STEPS):

        def batch(mb: int, step: int = step) -> tuple[torch.Tensor, torch.Tensor]:
            idx = sample_indices(step, GLOBAL_BATCH, PLAN.first_microbatch(r) + mb, MBS)
            return stream.batch(idx, SEQ)

        losses = run_actions(
            eng, sched.stages[k], batch, first=k == 0, last=k == p - 1, prev=prev, nxt=nxt
        )
        out["losses"].append(losses)
    out["params"] = {n: q.detach().clone() for n, q in eng.module.named_parameters()}
    out["state"] = eng.full_state()
    eng.destroy()
    destroy_process_group()
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_mixed_pipelines_match_single_process(schedule: str) -> None:
    """Measured: parameters within ~1e-6 of the reference, moments ~1e-6 relative."""
    (world,) = site_worlds(PLAN)
    assert world.groups == ((0, 1, 2),)  # the three actors share layers: one group
    assert set(world.hold.values()) == {(0, 4)}
    ranks = run_ranks(_mixed_worker, 3, free_port(), schedule)
    ref = _reference(PLAIN_CFG, STEPS)
    want, adam = ref["params"][STEPS - 1], ref["adam"][STEPS - 1]
    for got in ranks:
        assert set(got["params"]) == set(want)  # every actor holds the group's union
        assert _max_diff(got["params"], want) <= TOL
        assert _max_diff(got["state"]["params"], want) <= TOL
        for key in ("exp_avg", "exp_avg_sq"):
            moment = {n: adam[n][key] for n in adam}
            assert _rel_diff(got["state"][key], moment) <= MOMENT_RTOL
    for step in range(STEPS):  # A's last stage (rank 2) and B (rank 1) report losses
        mb = ranks[2]["losses"][step] + ranks[1]["losses"][step]
        assert len(mb) == GLOBAL_BATCH // MBS and not ranks[0]["losses"][step]
        assert sum(mb) / len(mb) == pytest.approx(ref["losses"][step], abs=TOL)
