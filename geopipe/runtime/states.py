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
    Planning | Launching | Running | Recovering | Growing | Checkpointing | Finished
    | Interrupted | Failed
)  # fmt: skip
TERMINAL = (Finished, Interrupted, Failed)
