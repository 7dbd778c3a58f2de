"""Where a run resumes or a recovery restores from: the checkpoint ``--resume`` names (with
the lineage of runs it belongs to, found by :func:`find_resume` at launch), the newest one a
recovery can restore, and that one ready to load, each site reading its own copy. The
coordinator (:mod:`.checkpointing`) finds the latter two and loads them all."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geopipe.checkpoint.lineage import config_refusal, previous_launch, resume_lineage
from geopipe.checkpoint.store import (
    CheckpointError,
    check_compatible,
    latest_complete,
    load_checkpoint,
)
from geopipe.runtime.control.cluster import LaunchError
from geopipe.runtime.control.models import model_shape

if TYPE_CHECKING:
    from geopipe.runtime.control.checkpointing import CheckpointCoordinator

__all__ = ["Found", "RestoreFrom", "ResumePoint", "find_resume"]


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from."""

    path: str
    step: int
    data_digest: str | None  # sha256 of the corpus it was trained on
    run_id: str | None = None  # the run that wrote it (None: before runs had ids)
    lineage: dict | None = None  # that run's own lineage (run id -> newest usable step)

    def lineage_for(self, run_id: str) -> dict[str, int | None]:
        """The lineage of a run resuming from here: its own checkpoints, and its ancestors'
        (this one's run included) up to the step it resumes from."""
        out: dict[str, int | None] = {}
        for rid, cap in (self.lineage or {}).items():
            out[rid] = self.step if cap is None else min(int(cap), self.step)
        out[self.run_id or ""] = self.step
        out[run_id] = None
        return out


@dataclass(frozen=True)
class Found:
    """The newest checkpoint a recovery can restore (``site``: where its copy is read from,
    None for the shared directory)."""

    step: int
    site: str | None
    handle: Any  # CheckpointInfo (shared) or Restorable (per-site copies)


@dataclass(frozen=True)
class RestoreFrom:
    """A checkpoint ready to load: each site's actors read ``paths[site]``."""

    step: int
    paths: dict[str, str]
    site: str | None  # where it was found (None: the shared directory)

    @property
    def name(self) -> str:
        return Path(next(iter(self.paths.values()))).name


# -- what --resume names ([Note: resuming a lineage]) ----------------------------------------
def find_resume(
    ck: CheckpointCoordinator, resume: str | bool, run_id: str | None = None
) -> ResumePoint | None:
    """The checkpoint ``--resume`` names (True: the newest complete one of the lineage of
    the last launch in the run directory), checked against the run's model and settings;
    ``ck``: the run's checkpoint coordinator (where its checkpoints are, what it skips)."""
    if not resume:
        return None
    path = _newest_of_lineage(ck, run_id) if resume is True else Path(resume)
    try:
        ckpt = load_checkpoint(path)
        check_compatible(ckpt.manifest, model_shape(ck.spec))
    except CheckpointError as exc:
        raise LaunchError(f"--resume: {exc}") from None
    m = ckpt.manifest
    refusal = config_refusal(m, path, ck.trajectory, run_id)
    if refusal is not None and resume is True:
        raise LaunchError(f"--resume: {refusal}")
    if refusal is not None:  # named by hand: the user's choice, said once
        ck.reporter.say(f"--resume {path}: other settings than the checkpoint's run")
    lineage = m.get("lineage") if isinstance(m.get("lineage"), dict) else None
    writer = m.get("run_id") if isinstance(m.get("run_id"), str) else None
    return ResumePoint(str(path), ckpt.step, m.get("data", {}).get("digest"), writer, lineage)


def _newest_of_lineage(ck: CheckpointCoordinator, run_id: str | None) -> Path:
    """The newest verified checkpoint ``--resume`` may continue from (newer corrupt or
    incomplete ones skipped and said); the error names what is there instead."""
    last = previous_launch(ck.run_dir)
    lineage = resume_lineage(last)
    if ck.copies is not None:
        found = ck.copies.find_latest(lineage)
        for p, reason in found[1] if found is not None else []:
            ck.skip(p, reason)
        path = found[0] if found is not None else None
    elif ck.root.is_dir():
        info = latest_complete(ck.root, on_skip=ck.skip, lineage=lineage)
        path = info.path if info is not None else None
    else:
        raise LaunchError(f"--resume: no checkpoint directory {ck.root}")
    if path is not None:
        return path
    if lineage is None or last is None:
        raise LaunchError(f"--resume: no complete checkpoint under {ck.where()}")
    others = _other_runs_newest(ck)
    there = (
        f"; run {others[1]}'s {others[0].name} is there: name it to resume from it "
        f"(--resume {others[0]})"
        if others is not None
        else ""
    )
    raise LaunchError(
        f"--resume: no complete checkpoint of run {last.run_id} (the last launch in "
        f"{ck.run_dir}, lineage {sorted(lineage)}) under {ck.where()}{there}"
    )


def _other_runs_newest(ck: CheckpointCoordinator) -> tuple[Path, str] | None:
    """The newest complete checkpoint of any run (for the refusal's message)."""
    roots = [Path(r) for r in ck.copies.roots().values()] if ck.copies else [ck.root]
    best = None
    for root in roots:
        if root.is_dir():
            info = latest_complete(root, on_skip=lambda p, r: None)
            if info is not None and (best is None or info.step > best.step):
                best = info
    return None if best is None else (best.path, best.run_id or "(no run id)")
