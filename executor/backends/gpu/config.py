"""GPU services with their loaders, and the GPU nodes: from YAML or discovered with NVML.

A GPU cluster file is a cluster YAML (``sim/clusters/default.yaml`` documents
the fields) whose services may say how to load their model::

    gpu_nodes:
      - {count: 1, prefix: gpu-, gpus: 8, gpu_mem_gb: 80}
    services:
      - name: teacher0
        model: {init: random, seed: 0, config: {hidden_size: 2048, num_hidden_layers: 16,
                intermediate_size: 5632, num_attention_heads: 16, vocab_size: 32000}}
      - name: judge
        model: {path: /models/judge-7b}      # a local Hugging Face directory
    restore_gbps: 25

``size_gb`` may be left out: it is computed from the config (``init: random``)
or from the checkpoint files (``path``). With ``--gpus auto`` the ``gpu_nodes``
come from NVML instead (this machine's GPUs, one node).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from executor.backends.gpu.arrays import DTYPE_SIZES, default_dtype, torch_available
from executor.backends.gpu.model import ModelError, ModelSource, config_for_bytes, random_size_bytes
from tangram.cluster import ClusterError, ClusterSpec, GpuNodeSpec, ServiceSpec


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (no NVIDIA driver, no GPU); the message says why."""


