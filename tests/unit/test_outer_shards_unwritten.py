"""An outer-loop run whose save meets a wedged writer (issue 33): ``recover_groups`` given
the :class:`ShardsUnwritten` that the real checkpoint coordinator raises.

The writer belongs to one replica group; it answers pings (its writer thread is stuck in a
gather), so only the error names it. The driver's real parts run against a scripted
worker seam (tests/unit/test_outer_failures.py's ``Script``, with pings, kills and real
shard files added): :class:`CheckpointCoordinator` over the outer run's shard rows,
:class:`OuterRounds`, :class:`Placement` and ``recover_groups``. What must hold: the
writer's group is lost as a frozen member's would be (its actors stopped, its pipeline
out of the plan), the other groups go on from the same step with nothing lost or redone,
the dropped save is made again over the survivors and commits, and their next round
averages over them only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from geopipe.checkpoint.store import list_checkpoints, load_checkpoint
from geopipe.checkpoint.writer import write_shard_file
from geopipe.plan import Plan
from geopipe.runtime.control.checkpointing import CheckpointCoordinator
from geopipe.runtime.control.health import ShardsUnwritten
from geopipe.runtime.control.outerfail import recover_groups
from geopipe.runtime.control.placement import Placement
from geopipe.runtime.control.states import Checkpointing, Recovering
from geopipe.runtime.control.workers import CallTimeout, WorkerLost
from tests.unit.test_outer_failures import FROZEN, Script, _plan, _rounds

pytestmark = pytest.mark.timeout(60)

MANIFEST = {
    "config_hash": "h",
    "plan": {},
    "data": {"step": 0},
    "model": {"n_layer": 2, "n_embd": 4, "n_head": 1, "vocab_size": 256, "max_seq_len": 8},
}


class Seam(Script):
    """``Script``'s outer-loop answers (actor ``a`` is group ``a // 2``'s stage ``a % 2``),
    plus what a save and a recovery ask: a ping answers a pid (until killed), a save's
    snapshot its stall, and each shard row's writer writes a real shard file (its value
    the actor's id) -- except the ``wedged`` ones, which never finish (``shard_written``
    never answers) though they answer pings."""

    def __init__(self, groups: int, wedged: set[int]) -> None:
        super().__init__(groups)
        self.wedged, self.killed = wedged, []
        self.rows: Any = None  # the save's shard rows ([shard][replica], writer first)
        self.written: dict[int, Any] = {}

    def call(self, actor: int, method: str, *args: Any) -> Any:
        if actor in self.dead:
            return WorkerLost(f"actor {actor} died")
        if method == "ping":
            return 1000 + actor
        if method == "save_shard":
            directory, step = args
            shard = next(i for i, row in enumerate(self.rows()) if row[0] == actor)
            if actor not in self.wedged:
                meta = {"adam_step": step, "lr_step": step, "layers": [shard, shard + 1]}
                tensors = {f"params/a{actor}": torch.tensor([float(actor)])}
                self.written[actor] = write_shard_file(directory, shard, tensors, meta)
            return 0.01
        if method == "shard_written":
            return FROZEN if actor in self.wedged else self.written.pop(actor)
        if method == "release_shard":
            return None
        return super().call(actor, method, *args)

    def wait(self, pendings: list, num_returns: int = 1, timeout: float | None = None):
        ready = [p for p in pendings if p is not FROZEN]
        if len(ready) < num_returns:
            assert timeout is not None, "a wait without a bound on a call that never answers"
            time.sleep(timeout)
        return ready[:num_returns], [p for p in pendings if p not in ready[:num_returns]]

    def get(self, pendings: list, timeout: float | None = None) -> list:
        if any(p is FROZEN for p in pendings):
            assert timeout is not None, "a get without a bound on a call that never answers"
            time.sleep(timeout)
            raise CallTimeout("no answer")
        return super().get(pendings, timeout)

    def kill(self, actor: int) -> None:
        self.killed.append(actor)
        self.dead.add(actor)


class Reporter:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.said: list[str] = []
        self.sink, self.checkpoint = None, None

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append((kind, fields))

    def say(self, text: str, warning: bool = False) -> None:
        self.said.append(text)

    def of(self, kind: str) -> list[dict]:
        return [f for k, f in self.events if k == kind]


class Ctl:
    """The controller as ``recover_groups`` uses it (its placement, workers, reporter,
    outer rounds, checkpoints), recording the calls it makes back."""

    def __init__(self, spec: Any, seam: Seam, pl: Placement, rounds: Any, ckpt: Any) -> None:
        self.spec, self.workers, self.placement, self.outer = spec, seam, pl, rounds
        self.reporter, self.checkpoints = ckpt.reporter, ckpt
        self.calibrator = type("Cal", (), {"predicted_s": 0.1, "calibrated": False})()
        self.recovery = type("Rec", (), {"outer": None})()
        self.stop = type("Stop", (), {"requested": False})()
        self.recorded: list = []
        self.recovered: list = []
        self.relaid: list = []
        self.history = type("H", (), {"recovered": lambda _s, *a: self.recovered.append(a)})()

    def _set_plan(self, plan: Plan) -> None:
        self.placement.plan = plan

    def _record(
        self, step: int, results: list, at: float | None = None, status: bool = True
    ) -> None:
        self.recorded.append(step)

    def _relaid(self, step: int) -> None:
        self.relaid.append(step)

    def _pings(self) -> list:
        return [self.workers.call(a, "ping") for a in self.placement.flat()]


def _three_groups(rounds: Any, seam: Seam, tmp_path: Path) -> tuple[Any, Placement, Any]:
    """Three groups of one two-stage pipeline each over ``seam``: the spec, the placement
    (rows[stage][pipeline]) and the real checkpoint coordinator over the outer run's shard
    rows (shard g * 2 + k: group g's stage k)."""
    rounds.workers = seam
    spec = rounds.spec
    pl = Placement(spec, 60, 0.0, None, seam)
    pl.plan, pl.rows = _plan(3, per_group=1), [[0, 2, 4], [1, 3, 5]]
    ckpt = CheckpointCoordinator(
        spec,
        tmp_path,
        Reporter(),
        lambda: pl.rows,
        lambda step: {**MANIFEST, "data": {"step": step}},
        stage_sites=lambda: list(pl.plan.stage_sites),
        actor_sites=pl.actor_sites,
        workers=seam,
    )
    ckpt.begin_outer(rounds, None)
    seam.rows = ckpt._actors
    return spec, pl, ckpt


def test_a_wedged_writer_loses_its_group_and_the_others_go_on(tmp_path: Path) -> None:
    health = {"hang_floor_uncalibrated_s": 0.2, "unresponsive_s": 0.5, "hang_floor_s": 1.0}
    rounds, _, _, _ = _rounds(3, health)  # H = 2: an apply every 2 steps
    seam = Seam(3, wedged={3})  # group 1's stage-1 actor: its shard of step 4 never comes
    spec, pl, ckpt = _three_groups(rounds, seam, tmp_path)
    for done in (1, 2, 3, 4):  # steps 0..3 run; rounds applied after steps 2 and 4
        rounds.after_step(done, pl.flat())
    ckpt.save(4)
    with pytest.raises(ShardsUnwritten) as err:
        ckpt.poll(wait=True)  # the next save (or the last) needs it: 0.2 s, then this
    exc = err.value
    assert exc.names == ["west/stage1/r1"] and exc.step == 4
    assert [pl.flat()[i] for i in exc.indices] == [3]  # the layout's order, as recovery reads
    assert list_checkpoints(tmp_path / "checkpoints") == []  # nothing of the save committed

    ctl = Ctl(spec, seam, pl, rounds, ckpt)
    nxt = recover_groups(ctl, Recovering(4, exc, ctl._pings()))

    survivors = [0, 4, 1, 5]
    # The writer's group goes as a frozen member's would: both its actors stopped, its
    # pipeline out of the plan; the other groups' actors untouched, in place.
    assert sorted(seam.killed) == [2, 3]
    assert pl.rows == [[0, 4], [1, 5]] and pl.plan.groups == (0, 2)
    assert rounds.live == {0, 2}
    assert seam.of("outer_drop") == [(a, ([1],)) for a in survivors]
    # No step lost or redone: the failure came between steps, nothing is recorded again,
    # and the run goes on at step 4 by saving it again (the boundary is a checkpoint's).
    assert nxt == Checkpointing(4)
    assert ctl.recorded == [] and ctl.relaid == [4] and ctl.recovered[0][1:] == (4, 4)
    (failure,) = ctl.reporter.of("failure")
    assert failure["lost_groups"] == [1] and failure["lost_sites"] == ["west"]
    assert sorted(failure["dead"]) == [f"geopipe/local-2dc/west/stage{k}/r1" for k in (0, 1)]
    assert "not written" in failure["error"]
    (recovered,) = ctl.reporter.of("recovered")
    assert recovered["lost_steps"] == 0 and recovered["groups_left"] == [0, 2]
    assert recovered["step"] == 4 and recovered["source"] == "surviving groups"
    assert "the other 2 go on, no step lost" in ctl.reporter.said[-1]

    # Checkpointing(4) over the survivors: two groups' shards, each written by its own
    # group's actor, and the manifest names those groups.
    ckpt.save(4)
    ckpt.poll(wait=True)
    saved = load_checkpoint(tmp_path / "checkpoints" / "step-00000004", verify=True)
    assert saved.manifest["outer"]["group_ids"] == [0, 2]
    values = [float(t[0]) for s in saved.stages for t in s.tensors("params/").values()]
    assert values == [0.0, 1.0, 4.0, 5.0]
    assert [(i.step, i.status) for i in list_checkpoints(tmp_path / "checkpoints")] == [
        (4, "complete")
    ]
    # The next round (after step 6) averages over the survivors only.
    applies = len(seam.of("outer_apply"))
    for done in (5, 6):
        rounds.after_step(done, pl.flat())
    assert seam.of("outer_apply")[applies:] == [(a, (0, [0, 2])) for a in pl.flat()]


def test_a_save_in_flight_when_a_group_goes_commits_the_layout_it_began_on(
    tmp_path: Path,
) -> None:
    """Review of the checkpoint-race fix: the save of step 4 is still in flight (its shards
    written, not yet committed) when group 1 dies in the next call. ``recover_groups``
    shrinks the placement to the survivors, then settles the save: it commits all three
    groups' shards under the manifest taken as the save began (group ids 0, 1, 2), so the
    checkpoint loads as the three-group run it is. Built from the shrunk layout instead, its
    manifest named two groups over six shards, and no resume could read it."""
    rounds, _, _, _ = _rounds(3, {"hang_floor_s": 1.0})
    seam = Seam(3, wedged=set())
    spec, pl, ckpt = _three_groups(rounds, seam, tmp_path)
    for done in (1, 2, 3, 4):
        rounds.after_step(done, pl.flat())
    ckpt.save(4)  # not polled: the next call fails first
    seam.dead.add(2)  # group 1's stage-0 actor
    ctl = Ctl(spec, seam, pl, rounds, ckpt)
    recover_groups(ctl, Recovering(4, WorkerLost("actor 2 died"), ctl._pings()))
    assert pl.rows == [[0, 4], [1, 5]]
    saved = load_checkpoint(tmp_path / "checkpoints" / "step-00000004", verify=True)
    assert saved.manifest["outer"]["group_ids"] == [0, 1, 2] and len(saved.stages) == 6
    values = [float(t[0]) for s in saved.stages for t in s.tensors("params/").values()]
    assert values == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
