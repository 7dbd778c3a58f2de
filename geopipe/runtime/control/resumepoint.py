"""Where a run resumes or a recovery restores from: the checkpoint ``--resume`` names (with
the lineage of runs it belongs to), the newest one a recovery can restore, and that one
ready to load, each site reading its own copy. Plain records, apart from the coordinator
(:mod:`.checkpointing`) that finds and loads them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Found", "RestoreFrom", "ResumePoint"]


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
