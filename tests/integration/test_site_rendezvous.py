"""Tier 2: no port of a stage actor takes a stranger's store commands (issue 33, item 2).

A run across two emulated sites with two replicas per stage (so each site forms a process
group of two ranks and their ZeRO-1 groups). Once the groups are formed, a client speaking
torch's own TCPStore protocol connects to every listening TCP port of every stage actor's
process (Ray's, gloo's, the data plane's) and tries to list, write and read a key: none
answers. The same client lists, writes and reads a real ``TCPStore`` (the kind each site's
first rank used to run), so a store that answered would be found. The run then trains on
to the losses of the same run's reference (the rendezvous through Ray changes nothing).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import ray
import torch.distributed as dist
from test_runtime import reference, tiny_doc

from geopipe.config import parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def store_answers(host: str, port: int) -> list[str]:
    """What a TCPStore client could do at ``host:port``: "list", "write", "read"."""
    done: list[str] = []
    try:
        store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False
        )
    except Exception:
        return done
    for name, op in (
        ("list", lambda: store.num_keys()),
        ("write", lambda: store.set("geopipe-stranger", b"x")),
        ("read", lambda: store.get("geopipe-stranger")),
    ):
        try:
            op()
            done.append(name)
        except Exception:
            pass
    return done


def answering(targets: list[tuple[str, int]], wait_s: float = 6.0) -> dict:
    """`store_answers` for every target at once. The TCPStore client does not always honour
    its timeout (a server that takes the connection and never answers leaves it blocked in
    C++), so each runs on a daemon thread and one still blocked after ``wait_s`` (three times
    the client's own 2 s timeout; a store answers in milliseconds, as the positive control
    shows) answered nothing."""
    got: dict[tuple[str, int], list[str]] = {}
    threads = [
        threading.Thread(target=lambda t=t: got.update({t: store_answers(*t)}), daemon=True)
        for t in targets
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + wait_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return {t: got.get(t, []) for t in targets}


def listening(pid: int) -> list[tuple[str, int]]:
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sorted({(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN})


def reachable(ip: str) -> str:
    return ray.util.get_node_ip_address() if ip in ("0.0.0.0", "::") else ip


def test_no_stage_actor_port_takes_store_commands(tmp_path: Path) -> None:
    # the client finds a real, unauthenticated store: the positive control
    control = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert answering([("127.0.0.1", control.port)]) == {
        ("127.0.0.1", control.port): ["list", "write", "read"]
    }

    doc = tiny_doc(2, 2, steps=2)
    doc["name"] = "rendezvous"
    spec = parse_cluster(doc, "t")
    ctl = Controller(spec, LaunchOptions(run_dir=str(tmp_path), progress=False))
    try:
        ctl.launch()
        actors = [a for row in ctl.actors for a in row]
        pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors])
        assert len(set(pids)) == 4 and os.getpid() not in pids
        ports = {(reachable(ip), port): pid for pid in pids for ip, port in listening(pid)}
        # every process listens (Ray's own server, gloo's pair listeners): all are tried
        assert set(ports.values()) == set(pids)
        answered = {t: ops for t, ops in answering(list(ports)).items() if ops}
        assert not answered, f"a stage actor's port took store commands: {answered}"
        losses = [m.loss for m in ctl.train().steps]
    finally:
        ctl.close()
    ref, _ = reference(doc)
    assert losses == pytest.approx(ref, abs=1e-5)  # as test_runtime's parity test
