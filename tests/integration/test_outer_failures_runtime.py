"""Tier 2: an outer-loop run that loses a replica group goes on with the other one, and the
lost group grows back, on the suite's embedded Ray (real actors, DeepSpeed, the
authenticated data plane).

Two emulated sites, one group each (a one-stage pipeline on one device); outer lr 1,
momentum 0, codec none, H = 2, checkpoints every 2 steps (rounds after 2, 4, 6, 8 steps).
Group 1 (west) is lost inside round 2 in three ways:

* ``mid``: killed after three inner steps (its call of step 3, counted from 0, fails: the
  step-failure path); its device is free at once, so at the checkpoint boundary after six
  steps it grows back, from the survivor's snapshot and outer state; eight steps;
* ``send``: killed right after the call that made round 2's send and apply (inside its
  span: [Note: applies decided inside a span] in geopipe.runtime.actor.inner_run), so the
  next call meets a dead actor (the between-calls path); six steps;
* ``stall``: its outer connections cut before round 2 (a WAN link between the groups that
  stalls while both processes live): round 2 waits ``health.wan_outage_s``, naming the
  link, then writes group 1 off; six steps.

And ``first``: group 0 (east) killed as ``mid`` kills group 1, five steps: the survivor's
actors keep their launch positions, past the shrunk plan's, which every later step's
record must map through the launch plan.

The references: up to its kill after four steps ``send`` is an uninterrupted run, whose
losses ``mid`` must equal bit for bit up to its own kill (group 0 is not disturbed by its
peer's death); from round 2 on, group 0's losses must be bit-identical in all three,
whichever moment and way its peer was lost. That holds only if the round in flight
averages over the survivor alone whenever the loss came ([Note: a round over the
survivors] in geopipe.runtime.actor.outer) and no step is lost or redone. The returning
group starts from theta_global: the digests of the round after it are equal in both
groups. And in every run: each step recorded once, no checkpoint read, ``lost_steps`` 0.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray

from geopipe.checkpoint.store import latest_complete
from geopipe.config import parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions
from tests.integration.test_outer_runtime import _doc, _table

pytestmark = pytest.mark.ray
STEPS = {"mid": 8, "send": 6, "stall": 6, "first": 5}  # "mid" runs past its grow-back at 6


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def _kill(actor) -> None:
    """Kill ``actor`` and return once Ray reports it dead (calls to it fail)."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except Exception:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


