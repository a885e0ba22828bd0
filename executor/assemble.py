"""The composition root of the live executor: ``tangram serve`` and ``tangram run`` parse
and check their options, then ask here for the pieces — the Ray backend, the GPU part of
the cluster, the server app with its core, env backend, quotas and GPU workers.

Every refusal is an :class:`AssemblyError` whose message names the option at fault; what
was started before it (a Ray connection, its agents) is stopped first, so a refused
assembly leaves nothing behind.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from executor.backends.docker.limits import SandboxLimits
from executor.backends.gpu.arrays import check_device
from executor.backends.gpu.backend import GpuBackend
from executor.backends.gpu.config import (
    GpuCluster,
    NvmlUnavailable,
    discover,
    read_gpu_cluster,
    scaled_cluster,
)
from executor.backends.gpu.model import ModelError
from executor.backends.gpu.ray_worker import attach_gpus, local_gpu_labels
from executor.backends.ray.backend import RayBackend
from executor.backends.ray.cluster import RaySpec, connect
from executor.backends.registry import make_backend
from executor.driver import LiveBackend, RunObserver
from executor.node.local import local_cluster
from executor.server.app import Phase, create_app, no_phase
from executor.server.limits import READ_TIMEOUT_S
from executor.server.tokens import Tokens
from tangram.cluster import ClusterError, ClusterSpec, QuotaSpec
from tangram.core import Tangram
from tangram.cpu.admission import LIVE, RESERVE, MemoryAdmission
from tangram.policies import Policy


class AssemblyError(ValueError):
    """The options cannot be put together on this machine (the message says which)."""


@dataclass(frozen=True)
class ServeOptions:
    """What `tangram serve` serves, checked and parsed (the CLI's options as values)."""

    backend: str  # process | docker: the env backend (on each Ray node with a Ray backend)
    state_dir: Path
    policy: Policy
    quotas: tuple[QuotaSpec, ...] = ()
    allow_urls: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    task_images: Mapping[str, str] = field(default_factory=dict)
    result_ttl_s: float = 60.0
    sandbox_mem_gb: float = 2.0
    sandbox_pids: int = 512
    warm_pool: int = 0
    gpu: GpuCluster | None = None
    gpu_device: str = "cuda"
    #: how this machine admits sandboxes by its observed memory (--mem-overcommit,
    #: --mem-headroom); a Ray cluster's nodes are not observed: they reserve in full
    admission: MemoryAdmission = LIVE
    sandbox_disk_gb: float = 4.0
    read_timeout_s: float = READ_TIMEOUT_S  # a request body's longest silence
    sandbox_uids: int = SandboxLimits.uids  # the process backend as root (--sandbox-uids)
    #: --record: the trace the run is recorded to (executor/record.py); None: not recorded
    record: Path | None = None
    record_commands: bool = False  # --record-commands: commands kept, not hashed
    image_pulls: int = SandboxLimits.image_pulls  # docker: pulls at once (--image-pulls)
    image_cache_gb: float | None = None  # docker: the pulled images' disk (--image-cache-gb)

    @property
    def sandboxes(self) -> SandboxLimits:
        return SandboxLimits(self.sandbox_mem_gb, self.sandbox_pids, self.sandbox_disk_gb,
                             self.warm_pool, self.sandbox_uids, self.image_pulls,
                             self.image_cache_gb)


def check_local_policy(quotas: tuple[QuotaSpec, ...], policy: Policy) -> None:
    """Refuse a policy that cannot hold this machine before anything is served."""
    try:
        Tangram(local_cluster(quotas), policy)
    except ValueError as e:
        raise AssemblyError(str(e)) from None


def ray_backend(spec: RaySpec, backend: str, gpu: GpuCluster | None = None,
                gpu_device: str = "cpu", sandboxes: SandboxLimits = SandboxLimits(),
                phase: Phase = no_phase) -> Any:
    """Connect to Ray and start one agent per node, its docker sandboxes bounded by
    ``sandboxes``; with ``gpu``, a GPU worker actor on every node that has GPUs too
    (executor/backends/gpu/ray_worker.py; ``local:N`` nodes declare the GPU cluster's first node's
    GPUs by label). ``phase``: told of each step (connecting, the agents, the GPU workers)."""
    labels = local_gpu_labels(gpu) if gpu is not None and spec.mode == "local" else None
    try:
        live = _ray_backend(spec, backend, labels, sandboxes, phase)
        if gpu is None:
            return live
    except (RuntimeError, ValueError) as e:
        raise AssemblyError(str(e)) from None
    try:
        with phase("starting the GPU workers on the Ray nodes (staging their services)"):
            return attach_gpus(live, gpu, gpu_device)
    except (RuntimeError, ValueError, TimeoutError) as e:
        live.shutdown()
        raise AssemblyError(str(e)) from None


def _ray_backend(spec: RaySpec, backend: str, labels: dict[str, str] | None,
                 sandboxes: SandboxLimits, phase: Phase = no_phase) -> RayBackend:
    try:
        with phase(f"starting a local Ray cluster of {spec.nodes} nodes" if spec.mode == "local"
                   else f"connecting to Ray at {spec.address}"):
            conn = connect(spec, labels)
    except ConnectionError as e:
        raise AssemblyError(str(e)) from None
    try:
        with phase(f"starting a {backend} agent on each Ray node"):
            return RayBackend(conn, backend, owns_connection=True, sandboxes=sandboxes)
    except (RuntimeError, ValueError) as e:
        conn.close()
        raise AssemblyError(str(e)) from None


def replay_gpu_cluster(device: str, path: Path | None, cluster: ClusterSpec | None,
                       scale: float) -> GpuCluster:
    """`run --gpu-device`: the GPU nodes and services of --gpu-cluster's YAML, or else
    ``cluster``'s scaled by ``scale`` as random-weight models."""
    try:
        check_device(device)
        if path is not None:
            return read_gpu_cluster(path, device)
        if cluster is None:
            raise AssemblyError("--gpu-device: give --gpu-cluster or a --cluster to scale")
        return scaled_cluster(cluster, scale)
    except (ClusterError, ModelError, ValueError) as e:
        raise AssemblyError(str(e)) from None


def serve_gpu_cluster(gpus: str | None, path: Path | None, device: str) -> GpuCluster | None:
    """The GPU part of `serve`: nodes from NVML (--gpus auto) or the YAML; services from it."""
    if gpus not in (None, "auto"):
        raise AssemblyError(f"--gpus: expected 'auto' (discover this machine's GPUs with "
                            f"NVML), got {gpus!r}")
    if gpus is None and path is None:
        return None
    discovered = physical = info = None
    if gpus == "auto":
        try:
            discovered, physical, info = discover()
        except NvmlUnavailable as e:
            raise AssemblyError(f"--gpus auto: {e}") from None
    if path is None:
        raise AssemblyError("--gpu-cluster: give the YAML that lists the services to serve "
                            "(name, model)")
    try:
        check_device(device)
        gc = read_gpu_cluster(path, device, discovered, physical)
    except (ClusterError, ModelError, ValueError) as e:
        raise AssemblyError(str(e)) from None
    if info is not None:
        gc = replace(gc, discovery=info)
    return gc


def serve_app(opts: ServeOptions, token: str | Tokens, ray: Any = None,
              phase: Phase = no_phase) -> FastAPI:
    """The server app: over the Ray cluster behind ``ray``, or over this machine (its
    cores, the env backend, GPU workers when ``opts.gpu``). ``phase``: told of each step
    of the server's start (its lifespan: the backend, the GPU workers, the journal)."""
    hardening = {"allow_urls": opts.allow_urls, "task_images": opts.task_images,
                 "result_ttl_s": opts.result_ttl_s, "read_timeout_s": opts.read_timeout_s,
                 "phase": phase}
    if ray is not None:
        return _ray_app(opts, token, ray, hardening)
    cluster = local_cluster(opts.quotas)
    gc = opts.gpu
    if gc is not None:
        cluster = replace(cluster, gpu_nodes=gc.spec.gpu_nodes, services=gc.spec.services,
                          restore_gbps=gc.spec.restore_gbps)

    def make_core() -> Tangram:
        return Tangram(cluster, opts.policy, admission=opts.admission)

    def make_live_backend() -> LiveBackend:
        gpu = None
        if gc is not None:
            with phase(f"starting the GPU workers ({len(gc.spec.services)} services to "
                       "stage)"):
                gpu = GpuBackend(cluster, gc.sources, opts.gpu_device, gc.physical)
                gpu.start_workers()  # stage every service now, not at the first action
        with phase(f"starting the {opts.backend} backend"
                   + (" (the docker image built first if missing)"
                      if opts.backend == "docker" else "")):
            return make_backend(opts.backend, opts.state_dir / "work", gpu=gpu,
                                sandboxes=opts.sandboxes)

    # this machine is the one CPU node: its free memory is observed (executor/node/memwatch.py)
    app = create_app(make_live_backend, make_core, token, opts.state_dir, **hardening,
                     memory_node=cluster.cpu_nodes[0].name,
                     observer=recorder(opts, cluster))
    if gc is not None:
        app.state.gpu_discovery = gc.discovery
    return app


def _ray_app(opts: ServeOptions, token: str | Tokens, live: Any, hardening: dict) -> FastAPI:
    try:  # the policy must hold the Ray nodes too
        Tangram(live.cluster(opts.quotas), opts.policy)
    except ValueError as e:
        live.shutdown()
        raise AssemblyError(str(e)) from None
    # ray.init installs a SIGTERM handler that exits with status 15; uvicorn re-raises
    # the signal after its graceful shutdown (which stops the agents): keep the default
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return create_app(lambda: live, lambda: Tangram(live.cluster(opts.quotas), opts.policy),
                      token, opts.state_dir, **hardening,
                      # (a Ray node's memory is not observed: every limit reserved in full)
                      observer=recorder(replace(opts, admission=RESERVE),
                                        live.cluster(opts.quotas)))


def recorder(opts: ServeOptions, cluster: ClusterSpec) -> Callable[[Tangram], RunObserver] | None:
    """``--record``: a recorder of the served run for its core (None: not recorded). On the
    process backend a trajectory's environment is a directory: nothing to start, which the
    recorded cluster says (the simulator otherwise models a container's start)."""
    if opts.record is None:
        return None
    from executor.record import Recorder  # (pandas, through the trace schema: only to record)

    path, keep = opts.record, opts.record_commands
    if opts.backend == "process":
        cluster = replace(cluster, extra={**cluster.extra, "env_start_s": 0.0})
    if opts.admission.overcommit > 1:
        # admitted by observed memory, up to overcommit x the node's in declared limits:
        # what a simulation (which reserves every limit in full) admits on a node of that
        # much memory; the factor is kept in extra, for whoever reads the file
        over = opts.admission.overcommit
        cluster = replace(cluster, cpu_nodes=tuple(replace(n, mem_gb=n.mem_gb * over)
                                                   for n in cluster.cpu_nodes),
                          extra={**cluster.extra, "recorded_mem_overcommit": over})
    meta = {"by": "tangram serve", "backend": opts.backend, "policy": opts.policy.label}
    return lambda core: Recorder(path, cluster, core.learnt_speedup, keep, meta)
