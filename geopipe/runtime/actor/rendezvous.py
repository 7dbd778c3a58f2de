"""A site's process-group rendezvous as a Ray actor: a key-value store reached only through
Ray actor calls, so no TCP port of geopipe's takes a stranger's commands.

[Note: the site rendezvous goes through Ray]
``torch.distributed`` forms a site's process groups (the default group, then one per ZeRO-1
replica group; NCCL also trades its unique ids) through a key-value store. Its usual store,
a ``TCPStore`` on the first rank, listens on a port and obeys anyone who can reach it: no
secret, any key listed, read, written or deleted, for as long as the group lives (NCCL
initialises lazily, so that is the whole run). Here the store is this small actor instead,
started beside the site's first rank (``SiteRendezvous.open``, owned by that rank's actor:
it dies with it) and read by every rank through `geopipe.runtime.actor.distgroups.RayStore`.
Every call goes over Ray's control plane, authenticated as the cluster's is (``ray.auth``,
the same protection as the run secret the driver hands out): a process that cannot call
Ray cannot touch a key. It listens on nothing and binds no port, so there is no port to
pick and re-bind (the old race). The cost is a Ray call per store operation: forming a
group of W ranks takes a few per rank, milliseconds each.

No torch here: the actor's process imports only this module and Ray.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

__all__ = ["SiteRendezvous", "open_rendezvous"]


class SiteRendezvous:
    """The store's contents and its blocking reads (an asyncio actor: a read waiting for a
    key holds no thread). Values are bytes; counters are decimal bytes, as torch's own
    stores keep them."""

    def __init__(self) -> None:
        self._kv: dict[str, bytes] = {}
        self._changed = asyncio.Condition()

    async def set(self, key: str, value: bytes) -> None:
        async with self._changed:
            self._kv[key] = bytes(value)
            self._changed.notify_all()

    async def get(self, key: str, timeout_s: float) -> bytes | None:
        """The value of ``key`` once it is set; None after ``timeout_s`` without it."""
        if not await self.wait_all([key], timeout_s):
            return None
        return self._kv[key]

    async def wait_all(self, keys: list[str], timeout_s: float) -> bool:
        """Whether every key in ``keys`` was set within ``timeout_s``."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: all(k in self._kv for k in keys)), timeout_s
                )
            except TimeoutError:
                return False
            return True

    async def add(self, key: str, amount: int) -> int:
        async with self._changed:
            value = int(self._kv.get(key, b"0")) + amount
            self._kv[key] = str(value).encode()
            self._changed.notify_all()
            return value

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """``desired`` if ``key`` held ``expected`` (or was unset and ``expected`` empty),
        else what it holds — torch's ``compareSet``."""
        async with self._changed:
            current = self._kv.get(key)
            if (current is None and not expected) or current == expected:
                self._kv[key] = bytes(desired)
                self._changed.notify_all()
                return bytes(desired)
            return current if current is not None else bytes(expected)

    async def check(self, keys: list[str]) -> bool:
        return all(k in self._kv for k in keys)

    async def delete_key(self, key: str) -> bool:
        return self._kv.pop(key, None) is not None

    async def num_keys(self) -> int:
        return len(self._kv)


def open_rendezvous() -> Any:
    """Start a `SiteRendezvous` on this node, owned by the calling actor (it dies with it),
    and return its handle (what the site's ranks are given)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    strategy = NodeAffinitySchedulingStrategy(node, soft=False)
    return _actor_class().options(num_cpus=0, scheduling_strategy=strategy).remote()


@functools.cache
def _actor_class() -> Any:
    """The Ray class, made once per process (Ray exports a new class on each ``ray.remote``)."""
    import ray

    return ray.remote(max_concurrency=1000)(SiteRendezvous)
