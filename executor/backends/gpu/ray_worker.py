"""GPU workers on Ray nodes: one scheduler (the core in this process) for every GPU node
of a Ray cluster.

Each Ray node that has GPUs runs one :class:`GpuNodeActor`, pinned to it
(``NodeAffinitySchedulingStrategy``, not soft). The actor starts that node's GPU worker
process (executor/backends/gpu/worker.py, the same one a local run starts) and relays: commands in
(``send``, applied in the order the driver numbered them: Ray does not order the calls of
a threaded actor) and the worker's messages out (``recv``, long-polled by the driver's
reader thread). Everything else is :class:`~executor.backends.gpu.backend.GpuBackend`'s: the
residency plans carried out, the mirror and its three checks, batches as one command,
pre-restores, timeouts and cancellation.

A GPU node is found by its Ray resources (``GPU``, NVML's count on that node, with the
memory read by NVML there) or by the node labels ``tangram-gpus`` and
``tangram-gpu-mem-gb`` (a node declares GPU capacity; with ``--gpu-device cpu`` the
labels stand in for GPUs in tests: ``--ray local:N`` labels its nodes so).

Node loss: when a node's actor dies (the node left, or the actor was killed) every action
it ran ends ``failed`` with ``extra.reason == "node_lost"``, the core is told
``NodeLost`` (the node's GPUs leave the pool and its residency is forgotten), and a fresh
actor is started on the node if Ray still lists it alive; once that worker has staged its
services the core is told ``NodeJoined`` and the GPUs come back, nothing resident.
"""

from __future__ import annotations

import collections
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from executor.backends.gpu.backend import GpuBackend, NodeWorker
from executor.backends.gpu.config import GpuCluster
from executor.backends.gpu.model import ModelSource
from executor.backends.router import route
from tangram.cluster import ClusterSpec, GpuNodeSpec
from tangram.model import Dispatch, Outcome
from tangram.protocol import Command, NodeJoined, NodeLost, PreRestore, PullImage, Sink

log = logging.getLogger("tangram.gpu.ray")

GPUS_LABEL = "tangram-gpus"
GPU_MEM_LABEL = "tangram-gpu-mem-gb"
NODE_LOST = "node_lost"
#: the chunk sizes a GPU node may have (the core's aligned chunks)
GPU_COUNTS = (1, 2, 4, 8)


class GpuNodeActor:
    """The Ray actor of one GPU node (plain Python here; ``ray.remote`` wraps it)."""

    def __init__(self, node: str, gpus: int, device: str, devices: list[int],
                 services: list[tuple[str, ModelSource]]) -> None:
        self.worker = NodeWorker(node, gpus, device, devices, services)
        self._next = 0
        self._held: dict[int, tuple] = {}
        self._lock = threading.Lock()

    def pid(self) -> int:
        return self.worker.proc.pid

    def send(self, n: int, msg: tuple) -> None:
        """The driver's ``n``-th command: applied once every earlier one was."""
        with self._lock:
            self._held[n] = msg
            while self._next in self._held:
                try:
                    self.worker.send(self._held.pop(self._next))
                except (OSError, ValueError):
                    pass  # the worker is gone: recv reports its exit
                self._next += 1

    def recv(self, wait_s: float) -> list[tuple]:
        """The worker's messages (waiting at most ``wait_s`` for the first); the last is
        ``("exit", code)`` once the worker process is gone."""
        conn, out = self.worker.conn, []
        try:
            if not conn.poll(wait_s):
                return out
            while len(out) < 512:
                out.append(conn.recv())
                if not conn.poll(0):
                    break
        except (EOFError, OSError):
            try:
                code = self.worker.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                code = None
            out.append(("exit", code))
        return out

    def stop(self) -> None:
        self.worker.stop(timeout=5.0)


