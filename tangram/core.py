"""Tangram: the clock-free core. No clock, no I/O, no threads.

Drivers send commands (tangram/protocol.py: ``Submit``, ``Finish``, ``Poll``...) to
``handle`` with the current time and get back the effects to carry out (the dispatches to
start); they read the core through ``snapshot`` and the point queries. Nothing else of a
Tangram is public. The same object is driven by the SimPy clock (sim/) and by the asyncio
loop (executor/).

A ``Tangram`` is the state machine (tangram/machine.py, generic over resource kinds) built
from a policy's parts (tangram/assembly.py: its pools, and the CPU and GPU sides).
"""

from __future__ import annotations

from tangram.assembly import MemoryAdmission, assemble
from tangram.cluster import ClusterSpec
from tangram.estimates import Estimates
from tangram.machine import Machine
from tangram.policies import Policy


class Tangram(Machine):
    """The action-level resource manager's state machine, built from a policy."""

    def __init__(self, cluster: ClusterSpec, policy: Policy | None = None,
                 estimates: Estimates | None = None,
                 admission: MemoryAdmission | None = None) -> None:
        """``policy``: None, the default ``Policy()``. ``admission``: when a CPU node takes
        one more trajectory's memory (None: RESERVE, every declared limit reserved in full,
        the paper's rule; a node whose free memory is observed, MemoryObserved, may admit by
        use: tangram/cpu/admission.py)."""
        policy = policy or Policy()
        super().__init__(
            cluster,
            lambda trajectories, queued, queue_many: assemble(
                cluster, policy, trajectories, queued, queue_many, admission),
            estimates)
