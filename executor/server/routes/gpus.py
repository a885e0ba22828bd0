"""HTTP surface of the GPU workers: ``GET /v1/gpus`` (JSON) and the GPU lines of ``/metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from executor.backends.gpu.backend import GpuBackend
from executor.backends.gpu.config import NvmlUnavailable, readings
from tangram.protocol import traits_of


def gpu_backend(backend: Any) -> GpuBackend | None:
    """The GPU backend behind the server's backend (a RouterBackend), if any."""
    if not traits_of(backend).gpu:
        return None
    return backend if isinstance(backend, GpuBackend) else backend.gpu  # a RouterBackend


def telemetry(gpu: GpuBackend) -> dict[str, Any]:
    """The backend's figures plus NVML readings of each node's physical GPUs (cuda)."""
    snap = gpu.snapshot()
    if gpu.device == "cuda":
        for node, phys in gpu.physical.items():
            try:
                snap["nodes"][node]["nvml"] = readings(list(phys))
            except NvmlUnavailable as e:
                snap["nodes"][node]["nvml_error"] = str(e)
    return snap


def metric_lines(backend: Any) -> list[str]:
    """Prometheus lines: per GPU (leased, busy fraction, weights held, NVML utilisation
    and memory on cuda) and per service (resident variants, restores, restore seconds
    and bytes, evictions, requests)."""
    gpu = gpu_backend(backend)
    if gpu is None:
        return []
    snap = telemetry(gpu)
    lines = ["# HELP tangram_gpu_leased Whether an action holds the GPU.",
             "# TYPE tangram_gpu_leased gauge"]
    per_gpu: list[tuple[str, str, float]] = []
    for node, n in snap["nodes"].items():
        for g in n["gpus"]:
            labels = f'node="{node}",gpu="{g["gpu"]}"'
            per_gpu += [("leased", labels, float(g["leased"])),
                        ("busy_fraction", labels, g["busy_fraction"]),
                        ("weights_bytes", labels, float(g["weights_bytes"]))]
        for r in n.get("nvml", []):
            labels = f'node="{node}",device="{r["index"]}"'
            per_gpu += [("utilisation_percent", labels, r["util_gpu_pct"]),
                        ("memory_used_bytes", labels, r["mem_used_gb"] * 1e9),
                        ("memory_total_bytes", labels, r["mem_total_gb"] * 1e9)]
    helps = {"leased": "Whether an action holds the GPU.",
             "busy_fraction": "Fraction of wall time the GPU was leased to an action.",
             "weights_bytes": "Bytes of service weights resident on the GPU.",
             "utilisation_percent": "NVML GPU utilisation.",
             "memory_used_bytes": "NVML memory used.", "memory_total_bytes": "NVML memory."}
    lines = []
    for metric, text in helps.items():
        rows = [(lab, v) for m, lab, v in per_gpu if m == metric]
        if not rows:
            continue
        lines += [f"# HELP tangram_gpu_{metric} {text}", f"# TYPE tangram_gpu_{metric} gauge"]
        lines += [f"tangram_gpu_{metric}{{{lab}}} {v:.6g}" for lab, v in rows]
    service_metrics = {"resident_variants": ("gauge", "Resident variants of the service."),
                       "restores": ("counter", "Restores from host memory (pre-restores "
                                                   "included)."),
                       "prerestores": ("counter", "Restores made ahead of demand."),
                       "restore_seconds": ("counter", "Seconds spent restoring."),
                       "restore_bytes": ("counter", "Bytes copied by restores."),
                       "evictions": ("counter", "Variants evicted."),
                       "requests": ("counter", "Requests served (actions)."),
                       "batches": ("counter", "Forward passes run for the requests (a "
                                              "batch of several requests is one)."),
                       "failed": ("counter", "Actions that failed.")}
    for key, (kind, text) in service_metrics.items():
        name = f"tangram_service_{key}" + ("_total" if kind == "counter" and
                                           not key.endswith(("seconds", "bytes")) else "")
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{service="{s}"}} {v[key]:.6g}' for s, v in snap["services"].items()]
    lines += ["# HELP tangram_gpu_worker_crashes_total GPU workers that died.",
              "# TYPE tangram_gpu_worker_crashes_total counter",
              f"tangram_gpu_worker_crashes_total {snap['crashes']}"]
    return lines


router = APIRouter()


@router.get("/v1/gpus")
async def gpus(request: Request) -> dict[str, Any]:
    """GPU nodes, per-GPU state, per-service residency and restore figures, NVML readings."""
    backend = request.app.state.service.executor.backend
    gpu = gpu_backend(backend)
    if gpu is None:
        return {"device": None, "nodes": {}, "services": {}}
    out = telemetry(gpu)
    out["discovery"] = getattr(request.app.state, "gpu_discovery", None)
    return out
