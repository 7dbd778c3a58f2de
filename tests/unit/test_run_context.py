"""The run context and the one planning function: the dry run is the launch, measurements
never move the config hash, and the launch-time checks that need no Ray run in a dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from geopipe.cli import main
from geopipe.config import load_cluster, parse_cluster
from geopipe.optimizer.measurements import DeviceSpeed, LinkRate, Measurements, costed
from geopipe.optimizer.runplan import Overrides, plan_run
from geopipe.runtime.control import controller as controller_module
from geopipe.runtime.control.context import RunContext
from geopipe.runtime.control.controller import Controller, LaunchOptions

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "clusters" / "local-2dc.yaml"


def _local() -> dict:
    return yaml.safe_load(LOCAL.read_text())


def _write(tmp_path: Path, doc: dict, name: str = "c.yaml") -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc))
    return str(p)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_refuses_a_missing_data_directory_and_starts_nothing(tmp_path, capsys) -> None:
    doc = _local()
    missing = tmp_path / "no-such-dataset"
    doc["training"]["data"] = str(missing)
    doc["training"]["run_dir"] = str(tmp_path / "run")
    code, out, err = run(capsys, "launch", _write(tmp_path, doc), "--dry-run")
    assert code == 2
    assert "training.data" in err and str(missing) in err
    assert "Traceback" not in err and "valid and plannable" not in out
    assert not (tmp_path / "run").exists()


def test_dry_run_refuses_a_run_dir_a_live_run_holds(tmp_path, capsys) -> None:
    doc = _local()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    doc["training"]["run_dir"] = str(run_dir)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run_dir / "status.json").write_text(json.dumps({"pid": live.pid, "state": "running"}))
        code, _, err = run(capsys, "launch", _write(tmp_path, doc), "--dry-run")
        assert code == 2 and f"pid {live.pid}" in err and str(run_dir) in err
    finally:
        live.kill()
        live.wait()
    # the same status file of a run that has ended holds nothing
    (run_dir / "status.json").write_text(json.dumps({"pid": live.pid, "state": "running"}))
    code, out, _ = run(capsys, "launch", _write(tmp_path, doc), "--dry-run")
    assert code == 0 and "valid and plannable" in out


def test_dry_run_shows_the_mix_the_launch_runs(tmp_path, capsys) -> None:
    """3 devices in one site and 2 in the other: the dry run prints the mixed layout the
    launch runs (plan_run's), not the planner's identical pipelines."""
    doc = _local()
    doc["sites"][1]["devices_per_node"] = 3
    rp = plan_run(parse_cluster(doc, "uneven"))
    assert rp.mixed and rp.plan.heterogeneous
    code, out, _ = run(capsys, "launch", _write(tmp_path, doc), "--dry-run")
    assert code == 0 and "launch runs a mix of pipeline templates" in out
    for r, p in enumerate(rp.plan.mix):
        assert f"pipeline {r}: {len(p.stage_sites)} stages over {' → '.join(p.stage_sites)}" in out


@pytest.mark.parametrize("path", sorted((ROOT / "clusters").glob("*.yaml")), ids=lambda p: p.stem)
def test_overrides_are_the_settings_not_the_identity(path: Path) -> None:
    spec = load_cluster(path)
    ctx = RunContext(spec, Overrides(steps=3, schedule="1f1b"))
    assert ctx.settings.training.steps == 3 and ctx.settings.plan.schedule == "1f1b"
    assert ctx.config_hash == spec.digest == RunContext(spec).config_hash
    assert spec.training.steps != 3 or spec.plan.schedule != "1f1b"  # the spec is untouched


def test_measurements_price_the_plan_but_never_move_the_config_hash() -> None:
    spec = parse_cluster(_local(), "t")
    src, dst = spec.links[0].src, spec.links[0].dst
    slow = Measurements(
        devices={s.name: DeviceSpeed(0.01, 2.5) for s in spec.sites},
        links=(LinkRate(src, dst, 0.2, 1e6),),
        codecs={s.name: {"int8": 0.5} for s in spec.sites},
    )
    priced = costed(spec, slow)
    assert priced.sites[0].device_efficiency == 0.01
    assert priced.link(src, dst).latency_s == pytest.approx(0.2)
    assert priced.link(dst, src).bandwidth_bps == pytest.approx(1e6)  # the mirrored entry
    assert spec.sites[0].device_efficiency != 0.01  # the loaded spec is never patched
    ctx = RunContext(spec).measured(slow)
    assert ctx.config_hash == spec.digest and ctx.priced.digest != spec.digest
    fast, slowed = plan_run(spec), plan_run(spec, slow)
    assert slowed.predicted.iteration_time_s > 2 * fast.predicted.iteration_time_s


def test_two_launches_measuring_differently_record_one_config_hash(tmp_path, monkeypatch):
    """The Planning state with the machine's measurement injected at its seam: the plans'
    predictions differ with the measured speed, the manifests' config hashes do not."""
    doc = _local()
    doc["plan"]["calibrate"] = True
    spec = parse_cluster(doc, "t")
    manifests, predicted = [], []
    for eff in (0.5, 0.05):
        got = Measurements(devices={s.name: DeviceSpeed(eff, 2.0) for s in spec.sites})
        monkeypatch.setattr(controller_module, "measure_before_planning", lambda *a, m=got: m)
        ctl = Controller(spec, LaunchOptions(run_dir=str(tmp_path / f"r{eff}"), progress=False))
        state = ctl._step(ctl.state)
        assert state.name == "launching" and ctl.ctx.measurements == got
        manifests.append(ctl._manifest(0))
        predicted.append(ctl.predicted.iteration_time_s)
        ctl.reporter.close()
    assert manifests[0]["config_hash"] == manifests[1]["config_hash"] == spec.digest
    assert predicted[1] > 2 * predicted[0]


def test_the_controller_starts_in_planning_and_plans_with_plan_run(tmp_path, monkeypatch):
    doc = _local()
    doc["sites"][1]["devices_per_node"] = 3
    spec = parse_cluster(doc, "uneven")
    monkeypatch.setattr(controller_module, "measure_before_planning", lambda *a: Measurements())
    ctl = Controller(spec, LaunchOptions(run_dir=str(tmp_path / "r"), progress=False, steps=4))
    assert ctl.state.name == "planning" and ctl.plan is None
    ctl.state = ctl._step(ctl.state)
    want = plan_run(spec, overrides=Overrides(steps=4))
    assert ctl.plan.to_dict() == want.plan.to_dict() and ctl.plan.heterogeneous
    assert ctl.spec.training.steps == 4 and ctl.ctx.spec.training.steps == spec.training.steps
    ctl.reporter.close()
    assert os.environ.get("RAY_AUTH_MODE") is not None  # set before anything imports ray


@pytest.mark.parametrize("path", sorted((ROOT / "clusters").glob("*.yaml")), ids=lambda p: p.stem)
def test_geopipe_plan_shows_the_plan_launch_runs(path: Path, capsys) -> None:
    """`geopipe plan --json` and the one planning function launch calls agree on every
    shipped cluster (its launch-time mix, its strategy's outer loop included)."""
    assert main(["plan", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rp = plan_run(load_cluster(path), strict=False)
    want = rp.outer.plan if rp.outer is not None else rp.plan
    if rp.outer is None:
        assert doc["plan"] == json.loads(json.dumps(want.to_dict()))
    else:  # the table's chosen row carries the groups' plans
        chosen = doc["strategy"]["chosen"]
        assert [g["plan"]["stage_sites"] for g in chosen["group_plans"]] == [
            list(want.mix[want.groups.index(g)].stage_sites) for g in range(want.num_groups)
        ]
