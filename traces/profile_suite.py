"""A trace of real commands: sympy's own test modules, profiled on this machine.

    python -m traces.profile_suite --out traces/samples/sympy.parquet

Each test module is run twice on this machine, exactly as the live executor
will run it: on one pinned core as written (``python -m pytest ... --pyargs
MODULE``), and on two pinned cores with ``-n 2`` (pytest-xdist). The first wall
time is the row's ``t1_s``; the speed-up on two cores gives the Amdahl parallel
fraction ``p = 2 (1 - T2 / T1)`` (clipped to [0, 0.95]: a module whose worker
start-up outweighs its tests gets 0, and the scheduler then never widens it).
Shell rows are real commands too (importing sympy, a small
factorisation, listing the directory), timed the same way; edits append to a file in the trajectory's working
directory. Modules that fail or error here are left out, so a replay of the
trace expects ``failed 0``.

Trajectories follow the coding generator's shape (traces/generate.py): its
calibrated think times and action mix, a few agent test runs, and one profiled
reward run (a larger module) at the end. Profiling takes minutes and depends on
the machine's load: the trace records the load average it was profiled under
(Parquet metadata ``tangram.profiled_load``), and a quiet machine gives the
truest profile.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from traces.generate import _row, _think, c

#: agent test runs: modules of a few seconds each on one core (sympy 1.14)
TEST_MODULES = (
    "sympy.core.tests.test_basic", "sympy.core.tests.test_symbol",
    "sympy.core.tests.test_containers", "sympy.printing.tests.test_str",
    "sympy.ntheory.tests.test_primetest", "sympy.utilities.tests.test_iterables",
)
#: reward runs (the hidden tests of a task): larger modules, tens of seconds
REWARD_MODULES = (
    "sympy.core.tests.test_numbers", "sympy.core.tests.test_relational",
    "sympy.sets.tests.test_sets",
)
PYTEST = "python -m pytest -q -p no:cacheprovider --pyargs {module}"
EDIT = "sh -c 'echo edit >> notes.txt'"
SHELL = ("python -c 'import sympy; print(sympy.__version__)'",
         "sh -c 'ls -la; tail -n 3 notes.txt 2>/dev/null; true'",
         "python -c 'import sympy as s; x = s.Symbol(\"x\"); print(s.factor(x**12 - 1))'")


def run_pinned(command: str, cores: list[int], cwd: Path, env: dict[str, str]) -> tuple[float, int]:
    """Wall seconds and exit code of ``command`` pinned to ``cores``."""
    argv = ["taskset", "-c", ",".join(map(str, cores)), *shlex.split(command)]
    t0 = time.perf_counter()
    res = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, timeout=900)
    return time.perf_counter() - t0, res.returncode


def with_n(command: str, k: int) -> str:
    """What the executor runs on k cores (executor/commands.py's rewrite)."""
    return command.replace("-m pytest", f"-m pytest -n {k}", 1)


def profile(commands: list[str], elastic: set[str], log=print) -> dict[str, dict]:
    cores = sorted(os.sched_getaffinity(0))
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cmd in commands:
            t1, code = run_pinned(cmd, cores[:1], Path(tmp), env)
            row = {"t1_s": t1, "exit_code": code, "parallel_fraction": float("nan")}
            if cmd in elastic and code == 0 and len(cores) >= 2:
                t2, code2 = run_pinned(with_n(cmd, 2), cores[:2], Path(tmp), env)
                row["t2_s"] = t2
                row["parallel_fraction"] = float(np.clip(2 * (1 - t2 / t1), 0.0, 0.95))
                row["exit_code"] = code or code2
            log(json.dumps({"command": cmd, **row}))
            out[cmd] = row
    return out


def build(n: int, prof: dict[str, dict], seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    ok = {cmd for cmd, r in prof.items() if r["exit_code"] == 0}
    tests = [m for m in TEST_MODULES if PYTEST.format(module=m) in ok]
    rewards = [m for m in REWARD_MODULES if PYTEST.format(module=m) in ok]
    if not tests or not rewards:
        raise SystemExit("profile_suite: no test module passed here; is sympy installed?")
    rows = []
    for j in range(n):
        traj = f"sympy-{j:03d}"
        k = int(rng.integers(10, 16))
        think = _think(rng, k, c("coding_think_tokens_median"))
        kinds = rng.choice(["shell", "file_edit", "test_run"], size=k - 1, p=[0.55, 0.3, 0.15])
        for seq, kind in enumerate(kinds):
            module = str(rng.choice(tests))
            if kind == "test_run":
                cmd = PYTEST.format(module=module)
                r = prof[cmd]
                rows.append(_row(task="coding", trajectory=traj, seq=seq, kind="test_run",
                                 think_s=think[seq], t1_s=r["t1_s"], cpu_cores="1-16",
                                 mem_gb=1.0, elastic="cpu",
                                 parallel_fraction=r["parallel_fraction"],
                                 timeout_s=c("test_timeout_s") * 4, command=cmd))
                continue
            if kind == "file_edit":
                cmd = EDIT
                t1 = prof[cmd]["t1_s"]
            else:
                cmd = str(rng.choice([s for s in SHELL if s in ok]))
                t1 = prof[cmd]["t1_s"]
            rows.append(_row(task="coding", trajectory=traj, seq=seq, kind=kind,
                             think_s=think[seq], t1_s=t1, cpu_cores="1", mem_gb=1.0,
                             timeout_s=c("test_timeout_s"), command=cmd))
        cmd = PYTEST.format(module=str(rng.choice(rewards)))
        r = prof[cmd]
        rows.append(_row(task="coding", trajectory=traj, seq=k - 1, kind="reward_test",
                         think_s=think[-1], t1_s=r["t1_s"], cpu_cores="1-32", mem_gb=1.0,
                         elastic="cpu", parallel_fraction=r["parallel_fraction"], profiled=True,
                         timeout_s=c("suite_timeout_s"), command=cmd))
    df = pd.DataFrame(rows)
    for col in ("think_s", "t1_s"):
        df[col] = df[col].astype(float).round(4)
    return df


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m traces.profile_suite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="trace file to write")
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    import pyarrow.parquet as pq

    from traces.samples import declare_measured
    from traces.schema import validate, write

    commands = [PYTEST.format(module=m) for m in TEST_MODULES + REWARD_MODULES]
    shell = [*SHELL, EDIT]
    load0 = os.getloadavg()[0]
    prof = profile(shell + commands, set(commands), log=lambda s: print(s, file=sys.stderr))
    load1 = os.getloadavg()[0]
    # what a profile tells the scheduler: the measurement off by the profiling error
    df = declare_measured(validate(build(args.trajectories, prof, args.seed)), args.seed)
    path = write(df, args.out)
    if path.suffix == ".parquet":  # where and under what load it was profiled
        table = pq.read_table(path)
        meta = dict(table.schema.metadata or {})
        meta[b"tangram.profiled_load"] = f"{load0:.2f}-{load1:.2f}".encode()
        meta[b"tangram.profiled_cores"] = str(len(os.sched_getaffinity(0))).encode()
        pq.write_table(table.replace_schema_metadata(meta), path, compression="zstd")
    print(f"wrote {path} ({len(df)} actions, {args.trajectories} trajectories; "
          f"load average {load0:.2f} -> {load1:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
