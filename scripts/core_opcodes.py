"""Python opcodes the core executes in the scheduler benchmark (issue 23): a cost figure a
shared machine does not blur, for comparing two versions of the core where wall clock
and CPU time move by more than the change (other processes' load, caches).

Counts, inside ``Tangram.handle`` only: the burst (the one Submit of 2,048 actions) per
action, and the whole run (opens, the burst, every finish and close) per dispatch; with
``--by-function``, the run's opcodes per dispatch by the function executing them. The
schedule figures (act_mean_s, gpu_restores, batched_actions) come with them: a change
that only makes the core cheaper leaves them as they are.

    PYTHONPATH=. python scripts/core_opcodes.py [cpu|gpu ...] [--by-function]
"""

from __future__ import annotations

import collections
import json
import sys
from types import FrameType
from typing import Any

import numpy as np

from analysis.bench.scheduler import cpu_scenario, gpu_scenario, run_scheduler_scenario
from tangram.core import Tangram
from tangram.protocol import Open, Submit

N = 2048


class Counter:
    """Opcodes (and calls) executed while tracing, optionally by function."""

    def __init__(self, by_function: bool) -> None:
        self.ops = 0
        self.calls = 0
        self.by_function = by_function
        self.per: collections.Counter[tuple[str, str, int]] = collections.Counter()

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.ops += 1
            if self.by_function:
                c = frame.f_code
                self.per[(c.co_filename.rpartition("/")[2], c.co_name, c.co_firstlineno)] += 1
        return self._local

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        self.calls += 1
        frame.f_trace_opcodes = True
        return self._local

    def traced(self, handle: Any) -> Any:
        def wrapper(core: Tangram, command: Any, now: float) -> Any:
            sys.settrace(self._global)
            try:
                return handle(core, command, now)
            finally:
                sys.settrace(None)

        return wrapper


def main(argv: list[str]) -> None:
    by_function = "--by-function" in argv
    which = [a for a in argv if not a.startswith("--")] or ["cpu", "gpu"]
    handle = Tangram.handle
    for name, build in (("cpu", cpu_scenario), ("gpu", gpu_scenario)):
        if name not in which:
            continue
        cluster, actions = build(N, np.random.default_rng(0))
        core = Tangram(cluster)
        for a in actions:
            core.handle(Open(a.trajectory, a.task, 1.0), 0.0)
        burst = Counter(False)
        Tangram.handle = burst.traced(handle)  # type: ignore[method-assign]
        try:
            core.handle(Submit(tuple(actions)), 0.0)
        finally:
            Tangram.handle = handle  # type: ignore[method-assign]
        run = Counter(by_function)
        Tangram.handle = run.traced(handle)  # type: ignore[method-assign]
        try:
            r = run_scheduler_scenario(name, cluster, actions)
        finally:
            Tangram.handle = handle  # type: ignore[method-assign]
        print(json.dumps({
            "scenario": r["scenario"],
            "burst_opcodes_per_action": round(burst.ops / N, 1),
            "burst_calls_per_action": round(burst.calls / N, 2),
            "run_opcodes_per_dispatch": round(run.ops / r["dispatched"], 1),
            "run_calls_per_dispatch": round(run.calls / r["dispatched"], 2),
            "act_mean_s": r["act_mean_s"], "gpu_restores": r["gpu_restores"],
            "batched_actions": r["batched_actions"]}), flush=True)
        for (file, func, line), ops in run.per.most_common(25):
            print(f"  {ops / r['dispatched']:8.1f} opcodes/dispatch  {func} ({file}:{line})")


if __name__ == "__main__":
    main(sys.argv[1:])
