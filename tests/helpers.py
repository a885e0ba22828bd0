"""Small builders shared by the tests."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import re
import time

import numpy as np

from sim.clock import SimClock
from sim.modelled import ModelledBackend
from tangram.cluster import ClusterSpec, CpuNodeSpec, GpuNodeSpec, QuotaSpec, ServiceSpec
from tangram.core import Tangram
from tangram.model import Action, Demand, Elasticity, Outcome
from tangram.protocol import (
    Close,
    CpuNodeView,
    Effect,
    Finish,
    GpuNodeView,
    Open,
    Poll,
    Snapshot,
    Submit,
)
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


# -- the core driven through its door (tangram/protocol.py), as a driver drives it ---------
def open_trajectory(core: Tangram, trajectory: str, task: str = "default",
                    mem_gb: float | None = None) -> None:
    core.handle(Open(trajectory, task, mem_gb), 0.0)  # (Open takes no time: it effects none)


def submit(core: Tangram, action: Action, now: float) -> list[Effect]:
    return core.handle(Submit((action,)), now)


def submit_many(core: Tangram, actions, now: float) -> list[Effect]:
    return core.handle(Submit(tuple(actions)), now)


def finish(core: Tangram, action_id: str, now: float,
           outcome: Outcome | None = None) -> list[Effect]:
    return core.handle(Finish(action_id, outcome), now)


def close_trajectory(core: Tangram, trajectory: str, now: float) -> list[Effect]:
    return core.handle(Close(trajectory), now)


def poll(core: Tangram, now: float) -> list[Effect]:
    return core.handle(Poll(), now)


def counts(core: Tangram) -> Snapshot:
    """The snapshot's counts, usage and capacity (no per-node views)."""
    return core.snapshot(detail=False)


def queued_ids(core: Tangram) -> set[str]:
    """The ids of the actions queued anywhere (a pool, a light lane, the binding queue)."""
    return {w.action.id for q in core.snapshot().queues for w in q.waiting}


def cpu_node(core: Tangram, name: str) -> CpuNodeView:
    return next(n for n in core.snapshot().cpu_nodes if n.name == name)


def cores_in_use(core: Tangram, name: str) -> int:
    """The cores of CPU node ``name`` someone holds."""
    node = cpu_node(core, name)
    return node.cores - len(node.free)


def gpu_node(core: Tangram, name: str) -> GpuNodeView:
    return next(n for n in core.snapshot().gpu_nodes if n.name == name)


def free_gpus(core: Tangram) -> int:
    return sum(size for node in core.snapshot().gpu_nodes for _, size in node.free)


def gpu_invariants(core: Tangram, shared: bool = True) -> None:
    """The GPU accounting as the snapshot shows it holds (AssertionError if not): every GPU
    of a node up is in one free chunk or one running lease, never both (a node down: in
    none or a lease still running); chunks and leases are aligned; resident memory never
    exceeds a GPU's and is what the node's ``mem_used`` says. ``shared`` False: the leases
    do not come out of the free chunks (a static policy's replicas own their GPUs apart
    from them, tangram/gpu/static.py), so they are checked among themselves only."""
    snap = core.snapshot()
    leases = {d.lease.action_id: d.lease for d in snap.running.values() if d.lease.gpus}
    for node in snap.gpu_nodes:
        owner = [0] * node.gpus
        for start, size in node.free:
            assert start % size == 0, f"{node.name}: free chunk ({start}, {size}) unaligned"
            for g in range(start, start + size):
                owner[g] += 1
        leased = owner if shared else [0] * node.gpus
        for lease in leases.values():
            if lease.node == node.name:
                assert lease.gpus[0] % len(lease.gpus) == 0, f"lease {lease} unaligned"
                for g in lease.gpus:
                    leased[g] += 1
        want = {0, 1} if node.down else {1}
        assert all(o in want for o in owner), f"{node.name}: GPUs owned {owner} times"
        assert all(o <= 1 for o in leased), f"{node.name}: GPUs leased {leased} times"
        mem = [0.0] * node.gpus
        for service, k, start in node.resident:
            for g in range(start, start + k):
                mem[g] += snap.service_gb[service] / k
        for g, m in enumerate(mem):
            assert m <= node.gpu_mem_gb + 1e-6, f"{node.name} GPU {g}: {m} GB resident"
            assert abs(m - node.mem_used[g]) < 1e-6, f"{node.name} GPU {g}: memory drift"


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


async def until(check, timeout: float, what: str, seen=None) -> None:
    """Await ``check()`` (a function or a coroutine function) turning true; an
    AssertionError naming ``what``, and what ``seen()`` describes when given, after
    ``timeout`` s (a hang guard, not a speed bound)."""
    deadline = time.monotonic() + timeout
    while not (await ok if inspect.isawaitable(ok := check()) else ok):
        if time.monotonic() > deadline:
            saw = f"; saw {seen()}" if seen is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{saw}")
        await asyncio.sleep(0.02)


def until_true(check, timeout: float, what: str):
    """Call ``check()`` until it returns something true (returned); an AssertionError
    naming ``what`` and the last value after ``timeout`` s (a hang guard, not a bound)."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} "
                                 f"(last seen: {got!r})")
        time.sleep(0.05)
    return got


#: a sandbox's background process racing a fork (issue 45 #1-3, #7): it swaps each of its
#: directories ``a0``..``a15`` with ``l0``..``l15``, symlinks to a host directory
#: (``renameat2`` with RENAME_EXCHANGE: atomic, both names always exist), in a tight loop
#: (16 pairs: a root ``cp -a`` read the host directory in ~half the copies, 1 pair: ~1 in
#: 200); does the same in every copy it can reach and writes into it; counts its rounds
#: in ``count``. argv: the host directory, then the copies' directories as it sees them
SWAPPER = r"""
import ctypes, os, sys
target, copies = sys.argv[1], [c.encode() for c in sys.argv[2:]]
libc = ctypes.CDLL(None, use_errno=True)
PAIRS = [(b"a%d" % i, b"l%d" % i) for i in range(16)]
for a, link in PAIRS:
    os.makedirs(a, exist_ok=True)
    with open(a + b"/mine", "w") as f:
        f.write("mine\n")
    if not os.path.lexists(link):
        os.symlink(target, link)
n = 0
while True:
    for a, link in PAIRS:
        libc.renameat2(-100, a, -100, link, 2)
    if n % 16 == 0:
        for c in copies:
            libc.renameat2(-100, c + b"/a0", -100, c + b"/l0", 2)
            try:
                os.close(os.open(c + b"/from-the-source", os.O_CREAT | os.O_WRONLY, 0o666))
            except OSError:
                pass
    n += 1
    if n % 2000 == 0:
        with open("count.tmp", "w") as f:
            f.write(str(n))
        os.rename("count.tmp", "count")
"""
