"""Tier 2: an outer-loop run asks its actors for spans of inner steps, not one call per step
([Note: many inner steps per driver call] in geopipe.runtime.actor.inner_run), on the suite's
embedded Ray (real actors, DeepSpeed, the authenticated data plane).

Two emulated sites, one group each (a one-stage pipeline on one device); Streaming DiLoCo
with H = 6, F = 2, overlap 1, codec int8, DiLoCo's outer lr 0.7 and momentum 0.9: fragment 0
is sent after 2 and 8 steps and applied after 3 and 9, fragment 1 sent after 5 and 11 and
applied after 6 and 12, so every send falls inside a span and is the actors' own. The
reference is the same run with the driver's per-step path (``OuterRounds.max_span = 0``: one
``run_iteration`` per step, the driver's ``outer_send``): the losses, the rounds and the
final weights must be bit-identical, and the spans must take fewer than one step call per
inner step, with every apply made inside a span ([Note: applies decided inside a span] in
geopipe.runtime.actor.inner_run: no apply call, and no span ends at an apply). A third run,
with spans of at most 2 steps (each interval's second span queued behind its first), loses
group 1 as a span starts: the survivor runs that span and the one queued behind it (whose
apply after 9 steps the recovery decides over the survivor alone), every step is recorded
once, and no step is lost.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from geopipe.config import parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions
from geopipe.runtime.control.workers import RayWorkers
from tests.integration.test_outer_failures_runtime import _kill
from tests.integration.test_outer_runtime import streaming_doc

pytestmark = pytest.mark.ray
STEPS, H, F, TAU = 12, 6, 2, 1


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


class Counting(RayWorkers):
    """The production seam, counting the calls the driver starts, by method; ``before``
    runs before each call is started (a test's hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.before = lambda actor, method, args: None

    def call(self, actor, method, *args, **kwargs):
        self.counts[method] += 1
        self.before(actor, method, args)
        return super().call(actor, method, *args, **kwargs)


def _doc() -> dict:
    return streaming_doc("outer-spans", STEPS, H, F, TAU)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each run once for the module (launches are the tier's cost)."""
    row = {"replicas": 2, "h": H, "fragments": F, "overlap": TAU, "codec": "int8"}
    row.update(rel_gap=0.01, outer_lr=0.7, outer_momentum=0.9)
    table = {"source": "t", "model": "t", "steps": 1, "tokens_per_step": 1, "sync_noise": 0.0}
    root = tmp_path_factory.mktemp("outer-spans")
    (root / "penalty.json").write_text(json.dumps({**table, "rows": [row]}))
    done: dict[str, dict] = {}

    def get(kind: str) -> dict:
        if kind not in done:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("GEOPIPE_LOSS_PENALTY", str(root / "penalty.json"))
                done[kind] = _run(root / kind, kind)
        return done[kind]

    return get


def _run(run_dir: Path, kind: str) -> dict:
    """``spans`` (the default), ``per_step`` (the driver's path before spans) or ``loss``
    (spans; group 1 killed as the span from step 6 starts)."""
    workers = Counting()
    opts = LaunchOptions(run_dir=str(run_dir), progress=False)
    ctl = Controller(parse_cluster(_doc(), "outer-spans"), opts, workers=workers)
    try:
        ctl.launch()
        assert ctl.plan.num_groups == 2 and ctl.outer is not None
        if kind == "per_step":
            ctl.outer.max_span = 0
        if kind == "loss":
            ctl.outer.max_span = 2
        victim = ctl.placement.rows[0][1]

        def before(actor, method, args) -> None:
            if kind == "loss" and actor is victim and method == "run_iterations" and args[0] == 6:
                _kill(victim)

        workers.counts.clear()
        workers.before = before
        losses = [m.loss for m in ctl.train().steps]
        counts = Counter(workers.counts)
        survivors = [a for row in ctl.placement.rows for a in row]
        states = ctl.workers.get([ctl.workers.call(a, "full_state") for a in survivors])
    finally:
        ctl.close()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"losses": losses, "counts": counts, "states": states, "lines": lines}


def _events(lines: list[dict], kind: str) -> list[dict]:
    return [x for x in lines if x.get("event") == kind]


def _rounds(lines: list[dict]) -> list[tuple]:
    return [
        (r["step"], r["fragment"], r["groups"], r["bytes"], r["digests_equal"])
        for r in _events(lines, "outer_round")
    ]


def test_spans_train_bit_identically_to_one_call_per_step(runs) -> None:
    spans, per_step = runs("spans"), runs("per_step")
    assert len(spans["losses"]) == STEPS
    assert spans["losses"] == per_step["losses"]  # bit for bit
    assert _rounds(spans["lines"]) == _rounds(per_step["lines"])
    assert [r[0] for r in _rounds(spans["lines"])] == [3, 6, 9, 12]
    assert all(r[4] and r[3] > 0 for r in _rounds(spans["lines"]))
    for a, b in zip(spans["states"], per_step["states"], strict=True):
        assert a["params"].keys() == b["params"].keys()
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    # every step's metrics line is written, once, as before
    rows = [x["step"] for x in spans["lines"] if "event" not in x]
    assert rows == list(range(STEPS))


def test_spans_take_fewer_driver_calls_than_inner_steps(runs) -> None:
    actors = 2
    spans, per_step = runs("spans"), runs("per_step")
    # steps 0-2 one a call (calibration records them), then 3-5 (a checkpoint after 6) and
    # 6-11: 5 calls; the applies after 3, 6, 9 and 12 are made inside them
    got = spans["counts"]
    assert got["run_iteration"] == 0 and got["outer_send"] == 0  # the actors send
    assert got["run_iterations"] == 5 * actors
    assert got["outer_apply"] == 0  # every apply made inside a span
    assert got["outer_decide"] == 4 * actors  # the driver named the groups of each
    assert got["outer_gather"] >= 4 * actors  # asked beside the spans
    calls = sum(got[m] for m in ("run_iterations", "outer_send", "outer_apply"))
    assert calls == 5 * actors  # the calls the actors wait on, for 12 inner steps
    # a span's steps are recorded as done when the span came back: one time each span
    done = {x["step"]: x["completed_at"] for x in spans["lines"] if "event" not in x}
    assert len({done[s] for s in range(3)}) == 3
    assert done[3] == done[4] == done[5] < done[6] == done[11]
    old = per_step["counts"]
    assert old["run_iteration"] == STEPS * actors and old["outer_send"] == 4 * actors
    assert old["outer_apply"] == 4 * actors and old["outer_gather"] >= 4 * actors
    assert (old["run_iteration"] + old["outer_send"]) / (STEPS * actors) > 1


def test_a_group_lost_as_a_span_starts_costs_the_survivor_no_step(runs) -> None:
    lost, spans = runs("loss"), runs("spans")
    rows = [x for x in lost["lines"] if "event" not in x]
    assert [x["step"] for x in rows] == list(range(STEPS))  # each step once: none lost
    assert lost["losses"][:6] == spans["losses"][:6]  # undisturbed before the loss
    (rec,) = _events(lost["lines"], "recovered")
    assert rec["failed_step"] == 6 and rec["lost_steps"] == 0 and rec["step"] == 9
    assert rec["lost_groups"] == [1] and rec["source"] == "surviving groups"
    assert not _events(lost["lines"], "resumed")  # no checkpoint read
    # 0, 1, 2 alone; 3-4 and 5 queued (spans of 2 at most end at the applies after 3, 6, 9:
    # [Note: spans end at applies]); 6-7 (the victim's call fails) and 8 queued; after the
    # recovery 9, 10, 11 alone on the survivor (the new layout's calibration records them)
    assert lost["counts"]["run_iterations"] == 3 * 2 + 2 * 2 + 2 * 2 + 3
    # the survivor ran the span 6-7 and 8 queued; the round after 9 averages over it alone
    assert [(r[0], r[2]) for r in _rounds(lost["lines"])] == [(3, 2), (6, 2), (9, 1), (12, 1)]
    assert all(r[4] for r in _rounds(lost["lines"]))