def _run(tmp: Path, when: str | None) -> tuple[list[dict], Controller]:
    """``STEPS[when]`` steps; ``when`` kills group 1 in round 2 (``mid``, ``send``) or cuts its
    outer connections before round 2 (``stall``), or kills group 0 as ``mid`` kills group 1
    (``first``). Returns the metrics lines and the finished
    controller."""
    doc = _doc(steps=8, h=2)  # the YAML's steps set the LR schedule: one for all three
    doc["health"] = {"wan_outage_s": 3.0}  # how long round 2 waits on a stalled link
    opts = LaunchOptions(steps=STEPS[when], run_dir=str(tmp), progress=False)
    ctl = Controller(parse_cluster(doc, "outer"), opts)
    try:
        ctl.launch()
        assert ctl.plan.num_groups == 2 and ctl.plan.site_of(0, 1) == "west"
        victim = ctl.placement.rows[0][0 if when == "first" else 1]
        after_step = ctl.evals.after_step  # what the driver does after each call's steps

        def hooked(done: int, *rest) -> None:
            after_step(done, *rest)
            if when == "send" and done == 4:
                _kill(victim)  # after round 2: the next call meets a dead actor
            if when in ("mid", "first") and done == 3:
                _kill(victim)  # the next inner step meets a dead actor
            if when == "stall" and done == 3:
                # west's outer peers are cut (its sends go nowhere, it hears no one); the
                # process lives and trains
                ray.get(victim.outer_connect.remote([]))

        ctl.evals.after_step = hooked
        ctl.train()
    finally:
        ctl.close()
    lines = [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()]
    return lines, ctl


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each kind of run once for the module (launches are the tier's cost)."""
    done: dict[str, tuple[list[dict], Controller]] = {}
    root = tmp_path_factory.mktemp("outer-failures")
    table = _table(root, 2)

    def get(when: str) -> tuple[list[dict], Controller]:
        if when not in done:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("GEOPIPE_LOSS_PENALTY", str(table))
                done[when] = _run(root / when, when)
        return done[when]

    return get


def _losses(lines: list[dict], steps: int) -> list[float]:
    rows = [x for x in lines if "event" not in x]
    assert [x["step"] for x in rows] == list(range(steps))  # each step once: none lost
    return [x["loss"] for x in rows]


def _events(lines: list[dict], kind: str) -> list[dict]:
    return [x for x in lines if x.get("event") == kind]


def _lost(lines: list[dict], failed: int, grown: bool = False, round2: int = 1) -> None:
    """Group 1 lost in round 2 (no step lost, no checkpoint read); ``grown``: back at 6;
    ``round2``: the groups round 2 averaged over."""
    (rec,) = _events(lines, "recovered")
    assert rec["failed_step"] == failed and rec["lost_steps"] == 0
    assert rec["source"] == "surviving groups" and rec["restored_from"] is None
    assert rec["lost_groups"] == [1] and rec["groups_left"] == [0]
    assert rec["lost_sites"] == ["west"]
    assert not _events(lines, "resumed")  # no checkpoint read
    rounds = [(x["step"], x["groups"]) for x in _events(lines, "outer_round")]
    assert all(x["digests_equal"] for x in _events(lines, "outer_round"))
    if not grown:
        assert rounds == [(2, 2), (4, round2), (6, 1)] and not _events(lines, "grown")
        return
    (back,) = _events(lines, "grown")
    assert back["step"] == 6 and back["plan"]["groups"] == [0, 1]
    # round 8 over both groups, digests equal: the grown-back group began at theta_global
    assert rounds == [(2, 2), (4, 1), (6, 1), (8, 2)]


def test_a_lost_group_leaves_the_other_training_without_losing_a_step(runs, tmp_path):
    (mid, ctl), (send, _) = runs("mid"), runs("send")
    m, s = _losses(mid, 8), _losses(send, 6)
    # "send" is uninterrupted up to its kill after step 3: up to the kill, group 0 (and
    # group 1) train exactly as without it
    assert m[:3] == s[:3]
    assert m[3] != s[3]  # step 3 of "mid" is group 0's alone (group 1 died in it)
    # "send": group 1 dies after round 2, which averaged over both; "mid": group 1 died
    # before its send, so round 2 averages over the survivor alone
    _lost(mid, 3, grown=True)
    _lost(send, 4, round2=2)
    assert m[4:6] != s[4:6]
    assert latest_complete(Path(ctl.run_dir) / "checkpoints").step == 8
    assert ctl.plan.pipelines == 2 and ctl.plan.num_groups == 2


def test_a_stalled_link_between_groups_is_named_then_the_silent_group_written_off(runs, capsys):
    """West's outer connections are cut before round 2, its process alive and training: round 2
    waits ``health.wan_outage_s`` (3 s) naming the link, then goes on without group 1:
    both groups' steps before the call whose span holds round 2 (as "send"); that span's
    step (3) and every later one recorded as group 0's alone (group 1's answer to that
    call never comes: it waits at the apply group 1 is written off in), round 2 over group
    0 alone: bit-identical to "mid", where group 1 died in step 3."""
    (stall, _), (send, _), (mid, _) = runs("stall"), runs("send"), runs("mid")
    out = capsys.readouterr().err  # the console: geopipe's lines go to stderr
    assert "waits on group 0 <- 1 (sites east <-> west)" in out
    assert _losses(stall, 6)[:3] == _losses(send, 6)[:3]
    assert _losses(stall, 6)[3:] == _losses(mid, 8)[3:6]
    _lost(stall, 3)  # the call of step 3, whose span holds round 2
    (fail,) = _events(stall, "failure")
    assert "no outer payload over group 0 <- 1" in fail["error"]


def test_losing_the_first_group_is_recorded_by_the_survivors_stable_group(runs):
    """Group 0 (east) killed as "mid" kills group 1: its survivor's actors keep their launch
    positions, past the shrunk plan's one pipeline, so every step after the loss must be
    recorded by the launch plan's groups (before the fix the first one raised IndexError):
    group 1's loss beside a lost group 0's nothing, the survivors' tokens (half the batch),
    no step lost or redone."""
    first, ctl = runs("first")
    losses = _losses(first, STEPS["first"])
    (rec,) = _events(first, "recovered")
    assert rec["failed_step"] == 3 and rec["lost_steps"] == 0
    assert rec["lost_groups"] == [0] and rec["groups_left"] == [1]
    assert rec["lost_sites"] == ["east"] and not _events(first, "resumed")
    rows = [x for x in first if "event" not in x]
    before, after = rows[:3], rows[4:]
    assert all(len(x["group_loss"]) == 2 for x in before)
    for x in after:
        lost, kept = x["group_loss"]
        assert (lost is None or lost != lost) and kept == pytest.approx(x["loss"])
        assert x["tokens"] * 2 == before[0]["tokens"]
    assert all(loss == loss for loss in losses)
    assert ctl.plan.group_ids == (1,) and ctl.plan.pipelines == 1
