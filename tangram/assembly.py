"""What a core is built of, from its policy and its cluster: the managers and pools (the
policy's parts build them) and the sides (tangram/sides.py) that carry what is CPU- or
GPU-specific: the GPU nodes, the CPU nodes and the binding of trajectories to CPU nodes.
Built here so the state machine (tangram/machine.py) names no concrete CPU or GPU class and
imports neither: it holds the sides by the points they implement."""

from __future__ import annotations

from functools import partial

from tangram.cluster import ClusterSpec
from tangram.cpu.admission import RESERVE, MemoryAdmission
from tangram.cpu.binding import Binding
from tangram.cpu.images import ImageBook
from tangram.cpu.nodes import CpuNodes
from tangram.gpu.nodes import GpuNodes
from tangram.machine import Parts, QueueMany
from tangram.model import Pending
from tangram.policies import Policy
from tangram.trajectory import TrajectoryState


def assemble(cluster: ClusterSpec, policy: Policy, trajectories: dict[str, TrajectoryState],
             queued: dict[str, Pending], queue_many: QueueMany,
             admission: MemoryAdmission | None = None) -> Parts:
    """The parts of a core over ``trajectories`` and ``queued`` (the core's own dicts, which
    the binding reads), queuing through ``queue_many``. ``admission``: when a CPU node takes
    one more trajectory's memory (None: RESERVE, every declared limit in full, the paper's
    rule; tangram/cpu/admission.py)."""
    scheduler = policy.scheduler()
    res = policy.build(cluster)
    # the GPU side first, as before: building a side registers nothing the others read
    gpu = GpuNodes(res.gpu, cluster.gpu_nodes, res.pools)
    binding = Binding(
        res.cpu, cluster.cpu_nodes, policy.env, trajectories, queued,
        lambda action: policy.route(action, res),  # type: ignore[arg-type,return-value]
        lambda node: policy.node_pool(node, res), queue_many)
    cpu = CpuNodes(res.cpu, cluster.cpu_nodes, policy.cpu, res.pools, binding,
                   admission if admission is not None else RESERVE,
                   ImageBook.of(cluster, policy.images))
    # the sides in the order the core asks them at each point: the GPU nodes first (a node
    # joining is a GPU node's if it is one, the CPU nodes take every other; a submitted GPU
    # request is the GPU side's to check), the CPU nodes, the binding; their figures in the
    # order of the utilisation columns
    return Parts(policy.label, scheduler, res.pools, res.quota,  # type: ignore[arg-type]
                 partial(policy.route_many, res=res),  # type: ignore[arg-type]
                 (gpu, cpu, binding), (cpu, gpu))
