"""The per-site checkpoint store actors of one run: where each goes (beside a live actor
of its site), made together, found live after a failure, stopped with the run.

Its own module because this is the stores' lifecycle as Ray actors, apart from what
:class:`~geopipe.runtime.control.sitecopies.SiteCopies` (a subclass) does through them:
saving a checkpoint's copies and restoring from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geopipe.checkpoint.restore import copy_sites
from geopipe.checkpoint.store import CheckpointError
from geopipe.config import ClusterSpec
from geopipe.runtime.control.cluster import kill_actors
from geopipe.runtime.control.health import quiet_get, ref_failed
from geopipe.runtime.control.workers import SpawnOptions, Workers, ask
from geopipe.runtime.storage.sitestore import PullBound, SiteStore

__all__ = ["STORE_CONCURRENCY", "SiteStoreActors", "StoreUnusable"]


class StoreUnusable(CheckpointError):
    """A site's checkpoint store could not start (its directory cannot be made, ...)."""

    def __init__(self, site: str, root: Path | str, cause: str) -> None:
        super().__init__(f"site {site} cannot use {root}: {cause}")
        self.site = site


# Calls a store serves at once: a save's pulls, and beside them pings, holdings, aborts.
STORE_CONCURRENCY = 4


class SiteStoreActors:
    """The store actors of one run's sites, by site; :class:`SiteCopies` saves and
    restores through them."""

    def __init__(
        self,
        spec: ClusterSpec,
        workers: Workers,
        actors: Callable[[], list[list[Any]]],
        stage_sites: Callable[[], list[str]],
        actor_sites: Callable[[], list[tuple[Any, str]]] | None,
        creds: Any,
    ) -> None:
        self.spec = spec
        self.workers = workers  # makes the stores and calls them and the stage actors
        self.creds = creds  # the run's data-plane credentials, for the stores' chunk servers
        # The run's identity for the stores ({"id", "lineage", "fresh"}, see
        # CheckpointCoordinator.identify), and what fresh stores moved aside.
        self.run: dict | None = None
        self.moved_aside: dict[str, tuple[str, str]] = {}
        self._opened: set[str] = set()  # sites whose store was made once (fresh only then)
        self._actor_sites = actor_sites  # every actor with its site (a mix's rows mix sites)
        self._actors = actors
        self._stage_sites = stage_sites
        self._stores: dict[str, Any] = {}
        self._made = 0
        self._handles: dict[str, Any] = {}  # every store ever made, by Ray name (close)

    # -- where ---------------------------------------------------------------------------------
    def root(self, site: str) -> Path:
        """The checkpoint directory of ``site`` (absolute, as the driver resolves it)."""
        return Path(self.spec.training.checkpoint.dir_for(site, "")).absolute()

    def roots(self) -> dict[str, str]:
        return {s.name: str(self.root(s.name)) for s in self.spec.sites}

    def copy_sites(self) -> list[str]:
        return copy_sites(self._stage_sites(), self.spec.training.checkpoint.replicated)

    # -- the stores ----------------------------------------------------------------------------
    def _node_of(self, site: str) -> str | None:
        """The node of a live actor of the current layout in ``site`` (its store goes
        there): after a failure some of the site's actors may be dead."""
        if self._actor_sites is not None:
            cands = [a for a, s in self._actor_sites() if s == site]
        else:
            rows = self._actors()
            cands = [
                a
                for k, s in enumerate(self._stage_sites())
                if s == site and k < len(rows)
                for a in rows[k]
            ]
        for a in cands:
            node = quiet_get(self.workers, [self.workers.call(a, "node_id")], 10)[0]
            if node is not None:
                return node
        return None

    def store(self, site: str) -> Any:
        """The store of ``site``, created beside the site's stage actors when missing."""
        return self.open_stores([site])[site]

    def open_stores(self, sites: list[str]) -> dict[str, Any]:
        """The stores of ``sites``, the missing ones created together (each is a new actor
        process: made one after another they cost a launch one start-up per site)."""
        made: dict[str, Any] = {}
        current = sites[0] if sites else ""
        try:
            for current in sites:
                if current not in self._stores:
                    made[current] = self._create(current)
            for current, handle in list(made.items()):
                ask(self.workers, [handle], "ping")  # the directory could not be made: fail here
                moved = ask(self.workers, [handle], "moved")[0]
                if moved is not None:
                    self.moved_aside[current] = tuple(moved)
                self._stores[current] = made.pop(current)
        except Exception as exc:  # any reason: say which site, and the cause's last line
            failed = current
            for handle in made.values():  # started, never to be used: no name left taken
                with contextlib.suppress(Exception):
                    self.workers.kill(handle)
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            raise StoreUnusable(failed, self.root(failed), lines[-1]) from None
        return {s: self._stores[s] for s in sites}

    def _create(self, site: str) -> Any:
        node = self._node_of(site)
        if node is None:
            raise CheckpointError(f"no actor runs in site {site}: nowhere to place its store")
        name = f"geopipe/{self.spec.name}/{site}/checkpoints"
        self._made += 1
        if self._made > len(self.spec.sites):  # a replacement: Ray may still hold the name
            name += f"-{self._made}"
        opts = SpawnOptions(
            name=name,
            namespace=self.spec.ray.namespace,
            node=node,
            env={"OMP_NUM_THREADS": "1"},
            max_concurrency=STORE_CONCURRENCY,
        )
        ck = self.spec.training.checkpoint
        listen_all = self.spec.security.listen == "all"
        run = self._run_for(site)
        args = (site, str(self.root(site)), ck.keep, self.creds, listen_all, run, self.bound())
        handle = self.workers.spawn(SiteStore, args, opts)
        self._handles[name] = handle
        return handle

    def bound(self) -> PullBound:
        """Each pull's deadline rule, from the run's health clocks."""
        return PullBound(self.spec.health.copy_wait_s, self.spec.health.hang_factor)

    def _run_for(self, site: str) -> dict | None:
        """The run's identity for a new store of ``site``: fresh (move another run's
        checkpoints aside) only the first time, never for a replacement store."""
        if self.run is None:
            return None
        fresh = self.run["fresh"] and site not in self._opened
        self._opened.add(site)
        return {**self.run, "fresh": fresh}

    def live_stores(self, timeout: float = 30.0) -> dict[str, Any]:
        """The stores that answer within ``timeout``. Dead ones are forgotten (re-created on
        next use); slow ones (a loaded machine) are only left out of this answer."""
        refs = {s: self.workers.call(h, "ping") for s, h in self._stores.items()}
        ready, _ = self.workers.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        live = {}
        for s, r in refs.items():
            if r not in ready:
                continue
            if ref_failed(self.workers, r):
                del self._stores[s]
            else:
                live[s] = self._stores[s]
        return live

    def close(self) -> list[str]:
        """Stop the stores; returns their names (a relaunch of the run makes stores of the
        same names: see :func:`~geopipe.runtime.control.cluster.wait_released`)."""
        names = kill_actors(self.workers, self._handles)
        self._stores, self._handles = {}, {}
        return names
