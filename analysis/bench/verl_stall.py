"""Benchmark: verl's stock ToolAgentLoop against `tangram serve`, a batch of rollouts
each declaring more memory than the machine has in total.

    python -m analysis.bench.verl_stall                      # 64 rollouts x 4 calls
    python -m analysis.bench.verl_stall --mem-overcommit 1   # every limit reserved
    python -m analysis.bench.verl_stall --backend docker --steps 2 --fresh-ids --train-s 30
    python -m analysis.bench.verl_stall --backend docker --serve-arg=--warm-pool=64 \
        --serve-arg=--sandbox-mem-gb=4 --start-after-s 40   # a pool made before step 1

It starts `tangram serve` (``--backend``, default process) on a free loopback port, builds the
tool with verl's own loader from examples/verl_tool.yaml (mem_gb 4 per sandbox),
and runs ``--rollouts`` rollouts concurrently; each makes ``--calls`` tool calls
through verl 0.9.1's ``ToolAgentLoop._call_tool`` (compiled from verl's source,
tests/verl_torchfree.py) with a simulated generation time between calls. As in
the stock loop nothing closes a rollout's sandbox when it ends.

Prints one JSON object: the wait of each call in Tangram's queue (``queue_s``:
admission to a node plus waiting for a core; the first call of a rollout is the
one admitted, ``admission_wait_s``), the first call's wait end to end as the rollout
sees it (``first_call_wait_s``, and per step: with ``--fresh-ids`` each step's rollouts get
new sandboxes, ``--train-s`` apart, so a docker warm pool sized from the first step's
demand serves the second), how many calls waited for memory admission
(``tangram_actions_waiting_for_node``, sampled every 0.2 s), the peak of open
sandboxes, the memory they declare vs the memory the machine actually used
(MemTotal - MemAvailable, less the baseline: other work on the machine counts too),
the load average, and how many calls did not finish within ``--deadline-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # verl_torchfree: verl's modules without torch

from verl_torchfree import AgentData, function_call, load_verl_tools, stock_loop  # noqa: E402

from analysis.bench.server import start_server  # noqa: E402

TOKEN = "bench-token"


def used_gb() -> float:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) / 1024**2
    return info["MemTotal"] - info["MemAvailable"]


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


async def bench(url: str, rollouts: int, calls: int, think_s: float, deadline_s: float,
                steps: int, train_s: float = 0.0, fresh_ids: bool = False) -> dict:
    os.environ.update(TANGRAM_URL=url, TANGRAM_TOKEN=TOKEN)
    registry = load_verl_tools()
    with contextlib.redirect_stdout(sys.stderr):  # verl's loader prints the tool schema
        tool = registry.initialize_tools_from_config(str(ROOT / "examples" / "verl_tool.yaml"))[0]
    loop = stock_loop([tool])
    rng = random.Random(0)
    waits: list[tuple[int, float]] = []  # (call index, queue_s)
    walls: list[tuple[int, int, float]] = []  # (step, call index, seconds, end to end)
    errors: list[str] = []
    peak = {"open": 0, "declared_gb": 0.0, "used_gb": 0.0, "waiting": 0, "samples": 0,
            "waiting_samples": 0}
    base = used_gb()

    async def rollout(i: int) -> None:
        # full_determinism's ids, reused every step; without it (fresh_ids) new each step
        agent = AgentData(f"r-{i}" if fresh_ids else f"det-{i % rollouts}")
        for c in range(calls):
            await asyncio.sleep(rng.uniform(0.2, 1.8) * think_s)  # the model generating
            call = function_call("shell", json.dumps(
                {"command": f"echo call {c} >> log.txt && wc -l < log.txt"}))
            t = time.monotonic()
            resp, _, metrics = await loop._call_tool(call, agent.tools_kwargs, agent)
            walls.append((i // rollouts, c, time.monotonic() - t))
            if metrics.get("queue_s") is None:
                errors.append(resp.text[:200])
            else:
                waits.append((c, metrics["queue_s"]))

    async def sample(http: httpx.AsyncClient) -> None:
        while True:
            text = (await http.get("/metrics")).text
            m = re.search(r"^tangram_open_trajectories (\S+)", text, re.M)
            d = re.search(r'^tangram_resource_in_use\{resource="mem_gb"\} (\S+)', text, re.M)
            peak["open"] = max(peak["open"], int(float(m.group(1))) if m else 0)
            peak["declared_gb"] = max(peak["declared_gb"], float(d.group(1)) if d else 0.0)
            peak["used_gb"] = max(peak["used_gb"], used_gb() - base)
            w = re.search(r"^tangram_actions_waiting_for_node (\S+)", text, re.M)
            waiting = int(float(w.group(1))) if w else 0
            peak["waiting"] = max(peak["waiting"], waiting)
            peak["samples"] += 1
            peak["waiting_samples"] += waiting > 0
            await asyncio.sleep(0.2)

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) \
            as http:
        sampler = asyncio.create_task(sample(http))
        t0 = time.monotonic()
        pending: set = set()
        for step in range(steps):  # the stock loop closes nothing: earlier steps' sandboxes idle
            tasks = [asyncio.create_task(rollout(step * rollouts + i)) for i in range(rollouts)]
            _, pending = await asyncio.wait(tasks, timeout=deadline_s)
            for t in pending:
                t.cancel()
            if pending:
                break
            if step + 1 < steps:
                await asyncio.sleep(train_s)  # the trainer's update between rollout steps
        wall = time.monotonic() - t0
        await asyncio.sleep(0.5)
        sampler.cancel()
    first = [w for c, w in waits if c == 0]
    first_wall = [w for _, c, w in walls if c == 0]
    per_step = [[w for s, c, w in walls if c == 0 and s == step] for step in range(steps)]
    every = [w for _, w in waits]
    return {
        "rollouts": rollouts, "steps": steps, "calls_per_rollout": calls,
        "mem_gb_declared_each": tool.settings.mem_gb,
        "calls_done": len(waits), "calls_failed": len(errors), "rollouts_unfinished": len(pending),
        "first_error": errors[0] if errors else None,
        "admission_wait_s": {"p50": percentile(first, 0.5), "p99": percentile(first, 0.99),
                             "max": max(first) if first else None},
        # the first call end to end, as the rollout waits for it: opening the sandbox, its
        # admission, the container's start (docker), the command and the answer
        "first_call_wait_s": {"p50": percentile(first_wall, 0.5),
                              "p99": percentile(first_wall, 0.99),
                              "max": round(max(first_wall), 4) if first_wall else None},
        "first_call_wait_s_per_step": [{"p50": percentile(xs, 0.5), "p99": percentile(xs, 0.99)}
                                       for xs in per_step],
        "queue_wait_all_calls_s": {"p50": percentile(every, 0.5), "p99": percentile(every, 0.99),
                                   "max": max(every) if every else None},
        # sampled every 0.2 s: calls waiting for memory admission (not for a core)
        "peak_waiting_for_memory": peak["waiting"],
        "share_of_samples_with_a_wait_for_memory": round(
            peak["waiting_samples"] / max(peak["samples"], 1), 3),
        "peak_open_sandboxes": peak["open"], "peak_declared_gb": peak["declared_gb"],
        "peak_used_gb": round(peak["used_gb"], 2), "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--think-s", type=float, default=0.5, help="mean generation time per turn")
    ap.add_argument("--deadline-s", type=float, default=120.0, help="give up on a step after")
    ap.add_argument("--steps", type=int, default=1,
                    help="batches one after another (a step's sandboxes stay open, idle)")
    ap.add_argument("--train-s", type=float, default=0.0,
                    help="pause between steps (the trainer's update)")
    ap.add_argument("--fresh-ids", action="store_true",
                    help="new rollout ids each step (verl without full_determinism): a new "
                         "sandbox per rollout per step")
    ap.add_argument("--backend", default="process", help="process or docker (a container each)")
    ap.add_argument("--mem-overcommit", type=float, default=None,
                    help="passed to tangram serve (default: its own)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="one more argument for tangram serve (repeatable), e.g. "
                         "--serve-arg=--warm-pool=64")
    ap.add_argument("--start-after-s", type=float, default=0.0,
                    help="wait this long after the server answers before the first step "
                         "(e.g. for a --warm-pool to be made)")
    args = ap.parse_args()
    extra = ["--backend", args.backend]
    extra += ["--mem-overcommit", str(args.mem_overcommit)] if args.mem_overcommit else []
    extra += args.serve_arg
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(Path(tmp), TOKEN, extra)
        time.sleep(args.start_after_s)
        try:
            out = asyncio.run(bench(url, args.rollouts, args.calls, args.think_s,
                                    args.deadline_s, args.steps, args.train_s,
                                    args.fresh_ids))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    out.update(serve_args=extra, loadavg_start=load0, loadavg_end=os.getloadavg(),
               cores=os.cpu_count())
    with open("/proc/meminfo") as f:
        out["mem_total_gb"] = round(int(f.readline().split()[1]) / 1024**2, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
