"""The local node's free memory, observed for the core's memory admission.

Once a second (``period_s``) the machine's ``MemAvailable`` goes to the core as a
``MemoryObserved`` command (tangram/protocol.py), through the runtime like every other
command: from then on the node admits sandboxes by what they use, their declared
``mem_gb`` being their cap (tangram/cpu/admission.py, the rule the core was built with).
What follows is the core's decision, not this module's: while trajectories wait for
a node, idle ones (nothing in flight for ``reclaim_idle_s``) give their place, least
recently used first (``Reclaim`` effects: a backend that ``evicts``, docker, removes
their containers; the process backend keeps their files), and a scheduling pass
follows, so memory freed by a sandbox's processes (not only by a close) admits them.
Still below the headroom after that, the node sheds its largest sandbox (``Shed``: the
process backend kills that trajectory's commands, which end ``oom``), before the kernel's
OOM killer would pick by size alone. A server in a container sees its container's limit
as its memory (executor/node/cgroups.py).

Only the machine the server runs on is observed (executor/assemble.py); a multi-node
backend (Ray) observes nothing: its nodes keep reserving every declared limit in full.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from executor.driver import LiveExecutor
from executor.node import cgroups
from tangram.protocol import MemoryObserved, Shed

log = logging.getLogger(__name__)


def mem_available_gb(path: str = "/proc/meminfo") -> float | None:
    """The kernel's estimate of memory available to new work (GB), None if unknown; in
    a cgroup with a memory limit, at most what that limit leaves (executor/node/cgroups.py)."""
    host = _meminfo_available_gb(path)
    limited = cgroups.free_gb()
    if host is None or limited is None:
        return host if limited is None else limited
    return min(host, limited)


def _meminfo_available_gb(path: str) -> float | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024**2
    except (OSError, ValueError, IndexError):
        return None
    return None


class MemoryWatch:
    """Observes ``node``'s free memory for ``executor``'s core every ``period_s``, and
    every ``waiting_period_s`` while trajectories wait for a node.

    Why faster then: a sandbox admitted since the last observation is assumed to use
    ``start_gb`` (tangram/cpu/admission.py) until the next one shows what it does use, so
    a burst of opens is admitted ~(free - headroom) / start_gb at a time, one batch per
    observation: at 1 s, a burst of 1,024 trajectories' first actions waited up to tens of
    seconds for a node while the admitted ones' later actions ran."""

    def __init__(self, executor: LiveExecutor, node: str = "local", period_s: float = 1.0,
                 reclaim_idle_s: float = 2.0, waiting_period_s: float = 0.05) -> None:
        self.executor = executor
        self.node = node
        self.period_s = period_s
        self.waiting_period_s = waiting_period_s
        self.reclaim_idle_s = reclaim_idle_s
        self._task: asyncio.Task | None = None

    def observe(self) -> None:
        free = mem_available_gb()
        if free is not None:
            self.executor.runtime.apply(MemoryObserved(self.node, free, self.reclaim_idle_s))

    def start(self) -> None:
        self.observe()
        self._task = self.executor.loop.create_task(self._run())

    async def _run(self) -> None:
        since = 0.0
        while True:
            await asyncio.sleep(self.waiting_period_s)
            since += self.waiting_period_s
            if since >= self.period_s or self.executor.snapshot(detail=False).waiting_for_node:
                since = 0.0
                self.observe()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def largest_sandbox(use: Mapping[str, int], effect: Shed) -> tuple[str, str] | None:
    """What a backend that ``sheds`` kills for the core's ``Shed``: the trajectory whose
    sandbox holds the most of ``use`` (bytes by trajectory), and the error its running
    actions end ``oom`` with; None when no sandbox holds memory. The decision is logged."""
    if not use or max(use.values()) <= 0:
        return None
    worst = max(use, key=use.__getitem__)
    gb = use[worst] / 1024**3
    log.warning("memory short (%.2f GB free, %.2f GB kept): killing the commands of "
                "trajectory %r (%.2f GB)", effect.free_gb, effect.keep_gb, worst, gb)
    return worst, (f"out of memory: the machine was short of memory ({effect.free_gb:.2f} GB "
                   f"free where {effect.keep_gb:.2f} GB are kept free) and this trajectory's "
                   f"sandbox used the most ({gb:.2f} GB): its commands were killed")
