"""The per-trajectory-api policy live: no quota manager holds API calls; every call is sent
at once, the provider's 429s and Retry-After drive the retries (issue 19, item 3)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import uvicorn
from conftest import TOKEN, free_port, start_server
from fastapi import FastAPI, Response

from tangram_sdk.client import TangramClient


def test_per_trajectory_api_sends_every_call_and_the_providers_429s_drive_retries(
        tmp_path: Path) -> None:
    # a provider with a quota of one call at a time: past it, 429 with a Retry-After. Its
    # first call is held until a second one arrives, which happens only if the calls are
    # sent at once (a quota manager holding them would send the second after the first)
    app = FastAPI()
    lock = threading.Lock()
    state = {"in_flight": 0, "served": 0, "refused": 0, "most": 0}
    second = threading.Event()

    @app.get("/search")
    def search() -> Response:
        with lock:
            if state["in_flight"] >= 1:
                state["refused"] += 1
                second.set()
                return Response("quota", status_code=429, headers={"Retry-After": "0.05"})
            state["in_flight"] += 1
            state["most"] = max(state["most"], state["in_flight"])
        second.wait(10)  # (held by a quota manager, no second call comes: served late)
        with lock:
            state["in_flight"] -= 1
            state["served"] += 1
        return Response('{"hits": 1}', media_type="application/json")

    port = free_port()
    provider = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                             log_level="error"))
    thread = threading.Thread(target=provider.run, daemon=True)
    thread.start()
    while not provider.started:
        time.sleep(0.05)
    server = start_server(tmp_path / "st", quotas=("api=concurrency:1",), extra_args=(
        "--policy", "per-trajectory-api", "--allow-url", "api=http://127.0.0.1:"))
    try:
        async def calls() -> list[dict]:
            async with TangramClient(server.url, TOKEN) as tg:
                tids = [await tg.open_trajectory(task="ds") for _ in range(3)]
                url = f"http://127.0.0.1:{port}/search"
                return list(await asyncio.gather(*(
                    tg.run(t, kind="search", quota={"api": 1},
                           request={"method": "GET", "url": url}) for t in tids)))

        results = asyncio.run(calls())
        assert [r["status"] for r in results] == ["ok"] * 3, results
        assert all(r["exit_code"] == 200 for r in results)
        # the calls met the provider's quota, not ours: refused there, retried after its
        # Retry-After, and the provider never served two at once
        assert state["refused"] >= 1 and sum(r["retries"] for r in results) == state["refused"]
        assert state["served"] == 3 and state["most"] == 1
    finally:
        server.stop()
        provider.should_exit = True
        thread.join(10)
