"""The run's history: what failed, how it was recovered, when devices came back.

The controller owns it; :class:`~geopipe.runtime.control.recovery.Recovery` writes into the
one it is given at construction, the reporter shows it in status.json, and the grow-back
decision reads it from here, not from what the progress reporter happened to print.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RunHistory"]


@dataclass
class RunHistory:
    recoveries: list[dict] = field(default_factory=list)  # seconds, step, failed_step
    growbacks: list[dict] = field(default_factory=list)  # seconds, step, pipelines

    def recovered(self, seconds: float, step: int, failed_step: int) -> None:
        self.recoveries.append({"seconds": seconds, "step": step, "failed_step": failed_step})

    def grown(self, seconds: float, step: int, pipelines: int) -> None:
        self.growbacks.append({"seconds": seconds, "step": step, "pipelines": pipelines})

    @property
    def lost_devices(self) -> bool:
        """Whether any recovery has run: only then can devices come back to grow onto."""
        return bool(self.recoveries)
