"""What each docker sandbox may use, as `tangram serve` / `run` were told
(--sandbox-mem-gb, --sandbox-pids, --sandbox-disk-gb, --warm-pool, --image-pulls,
--image-cache-gb, and the process
backend's --sandbox-uids): one value handed
to the docker backend of this machine and to the one of every Ray node agent, so a
sandbox is bounded the same wherever it runs. Standard library only: a process-backend
agent imports it without Docker's SDK."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: where a trajectory's commands run and its files live, inside the container
SANDBOX_WORKDIR = "/work"


@dataclass(frozen=True)
class SandboxLimits:
    mem_gb: float = 2.0  # a sandbox's memory limit when its trajectory declares none
    pids: int = 512  # most processes in a sandbox
    disk_gb: float = 4.0  # its disk (executor/backends/docker/backend.py: storage-opt or tmpfs)
    warm: int = 0  # started sandboxes kept ready for a first action (per node)
    #: the process backend as root: user ids it hands out, at most this many trajectories
    #: open at once (executor/backends/process/uids.py BLOCK)
    uids: int = 4096
    #: images pulled at once from their registries (per node; executor/backends/docker/cache.py)
    image_pulls: int = 2
    #: disk the images the node pulled may take (GB); None: no budget, nothing evicted
    image_cache_gb: float | None = None

    def docker_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``DockerBackend`` these set."""
        return {"default_mem_gb": self.mem_gb, "pids_limit": self.pids,
                "disk_gb": self.disk_gb, "warm": self.warm,
                "image_pulls": self.image_pulls, "image_cache_gb": self.image_cache_gb}
