"""Shared test setup.

RAY_AUTH_MODE must be set the same way for the cluster, the driver and the tests, and Ray
reads it when first imported: token authentication on, as in a user's run.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from geopipe.runtime.control.cluster import GCS_START_WAIT_S, GCS_START_WAIT_VAR

# As geopipe's embedded start ([Note: a cold machine's first Ray start]): the tests' own Ray
# heads, and the CLI launches they spawn.
os.environ.setdefault(GCS_START_WAIT_VAR, GCS_START_WAIT_S)


import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The tests' own torch work (the single-process references, the checks on gathered
    state) runs on one intra-op thread, as every stage actor does (OMP_NUM_THREADS=1,
    geopipe.runtime.control.cluster.ACTOR_ENV).

    [Note: one torch thread in the test process]
    torch's default is a thread per core: two here, on a host whose cores the stage actors,
    Ray and the other pytest-xdist worker keep busy. The tiny models' kernels are far too
    small to split, and each kernel's two threads wait for each other while the other is
    descheduled: test_runtime's ``reference`` of a 2-layer GPT over 4 steps of 16
    micro-batches took 22-25 s of CPU that way, 0.28 s on one thread (2.5 s the first time,
    imports and warm-up included; getrusage, the host loaded as in `make test`), the
    losses equal to ~6e-8 (float summation order: every comparison with a reference has a
    tolerance far above it); test_outage_runtime's 40-step one 54 s -> 3 s.
    test_outer_actor's reference already set one thread, for the rest of its worker's
    session: now every session does, from the start."""
    import torch

    torch.set_num_threads(1)
    yield


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

    from geopipe.runtime.control.cluster import RAY_SYSTEM_CONFIG, worker_env

    with worker_env():  # as geopipe's own embedded Ray: actors need no runtime_env
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


# [Note: two workers finishing together]
# `make test` runs the integration tier on two pytest-xdist workers, a module at a time
# (--dist loadfile): a module's tests run on one worker, in order, so its shared runs (its
# module-scoped fixtures) are made once. xdist hands out the modules in collection order
# (--no-loadscope-reorder; by default it would sort them by their number of tests), the
# next one to whichever worker runs low first: longest first, the short ones at the end
# fill in, and both workers finish within a short module of each other. COST: each
# module's seconds in one run of the whole tier in one process on the 2-core machine, other
# work running too (noisy: only the order matters; test_outer_spans',
# test_outer_shares' and the trimmed trainer and recompute modules' are guesses from their
# launches). A module not listed comes last, in collection order.
# (Not --dist loadgroup: with pytest 9.2, xdist 3.8 no longer sees the xdist_group marks.)
COST = {
    "test_cli_launch": 118,  # own_ray: first on one worker
    "test_multinode": 56,  # own_ray: first on the other
    "test_recovery_runtime": 214,
    "test_runtime": 128,
    "test_checkpoint_runtime": 112,
    "test_hf_runtime": 75,  # two families across sites (the rest: unit tier)
    "test_outer_checkpoint": 78,
    "test_trainer_runtime": 45,
    "test_outer_spans": 60,
    "test_testbed": 57,
    "test_recompute_runtime": 30,
    "test_outer_failures_runtime": 41,
    # It was missing here and so came last, its ~50 s alone on one worker at the very end.
    "test_starved_chaos": 50,
    "test_site_rendezvous": 34,
    "test_security_runtime": 17,  # the undisturbed run: the torch reference
    "test_outage_runtime": 21,  # the undisturbed run: the torch reference
    "test_eval_runtime": 25,
    "test_engine": 24,
    "test_outer_actor": 22,
    "test_outer_runtime": 10,
    "test_outer_shares": 20,
    "test_engine_mixed": 8,
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that start their own Ray or need none in their process (test_multinode's
    cluster, the CLI launches) are marked ``own_ray`` and run first, so the shared embedded
    Ray (:func:`ray_cluster`, started when a test first asks for it) never meets them in
    their process: with two xdist workers, each runs one of the first two modules first
    (keep own_ray tests to at most two modules). Then the modules by COST, longest first
    ([Note: two workers finishing together]), each module's tests in their own order."""
    for item in items:
        if item.get_closest_marker("ray") and "ray_cluster" not in item.fixturenames:
            item.add_marker(pytest.mark.own_ray)
    position = {id(item): i for i, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple:
        cost = COST.get(item.path.stem, 0) if item.path.parent.name == "integration" else 0
        return (not item.get_closest_marker("own_ray"), -cost, position[id(item)])

    items.sort(key=key)
