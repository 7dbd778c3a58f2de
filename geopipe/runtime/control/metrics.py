"""Per-step metrics: a JSONL file, Ray metrics for the dashboard, and measured timelines.

The figures come from the stage actors' own clocks: busy time (forward + backward + the
optimizer step, which runs after the step's sends) and the iteration's duration. The
bubble ratio uses the planner's definition, ``1 − Σ_stages busy / (p × iteration)``, with
each stage's busy time averaged over its replicas.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from geopipe.runtime.actor.executor import IterationResult

__all__ = ["MetricsSink", "StepMetrics", "aggregate", "measured_events"]


@dataclass
class StepMetrics:
    step: int
    loss: float
    iteration_time_s: float
    tokens: int
    bubble_ratio: float
    wan_bytes: int
    tokens_per_s: float
    # per stage, where its step time went (seconds, mean over the stage's replicas; the
    # categories are those of ``executor.BREAKDOWN``)
    breakdown: list[dict[str, float]] = field(default_factory=list)
    # per stage, the most bytes autograd held for backward at once (max over its replicas;
    # the activation meter of :mod:`geopipe.runtime.actor.backward`)
    peak_activation_bytes: list[int] = field(default_factory=list)
    lr: float | None = None  # the learning rate this step applied
    # the whole model's gradient norm: the stages' norms (each over its ZeRO-1 group)
    # combined in quadrature; a tied embedding's two copies both count
    grad_norm: float | None = None
    # the worst sampled relative error of a lossy WAN codec, per direction ("forward":
    # activations, "backward": gradients), over every replica that sends across a WAN link
    codec_error: dict[str, float] = field(default_factory=dict)
    # the outer loop's replica groups: each group's mean micro-batch loss (empty with one
    # group: then it is ``loss``)
    group_loss: list[float] = field(default_factory=list)

    def to_json(self) -> dict:
        extra = {"group_loss": self.group_loss} if self.group_loss else {}
        return {
            "step": self.step,
            "loss": self.loss,
            "iteration_time_s": self.iteration_time_s,
            "tokens": self.tokens,
            "bubble_ratio": self.bubble_ratio,
            "wan_bytes": self.wan_bytes,
            "tokens_per_s": self.tokens_per_s,
            "breakdown": [{k: round(v, 6) for k, v in b.items()} for b in self.breakdown],
            "peak_activation_bytes": self.peak_activation_bytes,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "codec_error": self.codec_error,
            **extra,
        }


def aggregate(
    results: list[IterationResult], num_stages: int, tokens: int, groups: tuple[int, ...] = ()
) -> StepMetrics:
    """Combine every replica's ``run_iteration`` result into one step's figures; ``groups``
    (``Plan.groups``: each pipeline's replica group) adds each group's loss."""
    step = results[0].step
    duration = max(r.duration_s for r in results)
    busy: dict[int, list[float]] = {}
    parts: dict[int, list[dict[str, float]]] = {}
    held: dict[int, int] = {}
    for r in results:
        held[r.stage] = max(held.get(r.stage, 0), r.peak_activation_bytes)
        busy.setdefault(r.stage, []).append(r.busy_s)
        parts.setdefault(r.stage, []).append(r.breakdown)
    total_busy = sum(sum(v) / len(v) for v in busy.values())
    losses = [x for r in results for x in r.losses]
    loss = sum(losses) / len(losses) if losses else float("nan")
    bubble = 1.0 - total_busy / (num_stages * duration) if duration > 0 else 0.0
    return StepMetrics(
        step=step,
        loss=loss,
        iteration_time_s=duration,
        tokens=tokens,
        bubble_ratio=bubble,
        wan_bytes=sum(r.wan_bytes for r in results),
        tokens_per_s=tokens / duration if duration > 0 else 0.0,
        breakdown=[_mean_parts(parts[k]) for k in sorted(parts)],
        peak_activation_bytes=[held[k] for k in sorted(held)],
        lr=next((r.lr for r in results if r.lr is not None), None),
        grad_norm=_grad_norm(results),
        codec_error=_codec_error(results),
        group_loss=group_losses(results, groups),
    )


def group_losses(results: list[IterationResult], groups: tuple[int, ...]) -> list[float]:
    """Each replica group's mean micro-batch loss (its pipelines' last stages report the
    losses; a result's ``replica`` is its pipeline); empty unless there are two groups or
    more. Every micro-batch has as many tokens, so the mean is the group's token mean."""
    if not groups or max(groups) == 0:
        return []
    per: dict[int, list[float]] = {}
    for r in results:
        if r.losses:
            per.setdefault(groups[r.replica], []).extend(r.losses)
    return [
        sum(per[g]) / len(per[g]) if per.get(g) else float("nan") for g in range(max(groups) + 1)
    ]


def _codec_error(results: list[IterationResult]) -> dict[str, float]:
    """The worst sampled codec error per direction over the replicas that reported one."""
    out: dict[str, float] = {}
    for r in results:
        for direction, err in getattr(r, "codec_error", {}).items():
            out[direction] = max(out.get(direction, 0.0), err)
    return out


def _grad_norm(results: list[IterationResult]) -> float | None:
    """sqrt of the sum over stages of each stage's squared norm (one replica per stage:
    the ZeRO-1 reduction made its replicas' gradients equal)."""
    norms: dict[int, float] = {}
    for r in results:
        if r.grad_norm is not None:
            norms.setdefault(r.stage, r.grad_norm)
    return math.sqrt(sum(n * n for n in norms.values())) if norms else None


def _mean_parts(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(k for row in rows for k in row)
    return {k: sum(row.get(k, 0.0) for row in rows) / len(rows) for k in keys}


@dataclass(frozen=True)
class _Ev:
    row: str
    name: str
    start: float
    end: float


_NAMES = {
    "F": "F",
    "B": "B",
    "SEND_F": "send",
    "SEND_B": "send",
    "RECV_F": "recv",
    "RECV_B": "recv",
}


def measured_events(results: list[IterationResult]) -> list[_Ev]:
    """Timeline rows per stage replica: forward, backward, send, and receive waits (idle)."""
    base = min(r.start for r in results)
    out = []
    for r in results:
        row = f"stage {r.stage}" + (f" r{r.replica}" if r.replica else "")
        off = r.start - base
        for kind, mb, t0, t1 in r.events:
            name = _NAMES[kind]
            if name == "recv" and t1 - t0 < 1e-4:
                continue  # the data was already there: no idle time to show
            label = f"{name}{mb}" if name in ("F", "B") else f"{name} {kind[-1]}{mb}"
            out.append(_Ev(row, label, off + t0, off + t1))
    return out


class MetricsSink:
    """Writes one JSON line per step and per event, mirrors the step figures into Ray's
    metrics, and the scalars (:func:`step_scalars`, :func:`event_scalars`) into TensorBoard
    and, when ``logging.wandb`` asks, a Weights & Biases run (``wandb``: a
    :class:`~geopipe.runtime.control.wandb_log.WandbLog`)."""

    def __init__(
        self,
        path: Path | None,
        run: str,
        use_ray: bool = True,
        tensorboard: Path | None = None,
        wandb: Any = None,
    ) -> None:
        self.path = path
        self.run = run
        self._fh = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("a", buffering=1)
        self._tb = _tensorboard(tensorboard) if tensorboard is not None else None
        self._wandb = wandb
        self._gauges: dict[str, Any] = {}
        if use_ray:
            try:
                from ray.util.metrics import Gauge

                for key, desc in (
                    ("loss", "training loss"),
                    ("iteration_time_s", "seconds per optimizer step"),
                    ("tokens_per_s", "training throughput"),
                    ("bubble_ratio", "1 - busy / (stages × iteration time)"),
                    ("wan_bytes", "bytes sent over WAN links in the step"),
                    ("step", "optimizer steps completed"),
                ):
                    self._gauges[key] = Gauge(f"geopipe_{key}", description=desc, tag_keys=("run",))
            except Exception:  # metrics are an extra: never fail a run for them
                self._gauges = {}

    def write(self, m: StepMetrics, extra: dict | None = None) -> None:
        rec = {**m.to_json(), **(extra or {})}
        if self._fh is not None:
            self._fh.write(json.dumps(rec) + "\n")
        for key, g in self._gauges.items():
            with contextlib.suppress(Exception):
                g.set(float(rec[key]), tags={"run": self.run})
        self._emit(step_scalars(rec), m.step)

    def event(self, kind: str, **fields: Any) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps({"event": kind, **fields}) + "\n")
        scalars = event_scalars(kind, fields)
        if scalars:
            self._emit(scalars, int(fields["step"]))

    def _emit(self, scalars: dict[str, float], step: int) -> None:
        """The same scalars to TensorBoard and W&B; a sink that fails (a full disk, a lost
        server) stops with one warning, never the run."""
        if self._tb is not None:
            try:
                for tag, value in scalars.items():
                    self._tb.add_scalar(tag, value, step)
            except Exception as exc:
                say(f"TensorBoard logging stopped: {exc}", warning=True)
                self._tb = None
        if self._wandb is not None:
            try:
                self._wandb.log(scalars, step)
            except Exception as exc:
                say(f"Weights & Biases logging stopped: {exc}", warning=True)
                self._wandb = None

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        for sink in (self._tb, self._wandb):
            if sink is not None:
                with contextlib.suppress(Exception):
                    sink.close()
        self._tb = self._wandb = None


TENSORBOARD_SCALARS = (
    "loss",
    "tokens_per_s",
    "iteration_time_s",
    "bubble_ratio",
    "wan_bytes",
    "predicted_iteration_time_s",
    "lr",
    "grad_norm",
)
# The outer loop's ``outer_round`` rows (geopipe.runtime.control.outerloop) as scalars
OUTER_SCALARS = ("round", "groups", "apply_s", "overlapped_s", "exposed_s", "bytes", "codec_error")


def step_scalars(rec: dict) -> dict[str, float]:
    """A step line's scalars, by TensorBoard tag: ``train/*``, ``codec/error_<direction>``,
    ``group/<g>/loss`` (each replica group of the outer loop)."""
    out = {f"train/{k}": float(rec[k]) for k in TENSORBOARD_SCALARS if rec.get(k) is not None}
    for direction, err in rec.get("codec_error", {}).items():
        out[f"codec/error_{direction}"] = float(err)
    for g, loss in enumerate(rec.get("group_loss", ())):
        out[f"group/{g}/loss"] = float(loss)
    return out


def event_scalars(kind: str, fields: dict) -> dict[str, float]:
    """An event's scalars: ``outer/*`` per outer round (fragment) applied, ``eval/loss``,
    ``eval/perplexity`` (and ``eval/group_<g>_loss``) per held-out evaluation; none for the
    other events."""
    if kind == "outer_round":
        return {f"outer/{k}": float(fields[k]) for k in OUTER_SCALARS if fields.get(k) is not None}
    if kind == "eval":
        out = {
            "eval/loss": float(fields["eval_loss"]),
            "eval/perplexity": float(fields["perplexity"]),
        }
        for g, loss in enumerate(fields.get("group_eval_loss", ())):
            out[f"eval/group_{g}_loss"] = float(loss)
        return out
    return {}


def say(message: str, warning: bool = False) -> None:
    """Tell the user something, on stderr: every console line of the control plane comes
    through here (:meth:`Reporter.say <geopipe.runtime.control.reporting.Reporter.say>`;
    rich keeps a live progress bar below what is written there)."""
    lead = "\n" if message.startswith("\n") else ""
    kind = "warning: " if warning else ""
    print(f"{lead}geopipe: {kind}{message.lstrip(chr(10))}", file=sys.stderr, flush=True)


def _tensorboard(logdir: Path) -> Any:
    """A TensorBoard event writer (torch's SummaryWriter), or None with one warning when
    it cannot start: the metrics file and Ray's gauges still record everything."""
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(logdir), flush_secs=5)
    except Exception as exc:
        say(f"no TensorBoard logs ({exc})", warning=True)
        return None
