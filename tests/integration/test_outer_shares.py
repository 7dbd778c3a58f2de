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
from geopipe.runtime.actor.outer_wire import OuterSettings
from geopipe.runtime.actor.stage import StageSpec
from geopipe.transport.security import make_credentials
from tests.integration.test_outer_actor import (
    CHUNK,
    DESC,
    ENGINE,
    GLOBAL_BATCH,
    MBS,
    PLAN,
    TOL,
    H,
    _begin,
    _inner,
    _max_diff,
    _Reference,
    _round,
    start_groups,
    stop_groups,
)
from tests.integration.test_outer_actor import corpus as corpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SHARES = (12, 4)  # sequences per step of groups 0 and 1
MICRO = tuple(s // MBS for s in SHARES)  # 6 and 2 micro-batches
STARTS = (0, MICRO[0])  # where each group's slice begins, in micro-batches


@pytest.fixture(scope="module")
def uneven(ray_cluster, corpus):
    """``uneven[g][0]``: group g's one actor, its own site world."""
    creds = make_credentials("outer-shares", encrypt=True)
    specs = [
        [
            StageSpec(
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
        ]
        for g in range(2)
    ]
    out = start_groups(specs)
    yield out
    stop_groups(out)


def _reference(corpus: str, rounds: int, **kw) -> dict[str, torch.Tensor]:
    args = {"micro": MICRO, "starts": STARTS, "weights": SHARES, **kw}
    ref = _Reference(corpus, **args)
    for r in range(rounds):
        for s in range(r * H, (r + 1) * H):
            ref.step(s)
        ref.average()
    return ref.params(0)


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
