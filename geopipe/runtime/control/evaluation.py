"""The driver's half of held-out evaluation (``training.eval``): when, and what it reports.

The actors do the work (:mod:`geopipe.runtime.actor.evaluate`); the controller calls
:meth:`Evaluator.prepare` once the actors are wired (before the data digest is read, so a
held-out split is part of it) and after every new layout, and :meth:`Evaluator.after_step`
after each step: every ``every_steps`` steps and after the last one, every actor runs its
held-out micro-batches forward and the last stages' losses become one ``eval`` event:
``eval_loss`` (the mean over the micro-batches, each of the same number of tokens: the
token mean), ``perplexity`` = exp(eval_loss), and with the outer loop's replica groups each
group's loss (mid-round the groups' weights differ; the figure is over all of them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from geopipe.config import ClusterSpec
from geopipe.runtime.actor.evaluate import EvalSetup
from geopipe.runtime.control.reporting import Reporter
from geopipe.runtime.control.workers import Workers, ask

__all__ = ["Evaluator", "summarize"]


def summarize(answers: list[dict], step: int) -> dict[str, Any]:
    """The ``eval`` event's fields from every actor's ``run_eval`` answer."""
    losses = [x for a in answers for x in a["losses"]]
    if not losses:
        raise RuntimeError(f"the evaluation after step {step} returned no loss")
    loss = sum(losses) / len(losses)
    per: dict[int, list[float]] = {}
    for a in answers:
        if a["losses"]:
            per.setdefault(a["group"], []).extend(a["losses"])
    fields: dict[str, Any] = {
        "step": step,
        "eval_loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "micro_batches": len(losses),
    }
    if len(per) > 1:
        fields["group_eval_loss"] = [sum(per[g]) / len(per[g]) for g in sorted(per)]
    return fields


class Evaluator:
    """``training.eval`` of one run; does nothing when the YAML has none."""

    def __init__(self, spec: ClusterSpec, workers: Workers, reporter: Reporter) -> None:
        t = spec.training
        self.cfg = t.eval
        self.workers, self.reporter = workers, reporter
        self.setup = None
        if self.cfg is not None:
            self.setup = EvalSetup(
                data=self.cfg.data,
                holdout=self.cfg.holdout,
                sequences=self.cfg.batches * t.global_batch_size,
                seed=t.seed,
                data_max_bytes=t.data_max_bytes,
            )
        self.results: list[dict[str, Any]] = []  # every evaluation's event fields

    @classmethod
    def ready(
        cls, spec: ClusterSpec, workers: Workers, reporter: Reporter, actors: Sequence[Any]
    ) -> Evaluator:
        """An evaluator whose held-out data ``actors`` already hold."""
        ev = cls(spec, workers, reporter)
        ev.prepare(actors)
        return ev

    def prepare(self, actors: Sequence[Any]) -> None:
        """Give every actor the held-out data (again after a new layout)."""
        if self.setup is not None:
            ask(self.workers, actors, "set_eval", self.setup)

    def due(self, done: int, total: int) -> bool:
        every = self.cfg.every_steps if self.cfg is not None else 0
        return self.cfg is not None and (done == total or (every > 0 and done % every == 0))

    def after_step(self, done: int, total: int, actors: Sequence[Any]) -> dict | None:
        """Evaluate when ``done`` steps call for it; returns the event's fields (or None)."""
        if not self.due(done, total):
            return None
        t0 = time.perf_counter()
        fields = summarize(ask(self.workers, actors, "run_eval", done), done)
        fields["eval_s"] = time.perf_counter() - t0
        self.results.append(fields)
        self.reporter.event("eval", **fields)
        return fields
