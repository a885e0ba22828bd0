"""The worker process of one GPU node: stage, restore, evict, serve.

It owns its node's GPUs (``cuda``) or stands in for them (``cpu``). At start it
stages every service once in host memory (pinned on cuda) and says ``ready``.
Then it executes what the backend sends, which is what the core's GpuManager
decided; it decides nothing itself:

* ``run``: evict the listed variants (drop their device copies) at once, in
  the order commands arrive, then, in a thread of its own (actions on disjoint
  chunks run concurrently), restore the variant if told to and serve the
  members on it: one member alone, or a batch (the core's continuous batching)
  as ONE forward pass whose members each get their own ``done`` (a bad member
  fails alone, a cancelled one leaves the pass between two layers). Every reply
  carries the worker's resident set and the sequence number of the last command
  applied, which the backend compares with the core's model.
* ``prerestore``: the same evictions, then load a variant ahead of demand (in a
  thread); it is resident from the command on, and a ``run`` that lands on it
  while it loads waits for the load (and reports the wait as its restore).
* ``resident`` / ``verify`` / ``counters``: what is resident; whether a variant's
  device copy equals its host stage (and is a copy, not a view of it); how many
  commands, forward passes, restores and pre-restores the worker has done.
* ``probe``: time a restore and forward passes of given shapes on a temporary copy
  (residency untouched; only while the node runs nothing): the live run's measured
  costs, which the simulator reads back (``executor/backends/gpu/measure.py``).
* ``cancel``: the member stops between layers and reports ``cancelled``.

Messages are tuples over a ``multiprocessing`` pipe (see ``backend.py``).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import traceback
from typing import Any

from executor.backends.gpu.arrays import make_ops
from executor.backends.gpu.model import (
    Batch,
    ModelError,
    ModelSource,
    Placed,
    Request,
    StagedModel,
    load_model,
)

Variant = tuple[str, int, int]  # (service, DoP, first GPU)


class Worker:
    def __init__(self, conn: Any, device: str, devices: list[int],
                 services: list[tuple[str, ModelSource]]) -> None:
        self.conn = conn
        self.devices = devices  # logical GPU index -> physical device index
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()  # resident + loading + applied + counters
        self.resident: dict[Variant, Placed | None] = {}  # None: being restored
        #: variants being loaded -> set when the load ends (a run waits for it)
        self.loading: dict[Variant, threading.Event] = {}
        self.applied = 0
        self.cancelled: set[str] = set()
        #: run commands received (a batch is one), restores and pre-restores done
        self.runs = 0
        self.restores = 0
        self.prerestores = 0
        self.probe_forwards = 0  # forward passes of probes (not the services' traffic)
        t0 = time.perf_counter()
        self.ops = make_ops(device)
        self.models: dict[str, StagedModel] = {name: load_model(src, self.ops)
                                               for name, src in services}
        self.stage_s = time.perf_counter() - t0

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def snapshot(self) -> tuple[int, list[Variant]]:
        with self.lock:
            return self.applied, sorted(self.resident)

    def loop(self) -> None:
        self.send(("ready", {"pid": os.getpid(), "ops": self.ops.name, "device": self.ops.device,
                             "stage_s": self.stage_s,
                             "services": {n: m.nbytes for n, m in self.models.items()},
                             "dtypes": {n: m.ops.dtype_name for n, m in self.models.items()}}))
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return  # the backend is gone
            kind = msg[0]
            if kind == "run":
                _, seq, variant, gpus, evict, restore, members = msg
                variant = tuple(variant)
                t0 = time.perf_counter()
                evicted = self.apply(seq, evict, variant if restore else None)
                with self.lock:
                    self.runs += 1
                threading.Thread(target=self.run, daemon=True, name=f"action-{members[0][0]}",
                                 args=(variant, list(gpus), restore, members, evicted,
                                       time.perf_counter() - t0)).start()
            elif kind == "prerestore":
                _, seq, variant, gpus, evict = msg
                variant = tuple(variant)
                t0 = time.perf_counter()
                evicted = self.apply(seq, evict, variant)
                threading.Thread(target=self.prerestore, daemon=True,
                                 name=f"prerestore-{variant}",
                                 args=(variant, list(gpus), evicted,
                                       time.perf_counter() - t0)).start()
            elif kind == "cancel":
                self.cancelled.add(msg[1])
            elif kind == "resident":
                applied, res = self.snapshot()
                self.send(("reply", msg[1], {"applied": applied, "resident": res}))
            elif kind == "verify":
                self.send(("reply", msg[1], self.verify(tuple(msg[2]))))
            elif kind == "counters":
                self.send(("reply", msg[1], self.counters()))
            elif kind == "probe":
                threading.Thread(target=self.probe, daemon=True, name="probe",
                                 args=msg[1:]).start()
            elif kind == "stop":
                return

    # -- residency -----------------------------------------------------------------------
    def apply(self, seq: int, evict: list, load: Variant | None) -> list[Variant]:
        """A command's residency change, at once and in command order: drop the evicted
        variants' device copies; ``load`` is resident from now on (its copy follows)."""
        evicted = []
        with self.lock:
            for v in evict:  # dropping the last reference frees the device copy
                if self.resident.pop(tuple(v), "absent") != "absent":
                    evicted.append(tuple(v))
            if load is not None:
                self.resident[load] = None
                self.loading[load] = threading.Event()
            self.applied = seq
        return evicted

    def load(self, variant: Variant, gpus: list[int]) -> tuple[Placed, float]:
        """Make the device copy of a variant ``apply`` marked resident; its seconds."""
        service, k, _ = variant
        t0 = time.perf_counter()
        try:
            placed = self.models[service].place(k, [self.devices[g] for g in gpus])
        except BaseException:
            with self.lock:
                if self.resident.get(variant, "absent") is None:
                    del self.resident[variant]  # not held: the next check says so
                ev = self.loading.pop(variant, None)
            if ev is not None:
                ev.set()
            raise
        seconds = time.perf_counter() - t0
        with self.lock:
            if variant in self.resident:  # not evicted meanwhile
                self.resident[variant] = placed
            ev = self.loading.pop(variant, None)
            self.restores += 1
        if ev is not None:
            ev.set()
        return placed, seconds

    def held(self, variant: Variant) -> tuple[Placed | None, float]:
        """A resident variant's copy, after waiting for its load if it is still being
        pre-restored; and the seconds waited."""
        with self.lock:
            placed = self.resident.get(variant)
            ev = self.loading.get(variant) if placed is None else None
        if ev is None:
            return placed, 0.0
        t0 = time.perf_counter()
        ev.wait()
        with self.lock:
            return self.resident.get(variant), time.perf_counter() - t0

    # -- commands --------------------------------------------------------------------------
    def run(self, variant: Variant, gpus: list[int], restore: bool,
            members: list[tuple[str, Any]], evicted: list[Variant], evict_s: float) -> None:
        service, k, _ = variant
        devs = [self.devices[g] for g in gpus]
        info: dict[str, Any] = {"restored": restore, "evicted": evicted, "restore_s": 0.0,
                                "evict_s": evict_s, "batch": len(members),
                                "lead": members[0][0]}
        t1: list[float] = []

        def report(r: Request) -> None:
            self.cancelled.discard(r.id)
            applied, res = self.snapshot()
            compute = time.perf_counter() - t1[0] if t1 else 0.0
            self.send(("done", r.id, r.status, r.output, r.error,
                       {**info, "compute_s": compute}, applied, res))

        batch = Batch([Request(aid, payload) for aid, payload in members],
                      lambda aid: aid in self.cancelled, report)
        try:
            model = self.models[service]
            if restore:
                placed, info["restore_s"] = self.load(variant, gpus)
                info["restore_bytes"] = sum(placed.nbytes)
            else:
                got, waited = self.held(variant)
                if got is None:
                    raise AssertionError(f"residency mismatch: the core has {variant} "
                                         "resident, the worker holds no copy of it")
                placed = got
                if waited > 0:  # landed on a pre-restore still loading: paid what was left
                    info["restore_s"] = waited
                    info["prerestore_wait"] = True
            self.send(("started", [m[0] for m in members], info["restore_s"]))
            t1.append(time.perf_counter())
            model.run_batch(placed, devs, batch)
        except (ModelError, AssertionError) as e:
            for r in batch.live:
                batch.end(r, "failed", error=str(e))
        except Exception as e:  # a bug or an out-of-memory: fail this batch, keep serving
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
            for r in batch.live:
                batch.end(r, "failed", error=error)

    def prerestore(self, variant: Variant, gpus: list[int], evicted: list[Variant],
                   evict_s: float) -> None:
        info: dict[str, Any] = {"evicted": evicted, "evict_s": evict_s}
        status, error = "ok", ""
        try:
            placed, info["restore_s"] = self.load(variant, gpus)
            info["restore_bytes"] = sum(placed.nbytes)
        except Exception as e:  # out of memory: the variant is not held; say so
            status, error = "failed", f"{type(e).__name__}: {e}"
        with self.lock:
            self.prerestores += 1
        applied, res = self.snapshot()
        self.send(("prerestored", list(variant), status, error, info, applied, res))

    def probe(self, req: int, service: str, k: int, shapes: list[tuple[int, int]],
              repeats: int) -> None:
        """Seconds of a restore of ``service`` onto GPUs 0..k-1 and of forward passes of
        ``(members, tokens)`` shapes (medians of ``repeats``), on a temporary copy."""
        try:
            model = self.models[service]
            devs = self.devices[:k]
            times = []
            for _ in range(max(repeats, 1)):  # the first may pay page faults the rest do not
                placed = None  # the previous copy goes first: one copy at a time
                t0 = time.perf_counter()
                placed = model.place(k, devs)
                times.append(time.perf_counter() - t0)
            restore_s = statistics.median(times)
            forwards = []
            vocab = model.vocab
            for members, tokens in shapes:
                times = []
                for rep in range(repeats):
                    reqs = [Request(f"p{i}", {"op": "logprobs", "tokens": [[
                        (7 * i + 3 * j + rep) % vocab for j in range(max(tokens, 2))]]})
                        for i in range(members)]
                    t1 = time.perf_counter()
                    model.run_batch(placed, devs, Batch(reqs, lambda _id: False))
                    with self.lock:
                        self.probe_forwards += 1
                    times.append(time.perf_counter() - t1)
                    if any(r.status != "ok" for r in reqs):
                        raise ModelError(f"probe: {reqs[0].error}")
                forwards.append([members, tokens, statistics.median(times)])
            del placed
            reply: dict[str, Any] = {"restore_s": restore_s, "bytes": model.nbytes,
                                     "forwards": forwards}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        self.send(("reply", req, reply))

    def counters(self) -> dict[str, int]:
        with self.lock:
            return {"runs": self.runs, "restores": self.restores,
                    "prerestores": self.prerestores,
                    "forwards": sum(m.forwards for m in self.models.values())
                    - self.probe_forwards}

    def verify(self, variant: Variant) -> dict[str, Any]:
        with self.lock:
            placed = self.resident.get(variant)
        if placed is None:
            return {"resident": False}
        model = self.models[variant[0]]
        equal, shared = True, False
        for buf, (lo, hi) in zip(placed.buffers, placed.ranges, strict=True):
            host = model.host[lo:hi]
            equal = equal and self.ops.same(buf, host)
            shared = shared or (hi > lo and self.ops.shares(buf, host))
        return {"resident": True, "equal": equal, "shares_host_memory": shared,
                "bytes": sum(placed.nbytes), "bytes_per_gpu": list(placed.nbytes),
                "host_bytes": model.nbytes}


def worker_main(conn: Any) -> None:
    """Entry point of the worker process: the first message says what to serve."""
    device, devices, services = conn.recv()
    if device == "cuda":
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # the same order as NVML
    try:
        worker = Worker(conn, device, devices, services)
    except (ModelError, RuntimeError, OSError, MemoryError) as e:
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    worker.loop()


if __name__ == "__main__":
    import sys
    from multiprocessing.connection import Connection

    worker_main(Connection(int(sys.argv[1])))
