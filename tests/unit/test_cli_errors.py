"""Every command ends with exit 0, or 2 and a message naming the cause — never a traceback;
a genuine bug is exit 1 with "internal error"; --json is strict JSON; the tables tell the
truth (infeasible baselines marked, one row per schedule); ``launch --dry-run``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from geopipe.cli import main
from geopipe.cli.render import json_text

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "clusters" / "local-2dc.yaml"


def strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _write(tmp_path: Path, doc: Any, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _local() -> dict:
    return yaml.safe_load(LOCAL.read_text())


# The classes the issue saw end in a traceback, each through every command that reads a file.
def _bad_docs() -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    doc = _local()
    doc["model"]["n_layer"] = 10**400
    out["huge-int"] = (doc, "model.n_layer: must be an integer in [1, 10000]")
    doc = _local()
    doc["sites"][0]["device_tflops"] = math.inf
    out["inf-tflops"] = (doc, "sites[0].device_tflops: must be a finite number")
    doc = _local()
    doc["sites"][1]["device_tflops"] = 1e300
    out["absurd-tflops"] = (doc, "sites[1].device_tflops: must be a finite number")
    doc = _local()
    doc["links"][0]["latency_ms"] = math.inf
    out["inf-link"] = (doc, "links[0].latency_ms: must be a finite number")
    doc = _local()
    doc["plan"]["ga"]["crossover_prob"] = 0.9
    out["ga-probs"] = (doc, "plan.ga: crossover_prob (0.9) + mutation_prob (0.3)")
    doc = _local()
    doc["sites"][0]["intra_latency_ms"] = math.inf
    out["inf-intra"] = (doc, "sites[0].intra_latency_ms: must be a finite number")
    return out


COMMANDS = [
    ["plan"],
    ["plan", "--json"],
    ["plan", "--templates"],
    ["simulate", "--micro-batch-size", "1", "--seq-len", "128", "--json"],
    ["launch", "--dry-run"],
]


@pytest.mark.parametrize("case", sorted(_bad_docs()))
@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c))
def test_bad_input_exits_2_naming_the_field(tmp_path, capsys, case: str, cmd: list[str]):
    doc, want = _bad_docs()[case]
    path = _write(tmp_path, doc)
    code, _, err = run(capsys, cmd[0], path, *cmd[1:])
    assert code == 2
    assert f"{path}: {want}" in err


def test_not_utf8_exits_2_with_the_offset(tmp_path, capsys) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(LOCAL.read_bytes().replace(b"east", b"\xe9ast", 1))
    code, _, err = run(capsys, "plan", str(path))
    assert code == 2 and "not UTF-8 text: byte 0xe9 at offset" in err


@pytest.mark.parametrize(
    "args",
    [
        ["--delta-n", "abc"],
        ["--delta-n", "-1"],
        ["--codec", "zip"],
        ["--micro-batch-size", "0"],
        ["--pipelines", "99"],
        ["--seq-len", "99999"],
        ["--delta-n", "1,2,3"],
        ["--micro-batch-size", "3"],
    ],
)
def test_simulate_bad_settings_exit_2(capsys, args: list[str]) -> None:
    base = {"--micro-batch-size": "1", "--seq-len": "128"}
    for k, v in zip(args[::2], args[1::2], strict=True):
        base[k] = v
    code, _, err = run(capsys, "simulate", str(LOCAL), *[x for kv in base.items() for x in kv])
    assert code == 2 and err.strip()


def test_genuine_bug_is_an_internal_error_not_a_traceback(capsys, monkeypatch) -> None:
    import geopipe.optimizer.runplan as runplan

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(runplan, "plan_cluster", broken)
    code, _, err = run(capsys, "plan", str(LOCAL))
    assert code == 1
    assert "geopipe plan: internal error: RuntimeError: boom" in err
    assert "report" in err and "GEOPIPE_DEBUG=1" in err
    monkeypatch.setenv("GEOPIPE_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(["plan", str(LOCAL)])


def test_exhaustive_search_too_large_exits_2(capsys) -> None:
    code, _, err = run(capsys, "plan", str(ROOT / "clusters" / "worldwide-64.yaml"), "--exhaustive")
    assert code == 2 and "exhaustive search over" in err and "not practical" in err


def test_unwritable_output_file_exits_2(tmp_path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "trace.json"  # a directory that cannot exist
    code, _, err = run(capsys, "plan", str(LOCAL), "--trace", str(target))
    assert code == 2 and str(blocker) in err


def test_damaged_status_file_exits_2(tmp_path, capsys) -> None:
    (tmp_path / "status.json").write_text('{"run": "x", "step": ')
    code, _, err = run(capsys, "status", str(tmp_path))
    assert code == 2 and "not a readable status file" in err


# --------------------------------------------------------------------------------------------
# Strict JSON, honest tables, dry run


def test_json_text_has_no_nan_or_infinity() -> None:
    doc = {"a": math.inf, "b": [1.0, -math.inf, math.nan], "c": {"d": 2.5}}
    assert strict_json(json_text(doc)) == {"a": None, "b": [1.0, None, None], "c": {"d": 2.5}}


def test_plan_that_cannot_run_prints_strict_json_and_a_reason(tmp_path, capsys) -> None:
    # topk cannot index messages above 2**31 elements: every plan of this model is unusable,
    # its time infinite — the JSON must still parse, the table must say why.
    site = {"nodes": 1, "devices_per_node": 1, "device_memory_gb": 10**5, "device_tflops": 100}
    doc = {
        "name": "giant",
        "sites": [{"name": "a", **site}, {"name": "b", **site}],
        "links": [{"from": "a", "to": "b", "bandwidth_gbps": 10, "latency_ms": 5, "codec": "topk"}],
        "model": {"n_layer": 2, "n_embd": 65536, "n_head": 64, "max_seq_len": 65536},
        "training": {"global_batch_size": 1, "steps": 1, "lr": 1e-4},
        "plan": {"micro_batch_size": 1, "delta_n": 0, "codecs": ["topk"]},
    }
    path = _write(tmp_path, doc)
    code, out, _ = run(capsys, "plan", path, "--json")
    assert code == 0
    best = strict_json(out)["best"]
    assert best["iteration_time_s"] is None and not best["feasible"]
    assert "topk cannot encode" in best["reason"]
    code, out, _ = run(capsys, "plan", path)
    assert code == 0 and "no plan can run" in out and "topk cannot encode" in out


def test_infeasible_baseline_is_marked_with_the_reason(tmp_path, capsys) -> None:
    doc = _local()
    for s in doc["sites"]:
        s["device_memory_gb"] = 0.03  # look-ahead fits (0.017 GiB), GPipe (0.04) does not
    code, out, _ = run(capsys, "plan", _write(tmp_path, doc))
    assert code == 0
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if "│" in line}
    assert rows["gpipe"].split("│")[-2].strip() == "no"  # the "fits" column
    assert rows["look-ahead"].split("│")[-2].strip() == "yes"
    assert "gpipe: infeasible: peak 0.0419 GiB > 0.03 GiB device memory (stage 1)" in out


def test_each_schedule_is_compared_once(tmp_path, capsys) -> None:
    doc = _local()
    doc["plan"]["schedule"] = "1f1b"
    code, out, _ = run(capsys, "plan", _write(tmp_path, doc))
    assert code == 0
    table = out[out.index("predicted iteration") : out.index("codecs compared")]
    rows = [line.split("│")[1].strip() for line in table.splitlines() if line.count("│") > 2]
    names = [r for r in rows if r and r != "schedule"]
    assert sorted(names) == ["1f1b", "gpipe"]


def test_launch_dry_run_plans_and_starts_nothing(capsys) -> None:
    code, out, _ = run(capsys, "launch", str(LOCAL), "--dry-run", "--steps", "5")
    assert code == 0
    assert "local-2dc" in out and "look-ahead" in out
    assert "dry run: local-2dc is valid and plannable; nothing was started" in out
    assert "plan.calibrate" in out  # the embedded cluster would time this machine first


def test_launch_dry_run_without_a_feasible_plan_exits_2(tmp_path, capsys) -> None:
    doc = _local()
    for s in doc["sites"]:
        s["device_memory_gb"] = 0.005  # the weights fit, no schedule's activations do
    code, _, err = run(capsys, "launch", _write(tmp_path, doc), "--dry-run")
    assert code == 2 and "no feasible plan for local-2dc" in err


def test_status_and_launch_agree_a_process_of_another_user_is_alive(
    tmp_path, capsys, monkeypatch
) -> None:
    """`geopipe status` and the launch preflight read EPERM (a process this user cannot
    signal) the same way: alive, so neither calls another user's live run ended."""
    import os

    from geopipe.runtime.control.preflight import pid_alive

    def kill(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    (tmp_path / "status.json").write_text('{"run": "x", "step": 3, "pid": 4242, "state": "x"}')
    monkeypatch.setattr(os, "kill", kill)
    assert pid_alive(4242)
    code, out, _ = run(capsys, "status", "--json", str(tmp_path))
    assert code == 0 and '"state": "running"' in out


def test_gpus_per_actor_defaults_and_refusal() -> None:
    """One GPU per actor when the cluster has them, else CPU; a fraction shares a GPU; asking
    for more GPUs than the cluster has is refused naming ray.gpus_per_actor."""
    from geopipe.config import load_cluster
    from geopipe.runtime.control.cluster import LaunchError, gpus_per_actor

    spec = load_cluster(LOCAL)
    assert gpus_per_actor(spec, {"GPU": 4}, 4) == 1.0
    assert gpus_per_actor(spec, {"GPU": 1}, 2) == 0.0
    assert gpus_per_actor(spec, {}, 2) == 0.0
    shared = spec.model_copy(update={"ray": spec.ray.model_copy(update={"gpus_per_actor": 0.5})})
    assert gpus_per_actor(shared, {"GPU": 1}, 2) == 0.5
    assert shared.digest == spec.digest  # how devices are shared changes no number
    with pytest.raises(LaunchError, match=r"ray\.gpus_per_actor"):
        gpus_per_actor(shared, {"GPU": 1}, 4)


def test_status_shows_the_launchs_set_overrides(tmp_path, capsys) -> None:
    """A launch's --set overrides are recorded in status.json and printed by geopipe status."""
    from geopipe.runtime.control.history import RunHistory
    from geopipe.runtime.control.reporting import Reporter

    r = Reporter("x", tmp_path, 10, RunHistory())
    r.sets = ["training.lr=1e-4", "plan.pipelines=2"]
    plan = main_plan()
    r.status("running", 3, plan, [])
    doc = json.loads((tmp_path / "status.json").read_text())
    assert doc["set"] == ["training.lr=1e-4", "plan.pipelines=2"]
    code, out, _ = run(capsys, "status", str(tmp_path))
    assert code == 0 and "--set training.lr=1e-4 --set plan.pipelines=2" in out


def main_plan():
    from geopipe.config import load_cluster
    from geopipe.optimizer.runplan import plan_run

    return plan_run(load_cluster(LOCAL)).plan
