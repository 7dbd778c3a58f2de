"""The multi-node path: attach to an existing Ray cluster whose nodes carry the sites.

``ray.cluster_utils.Cluster`` starts a real head and a second real raylet on this machine
— two Ray nodes, as ``ray start --head --resources='{"site:east": 2}'`` and ``ray start
--address=… --resources='{"site:west": 2}'`` would on two hosts. The run attaches with
``ray.address: <head>`` (not the embedded path), places each site's stages on its node,
and when the west node is removed mid-run it recovers in place on what is left.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from test_runtime import tiny_doc

from geopipe.checkpoint.store import list_checkpoints
from geopipe.config import parse_cluster
from geopipe.runtime.control.cluster import RAY_SYSTEM_CONFIG
from geopipe.runtime.control.controller import Controller, LaunchOptions

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"site:east": 2},
            "include_dashboard": False,
            "_system_config": RAY_SYSTEM_CONFIG,  # as geopipe's own embedded Ray
        },
    )
    west = cluster.add_node(num_cpus=2, resources={"site:west": 2})
    try:
        yield cluster, west
    finally:
        ray.shutdown()
        cluster.shutdown()


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_loss_per_step(run_dir: Path) -> list[float]:
    by_step = {x["step"]: x["loss"] for x in metrics(run_dir) if "event" not in x}
    return [by_step[k] for k in sorted(by_step)]


def complete_steps(root: Path) -> list[int]:
    return [i.step for i in list_checkpoints(root) if i.status == "complete"]


def test_runs_on_two_nodes_and_survives_losing_a_site(two_nodes, tmp_path):
    """Reference run: one shared checkpoint directory. Lost run: a directory per site (no
    shared file system), every checkpoint replicated to both; the west node is removed
    and its directory deleted mid-run, and the job continues from east's copy."""
    cluster, west = two_nodes
    every = 2
    doc = tiny_doc(2, 2, steps=7)
    doc["name"] = "multinode"
    doc["ray"] = {"address": cluster.address, "emulate_links": True, "dashboard": False}
    doc["training"]["checkpoint"] = {"every_steps": every, "keep": 3}
    shared = parse_cluster(doc, "multinode")
    doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ckpt-{site}")
    per_site = parse_cluster(doc, "multinode")
    east_dir, west_dir = tmp_path / "ckpt-east", tmp_path / "ckpt-west"
    seen: dict = {}

    def run(spec, run_dir: Path, remove_west: bool) -> Controller:
        ctl = Controller(spec, LaunchOptions(run_dir=str(run_dir), progress=False))
        try:
            ctl.launch()
            assert not ctl.cluster.started_here  # attached, not embedded
            site_node = {"east": cluster.head_node.node_id, "west": west.node_id}
            for k, row in enumerate(ctl.actors):
                assert {node_of(a) for a in row} == {site_node[ctl.plan.stage_sites[k]]}
            if remove_west:

                def remove() -> None:
                    # Both sites hold a complete copy of step 2 before west goes away (a
                    # site lost while the newest copy is still on its way costs one more
                    # interval: the survivors restore their previous copy).
                    while (
                        every not in complete_steps(west_dir)
                        or every not in complete_steps(east_dir)
                        or len(last_loss_per_step(run_dir)) < 2 * every
                    ):
                        time.sleep(0.05)
                    seen["east"] = complete_steps(east_dir)
                    seen["west"] = complete_steps(west_dir)
                    seen["manifest"] = json.loads(
                        (west_dir / "step-00000002" / "manifest.json").read_text()
                    )
                    cluster.remove_node(west)
                    shutil.rmtree(west_dir)  # the site's disk goes with it

                threading.Thread(target=remove, daemon=True).start()
            ctl.train()
            return ctl
        finally:
            ctl.close()

    run(shared, tmp_path / "ref", remove_west=False)
    ctl = run(per_site, tmp_path / "lost", remove_west=True)
    # One directory, but every site's node sees it (one machine): no warning.
    shared_storage = next(
        x for x in metrics(tmp_path / "ref") if x.get("event") == "checkpoint_storage"
    )
    assert shared_storage["mode"] == "shared" and shared_storage["warning"] is None
    assert set(shared_storage["dirs"]) == {"east", "west"}
    lines = metrics(tmp_path / "lost")
    storage = next(x for x in lines if x.get("event") == "checkpoint_storage")
    assert storage["mode"] == "per-site" and storage["warning"] is None
    assert storage["dirs"] == {"east": str(east_dir), "west": str(west_dir)}
    # Before the loss: each site committed a complete copy on its own, recording both;
    # the shards crossing sites came over the data plane (the writers' chunk servers),
    # those of a site's own stages through Ray, not both ways.
    assert every in seen["east"] and every in seen["west"]
    first = next(x for x in lines if x.get("event") == "checkpoint" and x["step"] == every)
    for site, via in first["transferred"].items():
        assert via.get("data_plane", 0) > 0 and via.get("ray", 0) > 0, (site, via)
    assert set(seen["manifest"]["copies"]) == {"east", "west"}
    failure = [x for x in lines if x.get("event") == "failure"]
    assert len(failure) == 1 and failure[0]["lost_sites"] == ["west"]
    assert sorted(failure[0]["dead"]) == [
        "geopipe/multinode/west/stage1/r0",
        "geopipe/multinode/west/stage1/r1",
    ]
    rec = next(x for x in lines if x.get("event") == "recovered")
    # Stage 1's state survives only in east's replicated copy of a checkpoint.
    assert rec["source"] == "checkpoint" and rec["lost_sites"] == ["west"]
    assert rec["restored_from"]["site"] == "east"
    assert rec["restored_from"]["paths"]["east"].startswith(str(east_dir))
    assert rec["restored_from"]["step"] % every == 0
    assert 0 <= rec["lost_steps"] <= every
    assert set(ctl.plan.stage_sites) == {"east"}
    assert not west_dir.exists()  # nothing was read from or written to west after the loss
    assert max(complete_steps(east_dir)) == 7  # the final checkpoint, on east alone
    assert last_loss_per_step(tmp_path / "lost") == pytest.approx(
        last_loss_per_step(tmp_path / "ref"), abs=1e-4
    )
