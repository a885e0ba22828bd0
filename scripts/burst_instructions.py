"""Machine instructions the core executes in the scheduler benchmark's burst (issue 23),
counted by valgrind's callgrind: a cost figure for comparing two versions of the core.

Why instructions, not wall time: on a shared machine the burst's wall clock (and even
its CPU time) moves by more than a change worth making (other processes, caches, a
machine that one day runs the same loop ~3.5x slower), and Python opcodes
(scripts/core_opcodes.py) weigh a cheap opcode like a dear one (an attribute read that
goes through ``__getattr__``, a C ``map`` over a short list). Instructions count what
the C under each opcode does, and they repeat exactly run to run.

What it counts: the scenario (``analysis.bench.scheduler``'s cpu or gpu, 2,048 actions, as ``tangram
bench scheduler`` builds it) is set up uninstrumented, its trajectories opened; then
callgrind collects inside the one ``Tangram.handle`` call that submits the 2,048 actions
(the burst). With ``--gc off`` the cyclic GC is collected and disabled first; with
``--gc on`` (default) a collection falls in the burst or not as it would in the
benchmark. With ``--run`` a second process counts every ``Tangram.handle`` call of a
whole run (opens, the burst, every finish and close; the simulator's own work is not
counted), as ``run_scheduler_scenario`` drives it. A burst takes ~35 s here, a run
longer. Repeated runs of one tree give the same count, but the same code checked out at
two paths differed by up to ~0.3% (likely memory layout: the paths' strings, the
environment): compare trees whose paths have the same length, e.g. a detached worktree
of the base next to yours (``git worktree add --detach``).

    PYTHONPATH=. python scripts/burst_instructions.py cpu|gpu [--gc on|off] [--run]

prints one JSON line: scenario, gc, burst_instructions (and run_instructions). Compare
two trees on the same machine and interpreter (the counts depend on Python's build).

How: valgrind starts with instrumentation off (``--instr-atstart=no``: the setup runs
unsimulated, much faster) and collects only inside ``operator.call``
(``--toggle-collect``), through which the measured calls are made; the child says when it
is set up, the driver switches instrumentation on (``callgrind_control -i on``) and tells
it to go. The count is the callgrind output's ``totals``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

N = 2048
TOOLS = ("valgrind", "callgrind_control")


def child(scenario: str, gc_on: bool, run: bool) -> None:
    """Under valgrind: set up, say 'ready' on stdout, wait for a line on stdin, then make
    the measured calls through ``operator.call``."""
    import operator

    import numpy as np

    from sim import bench
    from tangram.core import Tangram
    from tangram.protocol import Open, Submit

    # as the benchmark does (pin_one_core): the imports' objects out of the GC's way
    gc.collect()
    gc.freeze()
    build = bench.cpu_scenario if scenario == "cpu" else bench.gpu_scenario
    cluster, actions = build(N, np.random.default_rng(0))
    if run:
        handle = Tangram.handle

        def counted(core: Tangram, command: Any, now: float) -> Any:
            return operator.call(handle, core, command, now)

        Tangram.handle = counted  # type: ignore[method-assign]
    else:
        core = Tangram(cluster)
        for a in actions:
            core.handle(Open(a.trajectory, a.task, 1.0), 0.0)
        command = Submit(tuple(actions))
    if not gc_on:
        gc.collect()
        gc.disable()
    print("ready", flush=True)
    sys.stdin.readline()
    if run:
        bench.run_scheduler_scenario(scenario, cluster, actions)
    else:
        operator.call(core.handle, command, 0.0)


def measure(scenario: str, gc_on: bool, run: bool) -> int:
    """Instructions collected by callgrind in one child process."""
    with tempfile.TemporaryDirectory(prefix="burst_instructions.") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               "--toggle-collect=_operator_call*", f"--callgrind-out-file={out}",
               f"--log-file={os.path.join(tmp, 'valgrind.log')}",
               sys.executable, os.path.abspath(__file__), "--child", scenario,
               "--gc", "on" if gc_on else "off"] + (["--run"] if run else [])
        # a GPU plan's resident set is a frozenset: the same seed, the same iteration order
        env = dict(os.environ, PYTHONHASHSEED="0")
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=env)
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            proc.wait()
            raise SystemExit(f"burst_instructions: the child failed (valgrind exit {proc.returncode})")
        # valgrind runs the child in its own process: its pid is valgrind's
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True,
                       capture_output=True)
        proc.stdin.write("go\n")
        proc.stdin.close()
        proc.stdout.read()
        if proc.wait() != 0:
            raise SystemExit(f"burst_instructions: the child failed (exit {proc.returncode})")
        with open(out) as f:
            for line in f:
                if line.startswith("totals:"):
                    return int(line.split()[1])
    raise SystemExit("burst_instructions: no totals in callgrind's output")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=("cpu", "gpu"))
    p.add_argument("--gc", choices=("on", "off"), default="on",
                   help="off: collect, then disable the cyclic GC before the measured calls")
    p.add_argument("--run", action="store_true",
                   help="also count every core call of a whole run (a second process)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    gc_on = args.gc == "on"
    if args.child:
        child(args.scenario, gc_on, args.run)
        return
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        print(f"burst_instructions: {' and '.join(missing)} not found on PATH "
              "(install valgrind, e.g. apt-get install valgrind)", file=sys.stderr)
        raise SystemExit(2)
    result: dict[str, Any] = {"scenario": args.scenario, "gc": args.gc,
                              "burst_instructions": measure(args.scenario, gc_on, False)}
    if args.run:
        result["run_instructions"] = measure(args.scenario, gc_on, True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
