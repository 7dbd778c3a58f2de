"""Shared test setup.

RAY_AUTH_MODE must be set the same way for the cluster, the driver and the tests, and Ray
reads it when first imported: token authentication on, as in a user's run.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """One embedded Ray for every test that asks for it, with both sites of the local
    clusters and the dashboard (the state API needs it). Started once: a Ray start and stop
    costs ~6 s of the suite per module, and a run frees its actor names before it returns,
    so the next test's launch of the same run finds them free. The tests that need a
    machine with no Ray of theirs running (the CLI launches, the multi-node cluster) run
    before it starts (:func:`pytest_collection_modifyitems`); the test bed's Ray lives in
    network namespaces of its own."""
    import ray
    from _state import DASHBOARD

    from geopipe.runtime.control.cluster import RAY_SYSTEM_CONFIG

    ctx = ray.init(
        address="local",
        namespace="geopipe",
        resources={"site:east": 3, "site:west": 3},  # up to 3 devices per site
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=_free_port(),
        logging_level="WARNING",
        _system_config=RAY_SYSTEM_CONFIG,  # as geopipe's own embedded Ray
    )
    DASHBOARD["url"] = f"http://{ctx.dashboard_url}"
    yield
    DASHBOARD.clear()
    ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the shared embedded Ray run last, each module's in its own order, so the
    ones that start their own Ray (or need none running) never meet it. Those are marked
    ``own_ray``: ``make test`` runs them first and alone, then the rest on both cores
    (pytest-xdist, one module per worker so a module's shared runs are made once), each
    worker with an embedded Ray of its own."""
    for item in items:
        if item.get_closest_marker("ray") and "ray_cluster" not in item.fixturenames:
            item.add_marker(pytest.mark.own_ray)
    items.sort(key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()))
