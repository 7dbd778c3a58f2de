"""The codec guard, as the controller runs it after a step: a hop whose sampled codec error
exceeds ``plan.max_codec_error`` sends that direction with the next finer codec from the next
step (the decision is :mod:`geopipe.optimizer.codec_guard`'s; this tells the actors and
says so)."""

from __future__ import annotations

from typing import Any

from geopipe.config import ClusterSpec
from geopipe.optimizer.codec_guard import apply_fallbacks, codec_fallbacks
from geopipe.plan import Plan
from geopipe.runtime.control.calibration import searched_codecs
from geopipe.runtime.control.reporting import Reporter
from geopipe.runtime.control.workers import Workers, ask

__all__ = ["guard_codecs"]


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
