"""Every checkpoint pull between sites has a deadline (issue 33; [Note: every pull has a
deadline] in geopipe/runtime/storage/sitestore.py).

* the store (the real :class:`SiteStore` on real directories) pulling from a real TCP
  listener on 127.0.0.1 that accepts and never answers, or answers a byte at a time: the
  pull ends at its deadline (the floor, or ``factor`` x bytes over the rate when that is
  longer), raises :class:`PullTimeout`, leaves no partial file, and the site's last good
  copy still verifies; a restore's copy (``copy_from``) is abandoned whole;
* the Ray fallback: no chunk is waited for past the pull's deadline;
* the driver (the controller on the in-process fake, tests/unit/fakes.py): a site's store
  that never finishes its copy costs that copy only, counted as a replication shortfall in
  status.json and ``geopipe status``, and the run ends every step exactly; a restore's copy
  that a store never finishes is a CheckpointError at the bound (the restore's cue to try
  an older checkpoint).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from geopipe.checkpoint.restore import Restorable, SiteCopy
from geopipe.checkpoint.store import CheckpointError, list_checkpoints, load_checkpoint
from geopipe.cli.render import replication_lines
from geopipe.config import parse_cluster
from geopipe.runtime.control import sitecopies
from geopipe.runtime.control.sitecopies import SiteCopies
from geopipe.runtime.control.workers import SpawnOptions
from geopipe.runtime.storage.sitestore import PullBound, PullTimeout, ShardSource, SiteStore
from tests.unit._controller_runs import Run, assert_exact, make_doc
from tests.unit.fakes import FakeWorkers
from tests.unit.test_outer_shards_unwritten import Reporter
from tests.unit.test_site_copies import MANIFEST, _Call, _Handle, _Holder, _save, _shards

pytestmark = pytest.mark.timeout(120)


class StallingServer:
    """A listener that accepts every connection and then never answers (``trickle`` 0) or
    answers each request with a reply header announcing the size asked and then one byte
    every ``trickle`` seconds: a reply that keeps coming and never completes in time."""

    def __init__(self, trickle: float = 0.0) -> None:
        self.trickle, self.sent = trickle, 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            if self.trickle:
                threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        try:
            (n,) = struct.unpack("<I", conn.recv(4))
            size = int(conn.recv(n).split(b'"size": ')[1].rstrip(b"}"))
            conn.sendall(struct.pack("<BQ", 0, size))
            while not self._stop.wait(self.trickle):
                conn.sendall(b"x")
                self.sent += 1
        except OSError:
            pass

    def __enter__(self) -> StallingServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for s in [self._listener, *self._conns]:
            s.close()


def _store(tmp: Path, site: str, bound: PullBound) -> SiteStore:
    st = SiteStore(site, str(tmp / f"ckpt-{site}"), keep=2, bound=bound)
    st.get = lambda ref, timeout=None: ref
    return st


def _tmp_files(root: Path) -> list[str]:
    """Every file in a save in progress under ``root`` (its ``.tmp-*`` directories)."""
    return sorted(f.name for d in root.glob(".tmp-*") for f in d.iterdir())


def test_the_bound_is_factor_times_bytes_over_rate_at_least_the_floor() -> None:
    b = PullBound(floor_s=120.0, factor=20.0)
    assert b.seconds(10 << 20, None) == 120.0  # unpriced (inside a site): the floor
    assert b.seconds(10 << 20, 12.5e6) == 120.0  # 10 MiB at 100 Mbit/s: 0.84 s x 20 < floor
    assert b.seconds(1 << 30, 12.5e6) == pytest.approx(20 * (1 << 30) / 12.5e6)  # 1718 s


@pytest.mark.parametrize(
    ("trickle", "floor_s", "priced_s", "want_s"),
    [(0.0, 1.0, None, 1.0), (0.05, 0.5, 0.1, 2.0)],
    ids=["silent-floor", "trickle-rate"],
)
def test_a_stalled_pull_ends_at_its_deadline_and_leaves_nothing(
    tmp_path: Path, trickle: float, floor_s: float, priced_s: float | None, want_s: float
) -> None:
    """Stage 1's holder accepts the connection and never answers (its deadline: the floor),
    or trickles a byte every 50 ms (priced: its bytes take 0.1 s at the rate, x 20 = 2 s,
    past the 0.5 s floor). The save's pull raises at that deadline, not before and not
    after the client's 120 s idle timeout (which a trickle would renew forever), the
    partial shard is gone, the save is not pulled again, and the site's last good copy
    (step 2) still verifies."""
    east = _store(tmp_path, "east", PullBound(floor_s=floor_s, factor=20.0))
    _save(east, 2, _shards(2))
    shards = _shards(4)
    infos = [i for _, i in shards]
    bps = None if priced_s is None else infos[1].bytes / priced_s
    with StallingServer(trickle) as srv:
        srcs = [
            ShardSource(0, _Holder(shards[0][0]), None),
            ShardSource(1, None, None, srv.address, deadline_bps=bps),
        ]
        t0 = time.monotonic()
        with pytest.raises(PullTimeout, match=r"stage-1\.safetensors of step 4") as err:
            east.save(4, "s4", MANIFEST, srcs, *infos)
        took = time.monotonic() - t0
    assert want_s <= took < want_s + 3.0, took
    assert f"within its deadline ({want_s:.1f} s" in str(err.value)
    if trickle:
        assert srv.sent > 5  # bytes kept coming; the deadline held anyway
    assert _tmp_files(east.root) == ["stage-0.safetensors"]  # the partial shard is gone
    # The driver's stand-in retry of this save: the same error at once, nothing pulled
    # again over the link that was too slow.
    again = [ShardSource(k, _Holder(b), None) for k, (b, _) in enumerate(shards)]
    t0 = time.monotonic()
    with pytest.raises(PullTimeout, match="within its deadline"):
        east.save(4, "s4", MANIFEST, again, *infos)
    assert time.monotonic() - t0 < 0.5 and again[1].actor.asked == []
    east.abort(4, "s4")  # what the driver does with a copy that failed
    assert [(i.step, i.status) for i in list_checkpoints(east.root)] == [(2, "complete")]
    assert east.holdings() == [SiteCopy(2, 2, frozenset({0, 1}))]  # hashed again: intact


def test_a_restore_copy_from_a_stalled_site_is_abandoned_whole(tmp_path: Path) -> None:
    """West pulls east's step 2 before a restore, and east's chunk server accepts and never
    answers: a clear CheckpointError (which a restore answers by trying an older
    checkpoint) at the deadline, and nothing of step 2 on west's disk."""
    east = _store(tmp_path, "east", PullBound())
    west = _store(tmp_path, "west", PullBound(floor_s=0.5, factor=20.0))
    _save(east, 2, _shards(2))
    with StallingServer() as srv:
        source = _Handle(east)
        source.chunk_address = _Call(lambda: srv.address)
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match="not pulled onto west within"):
            west.copy_from(2, source, rate_bps=1e9)
        assert time.monotonic() - t0 < 3.5
    assert list(west.root.iterdir()) == []  # no step directory, no .tmp-* left
    assert west.holdings() == []


