"""The file API on both sandbox backends in one run.

A real ``tangram serve`` per backend, one trajectory each, one action run first (so the
docker sandbox is an idle container held at its idle CPU quota, as between a rollout's
actions), then ``n`` ``put_file`` and ``n`` ``get_file`` of ``size`` bytes, one at a
time. Prints one JSON line: per backend the median and p90 seconds of each, and the
docker / process ratio of the medians.

    python -m analysis.bench.files [--n 20] [--size 65536]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from analysis.bench.serving import stop, wait_healthy


async def _measure(url: str, token: str, n: int, size: int) -> dict:
    from tangram_sdk.client import TangramClient

    data = os.urandom(size)
    puts, gets = [], []
    async with TangramClient(url, token, timeout_s=120) as tg:
        tid = await tg.open_trajectory(task="files")
        res = await tg.run(tid, argv=["true"])
        assert res["status"] == "ok", res
        await asyncio.sleep(0.5)  # idle: the action's cores reclaimed
        for i in range(n):
            t = time.perf_counter()
            await tg.put_file(tid, f"f{i}.bin", data)
            puts.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = await tg.get_file(tid, f"f{i}.bin")
            gets.append(time.perf_counter() - t)
            assert got == data
        await tg.close_trajectory(tid)

    def stats(xs: list[float]) -> dict:
        return {"p50_s": round(float(np.median(xs)), 4), "p90_s": round(float(np.percentile(xs, 90)), 4)}

    return {"put": stats(puts), "get": stats(gets)}


def run_backend(backend: str, n: int, size: int) -> dict:
    """One backend's figures from a fresh ``tangram serve``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "bench-" + os.urandom(8).hex()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli",
                "serve",
                "--port",
                str(port),
                "--backend",
                backend,
                "--state-dir",
                tmp,
            ],
            env={**os.environ, "TANGRAM_TOKEN": token},
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
            cwd=Path(__file__).parents[2],
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, log, 120.0)
            return asyncio.run(_measure(url, token, n, size))
        finally:
            stop(proc)


def files_bench(n: int = 20, size: int = 65536) -> dict:
    out: dict = {"bench": "files", "n": n, "size_bytes": size}
    for backend in ("process", "docker"):
        out[backend] = run_backend(backend, n, size)
    for op in ("put", "get"):
        out[f"{op}_docker_over_process"] = round(
            out["docker"][op]["p50_s"] / max(out["process"][op]["p50_s"], 1e-9), 2
        )
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    out["cpus"] = os.cpu_count()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--size", type=int, default=65536)
    args = ap.parse_args()
    print(json.dumps(files_bench(args.n, args.size)), flush=True)


if __name__ == "__main__":
    main()