class _RemoteProc:
    """The worker process as seen from the driver (what NodeWorker asks of a Popen)."""

    def __init__(self, ray: Any, handle: Any, pid: int) -> None:
        self.ray, self.handle, self.pid = ray, handle, pid
        self.code: int | None = None
        self.gone = threading.Event()

    def poll(self) -> int | None:
        return self.code if self.gone.is_set() else None

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.gone.wait(timeout):
            raise subprocess.TimeoutExpired("gpu worker actor", timeout or 0)
        return self.code

    def kill(self) -> None:
        try:
            self.ray.kill(self.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        self.gone.set()


class _RemoteConn:
    """The worker's pipe over the actor: ``recv`` long-polls it (the backend's reader
    thread), ``send`` numbers the commands so the actor applies them in order."""

    def __init__(self, ray: Any, handle: Any, proc: _RemoteProc) -> None:
        self.ray, self.handle, self.proc = ray, handle, proc
        self._buf: collections.deque[tuple] = collections.deque()
        self._n = 0
        self.lost: str | None = None  # why the actor is gone (it died, not the worker)

    def send(self, msg: tuple) -> None:  # under NodeWorker.send_lock
        if self.proc.gone.is_set():
            raise OSError("the GPU worker actor is gone")
        self.handle.send.remote(self._n, msg)
        self._n += 1

    def recv(self) -> tuple:
        while not self._buf:
            if self.proc.gone.is_set():
                raise EOFError
            try:
                got = self.ray.get(self.handle.recv.remote(1.0))
            except Exception as e:  # noqa: BLE001 - RayActorError: the actor (node) died
                self.lost = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.proc.gone.set()
                raise EOFError from None
            self._buf.extend(got)
        msg = self._buf.popleft()
        if msg[0] == "exit":
            self.proc.code = msg[1]
            self.proc.gone.set()
            raise EOFError
        return msg

    def close(self) -> None:
        return None


class RayNodeWorker(NodeWorker):
    """A :class:`NodeWorker` whose process runs in a :class:`GpuNodeActor` on its node."""

    def __init__(self, node: str, gpus: int, device: str, devices: list[int],
                 services: list[tuple[str, ModelSource]], ray: Any, remote: Any,
                 ray_node_id: str, num_gpus: int) -> None:
        self._ray, self._remote = ray, remote
        self._ray_node_id, self._num_gpus = ray_node_id, num_gpus
        super().__init__(node, gpus, device, devices, services)

    def _spawn(self, device: str, devices: list[int],
               services: list[tuple[str, ModelSource]]) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # num_gpus: the node's GPUs (Ray sets CUDA_VISIBLE_DEVICES for them; 0 for GPUs a
        # label declares); a few threads: recv's long poll must not block send
        handle = self._remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(self._ray_node_id, soft=False),
            num_cpus=0, num_gpus=self._num_gpus, max_restarts=0, max_task_retries=0,
            max_concurrency=4,
        ).remote(self.node, len(devices), device, devices, services)
        pid = self._ray.get(handle.pid.remote(), timeout=120)
        self.proc = _RemoteProc(self._ray, handle, pid)  # type: ignore[assignment]
        self.conn = _RemoteConn(self._ray, handle, self.proc)  # type: ignore[assignment]

    def stop(self, timeout: float = 5.0) -> None:
        proc: _RemoteProc = self.proc  # type: ignore[assignment]
        if not proc.gone.is_set():
            try:
                self._ray.get(proc.handle.stop.remote(), timeout=timeout)
            except Exception:  # noqa: BLE001 - the actor is gone already
                pass
        proc.kill()


@dataclass(frozen=True, slots=True)
class RayGpuNode:
    """A GPU node of the Ray cluster: the core's spec and where its actor runs."""

    spec: GpuNodeSpec
    ray_node_id: str
    #: Ray GPU resources the actor takes (0 where labels declare the GPUs)
    num_gpus: int


def gpu_nodes(ray: Any, name_of: Callable[[dict], str],
              default_mem_gb: float) -> list[RayGpuNode]:
    """The alive Ray nodes with GPUs: a ``tangram-gpus`` label (and
    ``tangram-gpu-mem-gb``), else the node's ``GPU`` resource (memory read by NVML on the
    node). ValueError (the label, the node, the value) for a malformed label."""
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        labels = n.get("Labels") or {}
        nid = n["NodeID"]
        if GPUS_LABEL in labels:
            text = labels[GPUS_LABEL]
            if not text.isdigit() or int(text) not in GPU_COUNTS:
                raise ValueError(f"node label {GPUS_LABEL} of Ray node {nid[:8]}: expected one "
                                 f"of {GPU_COUNTS}, got {text!r}")
            gpus, num_gpus = int(text), 0
        else:
            gpus = int((n.get("Resources") or {}).get("GPU", 0))
            if not gpus:
                continue
            if gpus not in GPU_COUNTS:
                log.warning("Ray node %s: %d GPUs is not a chunk size %s; not used",
                            nid[:8], gpus, GPU_COUNTS)
                continue
            num_gpus = gpus
        mem = default_mem_gb
        if GPU_MEM_LABEL in labels:
            try:
                mem = float(labels[GPU_MEM_LABEL])
            except ValueError:
                mem = -1.0
            if not mem > 0:
                raise ValueError(f"node label {GPU_MEM_LABEL} of Ray node {nid[:8]}: expected "
                                 f"GB > 0, got {labels[GPU_MEM_LABEL]!r}")
        elif num_gpus:
            mem = ray.get(ray.remote(_nvml_mem_gb).options(
                scheduling_strategy=_on(nid), num_cpus=0, num_gpus=num_gpus).remote())
        out.append(RayGpuNode(GpuNodeSpec(name_of(n), gpus, mem), nid, num_gpus))
    return sorted(out, key=lambda g: g.spec.name)


