"""The local node's free memory, observed for the core's memory admission.

Once a second (``period_s``) the machine's ``MemAvailable`` is handed to the core
(``CpuManager.observe_free``): from then on the node admits sandboxes by what
they use, their declared ``mem_gb`` being their cap (tangram/managers/memory.py).
When trajectories wait for a node, a scheduling pass follows each observation,
so memory freed by a sandbox's processes (not only by a close) admits them.
A multi-node backend (Ray) observes nothing: its nodes keep reserving every
declared limit in full.
"""

from __future__ import annotations

import asyncio
import contextlib

from executor.driver import LiveExecutor
from tangram.managers.memory import MemoryAdmission


def mem_available_gb(path: str = "/proc/meminfo") -> float | None:
    """The kernel's estimate of memory available to new work (GB), None if unknown."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024**2
    except (OSError, ValueError, IndexError):
        return None
    return None


class MemoryWatch:
    """Observes ``node``'s free memory for ``executor``'s core every ``period_s``."""

    def __init__(self, executor: LiveExecutor, admission: MemoryAdmission,
                 node: str = "local", period_s: float = 1.0) -> None:
        self.executor = executor
        self.node = node
        self.period_s = period_s
        executor.core.cpu.admission = admission
        self._task: asyncio.Task | None = None

    def observe(self) -> None:
        free = mem_available_gb()
        if free is None:
            return
        core = self.executor.core
        core.cpu.observe_free(self.node, free)
        if core.unbound or core.opening:  # someone waits for memory: try to bind now
            runtime = self.executor.runtime
            runtime._launch(runtime._timed(core.poll, self.executor.clock.now()))

    def start(self) -> None:
        self.observe()
        self._task = self.executor.loop.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.observe()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(RuntimeError):  # the loop may already be closed
                self._task = None
