"""Memory admission: when a node takes one more sandbox.

A trajectory's ``mem_gb`` is the limit its sandbox is held to (the docker
backend's cgroup limit), not what it uses: a rollout's shell commands mostly use
a small fraction of it. Reserving every limit in full (what the paper's CPU
manager does, and what ``RESERVE`` keeps) lets a batch of rollouts declaring
4 GB each stall a 23 GB machine at its sixth rollout while the memory is free.

``MemoryAdmission`` admits by what the node's sandboxes actually use, with the
declared limits as a cap:

* the declared limits bound to a node may add up to ``overcommit`` times its
  memory (a bound on what the sandboxes could claim together);
* a node takes a new sandbox only while its observed free memory, less what the
  sandboxes admitted since that observation are assumed to use (``start_gb``
  each, at most their limit), keeps ``headroom`` (a fraction of its memory) free.

Observed free memory is what a deployment knows about a node (the executor reads
it, e.g. ``MemAvailable``, and sends the core ``MemoryObserved``); a node with no
observation falls back to reserving every declared limit in full, so the simulator
and nodes nobody observes behave as before.

A value, like the cluster's specs: the core is given one at construction
(``Tangram(cluster, policy, admission=...)``); its CPU manager applies it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MemoryAdmission:
    #: the declared limits bound to a node may add up to this many times its memory
    overcommit: float = 1.0
    #: fraction of a node's memory kept free (by observation) when a sandbox is admitted
    headroom: float = 0.0
    #: what a sandbox admitted since the last observation is assumed to use (GB, at most
    #: its limit): a burst of opens cannot all count on the same free memory
    start_gb: float = 0.25

    def __post_init__(self) -> None:
        if not self.overcommit >= 1.0:
            raise ValueError(f"overcommit: must be >= 1, got {self.overcommit!r}")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom: must be within [0, 1), got {self.headroom!r}")
        if not self.start_gb >= 0.0:
            raise ValueError(f"start_gb: must be >= 0, got {self.start_gb!r}")

    def refusal(self, node: str, mem_gb: float, declared_gb: float, new_gb: float,
                observed_free_gb: float | None, since_gb: float) -> str | None:
        """Why a node of ``mem_gb`` holding ``declared_gb`` of limits cannot take a sandbox
        declaring ``new_gb`` (None: it can). ``since_gb``: assumed use of the sandboxes
        admitted since ``observed_free_gb`` was observed (None: never observed)."""
        if observed_free_gb is None:  # nobody observes it: every limit reserved in full
            if declared_gb + new_gb > mem_gb + 1e-9:
                return (f"node {node}: {declared_gb:g} of {mem_gb:g} GB reserved by open "
                        f"sandboxes, {new_gb:g} GB more does not fit")
            return None
        if self.over_cap(mem_gb, declared_gb, new_gb):
            return (f"node {node}: sandboxes declare {declared_gb:g} GB, {new_gb:g} GB more "
                    f"would pass {self.overcommit:g} x its {mem_gb:g} GB (overcommit)")
        keep = self.headroom * mem_gb
        left = observed_free_gb - since_gb - min(new_gb, self.start_gb)
        if left < keep - 1e-9:
            return (f"node {node}: {observed_free_gb:.1f} GB free (observed), "
                    f"{keep:.1f} GB headroom kept; waiting for a sandbox to close")
        return None

    def over_cap(self, mem_gb: float, declared_gb: float, new_gb: float) -> bool:
        """Would ``new_gb`` more of declared limits pass ``overcommit`` x the node's memory."""
        return declared_gb + new_gb > self.overcommit * mem_gb + 1e-9


#: the paper's rule: every declared limit reserved in full
RESERVE = MemoryAdmission()
#: the live executor's default on a node it observes. 16x: 64 rollouts declaring 4 GB
#: fit a 16 GB node by their limits; what protects the machine is the headroom rule
#: (10% of its memory kept free, by observation), the limit caps each sandbox.
LIVE = MemoryAdmission(overcommit=16.0, headroom=0.10)
