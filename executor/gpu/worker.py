"""The worker process of one GPU node: stage, restore, evict, serve.

It owns its node's GPUs (``cuda``) or stands in for them (``cpu``). At start it
stages every service once in host memory (pinned on cuda) and says ``ready``.
Then it executes what the backend sends, which is what the core's GpuManager
decided; it decides nothing itself:

* ``run``: evict the listed variants (drop their device copies) at once, in
  the order commands arrive, then, in a thread of its own (actions on disjoint
  chunks run concurrently), restore the action's variant if told to and serve
  the request on it. The reply carries the worker's resident set and the
  sequence number of the last command applied, which the backend compares with
  the core's model.
* ``resident`` / ``verify``: what is resident; whether a variant's device copy
  equals its host stage (and is a copy, not a view of it).
* ``cancel``: the action stops between layers and reports ``cancelled``.

Messages are tuples over a ``multiprocessing`` pipe (see ``backend.py``).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

from executor.gpu.arrays import make_ops
from executor.gpu.model import Cancelled, ModelError, ModelSource, Placed, StagedModel, load_model

Variant = tuple[str, int, int]  # (service, DoP, first GPU)


class Worker:
    def __init__(self, conn: Any, device: str, devices: list[int],
                 services: list[tuple[str, ModelSource]]) -> None:
        self.conn = conn
        self.devices = devices  # logical GPU index -> physical device index
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()  # resident + applied
        self.resident: dict[Variant, Placed | None] = {}  # None: being restored
        self.applied = 0
        self.cancelled: set[str] = set()
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
                             "services": {n: m.nbytes for n, m in self.models.items()}}))
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return  # the backend is gone
            kind = msg[0]
            if kind == "run":
                _, seq, aid, variant, gpus, evict, restore, payload = msg
                evicted = []
                t0 = time.perf_counter()
                with self.lock:
                    for v in evict:  # dropping the last reference frees the device copy
                        if self.resident.pop(tuple(v), "absent") != "absent":
                            evicted.append(tuple(v))
                    if restore:
                        self.resident[tuple(variant)] = None
                    self.applied = seq
                threading.Thread(target=self.run, daemon=True, name=f"action-{aid}",
                                 args=(aid, tuple(variant), list(gpus), restore, payload,
                                       evicted, time.perf_counter() - t0)).start()
            elif kind == "cancel":
                self.cancelled.add(msg[1])
            elif kind == "resident":
                applied, res = self.snapshot()
                self.send(("reply", msg[1], {"applied": applied, "resident": res}))
            elif kind == "verify":
                self.send(("reply", msg[1], self.verify(tuple(msg[2]))))
            elif kind == "stop":
                return

    def run(self, aid: str, variant: Variant, gpus: list[int], restore: bool, payload: Any,
            evicted: list[Variant], evict_s: float) -> None:
        service, k, _ = variant
        devs = [self.devices[g] for g in gpus]
        info: dict[str, Any] = {"restored": restore, "evicted": evicted, "restore_s": 0.0,
                                "evict_s": evict_s}
        status, output, error = "ok", None, ""
        try:
            model = self.models[service]
            if restore:
                t0 = time.perf_counter()
                placed = model.place(k, devs)
                info["restore_s"] = time.perf_counter() - t0
                info["restore_bytes"] = sum(placed.nbytes)
                with self.lock:
                    if variant in self.resident:  # not evicted meanwhile
                        self.resident[variant] = placed
            else:
                with self.lock:
                    placed = self.resident.get(variant)  # type: ignore[assignment]
                if placed is None:
                    raise AssertionError(f"residency mismatch: the core has {variant} "
                                         "resident, the worker holds no copy of it")
            self.send(("started", aid, info["restore_s"]))
            t1 = time.perf_counter()
            output = model.run(placed, devs, payload, lambda: aid in self.cancelled)
            info["compute_s"] = time.perf_counter() - t1
        except Cancelled:
            status, error = "cancelled", "cancelled while computing"
        except ModelError as e:
            status, error = "failed", str(e)
        except AssertionError as e:
            status, error = "failed", str(e)
        except Exception as e:  # a bug or an out-of-memory: fail this action, keep serving
            status = "failed"
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        self.cancelled.discard(aid)
        applied, res = self.snapshot()
        self.send(("done", aid, status, output, error, info, applied, res))

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
