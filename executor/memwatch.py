"""The local node's free memory, observed for the core's memory admission.

Once a second (``period_s``) the machine's ``MemAvailable`` is handed to the core
(``CpuManager.observe_free``): from then on the node admits sandboxes by what
they use, their declared ``mem_gb`` being their cap (tangram/managers/memory.py).
When trajectories wait for a node, a scheduling pass follows each observation,
so memory freed by a sandbox's processes (not only by a close) admits them.
A multi-node backend (Ray) observes nothing: its nodes keep reserving every
declared limit in full.

Reclaiming. When the first trajectory waiting for the node is refused, idle
trajectories (nothing in flight for ``reclaim_idle_s``) give their place, least
recently used first: the core unbinds them (their declared memory no longer
counts) and the backend drops what holds memory for them (``evict``: the docker
backend removes the container, so their next action runs in a fresh one and
reports ``state_lost``; a backend without ``evict``, the process backend, holds
nothing in memory for an idle trajectory and its files stay on disk). A
trajectory's next action binds it again like a first action. Over the declared
cap as many are reclaimed as the waiting one needs; on an observed shortage one
per observation (its freed memory shows in the next one). Rollouts that finished
are closed by their reward (tangram.integrations.verl.compute_score), so the
idle ones left are the abandoned or the slow.
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
                 node: str = "local", period_s: float = 1.0,
                 reclaim_idle_s: float = 2.0) -> None:
        self.executor = executor
        self.node = node
        self.period_s = period_s
        self.reclaim_idle_s = reclaim_idle_s
        #: trajectories reclaimed so far (for the status and the tests)
        self.reclaimed = 0
        executor.core.cpu.admission = admission
        self._task: asyncio.Task | None = None

    def observe(self) -> None:
        free = mem_available_gb()
        if free is None:
            return
        core = self.executor.core
        core.cpu.observe_free(self.node, free)
        runtime = self.executor.runtime
        again = True
        while again and (core.unbound or core.opening):  # someone waits for memory
            again = self.reclaim()  # for the first one waiting; the pass binds it
            runtime._launch(runtime._timed(core.poll, self.executor.clock.now()))

    def reclaim(self) -> bool:
        """Unbind idle trajectories (least recently used first) for the first one waiting;
        True when they made room under the declared cap (the next one may need more)."""
        core = self.executor.core
        node = core.cpu.nodes.get(self.node)
        if node is None or not core.unbound or core.policy.env_start == "open":
            return False  # a pod per trajectory holds its place until it closes
        first = core.unbound[0].action
        state = core.trajectories.get(first.trajectory)
        if state is None:
            return False
        need = state.mem_gb if state.mem_gb is not None else first.min("mem_gb")
        if core.cpu.mem_refusal(node, need) is None:
            return False
        env = getattr(self.executor.backend, "env", self.executor.backend)
        evict = getattr(env, "evict", None)
        now = self.executor.clock.now()
        idle = sorted((st.last_end, tid) for tid, st in core.trajectories.items()
                      if not st.in_flight and core.cpu.node_of(tid) == self.node
                      and now - st.last_end >= self.reclaim_idle_s)
        for _, tid in idle:
            over_cap = node.mem_reserved + need > \
                core.cpu.admission.overcommit * node.spec.mem_gb + 1e-9
            if not over_cap and evict is None:
                return False  # nothing held in memory to free: the shortage is not theirs
            if evict is not None and not evict(tid):
                continue  # busy after all
            core.cpu.unbind(tid)
            self.reclaimed += 1
            if not over_cap:
                return False  # observed shortage: one per observation
            if core.cpu.mem_refusal(node, need) is None:
                return True
        return False

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
