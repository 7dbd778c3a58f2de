"""The launch-time checks that need no Ray, run by a launch and by ``launch --dry-run`` alike.

A dry run that says "valid" must mean the launch will not fail on anything this machine can
know: the data (manifest, shards' checksums, vocabulary against the model), the model's
files (read when the YAML is loaded), the precision on this machine's devices, the run
directory (not another live run's; writable), and the paths every node of a real cluster
must find at the same place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from geopipe.config import ClusterSpec
from geopipe.runtime.control.cluster import LaunchError, check_precision

__all__ = ["check_run_dir", "preflight", "shared_paths"]


def preflight(spec: ClusterSpec, run_dir: Path) -> list[str]:
    """Raise :class:`LaunchError` naming the field or path at fault; return notes (what a
    dry run cannot check from here, and what the operator must provide)."""
    # Here, not at the top: models imports torch (~2 s), which `geopipe status` never needs.
    from geopipe.runtime.control.models import check_data_source

    check_data_source(spec)
    check_run_dir(run_dir)
    notes = []
    if spec.ray.address == "local":
        import torch

        check_precision(spec.training.precision, torch.cuda.is_available())
    elif spec.training.precision == "fp16":
        notes.append("training.precision fp16 needs GPUs on the cluster: checked at launch")
    paths = shared_paths(spec)
    if paths and spec.ray.address != "local":
        notes.append(
            "every node must see these paths at the same place (no shared file system is "
            "assumed for checkpoints, but the data and model are read where they are): "
            + ", ".join(f"{field} = {path}" for field, path in paths.items())
        )
    return notes


def check_run_dir(run_dir: Path) -> None:
    """The run directory is not a live run's (its status.json names a process still up on
    this node) and can be created or written."""
    status = run_dir / "status.json"
    try:
        doc = json.loads(status.read_text())
        pid, state = doc.get("pid"), doc.get("state")
    except (OSError, ValueError, AttributeError):
        pid, state = None, None
    mine = not isinstance(pid, int) or pid <= 0 or pid == os.getpid()
    if not mine and state not in _ENDED and pid_alive(pid):
        raise LaunchError(
            f"run dir {run_dir} belongs to a run still going (pid {pid}, see "
            f"`geopipe status {run_dir}`): stop it, or give --run-dir"
        )
    parent = run_dir
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LaunchError(f"run dir {run_dir}: {parent} is not writable by this user")


def shared_paths(spec: ClusterSpec) -> dict[str, str]:
    """The YAML's paths that stage actors open on their own node."""
    out = {}
    if spec.training.data != "stdlib" and Path(spec.training.data).exists():
        out["training.data"] = str(Path(spec.training.data).absolute())
    if spec.model.is_hf:
        out["model.hf"] = str(Path(spec.model.hf).absolute())
    return out


_ENDED = ("finished", "failed", "interrupted")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists: one owned by another user (EPERM) is alive too, so a
    run dir in use by someone else is never taken for free (`geopipe status` agrees)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
