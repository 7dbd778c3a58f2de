"""Which checkpoint ``--resume`` continues from when a directory holds several runs'.

[Note: resuming a lineage] A launch without ``--resume`` moves other runs' checkpoints
aside, but a directory can still hold several runs' (a run resumed from another's early
step shares its directory and keeps the parent's later checkpoints, and a per-site or
explicit ``training.checkpoint.dir`` may be shared by run directories). ``--resume``
therefore continues the *last launch in the run directory*: its run id, lineage and config
come from that launch's ``status.json`` (or its ``plan`` event in ``metrics.jsonl``), and
only checkpoints of that lineage (:func:`~geopipe.checkpoint.store.accepts`) are
candidates. Run B resumed from A@10 and died before its first save: ``--resume`` takes
A@10 (B's lineage), never A@30.

A candidate written under other training settings is refused unless the user names it with
``--resume PATH`` (the existing flag that picks a checkpoint by hand; there is no second
override). What "other settings" means is :func:`trajectory_hash`: the model and the
optimizer's settings, the numbers a continued run must share to continue the same
training. The config hash itself is not compared: it also changes with what a resume may
change by design — ``training.steps`` (a longer run), the devices and the plan (resuming
onto another partition or replica count), the data (checked on its own, by digest) and
where checkpoints go.

Pure: reads files, imports neither Ray nor torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geopipe.checkpoint.store import Lineage

__all__ = ["Launch", "config_refusal", "previous_launch", "resume_lineage", "trajectory_hash"]

# training keys a resume may change without leaving the run's trajectory (module docstring)
_FREE = {"steps", "data", "data_max_bytes", "run_dir", "checkpoint", "eval", "recompute"}
_FREE |= {"recovery_snapshots"}


@dataclass(frozen=True)
class Launch:
    """What a run directory says of its last launch."""

    run_id: str
    lineage: dict[str, int | None] | None  # None: not recorded (launched before lineage)


def trajectory_hash(spec: Any) -> str:
    """The digest of what a resumed run must share with the checkpoint's run to continue
    its training: the model and the optimizer settings (``training`` without the keys a
    resume may change: :data:`_FREE`). Recorded in each manifest as ``trajectory_hash``."""
    doc = spec.model_dump(mode="json", by_alias=True, include={"model", "training"})
    for key in _FREE:
        doc["training"].pop(key, None)
    blob = json.dumps(doc, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _plan_event(metrics: Path, run_id: str) -> Mapping[str, Any] | None:
    """The ``plan`` event of ``run_id`` in a metrics file (the last one, if several)."""
    found = None
    try:
        with open(metrics, encoding="utf-8") as f:
            for line in f:
                if '"plan"' not in line or run_id not in line:
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if row.get("event") == "plan" and row.get("run_id") == run_id:
                    found = row
    except OSError:
        return None
    return found


def previous_launch(run_dir: str | Path) -> Launch | None:
    """The last launch in ``run_dir``: from its ``status.json``, completed from the
    ``plan`` event in ``metrics.jsonl`` where the status file predates lineage. None when
    the directory records no launch."""
    run_dir = Path(run_dir)
    status = _read_json(run_dir / "status.json")
    if not isinstance(status, dict) or not isinstance(status.get("run_id"), str):
        return None
    run_id = status["run_id"]
    lineage = status.get("lineage")
    if not isinstance(lineage, dict):
        plan = _plan_event(run_dir / "metrics.jsonl", run_id) or {}
        lineage = plan.get("lineage") if isinstance(plan.get("lineage"), dict) else None
    return Launch(run_id, lineage)


def resume_lineage(last: Launch | None) -> Lineage | None:
    """The checkpoints ``--resume`` may continue from: the last launch's lineage (its own
    checkpoints, and its ancestors' up to where it resumed them); None (any run's, as
    before runs had ids) when the directory records no launch."""
    if last is None:
        return None
    lineage = dict(last.lineage or {})
    lineage.setdefault(last.run_id, None)
    return lineage


def config_refusal(
    manifest: Mapping[str, Any], path: str | Path, trajectory: str, this_run: str | None
) -> str | None:
    """Why ``--resume`` refuses the checkpoint in ``path`` (its ``manifest``) for a launch whose
    :func:`trajectory_hash` is ``trajectory``, naming both runs; None when it may resume
    (the same settings, or a checkpoint written before manifests recorded them)."""
    saved = manifest.get("trajectory_hash")
    if not isinstance(saved, str) or saved == trajectory:
        return None
    writer = manifest.get("run_id") or "(no run id)"
    return (
        f"{Path(path).name} was written by run {writer} with other model or optimizer settings "
        f"(trajectory hash {saved}) than this launch's (run {this_run or '?'}, {trajectory}): "
        f"the YAML's model or training section changed since. To continue from it anyway, "
        f"name it: --resume {path}"
    )
