"""`tangram bench live-mix`: a real test suite beside short shell commands, through a real
`tangram serve --backend process`, under several policies in one run.

The suite is sympy's own (a well-known pure-Python project; in the dev extras, so it is
here offline): each trajectory's reward is one of its test modules, run as the reward
action (``python -m pytest --pyargs MODULE``, elastic: the server may rewrite it to
``pytest -n k``), with short shell commands before and after it (listing, editing a file,
importing sympy, factoring a polynomial) and a think time between actions, as an agent
does. Nothing is declared (no ``t1_s``): the server learns, as it would for a real client.

Every policy gets a fresh server pinned to the same ``cores`` and the same seeded
trajectories. Per policy: makespan (first open to last close), the queue wait the server
recorded for the short commands (mean, p99, max; for those that ran on the light lane and
for the rest), the rewards' queue wait, execution time and cores, and the machine's load
(1-minute load average before and after, and this machine's CPU count): a loaded machine
stretches every figure, so compare policies measured in the same run.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np

from analysis.bench import QUIET, BenchError, Opt, Progress
from analysis.bench.serving import stop, wait_healthy

#: reward runs: sympy test modules of a few seconds on one idle core (traces/profile_suite.py)
REWARD_MODULES = ("sympy.core.tests.test_numbers", "sympy.core.tests.test_relational",
                  "sympy.sets.tests.test_sets", "sympy.ntheory.tests.test_primetest")
#: short commands an agent runs between its LLM turns: light ones (tens of ms) and
#: heavier ones of the same kind (importing the project: a second or more)
LIGHT = ("sh -c 'ls -la; tail -n 3 notes.txt 2>/dev/null; true'", "sh -c 'echo edit >> notes.txt'",
         "sh -c 'cat notes.txt 2>/dev/null | wc -l'")
HEAVY = ("{py} -c 'import sympy; print(sympy.__version__)'",
         "{py} -c 'import sympy as s; x = s.Symbol(\"x\"); print(s.factor(x**12 - 1))'")
POLICIES = ("tangram", "fixed-dop:1", "fixed-dop:2")


@dataclass(frozen=True)
class Step:
    """One action of a trajectory: what it runs, and the think time before it."""

    kind: str
    command: str
    think_s: float
    reward: bool = False


def plan(trajectories: int, shorts: int, seed: int, modules: tuple[str, ...],
         think_s: float) -> list[list[Step]]:
    """Each trajectory: ``shorts`` short commands, its reward (a test module) somewhere in
    the middle, thinking 0.5-1.5 x ``think_s`` before each action. Seeded."""
    rng = np.random.default_rng(seed)
    py = sys.executable
    out = []
    for j in range(trajectories):
        at = int(rng.integers(1, shorts))  # shorts before the reward
        steps = []
        for k in range(shorts + 1):
            think = float(rng.uniform(0.5, 1.5) * think_s) if k else float(rng.uniform(0, think_s))
            if k == at:
                module = modules[j % len(modules)]
                steps.append(Step("reward_test", f"{py} -m pytest -q -p no:cacheprovider "
                                  f"--pyargs {module}", think, reward=True))
                continue
            pool = LIGHT if rng.random() < 0.7 else HEAVY
            steps.append(Step("shell", pool[int(rng.integers(len(pool)))].format(py=py), think))
        out.append(steps)
    return out


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    a = np.asarray(xs)
    return {"n": len(xs), "mean_s": round(float(a.mean()), 3),
            "p99_s": round(float(np.percentile(a, 99)), 3), "max_s": round(float(a.max()), 3)}


async def _drive(url: str, token: str, trajectories: list[list[Step]], cores: int) -> dict:
    from tangram_sdk.client import TangramClient

    rows: list[dict] = []
    errors: list[str] = []
    async with TangramClient(url, token, timeout_s=900) as tg:
        async def one(j: int, steps: list[Step]) -> None:
            tid = await tg.open_trajectory(f"mix{j}", task="coding")
            for k, step in enumerate(steps):
                await asyncio.sleep(step.think_s)
                body = {"kind": step.kind, "command": step.command, "timeout_s": 900.0}
                if step.reward:
                    body.update(cpu=f"1-{cores}", elastic=True)
                res = await tg.run(tid, action_id=f"mix{j}-{k}", **body)
                if res["status"] != "ok" or res["exit_code"] != 0:
                    errors.append(f"{step.command[-60:]}: {res['status']} exit "
                                  f"{res['exit_code']} {res['error'][:80]} "
                                  f"{res['output'][-200:]}")
                rows.append({"reward": step.reward, "heavy": not step.reward
                             and "sympy" in step.command, **res})
            await tg.close_trajectory(tid)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(j, s) for j, s in enumerate(trajectories)))
        makespan = time.perf_counter() - t0
    shorts = [r for r in rows if not r["reward"]]
    rewards = [r for r in rows if r["reward"]]
    light = [r["queue_s"] for r in shorts if not r["heavy"]]
    return {
        "makespan_s": round(makespan, 2),
        "short_wait": _stats([r["queue_s"] for r in shorts]),
        # the light ones (ls, cat, an edit) and those importing sympy (a second or more)
        "light_wait": _stats(light),
        "heavy_short_wait": _stats([r["queue_s"] for r in shorts if r["heavy"]]),
        "light_waits_over_2s": sum(w > 2.0 for w in light),
        "lane_wait": _stats([r["queue_s"] for r in shorts if r["lane"]]),
        "shorts_on_lane": sum(bool(r["lane"]) for r in shorts),
        "reward_wait": _stats([r["queue_s"] for r in rewards]),
        "reward_exec": _stats([r["exec_s"] for r in rewards]),
        "reward_cores": sorted(int(r["units"] or 0) for r in rewards),
        "errors": len(errors), "first_errors": errors[:3],
    }


def run_policy(policy: str, trajectories: list[list[Step]], cores: int) -> dict:
    """One fresh `tangram serve --backend process --policy POLICY` pinned to ``cores``
    cores (its node has those), driven through ``trajectories``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "mix-" + os.urandom(8).hex()
    cpus = sorted(os.sched_getaffinity(0))[:cores]
    with tempfile.TemporaryDirectory() as tmp:
        # as root, commands run as sandbox users: they pass through the state dir to their
        # own (pytest looks for its config in every parent)
        os.chmod(tmp, 0o711)
        log = Path(tmp) / "server.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--port", str(port), "--backend", "process",
             "--policy", policy, "--state-dir", tmp],
            env={**os.environ, "TANGRAM_TOKEN": token}, stdout=subprocess.DEVNULL,
            stderr=log.open("w"), cwd=Path(__file__).resolve().parents[2],
            preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, log)
            load0 = os.getloadavg()[0]
            row = asyncio.run(_drive(f"http://127.0.0.1:{port}", token, trajectories, cores))
            return {"policy": policy, **row, "load_avg_1m_before": round(load0, 2),
                    "load_avg_1m_after": round(os.getloadavg()[0], 2)}
        finally:
            stop(proc)


