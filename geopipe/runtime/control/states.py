"""The controller's states: one type per state, carrying what that state needs.

``name`` is what ``status.json`` (and ``geopipe status``) shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from geopipe.optimizer.policies import GrowBack

__all__ = [
    "TERMINAL",
    "Checkpointing",
    "Failed",
    "Finished",
    "Growing",
    "Interrupted",
    "Launching",
    "Planning",
    "Recovering",
    "Running",
    "State",
    "Waiting",
]


@dataclass(frozen=True)
class Planning:
    name: ClassVar[str] = "planning"


@dataclass(frozen=True)
class Launching:
    name: ClassVar[str] = "launching"


@dataclass(frozen=True)
class Running:
    name: ClassVar[str] = "running"
    step: int


@dataclass(frozen=True)
class Waiting:
    """Running, but a site has gone silent mid-step (a WAN outage or partition): the step
    waits for the link up to ``health.wan_outage_s`` (shown in status.json; the state
    machine never transitions into it — the step in flight stays Running)."""

    name: ClassVar[str] = "waiting"
    step: int


@dataclass(frozen=True)
class Recovering:
    name: ClassVar[str] = "recovering"
    step: int  # the step that failed
    error: BaseException
    refs: list  # that step's calls, one per actor


@dataclass(frozen=True)
class Growing:
    name: ClassVar[str] = "growing"
    step: int
    decision: GrowBack


@dataclass(frozen=True)
class Checkpointing:
    name: ClassVar[str] = "checkpointing"
    step: int
    final: bool = False  # the run ends after this save
    interrupted: bool = False  # … because of Ctrl-C


@dataclass(frozen=True)
class Finished:
    name: ClassVar[str] = "finished"


@dataclass(frozen=True)
class Interrupted:
    name: ClassVar[str] = "interrupted"


@dataclass(frozen=True)
class Failed:
    name: ClassVar[str] = "failed"


State = (
    Planning
    | Launching
    | Running
    | Waiting
    | Recovering
    | Growing
    | Checkpointing
    | Finished
    | Interrupted
    | Failed
)
TERMINAL = (Finished, Interrupted, Failed)
