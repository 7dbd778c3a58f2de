"""The house rules that keep modules readable: no module under ``geopipe/`` over 600 lines,
no function over 80 — the simulator's replay loop excepted (one event loop, kept whole so
its invariants read in one place)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXCEPTED = {("geopipe/optimizer/simulator.py", "replay")}


def test_modules_and_functions_stay_small() -> None:
    long_files, long_funcs = [], []
    for path in sorted((ROOT / "geopipe").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        if text.count("\n") > 600:
            long_files.append((rel, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80 and (rel, node.name) not in EXCEPTED:
                    long_funcs.append((rel, node.name, lines))
    assert not long_files, long_files
    assert not long_funcs, long_funcs
