"""The GPU backend: runs dispatched GPU actions on the worker of their node.

The core has already decided everything when ``start`` is called, and the dispatch
carries it (``Dispatch.gpu``, a :class:`~tangram.model.GpuPlan`): the chunk
(``lease.gpus``), which variants to evict to make room (least recently used first) and
whether the action's variant must be restored. The backend turns that into one command
for the node's worker: *evict these variants, restore this one (or not), serve the
request*. It reads nothing of the core: it keeps a mirror of what it has told the worker
to hold, and checks three things, each of which fails the action loudly (and resets the
node, see below) when it does not hold, because a mismatch is a bug:

1. at start: the plan agrees with the mirror (restore iff the variant is not held; every
   variant to evict is held);
2. at the end of every action: the resident set the worker reports equals the
   mirror as it was after the last command the worker had applied;
3. when the node is quiet (nothing running there, every command applied): the worker's
   resident set equals the resident set of the newest plan carried out there
   (``GpuPlan.resident``: the core's, right after its latest decision on the node),
   exactly.

A worker that dies (crash, OOM kill) fails every action it was running, the core is
told (a :class:`~tangram.protocol.WorkerLost` command: it forgets the node's residency)
and the next action on that node gets a fresh worker that stages its services again.

A batch dispatch (``Dispatch.batch``, the core's continuous batching) is ONE
``run`` command: the worker serves its members with one forward pass and
reports each member on its own (``Capabilities.batches``). A pre-restore effect
(:class:`~tangram.protocol.PreRestore`) is a ``prerestore`` command: the worker
evicts at once and loads in the background; an action landing on the variant
meanwhile waits for the load (``Capabilities.prerestores``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from executor.backends.gpu.model import ModelSource
from tangram.cluster import ClusterSpec
from tangram.model import Dispatch, GpuPlan, Outcome
from tangram.protocol import Command as Command_
from tangram.protocol import PreRestore, Sink, Traits, WorkerLost

log = logging.getLogger("tangram.gpu")
Variant = tuple[str, int, int]
ROOT = str(Path(__file__).resolve().parents[3])  # where the executor package is


@dataclass(slots=True)
class Command:
    """What the actions of one ``run`` command share (one action, or a batch's)."""

    left: set[str]  # actions not reported yet
    counted: bool = False  # its restore is in the stats


@dataclass(slots=True)
class InFlight:
    """One action of a running command (``dispatch``: the command's, lead first)."""

    dispatch: Dispatch
    on_done: Callable[[Outcome], None]
    seq: int
    t_start: float
    variant: Variant
    command: Command
    computing: bool = False
    timer: asyncio.TimerHandle | None = None
    timed_out: float = 0.0


@dataclass(slots=True)
class ServiceStats:
    restores: int = 0
    prerestores: int = 0
    restore_s: float = 0.0
    restore_bytes: int = 0
    evictions: int = 0
    requests: int = 0
    failed: int = 0
    compute_s: float = 0.0
    #: run commands served to their end (a batch of several requests is one)
    batches: int = 0
    #: GPU-seconds its run commands held their leases (restores included; a batch once)
    gpu_s: float = 0.0


class NodeWorker:
    """One worker process and what the backend knows about it."""

    def __init__(self, node: str, gpus: int, device: str, devices: list[int],
                 services: list[tuple[str, ModelSource]]) -> None:
        self.node = node
        self._spawn(device, devices, services)
        self.gpus = gpus
        self.ready: dict[str, Any] | None = None
        self.fatal: str | None = None
        self.ready_event = threading.Event()
        self.commanded: set[Variant] = set()
        #: the variants of ``commanded``, least recently used first
        self.lru: list[Variant] = []
        #: the newest plan carried out on this node (check 3)
        self.latest: GpuPlan | None = None
        self.expected: dict[int, frozenset[Variant]] = {0: frozenset()}
        self.seq = 0
        self.inflight: dict[str, InFlight] = {}
        self.replies: dict[int, concurrent.futures.Future] = {}
        self.send_lock = threading.Lock()
        self.dead = False
        #: bytes each resident variant holds per GPU of its chunk (as the worker measured)
        self.variant_bytes: dict[Variant, list[int]] = {}

    def _spawn(self, device: str, devices: list[int],
               services: list[tuple[str, ModelSource]]) -> None:
        """Start the worker process (``proc``) and its pipe (``conn``) with the staging
        order (executor/backends/gpu/ray_worker.py starts it in a Ray actor on its node instead)."""
        # A fresh interpreter (``python -m executor.backends.gpu.worker``), not a fork: CUDA cannot be
        # used in a forked child, and multiprocessing's spawn would re-import the caller's
        # main module. The pipe is one end of a socket pair, passed as a file descriptor.
        mine, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
        if device == "cpu":
            # Concurrent actions are threads of the worker; a BLAS that also starts a thread
            # per core for every matmul oversubscribes the CPU many times over (measured:
            # a 32-token request went from ~10 ms to ~0.5 s under 16 concurrent actions).
            env.update({v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                         "MKL_NUM_THREADS")})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "executor.backends.gpu.worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(mine.detach())
        self.conn.send((device, devices, services))

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send(("stop",))
            except (OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self.conn.close()


class GpuBackend:
    """Backend for actions with a GPU lease (``service`` + ``gpus``) and a residency plan.

    ``cluster``: its GPU nodes and services (the same the core schedules). A worker lost
    is reported to the ``sink`` the driver gives (``watch``) as WorkerLost."""

    name = "gpu"
    traits = Traits(gpu=True, batches=True)

    def __init__(self, cluster: ClusterSpec,
                 sources: Mapping[str, ModelSource], device: str = "cpu",
                 physical: Mapping[str, list[int]] | None = None) -> None:
        self.nodes = {n.name: n for n in cluster.gpu_nodes}
        self.services = {s.name: s for s in cluster.services}
        self._sink: Sink | None = None
        self.sources = dict(sources)
        self.device = device
        self.physical = dict(physical or {})
        self.workers: dict[str, NodeWorker] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stats: dict[str, ServiceStats] = {s: ServiceStats() for s in self.sources}
        self.gpu_busy_s: dict[tuple[str, int], float] = {}
        self.crashes = 0
        self.mismatches = 0
        self._req = itertools.count(1)
        self.started = time.time()

    def watch(self, sink: Sink) -> None:
        """Report a lost worker to ``sink`` (WorkerLost), on the loop."""
        self._sink = sink

    # -- workers ---------------------------------------------------------------------
    def start_workers(self) -> None:
        """Start (and stage) every node's worker now instead of at its first action."""
        for node in self.nodes:
            self._worker(node)

    def _worker(self, node: str) -> NodeWorker:
        nw = self.workers.get(node)
        if nw is not None and not nw.dead and nw.proc.poll() is not None:
            self._on_exit(nw)  # died while idle, before its reader thread reported it
        if nw is not None and not nw.dead:
            return nw
        spec = self.nodes[node]
        devices = self.physical.get(node) or list(range(spec.gpus))
        missing = sorted(set(self.services) - set(self.sources))
        if missing:
            raise ValueError(f"services: no model (loader) for {missing}")
        nw = self._new_worker(node, spec.gpus, devices)
        self.workers[node] = nw
        threading.Thread(target=self._read, args=(nw,), daemon=True,
                         name=f"gpu-reader-{node}").start()
        return nw

    def _new_worker(self, node: str, gpus: int, devices: list[int]) -> NodeWorker:
        """A worker for ``node`` (a process here; a Ray actor's on its node: ray_worker.py)."""
        return NodeWorker(node, gpus, self.device, devices, sorted(self.sources.items()))

    def wait_ready(self, timeout: float = 600.0) -> dict[str, dict[str, Any]]:
        """Block until every started worker has staged its services; their reports."""
        out = {}
        for node, nw in self.workers.items():
            if not nw.ready_event.wait(timeout):
                raise TimeoutError(f"GPU worker of {node} did not stage in {timeout:g} s")
            if nw.fatal:
                raise RuntimeError(f"GPU worker of {node}: {nw.fatal}")
            out[node] = dict(nw.ready or {})
        return out

    def _read(self, nw: NodeWorker) -> None:
        """Reader thread: replies resolve futures here; the rest goes to the loop."""
        while True:
            try:
                msg = nw.conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "reply":
                fut = nw.replies.pop(msg[1], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg[2])
                continue
            if kind == "ready":
                nw.ready = msg[1]
                nw.ready_event.set()
                continue
            if kind == "fatal":
                nw.fatal = msg[1]
                nw.ready_event.set()
                continue
            self._post(self._on_message, nw, msg)
        nw.ready_event.set()
        for fut in list(nw.replies.values()):
            if not fut.done():
                fut.set_exception(RuntimeError(f"GPU worker of {nw.node} exited"))
        self._post(self._on_exit, nw)

    def _post(self, fn: Callable, *args: Any) -> None:
        if self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(fn, *args)
                return
            except RuntimeError:  # loop closed meanwhile
                pass

    # -- the Backend protocol ------------------------------------------------------------
    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        self.loop = asyncio.get_running_loop()
        lease, action, plan = d.lease, d.action, d.gpu
        if not lease.gpus or lease.node is None or not action.service or plan is None:
            self._fail_all(d, on_done, "gpu backend: the action has no GPU lease and "
                           "residency plan (the evict-on-execution GPU manager makes them)")
            return
        node = lease.node
        variant: Variant = (action.service, len(lease.gpus), lease.gpus[0])
        try:
            nw = self._worker(node)
        except (ValueError, OSError) as e:
            self._fail_all(d, on_done, str(e))
            return
        evict = list(plan.evict)
        restore = variant not in nw.commanded
        new = (nw.commanded - set(evict)) | {variant}
        problem = None
        if plan.variant != variant or plan.node != node:
            problem = f"the plan is for {plan.variant} on {plan.node}, the lease for {variant}"
        elif restore != plan.restore:
            problem = (f"the core {'restores' if plan.restore else 'reuses'} {variant} "
                       f"but the worker {'holds' if not restore else 'does not hold'} it")
        elif not set(evict) <= nw.commanded:
            problem = (f"the core evicts {sorted(set(evict) - nw.commanded)}, which the "
                       f"worker does not hold")
        if problem is not None:
            self._mismatch(nw, f"residency mismatch on {node} at the start of {action.id}: "
                               f"{problem}")
            self._fail_all(d, on_done, f"residency mismatch: {problem}")
            return
        nw.commanded = new
        nw.lru = [v for v in nw.lru if v in new and v != variant] + [variant]
        if nw.latest is None or plan.version > nw.latest.version:
            nw.latest = plan
        nw.seq += 1
        nw.expected[nw.seq] = frozenset(new)
        for v in evict:
            nw.variant_bytes.pop(v, None)
            self.stats[v[0]].evictions += 1
        self._send_run(nw, d, on_done, variant, evict, restore)

    def _send_run(self, nw: NodeWorker, d: Dispatch, on_done: Callable[[Outcome], None],
                  variant: Variant, evict: list[Variant], restore: bool) -> None:
        """One ``run`` command for the dispatch's actions (the lead, then its batch): the
        worker serves them with one forward pass and reports each on its own."""
        assert self.loop is not None
        actions = d.actions
        command = Command({a.id for a in actions})
        t_start = time.perf_counter()
        for a in actions:
            f = nw.inflight[a.id] = InFlight(d, on_done, nw.seq, t_start, variant, command)
            timeout = float((a.payload or {}).get("timeout_s") or 0) \
                if isinstance(a.payload, Mapping) else 0.0
            if timeout > 0:
                f.timer = self.loop.call_later(timeout, self._timeout, a.id, timeout)
        try:
            nw.send(("run", nw.seq, variant, list(d.lease.gpus), evict, restore,
                     [(a.id, a.payload) for a in actions]))
        except (OSError, ValueError) as e:  # the pipe broke: the worker is gone
            for a in actions:
                f = nw.inflight.pop(a.id, None)
                if f is not None and f.timer is not None:
                    f.timer.cancel()
            self._fail_all(d, on_done, f"GPU worker of {nw.node} unreachable: {e}")

    def _fail_all(self, d: Dispatch, on_done: Callable[[Outcome], None], error: str) -> None:
        assert self.loop is not None
        for a in d.actions:
            self.loop.call_soon(on_done, Outcome(a.id, "failed", None, error=error))

    def prerestore(self, effect: PreRestore) -> None:
        """Load ``effect.plan.variant`` ahead of demand (the core made it resident on a free
        chunk, evicting ``plan.evict``): the worker applies the evictions at once and loads
        in the background; an action that lands on the variant meanwhile waits for it."""
        self.loop = asyncio.get_running_loop()
        plan = effect.plan
        variant = plan.variant
        try:
            nw = self._worker(plan.node)
        except (ValueError, OSError) as e:
            log.error("pre-restore of %s on %s: %s", variant, plan.node, e)
            return
        evict = list(plan.evict)
        if variant in nw.commanded or not set(evict) <= nw.commanded:
            self._mismatch(nw, f"residency mismatch on {plan.node} at the pre-restore of "
                               f"{variant}: the worker holds {sorted(nw.commanded)}, the "
                               f"core evicts {evict} and loads it")
            return
        # the mirror, as for a dispatch (start), without an action
        nw.commanded = (nw.commanded - set(evict)) | {variant}
        nw.lru = [v for v in nw.lru if v in nw.commanded and v != variant] + [variant]
        if nw.latest is None or plan.version > nw.latest.version:
            nw.latest = plan
        nw.seq += 1
        nw.expected[nw.seq] = frozenset(nw.commanded)
        for v in evict:
            nw.variant_bytes.pop(v, None)
            self.stats[v[0]].evictions += 1
        gpus = list(range(variant[2], variant[2] + variant[1]))
        try:
            nw.send(("prerestore", nw.seq, variant, gpus, evict))
        except (OSError, ValueError):
            pass  # the worker is gone: its reader resets the node

    def _timeout(self, action_id: str, timeout: float) -> None:  # one member
        for nw in self.workers.values():
            f = nw.inflight.get(action_id)
            if f is not None:
                f.timed_out = timeout
        self.cancel(action_id)

    def cancel(self, action_id: str) -> None:
        """Stop a running action between two layers of its forward pass."""
        for nw in self.workers.values():
            if action_id in nw.inflight and not nw.dead:
                try:
                    nw.send(("cancel", action_id))
                except (OSError, ValueError):
                    pass

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None:
        return None

    def close_trajectory(self, trajectory: str) -> None:
        return None

    def shutdown(self) -> None:
        for nw in list(self.workers.values()):
            nw.dead = True
            nw.stop()

    # -- results -------------------------------------------------------------------------
    def _on_message(self, nw: NodeWorker, msg: tuple) -> None:
        kind = msg[0]
        if kind == "started":
            for aid in msg[1]:
                f = nw.inflight.get(aid)
                if f is not None:
                    f.computing = True
            return
        if kind == "prerestored":
            self._on_prerestored(nw, msg)
            return
        if kind != "done":
            return
        _, aid, status, output, error, info, applied, resident = msg
        f = nw.inflight.pop(aid, None)
        if f is None:
            return
        if f.timer is not None:
            f.timer.cancel()
        if f.timed_out and status == "cancelled":
            status, error = "timeout", f"stopped after the {f.timed_out:g} s timeout"
        c = f.command
        c.left.discard(aid)
        lease = f.dispatch.lease
        st = self.stats[f.variant[0]]
        if not c.left:  # the lease's GPUs were busy from the command to its last action
            now = time.perf_counter()
            for g in lease.gpus:
                key = (lease.node or "", g)
                self.gpu_busy_s[key] = self.gpu_busy_s.get(key, 0.0) + now - f.t_start
            st.gpu_s += (now - f.t_start) * len(lease.gpus)
        problem = self._check_reported(nw, applied, resident)
        st.requests += 1
        if not c.counted and info.get("restore_bytes"):  # a batch restores once
            c.counted = True
            st.restores += 1
            st.restore_s += float(info.get("restore_s", 0.0))
            st.restore_bytes += int(info.get("restore_bytes", 0))
            k = f.variant[1]
            nw.variant_bytes[f.variant] = [int(info["restore_bytes"]) // k] * k
        if not c.left:
            st.batches += 1
            st.compute_s += float(info.get("compute_s", 0.0))
        extra = {"node": nw.node, "gpus": list(lease.gpus), "service": f.variant[0],
                 "restored": bool(info.get("restored")),
                 "restore_s": float(info.get("restore_s", 0.0)),
                 "evicted": [list(v) for v in info.get("evicted", [])],
                 "evict_s": float(info.get("evict_s", 0.0)),
                 "restore_bytes": int(info.get("restore_bytes", 0)),
                 "compute_s": float(info.get("compute_s", 0.0)), "device": self.device,
                 "batch": int(info.get("batch", 1)), "batch_of": str(info.get("lead", aid))}
        if problem is not None:
            self._mismatch(nw, f"residency mismatch on {nw.node} after {aid}: {problem}")
            status, error = "failed", f"residency mismatch: {problem}"
        if status != "ok":
            st.failed += 1
            out = Outcome(aid, status, None, "", error, float(info.get("restore_s", 0.0)), extra)
        else:
            out = Outcome(aid, "ok", 0, json.dumps(output), "",
                          float(info.get("restore_s", 0.0)), extra)
        f.on_done(out)

    def _check_reported(self, nw: NodeWorker, applied: int, resident: list) -> str | None:
        """Check 2 and 3 of the module doc on a resident set the worker reported."""
        got = frozenset(tuple(v) for v in resident)
        want = nw.expected.get(applied)
        problem = None
        if want is not None and got != want:
            problem = f"the worker holds {sorted(got)}, it was told to hold {sorted(want)}"
        elif applied == nw.seq and not nw.inflight and nw.latest is not None and \
                got != nw.latest.resident:
            # quiet: nothing running, and the report was taken after every command sent
            # (a pre-restore sent after it is not in it yet)
            problem = (f"the worker holds {sorted(got)}, the core has "
                       f"{sorted(nw.latest.resident)}")
        low = min([x.seq for x in nw.inflight.values()] + [nw.seq])
        for s in [s for s in nw.expected if s < low]:
            del nw.expected[s]
        return problem

    def _on_prerestored(self, nw: NodeWorker, msg: tuple) -> None:
        _, variant, status, error, info, applied, resident = msg
        variant = tuple(variant)
        st = self.stats[variant[0]]
        for v in info.get("evicted", []):
            nw.variant_bytes.pop(tuple(v), None)
        if status == "ok":
            st.prerestores += 1
            st.restores += 1
            st.restore_s += float(info.get("restore_s", 0.0))
            st.restore_bytes += int(info.get("restore_bytes", 0))
            k = variant[1]
            nw.variant_bytes[variant] = [int(info.get("restore_bytes", 0)) // k] * k
        problem = self._check_reported(nw, applied, resident)
        if status != "ok":  # the worker does not hold what the core believes resident
            problem = f"the pre-restore of {variant} failed: {error}"
        if problem is not None:
            self._mismatch(nw, f"residency mismatch on {nw.node} after a pre-restore: "
                               f"{problem}")

    def _mismatch(self, nw: NodeWorker, message: str) -> None:
        """A residency mismatch is a bug: say so loudly and start the node afresh."""
        self.mismatches += 1
        log.error("%s; restarting the node's worker", message)
        self._reset(nw, f"the node's worker was restarted after: {message}")

    def _on_exit(self, nw: NodeWorker) -> None:
        if nw.dead:
            return
        try:
            code = nw.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        why = nw.fatal or f"exit code {code}"
        self.crashes += 1
        log.error("GPU worker of %s died (%s)", nw.node, why)
        self._reset(nw, f"the GPU worker of {nw.node} died ({why}) during this action; "
                        "the node's residency was reset and a fresh worker serves the next one")

    #: what a failed action's Outcome.extra says besides the node (ray_worker.py: node_lost)
    lost_extra: Mapping[str, Any] = {}

    def _lost(self, node: str) -> Command_:
        """What the core is told when ``node``'s worker is gone: it forgets the node's
        residency (a fresh worker serves the next action here)."""
        return WorkerLost(node)

    def _reset(self, nw: NodeWorker, error: str) -> None:
        """Drop the worker, make the core forget the node's residency, fail what it ran."""
        nw.dead = True
        if self.workers.get(nw.node) is nw:
            del self.workers[nw.node]
        nw.stop(timeout=1.0)
        if self._sink is not None:  # the core forgets the node's residency
            self._sink(self._lost(nw.node))
        failed = list(nw.inflight.items())
        nw.inflight.clear()
        for aid, f in failed:
            if f.timer is not None:
                f.timer.cancel()
            self.stats[f.variant[0]].failed += 1
            out = Outcome(aid, "failed", None, error=error,
                          extra={"node": nw.node, "worker_lost": True, **self.lost_extra})
            # reported from the loop, not from inside a start() that found the worker dead
            if self.loop is not None:
                self.loop.call_soon(f.on_done, out)
            else:  # pragma: no cover - nothing was started without a loop
                f.on_done(out)

    # -- inspection (tests, /v1/gpus, metrics) -------------------------------------------
    def _ask(self, node: str, *msg: Any) -> concurrent.futures.Future:
        nw = self.workers[node]
        req = next(self._req)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        nw.replies[req] = fut
        nw.send((msg[0], req, *msg[1:]))
        return fut

    async def worker_resident(self, node: str) -> frozenset[Variant]:
        """What the node's worker holds right now (asks the worker process)."""
        reply = await asyncio.wrap_future(self._ask(node, "resident"))
        return frozenset(tuple(v) for v in reply["resident"])

    async def verify(self, node: str, variant: Variant) -> dict[str, Any]:
        """Whether ``variant``'s device copy equals its host stage, byte for byte."""
        return await asyncio.wrap_future(self._ask(node, "verify", list(variant)))

    async def worker_counters(self, node: str) -> dict[str, int]:
        """Commands the node's worker ran (a batch is one), forward passes, restores and
        pre-restores (asks the worker process)."""
        return await asyncio.wrap_future(self._ask(node, "counters"))

    def probe(self, node: str, service: str, k: int, shapes: list[tuple[int, int]],
              repeats: int = 3, timeout: float = 300.0) -> dict[str, Any]:
        """Time a restore of ``service`` onto the node's GPUs 0..k-1 and forward passes of
        ``(members, tokens)`` shapes on a temporary copy (residency untouched). Only while
        the node runs nothing (before a run: ``executor.backends.gpu.measure``)."""
        reply = self._ask(node, "probe", service, k, [list(s) for s in shapes],
                          repeats).result(timeout)
        if "error" in reply:
            raise RuntimeError(f"GPU worker of {node}: probe of {service}: {reply['error']}")
        return reply

    def worker_pid(self, node: str) -> int | None:
        nw = self.workers.get(node)
        return nw.proc.pid if nw is not None and not nw.dead else None

    def computing(self, action_id: str) -> bool:
        """True once the action's restore is done and its request is being served."""
        return any(action_id in nw.inflight and nw.inflight[action_id].computing
                   for nw in self.workers.values())

    @property
    def gpu_count(self) -> int:
        """GPUs of all nodes."""
        return sum(n.gpus for n in self.nodes.values())

    def gpu_s_per_request(self) -> dict[str, float]:
        """Observed GPU-seconds per request of each service that has served one: its run
        commands' lease time (restores included) over its requests, so a batch's time is
        shared by its members and the figure is what a request costs the pool as served."""
        return {s: st.gpu_s / st.requests for s, st in self.stats.items() if st.requests}

    def snapshot(self) -> dict[str, Any]:
        """Per-node, per-GPU and per-service figures (``/v1/gpus``, ``/metrics``). The
        resident variants and their memory are the worker's mirror (which the checks keep
        equal to the core's: what the core accounts for each GPU is ``core_mem_gb``)."""
        wall = max(time.time() - self.started, 1e-9)
        nodes = {}
        resident_all: list[Variant] = []
        for name, spec in self.nodes.items():
            nw = self.workers.get(name)
            per_gpu = [0] * spec.gpus
            mem_gb = [0.0] * spec.gpus
            lru: list[Variant] = []
            busy_now: set[int] = set()
            if nw is not None and not nw.dead:
                for v, parts in nw.variant_bytes.items():
                    for i, b in enumerate(parts):
                        per_gpu[v[2] + i] += b
                lru = list(nw.lru)
                busy_now = {g for f in nw.inflight.values() for g in f.dispatch.lease.gpus}
            for svc, k, start in lru:
                for g in range(start, start + k):
                    mem_gb[g] += self.services[svc].size_gb / k
            resident_all += lru
            nodes[name] = {
                "worker_pid": self.worker_pid(name),
                "ready": bool(nw and nw.ready),
                "gpus": [{"gpu": g, "leased": g in busy_now,
                          "busy_fraction": self.gpu_busy_s.get((name, g), 0.0) / wall,
                          "weights_bytes": per_gpu[g],
                          "core_mem_gb": mem_gb[g]}
                         for g in range(spec.gpus)],
                "resident": [list(v) for v in lru],
            }
        services = {}
        for s, st in self.stats.items():
            services[s] = {"resident_variants": sum(1 for v in resident_all if v[0] == s),
                           "restores": st.restores, "prerestores": st.prerestores,
                           "restore_seconds": st.restore_s,
                           "restore_bytes": st.restore_bytes, "evictions": st.evictions,
                           "requests": st.requests, "failed": st.failed,
                           "batches": st.batches, "compute_seconds": st.compute_s,
                           "gpu_seconds": st.gpu_s}
        return {"device": self.device, "nodes": nodes, "services": services,
                "crashes": self.crashes, "mismatches": self.mismatches}


@dataclass(frozen=True, slots=True)
class GpuSetup:
    """What a live run needs to serve GPU actions: the device and each service's loader."""

    device: str
    sources: Mapping[str, ModelSource] = field(default_factory=dict)
    physical: Mapping[str, list[int]] = field(default_factory=dict)
