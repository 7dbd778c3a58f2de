"""The multi-node path: attach to an existing Ray cluster whose nodes carry the sites.

``ray.cluster_utils.Cluster`` starts a real head and a second real raylet on this machine
— two Ray nodes, as ``ray start --head --resources='{"site:east": 2}'`` and ``ray start
--address=… --resources='{"site:west": 2}'`` would on two hosts. The run attaches with
``ray.address: <head>`` (not the embedded path), places each site's stages on its node,
and when the west node is removed mid-run it recovers in place on what is left.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from test_runtime import tiny_doc

from geopipe.config import parse_cluster
from geopipe.runtime.controller import Controller, LaunchOptions

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"site:east": 2}, "include_dashboard": False},
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


def test_runs_on_two_nodes_and_survives_losing_one(two_nodes, tmp_path):
    cluster, west = two_nodes
    doc = tiny_doc(2, 2, steps=6)
    doc["name"] = "multinode"
    doc["ray"] = {"address": cluster.address, "emulate_links": True, "dashboard": False}
    doc["training"]["checkpoint"] = {"every_steps": 1, "keep": 3}
    spec = parse_cluster(doc, "multinode")

    def run(run_dir: Path, remove_west: bool) -> Controller:
        ctl = Controller(spec, LaunchOptions(run_dir=str(run_dir), progress=False))
        try:
            ctl.launch()
            assert not ctl.cluster.started_here  # attached, not embedded
            site_node = {"east": cluster.head_node.node_id, "west": west.node_id}
            for k, row in enumerate(ctl.actors):
                assert {node_of(a) for a in row} == {site_node[ctl.plan.stage_sites[k]]}
            if remove_west:

                def remove() -> None:
                    path = run_dir / "metrics.jsonl"
                    while not path.exists() or len(last_loss_per_step(run_dir)) < 3:
                        time.sleep(0.05)
                    cluster.remove_node(west)

                threading.Thread(target=remove, daemon=True).start()
            ctl.train()
            return ctl
        finally:
            ctl.close()

    run(tmp_path / "ref", remove_west=False)
    ctl = run(tmp_path / "lost", remove_west=True)
    failure = [x for x in metrics(tmp_path / "lost") if x.get("event") == "failure"]
    assert len(failure) == 1 and sorted(failure[0]["dead"]) == [
        "geopipe/multinode/west/stage1/r0",
        "geopipe/multinode/west/stage1/r1",
    ]
    rec = next(x for x in metrics(tmp_path / "lost") if x.get("event") == "recovered")
    # Every west replica is gone, so stage 1's state survives only in the checkpoint; the
    # job continues on the east node alone, in place (no relaunch).
    assert rec["source"] == "checkpoint" and set(rec["plan"]["stage_sites"]) == {"east"}
    assert set(ctl.plan.stage_sites) == {"east"}
    assert last_loss_per_step(tmp_path / "lost") == pytest.approx(
        last_loss_per_step(tmp_path / "ref"), abs=1e-4
    )
