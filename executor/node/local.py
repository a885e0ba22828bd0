"""The machine the live executor runs on, as a ClusterSpec."""

from __future__ import annotations

import os

from tangram.cluster import ClusterSpec, CpuNodeSpec, QuotaSpec


def allowed_cpus() -> list[int]:
    """CPU ids this process may use; the core's core i is ``allowed_cpus()[i]``."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def mem_total_gb() -> float:
    """This machine's memory, or the memory limit of the cgroup it runs in when smaller
    (a container's: executor/node/cgroups.py)."""
    from executor.node import cgroups

    limit = cgroups.limit_gb()
    host = _meminfo_total_gb()
    return host if limit is None else min(host, limit)


def _meminfo_total_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024**2
    except OSError:  # pragma: no cover
        pass
    return 16.0


def local_cluster(quotas: tuple[QuotaSpec, ...] = (), mem_gb: float | None = None) -> ClusterSpec:
    """One CPU node with this machine's allowed cores in one NUMA domain."""
    cores = len(allowed_cpus())
    return ClusterSpec(cpu_nodes=(CpuNodeSpec("local", cores, 1, mem_gb or mem_total_gb()),),
                       quotas=quotas)
