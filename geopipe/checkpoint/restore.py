"""Where checkpoints live when every site keeps its own directory, and which one a recovery
can restore from (pure: the runtime reports what each live site holds, these decide).

[Note: per-site copies] With ``{site}`` in ``training.checkpoint.dir`` no directory is
shared between sites: each site that holds a copy of a checkpoint holds a complete,
self-verifying checkpoint directory (manifest + every stage's shard + SHA-256s) committed
atomically on that site. A site that loses its devices may take its disk with it, so a
recovery must use what the *live* sites hold. The unit of survival is the shard: the
newest step for which every stage's shard survives on some live site can be restored,
even if no single site holds all of it (the runtime then assembles a complete copy on a
site first). Sites with a complete copy are preferred as sources, so the common case —
each surviving site holds the whole checkpoint — moves nothing between sites.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Restorable", "SiteCopy", "copy_sites", "newest_restorable"]


def copy_sites(plan_sites: Sequence[str], replicated: bool) -> list[str]:
    """The sites that receive a copy of a checkpoint saved under a plan whose stages run in
    ``plan_sites`` (pipeline order): every one of them when ``replicated``, else only the
    first (one copy: losing that site loses the checkpoints).

    Replicating to every site is the simplest rule that survives the loss of any site but
    the last, and its price is that each site receives every other site's shards: a save
    moves ``(S - 1) × checkpoint bytes`` over the WAN for S sites. [k copies] For many
    sites, copies on the first k sites (any k - 1 losses survived) would cut that to
    ``(k - 1)/(S - 1)`` of it: this function is where k would go.
    """
    sites = list(dict.fromkeys(plan_sites))
    return sites if replicated else sites[:1]


@dataclass(frozen=True)
class SiteCopy:
    """What one site holds of one checkpoint step: its stages' shards (verified)."""

    step: int
    num_stages: int  # stages of the checkpoint (from its manifest)
    stages: frozenset[int]  # shards present on this site

    @property
    def complete(self) -> bool:
        return self.stages >= frozenset(range(self.num_stages))


@dataclass(frozen=True)
class Restorable:
    """A checkpoint every stage of which survives on a live site."""

    step: int
    num_stages: int
    complete_at: tuple[str, ...]  # live sites holding a complete copy (may be empty)
    sources: Mapping[int, str]  # stage -> a live site holding its shard

    @property
    def site(self) -> str:
        """The site a restore reads from (one with a complete copy when there is one)."""
        return self.complete_at[0] if self.complete_at else self.sources[0]


def newest_restorable(
    holdings: Mapping[str, Iterable[SiteCopy]],
    live: Iterable[str],
    not_after: int | None = None,
    prefer: Sequence[str] = (),
) -> Restorable | None:
    """The newest step (≤ ``not_after`` when given) whose every shard survives on a site in
    ``live``; ``holdings[site]`` lists what each site holds. Sources prefer a site with a
    complete copy, then the sites in ``prefer`` order (e.g. the new plan's), then by name,
    so the choice is deterministic. Copies of one step that disagree on the stage count
    (not the same save) are not mixed: the count most sites report is used, ties to the
    larger one."""
    alive = set(live)
    by_step: dict[int, dict[str, SiteCopy]] = {}
    for site, copies in holdings.items():
        if site not in alive:
            continue
        for c in copies:
            if not_after is None or c.step <= not_after:
                by_step.setdefault(c.step, {})[site] = c
    rank = {s: i for i, s in enumerate(prefer)}

    def order(site: str) -> tuple[int, str]:
        return (rank.get(site, len(rank)), site)

    for step in sorted(by_step, reverse=True):
        at = by_step[step]
        counts = [c.num_stages for c in at.values()]
        n = max(set(counts), key=lambda k: (counts.count(k), k))
        same = {s: c for s, c in at.items() if c.num_stages == n}
        complete = tuple(sorted((s for s, c in same.items() if c.complete), key=order))
        sources: dict[int, str] = {}
        for k in range(n):
            holders = [s for s, c in same.items() if k in c.stages]
            if not holders:
                break
            sources[k] = min(holders, key=lambda s: (s not in complete, order(s)))
        else:
            return Restorable(step, n, complete, sources)
    return None
