"""The floor of ``tangram bench sim-scale`` (analysis/bench/sim_scale.py): a minimal SimPy model of a
trace's closed loop, with no scheduler, no records and no outputs. Absolute speeds differ up
to 3x between machines and with their load; the simulator's cost divided by this floor's,
measured in the same process a moment apart, is the figure to compare.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import simpy


def floor_model(specs: Iterable[Any], capacity: dict[str, float]) -> int:
    """The minimal SimPy model of a trace's closed loop: per trajectory, think, take the
    action's minimum units of its key resource from one shared pool (FIFO), hold them for
    the action's true duration on that many, give them back. Returns the actions run."""
    env = simpy.Environment()
    pools = {r: simpy.Container(env, capacity=c, init=c) for r, c in capacity.items() if c > 0}
    done = [0]

    def trajectory(steps: tuple[Any, ...]):
        for step in steps:
            if step.think_s > 0:
                yield env.timeout(step.think_s)
            action = step.action
            res = "gpu" if action.min("gpu") > 0 else "cpu" if action.min("cpu") > 0 else None
            units = action.min(res) if res is not None else 0
            truth = step.truth
            dur = truth.duration(max(int(units), 1)) if truth is not None else (action.t1_s or 0.0)
            pool = pools.get(res) if res is not None else None
            if pool is not None:
                yield pool.get(units)
            yield env.timeout(dur)
            if pool is not None:
                yield pool.put(units)
            done[0] += 1

    for spec in specs:
        env.process(trajectory(spec.steps))
    env.run()
    return done[0]
