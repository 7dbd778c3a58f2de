"""The pure planning code imports without Ray, DeepSpeed or torch — checked at run time, in
a fresh interpreter (``lint-imports`` checks the same statically, see pyproject.toml)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def heavy_imports(*modules: str) -> list[str]:
    """Which of Ray, DeepSpeed and torch importing ``modules`` loads, in a fresh interpreter."""
    code = (
        f"import json, sys; import {', '.join(modules)}; "
        'print(json.dumps(sorted(m for m in ("ray", "deepspeed", "torch") if m in sys.modules)))'
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_planner_and_cli_import_without_ray_deepspeed_or_torch() -> None:
    assert (
        heavy_imports(
            "geopipe.cli.main",
            "geopipe.config",
            "geopipe.plan",
            "geopipe.model.sizes",
            "geopipe.optimizer.planner",
            "geopipe.optimizer.policies",
            "geopipe.optimizer.instantiate",
            "geopipe.optimizer.refine",
            "geopipe.pipeline.schedule",
            "geopipe.pipeline.partition",
        )
        == []
    )


def test_site_store_and_restore_policy_import_without_torch() -> None:
    """A site's checkpoint store lists, verifies, commits and serves copies as files: it
    starts without importing torch, and the pure restore policy never needs it."""
    assert heavy_imports("geopipe.runtime.storage.sitestore", "geopipe.checkpoint.restore") == []
