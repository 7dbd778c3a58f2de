"""The outer loop with unequal batch shares, on real stage actors (the planner's balanced
shares: [Note: batch shares] in geopipe.optimizer.strategy): group 0 trains on 12 of each
step's 16 sequences, group 1 on 4, each a one-replica, one-stage pipeline; pseudo-gradients
go over the authenticated data plane.

Checked against a reference computed here, in one process: with outer lr 1, momentum 0 and
codec none a round is the average of the groups' models *weighted by their shares*, each
model trained by torch Adam on its own contiguous slice of every global batch (group 1's
slice begins where group 0's ends: ``group_sample_indices(..., start)``), over two rounds,
to 1e-6 (as tests/integration/test_outer_actor.py for equal shares). The plain mean, the
slice an equal split would give, or the groups' weights swapped each miss by more than
1e-4 (checked on the reference itself, so the check can fail).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from geopipe.checkpoint.format import PARAMS_GROUP
from geopipe.model.data import Corpus, TokenStream, group_sample_indices
from geopipe.model.family import build_stage
from geopipe.model.gpt import lm_loss
from geopipe.runtime.actor.outer_wire import OuterSettings
from geopipe.runtime.actor.stage import StageSpec, StageWorker
from geopipe.runtime.control.placement import ACTOR_ENV
from geopipe.transport.security import make_credentials
from tests.integration.test_outer_actor import (
    CHUNK,
    DESC,
    ENGINE,
    MBS,
    PLAN,
    SEQ,
    TOL,
    _begin,
    _inner,
    _max_diff,
    _round,
)
from tests.integration.test_outer_actor import corpus as corpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

GLOBAL_BATCH, H = 16, 2
SHARES = (12, 4)  # sequences per step of groups 0 and 1
MICRO = tuple(s // MBS for s in SHARES)  # 6 and 2 micro-batches
STARTS = (0, MICRO[0])  # where each group's slice begins, in micro-batches


@pytest.fixture(scope="module")
def uneven(ray_cluster, corpus):
    """``uneven[g][0]``: group g's one actor, its own site world."""
    import ray

    creds = make_credentials("outer-shares", encrypt=True)
    remote = ray.remote(max_concurrency=8)(StageWorker)
    out = []
    for g in range(2):
        spec = StageSpec(
            run="outer-shares",
            stage=0,
            replica=0,
            plan=replace(PLAN, num_microbatches=MICRO[g]),
            model=DESC,
            engine=replace(ENGINE, micro_batches=MICRO[g]),
            global_batch=GLOBAL_BATCH,
            seed=1,
            data=corpus,
            data_max_bytes=1 << 20,
            creds=creds,
            group=g,
            groups=2,
            first_microbatch=0,
            group_start=STARTS[g],
        )
        opts = {"num_cpus": 0, "runtime_env": {"env_vars": dict(ACTOR_ENV)}}
        out.append([remote.options(**opts).remote(spec)])
    for row in out:
        master = ray.get(row[0].endpoint.remote())
        ray.get(row[0].setup.remote(master, 0, 1, [[0]], 0, None, None))
    yield out
    ray.get([row[0].shutdown.remote() for row in out])
    for row in out:
        ray.kill(row[0])


class _Reference:
    """One torch model and Adam per group, trained on ``starts[g]`` + its ``micro[g]``
    micro-batches of each step, averaged with ``weights`` every round."""

    def __init__(self, corpus: str, micro, starts, weights) -> None:
        torch.set_num_threads(1)
        self.stream = TokenStream(Corpus(corpus, max_bytes=1 << 20), seed=1)
        self.micro, self.starts, self.weights = micro, starts, weights
        self.models = [build_stage(DESC, 0, DESC.num_layers, seed=ENGINE.seed) for _ in micro]
        self.opts = []
        for m in self.models:
            ps = list(m.parameters())
            pg = [
                {"params": [p for p in ps if p.dim() >= 2]},
                {"params": [p for p in ps if p.dim() < 2]},
            ]
            self.opts.append(torch.optim.Adam(pg, lr=ENGINE.lr, betas=ENGINE.betas, eps=ENGINE.eps))

    def step(self, step: int) -> None:
        for g, (model, opt) in enumerate(zip(self.models, self.opts, strict=True)):
            opt.zero_grad()
            n = self.micro[g]
            for mb in range(n):
                idx = group_sample_indices(step, GLOBAL_BATCH, g, 2, mb, MBS, self.starts[g])
                x, y = self.stream.batch(idx, SEQ)
                (lm_loss(model(x), y) / n).backward()
            opt.step()

    @torch.no_grad()
    def average(self) -> None:
        named = [dict(m.named_parameters()) for m in self.models]
        total = sum(self.weights)
        for n in named[0]:
            mean = sum(w * d[n] for w, d in zip(self.weights, named, strict=True)) / total
            for d in named:
                d[n].copy_(mean)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.models[0].named_parameters()}


def _reference(corpus: str, rounds: int, **kw) -> dict[str, torch.Tensor]:
    args = {"micro": MICRO, "starts": STARTS, "weights": SHARES, **kw}
    ref = _Reference(corpus, **args)
    for r in range(rounds):
        for s in range(r * H, (r + 1) * H):
            ref.step(s)
        ref.average()
    return ref.params()


def test_unequal_shares_train_their_own_slices_and_average_weighted(uneven, corpus) -> None:
    import ray

    weights = tuple(float(s) for s in SHARES)
    _begin(
        uneven,
        OuterSettings(lr=1.0, momentum=0.0, codec="none", chunk_elems=CHUNK, weights=weights),
    )
    for r in range(2):
        _inner(uneven, range(r * H, (r + 1) * H))
        _sent, applied = _round(uneven)
        assert all(x["groups"] == 2 for x in applied)
        assert applied[0]["digest"] == applied[1]["digest"]  # theta_global alike in both
    states = ray.get([row[0].full_state.remote() for row in uneven])
    got = [s[PARAMS_GROUP] for s in states]
    assert _max_diff(got[0], got[1]) == 0.0
    want = _reference(corpus, 2)
    assert _max_diff(got[0], want) <= TOL
    # the check can fail: the plain mean, equal slices, or swapped weights are all far off
    for wrong in (
        {"weights": (1, 1)},
        {"micro": (4, 4), "starts": (0, 4)},
        {"weights": tuple(reversed(SHARES))},
    ):
        assert _max_diff(_reference(corpus, 2, **wrong), want) > 1e-4
