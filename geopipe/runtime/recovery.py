"""The recovery policy: a failure in, one decision out (pure logic, no Ray, no DeepSpeed).

The controller reports what died and what survives; :func:`decide` returns

* :class:`Reconfigure` — every layer's parameters *and* optimizer state survive on a live
  actor and a template fits the alive devices: lay out the new pipelines and copy each
  layer's state from the survivors named in ``sources``; training continues at the same
  step;
* :class:`RestoreFromCheckpoint` — some layer's state is gone, a complete checkpoint exists
  and the model still fits: lay out the new pipelines and load the checkpoint (any
  partition can load it, parameter names do not depend on the layout);
* :class:`Fail` — the model no longer fits the alive devices, or state is lost with no
  checkpoint to restore from. The reason says which.

The new layout is the best homogeneous one, :func:`geopipe.pipeline.templates.best_uniform`
(the runtime runs ``D`` identical pipelines), judged with the planner's cost model.

[Note: ZeRO-1 state survival] Every replica of a stage holds the stage's full parameters
(ZeRO-1 shards only optimizer state), so a stage's parameters survive while one replica
lives. Its Adam state is split into ``D`` shards, one per replica: losing a replica loses
that shard *unless it was copied elsewhere*. The policy does not assume either way — the
caller passes, per stage of the running plan, whether the parameters
(``params_available``) and the group's complete optimizer state (``optimizer_available``)
can be recovered from live actors. :func:`zero1_state` computes both for the two layouts the
runtime can have: plain ZeRO-1 (the optimizer state survives only if every replica of the
group lives, so any lost actor means a checkpoint restore) or ZeRO-1 with *buddy copies*
(replica ``r`` also keeps a copy of shard ``r-1 mod D``, refreshed at every step boundary:
shard ``r`` is lost only if replicas ``r`` and ``r+1 mod D`` both die; the price is one more
shard of memory per device and one intra-site shard transfer per step). Availability refers
to the state at the last completed step boundary: an iteration interrupted by the failure is
discarded, so survivors that already applied part of a step roll back to it (the runtime's
duty; a partially gathered ZeRO-1 step is not a consistent state).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from geopipe.pipeline.templates import Template, TemplateSet, best_uniform
from geopipe.plan import Plan

__all__ = [
    "Actor",
    "Decision",
    "Fail",
    "Failure",
    "LayerSource",
    "Reconfigure",
    "RestoreFromCheckpoint",
    "Slot",
    "decide",
    "placement_for",
    "zero1_state",
]

Actor = tuple[int, int]  # (stage, replica) of a plan


@dataclass(frozen=True, order=True)
class Slot:
    """A device slot: the ``index``-th alive device of ``site`` (0 ≤ index < alive count).

    The runtime maps slots to real devices (Ray placement-group bundles); the policy only
    guarantees that no two actors share a slot and each sits in its stage's site.
    """

    site: str
    index: int


@dataclass(frozen=True)
class Failure:
    """What the controller knows after a failure (see the module note for availability)."""

    plan: Plan  # the layout that was running
    dead: frozenset[Actor]  # actors of ``plan`` that died
    devices_alive: Mapping[str, int]  # usable devices per site now (dead nodes excluded)
    params_available: frozenset[int]  # stages whose parameters survive on a live replica
    optimizer_available: frozenset[int]  # stages whose complete Adam state survives
    checkpoint_step: int | None  # step of the latest complete checkpoint, if any

    def __post_init__(self) -> None:
        p, d = self.plan.num_stages, self.plan.pipelines
        bad = sorted(a for a in self.dead if not (0 <= a[0] < p and 0 <= a[1] < d))
        if bad:
            raise ValueError(f"dead actors {bad} are not in a plan of {p} stages × {d} replicas")
        for name in ("params_available", "optimizer_available"):
            stages = sorted(k for k in getattr(self, name) if not 0 <= k < p)
            if stages:
                raise ValueError(f"{name}: stages {stages} are not in a plan of {p} stages")
        neg = sorted(s for s, n in self.devices_alive.items() if n < 0)
        if neg:
            raise ValueError(f"devices_alive: negative counts for {neg}")

    def live_replicas(self, stage: int) -> list[int]:
        """Replicas of ``stage`` still alive, in order."""
        return [r for r in range(self.plan.pipelines) if (stage, r) not in self.dead]


@dataclass(frozen=True)
class LayerSource:
    """Where one layer's state comes from (live actors of the plan that was running)."""

    layer: int
    params: Actor  # a live replica holding the layer's weights
    optimizer: tuple[Actor, ...]  # live replicas of its old group: its Adam state between them


@dataclass(frozen=True)
class Reconfigure:
    """Continue without a restart: new layout, state copied from surviving actors."""

    template: Template
    plan: Plan
    placement: dict[Actor, Slot]  # new (stage, replica) -> device slot
    sources: dict[Actor, tuple[LayerSource, ...]]  # new actor -> one entry per layer it holds

    @property
    def pipelines(self) -> int:
        return self.plan.pipelines


