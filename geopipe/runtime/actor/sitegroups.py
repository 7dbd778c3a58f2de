"""Each site's ``torch.distributed`` world and its ZeRO-1 groups, for uniform and mixed plans.

Pure (no Ray, no DeepSpeed): :class:`~geopipe.runtime.control.placement.Placement` wires actors by
it and the tests check it without a cluster.

[Note: ZeRO-1 groups of a mixed plan] A layer's gradient must be reduced over every actor
that runs it — one per pipeline — and those actors all sit in the layer's site (templates
of one mix agree on every layer's site). With identical pipelines the actors of a stage
run the same layers, and a stage's replicas are the group, as DeepSpeed expects. Mixed
pipelines cut a site's layers differently (pipeline A runs layers 0–1 and 2–3 on two
devices, pipeline B all four on one), so the sets of actors sharing a layer overlap
without being equal. DeepSpeed keeps one data-parallel group per process (its ``mpu`` is
module-global), so per-layer groups inside one engine are not available; hand-writing
ZeRO-1 per layer group would give up DeepSpeed's tested optimizer, sharding and state
gathering. Instead the actors linked by shared layers form one group (a connected
component), and each of them holds the union of the group's layers in its engine: it
computes only its own layers, the others' gradients are zero on it, and the group's
all-reduce then sums exactly the contributions of the actors that ran each layer. The
cost, paid only by mixed plans: each such actor keeps the union's weights and gradients
(the Adam state is still sharded 1/R over the group) and the reduction moves the union,
inside the site. Uniform plans get exactly the per-stage groups.

[Note: gradient scale of a mixed plan] DeepSpeed divides the last stage's loss by the
pipeline's micro-batch count ``M_r`` and the group's reduced gradient by its size ``R``.
The step needs the mean over all ``M`` micro-batches of the global batch, so each actor
multiplies the gradient it accumulates into its weights by ``M_r · R / M``
(:func:`grad_scale`; exactly 1 for identical pipelines) and sends upstream the input
gradient without that factor, so the next stage applies its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from geopipe.plan import ActorKey, Plan

__all__ = ["Key", "SiteWorld", "grad_scale", "site_worlds"]

Key = ActorKey  # (stage, pipeline)


@dataclass(frozen=True)
class SiteWorld:
    """One site's process group: its members in rank order and their ZeRO-1 groups."""

    site: str
    members: tuple[Key, ...]  # rank i is members[i]
    groups: tuple[tuple[int, ...], ...]  # ranks of each ZeRO-1 group; they partition the world
    group_of: dict[Key, int] = field(default_factory=dict)
    hold: dict[Key, tuple[int, int]] = field(default_factory=dict)  # layers each engine holds

    def rank(self, key: Key) -> int:
        return self.members.index(key)


def site_worlds(plan: Plan) -> list[SiteWorld]:
    """The worlds of ``plan``'s sites, in pipeline order of first appearance.

    Ranks go stage by stage, pipelines in order (for identical pipelines: ``stage·D + r``,
    each stage's replicas one group); the groups are :meth:`Plan.shared_groups`."""
    held = plan.held_layers()
    out = []
    for site, groups in plan.shared_groups().items():
        members = tuple(key for key in plan.actors() if plan.site_of(*key) == site)
        rank = {key: i for i, key in enumerate(members)}
        ranks = tuple(tuple(rank[key] for key in g) for g in groups)
        group_of = {key: g for g, keys in enumerate(groups) for key in keys}
        out.append(SiteWorld(site, members, ranks, group_of, {k: held[k] for k in members}))
    return out


def grad_scale(plan: Plan, key: Key) -> float:
    """The factor actor ``key`` applies to its weight gradients (see the module note)."""
    size = next(len(g) for gs in plan.shared_groups().values() for g in gs if key in g)
    # The mean is over the actor's own replica group's micro-batches ([Note: replica groups]
    # in geopipe.plan): every micro-batch of the global batch for a synchronous plan.
    total = plan.group_microbatches(plan.group_of(key[1]))
    return plan.microbatches_of(key[1]) * size / total
