"""Per-action overhead of the live backends (``tangram bench executor``)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

from executor.driver import LiveExecutor
from executor.local import local_cluster
from executor.replay import make_backend
from tangram.core import Tangram
from tangram.model import Action, Demand


def executor_bench(backend: str, n: int = 60, long_n: int = 5, long_s: float = 1.0) -> dict:
    """Per-action overhead of a live backend, measured around real commands.

    The command prints the wall clock at its first and last instruction, so
    ``start overhead = command start - submit`` and ``end overhead = result
    delivered - command end`` include the scheduler, the backend and (docker)
    the cgroup update and exec, but not the command's own work.
    """
    async def go() -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            ex = LiveExecutor(Tangram(local_cluster()), make_backend(backend, Path(tmp)))
            ex.open_trajectory("bench", "bench", 0.25)
            starts, ends, updates, fractions = [], [], [], []
            try:
                for i in range(n + long_n + 1):
                    sleep = long_s if i > n else 0.0
                    cmd = f"sh -c 'date +%s.%N; sleep {sleep}; date +%s.%N'"
                    action = Action(f"b{i}", "bench", "bench", "shell", {"cpu": Demand.fixed(1)},
                                    payload={"command": cmd})
                    t_submit = time.time()
                    rec, out = await ex.run(action)
                    t_done = time.time()
                    first, last = (float(x) for x in out.output.split())
                    if i == 0:
                        continue  # the first action creates the environment (container)
                    if i <= n:
                        starts.append((first - t_submit) * 1e3)
                        ends.append((t_done - last) * 1e3)
                        if "update_s" in out.extra:
                            updates.append(out.extra["update_s"] * 1e3)
                    else:
                        fractions.append(((first - t_submit) + (t_done - last)) / (last - first))
            finally:
                ex.close_trajectory("bench")
                ex.shutdown()
        s, e = np.asarray(starts), np.asarray(ends)
        res = {"backend": backend, "actions": n,
               "submit_to_start_p50_ms": round(float(np.percentile(s, 50)), 2),
               "submit_to_start_p99_ms": round(float(np.percentile(s, 99)), 2),
               "end_to_result_p50_ms": round(float(np.percentile(e, 50)), 2),
               "end_to_result_p99_ms": round(float(np.percentile(e, 99)), 2),
               "overhead_p50_ms": round(float(np.percentile(s + e, 50)), 2),
               f"overhead_fraction_of_{long_s:g}s_actions": round(float(np.mean(fractions)), 4)}
        if updates:
            u = np.asarray(updates)
            res["cgroup_update_p50_ms"] = round(float(np.percentile(u, 50)), 2)
            res["cgroup_update_p99_ms"] = round(float(np.percentile(u, 99)), 2)
        return res

    return asyncio.run(go())