def test_the_ray_path_waits_no_chunk_past_the_deadline(tmp_path: Path) -> None:
    """No chunk server: the pull goes through actor calls, and a chunk that never comes
    is waited for only the time left of the pull's deadline (not 120 s per chunk)."""
    east = _store(tmp_path, "east", PullBound(floor_s=0.5, factor=20.0))
    never, asked = object(), []

    def get(ref: Any, timeout: float) -> bytes:
        if ref is not never:
            return ref
        asked.append(timeout)
        time.sleep(min(timeout, 3.0))
        raise TimeoutError("Get timed out")  # what ray.get raises at its timeout

    east.get = get
    shards = _shards(2)
    stuck = type("H", (), {"read_chunk": _Call(lambda *_: never)})()
    srcs = [ShardSource(0, _Holder(shards[0][0]), None), ShardSource(1, stuck, None)]
    with pytest.raises(PullTimeout):
        east.save(2, "s", MANIFEST, srcs, *[i for _, i in shards])
    assert asked and max(asked) <= 0.5
    assert _tmp_files(east.root) == ["stage-0.safetensors"]


def test_a_store_that_never_finishes_its_copy_is_a_counted_shortfall(
    tmp_path: Path, corpus: Path
) -> None:
    """West's store freezes as its copy of step 4 starts (it never answers again). Each
    later save waits for west's copy only its pulls' deadlines plus ``copy_wait_s`` (the
    fake raises FakeHang at any wait without a bound), abandons it, and counts the save
    short; east's copies commit, the run ends every step exactly, and status.json and
    ``geopipe status`` say how many saves were short and why."""
    fake = FakeWorkers()
    real_call = fake.call

    def call(actor: Any, method: str, *args: Any, **kw: Any) -> Any:
        if method == "save" and args[0] == 4 and actor.name.endswith("/west/checkpoints"):
            actor.frozen = True
        return real_call(actor, method, *args, **kw)

    fake.call = call
    doc = make_doc(corpus, steps=8, every=2)
    doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ck-{site}")
    run = Run(doc, tmp_path / "run", fake, health={"copy_wait_s": 0.3}).go()
    saved = run.events("checkpoint")
    assert [e["step"] for e in saved] == [2, 4, 6, 8]
    assert [sorted(e["copies"]) for e in saved] == [["east", "west"]] + [["east"]] * 3
    assert all("not copied within" in e["failed_copies"]["west"] for e in saved[1:])
    rep = run.status()["replication"]
    assert rep["short_saves"] == 3 and rep["newest_copy"] == {"east": 8, "west": 2}
    assert rep["last_short"]["step"] == 8 and "west" in rep["last_short"]["failed"]
    lines = replication_lines(rep)
    assert any("behind: newest copy step 2" in x for x in lines)
    assert any(x.startswith("replication short: 3 save(s)") for x in lines)
    assert [(i.step, i.status) for i in list_checkpoints(tmp_path / "ck-west")] == [(2, "complete")]
    assert_exact(run, 8)


