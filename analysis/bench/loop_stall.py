"""Benchmark: does the server's event loop keep answering while long commands arrive?

Starts a real `tangram serve` (process backend) on 127.0.0.1, probes /healthz every
10 ms, and submits 32 maximal (64 KiB) commands at once - each ~0.15 s of shlex, ~5 s
in all if that ran on the loop. Prints JSON: the probe's latencies (max, p50, p99),
the same probe's latencies before the burst (the baseline), and the machine's load.
This figure was once a timed assertion in tests/test_attack_input.py, which
failed at load ~6; a figure goes here, never into a test.

    python -m analysis.bench.loop_stall
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import TOKEN, start_server  # noqa: E402

H = {"Authorization": f"Bearer {TOKEN}"}


def probe(url: str, seconds: float | None, stop: threading.Event) -> list[float]:
    lat: list[float] = []
    end = time.perf_counter() + seconds if seconds else None
    with httpx.Client(base_url=url) as c:
        while not stop.is_set() and (end is None or time.perf_counter() < end):
            t0 = time.perf_counter()
            c.get("/healthz")
            lat.append(time.perf_counter() - t0)
            time.sleep(0.01)
    return lat


def summary(lat: list[float]) -> dict[str, float]:
    s = sorted(lat)
    return {"n": len(s), "max_s": round(s[-1], 4), "p50_s": round(s[len(s) // 2], 4),
            "p99_s": round(s[int(len(s) * 0.99)], 4)}


def main() -> None:
    server = start_server(Path(tempfile.mkdtemp(prefix="bench-loop-")), "process")
    try:
        baseline = probe(server.url, 2.0, threading.Event())
        httpx.post(server.url + "/v1/trajectories", json={"id": "long"}, headers=H)
        command = "echo " + "x" * (64 * 1024 - 5)
        stop, lat = threading.Event(), []
        t = threading.Thread(target=lambda: lat.extend(probe(server.url, None, stop)))
        t.start()

        def submit(i: int) -> None:
            with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
                c.post("/v1/trajectories/long/actions", json={"id": f"l{i}", "command": command})

        senders = [threading.Thread(target=submit, args=(i,)) for i in range(32)]
        for s in senders:
            s.start()
        for s in senders:
            s.join()
        stop.set()
        t.join()
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        print(json.dumps({"benchmark": "loop_stall", "commands": 32, "command_bytes": 64 * 1024,
                          "baseline": summary(baseline), "during": summary(lat),
                          "loadavg": load}))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
