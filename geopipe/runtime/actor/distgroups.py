"""The ``torch.distributed`` world of one site's stage replicas, as DeepSpeed needs it.

Joining and leaving the default group (gloo on CPU, NCCL on GPU) with DeepSpeed adopting it,
and the ``mpu`` object that tells DeepSpeed its data-parallel group is the stage's replica
group. Re-exported by :mod:`geopipe.runtime.actor.engine`.

The runtime's ranks meet through `RayStore`, a store reached over Ray actor calls, never a
listening ``TCPStore`` ([Note: the site rendezvous goes through Ray] in
:mod:`.rendezvous`); gloo's own pair listeners bind the node's address (`join_site`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import deepspeed
import deepspeed.comm
import torch
import torch.distributed as dist

__all__ = ["RayStore", "StageMPU", "destroy_process_group", "init_process_group", "join_site"]

# The rendezvous actor this process started as its site's first rank (`open_site`): ended
# with the group (`destroy_process_group`), and with this actor anyway (Ray owns it so).
_owned_rendezvous: Any = None
# The group's `RayStore`, held for as long as the group lives: torch keeps only its C++
# half, and once the Python object is collected every later call (a new subgroup, NCCL's
# lazy init) fails with "INTERNAL ASSERT FAILED ... Not implemented".
_store: Any = None


def _skip_shm_op_build() -> None:
    """Stop DeepSpeed compiling its shared-memory all-reduce op (~45 s) on CPU.

    The attribute must be replaced on the module object in ``sys.modules``:
    ``import deepspeed.comm.torch as m`` resolves to the ``torch`` package re-exported by
    ``deepspeed.comm`` and silently patches nothing.
    """
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


class RayStore(dist.Store):
    """A ``torch.distributed`` store whose keys live in a
    `~geopipe.runtime.actor.rendezvous.SiteRendezvous` actor, reached by Ray actor calls
    (torch calls these methods from its C++ side; gloo and NCCL need only these).

    ``timeout_s`` bounds each blocking read, as a ``TCPStore``'s timeout does."""

    def __init__(self, rendezvous: Any, timeout_s: float) -> None:
        super().__init__()
        self._kv, self._timeout_s = rendezvous, timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        ref = getattr(self._kv, method).remote(*args)
        return ray.get(ref, timeout=self._timeout_s + 60.0)  # the actor's own wait, plus slack

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        value = self._call("get", key, self._timeout_s)
        if value is None:
            raise dist.DistStoreError(
                f"site rendezvous: key {key!r} not set within {self._timeout_s:.0f} s "
                "(a rank of the site did not join)"
            )
        return value

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call("compare_set", key, _as_bytes(expected), _as_bytes(desired))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = self._timeout_s if timeout is None else timeout.total_seconds()
        if not self._call("wait_all", list(keys), limit):
            raise dist.DistStoreError(f"site rendezvous: keys {list(keys)} not set in {limit} s")

    def check(self, keys: Sequence[str]) -> bool:
        return self._call("check", list(keys))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def open_site() -> Any:
    """As the site's first rank: start the site's rendezvous (any earlier one this process
    started ends) and return its handle, which every rank is given for `join_site`."""
    from geopipe.runtime.actor.rendezvous import open_rendezvous

    global _owned_rendezvous
    _end_rendezvous()
    _owned_rendezvous = open_rendezvous()
    return _owned_rendezvous


def _end_rendezvous() -> None:
    global _owned_rendezvous
    if _owned_rendezvous is not None:
        import ray

        ray.kill(_owned_rendezvous)
        _owned_rendezvous = None


def join_site(rank: int, world_size: int, rendezvous: Any, host: str, timeout_s: float) -> None:
    """Join the site's default process group through its rendezvous actor (`open_site`).

    ``host``: this node's address. Gloo's pair listeners (one per group, ephemeral ports,
    gloo's own unauthenticated protocol) bind the interface holding it
    (``GLOO_SOCKET_IFNAME``, unless already set) — the node's own network, as
    docs/security.md says — instead of whatever the host name resolves to."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = _interface_of(host)
        if iface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    global _store
    _store = RayStore(rendezvous, timeout_s)
    _init(rank, world_size, _store, host, 0, timeout_s)


def _interface_of(ip: str) -> str | None:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    *,
    local_rank: int = 0,
) -> None:
    """Join the default process group through a ``TCPStore`` on ``master_addr:master_port``
    (rank 0 listens): for tests and benchmarks on one machine only — that store takes
    anyone's commands; the runtime uses `join_site`."""
    store = dist.TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
    )
    _init(rank, world_size, store, master_addr, master_port, timeout_s, local_rank=local_rank)


def _init(
    rank: int,
    world_size: int,
    store: dist.Store,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    *,
    local_rank: int = 0,
) -> None:
    """Join the default process group and make ``deepspeed.comm`` adopt it.

    Gloo on CPU, NCCL when CUDA is available. The environment variables DeepSpeed reads are
    set too (``local_rank`` defaults to 0 because a Ray actor sees only its own device).
    ``timeout_s`` bounds every collective: a hung peer surfaces as an error after it, so choose
    it from the measured step time. Call again after :func:`destroy_process_group` to re-form
    a group with new ranks and a new rendezvous.
    """
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _skip_shm_op_build()
    deepspeed.comm.init_distributed(dist_backend=backend, timeout=timeout)


def destroy_process_group() -> None:
    """Tear down the default group and every subgroup, DeepSpeed's cached group handles, and
    the site's rendezvous if this process started it."""
    global _store
    if dist.is_initialized():
        deepspeed.comm.destroy_process_group()
    _store = None
    _end_rendezvous()


class StageMPU:
    """The ``mpu`` DeepSpeed asks for: data parallel = this stage's replica group.

    "Model parallel" is a single-rank group: pipeline stages are not DeepSpeed's business (the
    caller moves activations), so gradient norms and reductions stay inside the stage.
    """

    def __init__(self, dp_group: Any, dp_ranks: list[int], mp_group: Any) -> None:
        self._dp_group, self._dp_ranks, self._mp_group = dp_group, dp_ranks, mp_group

    def get_data_parallel_group(self) -> Any:
        return self._dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._dp_ranks)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp_group)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp_group)

    def get_model_parallel_group(self) -> Any:
        return self._mp_group

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1
