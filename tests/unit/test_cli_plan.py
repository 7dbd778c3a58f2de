"""`geopipe plan` and `geopipe simulate`: the user's first commands (no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geopipe.cli import main

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "clusters" / "local-2dc.yaml")
FIELDS = {
    "iteration_time_s",
    "tokens_per_s",
    "bubble_ratio",
    "peak_memory_bytes",
    "micro_batch_size",
    "seq_len",
    "delta_n",
}


def run_json(capsys, *args: str) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_has_best_baselines_and_search(capsys):
    doc = run_json(capsys, "plan", LOCAL, "--json", "--exhaustive")
    assert set(doc["best"]) >= FIELDS
    assert set(doc["baselines"]) == {"1f1b", "gpipe"}
    for b in doc["baselines"].values():
        assert set(b) >= FIELDS
        # Baselines run at the best plan's settings.
        assert (b["micro_batch_size"], b["seq_len"]) == (
            doc["best"]["micro_batch_size"],
            doc["best"]["seq_len"],
        )
        assert b["iteration_time_s"] >= doc["best"]["iteration_time_s"] * (1 - 1e-9)
    s = doc["search"]
    assert s["evaluations"] > 0 and s["seconds"] >= 0
    assert s["exhaustive"]["evaluations"] >= s["evaluations"] or s["method"] == "exhaustive"
    assert s["exhaustive"]["gap"] == pytest.approx(0.0, abs=1e-9)
    assert doc["plan"]["stage_sites"] == ["east", "west"]


def test_plan_table_trace_and_plot(tmp_path, capsys):
    trace, plot = tmp_path / "t.json", tmp_path / "p.png"
    assert main(["plan", LOCAL, "--trace", str(trace), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    for word in ("placement", "look-ahead", "1f1b", "gpipe", "bubble", "peak memory", "ΔN="):
        assert word in out
    events = json.loads(trace.read_text())["traceEvents"]
    rows = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"stage 0", "stage 1", "link 0->1", "link 1->0"} <= rows
    spans = [e for e in events if e.get("ph") == "X"]
    assert any(e["name"].startswith("F") for e in spans) and all(e["dur"] >= 0 for e in spans)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_json_matches_fields_and_orders_schedules(capsys):
    common = ["--micro-batch-size", "1", "--seq-len", "128", "--pipelines", "2", "--json"]
    one = run_json(capsys, "simulate", LOCAL, "--schedule", "1f1b", "--delta-n", "0", *common)
    la = run_json(capsys, "simulate", LOCAL, "--schedule", "lookahead", "--delta-n", "6", *common)
    assert set(one) >= FIELDS and set(la) >= FIELDS
    assert la["delta_n"] == [6] and la["iteration_time_s"] < one["iteration_time_s"]


def test_simulate_bad_setting_is_a_clear_error(capsys):
    code = main(
        ["simulate", LOCAL, "--micro-batch-size", "3", "--seq-len", "128", "--pipelines", "2"]
    )
    assert code == 2
    assert "not divisible" in capsys.readouterr().err


def test_plan_bad_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsites: []\n")
    assert main(["plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: model: required field is missing" in err
    assert "Traceback" not in err
