"""Attack: memory. Finished results leave memory after their TTL (the journal
keeps them), and outputs are stored as bytes (NUL bytes are not 6x escapes)."""

from __future__ import annotations

import time

import httpx
from conftest import TOKEN, start_server

from executor.server.journal import kept

H = {"Authorization": f"Bearer {TOKEN}"}


def _gauge(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_results_leave_memory_and_outputs_are_bytes(tmp_path):
    server = start_server(tmp_path / "state", extra_args=("--result-ttl-s", "0.5"))
    try:
        with httpx.Client(base_url=server.url, headers=H, timeout=60) as c:
            c.post("/v1/trajectories", json={"id": "m"})
            journal = tmp_path / "state" / "journal.sqlite"
            for i in range(20):
                r = c.post("/v1/trajectories/m/actions", params={"wait": 30},
                           json={"id": f"z{i}", "argv": ["head", "-c", "100000", "/dev/zero"]})
                assert r.json()["status"] == "ok"
            size = sum(p.stat().st_size for p in journal.parent.glob("journal.sqlite*"))
            assert size < 20 * 100_000 * 1.5, size  # JSON escapes would be 6x: 12 MB
            time.sleep(1.0)
            assert _gauge(c.get("/metrics").text, "tangram_tracked_results") == 0
            res = c.get("/v1/actions/z7").json()  # from the journal now: its last 64 KiB
            assert res["status"] == "ok"
            assert res["output"] == kept("\x00" * 100_000).decode(), res["output"][:200]
    finally:
        server.stop()
