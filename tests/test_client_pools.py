"""TangramClient spreads many requests in flight over several connection pools
(tangram_sdk/client.py POOL_SHARE: httpx's pool costs O(n) per request for n at once)."""

from __future__ import annotations

import asyncio

from conftest import TOKEN

from tangram_sdk import client as client_module
from tangram_sdk.client import POOL_SHARE, TangramClient


def test_many_requests_at_once_spread_over_pools_and_all_answer(process_server):
    n = 2 * POOL_SHARE + 5  # three pools' worth, in flight together

    async def main() -> tuple[list[dict], int, list[int]]:
        async with TangramClient(process_server.url, TOKEN) as tg:
            tids = [await tg.open_trajectory(f"cp-{i}") for i in range(n)]
            # 2 cores: most of them wait in the queue, their submits held open meanwhile
            results = await asyncio.gather(*(
                tg.run(t, argv=["sleep", "0.2"]) for t in tids))
            pools, busy = len(tg._pools), list(tg._busy)
            for t in tids:
                await tg.close_trajectory(t)
            await tg.health()  # after the burst: the first pool is reused
            assert len(tg._pools) == pools
        return results, pools, busy

    results, pools, busy = asyncio.run(main())
    assert [r["status"] for r in results] == ["ok"] * n
    assert pools >= 3  # one per POOL_SHARE requests in flight at the peak
    assert busy == [0] * pools  # every request released its pool's slot


def test_a_full_client_reuses_its_least_busy_pool(monkeypatch):
    monkeypatch.setattr(client_module, "POOL_SHARE", 2)
    tg = TangramClient("http://127.0.0.1:1", TOKEN, max_connections=4)  # two pools at most
    assert tg._pick() == 0
    tg._busy[0] = 2
    assert tg._pick() == 1 and len(tg._pools) == 2
    tg._busy[1] = 3
    assert tg._pick() == 0  # no third pool: the least busy
    # each pool holds POOL_SHARE connections: the pools together hold max_connections
    assert [p._transport._pool._max_connections for p in tg._pools] == [2, 2]
    asyncio.run(tg.aclose())