def _on(nid: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(nid, soft=False)


def _nvml_mem_gb() -> float:
    from executor.backends.ray.agent import gpu_memory_gb

    return gpu_memory_gb()


class RayGpuBackend(GpuBackend):
    """The GPU backend over Ray: each GPU node's worker runs in its actor on that node."""

    lost_extra: Mapping[str, Any] = {"reason": NODE_LOST}

    def __init__(self, ray: Any, nodes: list[RayGpuNode], cluster: ClusterSpec,
                 sources: Mapping[str, ModelSource], device: str = "cpu",
                 alive: Callable[[str], bool] | None = None) -> None:
        super().__init__(cluster, sources, device)
        self.ray = ray
        self.ray_nodes = {n.spec.name: n for n in nodes}
        self._remote = ray.remote(GpuNodeActor)
        self._alive = alive or (lambda nid: True)
        self._closed = False
        #: nodes lost and not back yet
        self.down: set[str] = set()

    def _new_worker(self, node: str, gpus: int, devices: list[int]) -> NodeWorker:
        rn = self.ray_nodes[node]
        return RayNodeWorker(node, gpus, self.device, devices, sorted(self.sources.items()),
                             self.ray, self._remote, rn.ray_node_id, rn.num_gpus)

    def worker_actor(self, node: str) -> Any:
        """The node's actor handle (tests kill it)."""
        return self.workers[node].proc.handle  # type: ignore[attr-defined]

    def _lost(self, node: str) -> Command:
        return NodeLost(node)

    def _on_exit(self, nw: NodeWorker) -> None:
        if nw.dead:
            return
        conn: _RemoteConn = nw.conn  # type: ignore[assignment]
        why = nw.fatal or conn.lost or f"its worker process exited ({nw.proc.poll()})"
        self.crashes += 1
        log.error("GPU node %s lost: %s", nw.node, why)
        self._reset(nw, f"{NODE_LOST}: the GPU worker of node {nw.node} on Ray was lost during "
                        f"this action ({why}); not retried")

    def _reset(self, nw: NodeWorker, error: str) -> None:
        # the core was told NodeLost (the node's GPUs are out): they come back with a
        # fresh actor (after a loss, and after a residency mismatch alike)
        super()._reset(nw, error)
        self.down.add(nw.node)
        if not self._closed:
            threading.Thread(target=self._rejoin, args=(nw.node,), daemon=True,
                             name=f"gpu-rejoin-{nw.node}").start()

    def _rejoin(self, node: str, timeout: float = 600.0) -> None:
        """A fresh actor on the node, if Ray still lists it alive; once it has staged its
        services the core gets the node's GPUs back (NodeJoined)."""
        rn = self.ray_nodes[node]
        if not self._alive(rn.ray_node_id):
            log.warning("GPU node %s left the Ray cluster; its GPUs stay out", node)
            return
        spec = self.nodes[node]
        try:  # started here (it blocks on Ray), registered on the loop (_adopt)
            nw = self._new_worker(node, spec.gpus, list(range(spec.gpus)))
        except Exception as e:  # noqa: BLE001 - the node may be going away too
            log.error("GPU node %s: no fresh worker: %s", node, e)
            return
        threading.Thread(target=self._read, args=(nw,), daemon=True,
                         name=f"gpu-reader-{node}").start()
        self._post(self._adopt, nw)
        deadline = time.monotonic() + timeout
        while not nw.ready_event.wait(0.5):
            if self._closed or time.monotonic() > deadline:
                return
        if nw.fatal or nw.dead or self._closed:
            return
        self._post(self._joined, node)

    def _adopt(self, nw: NodeWorker) -> None:
        if self._closed:
            nw.dead = True
            nw.stop(timeout=1.0)
            return
        self.workers[nw.node] = nw

    def _joined(self, node: str) -> None:
        self.down.discard(node)
        if self._sink is not None:
            self._sink(NodeJoined(self.ray_nodes[node].spec))

    def shutdown(self) -> None:
        self._closed = True
        super().shutdown()


class RayWithGpus:
    """The Ray backend's CPU nodes and API calls with the GPU nodes' workers: one live
    backend for the one core (GPU dispatches go to :class:`RayGpuBackend`)."""

    name = "ray"

    def __init__(self, ray_backend: Any, gpu: RayGpuBackend) -> None:
        self.ray_backend = ray_backend
        self.gpu = gpu
        self.traits = gpu.traits

    def cluster(self, quotas: tuple = ()) -> ClusterSpec:
        """The Ray nodes' cores with the GPU nodes and services."""
        base = self.ray_backend.cluster(quotas)
        return replace(base, gpu_nodes=tuple(n.spec for n in self.gpu.ray_nodes.values()),
                       services=tuple(self.gpu.services.values()))

    def watch(self, sink: Sink) -> None:
        self.ray_backend.watch(sink)
        self.gpu.watch(sink)

    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        if route(d, has_gpu=True) == "gpu":
            self.gpu.start(d, on_done)
        else:
            self.ray_backend.start(d, on_done)

    def prerestore(self, effect: PreRestore) -> None:
        self.gpu.prerestore(effect)

    def cancel(self, action_id: str) -> None:
        if any(action_id in nw.inflight for nw in self.gpu.workers.values()):
            self.gpu.cancel(action_id)
        else:
            self.ray_backend.cancel(action_id)

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None:
        self.ray_backend.open_trajectory(trajectory, mem_gb)

    def close_trajectory(self, trajectory: str) -> None:
        self.ray_backend.close_trajectory(trajectory)

    # -- images: the CPU nodes' sandboxes (executor/backends/ray/backend.py) -------------
    def runs_images(self) -> bool:
        return bool(self.ray_backend.runs_images())

    def open_trajectory_image(self, trajectory: str, mem_gb: float | None,
                              image: str) -> float | None:
        return self.ray_backend.open_trajectory_image(trajectory, mem_gb, image)

    async def open_image_on(self, trajectory: str, mem_gb: float | None, image: str,
                            node: str) -> Any:
        return await self.ray_backend.open_image_on(trajectory, mem_gb, image, node)

    def image_status(self) -> dict[str, Any]:
        return dict(self.ray_backend.image_status())

    def pull(self, effect: PullImage) -> None:
        self.ray_backend.pull(effect)

    def shutdown(self) -> None:
        self.gpu.shutdown()
        self.ray_backend.shutdown()


def attach_gpus(ray_backend: Any, gpu: GpuCluster, device: str) -> RayWithGpus:
    """The GPU nodes of the Ray cluster behind ``ray_backend`` (labels or GPU resources)
    serving ``gpu``'s services; their workers start (and stage) now. ValueError (the
    label, the node, the value) for a malformed label or a cluster without GPU nodes."""
    from executor.backends.ray.backend import node_name

    ray = ray_backend.ray
    default_mem = max((n.gpu_mem_gb for n in gpu.spec.gpu_nodes), default=80.0)
    nodes = gpu_nodes(ray, lambda n: node_name(n.get("NodeManagerHostname") or "node",
                                               n["NodeID"]), default_mem)
    if not nodes:
        raise ValueError(f"--gpu-device: no node of the Ray cluster has GPUs (a GPU resource, "
                         f"or the node label {GPUS_LABEL})")
    cluster = ClusterSpec(gpu_nodes=tuple(n.spec for n in nodes), services=gpu.spec.services,
                          restore_gbps=gpu.spec.restore_gbps)

    def alive(nid: str) -> bool:
        try:
            return any(n["NodeID"] == nid and n.get("Alive") for n in ray.nodes())
        except Exception:  # noqa: BLE001 - the GCS briefly unreachable: try the node
            return True

    backend = RayGpuBackend(ray, nodes, cluster, gpu.sources, device, alive)
    backend.start_workers()
    return RayWithGpus(ray_backend, backend)


def local_gpu_labels(gpu: GpuCluster) -> dict[str, str]:
    """``--ray local:N --gpu-device cpu``: the labels each local node declares, shaped
    like the GPU cluster's first GPU node (the cpu device stands in for its GPUs)."""
    if not gpu.spec.gpu_nodes:
        return {}
    first = gpu.spec.gpu_nodes[0]
    return {GPUS_LABEL: str(first.gpus), GPU_MEM_LABEL: repr(first.gpu_mem_gb)}
