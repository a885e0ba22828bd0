"""Small builders shared by the tests."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time

import numpy as np

from sim.clock import SimClock
from sim.modelled import ModelledBackend
from tangram.cluster import ClusterSpec, CpuNodeSpec, GpuNodeSpec, QuotaSpec, ServiceSpec
from tangram.core import Tangram
from tangram.model import Action, Demand, Elasticity
from tangram.runtime import Runtime

_ids = itertools.count()


def cluster(cores=8, numa=1, nodes=1, mem_gb=64.0, gpu_nodes=0, quotas=(), services=()):
    return ClusterSpec(
        cpu_nodes=tuple(CpuNodeSpec(f"n{i}", cores, numa, mem_gb) for i in range(nodes)),
        gpu_nodes=tuple(GpuNodeSpec(f"g{i}", 8, 80.0) for i in range(gpu_nodes)),
        services=tuple(ServiceSpec(n, s) for n, s in services),
        quotas=tuple(QuotaSpec(*q) for q in quotas),
    )


def shell(traj, t1=None, cores=1, task="t", kind="shell", aid=None, **cost):
    c = {"cpu": Demand.fixed(cores)}
    c.update({k: Demand.fixed(v) for k, v in cost.items()})
    return Action(aid or f"a{next(_ids)}", task, traj, kind, c, t1_s=t1)


def test_run(traj, t1, lo=1, hi=8, p=1.0, aid=None, task="t"):
    return Action(aid or f"a{next(_ids)}", task, traj, "test_run",
                  {"cpu": Demand.range(lo, hi)}, elastic="cpu", t1_s=t1,
                  elasticity=Elasticity.amdahl(p))


test_run.__test__ = False  # not a pytest test


def gpu_call(traj, service, t1=1.0, choices=(1, 2, 4, 8), p=0.9, aid=None):
    return Action(aid or f"a{next(_ids)}", "t", traj, "reward_judge",
                  {"gpu": Demand.discrete(choices)}, elastic="gpu", t1_s=t1,
                  elasticity=Elasticity.amdahl(p), service=service)


class EventLoop:
    """The shared loop (SimClock + modelled backend, durations as declared) for core
    tests, checking invariants after every submit and every completion."""

    def __init__(self, core: Tangram, check=None):
        self.core = core
        self.clock = SimClock()
        self.runtime = Runtime(core, self.clock,
                               ModelledBackend(self.clock, np.random.default_rng(0)))
        self.check = check or (lambda c: None)

    @property
    def now(self) -> float:
        return self.clock.now()

    def submit(self, action):
        self.runtime.submit(action)
        self.check(self.core)

    def step(self) -> bool:
        """Finish the earliest running action (False: nothing left)."""
        stepped = self.clock.step()
        self.check(self.core)
        return stepped

    def run(self):
        while self.step():
            pass

    @property
    def records(self):
        return self.runtime.records


def cpus_of(output: str) -> set[int]:
    """Parse 'Cpus_allowed_list: 0-1,3' (from /proc/self/status) into {0, 1, 3}."""
    spec = re.search(r"Cpus_allowed_list:\s*(\S+)", output).group(1)
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def procs_with(arg: str) -> list[int]:
    """Pids whose command line has ``arg`` as one whole argument (read from /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if arg.encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass  # the process ended while we listed it
    return found


def procs_gone(arg: str, within_s: float = 60.0) -> list[int]:
    """Wait (up to ``within_s``) for no process to carry ``arg``; the pids still left."""
    deadline = time.time() + within_s
    while (left := procs_with(arg)) and time.time() < deadline:
        time.sleep(0.1)
    return left


async def until(check, timeout: float, what: str) -> None:
    """Await ``check()`` turning true; an AssertionError naming ``what`` after ``timeout`` s
    (a hang guard, not a speed bound)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)
