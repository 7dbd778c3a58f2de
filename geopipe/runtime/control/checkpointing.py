"""Checkpoint coordination: save, poll, stand-in writers, and what a recovery restores (what
``--resume`` names is found in :mod:`.resumepoint`).

A save snapshots every stage (training stalls only for that) and writes the shards in the
background; the manifest is committed once every shard is on disk. One save at a time: a
new one first completes the last. Whatever fails mid-save, the previous complete
checkpoint stays the newest one. The writes are waited for at most
:func:`~geopipe.runtime.control.health.shard_wait_s` once needed (the next save, the last
one): a frozen or wedged writer then raises
:class:`~geopipe.runtime.control.health.ShardsUnwritten`, which recovery handles as a frozen
actor, and nothing of that save is committed — never a hang of the driver.

Two kinds of storage: one directory every node shares (the driver commits each checkpoint
there), or — with ``{site}`` in ``training.checkpoint.dir`` — one directory per site, each
holding its own complete copy committed by an actor on that site
(:mod:`geopipe.runtime.control.sitecopies`). At launch :meth:`CheckpointCoordinator.check_storage`
says which it is and warns when a "shared" directory is not visible from every site.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geopipe.checkpoint.lineage import trajectory_hash
from geopipe.checkpoint.store import (
    CheckpointError,
    CheckpointInfo,
    latest_complete,
    move_aside,
    prune,
)
from geopipe.checkpoint.verify import bad_file
from geopipe.checkpoint.writer import CheckpointWriter
from geopipe.config import ClusterSpec
from geopipe.runtime.control.cluster import LaunchError
from geopipe.runtime.control.health import (
    ShardsUnwritten,
    answers,
    quiet_get,
    ref_failed,
    shard_wait_s,
)
from geopipe.runtime.control.outerckpt import (
    outer_manifest,
    restore_outer,
    shard_rows,
    shard_sites,
)
from geopipe.runtime.control.reporting import Reporter
from geopipe.runtime.control.resumepoint import Found, RestoreFrom, ResumePoint, find_resume
from geopipe.runtime.control.sitecopies import SiteCopies
from geopipe.runtime.control.workers import WorkerFailed, Workers, ask, call_all

__all__ = ["CheckpointCoordinator"]


@dataclass
class _Pending:
    writer: CheckpointWriter
    refs: list  # one per actor of ``rows``: its ShardInfo (replica 0) or None
    started: float
    stall_s: float
    rows: list[list[Any]]  # the layout the save began on (a recovery may change the current)
    manifest: dict  # taken as the save began: it describes ``rows``, whatever comes after

    @property
    def flat(self) -> list[Any]:
        return [a for row in self.rows for a in row]


class CheckpointCoordinator:
    """Saves of one run; ``actors()`` gives the current layout's rows, ``manifest(step)`` the
    run's manifest fields; ``workers`` calls the actors."""

    def __init__(
        self,
        spec: ClusterSpec,
        run_dir: Path,
        reporter: Reporter,
        actors: Callable[[], list[list[Any]]],
        manifest: Callable[[int], dict],
        synchronous: bool = False,
        stage_sites: Callable[[], list[str]] = list,
        actor_sites: Callable[[], list[tuple[Any, str]]] | None = None,
        creds: Any = None,
        link: Callable[[str, str], Any] | None = None,
        *,
        workers: Workers,
    ) -> None:
        self.spec = spec  # the run's settings: directories, keep, replication, clocks
        self.workers = workers
        self.root = Path(spec.training.checkpoint.dir or run_dir / "checkpoints")
        self.run_dir = run_dir  # its status.json names the launch `--resume` continues
        self.reporter = reporter
        self.trajectory = trajectory_hash(spec)  # every manifest records it (lineage.py)
        self._unsaid: list[dict] = []  # skip events found before the metrics file opened
        self._said: set[tuple[str, str, str | None]] = set()
        # An outer-loop run saves one shard per (group, stage) (set by begin_outer): the
        # saves see shard rows and their writers' sites (runtime.control.outerckpt).
        self.outer: Any = None
        self._rows, self._stage_sites = actors, stage_sites
        self._actors = self._shard_rows
        self._run_manifest = manifest
        self.synchronous = synchronous
        self._pending: _Pending | None = None
        self.skipped: list[tuple[str, str]] = []  # (checkpoint, why) skipped, once each
        self.copies: SiteCopies | None = None
        if spec.training.checkpoint.per_site:
            self.copies = SiteCopies(
                spec,
                reporter,
                self._shard_rows,
                self._shard_sites,
                self._manifest,
                actor_sites,
                creds,
                link,
                workers=workers,
            )
            self.copies.on_rejected = lambda site, path, why: self.skip(path, why, site)
            self.copies.who = self._who
        # Which checkpoints are this run's (set by the controller at launch): its id, and
        # its lineage (checkpoint.store.accepts); fresh: a launch without --resume, which
        # moves another run's checkpoints aside before saving any of its own.
        self.run_id: str | None = None
        self.lineage: dict[str, int | None] | None = None
        self.fresh = False
        self._actor_sites = actor_sites

    # -- the outer loop's state ([Note: the outer-loop checkpoint]) -----------------------------
    def _group_of(self) -> Callable[[Any], int] | None:
        if self.outer is None:
            return None
        return lambda a: self.outer.group_of[id(a)]

    def _shard_rows(self) -> list[list[Any]]:
        return shard_rows(self._rows(), self._group_of())

    def _shard_sites(self) -> list[str]:
        if self.outer is None or self._actor_sites is None:
            return self._stage_sites()
        return shard_sites(self._shard_rows(), self._actor_sites())

    def _manifest(self, step: int) -> dict:
        """The run's manifest fields, with an outer-loop run's ``outer`` entry."""
        group_of = self._group_of()
        own = {**self._run_manifest(step), "trajectory_hash": self.trajectory}
        if group_of is None:
            return own
        groups = sorted({group_of(a) for a in self._flat()})
        return {**own, **outer_manifest(self.outer, groups)}

    def begin_outer(self, outer: Any, resume: ResumePoint | None) -> None:
        """From now on saves hold ``outer``'s state (an :class:`~.outerloop.OuterRounds`
        whose ``begin`` ran); on ``--resume`` every actor loads the checkpoint's outer
        state, from its own site's copy."""
        self.outer = outer
        if resume is None:
            return
        pairs = self._actor_sites() if self._actor_sites is not None else []
        paths = self.resume_paths(resume, sorted({s for _, s in pairs}))
        digests = restore_outer(self.workers, pairs, paths)
        self.reporter.event("outer_resumed", step=resume.step, theta_digests=sorted(set(digests)))

    def identify(self, run_id: str, lineage: dict[str, int | None], fresh: bool) -> None:
        self.run_id, self.lineage, self.fresh = run_id, lineage, fresh
        self.reporter.lineage = lineage  # in status.json: what a later --resume continues
        if self.copies is not None:
            self.copies.run = {"id": run_id, "lineage": lineage, "fresh": fresh}

    def where(self) -> str:
        """Where the checkpoints are, for messages."""
        if self.copies is None:
            return str(self.root)
        return ", ".join(f"{s}: {r}" for s, r in self.copies.roots().items())

    def check_storage(self, site_actors: dict[str, Any]) -> str | None:
        """At launch: make the site stores (per-site copies), or check that every site sees
        the shared directory (``site_actors``: one actor per site). Returns a warning for
        storage that a lost site would take its checkpoints with, else None."""
        ck = self.spec.training.checkpoint
        for fields in self._unsaid:  # the metrics file is open now
            self.reporter.event("checkpoint_skipped", **fields)
        self._unsaid = []
        if self.copies is not None:
            try:
                self.copies.open_stores(self.copies.copy_sites())
            except CheckpointError as exc:  # a store that cannot start: which site, why
                raise LaunchError(f"training.checkpoint.dir: {exc}") from None
            for site, (path, run) in self.copies.moved_aside.items():
                self._say_moved(path, run, site)
            warning = None
            if not ck.replicated and len(set(site_actors)) > 1:
                home = self.copies.copy_sites()[0]
                warning = (
                    f"training.checkpoint.replicate is off: checkpoints are kept only in site "
                    f"{home}'s directory ({self.copies.root(home)}); losing that site loses them"
                )
            self._storage_event("per-site", self.copies.roots(), warning)
            return warning
        if self.fresh:
            moved = move_aside(self.root)
            if moved is not None:
                self._say_moved(*moved, None)
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root.absolute() / f".geopipe-probe-{os.getpid()}"
        token = f"{time.time_ns()}"
        marker.write_text(token)
        try:
            seen = ask(self.workers, list(site_actors.values()), "sees_file", str(marker), token)
        finally:
            marker.unlink(missing_ok=True)
        blind = [s for s, ok in zip(site_actors, seen, strict=True) if not ok]
        warning = None
        if blind:
            warning = (
                f"training.checkpoint.dir ({self.root.absolute()}) is not shared: site(s) "
                f"{', '.join(blind)} do not see it and replication is off, so their shards "
                "cannot reach a checkpoint; use shared storage, or put {site} in the path "
                "(each site then keeps a complete, replicated copy)"
            )
        self._storage_event("shared", {s: str(self.root.absolute()) for s in site_actors}, warning)
        return warning

    def _say_moved(self, path: Path | str, run: str, site: str | None) -> None:
        """A fresh launch found another run's checkpoints: they were moved, not adopted."""
        where = f" (site {site})" if site else ""
        self.reporter.say(
            f"moved the checkpoints of run {run}{where} to {path}; resume them "
            f"with --resume {path}/step-…"
        )
        self.reporter.event("checkpoints_moved_aside", run=run, path=str(path), site=site)

    def _storage_event(self, mode: str, dirs: dict[str, str], warning: str | None) -> None:
        self.reporter.checkpoint_dirs = dirs
        self.reporter.event(
            "checkpoint_storage",
            mode=mode,
            dirs=dirs,
            warning=warning,
            replicated=self.spec.training.checkpoint.replicated,
        )
        if warning:
            self.reporter.say(warning, warning=True)

    def close(self) -> list[str]:
        """Stop the site stores; returns their names (see ``SiteCopies.close``)."""
        return self.copies.close() if self.copies is not None else []

    def _flat(self) -> list[Any]:
        return [a for row in self._actors() for a in row]

    def _who(self, actors: list[Any]) -> tuple[list[int], list[str]]:
        """``actors``' indices in the layout's order (``rows[stage][replica]`` flattened, the
        order a recovery's :class:`ShardsUnwritten` indices follow) and their names."""
        sites = {id(a): f"{s}/" for a, s in self._actor_sites()} if self._actor_sites else {}
        layout = [(k, r, a) for k, row in enumerate(self._rows()) for r, a in enumerate(row)]
        place = {
            id(a): (i, f"{sites.get(id(a), '')}stage{k}/r{r}") for i, (k, r, a) in enumerate(layout)
        }
        found = [place[id(a)] for a in actors if id(a) in place]
        return [i for i, _ in found], [name for _, name in found]

    # -- save ----------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Start the save of step boundary ``step`` (finishing the previous save first)."""
        if self.copies is not None:
            self.copies.save(step)
            if self.synchronous:
                self.copies.poll(wait=True)
            return
        self.poll(wait=True)
        t0 = time.perf_counter()
        writer = CheckpointWriter(self.root, step)
        rows = [list(row) for row in self._actors()]
        flat, manifest = [a for row in rows for a in row], self._manifest(step)
        started = call_all(self.workers, flat, "save_shard", str(writer.tmp_dir), step)
        try:
            stalls = answers(self.workers, flat, started, self.spec.health, self._who)
        except BaseException:
            self._pending = self._cut_short(writer, rows, started, t0, manifest=manifest)
            raise
        # Every replica's background thread takes part in the gather; replica 0's writes.
        refs = call_all(self.workers, flat, "shard_written")
        self._pending = _Pending(writer, refs, t0, max(stalls), rows, manifest)
        if self.synchronous:
            self.poll(wait=True)

    def _cut_short(
        self,
        writer: CheckpointWriter,
        rows: list[list[Any]],
        started: list,
        t0: float,
        *,
        manifest: dict,
    ) -> _Pending:
        """A save an actor failed as it began (dead just before): the others already write
        into ``writer``'s directory, so it stays in flight for the recovery's :meth:`settle`
        (commits if every shard is written, else aborts once the writers are done or
        ``health.settle_s`` passed). Aborting here removed the directory under the survivors'
        writers, whose error then failed the run after the recovery."""
        wait_s = self.spec.health.settle_s  # a frozen actor: settle() waits it out again
        ready, _ = self.workers.wait(started, num_returns=len(started), timeout=wait_s)
        flat = [a for row in rows for a in row]
        refs = [  # a frozen one's shard_written may answer None: its shard is then missing
            ref
            if ref in ready and ref_failed(self.workers, ref)
            else self.workers.call(a, "shard_written")
            for a, ref in zip(flat, started, strict=True)
        ]
        return _Pending(writer, refs, t0, 0.0, rows, manifest)

    def poll(self, wait: bool = False, final: bool = False) -> None:
        """Commit the save in flight if its shards are written (``wait``: until they are)."""
        if self.copies is not None:  # ``final``: the run's last save must commit
            self.copies.poll(wait, strict=final)
            return
        pending = self._pending
        if pending is None:
            return
        refs = pending.refs  # waited for at most shard_wait_s: a wedged writer is no hang
        wait_s = shard_wait_s(pending.stall_s, self.spec.health) if wait else 0
        ready, _ = self.workers.wait(refs, num_returns=len(refs), timeout=wait_s)
        if len(ready) < len(refs) and not wait:
            return
        self._pending = None
        writer = pending.writer
        try:
            if len(ready) < len(refs):  # nothing of the save is committed
                stuck = [a for a, r in zip(pending.flat, refs, strict=True) if r not in ready]
                raise ShardsUnwritten(*self._who(stuck), writer.step, wait_s)
            path = self._commit(pending)
        except BaseException:
            writer.abort()  # the previous checkpoint stays the newest complete one
            raise
        # the stand-in copies are no longer needed (a recovery may have left some behind)
        flat = self._flat()
        call_all(self.workers, [a for a in pending.flat if a in flat], "release_shard", writer.step)
        deleted = prune(self.root, self.spec.training.checkpoint.keep, own=self.run_id)
        self.reporter.checkpoint = {"step": writer.step, "copies": {"shared": str(path)}}
        self.reporter.event(
            "checkpoint",
            step=writer.step,
            path=str(path),
            stall_s=pending.stall_s,
            seconds=time.perf_counter() - pending.started,
            bytes=sum(f.stat().st_size for f in path.iterdir()),
            pruned=[p.name for p in deleted],
        )

    def _commit(self, pending: _Pending) -> Path:
        writer = pending.writer
        # A replica that failed after its stage's shard was written (by replica 0) does not
        # spoil the checkpoint: commit() checks that every stage's shard is there.
        errors = []
        for ref in pending.refs:
            try:
                info = self.workers.get([ref])[0]
            except Exception as exc:
                errors.append(exc)
                continue
            if info is not None and info.stage not in writer.stages_written:
                writer.add_shard(info)
        if errors:  # a replica died while saving: survivors write the shards it owed
            self._stand_in_writers(writer, pending)
        try:
            return writer.commit(pending.manifest, num_stages=len(pending.rows))
        except CheckpointError:
            if errors:  # a stage's writer failed: say why, not just "shard missing"
                raise errors[0] from None
            raise

    def _stand_in_writers(self, writer: CheckpointWriter, pending: _Pending) -> None:
        """Shards whose writer (replica 0) died mid-save are written by a surviving replica
        of the same stage: every replica gathered the same full state for the save."""
        refs_of = dict(zip(map(id, pending.flat), pending.refs, strict=True))
        for k, row in enumerate(pending.rows):
            if k in writer.stages_written:
                continue
            for a in row[1:]:
                if ref_failed(self.workers, refs_of[id(a)]):
                    continue
                ref = self.workers.call(a, "write_shard_instead", writer.step)
                info = quiet_get(self.workers, [ref], 60)[0]
                if info is not None:
                    writer.add_shard(info)
                    self.reporter.event("checkpoint_stand_in", step=writer.step, stage=k)
                    break

    def settle(self) -> None:
        """After a failure (the frozen already killed): commit the save in flight if every
        shard made it, else drop it (the previous complete checkpoint stays the newest)."""
        if self.copies is not None:
            self.copies.settle()
            return
        pending, self._pending = self._pending, None
        if pending is None:
            return
        ready, _ = self.workers.wait(
            pending.refs, num_returns=len(pending.refs), timeout=self.spec.health.settle_s
        )
        if len(ready) == len(pending.refs):  # poll() stands in for writers that died
            self._pending = pending
            try:
                self.poll(wait=True)
                return
            except Exception:  # a shard failed with its writer: poll() aborted it
                pass
        else:
            pending.writer.abort()
        self.reporter.event("checkpoint_abandoned", step=pending.writer.step)

    def resume_paths(self, resume: ResumePoint, sites: list[str]) -> dict[str, str]:
        """Where the actors of each site read ``resume`` from: with per-site copies their
        own site's copy, verified (pulled from a site that holds one where missing), else
        the path the driver found (and verified)."""
        if self.copies is not None:
            point = self.copies.restorable(sites, not_after=resume.step)
            if point is not None and point.step == resume.step:
                found = Found(point.step, point.site, point)
                restore = self.restore_from(found, sites)
                if restore.step == resume.step:
                    return restore.paths
        return {s: resume.path for s in sites}

    # -- lookup --------------------------------------------------------------------------------
    def skip(self, path: Path | str, reason: str, site: str | None = None) -> None:
        """A checkpoint a resume or a recovery will not load (corrupt or incomplete): one
        console line and a ``checkpoint_skipped`` event naming the bad file (kept until the
        metrics file opens when found before it)."""
        if (str(path), reason, site) in self._said:  # each recovery looks again: said once
            return
        self._said.add((str(path), reason, site))
        where = f" (site {site})" if site else ""
        self.reporter.say(f"skipping checkpoint {path}{where}: {reason}", warning=True)
        self.skipped.append((Path(path).name, reason))
        fields = {"path": str(path), "file": bad_file(reason), "reason": reason, "site": site}
        if self.reporter.sink is None:
            self._unsaid.append(fields)
        else:
            self.reporter.event("checkpoint_skipped", **fields)

    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint of the run's lineage whose every shard verifies (newer
        unusable ones are skipped, said and recorded)."""
        if not self.root.is_dir():
            return None
        return latest_complete(self.root, on_skip=self.skip, lineage=self.lineage)

    def newest(self, prefer: list[str]) -> Found | None:
        """The newest checkpoint a recovery can restore: in the shared directory, or the
        newest whose every shard survives on a live site (preferring ``prefer``'s copies)."""
        if self.copies is None:
            info = self.latest()
            return None if info is None else Found(info.step, None, info)
        point = self.copies.restorable(prefer)
        return None if point is None else Found(point.step, point.site, point)

    def restore_from(self, found: Found, sites: list[str]) -> RestoreFrom:
        """Make ``found`` loadable by actors in ``sites``: each site's own copy (pulled from
        a site holding one where missing; each store verifies the copy it hands over), or
        the shared directory (verified by :meth:`latest`). A copy that fails verification
        now is skipped for the newest good checkpoint before it."""
        if self.copies is None:
            return RestoreFrom(found.step, {s: str(found.handle.path) for s in sites}, None)
        while True:
            try:
                paths = self.copies.paths_for(found.handle, sites)
                return RestoreFrom(found.step, paths, found.site)
            except (CheckpointError, WorkerFailed) as exc:
                self.reporter.event("checkpoint_restore_failed", step=found.step, why=str(exc))
                older = self.copies.restorable(sites, not_after=found.step - 1)
                if older is None:  # unrecoverable: said as the launch's errors are
                    raise LaunchError(
                        f"no checkpoint of the run verifies on a live site: {exc}"
                    ) from None
                found = Found(older.step, older.site, older)

    def load_into(self, resume: ResumePoint, rows: list[list[Any]], sites: list[str]) -> None:
        """Every stage actor (``rows[stage][replica]``, stage ``k`` in ``sites[k]``) loads its
        layers of the checkpoint ``resume`` names, from its own site's copy."""
        paths = self.resume_paths(resume, sites)
        w = self.workers
        steps = w.get(
            [
                w.call(a, "load_checkpoint", paths[sites[k]])
                for k, row in enumerate(rows)
                for a in row
            ]
        )
        if set(steps) != {resume.step}:
            raise LaunchError(
                f"--resume: the stages loaded steps {sorted(set(steps))}, not {resume.step}"
            )

    def find_resume(self, resume: str | bool, run_id: str | None = None) -> ResumePoint | None:
        """The checkpoint ``--resume`` names (True: the newest complete one of the lineage
        of the last launch in the run directory: [Note: resuming a lineage])."""
        return find_resume(self, resume, run_id)
