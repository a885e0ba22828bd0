"""Connecting to Ray for the multi-node executor (`--ray auto|ADDRESS|local:N`).

Ray is an optional extra (``pip install 'tangram-rl[ray]'``): nothing here
imports it before a connection is asked for, and a missing Ray is reported as
:class:`RayUnavailable`, which the CLI turns into exit status 2.

``local:N`` starts an N-node cluster on this machine (``ray.cluster_utils``),
for trying multi-node Tangram on one machine and for the tests. Each node is
told which of this machine's cores are its own through the node label
``tangram-cpus`` (the same label a real node may carry, see docs/ray.md); the
cores are split into N contiguous slices. With more nodes than cores (the
2-core CI machine runs 3 nodes) the slices overlap round-robin: every node
still has whole cores to pin actions to, but nodes share physical cores, so
such a cluster shows placement and failure handling, not capacity. Ray's own
logical ``CPU`` resource of each node is set to the slice size; each agent
reserves its node's cores as Ray CPUs (executor/backends/ray/backend.py), so neither a
second Tangram server nor the trainer's Ray tasks are placed on cores Tangram
grants, per action.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from typing import Any

from executor.node.local import allowed_cpus, mem_total_gb

#: Node labels Tangram reads (``ray start --labels='{"tangram-cpus": "0-15"}'``).
CPUS_LABEL = "tangram-cpus"
MEM_LABEL = "tangram-mem-gb"

#: Failure detection of the local test cluster: the GCS marks a node dead after
#: 3 missed health checks 300 ms apart (Ray's defaults: 5 checks 3 s apart).
LOCAL_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 300,
                       "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
OBJECT_STORE_BYTES = 80 * 1024**2  # actions move kilobytes; keep shared memory small


class RayUnavailable(RuntimeError):
    """Ray is not installed (or not importable) in this environment."""


def require_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RayUnavailable(
            f"--ray needs Ray, an optional extra: pip install 'tangram-rl[ray]' ({e})") from None
    return ray


@dataclass(frozen=True, slots=True)
class RaySpec:
    """What ``--ray`` asked for: ``auto``, an address, or a local N-node cluster."""

    mode: str  # auto | address | local
    address: str | None = None
    nodes: int = 0

    @classmethod
    def parse(cls, text: str) -> RaySpec:
        text = text.strip()
        if text == "auto":
            return cls("auto", "auto")
        if text.startswith("local:"):
            count = text.removeprefix("local:")
            if not count.isdigit() or not 1 <= int(count) <= 64:
                raise ValueError(f"--ray {text!r}: local:N needs a node count N in 1..64")
            return cls("local", None, int(count))
        if not text or any(c.isspace() for c in text):
            raise ValueError(f"--ray {text!r}: expected auto, local:N or a Ray address "
                             "(HOST:PORT or ray://HOST:PORT)")
        return cls("address", text)


def format_cpus(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2_5"`` (label values cannot hold commas)."""
    parts: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return "_".join(parts)


def parse_cpus(text: str) -> list[int]:
    """A CPU list as in ``/sys`` or the label: ``"0-3,8"`` or ``"0-3_8"``."""
    out: set[int] = set()
    for part in re.split(r"[,_\s]+", text.strip()):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"{CPUS_LABEL}: bad CPU list {text!r} (expected e.g. 0-3_8)")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def split_cores(cpus: list[int], nodes: int) -> list[list[int]]:
    """N slices of this machine's cores: contiguous and disjoint when there are
    enough cores, else one core each, assigned round-robin (shared)."""
    if nodes > len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(nodes)]
    size, extra = divmod(len(cpus), nodes)
    out, at = [], 0
    for i in range(nodes):
        n = size + (1 if i < extra else 0)
        out.append(cpus[at:at + n])
        at += n
    return out


@dataclass
class RayConnection:
    """This process's Ray connection, and the local cluster it started (if any)."""

    spec: RaySpec
    address: str
    cluster: Any = None  # ray.cluster_utils.Cluster for local:N
    node_args: list[dict] = field(default_factory=list)

    def add_local_node(self, cpus: list[int], mem_gb: float) -> Any:
        """Start one more node of the local cluster (tests: a node joins)."""
        if self.cluster is None:
            raise RuntimeError("only a local:N cluster can add nodes")
        args = _local_node_args(cpus, mem_gb)
        self.node_args.append(args)
        return self.cluster.add_node(**args)

    def local_nodes(self) -> list[Any]:
        """The local cluster's nodes (head first); each has ``.node_id``."""
        return [] if self.cluster is None else self.cluster.list_all_nodes()

    def close(self) -> None:
        ray = require_ray()
        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()  # the worker nodes
            if self.cluster.head_node is not None:
                self.cluster.remove_node(self.cluster.head_node, allow_graceful=False)
            self.cluster = None


def _local_node_args(cpus: list[int], mem_gb: float) -> dict:
    return {"num_cpus": len(cpus), "object_store_memory": OBJECT_STORE_BYTES,
            "labels": {CPUS_LABEL: format_cpus(cpus), MEM_LABEL: f"{mem_gb:.2f}"}}


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast: ray.init retries an unreachable address for minutes."""
    target: str | None = address
    if address == "auto":  # the cluster `ray start` on this machine recorded, if any
        try:
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address("auto")
        except Exception:  # noqa: BLE001 - a private helper: let ray.init decide
            return
        if target is None:
            raise ConnectionError("--ray auto: no Ray cluster on this machine (start one with "
                                  "`ray start --head`, or give its address)")
    hostport = target.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConnectionError(f"--ray {address}: expected HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"--ray {address}: no Ray cluster answers at {host}:{port} "
                              f"({e.strerror or e})") from None


def connect(spec: RaySpec | str, labels: dict[str, str] | None = None) -> RayConnection:
    """Connect this process to Ray (starting a local cluster for ``local:N``, each node
    with ``labels`` besides its own: e.g. the GPUs it declares, executor/backends/gpu/ray_worker.py).

    Raises RayUnavailable without Ray, ConnectionError when no cluster answers."""
    if isinstance(spec, str):
        spec = RaySpec.parse(spec)
    ray = require_ray()
    if ray.is_initialized():
        raise RuntimeError("this process is already connected to Ray")
    if spec.mode != "local":
        _check_reachable(spec.address or "auto")
        try:
            ray.init(address=spec.address, namespace="tangram", include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConnectionError(f"--ray {spec.address}: cannot connect to a Ray cluster "
                                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                                  ) from None
        return RayConnection(spec, spec.address or "auto")
    from ray.cluster_utils import Cluster

    slices = split_cores(allowed_cpus(), spec.nodes)
    mem = round(mem_total_gb() / spec.nodes, 2)
    args = [_local_node_args(s, mem) for s in slices]
    for a in args:
        a["labels"].update(labels or {})
    cluster = Cluster(initialize_head=True, head_node_args={
        **args[0], "include_dashboard": False, "_system_config": LOCAL_HEALTH_CHECKS})
    try:
        for a in args[1:]:
            cluster.add_node(**a)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="tangram", include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    except BaseException:
        cluster.shutdown()
        raise
    return RayConnection(spec, cluster.address, cluster, args)