def itemsize_for(device: str, dtype: str | None) -> int:
    """Bytes per weight of a service in ``dtype`` (None: the device's default, bfloat16 on
    GPUs and float32 on the cpu device). The worker computes in that same dtype, on
    either device, so the core's size is the worker's."""
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPE_SIZES:
        raise ModelError(f"model.dtype: expected one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
    if device == "cpu" and dtype == "bfloat16" and not torch_available():
        raise ModelError("model.dtype bfloat16: the cpu device computes with numpy here, "
                         "which has no bfloat16 (pip install torch, or give float32)")
    return DTYPE_SIZES[dtype]


def parse_model(raw: Any, where: str) -> ModelSource:
    if not isinstance(raw, Mapping):
        raise ModelError(f"{where}: expected {{init: random, config: {{...}}}} or {{path: DIR}}")
    unknown = set(raw) - {"init", "config", "seed", "path", "dtype"}
    if unknown:
        raise ModelError(f"{where}: unknown field(s) {sorted(unknown)}")
    dtype = raw.get("dtype")
    if dtype is not None and dtype not in DTYPE_SIZES:
        raise ModelError(f"{where}.dtype: expected one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
    if "path" in raw:
        if "init" in raw:
            raise ModelError(f"{where}: give either path or init: random, not both")
        return ModelSource.hf(str(raw["path"]), dtype)
    if raw.get("init") != "random":
        raise ModelError(f"{where}.init: expected 'random' (or give path: DIR), "
                         f"got {raw.get('init')!r}")
    config = raw.get("config")
    if not isinstance(config, Mapping):
        raise ModelError(f"{where}.config: expected a mapping of Hugging Face config keys")
    seed = raw.get("seed", 0)
    if not isinstance(seed, int):
        raise ModelError(f"{where}.seed: expected an integer, got {seed!r}")
    random_size_bytes(config, 4)  # validates the config, naming the bad key
    return ModelSource.random(config, seed, dtype)


def checkpoint_bytes(path: str) -> int:
    files = [p for p in Path(path).glob("*") if p.suffix in (".safetensors", ".bin", ".pt")]
    return sum(p.stat().st_size for p in files)


def source_bytes(source: ModelSource, device: str) -> int:
    if source.kind == "random":
        return random_size_bytes(dict(source.config), itemsize_for(device, source.dtype))
    return checkpoint_bytes(source.path)


@dataclass(frozen=True, slots=True)
class GpuCluster:
    """The GPU part of a live cluster: nodes, services, loaders, physical device ids."""

    spec: ClusterSpec
    sources: Mapping[str, ModelSource]
    physical: Mapping[str, list[int]] = field(default_factory=dict)
    discovery: Mapping[str, Any] | None = None


def load_gpu_cluster(data: Mapping[str, Any], device: str, where: str = "cluster",
                     discovered: GpuNodeSpec | None = None,
                     physical: list[int] | None = None) -> GpuCluster:
    """Services with loaders from a cluster mapping; GPU nodes from it or ``discovered``.
    Raises ClusterError listing every problem."""
    if not isinstance(data, Mapping):
        raise ClusterError([f"{where}: expected a mapping"])
    problems: list[str] = []
    sources: dict[str, ModelSource] = {}
    services = []
    for i, s in enumerate(data.get("services") or []):
        w = f"{where}: services[{i}]"
        if not isinstance(s, Mapping) or not isinstance(s.get("name"), str):
            problems.append(f"{w}: expected {{name, model, size_gb}}")
            continue
        entry = {k: v for k, v in s.items() if k != "model"}
        if "model" not in s:
            problems.append(f"{w} ({s['name']}): no model (give model: {{init: random, "
                            "config: {...}} or model: {path: DIR})")
            continue
        try:
            src = parse_model(s["model"], f"{w}.model")
        except ModelError as e:
            problems.append(str(e))
            continue
        try:
            itemsize_for(device, src.dtype)  # a dtype this device's array library lacks
        except ModelError as e:
            problems.append(f"{w}.{e}")
            continue
        sources[s["name"]] = src
        if "size_gb" not in entry:
            nbytes = source_bytes(src, device)
            if nbytes <= 0:
                problems.append(f"{w}.model.path: no checkpoint files (*.safetensors, *.bin) "
                                f"in {src.path!r}; give size_gb")
                continue
            entry["size_gb"] = nbytes / 1e9
        services.append(entry)
    if not services and not problems:
        problems.append(f"{where}: services: no GPU service defined")
    raw = {k: v for k, v in data.items() if k in ("gpu_nodes", "restore_gbps")}
    raw["services"] = services
    if discovered is not None:
        raw.pop("gpu_nodes", None)
    try:
        spec = ClusterSpec.from_dict(raw)
    except ClusterError as e:
        problems += [f"{where}: {p}" for p in e.problems]
        spec = None
    if problems:
        raise ClusterError(problems)
    assert spec is not None
    if discovered is not None:
        spec = ClusterSpec(gpu_nodes=(discovered,), services=spec.services,
                           restore_gbps=spec.restore_gbps)
    elif not spec.gpu_nodes:
        raise ClusterError([f"{where}: gpu_nodes: none (list them, or serve with --gpus auto)"])
    phys = {discovered.name: list(physical or range(discovered.gpus))} if discovered else {}
    return GpuCluster(spec, sources, phys)


def read_gpu_cluster(path: Path, device: str, discovered: GpuNodeSpec | None = None,
                     physical: list[int] | None = None) -> GpuCluster:
    if not path.exists():
        raise ClusterError([f"{path}: no such file"])
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ClusterError([f"{path}: not valid YAML: {e}"]) from None
    return load_gpu_cluster(data, device, str(path), discovered, physical)


def scaled_cluster(spec: ClusterSpec, scale: float, layers: int = 4) -> GpuCluster:
    """A cluster's GPU nodes and services shrunk by ``scale`` (sizes and GPU memory alike,
    so the core makes the same residency decisions), each service an ``init: random``
    model of its scaled size: replaying a GPU trace on the cpu device."""
    if not spec.gpu_nodes or not spec.services:
        raise ClusterError(["cluster: has no GPU nodes or services to scale"])
    sources, services = {}, []
    for i, s in enumerate(spec.services):
        config = config_for_bytes(int(s.size_gb * 1e9 * scale), 4, layers)
        # float32 said explicitly: the size below is the worker's on either device
        sources[s.name] = ModelSource.random(config, seed=i, dtype="float32")
        services.append(ServiceSpec(s.name, random_size_bytes(config, 4) / 1e9))
    # GPU memory scales with the models' real (rounded) sizes, not the declared ones
    ratio = sum(x.size_gb for x in services) / sum(s.size_gb for s in spec.services)
    nodes = tuple(GpuNodeSpec(n.name, n.gpus, n.gpu_mem_gb * ratio, n.host_mem_gb * ratio)
                  for n in spec.gpu_nodes)
    return GpuCluster(ClusterSpec(gpu_nodes=nodes, services=tuple(services),
                                  restore_gbps=spec.restore_gbps), sources)


# -- NVML ----------------------------------------------------------------------------------
def _nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("NVML: the nvidia-ml-py package is not installed") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise NvmlUnavailable(f"NVML cannot start ({e}): no NVIDIA driver on this machine? "
                              "Use --gpu-device cpu with a --gpu-cluster file to test "
                              "without a GPU") from None
    return pynvml


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def discover(node: str = "gpu-local") -> tuple[GpuNodeSpec, list[int], dict[str, Any]]:
    """This machine's GPUs as one node: the largest power-of-two count (at most 8) of
    GPUs, their smallest memory, the host memory; plus what NVML said (topology)."""
    nv = _nvml()
    try:
        count = nv.nvmlDeviceGetCount()
        if count == 0:
            raise NvmlUnavailable("NVML: the driver is loaded but reports no GPU")
        gpus = []
        for i in range(count):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            gpus.append({"index": i, "name": _text(nv.nvmlDeviceGetName(h)),
                         "uuid": _text(nv.nvmlDeviceGetUUID(h)),
                         "mem_total_gb": mem.total / 1e9,
                         "pci_bus_id": _text(nv.nvmlDeviceGetPciInfo(h).busId)})
        use = 1 << min(3, int(math.log2(count)))
        topology = []
        for a in range(use):
            for b in range(a + 1, use):
                ha, hb = nv.nvmlDeviceGetHandleByIndex(a), nv.nvmlDeviceGetHandleByIndex(b)
                try:
                    level = int(nv.nvmlDeviceGetTopologyCommonAncestor(ha, hb))
                except nv.NVMLError:
                    level = -1
                topology.append({"a": a, "b": b, "common_ancestor": TOPOLOGY.get(level, level)})
        driver = _text(nv.nvmlSystemGetDriverVersion())
    finally:
        nv.nvmlShutdown()
    from executor.node.local import mem_total_gb

    mem = min(g["mem_total_gb"] for g in gpus[:use])
    spec = GpuNodeSpec(node, use, round(mem * 0.95, 3), mem_total_gb())  # 5%: CUDA context
    info = {"driver": driver, "gpus": gpus, "used": use, "ignored": count - use,
            "topology": topology}
    return spec, list(range(use)), info


TOPOLOGY = {0: "same board", 10: "single PCIe switch", 20: "multiple PCIe switches",
            30: "host bridge", 40: "same NUMA node", 50: "across sockets"}


def readings(indices: list[int]) -> list[dict[str, float]]:
    """Utilisation, memory used, temperature and power of these GPUs (NVML)."""
    nv = _nvml()
    out = []
    try:
        for i in indices:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            util = nv.nvmlDeviceGetUtilizationRates(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            row = {"index": i, "util_gpu_pct": float(util.gpu), "util_mem_pct": float(util.memory),
                   "mem_used_gb": mem.used / 1e9, "mem_total_gb": mem.total / 1e9}
            try:
                row["temp_c"] = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
                row["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
            except nv.NVMLError:
                pass
            out.append(row)
    finally:
        nv.nvmlShutdown()
    return out