@dataclass(frozen=True)
class RestoreFromCheckpoint:
    """Lay out the new pipelines and load the checkpoint of ``step``."""

    step: int
    template: Template
    plan: Plan
    placement: dict[Actor, Slot]
    reason: str  # why live state was not enough


@dataclass(frozen=True)
class Fail:
    """Nothing to continue from: stop with ``reason``."""

    reason: str


Decision = Reconfigure | RestoreFromCheckpoint | Fail


def zero1_state(
    plan: Plan, dead: Iterable[Actor], *, buddy_copies: bool
) -> tuple[frozenset[int], frozenset[int]]:
    """``(params_available, optimizer_available)`` per stage under ZeRO-1 (module note).

    Without ``buddy_copies`` a group's Adam state survives only if all its replicas live;
    with them, shard ``r`` survives if replica ``r`` or ``r+1 mod D`` lives.
    """
    gone = set(dead)
    d = plan.pipelines
    params, opt = set(), set()
    for k in range(plan.num_stages):
        alive = [(k, r) not in gone for r in range(d)]
        if any(alive):
            params.add(k)
        if buddy_copies:
            if all(alive[r] or alive[(r + 1) % d] for r in range(d)):
                opt.add(k)
        elif all(alive):
            opt.add(k)
    return frozenset(params), frozenset(opt)


def placement_for(plan: Plan, devices_alive: Mapping[str, int]) -> dict[Actor, Slot]:
    """One slot per actor of ``plan``, in its stage's site; raises if a site is too small."""
    nxt: dict[str, int] = {}
    out: dict[Actor, Slot] = {}
    for k, site in enumerate(plan.stage_sites):
        for r in range(plan.pipelines):
            i = nxt.get(site, 0)
            if i >= devices_alive.get(site, 0):
                raise ValueError(f"site {site} has too few devices for plan {plan.stage_sites}")
            out[(k, r)] = Slot(site, i)
            nxt[site] = i + 1
    return out


def _old_stage_of_layers(plan: Plan) -> list[int]:
    return [k for k, (a, z) in enumerate(plan.partition) for _ in range(a, z)]


def _layer_list(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    runs: list[tuple[int, int]] = []
    for x in layers:
        if runs and runs[-1][1] == x - 1:
            runs[-1] = (runs[-1][0], x)
        else:
            runs.append((x, x))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _sources(failure: Failure, new: Plan) -> dict[Actor, tuple[LayerSource, ...]]:
    """For each new actor, a live source per layer; new replicas spread over old ones."""
    owner = _old_stage_of_layers(failure.plan)
    live = {k: failure.live_replicas(k) for k in set(owner)}
    out: dict[Actor, tuple[LayerSource, ...]] = {}
    for k, (a, z) in enumerate(new.partition):
        for r in range(new.pipelines):
            entries = []
            for layer in range(a, z):
                old = owner[layer]
                reps = live[old]
                entries.append(
                    LayerSource(
                        layer=layer,
                        params=(old, reps[r % len(reps)]),
                        optimizer=tuple((old, x) for x in reps),
                    )
                )
            out[(k, r)] = tuple(entries)
    return out


def decide(failure: Failure, templates: TemplateSet) -> Decision:
    """The recovery decision for ``failure`` (rules in the module docstring).

    ``templates`` must be built for the running plan's micro-batch size
    (``build_templates(spec, plan=plan)``); the global batch stays what the plan ran.
    """
    plan = failure.plan
    total = plan.pipelines * plan.num_microbatches
    alive = {s: n for s, n in failure.devices_alive.items() if s in templates.sites}
    choice = best_uniform(templates, alive, total * plan.micro_batch_size, plan.micro_batch_size)
    have = ", ".join(f"{s}={alive.get(s, 0)}" for s in templates.sites)
    if choice is None:
        return Fail(
            f"the model no longer fits the alive devices ({have}): no pipeline layout over "
            f"the sites with devices left fits in memory (or their links form no chain)"
        )
    template, d = choice
    new = templates.plan_for(template, d, total // d)
    placement = placement_for(new, alive)

    owner = _old_stage_of_layers(plan)
    live = {k for k in range(plan.num_stages) if failure.live_replicas(k)}
    params_ok = failure.params_available & live
    opt_ok = failure.optimizer_available & params_ok
    no_params = [x for x, k in enumerate(owner) if k not in params_ok]
    no_opt = [x for x, k in enumerate(owner) if k in params_ok and k not in opt_ok]
    if not no_params and not no_opt:
        return Reconfigure(template, new, placement, _sources(failure, new))

    lost = []
    if no_params:
        lost.append(f"layers {_layer_list(no_params)} lost their parameters (no live replica)")
    if no_opt:
        lost.append(f"layers {_layer_list(no_opt)} lost part of their optimizer state")
    reason = "; ".join(lost)
    if failure.checkpoint_step is not None:
        return RestoreFromCheckpoint(failure.checkpoint_step, template, new, placement, reason)
    return Fail(f"{reason}, and there is no complete checkpoint to restore from")
