"""The planner's front: search the best plan and compare it with plain 1F1B and GPipe.

``plan_cluster`` is what ``geopipe plan`` and ``geopipe launch`` call. Fixed values in the
YAML's ``plan`` section collapse the corresponding gene to one value, so a fully fixed
plan costs a single evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from geopipe.config import MAX_DELTA_N, ClusterSpec
from geopipe.optimizer.errors import PlanningError
from geopipe.optimizer.evaluate import Candidate, Evaluation, Evaluator
from geopipe.optimizer.exhaustive import exhaustive_search
from geopipe.optimizer.genetic import SearchResult, genetic_search
from geopipe.optimizer.ladder import delta_n_cover
from geopipe.pipeline.schedule import AUTO, AUTO_CHOICES, LOOKAHEAD_FAMILIES, family
from geopipe.transport.wire import CODECS, check_codec

__all__ = [
    "CodecRow",
    "PlanReport",
    "codec_rows",
    "evaluate_fixed",
    "plan_cluster",
]


@dataclass(frozen=True)
class CodecRow:
    """The best plan's structure with one codec setting on every WAN boundary (ΔN at its
    cover), and what binds it: the busiest link direction or the busiest stage."""

    setting: str
    evaluation: Evaluation
    wan_busy_s: float  # the busiest WAN direction per iteration: serialisation + codec time
    compute_s: float  # the busiest stage's forwards and backwards per iteration
    bound: str  # "WAN a→b" or "compute stage k"

    def to_json(self) -> dict:
        return {
            **self.evaluation.summary(),
            "wan_busy_s": self.wan_busy_s,
            "compute_s": self.compute_s,
            "bound": self.bound,
        }


def codec_rows(spec: ClusterSpec, best: Evaluation) -> list[CodecRow]:
    """Each searched codec setting (the same on every WAN boundary) at ``best``'s structure,
    then ``best`` itself: where compression moves the bottleneck."""
    if best.plan is None or not best.plan.wan_boundaries:
        return []
    ev = Evaluator(spec, schedule=best.candidate.schedule)
    sp, w = ev.space, len(best.candidate.codecs)
    rows = []
    for setting in sp.codecs[: sp.listed_codecs or None]:
        cand = replace(best.candidate, codecs=(setting,) * w)
        plan = ev.make_plan(cand)
        if plan is not None and cand.schedule in LOOKAHEAD_FAMILIES:
            top = max(sp.delta_ns)
            cover = delta_n_cover(ev.costs(plan), plan.wan_boundaries)
            cand = replace(cand, delta_n=tuple(min(x, top) for x in cover))
        rows.append(_codec_row(ev, setting, ev.evaluate(cand)))
    chosen = "/".join(dict.fromkeys(best.candidate.codecs))
    rows.append(_codec_row(ev, f"chosen: {chosen}", best))
    return rows


def _codec_row(ev: Evaluator, setting: str, e: Evaluation) -> CodecRow:
    if e.plan is None:
        return CodecRow(setting, e, math.nan, math.nan, "-")
    plan, costs = e.plan, ev.costs(e.plan)
    m = plan.num_microbatches
    wan = [(m * max(costs.ser_f[j], costs.ser_b[j]), j) for j in plan.wan_boundaries]
    comp = [(m * (f + b), k) for k, (f, b) in enumerate(zip(costs.fwd_s, costs.bwd_s, strict=True))]
    (w_s, j), (c_s, k) = max(wan), max(comp)
    sites = plan.stage_sites
    bound = f"WAN {sites[j]}→{sites[j + 1]}" if w_s > c_s else f"compute stage {k}"
    return CodecRow(setting, e, w_s, c_s, bound)


@dataclass
class PlanReport:
    best: Evaluation
    baselines: dict[str, Evaluation]
    search: SearchResult
    exhaustive: SearchResult | None = None
    codecs: list[CodecRow] = field(default_factory=list)

    def to_json(self) -> dict:
        search = {
            "method": self.search.method,
            "evaluations": self.search.evaluations,
            "seconds": round(self.search.seconds, 4),
            "space_size": self.search.space_size,
            "generations": self.search.generations,
        }
        if self.exhaustive is not None:
            ex = self.exhaustive
            search["exhaustive"] = {
                "evaluations": ex.evaluations,
                "simulated": ex.simulated,
                "seconds": round(ex.seconds, 4),
                "best": ex.best.summary(),
                "gap": self.best.fitness / ex.best.fitness - 1.0,
            }
        return {
            "best": self.best.summary(),
            "plan": self.best.plan.to_dict() if self.best.plan else None,
            "baselines": {k: v.summary() for k, v in self.baselines.items()},
            "codecs": {r.setting: r.to_json() for r in self.codecs},
            "search": search,
        }


def _baselines(spec: ClusterSpec, cand: Candidate, record: bool) -> dict[str, Evaluation]:
    """1F1B and GPipe at the plan's settings; for a ``lookahead-zb`` plan also plain
    look-ahead at the same ΔN (what the split backward buys) and ZB-H1 (no look-ahead)."""
    names = ["1f1b", "gpipe"]
    if family(cand.schedule).split_backward and family(cand.schedule).has_delta_n:
        names += ["lookahead", "zb-h1"]
    out = {}
    for name in names:
        ev = Evaluator(spec, schedule=name)
        dn = family(name).delta_n(cand.delta_n)
        out[name] = ev.evaluate(replace(cand, schedule=name, delta_n=dn), record=record)
    return out


def plan_cluster(
    spec: ClusterSpec, exhaustive: bool = False, record: bool = False, schedule: str | None = None
) -> PlanReport:
    """Search the plan for ``spec``; baselines run at the best plan's settings.

    ``schedule`` (default: the YAML's) ``auto`` plans each of :data:`AUTO_CHOICES` and keeps
    the split-backward plan only when it is predicted ``plan.min_gain.auto_schedule`` faster
    (its ``W`` passes fill the fill and drain that ΔN cannot; on a link with little to hide
    the split only costs its extra backward pass)."""
    if (schedule or spec.plan.schedule) == AUTO:
        plain, split = (plan_cluster(spec, exhaustive, record, s) for s in AUTO_CHOICES)
        faster = split.best.feasible and (
            not plain.best.feasible
            or split.best.tokens_per_s
            >= (1 + spec.plan.min_gain.auto_schedule) * plain.best.tokens_per_s
        )
        return split if faster else plain
    ev = Evaluator(spec, schedule=schedule)
    if ev.space.size(spec.training.global_batch_size) <= 64:
        result = exhaustive_search(ev)  # tiny spaces: no point in evolving
    else:
        result = genetic_search(ev)
    ex = exhaustive_search(Evaluator(spec, schedule=schedule)) if exhaustive else None
    best = ev.evaluate(result.best.candidate, record=record) if record else result.best
    return PlanReport(
        best, _baselines(spec, best.candidate, record), result, ex, codec_rows(spec, best)
    )


def evaluate_fixed(
    spec: ClusterSpec,
    schedule: str,
    micro_batch_size: int,
    seq_len: int,
    delta_n: int | list[int],
    pipelines: int | None = None,
    codec: str | None = None,
    record: bool = False,
) -> Evaluation:
    """Evaluate one fixed configuration (``geopipe simulate``); :class:`PlanningError` names
    the setting that cannot be used."""
    ev = Evaluator(spec, schedule=schedule)
    sp = ev.space
    d = pipelines if pipelines is not None else max(sp.pipelines)
    if d not in ev.shapes:
        raise PlanningError(f"{d} pipelines do not fit these sites (possible: {sorted(ev.shapes)})")
    w = sp.wan_boundaries
    dn = [delta_n] * w if isinstance(delta_n, int) else list(delta_n)
    if len(dn) != w:
        raise PlanningError(
            f"--delta-n needs one value or {w} (one per WAN boundary), got {len(dn)}"
        )
    if any(not 0 <= x <= MAX_DELTA_N for x in dn):
        raise PlanningError(f"--delta-n values must be in [0, {MAX_DELTA_N}], got {dn}")
    if not 1 <= seq_len <= spec.model.max_seq_len:
        raise PlanningError(
            f"--seq-len must be in [1, model.max_seq_len={spec.model.max_seq_len}], got {seq_len}"
        )
    if codec is not None:
        try:
            check_codec(codec)
        except ValueError:
            raise PlanningError(
                f"--codec must be one of {', '.join(CODECS)} or 'forward/backward' (int4h/int8), "
                f"got {codec!r}"
            ) from None
    gbs = spec.training.global_batch_size
    if micro_batch_size < 1 or gbs % (d * micro_batch_size):
        raise PlanningError(
            f"global batch {gbs} is not divisible by {d} pipelines × micro-batch {micro_batch_size}"
        )
    codecs = [codec or sp.codecs[0]] * w
    c = Candidate(d, micro_batch_size, seq_len, tuple(dn), tuple(codecs), schedule)
    return ev.evaluate(c, record=record)
