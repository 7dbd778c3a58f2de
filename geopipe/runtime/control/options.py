"""What a caller hands the controller (:class:`LaunchOptions`) and gets back
(:class:`RunResult`); plain data, re-exported by :mod:`geopipe.runtime.control.controller`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from geopipe.config import HealthSpec
from geopipe.optimizer.evaluate import Evaluation
from geopipe.plan import Plan
from geopipe.runtime.control.metrics import StepMetrics

__all__ = ["LaunchOptions", "RunResult"]


@dataclass
class LaunchOptions:
    steps: int | None = None
    schedule: str | None = None
    run_dir: str | None = None
    metrics_out: str | None = None
    trace: str | None = None
    progress: bool = True
    plan: Plan | None = None  # run this plan instead of searching one
    resume: str | bool = False  # True: newest complete checkpoint of the run; or a path
    chaos_kill_every: int | None = None  # kill a random stage actor every N steps (demo aid)
    checkpoint_sync: bool = False  # write checkpoints synchronously (benchmarks compare)
    health: HealthSpec | None = None  # the control plane's clocks; None: the YAML's
    sets: tuple[str, ...] = ()  # the command line's --set KEY.PATH=VALUE (already in the spec)


@dataclass
class RunResult:
    plan: Plan
    predicted: Evaluation
    steps: list[StepMetrics] = field(default_factory=list)
    run_dir: Path | None = None
    dashboard_url: str | None = None
    actor_names: list[str] = field(default_factory=list)