def test_a_restore_copy_a_store_never_finishes_is_a_checkpoint_error(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """West must pull east's step 2 before a restore and its store never answers: the
    driver waits its pulls' deadlines plus ``copy_wait_s`` (and the store's own manifest
    and address waits, shortened here), then raises a CheckpointError naming the copy,
    which ``restore_from`` answers by trying an older checkpoint. Answering, the same
    call makes west's copy, verified."""
    monkeypatch.setattr(sitecopies, "MANIFEST_WAIT_S", 0.1)
    monkeypatch.setattr(sitecopies, "ADDRESS_WAIT_S", 0.1)
    doc = make_doc(corpus)
    doc["training"]["checkpoint"]["dir"] = str(tmp_path / "ck-{site}")
    doc["health"] = {"copy_wait_s": 0.3}
    spec = parse_cluster(doc, "t")
    fake = FakeWorkers()
    copies = SiteCopies(spec, Reporter(), list, list, lambda step: {}, workers=fake)
    stores = {
        s: fake.spawn(SiteStore, (s, str(copies.root(s)), 2), SpawnOptions(s, "n"))
        for s in ("east", "west")
    }
    copies._stores = dict(stores)
    east = stores["east"].body.inner
    seam, east.get = east.get, lambda ref, timeout=None: ref  # _save's holders answer bytes
    _save(east, 2, _shards(2))
    east.get = seam
    point = Restorable(2, 2, ("east",), {0: "east", 1: "east"})
    stores["west"].frozen = True
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="west's copy of checkpoint step 2 from site east"):
        copies.paths_for(point, ["west"])
    assert 0.3 * 3 <= time.monotonic() - t0 < 5.0  # two shards' floors + copy_wait_s + 0.2
    stores["west"].frozen = False
    fake.pump()  # the abandoned call, answered late, is no restore's
    path = copies.paths_for(point, ["west"])["west"]
    assert load_checkpoint(path, verify=True).step == 2
