"""What a run tells the world: ``status.json``, the progress bar, metrics and events.

``status.json`` (read by ``geopipe status``) is replaced atomically at each step and at
each change of state; the metrics file gets one JSON line per step and per event; Ray's
metrics mirror the step figures for the dashboard. None of it may slow a step down
measurably or fail the run.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from geopipe.config import ClusterSpec
from geopipe.plan import Plan
from geopipe.runtime.control.history import RunHistory
from geopipe.runtime.control.metrics import MetricsSink, StepMetrics, say

__all__ = ["Eta", "Progress", "Reporter"]


class Eta:
    """Time left: the steps left × the median of the last :data:`WINDOW` step intervals.

    Intervals are measured between progress updates (wall time, so a checkpoint or an
    evaluation counts), never from the launch: the first step's compile and warm-up is no
    interval at all, and a median over a window shrugs off the odd slow step. rich's own
    TimeRemainingColumn averages the last 30 s, which on a short run still holds those
    first slow steps."""

    WINDOW = 20

    def __init__(self) -> None:
        self._last: float | None = None
        self._intervals: deque[float] = deque(maxlen=self.WINDOW)

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now

    def seconds(self, remaining: int) -> float | None:
        """Seconds for ``remaining`` more steps; None before two steps have been seen."""
        if not self._intervals:
            return None
        return max(0, remaining) * statistics.median(self._intervals)


def clock(secs: float) -> str:
    """``1:02:03`` / ``2:03``."""
    m, s = divmod(round(secs), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """A rich progress bar: step, loss, tokens/s, bubble ratio, the outer round, the latest
    held-out loss, and the time left."""

    def __init__(self, total: int, enabled: bool, done: int = 0) -> None:
        self._p: Any = None
        self.total, self.done = total, done
        self.eta = Eta()
        self.round: str | None = None  # "round 3/10" of an outer-loop run
        self.evaluated: str | None = None  # the latest evaluation: "eval 3.21 (ppl 24.8)"
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

    def info(self, m: StepMetrics) -> str:
        """The text beside the bar after step ``m`` (also without a bar: tests)."""
        parts = [
            f"loss {m.loss:.4f}",
            f"{m.tokens_per_s:,.0f} tok/s",
            f"bubble {m.bubble_ratio:.1%}",
            f"{m.iteration_time_s * 1e3:.0f} ms/step",
        ]
        parts += [x for x in (self.round, self.evaluated) if x]
        left = self.eta.seconds(self.total - self.done)
        if left is not None:
            parts.append(f"ETA {clock(left)}")
        return "  ".join(parts)

    def update(self, m: StepMetrics) -> None:
        self.done = m.step + 1
        self.eta.tick()
        if self._p is None:
            return
        self._p.update(self._task, completed=self.done, info=self.info(m), refresh=True)

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
        # and its lineage: a later `--resume` in this run directory
        # continues this launch's lineage (geopipe.checkpoint.lineage)
        self.lineage: dict | None = None
        # per-site copies: saves short of the copies promised, sites whose copy is behind
        self.replication: dict | None = None
        self.sets: list[str] = []  # the launch's --set overrides (validated in the spec)
        self.waiting: dict | None = None  # a silent link the step waits for (link, secs)
        self.outer_h: int | None = None  # inner steps per outer round (the plan event's)
        self.outer_fragments = 1  # and the fragments each round streams
        self.latest_round: str | None = None  # "round 3/10", shown on the progress line
        self.latest_eval: str | None = None  # "eval 3.21 (ppl 24.8)"

    def say(self, message: str, warning: bool = False) -> None:
        """Tell the user something (:func:`~geopipe.runtime.control.metrics.say`)."""
        say(message, warning)

    def open(
        self, metrics_path: Path, ray_metrics: bool = True, spec: ClusterSpec | None = None
    ) -> None:
        """Start the metrics file (and TensorBoard; Ray's gauges with ``ray_metrics``; the
        W&B run that ``spec``'s ``logging.wandb`` asks for)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tb = self.run_dir / "tensorboard"
        wandb = None
        if spec is not None and spec.logging.wandb is not None:
            from geopipe.runtime.control.wandb_log import WandbLog

            config = spec.model_dump(mode="json", by_alias=True)
            wandb = WandbLog.start(
                spec.logging.wandb, self.run_dir, self.run_id or self.run, config, self.say
            )
        self.sink = MetricsSink(
            metrics_path, self.run, use_ray=ray_metrics, tensorboard=tb, wandb=wandb
        )

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
        if kind == "plan" and fields.get("outer"):
            self.outer_h = int(fields["outer"]["h"])
            self.outer_fragments = int(fields["outer"].get("fragments", 1))
        elif kind == "outer_round":
            self._shown_round(fields)
        elif kind == "eval":
            self.latest_eval = f"eval {fields['eval_loss']:.4f} (ppl {fields['perplexity']:.4g})"
        if self.progress is not None:
            self.progress.round, self.progress.evaluated = self.latest_round, self.latest_eval

    def _shown_round(self, row: dict) -> None:
        """``round r/R`` once a round's last fragment is applied (``r`` counts from 1)."""
        if row.get("fragment", 0) != self.outer_fragments - 1:
            return
        total = f"/{math.ceil(self.total_steps / self.outer_h)}" if self.outer_h else ""
        self.latest_round = f"round {int(row['round']) + 1}{total}"

    def step(self, m: StepMetrics, predicted_s: float, at: float | None = None) -> None:
        """A finished step's metrics line; ``completed_at`` is ``at`` (when the driver
        received it: one time for every step of a span) or now."""
        if self.sink is not None:
            done = time.time() if at is None else at
            self.sink.write(m, {"predicted_iteration_time_s": predicted_s, "completed_at": done})
        if self.progress is not None:
            self.progress.update(m)

    def start_progress(self, enabled: bool, done: int) -> None:
        self.progress = Progress(self.total_steps, enabled, done=done)
        self.progress.round, self.progress.evaluated = self.latest_round, self.latest_eval

    def stop_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def status(self, state: str, step: int, plan: Plan, actors: list[list[str]]) -> None:
        """Replace ``status.json`` with the run's current state (atomically)."""
        doc = {
            "run": self.run,
            "run_id": self.run_id,
            "lineage": self.lineage,
            "set": self.sets,  # the --set overrides this launch was given
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
            "replication": self.replication,
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
        # the run's last save may have committed (or fallen short) since the last step
        doc["checkpoint"], doc["replication"] = self.checkpoint, self.replication
        self._write(doc)

    def _write(self, doc: dict) -> None:
        tmp = self.run_dir / "status.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.run_dir / "status.json")

    def close(self) -> None:
        self.stop_progress()
        if self.sink is not None:
            self.sink.close()
