"""This process's memory cgroup (cgroup v1), as far as the machine's memory is concerned.

A server inside a container with a memory limit (docker ``--memory``, a Kubernetes pod, a
cgroup a supervisor made) has that limit as its machine: ``/proc/meminfo`` still shows the
host's memory, and a server that trusted it would admit sandboxes past its container's
limit and meet the kernel's OOM killer there. So the node's memory is the smaller of the
host's and every enclosing cgroup's limit (:func:`limit_gb`), and its free memory the
smaller of ``MemAvailable`` and what each enclosing limit leaves (:func:`free_gb`).
"""

from __future__ import annotations

import os
from pathlib import Path

#: a v1 limit at or above this is "no limit" (the kernel's page-rounded LONG_MAX)
UNLIMITED = 1 << 60


def own_memory_cgroup_name() -> str | None:
    """This process's cgroup v1 memory cgroup as the hierarchy names it
    (``/docker/<id>``, ``/tangram-test``), None where there is none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 2)[2] for line in lines
                 if "memory" in line.split(":", 2)[1].split(",")), None)


def own_memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory cgroup directory, None where there is none."""
    rel = own_memory_cgroup_name()
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    if rel is None:
        return None
    for m in mounts:
        pre, _, post = m.partition(" - ")
        fields, super_fields = pre.split(), post.split()
        if super_fields[:1] == ["cgroup"] and "memory" in super_fields[-1].split(","):
            root, mount = fields[3], fields[4]
            inside = os.path.relpath(rel, root) if rel.startswith(root) else rel.lstrip("/")
            path = Path(mount) / inside
            return path if path.is_dir() else None
    return None



def _levels() -> list[Path]:
    """This process's memory cgroup and every parent up to the hierarchy's mount."""
    own = own_memory_cgroup()
    if own is None:
        return []
    out = [own]
    while (out[-1] / ".." / "memory.limit_in_bytes").exists() and out[-1].parent != out[-1]:
        out.append(out[-1].parent)
    return out


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def working_set(level: Path) -> int | None:
    """A v1 memory cgroup's usage less the file cache the kernel can drop (what only a
    kill frees: the "working set", as kubelet counts it); None where it cannot be read."""
    usage = _read_int(level / "memory.usage_in_bytes")
    if usage is None:
        return None
    try:
        for line in (level / "memory.stat").read_text().splitlines():
            if line.startswith("total_inactive_file "):
                return max(usage - int(line.split()[1]), 0)
    except (OSError, ValueError):
        pass
    return usage


def limit_gb() -> float | None:
    """The smallest memory limit of the cgroups enclosing this process (None: none)."""
    limits = [v for v in (_read_int(p / "memory.limit_in_bytes") for p in _levels())
              if v is not None and v < UNLIMITED]
    return min(limits) / 1024**3 if limits else None


def sandboxes_parent() -> str | None:
    """Where a server whose machine is a memory-limited cgroup puts the sandboxes it starts
    through another daemon (docker's ``cgroup_parent``): its own memory cgroup, so that the
    limit it observes as its machine's memory bounds them too, as it bounds the process
    backend's children. None where no enclosing cgroup has a limit (the host is the machine:
    the sandboxes stay where the daemon puts them)."""
    return own_memory_cgroup_name() if limit_gb() is not None else None


def free_gb() -> float | None:
    """The least memory any enclosing limited cgroup leaves (None: none is limited)."""
    out = None
    for level in _levels():
        limit = _read_int(level / "memory.limit_in_bytes")
        used = working_set(level)
        if limit is None or limit >= UNLIMITED or used is None:
            continue
        left = max(limit - used, 0) / 1024**3
        out = left if out is None else min(out, left)
    return out
