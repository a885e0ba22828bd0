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
    #: disk for container images (GB): least recently used unused images are
    #: removed past it (None: no budget, nothing is removed)
    image_cache_gb: float | None = None


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
        """The cluster of a YAML/JSON mapping; ClusterError lists every problem found."""
        if not isinstance(data, Mapping):
            raise ClusterError([f"top level: expected a mapping, got {type(data).__name__}"])
        read = _Reader(data)
        for key in data:
            if key not in KNOWN_FIELDS:
                read.problems.append(f"{key}: unknown field (expected one of {sorted(KNOWN_FIELDS)})")
        cpu = read.cpu_nodes()
        gpu = read.gpu_nodes()
        services, quotas = read.services(), read.quotas()
        restore = read.num("restore_gbps", data.get("restore_gbps", 20.0))
        names = [n.name for n in cpu] + [n.name for n in gpu]
        if len(set(names)) != len(names):
            read.problems.append("node names: duplicated (give each group its own prefix)")
        if read.problems:
            raise ClusterError(read.problems)
        return cls(tuple(cpu), tuple(gpu), tuple(services), tuple(quotas), restore or 20.0,
                   dict(data.get("extra", {}) or {}))


#: the top-level fields of a cluster file
KNOWN_FIELDS = ("cpu_nodes", "gpu_nodes", "services", "quotas", "restore_gbps", "extra")


class _Reader:
    """Reads the sections of a cluster mapping, collecting every problem (field and value)
    instead of stopping at the first."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = data
        self.problems: list[str] = []

    def num(self, where: str, value: Any, *, positive: bool = True, integer: bool = False):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and (math.isnan(value) or math.isinf(value)):
            ok = False
        if ok and integer and value != int(value):
            ok = False
        if ok and (value <= 0 if positive else value < 0):
            ok = False
        if not ok:
            kind = "an integer" if integer else "a number"
            self.problems.append(f"{where}: expected {kind} {'> 0' if positive else '>= 0'}, "
                                 f"got {value!r}")
            return None
        return int(value) if integer else float(value)

    def _list(self, name: str) -> list:
        raw = self.data.get(name, [])
        if not isinstance(raw, list):
            self.problems.append(f"{name}: expected a list")
            return []
        return raw

    def groups(self, name: str, fields: dict[str, tuple[bool, Any]]) -> list[tuple[str, dict]]:
        """Entries ``{count, prefix, field...}`` expanded into named nodes (or one entry
        ``{name, field...}``, what ``to_yaml`` writes). A field whose default is None is
        optional: absent (or null), it is None."""
        out = []
        for i, entry in enumerate(self._list(name)):
            where = f"{name}[{i}]"
            if not isinstance(entry, Mapping):
                self.problems.append(f"{where}: expected a mapping")
                continue
            for key in entry:
                if key not in fields and key not in ("count", "prefix", "name"):
                    self.problems.append(f"{where}.{key}: unknown field")
            count = self.num(f"{where}.count", entry.get("count", 1), integer=True) or 0
            prefix = str(entry.get("prefix", f"{name.split('_')[0]}{i}-"))
            if "name" in entry and (count != 1 or "prefix" in entry):
                self.problems.append(f"{where}.name: names one node (no count, no prefix)")
                continue
            vals = {key: self.num(f"{where}.{key}", entry.get(key, default), integer=integer)
                    for key, (integer, default) in fields.items()
                    if default is not None or entry.get(key) is not None}
            if None in vals.values():
                continue
            if "name" in entry:
                out.append((str(entry["name"]), vals))
            else:
                out.extend((f"{prefix}{k}", vals) for k in range(count))
        return out

    def cpu_nodes(self) -> list[CpuNodeSpec]:
        cpu = [CpuNodeSpec(n, **v) for n, v in self.groups(
            "cpu_nodes", {"cores": (True, 256), "numa": (True, 2), "mem_gb": (False, 2400.0),
                          "image_cache_gb": (False, None)})]
        for node in cpu:
            if node.cores % node.numa:
                self.problems.append(f"cpu_nodes: {node.name}: cores {node.cores} not divisible "
                                     f"by numa {node.numa}")
                break
        return cpu

    def gpu_nodes(self) -> list[GpuNodeSpec]:
        gpu = [GpuNodeSpec(n, **v) for n, v in self.groups(
            "gpu_nodes", {"gpus": (True, 8), "gpu_mem_gb": (False, 80.0),
                          "host_mem_gb": (False, 3000.0)})]
        for node in gpu:
            if node.gpus not in (1, 2, 4, 8):
                self.problems.append(f"gpu_nodes: {node.name}: gpus must be 1, 2, 4 or 8 "
                                     f"(aligned chunks of 1/2/4/8), got {node.gpus}")
                break
        return gpu

    def services(self) -> list[ServiceSpec]:
        out = []
        for i, s in enumerate(self._list("services")):
            if not isinstance(s, Mapping) or not isinstance(s.get("name"), str):
                self.problems.append(f"services[{i}]: expected {{name: str, size_gb: number}}")
                continue
            size = self.num(f"services[{i}].size_gb", s.get("size_gb"))
            if size is not None:
                out.append(ServiceSpec(s["name"], size))
        return out

    def quotas(self) -> list[QuotaSpec]:
        out = []
        for i, q in enumerate(self._list("quotas")):
            where = f"quotas[{i}]"
            if not isinstance(q, Mapping) or not isinstance(q.get("key"), str):
                self.problems.append(f"{where}: expected {{key: str, mode, limit, window_s}}")
                continue
            mode = q.get("mode", "concurrency")
            if mode not in ("concurrency", "window"):
                self.problems.append(f"{where}.mode: expected 'concurrency' or 'window', "
                                     f"got {mode!r}")
                continue
            limit = self.num(f"{where}.limit", q.get("limit", 1))
            window = self.num(f"{where}.window_s", q.get("window_s", 1.0))
            if limit is not None and window is not None:
                out.append(QuotaSpec(quota_resource(q["key"]), mode, limit, window))
        return out
