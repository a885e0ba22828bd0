"""`tangram burn`: a CPU worker whose run time on k cores follows Amdahl's law.

Live replay runs it for every trace row that names no real command, so a
replayed action does the work the trace says it does instead of sleeping:

    serial part   = t1 * (1 - p)   CPU seconds on one process
    parallel part = t1 * p         CPU seconds split over k processes (``-n k``)

On k free cores the wall time is ``t1 * ((1 - p) + p / k)``, exactly the
duration model of the simulator (``dur(k) = T1 / (E(k) * k)`` with Amdahl's
E). The work is measured in CPU time (``time.process_time``), not wall time, so
a contended core really stretches it, as it would a test suite. The serial
budget includes the interpreter's own start-up CPU time: the trace's ``t1_s``
is the whole action, process start included.

Like ``pytest``, it runs single-process unless told ``-n k``: the live
executor inserts ``-n <granted cores>`` into an elastic action's command
(executor/commands.py), so elasticity speeds it up only when the scheduler
grants more cores. This module imports nothing heavy (it is started once per
replayed action).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def spin(cpu_s: float) -> None:
    """Busy-loop until this process has used ``cpu_s`` seconds of CPU in total."""
    x = 0
    while time.process_time() < cpu_s:
        for i in range(2000):  # a few hundred microseconds between clock reads
            x ^= i
    return None


def burn(t1_s: float, parallel_fraction: float = 0.0, procs: int = 1) -> int:
    """Run the work; returns the exit status (0, or 1 when a worker died)."""
    serial = t1_s * (1.0 - parallel_fraction)
    share = t1_s * parallel_fraction / procs
    spin(serial)
    children = []
    for _ in range(procs - 1):
        pid = os.fork()
        if pid == 0:  # a child's CPU clock starts at zero
            try:
                spin(share)
            finally:
                os._exit(0)
        children.append(pid)
    spin(serial + share)  # this process does one share itself
    status = 0
    for pid in children:
        _, code = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(code) != 0:
            status = 1
    return status


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tangram burn",
        description="Burn CPU like a test suite: t1*(1-p) CPU seconds serially, then t1*p "
                    "split over -n processes. Wall time on k free cores: t1*((1-p)+p/k).")
    p.add_argument("--t1", type=float, required=True, metavar="SECONDS",
                   help="CPU seconds of the whole action on one core (start-up included)")
    p.add_argument("--parallel-fraction", "-p", type=float, default=0.0, metavar="P",
                   help="Amdahl parallel fraction in [0, 1] (default 0: all serial)")
    p.add_argument("-n", "--numprocesses", type=int, default=1, metavar="K",
                   help="processes for the parallel part (default 1)")
    p.add_argument("--exit-code", type=int, default=0, metavar="CODE",
                   help="exit with this status after the work (to model a failing command)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    problems = []
    if not args.t1 >= 0:
        problems.append(f"--t1: must be >= 0, got {args.t1}")
    if not 0.0 <= args.parallel_fraction <= 1.0:
        problems.append(f"--parallel-fraction: must be in [0, 1], got {args.parallel_fraction}")
    if args.numprocesses < 1:
        problems.append(f"-n: must be >= 1, got {args.numprocesses}")
    if not 0 <= args.exit_code <= 255:
        problems.append(f"--exit-code: must be in 0-255, got {args.exit_code}")
    if problems:
        print("tangram burn: error: " + "; ".join(problems), file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    status = burn(args.t1, args.parallel_fraction, args.numprocesses)
    print(f"burn t1={args.t1:g}s p={args.parallel_fraction:g} n={args.numprocesses} "
          f"wall={time.perf_counter() - t0:.3f}s cpu={time.process_time():.3f}s")
    return status or args.exit_code


if __name__ == "__main__":
    sys.exit(main())
