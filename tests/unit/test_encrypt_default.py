"""Encryption follows the topology, not the link emulation: a cluster launch attaches to may
span nodes (the test bed's links are emulated by a forwarder, every byte still crosses a
network), so only the embedded single-machine cluster runs in clear by default."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from geopipe.config import parse_cluster

LOCAL = Path(__file__).resolve().parents[2] / "clusters" / "local-2dc.yaml"


@pytest.mark.parametrize(
    ("ray", "security", "want"),
    [
        ({"address": "local"}, {}, False),  # one machine: nothing crosses a network
        ({"address": "local", "emulate_links": True}, {}, False),
        ({"address": "auto", "emulate_links": True}, {}, True),  # emulated links, many nodes
        ({"address": "10.0.0.1:6379", "emulate_links": False}, {}, True),
        ({"address": "auto", "emulate_links": True}, {"encrypt": False}, False),  # said so
        ({"address": "local"}, {"encrypt": True}, True),
    ],
)
def test_encryption_is_on_wherever_the_run_may_span_nodes(ray, security, want) -> None:
    doc = yaml.safe_load(LOCAL.read_text())
    doc["ray"] = {**doc.get("ray", {}), **ray}
    doc["security"] = security
    assert parse_cluster(doc, "t").encrypted is want
