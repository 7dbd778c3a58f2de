"""``cluster.worker_env``: the stage actors' environment set while an embedded Ray starts (its
raylet and workers inherit it, so actors need no ``runtime_env``: [Note: an actor's
environment without a runtime_env]) and the driver's own restored after, values it had and
values it lacked alike. That the actors do hold it is checked on launched actors
(tests/integration/test_runtime.py, the environment check)."""

from __future__ import annotations

import os

import pytest

from geopipe.runtime.control.cluster import ACTOR_ENV, worker_env


def test_the_environment_is_set_inside_and_restored_after(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    with worker_env():
        assert {k: os.environ.get(k) for k in ACTOR_ENV} == ACTOR_ENV
    assert os.environ["OMP_NUM_THREADS"] == "7"
    assert "MALLOC_ARENA_MAX" not in os.environ


def test_restored_when_the_start_fails(monkeypatch) -> None:
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    with pytest.raises(RuntimeError), worker_env():
        raise RuntimeError("ray.init failed")
    assert "TORCHDYNAMO_DISABLE" not in os.environ
