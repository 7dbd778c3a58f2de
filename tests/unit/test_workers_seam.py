"""The worker-group seam holds its shape: every method the driver calls on an actor is in the
seam's protocols, the real actor classes and the fakes implement them with the same
parameters, the control modules reach actors only through the seam, and Ray's errors
become the seam's own (checked against stand-ins for Ray's exception classes: no Ray)."""

from __future__ import annotations

import ast
import inspect
import sys
import types
from pathlib import Path

import pytest

from geopipe.runtime.actor.stage import StageWorker
from geopipe.runtime.control import workers as seam
from geopipe.runtime.control.workers import SiteStoreActor, StageActor
from geopipe.runtime.storage.sitestore import SiteStore
from tests.unit.fakes import FakeStage, FakeStore

ROOT = Path(__file__).resolve().parents[2]
CONTROL = ROOT / "geopipe" / "runtime" / "control"
# Modules that may import Ray: connecting to it (cluster), its implementation of the seam
# (workers) and its metrics gauges (metrics).
MAY_IMPORT_RAY = {"cluster.py", "workers.py", "metrics.py"}
# The outer loop's calls are not modelled by the fake (tests/unit/test_outer_rounds.py
# scripts them).
NOT_FAKED = {
    "outer_begin",
    "outer_connect",
    "outer_send",
    "outer_gather",
    "outer_decide",
    "outer_drop",
    "outer_apply",
    "outer_state",
    "load_outer_state",
    "load_outer_checkpoint",
}


def methods(protocol: type) -> dict[str, inspect.Signature]:
    return {
        n: inspect.signature(f)
        for n, f in vars(protocol).items()
        if not n.startswith("_") and callable(f)
    }


def params(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize(
    "protocol,real",
    [(StageActor, StageWorker), (SiteStoreActor, SiteStore)],
    ids=["stage", "store"],
)
def test_the_real_actors_implement_the_protocols(protocol: type, real: type) -> None:
    for name, sig in methods(protocol).items():
        assert hasattr(real, name), f"{real.__name__} lacks {name}"
        assert params(inspect.signature(getattr(real, name))) == params(sig), name


@pytest.mark.parametrize(
    "protocol,fake", [(StageActor, FakeStage), (SiteStoreActor, FakeStore)], ids=["stage", "store"]
)
def test_the_fakes_implement_every_method(protocol: type, fake: type) -> None:
    inner = SiteStore if fake is FakeStore else fake  # the fake store is the real one inside
    missing = [n for n in methods(protocol) if not hasattr(fake, n) and not hasattr(inner, n)]
    assert set(missing) <= NOT_FAKED


def _calls(tree: ast.AST) -> list[tuple[str, int]]:
    """The method names given as string literals to ``call``/``call_all``/``ask``."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
        index = {"call": 1, "call_all": 2, "ask": 2}.get(name or "")
        if index is not None and len(node.args) > index:
            arg = node.args[index]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.append((arg.value, node.lineno))
    return out


def test_the_control_modules_call_actors_only_through_the_seam() -> None:
    """Every method a control module names is in a protocol, every protocol method is called
    somewhere (they list exactly what the driver asks), and no module outside the allowed
    ones imports Ray or calls ``.remote``."""
    known = set(methods(StageActor)) | set(methods(SiteStoreActor))
    used: set[str] = set()
    for path in sorted(CONTROL.glob("*.py")):
        tree = ast.parse(path.read_text())
        for name, line in _calls(tree):
            assert name in known, f"{path.name}:{line} calls {name}, not in the protocols"
            used.add(name)
        if path.name in MAY_IMPORT_RAY:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                assert not any(m == "ray" or m.startswith("ray.") for m in mods), (
                    f"{path.name}:{node.lineno} imports Ray"
                )
            if isinstance(node, ast.Attribute) and node.attr == "remote":
                raise AssertionError(f"{path.name}:{node.lineno} calls .remote")
    assert used == known


class _RayError(Exception):
    pass


class _RayActorError(_RayError):
    pass


class _RayTaskError(_RayError):
    pass


class _GetTimeoutError(_RayError, TimeoutError):
    pass


class _DiedInCall(_RayTaskError, _RayActorError):
    """What Ray raises when a remote method failed because an actor it called died."""


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    exc = types.ModuleType("ray.exceptions")
    exc.RayActorError, exc.RayTaskError = _RayActorError, _RayTaskError
    exc.GetTimeoutError = _GetTimeoutError
    ray = types.ModuleType("ray")
    ray.exceptions = exc
    box = types.SimpleNamespace(raise_=None)

    def get(refs, timeout=None):
        if box.raise_ is not None:
            raise box.raise_
        return list(refs)

    ray.get = get
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.exceptions", exc)
    return box


@pytest.mark.parametrize(
    "raised,want",
    [
        (_RayActorError("The actor died unexpectedly"), seam.WorkerLost),
        (_RayTaskError("ray::StageWorker.setup()\nRuntimeError: no device"), seam.WorkerFailed),
        (_DiedInCall("ray::SiteStore.save()\nActorDiedError: gone"), seam.WorkerLost),
        (_GetTimeoutError("Get timed out"), seam.CallTimeout),
    ],
    ids=["actor-died", "method-raised", "died-in-a-call-it-made", "timeout"],
)
def test_ray_errors_become_the_seams_with_their_message(fake_ray, raised, want) -> None:
    fake_ray.raise_ = raised
    with pytest.raises(want) as info:
        seam.RayWorkers().get(["ref"])
    assert str(info.value) == str(raised) and info.value.__cause__ is raised


def test_other_errors_pass_through_unchanged(fake_ray) -> None:
    fake_ray.raise_ = err = _RayError("object lost")
    with pytest.raises(_RayError) as info:
        seam.RayWorkers().get(["ref"])
    assert info.value is err
    fake_ray.raise_ = None
    assert seam.RayWorkers().get(["a", "b"]) == ["a", "b"]
