"""Checkpoints without a shared file system (pure parts and the store, no Ray).

* config: ``{site}`` in ``training.checkpoint.dir`` and the ``replicate`` setting;
* which sites hold copies, and which checkpoint a recovery restores from
  (:func:`newest_restorable`, checked against a brute force over every holding pattern of
  three sites);
* the recovery policy on a whole site's loss;
* the site store (:class:`SiteStore`) with real files and real shards, its pull source
  faked at the actor-call seam: pulled copies verify, a corrupt transfer or an abandoned
  save never touches the last good copy, one store assembles a copy from another's.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from geopipe.checkpoint.restore import SiteCopy, copy_sites, newest_restorable
from geopipe.checkpoint.store import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_state_for_layers,
)
from geopipe.checkpoint.writer import shard_bytes
from geopipe.config import ConfigError, parse_cluster
from geopipe.optimizer.policies import Fail, Failure, RestoreFromCheckpoint, decide
from geopipe.optimizer.templates import build_templates
from geopipe.runtime.storage.sitestore import CHUNK_BYTES, ShardSource, SiteStore
from tests.unit.test_recovery_policy import _local_2x2, availability, running_plan
from tests.unit.test_templates import small_spec

ROOT = Path(__file__).resolve().parents[2]


def _doc(**checkpoint: Any) -> dict:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text()))
    doc["training"]["checkpoint"] = checkpoint
    return doc


def _problem(doc: dict, path: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_cluster(doc, "c.yaml")
    found = dict(info.value.problems)
    assert path in found, info.value.problems
    return found[path]


# --------------------------------------------------------------------------------------------
# config


def test_site_placeholder_makes_per_site_replicated_dirs() -> None:
    ck = parse_cluster(_doc(dir="/data/ckpt-{site}/x"), "c").training.checkpoint
    assert ck.per_site and ck.replicated
    assert ck.dir_for("east", "unused") == "/data/ckpt-east/x"
    off = parse_cluster(_doc(dir="/d/{site}", replicate=False), "c").training.checkpoint
    assert off.per_site and not off.replicated
    shared = parse_cluster(_doc(dir="/shared/ckpt"), "c").training.checkpoint
    assert not shared.per_site and not shared.replicated
    assert shared.dir_for("east", "x") == "/shared/ckpt"
    default = parse_cluster(_doc(), "c").training.checkpoint
    assert not default.per_site
    assert default.dir_for("west", "runs/a/checkpoints") == "runs/a/checkpoints"


def test_replicating_one_shared_directory_is_an_error() -> None:
    msg = _problem(_doc(dir="/shared/ckpt", replicate=True), "training.checkpoint.replicate")
    assert "{site}" in msg and "/shared/ckpt" in msg
    msg = _problem(_doc(replicate=True), "training.checkpoint.replicate")
    assert "{site}" in msg


@pytest.mark.parametrize("bad", ["/d/{sites}", "/d/{site}/{step}", "/d/}", "{site}"])
def test_only_the_site_placeholder_is_allowed(bad: str) -> None:
    assert _problem(_doc(dir=bad), "training.checkpoint.dir")


def test_site_names_must_be_directory_names_when_per_site() -> None:
    doc = _doc(dir="/d/{site}")
    doc["sites"][1]["name"] = "us/west"
    doc["links"][0]["to"] = "us/west"
    # Site names name Ray actors and directories in every layout, so the general name rule
    # (config/specs.py) already refuses this one, naming the field.
    assert "directories" in _problem(doc, "sites[1].name")


# --------------------------------------------------------------------------------------------
# which sites hold copies; which checkpoint survives


def test_copy_sites() -> None:
    assert copy_sites(["a", "a", "b", "c", "c"], True) == ["a", "b", "c"]
    assert copy_sites(["b", "a", "a"], False) == ["b"]
    assert copy_sites([], True) == []


def _brute(holdings: dict, live: set, n: int) -> int | None:
    steps = sorted({c.step for s in live for c in holdings.get(s, [])}, reverse=True)
    for step in steps:
        union = set()
        for s in live:
            for c in holdings.get(s, []):
                if c.step == step:
                    union |= c.stages
        if union >= set(range(n)):
            return step
    return None


def test_newest_restorable_matches_brute_force() -> None:
    """Three sites, steps 2 and 4, two stages: every pattern of held shards × live sites."""
    sites, n = ("a", "b", "c"), 2
    subsets = [frozenset(x) for r in range(n + 1) for x in itertools.combinations(range(n), r)]
    per_site = list(itertools.product(subsets, repeat=2))  # (stages of step 2, of step 4)
    for pattern in itertools.product(per_site, repeat=len(sites)):
        holdings = {
            s: [SiteCopy(step, n, st) for step, st in zip((2, 4), held, strict=True) if st]
            for s, held in zip(sites, pattern, strict=True)
        }
        for r in range(len(sites) + 1):
            for live in itertools.combinations(sites, r):
                got = newest_restorable(holdings, live)
                want = _brute(holdings, set(live), n)
                assert (got.step if got else None) == want, (holdings, live)
                if got is None:
                    continue
                held = {s: next((c for c in holdings[s] if c.step == got.step), None) for s in live}
                for k, s in got.sources.items():  # every source is live and holds the shard
                    assert s in live and k in held[s].stages
                assert set(got.complete_at) == {s for s, c in held.items() if c and c.complete}
                if got.complete_at:  # a complete copy exists: nothing is assembled
                    assert set(got.sources.values()) == {got.complete_at[0]}
                    assert got.site == got.complete_at[0]


def test_newest_restorable_rules() -> None:
    full = frozenset({0, 1})
    holdings = {
        "east": [SiteCopy(4, 2, full), SiteCopy(6, 2, frozenset({0}))],
        "west": [SiteCopy(4, 2, full), SiteCopy(6, 2, full), SiteCopy(8, 2, full)],
    }
    # West is lost: its newer copies do not count; east's partial step 6 is not enough.
    assert newest_restorable(holdings, ["east"]).step == 4
    both = newest_restorable(holdings, ["east", "west"])
    assert both.step == 8 and both.complete_at == ("west",)
    assert newest_restorable(holdings, ["east", "west"], not_after=7).step == 6
    # Sources prefer a complete copy, then the preferred sites.
    p = newest_restorable(holdings, ["east", "west"], not_after=4, prefer=["west"])
    assert p.site == "west" and p.complete_at == ("west", "east")
    assert newest_restorable(holdings, ["east", "west"], not_after=4).site == "east"
    assert newest_restorable({}, ["east"]) is None
    # Copies of one step from saves of different layouts are never mixed.
    mixed = {"a": [SiteCopy(3, 2, frozenset({0}))], "b": [SiteCopy(3, 3, frozenset({1, 2}))]}
    assert newest_restorable(mixed, ["a", "b"]) is None


# --------------------------------------------------------------------------------------------
# the policy when a whole site is lost


def test_site_loss_restores_the_newest_checkpoint_surviving_elsewhere() -> None:
    ts, plan = _local_2x2()
    dead = frozenset({(1, 0), (1, 1)})  # every actor of s1
    params, adam = availability(plan, dead, snapshots=True)
    full = frozenset({0, 1})
    holdings = {"s0": [SiteCopy(4, 2, full)], "s1": [SiteCopy(4, 2, full), SiteCopy(6, 2, full)]}
    point = newest_restorable(holdings, ["s0"])
    dec = decide(Failure(plan, dead, {"s0": 2, "s1": 0}, params, adam, point.step), ts)
    assert isinstance(dec, RestoreFromCheckpoint) and dec.step == 4
    assert set(dec.plan.stage_sites) == {"s0"} and "parameters" in dec.reason


def test_site_loss_fails_when_the_rest_cannot_hold_the_model() -> None:
    ts = build_templates(small_spec((1, 2), n_layer=2, mem_factor=0.75))
    plan = running_plan(ts, 1)
    assert plan is not None and set(plan.stage_sites) == {"s0", "s1"}
    dead = frozenset((k, 0) for k in range(plan.num_stages) if plan.stage_sites[k] == "s1")
    params, adam = availability(plan, dead, snapshots=True)
    dec = decide(Failure(plan, dead, {"s0": 1, "s1": 0}, params, adam, 4), ts)
    assert isinstance(dec, Fail)  # a checkpoint survives, but one device cannot hold it
    assert "no longer fits" in dec.reason and "s0=1" in dec.reason


# --------------------------------------------------------------------------------------------
# the site store, with its pull source faked at the actor-call seam


class _Call:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Holder:
    """A stage replica holding an encoded shard (what ``StageWorker.read_chunk`` serves)."""

    def __init__(self, blob: bytes, corrupt_at: int | None = None) -> None:
        self.blob = blob
        self.asked: list[int] = []

        def read(step: int, file: str, off: int, n: int) -> bytes:
            self.asked.append(off)
            data = bytearray(blob[off : off + n])
            if corrupt_at is not None and off <= corrupt_at < off + n:
                data[corrupt_at - off] ^= 0xFF
            return bytes(data)

        self.read_chunk = _Call(read)


class _Handle:
    """A store as another store sees it through Ray: ``handle.method.remote(...)``."""

    def __init__(self, store: SiteStore) -> None:
        self.manifest = _Call(store.manifest)
        self.read_chunk = _Call(store.read_chunk)


def _store(tmp: Path, site: str) -> SiteStore:
    st = SiteStore(site, str(tmp / f"ckpt-{site}"), keep=2)
    st.get = lambda ref, timeout=None: ref
    return st


def _shards(step: int, big: bool = False) -> list[tuple[bytes, Any]]:
    g = torch.Generator().manual_seed(step)
    n = 600_000 if big else 64  # big: more than one 4 MiB chunk
    return [
        shard_bytes(
            k,
            {f"params/blocks.{k}.w": torch.randn(n, 4, generator=g)},
            {"adam_step": step, "lr_step": step, "layers": [k, k + 1]},
        )
        for k in range(2)
    ]


MANIFEST = {
    "config_hash": "h",
    "plan": {},
    "data": {"step": 0},
    "model": {"n_layer": 2, "n_embd": 4, "n_head": 1, "vocab_size": 256, "max_seq_len": 8},
    "copies": {"east": "/e", "west": "/w"},
}


def _save(store: SiteStore, step: int, shards: list, save_id: str = "s") -> dict:
    holders = [_Holder(b) for b, _ in shards]
    sources = [ShardSource(k, h, None if k == 0 else 1e12) for k, h in enumerate(holders)]
    return store.save(
        step, save_id, {**MANIFEST, "data": {"step": step}}, sources, *[i for _, i in shards]
    )


def test_pulled_copy_is_a_complete_verified_checkpoint(tmp_path: Path) -> None:
    east = _store(tmp_path, "east")
    shards = _shards(2, big=True)
    assert shards[0][1].bytes > CHUNK_BYTES  # several chunks
    out = _save(east, 2, shards)
    ckpt = load_checkpoint(out["path"], verify=True)
    assert ckpt.manifest["copies"] == MANIFEST["copies"]
    assert [e["sha256"] for e in ckpt.manifest["stages"]] == [i.sha256 for _, i in shards]
    state = load_state_for_layers(ckpt, ["blocks.0.w", "blocks.1.w"])
    g = torch.Generator().manual_seed(2)
    assert torch.equal(state["params"]["blocks.0.w"], torch.randn(600_000, 4, generator=g))
    assert east.holdings() == [SiteCopy(2, 2, frozenset({0, 1}))]
    # A fresh store (a restarted actor) finds and verifies the copy on disk.
    again = _store(tmp_path, "east")
    assert again.holdings() == east.holdings()


def test_corrupt_transfer_or_abandoned_save_keeps_the_last_good_copy(tmp_path: Path) -> None:
    east = _store(tmp_path, "east")
    _save(east, 2, _shards(2))
    shards = _shards(4)
    bad = [
        ShardSource(0, _Holder(shards[0][0]), None),
        ShardSource(1, _Holder(shards[1][0], corrupt_at=100), None),
    ]
    with pytest.raises(CheckpointError, match="sha256"):
        east.fetch(4, "t", bad, *[i for _, i in shards])
    assert [i.status for i in list_checkpoints(east.root)] == ["complete", "partial"]
    with pytest.raises(CheckpointError, match="stage"):  # stage 1 never arrived
        east.commit(4, "t", MANIFEST, 2)
    assert [(i.step, i.status) for i in list_checkpoints(east.root)] == [(2, "complete")]
    # An abandoned save: its tmp dir goes, a late pull for it is refused.
    good = [ShardSource(k, _Holder(b), None) for k, (b, _) in enumerate(shards)]
    assert east.fetch(4, "u", good, *[i for _, i in shards]) == [0, 1]
    east.abort(4, "u")
    with pytest.raises(CheckpointError, match="abandoned"):
        east.fetch(4, "u", good, *[i for _, i in shards])
    assert [(i.step, i.status) for i in list_checkpoints(east.root)] == [(2, "complete")]
    assert east.holdings() == [SiteCopy(2, 2, frozenset({0, 1}))]


def test_a_pull_that_failed_resumes_with_a_stand_in(tmp_path: Path) -> None:
    """Stage 1's writer died mid-save: the store keeps stage 0 and pulls only stage 1 from
    the replica that stands in."""
    east = _store(tmp_path, "east")
    shards = _shards(2)
    h0 = _Holder(shards[0][0])

    def dead(*_: Any) -> bytes:
        raise RuntimeError("actor died")

    dead_writer = type("W", (), {"read_chunk": _Call(dead)})()
    srcs = [ShardSource(0, h0, None), ShardSource(1, dead_writer, None)]
    with pytest.raises(RuntimeError, match="died"):
        east.fetch(2, "s", srcs, *[i for _, i in shards])
    stand_in = _Holder(shards[1][0])
    srcs[1] = ShardSource(1, stand_in, None)
    h0.asked.clear()
    assert east.fetch(2, "s", srcs, *[i for _, i in shards]) == [0, 1]
    assert h0.asked == [] and stand_in.asked == [0]
    east.commit(2, "s", MANIFEST, 2)
    assert load_checkpoint(east.root / "step-00000002").step == 2


def test_a_site_assembles_its_copy_from_another_site(tmp_path: Path) -> None:
    east, west = _store(tmp_path, "east"), _store(tmp_path, "west")
    _save(east, 2, _shards(2, big=True))
    path = west.copy_from(2, _Handle(east))
    a = json.loads((east.root / "step-00000002" / "manifest.json").read_text())
    b = json.loads((Path(path) / "manifest.json").read_text())
    assert a == b  # the same checkpoint, byte for byte in every shard (checksums equal)
    load_checkpoint(path, verify=True)
    assert west.copy_from(2, _Handle(east)) == path  # already there: nothing moves
    # Pruning keeps the newest `keep` copies on each site independently.
    for step in (4, 6):
        _save(east, step, _shards(step))
    assert [c.step for c in east.holdings()] == [4, 6]
    assert [c.step for c in west.holdings()] == [2]


# --------------------------------------------------------------------------------------------
# what the user sees: `geopipe status` and `geopipe checkpoints` with per-site copies


def test_status_and_checkpoints_show_each_sites_copies(tmp_path: Path, capsys) -> None:
    from geopipe.cli import main
    from geopipe.cli.render import format_status

    east, west = _store(tmp_path, "east"), _store(tmp_path, "west")
    _save(east, 2, _shards(2))
    west.copy_from(2, _Handle(east))
    _save(east, 4, _shards(4))  # west's copy of step 4 failed
    (west.root / "step-00000002" / "stage-1.safetensors").write_bytes(b"rotten")
    run = tmp_path / "run"
    run.mkdir()
    status = {
        "run": "r",
        "state": "running",
        "step": 5,
        "steps": 9,
        "stages": [],
        "checkpoint": {
            "step": 4,
            "copies": {"east": east.path_of(4)},
            "failed": {"west": "the actor died"},
        },
        "checkpoint_dirs": {"east": str(east.root), "west": str(west.root)},
    }
    (run / "status.json").write_text(json.dumps(status))
    text = format_status(status, "running")
    assert "latest checkpoint: step 4" in text and east.path_of(4) in text
    assert "site west" in text and "copy failed: the actor died" in text

    assert main(["checkpoints", str(run), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    got = {(r["site"], r["step"]): r["status"] for r in rows}
    assert got == {("east", 2): "complete", ("east", 4): "complete", ("west", 2): "corrupt"}
    assert main(["checkpoints", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"site east: {east.root}" in out and f"site west: {west.root}" in out
