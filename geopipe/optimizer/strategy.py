"""Two ways across the WAN, one planner: the pipeline across the sites, an outer loop between
replica groups (the DiLoCo family), or a hybrid of the two — chosen by predicted time per
token × (1 + predicted loss penalty).

Options (``plan.strategy: outer`` or ``auto``):

* **pipeline**: today's plan, one pipeline across every site (``M = 1``, exact and
  synchronous: no loss penalty). Its report is the search's own (:func:`plan_cluster`).
* **outer**: ``M`` replica groups, each a pipeline inside one site, meeting every ``H``
  inner steps; **hybrid**: groups that span a contiguous run of sites. Groupings are the
  site order the pipeline uses (:func:`~geopipe.optimizer.shapes.site_order`, Held–Karp)
  cut into ``M`` contiguous runs of equal length (``n // M`` or one more; at most
  :data:`~.groups.MAX_ARRANGEMENTS` ways to place the longer runs), for every ``M`` that divides
  the global batch — one group per site is ``M = n``. Each group is planned by today's
  search on a spec of its own sites and links and its share of the global batch
  (:func:`~.groups.group_spec`, whose memory model holds the outer state: [Note: a replica group's
  spec] in :mod:`geopipe.optimizer.memory`); every ``(H, F, tau, codec)`` of
  ``plan.outer``'s grid (:func:`geopipe.config.outer_settings`) is priced by
  :mod:`.outer_cost`, its loss penalty comes from the measured table (:mod:`.penalty`), and
  each ``(H, F, codec)`` row keeps its best overlap ``tau`` (ties: the larger, [Note: an
  overlap with slack]).

[Note: batch shares] A grouping is planned with equal shares (``global_batch / M``), then
with shares in proportion to the groups' speeds (:func:`~.groups.balanced_shares`), and each row
keeps the faster. Every group waits for the slowest at each exchange, so with equal shares a
region of 3× the FLOP/s computes a third of the time (worldwide-64: at most ~68 % of the
devices' time, whatever H). Unequal shares ask two things of the runtime: group ``g`` takes
its own contiguous slice of every global batch (sample indices stay a pure function of the
step, so exact resume holds), and the pseudo-gradients should be averaged weighted by share,
so that ``H = 1`` with outer lr 1 and momentum 0 is still synchronous training. The loss
table is measured with equal shares; the planner assumes the same penalty for either.

[Note: one layout] Launch runs replica groups of one layout only — the same pipelines,
stages, layer partition, micro-batch size, sequence length and schedule — since each ZeRO-1
partition exchanges its pseudo-gradient with its peer of the same shape in every other group
(:func:`~geopipe.optimizer.outerplan.unlaunchable`); the batch shares may differ. Planned on
their own, groups may choose different layouts (worldwide-64: the region of 40 GB devices
prefers 2 pipelines × 4 stages at a small share, the others 4 × 2). Such groups are planned
again in one common layout (:mod:`.grouplayout`: every layout they chose is tried, the
fastest that fits every group is kept), at every share policy, and the balanced shares are
multiples of pipelines × micro-batch so that the common layout divides them. A group
forced out of its own layout is slower at the share it was given, and only the next
re-balancing moves share away from it: hence :data:`~.groups.BALANCE_PASSES` of 3 (worldwide-64's
chosen candidate keeps 79 % of its devices' time computing with 2 passes, 82 % with 3, as
its groups planned apart and unlaunchable did). A candidate whose groups fit no common
layout is listed with the reason (``launchable`` false in ``--json``) and never chosen: the
planner picks what launch runs (issue 30).

``auto`` takes an outer candidate only when it is ``plan.min_gain.outer`` better than the
pipeline after its penalty (a tie goes to the exact synchronous pipeline). A candidate whose
penalty cannot be priced (no table, an ``H`` beyond the measured ones, an ``M`` not measured)
is listed with the reason and never chosen by ``auto``; ``outer`` takes the best priced one,
or, where nothing is priced and ``plan.max_loss_penalty`` is unset, the fastest launchable
one, saying the penalty is unknown. A strategy that leaves nothing to choose is a
:class:`ConfigError` naming the field (the CLI's exit 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from geopipe.config import ClusterSpec, ConfigError, OuterSetting, outer_settings
from geopipe.optimizer.evaluate import Evaluation
from geopipe.optimizer.groups import (
    Grouping,
    GroupPlanner,
    group_plans,
    site_groupings,
)
from geopipe.optimizer.outer_cost import RoundCost, price_round
from geopipe.optimizer.penalty import Penalty, PenaltyModel
from geopipe.optimizer.planner import PlanReport
from geopipe.optimizer.shapes import site_order

__all__ = [
    "StrategyOption",
    "StrategyReport",
    "as_pipeline",
    "plan_strategy",
]


_NO_GROUPING = "one site, or no number of groups M >= 2 divides the global batch"


def as_pipeline(spec: ClusterSpec) -> ClusterSpec:
    """``spec`` planned as one pipeline across its sites (what ``strategy: pipeline`` does)."""
    if spec.plan.strategy == "pipeline":
        return spec
    return spec.model_copy(update={"plan": spec.plan.model_copy(update={"strategy": "pipeline"})})


@dataclass
class StrategyOption:
    """One row of the strategy table (``--json``'s ``strategy.candidates``): a strategy with
    its grouping and outer setting, priced. Not a *candidate*: that word is the layout
    search's point (:class:`geopipe.optimizer.evaluate.Candidate`, docs/glossary.md)."""

    kind: str  # "pipeline" | "outer" | "hybrid"
    groups: Grouping
    setting: OuterSetting | None = None
    tokens_per_s: float = 0.0
    device_utilization: float = 0.0
    penalty: Penalty = field(default_factory=lambda: Penalty(0.0, "exact, synchronous"))
    feasible: bool = True
    reason: str = ""  # why it cannot be chosen (empty if it can)
    bound: str = ""
    round: RoundCost | None = None
    evaluations: tuple[Evaluation, ...] = ()  # each group's plan (the pipeline's: one)
    unlaunchable: str = ""  # why launch cannot run these groups' plans ([Note: one layout])

    @property
    def replicas(self) -> int:
        return len(self.groups)

    @property
    def shares(self) -> tuple[int, ...]:
        """Sequences per inner step of each group (its share of the global batch)."""
        return tuple(e.tokens_per_iteration // e.plan.seq_len for e in self.evaluations if e.plan)

    @property
    def score(self) -> float:
        """Seconds per token × (1 + loss penalty); inf where it does not fit or has no price."""
        if not self.feasible or not self.penalty.priced or not self.tokens_per_s:
            return math.inf
        return (1.0 + (self.penalty.value or 0.0)) / self.tokens_per_s

    @property
    def effective_tokens_per_s(self) -> float:
        return 1.0 / self.score if math.isfinite(self.score) else 0.0

    @property
    def label(self) -> str:
        if self.kind == "pipeline":
            return "pipeline across sites"
        sizes = sorted({len(g) for g in self.groups})
        per = "one site" if sizes == [1] else "/".join(map(str, sizes)) + " sites"
        return f"{self.kind}: {self.replicas} groups of {per}"

    def to_json(self, plans: bool = False) -> dict:
        s = self.setting
        doc = {
            "kind": self.kind,
            "label": self.label,
            "replicas": self.replicas,
            "groups": [list(g) for g in self.groups],
            "batch_shares": list(self.shares),
            "h": s.h if s else None,
            "fragments": s.fragments if s else None,
            "overlap": s.overlap if s else None,
            "codec": s.codec if s else None,
            "outer_lr": s.lr if s else None,
            "outer_momentum": s.momentum if s else None,
            "tokens_per_s": self.tokens_per_s,
            "effective_tokens_per_s": self.effective_tokens_per_s,
            "device_utilization": self.device_utilization,
            "loss_penalty": self.penalty.value,
            "loss_penalty_basis": self.penalty.basis,
            "loss_penalty_spread": self.penalty.spread,  # its standard error
            "priced": self.penalty.priced,
            "feasible": self.feasible,
            "reason": self.reason,
            "launchable": not self.unlaunchable,
            "launch_refused": self.unlaunchable,
            "bound": self.bound,
            "round": self.round.to_json() if self.round else None,
        }
        if plans:
            doc["group_plans"] = [
                {
                    "sites": list(g),
                    "plan": e.plan.to_dict() if e.plan else None,
                    "summary": e.summary(),
                }
                for g, e in zip(self.groups, self.evaluations, strict=True)
            ]
        return doc


@dataclass
class StrategyReport:
    """Every candidate (the pipeline first), the chosen one and why, and the penalty model."""

    setting: str  # plan.strategy
    chosen: StrategyOption
    why: str
    candidates: list[StrategyOption]
    penalty: PenaltyModel

    def to_json(self) -> dict:
        t = self.penalty.table
        return {
            "setting": self.setting,
            "chosen": self.chosen.to_json(plans=True),
            "why": self.why,
            "loss_penalty_table": t.describe() if t else {"path": self.penalty.path},
            "candidates": [c.to_json() for c in self.candidates],
        }


def _price(
    spec: ClusterSpec,
    grouping: Grouping,
    evals: list[Evaluation],
    penalty: PenaltyModel,
    stuck: str = "",
) -> list[StrategyOption]:
    """Every setting of the ``plan.outer`` grid for these groups' plans, priced; ``stuck``:
    why launch cannot run them (the reason they cannot be chosen, before the penalty's)."""
    kind = "outer" if all(len(g) == 1 for g in grouping) else "hybrid"
    bound = spec.plan.max_loss_penalty
    out = []
    for setting in outer_settings(spec):
        cost = price_round(spec, grouping, evals, setting)
        p = penalty.predict(
            len(grouping),
            setting.h,
            setting.fragments,
            setting.codec,
            setting.overlap,
            (setting.lr, setting.momentum),
        )
        reason = "" if p.priced else f"loss penalty not priced: {p.basis}"
        if p.priced and bound is not None and p.upper > bound:
            reason = (
                f"loss penalty {p.value:.2%} ± {p.spread:.2%} above plan.max_loss_penalty "
                f"({bound:.2%}; checked at the mean plus its standard error)"
            )
        if stuck:
            reason = f"launch cannot run it: {stuck}"
        out.append(
            StrategyOption(
                kind,
                grouping,
                setting,
                cost.tokens_per_s,
                cost.device_utilization,
                p,
                True,
                reason,
                cost.bound,
                cost,
                tuple(evals),
                stuck,
            )
        )
    return out


def _rank(c: StrategyOption) -> tuple:
    """Within one ``(H, F, codec)`` row: choosable first, then the best score (the fastest
    where none is choosable), then the larger overlap.

    [Note: an overlap with slack] Overlaps that hide the whole transfer tie: the round's
    price is the same, and the loss table prices every overlap up to the largest it
    measured alike (:mod:`.penalty`). The larger is kept because the link model's transfer
    time is a mean a real one runs past: a fragment sent after an idle stretch starts in
    TCP's slow start again, and a group a step behind starts its send late. On the test bed
    (40 ms, 50 Mbit/s, a 356 kB fragment priced at 0.10 s) the transfers took 0.11-0.14 s:
    an overlap of 2 steps of 0.055 s, just enough on paper, left a median 7 ms (up to
    54 ms) exposed at each apply, one of 4 steps none after the first round
    (benchmarks/README.md, stop 44)."""
    choosable = c.feasible and not c.reason
    return (not choosable, c.score if choosable else -c.tokens_per_s, -c.setting.overlap)


def _pipeline_option(report: PlanReport) -> StrategyOption:
    best = report.best
    bound = report.codecs[-1].bound if report.codecs else "compute"
    return StrategyOption(
        "pipeline",
        (tuple(dict.fromkeys(best.plan.stage_sites)),) if best.plan else ((),),
        None,
        best.tokens_per_s,
        best.device_utilization,
        feasible=best.feasible,
        reason="" if best.feasible else best.reason,
        bound=bound,
        evaluations=(best,),
    )


def _options(
    spec: ClusterSpec, pipeline: PlanReport, penalty: PenaltyModel
) -> list[StrategyOption]:
    """The pipeline, then per grouping the best of its share policies for each setting."""
    out = [_pipeline_option(pipeline)]
    groups = GroupPlanner(spec)
    for grouping in site_groupings(site_order(spec), spec.training.global_batch_size):
        kind = "outer" if all(len(g) == 1 for g in grouping) else "hybrid"
        best: dict[tuple, StrategyOption] = {}
        whys = []
        for evals, why, stuck in group_plans(spec, grouping, groups):
            whys.append(why)
            for c in [] if why else _price(spec, grouping, evals, penalty, stuck):
                key = (c.setting.h, c.setting.fragments, c.setting.codec)
                if key not in best or _rank(c) < _rank(best[key]):
                    best[key] = c
        if not best:
            none = Penalty(None, "not priced: a group does not fit")
            out.append(StrategyOption(kind, grouping, feasible=False, reason=whys[0], penalty=none))
        out += best.values()
    return out


def _order(c: StrategyOption) -> tuple:
    """Best first: the score, then fewer groups, a shorter round, fewer fragments."""
    s = c.setting
    return (c.score, c.replicas, s.h if s else 0, s.fragments if s else 0, s.codec if s else "")


def _describe(c: StrategyOption) -> str:
    s = c.setting
    if s is None:
        return c.label
    return (
        f"{c.label}, H={s.h}, F={s.fragments}, overlap {s.overlap}, codec {s.codec}, "
        f"outer lr {s.lr:g} momentum {s.momentum:g}"
    )


def _choose_auto(
    spec: ClusterSpec,
    pipe: StrategyOption,
    best: StrategyOption | None,
    outer: list[StrategyOption],
) -> tuple[StrategyOption, str]:
    if best is None:
        runnable = [c for c in outer if c.feasible]
        if not runnable:
            why = outer[-1].reason if outer else _NO_GROUPING
            return pipe, f"pipeline across sites: no grouping into replica groups fits: {why}"
        fastest = max(runnable, key=lambda c: c.tokens_per_s)
        return pipe, (
            f"pipeline across sites: no outer candidate can be chosen; the fastest, "
            f"{_describe(fastest)}, has {fastest.reason}"
        )
    gain = pipe.score / best.score - 1.0 if pipe.feasible else math.inf
    need = spec.plan.min_gain.outer
    if gain <= need:
        return pipe, (
            f"pipeline across sites (exact, synchronous): the best outer candidate, "
            f"{_describe(best)}, is {gain:+.1%} after its assumed loss penalty of "
            f"{best.penalty.value:.2%}, not the {need:.0%} plan.min_gain.outer asks "
            "(a tie goes to the synchronous pipeline)"
        )
    versus = (
        f"{1 + gain:.2f}× the pipeline's tokens/s after its assumed loss penalty"
        if pipe.feasible
        else "the pipeline across sites does not fit; assumed loss penalty"
    )
    return best, _won(best, versus, pipe)


def _won(c: StrategyOption, versus: str, pipe: StrategyOption) -> str:
    return (
        f"{_describe(c)}: {versus} of {c.penalty.value:.2%} ({c.penalty.basis}); device "
        f"utilization {c.device_utilization:.0%} (pipeline across sites: "
        f"{pipe.device_utilization:.0%})"
    )


def _choose_outer(
    spec: ClusterSpec,
    source: str,
    pipe: StrategyOption,
    best: StrategyOption | None,
    outer: list[StrategyOption],
) -> tuple[StrategyOption, str]:
    if best is not None:
        ratio = best.effective_tokens_per_s / pipe.effective_tokens_per_s if pipe.feasible else 0
        versus = f"strategy outer; {ratio:.2f}× the pipeline's tokens/s after its loss penalty"
        return best, _won(best, versus, pipe)
    fit = [c for c in outer if c.feasible]
    if not fit:
        whys = sorted(outer, key=lambda c: -c.replicas)
        why = whys[0].reason if whys else _NO_GROUPING
        raise ConfigError(
            source,
            [("plan.strategy", f"outer: no grouping of the sites into replica groups fits: {why}")],
        )
    runnable = [c for c in fit if not c.unlaunchable]
    if not runnable:
        fastest = max(fit, key=lambda c: c.tokens_per_s)
        why = f"the fastest, {_describe(fastest)}: {fastest.unlaunchable}"
        raise ConfigError(source, [("plan.strategy", f"outer: launch can run no grouping: {why}")])
    fastest = max(runnable, key=lambda c: c.tokens_per_s)
    if spec.plan.max_loss_penalty is not None:
        raise ConfigError(
            source,
            [
                (
                    "plan.max_loss_penalty",
                    "no outer candidate's loss "
                    f"penalty is priced within it: the fastest, "
                    f"{_describe(fastest)}, has {fastest.reason}",
                )
            ],
        )
    return fastest, (
        f"{_describe(fastest)}: strategy outer, chosen by time alone: its {fastest.reason}"
    )


def plan_strategy(
    spec: ClusterSpec, pipeline: PlanReport, penalty: PenaltyModel, source: str = "<cluster>"
) -> StrategyReport:
    """Every strategy candidate for ``spec`` (``plan.strategy`` outer or auto), priced, and
    the one chosen. ``pipeline`` is the search's report for :func:`as_pipeline` of
    ``spec``; ``source`` names the file in a :class:`ConfigError`."""
    cands = _options(spec, pipeline, penalty)
    pipe, outer = cands[0], cands[1:]
    ok = sorted((c for c in outer if c.feasible and not c.reason), key=_order)
    best = ok[0] if ok else None
    if spec.plan.strategy == "outer":
        chosen, why = _choose_outer(spec, source, pipe, best, outer)
    else:
        chosen, why = _choose_auto(spec, pipe, best, outer)
    return StrategyReport(spec.plan.strategy, chosen, why, cands, penalty)
