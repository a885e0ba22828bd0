"""The one virtual clock: the Clock protocol (tangram/runtime.py) on a SimPy environment.

The simulator (sim/driver.py) runs its trajectory processes on the same environment; the
benches (analysis/bench/scheduler.py), the experiments (analysis/experiments.py) and the tests drive the
core with it alone (``run()``/``step()``). Only SimPy's public API is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import simpy


class SimTimer:
    """A timer that is cancelled by marking it (SimPy cannot unschedule an event: the
    clock skips a cancelled timer when its time comes)."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class SimClock:
    """The Clock protocol on ``env`` (a fresh environment by default). Timers due at the
    same time fire in the order they were set (SimPy's FIFO for equal times)."""

    def __init__(self, env: simpy.Environment | None = None) -> None:
        self.env = env if env is not None else simpy.Environment()
        self._fired = False

    def now(self) -> float:
        return self.env.now

    def call_later(self, delay: float, fn: Callable[[], None]) -> SimTimer:
        timer = SimTimer()

        def fire(_event: Any) -> None:
            if not timer.cancelled:
                self._fired = True
                fn()

        self.env.timeout(max(delay, 0.0)).callbacks.append(fire)
        return timer

    def step(self) -> bool:
        """Fire the next timer that is not cancelled (False when none is left)."""
        while self.env.peek() != simpy.core.Infinity:
            self._fired = False
            self.env.step()
            if self._fired:
                return True
        return False

    def run(self) -> None:
        """Fire timers in time order until none is left."""
        self.env.run()
