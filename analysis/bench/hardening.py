"""Hardening figures, against a real `tangram serve` (process backend).

Prints one JSON line:
  background_child: exec_s of ``sleep 25 & echo started`` (the action ends when the
      command exits, not when its background child does)
  uploads: the server's RSS before and after 12 concurrent 64 MiB uploads (spooled to disk)
  status_streams: a trivial action's round trip with 0 and MAX_STREAMS event streams open,
      and how many snapshots the server built per second for them
  loadavg: /proc/loadavg at the end

    python -m analysis.bench.hardening
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import TOKEN, start_server  # noqa: E402

from executor.server.status import MAX_STREAMS  # noqa: E402

H = {"Authorization": f"Bearer {TOKEN}"}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024


def round_trips(c: httpx.Client, n: int, tag: str) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        c.post("/v1/trajectories/b/actions", params={"wait": 30},
               json={"id": f"{tag}{i}", "argv": ["true"]})
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    server = start_server(Path(tempfile.mkdtemp(prefix="bench-hard-")), "process")
    fig: dict = {}
    try:
        with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
            c.post("/v1/trajectories", json={"id": "b"})
            r = c.post("/v1/trajectories/b/actions", params={"wait": 60}, json={
                "id": "bg", "command": "sleep 25 & echo started", "shell": True}).json()
            fig["background_child"] = {"status": r["status"], "exec_s": round(r["exec_s"], 3)}

            before = rss_mb(server.proc.pid)
            blob = b"\0" * (64 << 20)

            def up(i: int) -> None:
                with httpx.Client(base_url=server.url, headers=H, timeout=300) as u:
                    u.put(f"/v1/trajectories/b/files/up{i}.bin", content=blob)

            ts = [threading.Thread(target=up, args=(i,)) for i in range(12)]
            peak = before
            for t in ts:
                t.start()
            while any(t.is_alive() for t in ts):
                peak = max(peak, rss_mb(server.proc.pid))
                time.sleep(0.05)
            fig["uploads"] = {"n": 12, "mib_each": 64, "rss_before_mb": round(before),
                              "rss_peak_mb": round(peak)}

            quiet = round_trips(c, 20, "q")
            stop = threading.Event()

            def stream() -> None:
                with httpx.Client(base_url=server.url, headers=H, timeout=60) as s:
                    with s.stream("GET", "/v1/status/events") as r:
                        for _ in r.iter_lines():
                            if stop.is_set():
                                return

            streams = [threading.Thread(target=stream, daemon=True) for _ in range(MAX_STREAMS)]
            for t in streams:
                t.start()
            time.sleep(1.0)
            s0 = c.get("/v1/status").json()["streams"]
            t0 = time.monotonic()
            busy = round_trips(c, 20, "s")
            s1 = c.get("/v1/status").json()["streams"]
            built_per_s = (s1["built"] - s0["built"]) / (time.monotonic() - t0)
            stop.set()
            fig["status_streams"] = {
                "streams": s1["open"], "rtt_p50_ms_without": round(statistics.median(quiet) * 1e3, 1),
                "rtt_p50_ms_with": round(statistics.median(busy) * 1e3, 1),
                "snapshots_built_per_s": round(built_per_s, 2)}
        with open("/proc/loadavg") as f:
            fig["loadavg"] = f.read().split()[:3]
        print(json.dumps(fig))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
