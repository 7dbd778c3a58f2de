"""The site rendezvous's store semantics, as torch's stores have them (the actor's body,
without Ray: `tests/integration/test_site_rendezvous.py` runs it for real): a read waits
for its key or times out, counters add, compare-and-set swaps only on a match."""

from __future__ import annotations

import asyncio

from geopipe.runtime.actor.rendezvous import SiteRendezvous


def test_reads_wait_for_their_key_and_time_out_without_it() -> None:
    async def run() -> None:
        kv = SiteRendezvous()
        waiting = asyncio.create_task(kv.get("rank1/addr", 5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # blocks until the key is set
        await kv.set("rank1/addr", b"10.0.0.2:1234")
        assert await waiting == b"10.0.0.2:1234"
        assert await kv.get("never", 0.05) is None
        assert not await kv.wait_all(["rank1/addr", "never"], 0.05)
        assert await kv.check(["rank1/addr"]) and not await kv.check(["never"])

    asyncio.run(run())


def test_counters_and_compare_set_follow_torch() -> None:
    async def run() -> None:
        kv = SiteRendezvous()
        assert await kv.add("n", 1) == 1 and await kv.add("n", 2) == 3
        assert await kv.get("n", 0.1) == b"3"
        assert await kv.compare_set("k", b"", b"a") == b"a"  # unset and expected empty
        assert await kv.compare_set("k", b"x", b"b") == b"a"  # no match: what it holds
        assert await kv.compare_set("k", b"a", b"b") == b"b"
        assert await kv.compare_set("absent", b"x", b"y") == b"x"  # torch returns expected
        assert await kv.num_keys() == 2
        assert await kv.delete_key("k") and not await kv.delete_key("k")

    asyncio.run(run())
