"""What a run tells the world: ``status.json``, the progress bar, metrics and events.

``status.json`` (read by ``geopipe status``) is replaced atomically at each step and at
each change of state; the metrics file gets one JSON line per step and per event; Ray's
metrics mirror the step figures for the dashboard. None of it may slow a step down
measurably or fail the run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from geopipe.plan import Plan
from geopipe.runtime.control.history import RunHistory
from geopipe.runtime.control.metrics import MetricsSink, StepMetrics, say

__all__ = ["Progress", "Reporter"]


class Progress:
    """A rich progress bar with step, loss, tokens/s and bubble ratio."""

    def __init__(self, total: int, enabled: bool, done: int = 0) -> None:
        self._p: Any = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        # Redrawn once per step, not by rich's 10 Hz refresh thread: on a 2-core machine
        # that thread competes with the stage actors for nothing (no column animates).
        self._p = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            auto_refresh=False,
        )
        self._p.start()
        self._task = self._p.add_task("train", total=total, completed=done, info="")

    def update(self, m: StepMetrics) -> None:
        if self._p is None:
            return
        info = (
            f"loss {m.loss:.4f}  {m.tokens_per_s:,.0f} tok/s  bubble {m.bubble_ratio:.1%}  "
            f"{m.iteration_time_s * 1e3:.0f} ms/step"
        )
        self._p.update(self._task, advance=1, info=info, refresh=True)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None


class Reporter:
    """Status file, metrics sink and progress bar of one run."""

    def __init__(
        self, run: str, run_dir: Path, total_steps: int, history: RunHistory | None = None
    ) -> None:
        self.run = run
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.sink: MetricsSink | None = None
        self.progress: Progress | None = None
        self.dashboard_url: str | None = None
        self.ray_address: str | None = None
        self.history = history or RunHistory()  # the controller's record, shown in status
        self.checkpoint: dict | None = None  # the latest checkpoint: step, copies per site
        self.checkpoint_dirs: dict[str, str] = {}  # site -> its checkpoint directory
        self.run_id: str | None = None  # this launch's identity (checkpoints carry it)
        self.waiting: dict | None = None  # a silent link the step waits for (link, secs)

    def say(self, message: str, warning: bool = False) -> None:
        """Tell the user something (:func:`~geopipe.runtime.control.metrics.say`)."""
        say(message, warning)

    def open(self, metrics_path: Path, ray_metrics: bool = True) -> None:
        """Start the metrics file (and TensorBoard; and Ray's gauges with ``ray_metrics``)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tb = self.run_dir / "tensorboard"
        self.sink = MetricsSink(metrics_path, self.run, use_ray=ray_metrics, tensorboard=tb)

    def silence(
        self, step: int, sites: list[str], event: str, site: str, secs: float, limit: float
    ) -> bool:
        """A site went silent mid-step (a WAN outage or partition, as the driver sees it),
        stays so, or answers again: say which link and for how long, on the console, in the
        metrics and (``waiting``) in status.json. True while the step waits on the link."""
        others = sorted({s for s in sites if s != site}) or ["driver"]
        link = f"{','.join(others)}→{site}"
        if event == "silent":
            self.say(
                f"step {step}: link {link} silent for {secs:.0f} s: waiting up to "
                f"{limit:.0f} s (health.wan_outage_s) before writing site {site} off"
            )
            self.event(
                "link_silent", step=step, link=link, site=site, silent_s=secs, at=time.time()
            )
        if event == "healed":
            self.say(f"step {step}: link {link} answers again after {secs:.0f} s")
            self.event(
                "link_healed", step=step, link=link, site=site, silent_s=secs, at=time.time()
            )
            self.waiting = None
            return False
        self.waiting = {"link": link, "silent_s": round(secs, 1), "limit_s": limit}
        return True

    def event(self, kind: str, **fields: Any) -> None:
        if self.sink is not None:
            self.sink.event(kind, **fields)

    def step(self, m: StepMetrics, predicted_s: float) -> None:
        if self.sink is not None:
            self.sink.write(
                m, {"predicted_iteration_time_s": predicted_s, "completed_at": time.time()}
            )
        if self.progress is not None:
            self.progress.update(m)

    def start_progress(self, enabled: bool, done: int) -> None:
        self.progress = Progress(self.total_steps, enabled, done=done)

    def stop_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def status(self, state: str, step: int, plan: Plan, actors: list[list[str]]) -> None:
        """Replace ``status.json`` with the run's current state (atomically)."""
        doc = {
            "run": self.run,
            "run_id": self.run_id,
            "pid": os.getpid(),
            "state": state,
            "step": step,
            "steps": self.total_steps,
            "dashboard_url": self.dashboard_url,
            "ray_address": self.ray_address,
            "plan": plan.to_dict(),
            "layout": plan.describe(),
            "stages": [
                {
                    "stage": k,
                    "site": plan.stage_sites[k],
                    "layers": list(plan.partition[k]),
                    "actors": actors[k] if k < len(actors) else [],
                }
                for k in range(plan.num_stages)
            ],
            # per pipeline (a mix of templates differs from pipeline to pipeline)
            "pipelines": [
                {
                    "pipeline": r,
                    "microbatches": plan.microbatches_of(r),
                    "stages": [
                        {
                            "site": plan.site_of(k, r),
                            "layers": list(plan.layers_of(k, r)),
                            "actor": actors[k][r]
                            if k < len(actors) and r < len(actors[k])
                            else None,
                        }
                        for k in range(plan.depth(r))
                    ],
                }
                for r in range(plan.pipelines)
            ],
            "recoveries": list(self.history.recoveries),
            "growbacks": list(self.history.growbacks),
            "checkpoint": self.checkpoint,
            "checkpoint_dirs": self.checkpoint_dirs,
            "waiting": self.waiting,
            "updated": time.time(),
        }
        self._write(doc)

    def final_status(self, state: str) -> None:
        """The run ended (``finished``, ``failed``, ``interrupted``): no process serves it."""
        path = self.run_dir / "status.json"
        if not path.exists():
            return
        doc = json.loads(path.read_text())
        doc["state"] = state
        doc["pid"] = None
        self._write(doc)

    def _write(self, doc: dict) -> None:
        tmp = self.run_dir / "status.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.run_dir / "status.json")

    def close(self) -> None:
        self.stop_progress()
        if self.sink is not None:
            self.sink.close()
