"""The cluster Tangram manages, as typed, validated values.

``ClusterSpec.from_dict`` reads the YAML shape documented in ``sim/cluster.yaml``
and reports every problem at once (``ClusterError``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tangram.arrange import CHUNK_SIZES
from tangram.model import quota_resource


class ClusterError(ValueError):
    """A cluster description is malformed; ``problems`` lists every one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid cluster:\n  " + "\n  ".join(problems))


@dataclass(frozen=True, slots=True)
class CpuNodeSpec:
    name: str
    cores: int = 256
    numa: int = 2
    mem_gb: float = 2400.0


@dataclass(frozen=True, slots=True)
class GpuNodeSpec:
    name: str
    gpus: int = 8
    gpu_mem_gb: float = 80.0
    host_mem_gb: float = 3000.0


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str
    size_gb: float


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    """``concurrency``: at most ``limit`` in flight; ``window``: at most ``limit``
    starts per ``window_s`` seconds (sliding window)."""

    key: str
    mode: str = "concurrency"
    limit: float = 1
    window_s: float = 1.0


def gpu_misfit(nodes: Iterable[GpuNodeSpec], services: Mapping[str, ServiceSpec],
               service: str, units: int) -> str | None:
    """Why ``units`` GPUs of ``nodes`` can never serve ``service`` (None when they can):
    an unknown service, a unit count that is no chunk size or more than a node has, or
    weights that do not fit the smallest GPU's memory split ``units`` ways."""
    spec = services.get(service)
    if spec is None:
        return f"service: unknown service {service!r} (known: {sorted(services)})"
    if units not in CHUNK_SIZES:
        return f"cost['gpu']: {units} GPUs is not a chunk size {CHUNK_SIZES}"
    nodes = tuple(nodes)
    if not nodes:
        return "cost['gpu']: the cluster has no GPU nodes"
    if units > max(n.gpus for n in nodes):
        return f"cost['gpu']: {units} GPUs is more than any GPU node has"
    mem = min(n.gpu_mem_gb for n in nodes)
    if spec.size_gb / units > mem:
        return (f"cost['gpu']: service {service!r} ({spec.size_gb} GB) does not fit on "
                f"{units} GPU(s) of {mem} GB")
    return None


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    cpu_nodes: tuple[CpuNodeSpec, ...] = ()
    gpu_nodes: tuple[GpuNodeSpec, ...] = ()
    services: tuple[ServiceSpec, ...] = ()
    quotas: tuple[QuotaSpec, ...] = ()
    #: host-to-GPU restore bandwidth per GPU (GB/s); a k-GPU variant loads k shards in parallel
    restore_gbps: float = 20.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def service(self, name: str) -> ServiceSpec | None:
        for s in self.services:
            if s.name == name:
                return s
        return None

    def gpu_misfit(self, service: str, units: int) -> str | None:
        """Why ``units`` GPUs of this cluster can never serve ``service`` (None when they
        can): a fact of the spec, so code outside the core (an operator sizing static
        replicas) asks it here rather than of the GPU manager."""
        return gpu_misfit(self.gpu_nodes, {s.name: s for s in self.services}, service, units)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self) -> dict[str, Any]:
        """The cluster in the YAML shape ``from_dict`` reads back unchanged (one entry
        per node, named): what `tangram run` writes for `tangram simulate --cluster`."""
        data = asdict(self)
        return {"cpu_nodes": list(data["cpu_nodes"]), "gpu_nodes": list(data["gpu_nodes"]),
                "services": list(data["services"]), "quotas": list(data["quotas"]),
                "restore_gbps": self.restore_gbps, "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        problems: list[str] = []
        if not isinstance(data, Mapping):
            raise ClusterError([f"top level: expected a mapping, got {type(data).__name__}"])
        known = {"cpu_nodes", "gpu_nodes", "services", "quotas", "restore_gbps", "extra"}
        for key in data:
            if key not in known:
                problems.append(f"{key}: unknown field (expected one of {sorted(known)})")

        def num(where: str, value: Any, *, positive: bool = True, integer: bool = False):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if ok and (math.isnan(value) or math.isinf(value)):
                ok = False
            if ok and integer and value != int(value):
                ok = False
            if ok and (value <= 0 if positive else value < 0):
                ok = False
            if not ok:
                kind = "an integer" if integer else "a number"
                problems.append(f"{where}: expected {kind} {'> 0' if positive else '>= 0'}, "
                                f"got {value!r}")
                return None
            return int(value) if integer else float(value)

        def groups(name: str, fields: dict[str, tuple[bool, Any]]):
            """Entries ``{count, prefix, field...}`` expanded into named nodes."""
            out = []
            raw = data.get(name, [])
            if not isinstance(raw, list):
                problems.append(f"{name}: expected a list")
                return out
            for i, entry in enumerate(raw):
                where = f"{name}[{i}]"
                if not isinstance(entry, Mapping):
                    problems.append(f"{where}: expected a mapping")
                    continue
                for key in entry:
                    if key not in fields and key not in ("count", "prefix", "name"):
                        problems.append(f"{where}.{key}: unknown field")
                count = num(f"{where}.count", entry.get("count", 1), integer=True) or 0
                prefix = str(entry.get("prefix", f"{name.split('_')[0]}{i}-"))
                if "name" in entry:  # one node named as is (what to_yaml writes)
                    if count != 1 or "prefix" in entry:
                        problems.append(f"{where}.name: names one node (no count, no prefix)")
                        continue
                    vals = {key: num(f"{where}.{key}", entry.get(key, default), integer=integer)
                            for key, (integer, default) in fields.items()}
                    if None not in vals.values():
                        out.append((str(entry["name"]), vals))
                    continue
                vals = {}
                for key, (integer, default) in fields.items():
                    vals[key] = num(f"{where}.{key}", entry.get(key, default), integer=integer)
                if None in vals.values():
                    continue
                for k in range(count):
                    out.append((f"{prefix}{k}", vals))
            return out

        cpu = [CpuNodeSpec(n, **v) for n, v in groups(
            "cpu_nodes", {"cores": (True, 256), "numa": (True, 2), "mem_gb": (False, 2400.0)})]
        for node in cpu:
            if node.cores % node.numa:
                problems.append(f"cpu_nodes: {node.name}: cores {node.cores} not divisible "
                                f"by numa {node.numa}")
                break
        gpu = [GpuNodeSpec(n, **v) for n, v in groups(
            "gpu_nodes", {"gpus": (True, 8), "gpu_mem_gb": (False, 80.0),
                          "host_mem_gb": (False, 3000.0)})]
        for node in gpu:
            if node.gpus not in (1, 2, 4, 8):
                problems.append(f"gpu_nodes: {node.name}: gpus must be 1, 2, 4 or 8 (aligned "
                                f"chunks of 1/2/4/8), got {node.gpus}")
                break
        services = []
        raw_services = data.get("services", [])
        if not isinstance(raw_services, list):
            problems.append("services: expected a list")
            raw_services = []
        for i, s in enumerate(raw_services):
            if not isinstance(s, Mapping) or not isinstance(s.get("name"), str):
                problems.append(f"services[{i}]: expected {{name: str, size_gb: number}}")
                continue
            size = num(f"services[{i}].size_gb", s.get("size_gb"))
            if size is not None:
                services.append(ServiceSpec(s["name"], size))
        quotas = []
        raw_quotas = data.get("quotas", [])
        if not isinstance(raw_quotas, list):
            problems.append("quotas: expected a list")
            raw_quotas = []
        for i, q in enumerate(raw_quotas):
            where = f"quotas[{i}]"
            if not isinstance(q, Mapping) or not isinstance(q.get("key"), str):
                problems.append(f"{where}: expected {{key: str, mode, limit, window_s}}")
                continue
            key = q["key"]
            key = quota_resource(key)
            mode = q.get("mode", "concurrency")
            if mode not in ("concurrency", "window"):
                problems.append(f"{where}.mode: expected 'concurrency' or 'window', got {mode!r}")
                continue
            limit = num(f"{where}.limit", q.get("limit", 1))
            window = num(f"{where}.window_s", q.get("window_s", 1.0))
            if limit is not None and window is not None:
                quotas.append(QuotaSpec(key, mode, limit, window))
        restore = num("restore_gbps", data.get("restore_gbps", 20.0))
        names = [n.name for n in cpu] + [n.name for n in gpu]
        if len(set(names)) != len(names):
            problems.append("node names: duplicated (give each group its own prefix)")
        if problems:
            raise ClusterError(problems)
        return cls(tuple(cpu), tuple(gpu), tuple(services), tuple(quotas), restore or 20.0,
                   dict(data.get("extra", {}) or {}))
