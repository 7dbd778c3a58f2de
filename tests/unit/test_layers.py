"""The pure planning code imports without Ray, DeepSpeed or torch — checked at run time, in
a fresh interpreter (``lint-imports`` checks the same statically, see pyproject.toml)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys
import geopipe.cli.main, geopipe.config, geopipe.plan, geopipe.model.sizes
import geopipe.optimizer.planner, geopipe.optimizer.policies, geopipe.optimizer.instantiate
import geopipe.optimizer.refine, geopipe.pipeline.schedule, geopipe.pipeline.partition
print(json.dumps(sorted(m for m in ("ray", "deepspeed", "torch") if m in sys.modules)))
"""


def test_planner_and_cli_import_without_ray_deepspeed_or_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


_STORE_CHILD = """
import json, sys
import geopipe.runtime.storage.sitestore, geopipe.checkpoint.restore
print(json.dumps(sorted(m for m in ("ray", "deepspeed", "torch") if m in sys.modules)))
"""


def test_site_store_and_restore_policy_import_without_torch() -> None:
    """A site's checkpoint store lists, verifies, commits and serves copies as files: it
    starts without importing torch, and the pure restore policy never needs it."""
    out = subprocess.run(
        [sys.executable, "-c", _STORE_CHILD], capture_output=True, text=True, cwd=ROOT,
        check=True,
    )  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
