"""The light commands stay light: ``geopipe status``, ``--help`` and ``plan`` never import
torch (~2 s of CPU on every call). Each runs in a fresh interpreter, so the real import
chain — the command's own function-level imports included — is what is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_RUN = """
import contextlib, io, sys
from geopipe.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
assert code == 0, (code, out.getvalue())
heavy = sorted(m for m in ("torch", "ray", "deepspeed") if m in sys.modules)
assert not heavy, heavy
print("light")
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "{run}", "--json"],
        ["--help"],
        ["plan", str(ROOT / "clusters" / "local-2dc.yaml"), "--json"],
    ],
    ids=["status", "help", "plan"],
)
def test_light_commands_import_no_torch(tmp_path, argv: list[str]) -> None:
    (tmp_path / "status.json").write_text('{"run": "r", "step": 3, "pid": 0, "state": "finished"}')
    args = [a.format(run=tmp_path) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "light", proc.stderr[-2000:]