def check(cores: int) -> None:
    """Refuse what this machine cannot run (ValueError naming the option)."""
    if cores > len(os.sched_getaffinity(0)):
        raise ValueError(f"cores: {cores} asked, this process may use "
                         f"{len(os.sched_getaffinity(0))}")


def live_mix_bench(policies: tuple[str, ...] = POLICIES, trajectories: int = 8, cores: int = 2,
                   shorts: int = 6, seed: int = 0, think_s: float = 1.0,
                   modules: tuple[str, ...] = REWARD_MODULES,
                   progress: Progress = QUIET) -> Iterator[dict]:
    """One row per policy as each run ends (same trajectories, same cores), then a summary
    row comparing the first policy with the others."""
    check(cores)
    steps = plan(trajectories, shorts, seed, modules, think_s)
    rows = []
    for p in policies:
        progress(len(rows), len(policies))
        progress.phase(f"policy {p}")
        rows.append(run_policy(p, steps, cores))
        progress(len(rows), len(policies))
        yield rows[-1]
    first, others = rows[0], rows[1:]
    summary = {
        "summary": True, "policy": first["policy"], "against": [r["policy"] for r in others],
        "cpus": os.cpu_count(), "cores": cores, "trajectories": trajectories, "seed": seed,
        # the targets: makespan and short-command wait no worse than any other,
        # and no light command waiting more than 2 s
        "makespan_no_worse": all(first["makespan_s"] <= r["makespan_s"] for r in others),
        "short_wait_mean_no_worse": all(first["short_wait"].get("mean_s", 0)
                                        <= r["short_wait"].get("mean_s", 0) for r in others),
        "light_waits_over_2s": first["light_waits_over_2s"],
    }
    yield summary


def command(
    policies: Annotated[str, Opt(
        "Policies, comma-separated; the first is compared with the others.")]
    = "tangram,fixed-dop:1,fixed-dop:2",
    trajectories: Annotated[int, Opt("Concurrent trajectories.", min=1)] = 8,
    cores: Annotated[int, Opt("Cores the server is pinned to.", min=1)] = 2,
    shorts: Annotated[int, Opt("Short commands per trajectory.", min=2)] = 6,
    think_s: Annotated[float, Opt("Mean think time between actions.", min=0.0)] = 1.0,
    modules: Annotated[str | None, Opt(
        "Reward test modules (sympy's), comma-separated; default: four of a few seconds "
        "each on an idle core.")] = None,
    seed: int = 0,
    progress: Progress = QUIET,
) -> Iterator[dict]:
    """Sympy's own test modules, one per trajectory as its reward, beside short shell
    commands, through `tangram serve --backend process` pinned to --cores: makespan, the
    short commands' queue wait (mean/p99/max; light ones and those importing sympy apart),
    the rewards' wait, time and cores, and the machine's load (one JSON line per policy,
    then a summary). Takes minutes: the tests really run."""
    from tangram.policies import make_policy

    names = tuple(p.strip() for p in policies.split(",") if p.strip())
    try:
        for name in names:
            make_policy(name)
        check(cores)
        yield from live_mix_bench(names, trajectories, cores, shorts, seed, think_s,
                                  tuple(m.strip() for m in modules.split(",")) if modules
                                  else REWARD_MODULES, progress)
    except (ValueError, RuntimeError) as e:
        raise BenchError(str(e)) from None
