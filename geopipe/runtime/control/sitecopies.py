"""Checkpoints without a shared file system: one directory per site, a copy on each.

With ``{site}`` in ``training.checkpoint.dir`` every site that holds copies (all the plan's
sites when ``replicate`` is on, the default; the first one otherwise —
:func:`geopipe.checkpoint.restore.copy_sites`) has a store actor on its own node
(:class:`~geopipe.runtime.storage.sitestore.SiteStore`). A save:

1. each stage's replicas snapshot as before (the only stall) and replica 0 encodes the
   shard in memory on a background thread;
2. every store pulls every stage's shard — its own site's over the site's network, the
   others' across the WAN, paced to :data:`LINK_SHARE` of the link — and checks each
   against the writer's SHA-256; the pulls start as soon as every shard is encoded,
   without waiting for the controller;
3. each store whose pulls all succeeded commits its copy atomically on its own disk, at
   once (the controller's next poll only collects the outcome); the manifest names every
   site meant to hold a copy (``copies``). A copy that fails leaves that site's last good
   copy in place; a writer that died mid-save is stood in for by a surviving replica of
   its stage, as with a shared directory.

After a failure the controller asks the live stores what they hold and restores the newest
checkpoint all of whose shards survive on a live site
(:func:`~geopipe.checkpoint.restore.newest_restorable`); a site of the new layout without a
copy of it first pulls one from a site that has it, then every actor loads from its own
site's copy.

No pull is waited for without end ([Note: every pull has a deadline] in
:mod:`geopipe.runtime.storage.sitestore`): nor a store's copy, past its pulls' deadlines
plus ``health.copy_wait_s`` (a save's copy then fails and counts as short, a restore's
raises and the restore goes on to an older checkpoint, as after any copy that fails).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geopipe.checkpoint.restore import Restorable, SiteCopy, newest_restorable
from geopipe.checkpoint.store import CheckpointError, Lineage, latest_complete
from geopipe.config import ClusterSpec
from geopipe.runtime.control.health import (
    ShardsUnwritten,
    answers,
    quiet_get,
    ref_failed,
    shard_wait_s,
)
from geopipe.runtime.control.reporting import Reporter
from geopipe.runtime.control.storeactors import SiteStoreActors
from geopipe.runtime.control.workers import CallTimeout, Workers, ask, call_all
from geopipe.runtime.storage.sitestore import (
    ADDRESS_WAIT_S,
    MANIFEST_WAIT_S,
    ShardSource,
)

__all__ = ["LINK_SHARE", "SiteCopies"]

# Share of a WAN link's bandwidth checkpoint replication may take. The activations of the
# D pipelines are bursty (one micro-batch at a time) and the planner keeps the link below
# saturation, so half of it, spread over the checkpoint interval, leaves them room; with
# the demo's 200 Mbit/s link a 10 MB checkpoint replicates in under a second.
LINK_SHARE = 0.5


@dataclass
class _Save:
    """A save in flight."""

    step: int
    save_id: str
    manifest: dict
    sites: list[str]  # sites receiving a copy
    writers: list[Any]  # per stage: the replica whose in-memory shard is pulled
    infos: list[Any]  # per stage: ref to that shard's ShardInfo
    flat_refs: list[Any]  # every replica's shard_written (the gathers must all finish)
    fetches: dict[str, Any]  # site -> ref of its store's fetch
    started: float
    stall_s: float
    failed: dict[str, str] = field(default_factory=dict)  # site -> why its copy failed
    # the replicas of each shard when the save began (a lost group may have left them since)
    rows: list[list[Any]] = field(default_factory=list)
    stage_sites: list[str] = field(default_factory=list)  # each shard's writer's site, then


class SiteCopies(SiteStoreActors):
    """Saving and restoring one run's checkpoints through its per-site stores (their
    lifecycle: :class:`~geopipe.runtime.control.storeactors.SiteStoreActors`)."""

    def __init__(
        self,
        spec: ClusterSpec,
        reporter: Reporter,
        actors: Callable[[], list[list[Any]]],
        stage_sites: Callable[[], list[str]],
        manifest: Callable[[int], dict],
        actor_sites: Callable[[], list[tuple[Any, str]]] | None = None,
        creds: Any = None,
        link: Callable[[str, str], Any] | None = None,
        *,
        workers: Workers,
    ) -> None:
        super().__init__(spec, workers, actors, stage_sites, actor_sites, creds)
        # The link between two sites as the run prices it now (measured at launch where
        # links are real): copies are paced by it. Default: the YAML's.
        self._link = link or spec.link
        self.reporter = reporter
        self._manifest = manifest
        self._addresses: dict[int, tuple[str, int] | None] = {}  # id(actor) -> chunk server
        self._pending: _Save | None = None
        # told of each corrupt or incomplete copy a store finds (CheckpointCoordinator)
        self.on_rejected: Callable[[str, str, str], None] | None = None
        # actors -> (their indices in the layout, their names): a ShardsUnwritten's fields
        self.who: Callable[[list[Any]], tuple[list[int], list[str]]] = lambda a: ([], [])
        self._said: set[tuple[str, str, str]] = set()
        # Replication ([k copies]): each site's newest committed copy, and the saves that
        # committed fewer copies than promised (status.json, `geopipe status`).
        self.newest_copy: dict[str, int] = {}
        self.short_saves: list[dict] = []

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Start the save of boundary ``step``: snapshot, encode, and the stores' pulls."""
        self.poll(wait=True)
        t0 = time.perf_counter()
        rows, sites = self._actors(), self._stage_sites()
        flat = [a for row in rows for a in row]
        # A dead or frozen actor raises here, before anything else (once the others have
        # answered: health.answers): the controller then recovers.
        started = call_all(self.workers, flat, "save_shard", None, step)
        stalls = answers(self.workers, flat, started, self.spec.health, self.who)
        flat_refs = call_all(self.workers, flat, "shard_written")
        first = [sum(len(r) for r in rows[:k]) for k in range(len(rows))]
        targets = self.copy_sites()
        manifest = {
            **self._manifest(step),
            "time": time.time(),
            "copies": {s: str(self.root(s)) for s in targets},
        }
        save = _Save(
            step,
            uuid.uuid4().hex,
            manifest,
            targets,
            [row[0] for row in rows],
            [flat_refs[i] for i in first],
            flat_refs,
            {},
            t0,
            max(stalls),
            rows=rows,
            stage_sites=sites,
        )
        self.live_stores(1.0)  # one that died (its node went, then came back) is re-made
        stores = {}
        for s in save.sites:
            try:
                stores[s] = self.store(s)
            except Exception as exc:  # the site is going: its copy fails, the others go on
                save.failed[s] = _short(exc)
        for s, st in stores.items():
            srcs = self._sources(save, s, sites)
            save.fetches[s] = self.workers.call(
                st, "save", step, save.save_id, manifest, srcs, *save.infos
            )
        self._pending = save

    def _sources(self, save: _Save, dst: str, sites: list[str]) -> list[ShardSource]:
        """Where ``dst``'s store reads each shard: across sites paced, over the writer's
        chunk server (the data plane), else through Ray."""
        out = []
        for k, a in enumerate(save.writers):
            if sites[k] == dst:
                out.append(ShardSource(k, a, None))
            else:
                out.append(ShardSource(k, a, self._rate(sites[k], dst), self._address(a)))
        return out

    def _address(self, actor: Any) -> tuple[str, int] | None:
        """``actor``'s chunk server (asked once per actor; None if it does not answer)."""
        key = id(actor)
        if key not in self._addresses:
            ref = self.workers.call(actor, "chunk_address")
            self._addresses[key] = quiet_get(self.workers, [ref], 30)[0]
        return self._addresses[key]

    def _rate(self, src: str, dst: str) -> float | None:
        lk = self._link(src, dst)
        return None if lk is None else LINK_SHARE * lk.bandwidth_bps / 8

    def poll(self, wait: bool = False, strict: bool = False) -> None:
        """Commit the copies of the save in flight once its pulls are done (``wait``: wait
        for them); a writer that died is stood in for. If no copy commits: an event and a
        warning (the previous checkpoint stays the newest; a failure behind it is the next
        step's to find), or with ``strict`` (the run's last save) an error."""
        save = self._pending
        if save is None:
            return
        if wait:  # the shards at most shard_wait_s (a wedged writer), the pulls as they go
            self._await_shards(save)
            self._await_copies(save)
        refs = save.flat_refs + list(save.fetches.values())
        ready, _ = self.workers.wait(refs, num_returns=len(refs), timeout=None if wait else 0)
        if len(ready) < len(refs):
            return
        self._pending = None
        failed = {s: r for s, r in save.fetches.items() if ref_failed(self.workers, r)}
        if failed:
            self._stand_in(save, failed)
        self._finish(save, strict)

    def _await_shards(self, save: _Save) -> None:
        """Wait for the save's shard encodings as long as :func:`shard_wait_s` allows; past
        that drop the save (each site's previous copy stays its newest) and raise
        :class:`ShardsUnwritten` naming the actors whose shards never came."""
        refs, wait_s = save.flat_refs, shard_wait_s(save.stall_s, self.spec.health)
        ready, _ = self.workers.wait(refs, num_returns=len(refs), timeout=wait_s)
        if len(ready) == len(refs):
            return
        self._drop(save)
        flat = [a for row in save.rows for a in row]
        stuck = [a for a, r in zip(flat, refs, strict=True) if r not in ready]
        raise ShardsUnwritten(*self.who(stuck), save.step, wait_s)

    def _await_copies(self, save: _Save) -> None:
        """Wait for each site's copy as long as its pulls' deadlines allow, plus
        ``health.copy_wait_s`` for its commit; a copy still unfinished then (a frozen store)
        is abandoned and counted as failed, never waited for without end."""
        bound, w = self.bound(), self.workers
        infos = quiet_get(w, save.infos, 0)  # written by now (_await_shards)
        t0 = time.monotonic()
        limit = {
            s: bound.floor_s
            + sum(
                bound.seconds(getattr(info, "bytes", 0), None if src == s else self._rate(src, s))
                for info, src in zip(infos, save.stage_sites, strict=False)
            )
            for s in save.fetches
        }
        for s in sorted(save.fetches, key=limit.__getitem__):
            left = max(0.0, t0 + limit[s] - time.monotonic())
            if w.wait([save.fetches[s]], num_returns=1, timeout=left)[0]:
                continue
            del save.fetches[s]
            save.failed[s] = f"not copied within {limit[s]:.0f} s (the pulls' deadlines)"
            if s in self._stores:
                w.call(self._stores[s], "abort", save.step, save.save_id)

    def _drop(self, save: _Save) -> None:
        """Abandon the save in flight: the stores discard what they pulled of it."""
        self._pending = None
        for s in save.fetches:
            if s in self._stores:
                self.workers.call(self._stores[s], "abort", save.step, save.save_id)

    def _stand_in(self, save: _Save, failed: dict[str, Any]) -> None:
        """Stages whose writer died: a surviving replica encodes the shard instead, and the
        sites whose pulls failed pull again (they keep what they already have)."""
        w = self.workers
        rows = save.rows  # the actors the save called, whatever the run lost since
        flat_failed = {
            id(a)
            for a, r in zip([a for row in rows for a in row], save.flat_refs, strict=True)
            if ref_failed(w, r)
        }
        for k, ref in enumerate(save.infos):
            if not ref_failed(w, ref):
                continue
            for a in rows[k][1:] if k < len(rows) else []:
                if id(a) in flat_failed:
                    continue
                info = w.call(a, "write_shard_instead", save.step)
                if quiet_get(w, [info], 60)[0] is not None:
                    save.writers[k], save.infos[k] = a, info
                    self.reporter.event("checkpoint_stand_in", step=save.step, stage=k)
                    break
        live = self.live_stores()
        again = {
            s: w.call(
                live[s],
                "save",
                save.step,
                save.save_id,
                save.manifest,
                self._sources(save, s, save.stage_sites),
                *save.infos,
            )
            for s in failed
            if s in live
        }
        for s, ref in again.items():
            save.fetches[s] = ref
        if again:
            w.wait(
                list(again.values()), num_returns=len(again), timeout=self.spec.health.copy_wait_s
            )

    def _finish(self, save: _Save, strict: bool) -> None:
        """Collect the sites' commits; abandon the copies that failed; report."""
        committed: dict[str, dict] = {}
        for s, ref in save.fetches.items():
            store = self._stores.get(s)
            try:
                committed[s] = self.workers.get([ref], timeout=0)[0]
            except Exception as exc:  # any failure loses only this copy
                save.failed[s] = _short(exc)
                if store is not None:
                    self.workers.call(store, "abort", save.step, save.save_id)
        flat = [a for row in self._actors() for a in row]
        call_all(self.workers, flat, "release_shard", save.step)
        self._replication(save, committed)
        if not committed:
            self.reporter.event("checkpoint_failed", step=save.step, failed=save.failed)
            why = f"no copy of checkpoint step {save.step} could be committed: " + "; ".join(
                f"{s}: {why}" for s, why in save.failed.items()
            )
            if strict:
                raise CheckpointError(why)
            self.reporter.say(why, warning=True)
            return
        first = next(iter(committed.values()))
        copies = {s: c["path"] for s, c in committed.items()}
        self.reporter.checkpoint = {
            "step": save.step,
            "copies": copies,
            "failed": dict(save.failed),
        }
        self.reporter.event(
            "checkpoint",
            step=save.step,
            path=first["path"],
            copies=copies,
            failed_copies=save.failed,
            stall_s=save.stall_s,
            seconds=time.perf_counter() - save.started,
            bytes=first["bytes"],
            pruned=sorted({p for c in committed.values() for p in c["pruned"]}),
            transferred={s: c.get("via", {}) for s, c in committed.items()},
        )
        if save.failed:
            failed = f"{', '.join(save.failed)} ({'; '.join(save.failed.values())})"
            self.reporter.say(f"checkpoint step {save.step}: copy failed on {failed}")

    def _replication(self, save: _Save, committed: dict[str, dict]) -> None:
        """Count a save that committed fewer copies than promised, and note which sites'
        newest copy is behind the newest checkpoint: the reporter puts both in status.json
        (``replication``), so a run cannot end with fewer copies than ``replicate``
        promises and say so only in its log."""
        for s in committed:
            self.newest_copy[s] = save.step
        if len(committed) < len(save.sites):
            missing = {s: save.failed.get(s, "no copy committed") for s in save.sites}
            missing = {s: why for s, why in missing.items() if s not in committed}
            self.short_saves.append({"step": save.step, "failed": missing})
        newest = max(self.newest_copy.values(), default=None)
        behind = {
            s: self.newest_copy.get(s)
            for s in self.copy_sites()
            if newest is not None and self.newest_copy.get(s, -1) < newest
        }
        self.reporter.replication = {
            "promised": len(save.sites),
            "newest_step": newest,
            "newest_copy": dict(self.newest_copy),
            "behind": behind,
            "short_saves": len(self.short_saves),
            "last_short": self.short_saves[-1] if self.short_saves else None,
        }
        if behind:
            self.reporter.event("replication_short", step=save.step, behind=behind)

    def settle(self) -> None:
        """After a failure: commit what can be committed of the save in flight, abandon the
        rest (each site's previous copy stays its newest)."""
        save = self._pending
        if save is None:
            return
        refs = save.flat_refs + list(save.fetches.values())
        settle_s = self.spec.health.settle_s
        ready, _ = self.workers.wait(refs, num_returns=len(refs), timeout=settle_s)
        if len(ready) == len(refs):
            self.poll(wait=True)
            return
        self._drop(save)
        self.reporter.event("checkpoint_abandoned", step=save.step)

    # -- restoring -----------------------------------------------------------------------------
    def holdings(self) -> dict[str, list[SiteCopy]]:
        """What every live store holds (complete, verified copies); the copies a store
        found corrupt or incomplete go to ``on_rejected(site, path, why)``, once each."""
        live = self.live_stores()
        stores = list(live.values())
        got = quiet_get(self.workers, call_all(self.workers, stores, "holdings"), 60)
        bad = quiet_get(self.workers, call_all(self.workers, stores, "rejected"), 30)
        for site, rejected in zip(live, bad, strict=True):
            for path, why in (rejected or {}).items():
                if (site, path, why) not in self._said and self.on_rejected is not None:
                    self._said.add((site, path, why))
                    self.on_rejected(site, path, why)
        return {s: h for s, h in zip(live, got, strict=True) if h is not None}

    def restorable(self, prefer: list[str], not_after: int | None = None) -> Restorable | None:
        """The newest checkpoint (at most ``not_after``) whose every shard survives,
        verified, on a live site."""
        held = self.holdings()
        return newest_restorable(held, held, not_after=not_after, prefer=prefer)

    def paths_for(self, point: Restorable, sites: list[str]) -> dict[str, str]:
        """Each of ``sites`` gets a complete copy of ``point`` (pulled from ``point.site``
        where missing); returns each one's directory."""
        out = {}
        for s in dict.fromkeys(sites):
            store = self.store(s)
            if s in point.complete_at:
                out[s] = ask(self.workers, [store], "path_of", point.step)[0]
            else:
                out[s] = self._copy(store, point, s)
                self.reporter.event("checkpoint_copied", step=point.step, to=s, source=point.site)
        return out

    def _copy(self, store: Any, point: Restorable, site: str) -> str:
        """``site``'s store pulls ``point`` from ``point.site``'s (unpaced: its pulls'
        deadlines assume the link's whole rate), waited for as long as those deadlines
        allow plus ``health.copy_wait_s``; past that a :class:`CheckpointError`."""
        w, bound, source = self.workers, self.bound(), self._stores[point.site]
        lk = self._link(point.site, site)
        bps = None if lk is None else lk.bandwidth_bps / 8
        doc = quiet_get(w, [w.call(source, "manifest", point.step)], MANIFEST_WAIT_S)[0]
        sizes = [e.get("bytes", 0) for e in (doc or {}).get("stages", [])]
        wait_s = bound.floor_s + MANIFEST_WAIT_S + ADDRESS_WAIT_S
        wait_s += sum(bound.seconds(n, bps) for n in sizes)
        try:
            return w.get([w.call(store, "copy_from", point.step, source, bps)], timeout=wait_s)[0]
        except CallTimeout:
            raise CheckpointError(
                f"site {site}'s copy of checkpoint step {point.step} from site {point.site} "
                f"did not finish within {wait_s:.0f} s (its pulls' deadlines)"
            ) from None

    def find_latest(
        self, lineage: Lineage | None = None
    ) -> tuple[Path, list[tuple[Path, str]]] | None:
        """The newest complete checkpoint of ``lineage`` in any site directory the driver
        sees (for ``--resume``), and the newer unusable ones skipped."""
        best, skipped = None, []
        for root in dict.fromkeys(self.roots().values()):
            if not Path(root).is_dir():
                continue
            info = latest_complete(
                root, on_skip=lambda p, r: skipped.append((p, r)), lineage=lineage
            )
            if info is not None and (best is None or info.step > best.step):
                best = info
        return None if best is None else (best.path, skipped)


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1][:200] if text else type(exc).__name__
