"""A site's checkpoint store: the actor that keeps checkpoint copies on that site's disk.

With ``{site}`` in ``training.checkpoint.dir`` (see :mod:`geopipe.checkpoint.restore`) no
directory is shared between sites, and the driver may not see any of them. Each site that
holds copies gets one :class:`SiteStore` actor, placed on a node of the site (beside its
stage actors), named ``geopipe/<run>/<site>/checkpoints``. It pulls each stage's shard —
from the stage replica that encoded it in memory, or from another site's store — writes,
fsyncs and checks it against the writer's SHA-256, and commits the copy atomically with the
same :class:`~geopipe.checkpoint.writer.CheckpointWriter` the shared directory uses: a copy
is a complete, self-verifying checkpoint directory, and one that fails (a source died, a
checksum is wrong, the save was abandoned) never touches the site's last good one.

Transport: the puller reads 4 MiB pieces, two in flight. Across sites over the data plane
— one TCP stream to the holder's chunk server (:mod:`geopipe.transport.bulk`), no Ray on
the bulk path: through Ray each piece would be an object-store pull costing several round
trips over a long link — paced to a share of the WAN link's bandwidth so the activations
keep the rest (:data:`geopipe.runtime.control.sitecopies.LINK_SHARE`). Inside a site, and when a
holder's chunk server cannot be reached, through Ray actor calls.

[Note: every pull has a deadline]
A pull's deadline is what the run knows of it: ``health.hang_factor`` x its bytes over the
rate it is paced at (a copy: :data:`~geopipe.runtime.control.sitecopies.LINK_SHARE` of the
link) or, unpaced, the link's rate (a restore's copy), at least ``health.copy_wait_s``
(a pull inside a site, whose rate the run does not price, gets that floor alone):
:class:`PullBound`. It holds however the holder answers: over the data plane each
receive waits only the time left (a server that accepts and never answers, or trickles
a byte at a time, cannot renew it), through Ray each chunk's wait is cut to it. Past it
the pull raises :class:`PullTimeout`, its file is unlinked, and nothing of it reaches a
committed copy: a save's copy counts as failed (a replication shortfall,
:mod:`geopipe.runtime.control.sitecopies`), a restore's copy is abandoned whole and the
error names the file, the source and the bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geopipe.checkpoint.restore import SiteCopy
from geopipe.checkpoint.rootdir import step_dirname
from geopipe.checkpoint.store import (
    _RESERVED,
    MANIFEST,
    CheckpointError,
    ShardInfo,
    accepts,
    list_checkpoints,
    load_checkpoint,
    move_aside,
    prune,
)
from geopipe.checkpoint.verify import signature
from geopipe.checkpoint.writer import CheckpointWriter
from geopipe.runtime.node import node_ip
from geopipe.transport.bulk import ChunkClient, ChunkError, ChunkServer, ChunkTimeout
from geopipe.transport.security import RunCredentials

__all__ = ["CHUNK_BYTES", "PullBound", "PullTimeout", "ShardSource", "SiteStore"]

CHUNK_BYTES = 4 << 20  # one pull request
_IN_FLIGHT = 2  # chunks requested ahead, so a long round trip does not idle the link
# How long a store waits on another store over Ray: for a 4 MiB chunk across a slow WAN,
# for a manifest (a small document), and for the address of its chunk server.
CHUNK_WAIT_S = 120.0
MANIFEST_WAIT_S = 60.0
ADDRESS_WAIT_S = 30.0
_FILE_RE = re.compile(r"^(stage-\d+\.safetensors|manifest\.json)$")


@dataclass(frozen=True)
class PullBound:
    """How long a pull may take ([Note: every pull has a deadline]): ``factor`` x its
    bytes over its rate, at least ``floor_s`` (the run's ``health.hang_factor`` and
    ``health.copy_wait_s``; these defaults are theirs)."""

    floor_s: float = 120.0
    factor: float = 20.0

    def seconds(self, nbytes: int, bps: float | None) -> float:
        """The bound of a pull of ``nbytes`` at ``bps`` bytes/s (None: not priced)."""
        return max(self.floor_s, self.factor * nbytes / bps) if bps else self.floor_s


class PullTimeout(CheckpointError):
    """A pull passed its deadline (a stalled or trickling holder, a link far slower than
    planned): abandoned, its file unlinked."""


@dataclass(frozen=True)
class ShardSource:
    """Where a store pulls a shard from: any actor with ``read_chunk(step, file, offset,
    size)`` (a stage replica holding it in memory, or another site's store)."""

    stage: int
    actor: Any
    rate_bps: float | None  # bytes/s to pace at when crossing sites; None: no pacing
    address: tuple[str, int] | None = None  # the holder's chunk server (data plane)
    deadline_bps: float | None = None  # the rate its deadline assumes (None: rate_bps)


class SiteStore:
    """The actor body (wrapped with ``ray.remote`` by :mod:`geopipe.runtime.control.sitecopies`)."""

    def __init__(
        self,
        site: str,
        root: str,
        keep: int,
        creds: RunCredentials | None = None,
        listen_all: bool = False,
        run: dict | None = None,
        bound: PullBound | None = None,
    ) -> None:
        # Not at a lower CPU priority (os.nice): tried, it barely moved the replication
        # stall, and under heavy load a niced store did not answer a recovery's questions
        # for seconds.
        self.site = site
        self.root = Path(root)
        # Which checkpoints are the run's ({"id", "lineage", "fresh"}; None: all, tests):
        # only those are restored from or pruned; a fresh run moves others aside first.
        self.run_id = run["id"] if run else None
        self.lineage = run["lineage"] if run else None
        self._moved = move_aside(self.root) if run and run["fresh"] else None
        self.root.mkdir(parents=True, exist_ok=True)  # fails here, at launch, if it cannot
        self.keep = keep
        self.bound = bound or PullBound()  # each pull's deadline (the run's health clocks)
        self.creds, self.listen_all = creds, listen_all  # the data plane's protection
        self._lock = threading.Lock()
        self._writers: dict[int, tuple[str, CheckpointWriter]] = {}  # step -> (save id, w)
        self._cancelled: set[str] = set()
        self._late: dict[str, str] = {}  # save id -> its pull past its deadline (not again)
        # copies hashed once, by (step, directory signature): [Note: what is verified, when]
        self._verified: dict[tuple[int, tuple], SiteCopy] = {}
        self._rejected: dict[str, str] = {}  # copy path -> why it failed verification
        self.get: Any = None  # ray.get unless a test plugs in another (the seam for fakes)
        self._server: ChunkServer | None = None
        self._via: dict[int, dict[str, int]] = {}  # step -> bytes copied per path

    def chunk_address(self) -> tuple[str, int]:
        """This store's chunk server (other sites' stores read its copies through it)."""
        if self._server is None:
            host = "0.0.0.0" if self.listen_all else node_ip()
            self._server = ChunkServer(self.read_chunk, host, self.creds, node_ip())
        return self._server.address

    def ping(self) -> str:
        return self.site

    def moved(self) -> tuple[str, str] | None:
        """Where another run's checkpoints went when this store started (path, run id)."""
        return None if self._moved is None else (str(self._moved[0]), self._moved[1])

    # -- saving a copy -------------------------------------------------------------------------
    def _writer(self, step: int, save_id: str) -> CheckpointWriter:
        with self._lock:
            if save_id in self._cancelled:
                raise CheckpointError(f"the save of step {step} was abandoned")
            held = self._writers.get(step)
            if held is not None and held[0] == save_id:
                return held[1]
            if held is not None:  # superseded: its late pulls stop, its directory goes
                self._cancelled.add(held[0])
                held[1].abort()
            w = CheckpointWriter(self.root, step)  # a directory of its own, never held's
            self._writers[step] = (save_id, w)
            return w

    def fetch(
        self, step: int, save_id: str, sources: list[ShardSource], *infos: ShardInfo
    ) -> list[int]:
        """Pull the shards of checkpoint ``step`` into this site's copy in progress;
        ``infos[i]`` (resolved by Ray before this runs) is ``sources[i]``'s file, size and
        checksum. Returns the stages the copy holds so far. A save one of whose pulls
        passed its deadline is not pulled again (the driver's stand-in retry would only
        wait as long once more on the link that was too slow): the same error at once."""
        writer = self._writer(step, save_id)
        if save_id in self._late:
            raise PullTimeout(self._late[save_id])
        for src, info in zip(sources, infos, strict=True):
            if info.stage not in writer.stages_written:
                try:
                    self._pull(step, save_id, writer.tmp_dir, src, info)
                except PullTimeout as exc:
                    self._late[save_id] = str(exc)
                    raise
                writer.add_shard(info)
        return sorted(writer.stages_written)

    def save(
        self,
        step: int,
        save_id: str,
        manifest: dict,
        sources: list[ShardSource],
        *infos: ShardInfo,
    ) -> dict:
        """:meth:`fetch` every stage's shard, then :meth:`commit` — all on this site, so no
        round trip to the driver stands between the last shard and the copy's commit."""
        self.fetch(step, save_id, sources, *infos)
        return self.commit(step, save_id, manifest, len(sources))

    def commit(self, step: int, save_id: str, manifest: dict, num_stages: int) -> dict:
        """Seal this site's copy of ``step`` (manifest last, fsync, rename), then prune."""
        with self._lock:
            held = self._writers.pop(step, None)
        if held is None or held[0] != save_id:
            raise CheckpointError(f"no copy of step {step} is being written on {self.site}")
        try:
            path = held[1].commit(manifest, num_stages=num_stages)
        except BaseException:
            held[1].abort()  # this copy failed; the site's last good one is untouched
            raise
        self._remember(path, step, num_stages)
        size = sum(f.stat().st_size for f in path.iterdir())
        pruned = prune(self.root, self.keep, own=self.run_id)
        via = self._via.pop(step, {})
        return {"path": str(path), "bytes": size, "pruned": [p.name for p in pruned], "via": via}

    def abort(self, step: int, save_id: str) -> None:
        """Give up this save's copy of ``step`` (a pull still running fails at its next
        chunk); the site's previous copies are untouched."""
        with self._lock:
            self._cancelled.add(save_id)
            self._late.pop(save_id, None)
            held = self._writers.get(step)
            if held is not None and held[0] == save_id:
                del self._writers[step]
                held[1].abort()

    def _pull(
        self, step: int, save_id: str, tmp_dir: Path, src: ShardSource, info: ShardInfo
    ) -> None:
        """Copy ``info.file`` from ``src`` chunk by chunk, paced, then fsync and verify;
        past its deadline ([Note: every pull has a deadline]) :class:`PullTimeout`."""
        path = tmp_dir / info.file
        digest = hashlib.sha256()
        t0 = time.perf_counter()
        pieces = [
            (off, min(CHUNK_BYTES, info.bytes - off)) for off in range(0, info.bytes, CHUNK_BYTES)
        ]
        limit = self.bound.seconds(info.bytes, src.deadline_bps or src.rate_bps)
        deadline = time.monotonic() + limit
        done = 0
        try:
            with open(path, "wb") as f:
                for data in self._pieces(step, info.file, src, pieces, deadline):
                    if save_id in self._cancelled:
                        raise CheckpointError(f"the save of step {step} was abandoned")
                    if time.monotonic() > deadline:
                        raise _Late()
                    n = len(data)
                    f.write(data)
                    digest.update(data)
                    done += n
                    if src.rate_bps:  # pace: never ahead of rate_bps since the start
                        ahead = t0 + done / src.rate_bps - time.perf_counter()
                        if ahead > 0:
                            time.sleep(ahead)
                f.flush()
                os.fsync(f.fileno())
        except _Late:
            path.unlink(missing_ok=True)
            raise PullTimeout(  # short: a copy's failure is shown by its last 200 characters
                f"{info.file} of step {step} not pulled onto {self.site} within its deadline "
                f"({limit:.1f} s for {info.bytes} bytes): abandoned"
            ) from None
        except Exception:
            path.unlink(missing_ok=True)
            raise
        if digest.hexdigest() != info.sha256:
            path.unlink(missing_ok=True)
            raise CheckpointError(
                f"{info.file} of step {step} arrived on {self.site} with sha256 "
                f"{digest.hexdigest()[:16]}…, the writer's is {info.sha256[:16]}…"
            )

    def _pieces(
        self,
        step: int,
        file: str,
        src: ShardSource,
        pieces: list[tuple[int, int]],
        deadline: float,
    ) -> Iterator[bytes]:
        """The pieces of ``file``, in order: over the holder's chunk server when it has one
        (the data plane), else through Ray actor calls; ``_IN_FLIGHT`` asked ahead; none
        waited for past ``deadline`` (`_Late`)."""
        client = None
        if src.address is not None:
            try:
                left = deadline - time.monotonic()
                client = ChunkClient(tuple(src.address), max(left, 0.001), creds=self.creds)
            except ChunkError:
                client = None  # unreachable (another network?): Ray still reaches it
        via = self._via.setdefault(step, {})
        if client is not None:
            try:
                for data in client.read_all(step, file, pieces, _IN_FLIGHT, deadline):
                    via["data_plane"] = via.get("data_plane", 0) + len(data)
                    yield data
            except ChunkTimeout:
                raise _Late() from None
            except ChunkError as exc:
                raise CheckpointError(f"{file} of step {step}: {exc}") from None
            finally:
                client.close()
            return
        get = self.get or _ray_get
        todo, inflight = deque(pieces), deque()
        while todo or inflight:
            while todo and len(inflight) < _IN_FLIGHT:
                off, n = todo.popleft()
                inflight.append((n, src.actor.read_chunk.remote(step, file, off, n)))
            n, ref = inflight.popleft()
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Late()
            try:
                data = get(ref, timeout=min(CHUNK_WAIT_S, left))
            except Exception:
                if time.monotonic() >= deadline:
                    raise _Late() from None  # Ray's timeout was the time left
                raise
            if len(data) != n:
                raise CheckpointError(f"{file}: got {len(data)} bytes, asked {n}")
            via["ray"] = via.get("ray", 0) + n
            yield data

    # -- copies already on this site -----------------------------------------------------------
    def _remember(self, path: Path, step: int, num_stages: int) -> None:
        copy = SiteCopy(step, num_stages, frozenset(range(num_stages)))
        self._verified[(step, signature(path))] = copy

    def _check(self, path: Path, step: int) -> SiteCopy:
        """This site's copy in ``path``, hashed again unless no file of it changed since it
        last verified ([Note: what is verified, when]); raises naming the bad file."""
        try:
            key = (step, signature(path))
            if key not in self._verified:
                ckpt = load_checkpoint(path, verify=True)
                self._verified[key] = SiteCopy(
                    step, len(ckpt.stages), frozenset(range(len(ckpt.stages)))
                )
        except (CheckpointError, OSError) as exc:
            self._verified = {k: v for k, v in self._verified.items() if k[0] != step}
            self._rejected[str(path)] = str(exc)
            raise CheckpointError(f"site {self.site}'s copy {path}: {exc}") from None
        self._rejected.pop(str(path), None)
        return self._verified[key]

    def holdings(self) -> list[SiteCopy]:
        """The complete copies of the run's lineage on this site's disk whose checksums
        verify (a copy is hashed again only when one of its files changed)."""
        out = []
        for info in list_checkpoints(self.root):
            if info.status == "corrupt":  # a shard missing or of the wrong size
                self._rejected[str(info.path)] = info.reason or "corrupt"
            if info.status != "complete" or not accepts(self.lineage, info.run_id, info.step):
                continue
            try:
                out.append(self._check(info.path, info.step))
            except CheckpointError:
                continue  # said by rejected(); pruned meanwhile is no copy either
        return out

    def rejected(self) -> dict[str, str]:
        """The copies found corrupt or incomplete since this store started, and why."""
        return dict(self._rejected)

    def path_of(self, step: int) -> str:
        """Where the stage actors of this site load ``step`` from, verified first."""
        path = self.root / step_dirname(step)
        self._check(path, step)
        return str(path)

    def manifest(self, step: int) -> dict:
        return json.loads((self.root / step_dirname(step) / MANIFEST).read_text())

    def read_chunk(self, step: int, file: str, offset: int, size: int) -> bytes:
        """A piece of a file of this site's committed copy of ``step`` (another site's store
        assembling its own copy pulls it)."""
        if not _FILE_RE.match(file):
            raise CheckpointError(f"not a checkpoint file: {file!r}")
        with open(self.root / step_dirname(step) / file, "rb") as f:
            f.seek(offset)
            return f.read(size)

    def copy_from(self, step: int, source: Any, rate_bps: float | None = None) -> str:
        """Make this site hold a complete copy of ``step`` by pulling every file of
        ``source``'s (another store's) copy; returns its path. Used before a restore when
        this site's own copy of the chosen checkpoint is missing. ``rate_bps``: the link's
        bytes/s, which each pull's deadline assumes (the copy is not paced); past one the
        copy is abandoned whole (:class:`PullTimeout`)."""
        have = self.root / step_dirname(step)
        if any(c.step == step for c in self.holdings()):
            return str(have)
        get = self.get or _ray_get
        doc = get(source.manifest.remote(step), timeout=MANIFEST_WAIT_S)
        try:  # the copy crosses sites: over the data plane when the source's server answers
            address = get(source.chunk_address.remote(), timeout=ADDRESS_WAIT_S)
        except Exception:
            address = None
        save_id = f"copy-{step}-{time.time_ns()}"
        writer = self._writer(step, save_id)
        try:
            for e in doc["stages"]:
                info = ShardInfo(
                    e["stage"], e["file"], e["sha256"], e["bytes"], e.get("tensors", 0), 0.0
                )
                src = ShardSource(e["stage"], source, None, address, rate_bps)
                self._pull(step, save_id, writer.tmp_dir, src, info)
                writer.add_shard(info)
            manifest = {k: v for k, v in doc.items() if k not in _RESERVED}
            return self.commit(step, save_id, manifest, int(doc["num_stages"]))["path"]
        except BaseException:
            self.abort(step, save_id)
            raise


class _Late(Exception):
    """A pull's deadline passed (inside :meth:`SiteStore._pull`, which says which)."""


def _ray_get(ref: Any, timeout: float) -> Any:
    import ray

    return ray.get(ref, timeout=timeout)
