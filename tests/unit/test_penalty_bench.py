"""The writer of the loss-penalty table (benchmarks/outer_penalty.py): its multi-seed rows,
the bounded grid and the merge into an existing table, without training anything."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from geopipe.optimizer.penalty import parse_table
from geopipe.outer import StreamingSchedule

# Loaded by path, not through sys.path: benchmarks/ holds modules (models, trainer, ...)
# whose names would shadow others' for the rest of the session.
_SPEC = importlib.util.spec_from_file_location(
    "outer_penalty_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "outer_penalty.py"
)
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = bench  # dataclasses look their module up while the class is made
_SPEC.loader.exec_module(bench)


def _row(h: int, gap: float, seed: int | None = None, **extra) -> dict:
    r = {"replicas": 2, "h": h, "fragments": 1, "codec": "int8", "rel_gap": gap, **extra}
    return r if seed is None else {**r, "seed": seed}


def test_the_bounded_grid_is_the_planners_bounded_candidates() -> None:
    grid = bench.bounded_grid(1.0, 0.0)
    got = {(s.h, s.fragments, s.overlap) for s in grid}
    f1 = {(h, 1, 0) for h in (2, 5, 10, 25, 50, 100)}
    assert got == f1 | {(10, 5, 1), (25, 5, 4), (50, 5, 4), (100, 5, 4)}
    assert len(grid) == len(got) == 10
    for s in grid:
        assert (s.replicas, s.codec, s.outer_lr, s.outer_momentum) == (2, "int8", 1.0, 0.0)
        StreamingSchedule(s.h, s.fragments, s.overlap)  # torchft's constraints hold


@pytest.mark.parametrize("bad", ["-1", "0,0", "a", ""])
def test_seeds_must_be_distinct_non_negative_integers(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="non-negative"):
        bench.seed_list(bad)
    assert bench.seed_list("0,1,7") == [0, 1, 7]


def test_a_merged_grid_keeps_other_seeds_and_replaces_its_own(tmp_path: Path) -> None:
    # A table of the first format: sync losses a list (seeds 0, 1), rows without seed or
    # outer optimizer (seed 0, DiLoCo's 0.7 / 0.9).
    path = tmp_path / "t.json"
    doc = {"steps": 600, "tokens_per_step": 1024, "sync_loss": [3.1, 3.0]}
    path.write_text(json.dumps({**doc, "rows": [_row(10, 0.05), _row(50, 0.02)]}))
    data = bench.Data(None, None, 16, 64, 600)  # type: ignore[arg-type]
    old = bench.old_table(path, data)
    assert old["sync_loss"] == {0: 3.1, 1: 3.0}
    assert all(r["seed"] == 0 and r["outer_lr"] == 0.7 for r in old["rows"])
    o = {"outer_lr": 0.7, "outer_momentum": 0.9}
    new = [_row(10, 0.04, 0, **o), _row(10, 0.01, 1, **o), _row(10, 0.03, 2, **o)]
    rows = bench.merged_rows(old["rows"], new)
    assert sorted((r["h"], r["seed"], r["rel_gap"]) for r in rows) == [
        (10, 0, 0.04),  # seed 0's H = 10 replaced, H = 50 kept, seeds 1 and 2 added
        (10, 1, 0.01),
        (10, 2, 0.03),
        (50, 0, 0.02),
    ]
    # what the planner reads of it: H = 10 is the mean of its three seeds
    p = parse_table({"rows": rows}).predict(2, 10, 1, "int8")
    assert p.value == pytest.approx(0.08 / 3) and "(3 seeds)" in p.basis


def test_a_table_of_other_steps_is_not_merged_into(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"steps": 20, "tokens_per_step": 1024, "rows": [_row(10, 0.1)]}))
    with pytest.raises(SystemExit) as info:
        bench.old_table(path, bench.Data(None, None, 16, 64, 600))  # type: ignore[arg-type]
    assert info.value.code == 2 and f"--out {path}" in capsys.readouterr().err


def test_sync_noise_is_the_largest_relative_spread() -> None:
    assert bench.sync_noise({0: 3.12263, 1: 3.07796, 2: 3.0697}) == pytest.approx(
        (3.12263 - 3.0697) / 3.0697
    )
    assert bench.sync_noise({0: 3.1}) == 0.0
