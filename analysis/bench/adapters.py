"""Per-call overhead of the framework adapters (tangram_sdk.integrations) over the
plain client, against a real `tangram serve` (JSON on stdout).

    python -m analysis.bench.adapters [--calls 200] [--backend process] [--url URL]

Each call runs ``true`` in one open sandbox, sequentially (one call in flight),
so a call's latency is the HTTP round trips, the scheduler pass and the spawn;
an adapter's overhead is its mean latency minus the plain client's of the same
flavour (asyncio for verl, blocking for gymnasium and SkyRL), and, steadier, its
CPU time per call in the calling process minus the plain client's. The rounds
interleave the paths, so a change of machine load hits all of them alike.
Without --url a server is started on a free port and stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

from analysis.bench import QUIET, Opt, Progress
from analysis.bench.server import start_server
from tangram_sdk.client import TangramClient, TangramSyncClient


def _stats(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {"n": len(ms), "mean_ms": round(statistics.fmean(ms), 3),
            "p50_ms": round(ms[len(ms) // 2], 3), "p95_ms": round(ms[int(len(ms) * 0.95)], 3)}


def bench(url: str, token: str, calls: int, rounds: int = 10,
          progress: Progress = QUIET) -> dict[str, object]:
    """Time ``calls`` calls through each path; returns the figures."""
    from tangram_sdk.integrations import verl as verl_adapter
    from tangram_sdk.integrations.gym import TangramEnv
    from tangram_sdk.integrations.skyrl import TangramTextEnv

    per_round = max(calls // rounds, 1)
    names = ("client_async", "verl", "client_sync", "gymnasium", "skyrl")
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, float] = dict.fromkeys(names, 0.0)  # this process's CPU time (s)

    def timed() -> None:  # one more call timed (outside the timing)
        progress(sum(map(len, times.values())), len(names) * rounds * per_round)

    async def async_paths() -> None:
        tool = verl_adapter.TangramTool({"base_url": url, "token": token, "task": "bench"})
        rollout = types.SimpleNamespace(request_id="bench-rollout")
        async with TangramClient(url, token) as tg:
            tid = await tg.open_trajectory(task="bench")
            await tg.run(tid, command="true")  # warm both paths up
            iid, _ = await tool.create()
            await tool.execute(iid, {"command": "true"}, agent_data=rollout)
            await tool.release(iid)
            for _ in range(rounds):
                for _ in range(per_round):
                    c0, t0 = time.process_time(), time.perf_counter()
                    await tg.run(tid, command="true")
                    times["client_async"].append(time.perf_counter() - t0)
                    cpu["client_async"] += time.process_time() - c0
                    timed()
                for _ in range(per_round):  # verl 0.9's ToolAgentLoop order for one call
                    c0, t0 = time.process_time(), time.perf_counter()
                    iid, _ = await tool.create(create_kwargs={})
                    await tool.execute(iid, {"command": "true"}, agent_data=rollout)
                    await tool.release(iid)
                    times["verl"].append(time.perf_counter() - t0)
                    cpu["verl"] += time.process_time() - c0
                    timed()
            await tg.close_trajectory(tid)
            await tool.close_all()

    progress.phase("the async paths: client, verl")
    asyncio.run(async_paths())
    progress.phase("the sync paths: client, gymnasium, skyrl")

    gym_env = TangramEnv(url, token, task="bench")
    sky_env = TangramTextEnv({"base_url": url, "token": token, "task": "bench",
                              "max_turns": calls + 10}, {})
    with TangramSyncClient(url, token) as tg:
        tid = tg.open_trajectory(task="bench")
        gym_env.reset(seed=0)
        sky_env.init([])
        paths: list[tuple[str, Callable[[], object]]] = [
            ("client_sync", lambda: tg.run(tid, command="true")),
            ("gymnasium", lambda: gym_env.step("true")),
            ("skyrl", lambda: sky_env.step("<bash>true</bash>"))]
        for _, fn in paths:
            fn()
        for _ in range(rounds):
            for name, fn in paths:
                for _ in range(per_round):
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    cpu[name] += time.process_time() - c0
                    timed()
        tg.close_trajectory(tid)
    gym_env.close()
    sky_env.close()

    figures = {name: {**_stats(t), "client_cpu_ms": round(cpu[name] * 1000 / len(t), 3)}
               for name, t in times.items()}
    # overhead_ms: wall-clock (noisy: server and machine load); overhead_cpu_ms: the
    # adapter's own work in the caller's process (steadier)
    base = {"verl": "client_async", "gymnasium": "client_sync", "skyrl": "client_sync"}
    for name, ref in base.items():
        f, r = figures[name], figures[ref]
        f["overhead_ms"] = round(f["mean_ms"] - r["mean_ms"], 3)
        f["overhead_cpu_ms"] = round(f["client_cpu_ms"] - r["client_cpu_ms"], 3)
    return {"benchmark": "adapters", "command": "true", "calls_per_path": per_round * rounds,
            "in_flight": 1, "verl_base": "verl BaseTool" if verl_adapter.HAVE_VERL else
            "stand-in (verl not importable)", "paths": figures}


def run(calls: int = 200, backend: str = "process", url: str | None = None,
        token: str | None = None, progress: Progress = QUIET) -> dict:
    """The bench against ``url`` (with ``token``), or against a server it starts on
    ``backend`` and stops at the end; with the machine's load before and after."""
    load_before = os.getloadavg()
    if url:
        result = bench(url, token or "", calls, progress=progress)
        result["backend"] = "given server"
    else:
        token = "bench-" + os.urandom(8).hex()
        with tempfile.TemporaryDirectory(prefix="tangram-bench-") as state:
            progress.phase(f"starting a {backend} server")
            proc, url = start_server(Path(state), token, ["--backend", backend])
            try:
                result = bench(url, token, calls, progress=progress)
            finally:
                proc.terminate()
                proc.wait(30)
        result["backend"] = backend
    result["load"] = {"cpus": os.cpu_count(), "loadavg_1m_before": round(load_before[0], 2),
                      "loadavg_1m_after": round(os.getloadavg()[0], 2)}
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200, help="calls timed per path (default 200)")
    ap.add_argument("--backend", default="process", help="backend of the started server")
    ap.add_argument("--url", help="use a running server (token from TANGRAM_TOKEN)")
    args = ap.parse_args(argv)
    if args.calls < 10:
        ap.error("--calls: at least 10")
    token = os.environ.get("TANGRAM_TOKEN")
    if args.url and not token:
        ap.error("--url needs TANGRAM_TOKEN")
    print(json.dumps(run(args.calls, args.backend, args.url, token)), flush=True)


def command(
    backend: Annotated[str, Opt("Backend of the server it starts.")] = "process",
    calls: Annotated[int, Opt("Calls timed per path.", min=10)] = 200,
    progress: Progress = QUIET,
) -> Iterator[dict]:
    yield run(calls, backend, progress=progress)


if __name__ == "__main__":
    main()
