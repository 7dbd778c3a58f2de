"""Recovery and grow-back policies: what happened in, one decision out (pure: no Ray, no
DeepSpeed; the runtime executes the decisions, :mod:`geopipe.runtime.control.recovery`).

After a failure the runtime reports what died and what survives; :func:`decide` returns

* :class:`Reconfigure` — every layer's parameters *and* Adam state survive on a live actor
  and a template fits the alive devices: lay out the new pipelines and restore each layer's
  state from the survivors; training continues from the last step boundary;
* :class:`RestoreFromCheckpoint` — some layer's state is gone, a complete checkpoint exists
  and the model still fits: lay out the new pipelines and load the checkpoint (any
  partition can load it, parameter names do not depend on the layout);
* :class:`Fail` — the model no longer fits the alive devices, or state is lost with no
  checkpoint to restore from. The reason says which.

When devices come back, :func:`decide_grow` returns :class:`GrowBack` (switch to a faster
layout at the next step boundary) or :class:`Stay`.

The new layout is the best homogeneous one, :func:`geopipe.optimizer.templates.best_uniform`,
or — when it is predicted ``plan.min_gain.mixed_pipelines`` faster — a
mix of templates over the alive devices (:func:`geopipe.optimizer.mixes.best_mix`, Oobleck's
heterogeneous instantiation), judged with the planner's cost model.

[Note: state survival] Every replica of a stage holds the stage's full parameters (ZeRO-1
shards only the Adam state). The runtime's recovery snapshots keep, on every replica, the
stage's full state (weights and both Adam moments) at recent step boundaries, so a stage's
state survives while one replica holding the boundary lives. The policy does not assume
either way: the caller passes, per stage of the running plan, whether the parameters
(``params_available``) and the complete Adam state (``adam_state_available``) can be
recovered from live actors at the last completed step boundary. An iteration interrupted
by the failure is discarded, so survivors that already applied part of a step roll back to
it (the runtime's duty; a partially gathered ZeRO-1 step is not a consistent state).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from geopipe.optimizer.mixes import best_mix, uniform_time
from geopipe.optimizer.templates import Template, TemplateSet, best_uniform
from geopipe.plan import ActorKey, Plan

__all__ = [
    "Actor",
    "Decision",
    "Fail",
    "Failure",
    "GrowBack",
    "Reconfigure",
    "RestoreFromCheckpoint",
    "Stay",
    "decide",
    "decide_grow",
    "newest_common_boundary",
]

Actor = ActorKey  # (stage, replica) of a plan: the one actor key type


@dataclass(frozen=True)
class Failure:
    """What the controller knows after a failure (see the module note for availability)."""

    plan: Plan  # the layout that was running
    dead: frozenset[Actor]  # actors of ``plan`` that died
    devices_alive: Mapping[str, int]  # usable devices per site now (dead nodes excluded)
    params_available: frozenset[int]  # stages whose parameters survive on a live replica
    adam_state_available: frozenset[int]  # stages whose complete Adam state survives
    checkpoint_step: int | None  # step of the latest complete checkpoint, if any

    def __post_init__(self) -> None:
        p, d = self.plan.num_stages, self.plan.pipelines
        bad = sorted(a for a in self.dead if not (0 <= a[0] < p and 0 <= a[1] < d))
        if bad:
            raise ValueError(f"dead actors {bad} are not in a plan of {p} stages × {d} replicas")
        for name in ("params_available", "adam_state_available"):
            stages = sorted(k for k in getattr(self, name) if not 0 <= k < p)
            if stages:
                raise ValueError(f"{name}: stages {stages} are not in a plan of {p} stages")
        neg = sorted(s for s, n in self.devices_alive.items() if n < 0)
        if neg:
            raise ValueError(f"devices_alive: negative counts for {neg}")

    def live_replicas(self, stage: int) -> list[int]:
        """Replicas of ``stage`` still alive, in order (a mixed plan: pipelines that have a
        stage ``stage``; its layers are pipeline 0's, see ``params_available``)."""
        return [r for r in range(self.plan.replicas(stage)) if (stage, r) not in self.dead]


@dataclass(frozen=True)
class Reconfigure:
    """Continue without a restart: new layout, state restored from surviving actors."""

    template: Template
    plan: Plan
    predicted_s: float | None = None  # the new layout's predicted iteration time

    @property
    def pipelines(self) -> int:
        return self.plan.pipelines


@dataclass(frozen=True)
class RestoreFromCheckpoint:
    """Lay out the new pipelines and load the checkpoint of ``step``."""

    step: int
    template: Template
    plan: Plan
    reason: str  # why live state was not enough
    predicted_s: float | None = None


@dataclass(frozen=True)
class Fail:
    """Nothing to continue from: stop with ``reason``."""

    reason: str


Decision = Reconfigure | RestoreFromCheckpoint | Fail


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


def decide(failure: Failure, templates: TemplateSet) -> Decision:
    """The recovery decision for ``failure`` (rules in the module docstring).

    ``templates`` must be built for the running plan's micro-batch size
    (``build_templates(spec, plan=plan)``); the global batch stays what the plan ran.
    """
    plan = failure.plan
    total = plan.total_microbatches
    alive = {s: n for s, n in failure.devices_alive.items() if s in templates.sites}
    choice = best_layout(
        templates, alive, total * plan.micro_batch_size, plan.micro_batch_size, running=plan
    )
    have = ", ".join(f"{s}={alive.get(s, 0)}" for s in templates.sites)
    if choice is None:
        return Fail(
            f"the model no longer fits the alive devices ({have}): no pipeline layout over "
            f"the sites with devices left fits in memory (or their links form no chain)"
        )
    template, new, new_s = choice

    owner = _old_stage_of_layers(plan)
    live = {k for k in range(plan.num_stages) if failure.live_replicas(k)}
    params_ok = failure.params_available & live
    adam_ok = failure.adam_state_available & params_ok
    no_params = [x for x, k in enumerate(owner) if k not in params_ok]
    no_adam = [x for x, k in enumerate(owner) if k in params_ok and k not in adam_ok]
    if not no_params and not no_adam:
        return Reconfigure(template, new, new_s)

    lost = []
    if no_params:
        lost.append(f"layers {_layer_list(no_params)} lost their parameters (no live replica)")
    if no_adam:
        lost.append(f"layers {_layer_list(no_adam)} lost part of their optimizer state")
    reason = "; ".join(lost)
    if failure.checkpoint_step is not None:
        return RestoreFromCheckpoint(failure.checkpoint_step, template, new, reason, new_s)
    return Fail(f"{reason}, and there is no complete checkpoint to restore from")


def best_layout(
    templates: TemplateSet,
    devices: Mapping[str, int],
    global_batch: int,
    micro_batch: int,
    running: Plan | None = None,
) -> tuple[Template, Plan, float] | None:
    """The layout to run on ``devices``: the best identical pipelines, or a mix of
    templates predicted ``plan.min_gain.mixed_pipelines`` faster; its (first) template, plan and
    predicted iteration time. None if nothing fits."""
    choice = best_uniform(templates, devices, global_batch, micro_batch)
    if choice is None:
        return None
    template, d = choice
    plan = templates.plan_for(template, d, global_batch // (d * micro_batch))
    uniform_s = uniform_time(templates, devices, global_batch, micro_batch)  # memoised choice
    mix = best_mix(templates, devices, global_batch, micro_batch, running=running)
    gain = templates.spec.plan.min_gain.mixed_pipelines
    if mix is not None and mix.iteration_time_s < (1 - gain) * uniform_s:
        first = max(mix.instantiation.pipelines, key=lambda p: p.template.num_stages)
        return first.template, mix.plan, mix.iteration_time_s
    return template, plan, uniform_s


@dataclass(frozen=True)
class GrowBack:
    """Switch to ``plan`` at this step boundary: free devices allow a faster layout."""

    plan: Plan
    predicted_now_s: float
    predicted_new_s: float


@dataclass(frozen=True)
class Stay:
    """Keep the running layout (``reason`` says why)."""

    reason: str


def decide_grow(
    templates: TemplateSet,
    plan: Plan,
    devices_now: Mapping[str, int],
    global_batch: int,
    micro_batch: int,
    now_s: float | None = None,
    min_gain: float | None = None,
) -> GrowBack | Stay:
    """Whether to grow back onto ``devices_now`` (devices the running plan uses plus free
    ones): to the layout :func:`best_layout` picks for them, and only for a predicted gain
    of at least ``min_gain`` (default: ``plan.min_gain.grow_back``). ``now_s``: the running
    plan's predicted time (a mixed plan's must be given; identical pipelines are predicted
    here)."""
    choice = best_layout(templates, devices_now, global_batch, micro_batch, running=plan)
    if choice is None:
        return Stay("no layout fits the devices")
    _, new_plan, new_s = choice
    if now_s is None:
        if plan.heterogeneous:
            raise ValueError("decide_grow needs now_s for a mixed running plan")
        vector = tuple(plan.stage_sites.count(site) for site in templates.sites)
        now = templates.predict(vector, plan.pipelines, plan.num_microbatches)
        if now is None:
            return Stay("no prediction for the running layout")
        now_s = now.iteration_time_s
    if min_gain is None:
        min_gain = templates.spec.plan.min_gain.grow_back
    if new_s > (1 - min_gain) * now_s:
        return Stay(f"predicted gain below {min_gain:.0%}")
    return GrowBack(new_plan, now_s, new_s)


def newest_common_boundary(
    have: dict[tuple[int, int], set[int]],
    num_stages: int,
    failed_step: int,
    covers: Mapping[tuple[int, int], set[int]] | None = None,
) -> tuple[int | None, dict[int, list[tuple[int, int]]]]:
    """``have[(stage, replica)]``: the step boundaries a survivor holds in memory.

    The newest step boundary up to ``failed_step`` that, for every stage, some survivor
    holds; and who. Never a newer one: when the failure struck after every survivor had
    finished the step, its results (the losses) never reached the controller, so the step
    is redone rather than skipped. ``covers[key]``: the stages whose state a survivor's
    snapshot holds (default: its own; a mixed plan's survivor holds its group's layers,
    which may cover several of pipeline 0's stages)."""
    held = set().union(*have.values()) if have else set()
    cov = {key: (covers[key] if covers is not None else {key[0]}) for key in have}
    for s_ in sorted((b for b in held if b <= failed_step), reverse=True):
        found = {
            k: [key for key in have if k in cov[key] and s_ in have[key]] for k in range(num_stages)
        }
        if all(found.values()):
            return s_, found
    return None, {}
