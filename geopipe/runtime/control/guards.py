"""The guards the controller runs after a step.

* The codec guard: a hop whose sampled codec error exceeds ``plan.max_codec_error`` sends
  that direction with the next finer codec from the next step (the decision is
  :mod:`geopipe.optimizer.codec_guard`'s; this tells the actors and says so).
* The NaN guard (:class:`NanGuard`): a non-finite loss or gradient norm stops the run
  (:class:`Diverged`, exit 3), or with ``training.nan_policy: skip`` lets that step go
  without an optimizer step, up to ``training.max_skipped_steps``.

[Note: the NaN guard and checkpoints]
    DeepSpeed never applies a step whose gradient norm is not finite (it skips it: no Adam
    update, no LR step), and under the global norm every stage of the pipeline skips it
    together ([Note: global gradient clipping] in geopipe.runtime.actor.gradnorm). The guard
    runs on every step's results before that step's boundary may be checkpointed, and
    stops the run there: so the checkpoints a diverged run leaves are of finite steps, the
    newest complete one is finite, and pruning (which keeps the newest) never deletes it.
"""

from __future__ import annotations

import math
from typing import Any

from geopipe.config import ClusterSpec
from geopipe.optimizer.codec_guard import apply_fallbacks, codec_fallbacks
from geopipe.plan import Plan
from geopipe.runtime.control.calibration import searched_codecs
from geopipe.runtime.control.reporting import Reporter
from geopipe.runtime.control.workers import Workers, ask

__all__ = ["Diverged", "NanGuard", "RunStopped", "guard_codecs"]


class RunStopped(RuntimeError):
    """The run ended on purpose, for a reason its message says; ``geopipe launch`` prints
    the message and exits with :attr:`exit_code` (no traceback, no recovery)."""

    exit_code = 1


class Diverged(RunStopped):
    """A non-finite loss or gradient norm (the NaN guard)."""

    exit_code = 3


def non_finite(results: list) -> list[str]:
    """What was not finite in a step's results: each as "the loss of micro-batch m
    (stage k)" or "the gradient norm of stage k" (one replica each)."""
    out: list[str] = []
    for r in sorted(results, key=lambda r: (r.stage, r.replica)):
        bad = [i for i, x in enumerate(r.losses) if not math.isfinite(x)]
        if bad:
            out.append(f"the loss of micro-batch {bad[0]} (stage {r.stage}, replica {r.replica})")
        if r.grad_norm is not None and not math.isfinite(r.grad_norm):
            out.append(f"the gradient norm of stage {r.stage} (replica {r.replica})")
    return list(dict.fromkeys(out))


class NanGuard:
    """``training.nan_policy`` over the steps' results (see the module's note)."""

    def __init__(self, training: Any, reporter: Reporter | None = None) -> None:
        self.policy, self.limit = training.nan_policy, training.max_skipped_steps
        self.reporter = reporter
        self.skipped: list[int] = []

    def check(self, step: int, results: list) -> None:
        """Raise :class:`Diverged` naming the step, stage and tensor, unless skipping."""
        bad = non_finite(results)
        if not bad:
            return
        what = "; ".join(bad)
        if self.policy == "skip" and len(self.skipped) < self.limit:
            self.skipped.append(step)
            if self.reporter is not None:
                self.reporter.event("skipped_step", step=step, why=what)
                self.reporter.say(
                    f"step {step}: not finite: {what}; the optimizer step was skipped "
                    f"({len(self.skipped)} of training.max_skipped_steps {self.limit})"
                )
            return
        more = (
            f" after {len(self.skipped)} skipped steps (training.max_skipped_steps {self.limit})"
            if self.policy == "skip"
            else ""
        )
        raise Diverged(
            f"training diverged at step {step}: not finite: {what}{more}; the optimizer "
            "step was not applied and no checkpoint of this step is written (lower "
            "training.lr, set training.grad_clip, or resume from the last checkpoint)"
        )


def guard_codecs(
    spec: ClusterSpec,
    plan: Plan,
    step: int,
    results: list,
    workers: Workers,
    actors: list[Any],
    reporter: Reporter,
) -> Plan | None:
    """The plan with the fallbacks the step's samples call for (None: none)."""
    bound = spec.plan.max_codec_error
    if bound is None:
        return None
    samples = [(r.stage, r.replica, d, e) for r in results for d, e in r.codec_error.items()]
    fallbacks = codec_fallbacks(plan, samples, bound, searched_codecs(spec))
    if not fallbacks:
        return None
    ask(workers, actors, "set_codecs", fallbacks)
    for fb in fallbacks:
        reporter.event(
            "codec_fallback",
            step=step,
            link=f"{fb.src}→{fb.dst}",
            direction=fb.direction,
            codec=fb.old,
            to=fb.new,
            error=round(fb.error, 6),
            bound=bound,
        )
        reporter.say(
            f"step {step}: {fb.direction} codec {fb.old} on {fb.src}→{fb.dst} errs "
            f"{fb.error:.3g} > plan.max_codec_error {bound:g}: {fb.new} from the next step"
        )
    return apply_fallbacks(plan, fallbacks)
