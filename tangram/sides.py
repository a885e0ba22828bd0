"""What a resource side does for the core besides its pools, as the core sees any side: one
small protocol per point, a side implementing the points it uses (kube-scheduler plugin
style: the core asks isinstance once, at construction, and keeps the sides of each point in
order). The sides today: the GPU nodes (tangram/gpu/nodes.py), the CPU nodes
(tangram/cpu/nodes.py) and the binding of trajectories to CPU nodes
(tangram/cpu/binding.py), built by tangram/assembly.py. The core calls these points and
names no resource: a new resource kind plugs in a side implementing the points it needs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tangram.cluster import CpuNodeSpec, GpuNodeSpec
from tangram.model import Action, Outcome, Pending
from tangram.pool import PoolPoints
from tangram.protocol import Capabilities, Effect, QueueView
from tangram.trajectory import TrajectoryState

#: a submitted action's check by a side: True when the side took it (checked it, raising
#: ValueError/KeyError naming the field when it cannot run); False: another side's
Check = Callable[[Action, TrajectoryState], bool]


@dataclass(frozen=True, slots=True)
class Figures:
    """A side's figures for utilisation sampling: its key resources' (``units``, listed
    before every side's ``other`` figures, so the columns keep their order) and the rest."""

    units: Mapping[str, float]
    other: Mapping[str, float]


@runtime_checkable
class Membership(Protocol):
    """Nodes join, leave and lose their workers (multi-node executors, e.g. Ray)."""

    def joined(self, spec: CpuNodeSpec | GpuNodeSpec) -> Iterable[PoolPoints] | None:
        """``spec`` joined: the pools to run a pass for (None: not this
        side's node). Raises ValueError (naming the field) for a node it refuses."""
        ...

    def lost(self, node: str) -> Iterable[PoolPoints] | None:
        """``node`` left: the pools to run a pass for (None: none, or not this side's)."""
        ...

    def worker_lost(self, node: str) -> None:
        """``node``'s worker died (what it held in memory is gone)."""
        ...


@runtime_checkable
class Checking(Protocol):
    """Submitted actions that can never run are refused before anything is queued."""

    def checker(self) -> Check:
        """The check of one submission's actions (it may remember answers for the batch)."""
        ...


@runtime_checkable
class Owing(Protocol):
    """Effects a side decided outside any dispatch (the GPU pre-restores, the CPU nodes'
    pulls ahead for trajectories waiting for a node), carried out after every command."""

    def owed(self, out: list[Effect], now: float) -> None:
        """Append what is owed at ``now`` to ``out`` (and owe it no more)."""
        ...


@runtime_checkable
class Learning(Protocol):
    """What a side learns from how actions ended (the CPU side: an image's pull rate, from
    the outcome of the action whose environment's start waited for the pull)."""

    #: the ``Outcome.extra`` keys it learns from: the core hands it only the outcomes that
    #: carry one, so an action's end runs no code of a side with nothing to learn from it
    learns_from: frozenset[str]

    def ended(self, outcome: Outcome) -> None:
        """An action ended with ``outcome`` (carrying one of ``learns_from``)."""
        ...


@runtime_checkable
class Attaching(Protocol):
    """What the attached backend can carry out (tangram/protocol.py Capabilities)."""

    def attached(self, capabilities: Capabilities) -> None: ...


@runtime_checkable
class Reporting(Protocol):
    """What the snapshot shows of the side: counters, node views, figures."""

    def counters(self) -> dict[str, float]: ...
    def views(self) -> dict[str, object]:
        """Snapshot fields (tangram/protocol.py Snapshot) by name."""
        ...
    def usage(self) -> Figures: ...
    def capacity(self) -> Figures: ...


@runtime_checkable
class Hosting(Protocol):
    """A side that holds something for a trajectory's whole life (the CPU nodes: its node's
    memory, its image): told when one opens and when it closes."""

    def check_open(self, mem_gb: float | None) -> None:
        """Raise ValueError (naming the field) when a trajectory declaring ``mem_gb`` can
        never be held (asked before anything changes)."""
        ...

    def opened(self, trajectory: str, mem_gb: float | None, image: str, image_gb: float,
               now: float) -> list[Effect]:
        """``trajectory`` opened (naming ``image``, "" for none): the effects (an image
        pulled ahead)."""
        ...

    def closed(self, trajectory: str) -> bool:
        """``trajectory`` closed: True when what it held going may let a waiting one in (a
        pass is due)."""
        ...


@runtime_checkable
class Admitting(Protocol):
    """Actions that wait in a side before any pool (the CPU binding: the first actions of
    trajectories no node holds yet, and environments that start at open): the side admits
    them into pools before every pass, while some wait."""

    #: something waits: a plain attribute the side keeps, read before every pass, so a
    #: pass while nothing waits runs none of the side's code (a GPU action's walk stays
    #: out of the CPU side)
    waiting: bool

    def queue_fresh(self, fresh: list[Action], now: float,
                    touched: dict[PoolPoints, list[Action]]) -> None:
        """Take ``fresh``, actions submitted at ``now`` that the policy routed to no pool
        (their trajectory is not placed yet); those it queues in a pool at once are added
        to ``touched``."""
        ...

    def bind_waiting(self, touched: dict[str, None]) -> None:
        """Before a pass: queue what waits and now fits in its pools, adding their names to
        ``touched``."""
        ...

    def withdraw(self, pending: Pending) -> bool:
        """Take a cancelled ``pending`` out (False: it does not wait here)."""
        ...

    def why_queued(self, p: Pending, state: TrajectoryState) -> str:
        """Why the queued ``p`` waits, when it waits here ("" when it does not)."""
        ...

    def waiting_counts(self) -> tuple[int, int]:
        """For the snapshot: what waits here (trajectories and actions), and of those the
        actions alone."""
        ...

    def queue_view(self) -> QueueView:
        """What waits here, as the snapshot shows a queue."""
        ...


@runtime_checkable
class Observing(Protocol):
    """A node's free memory observed by its backend (MemoryObserved): the side admitting
    trajectories by memory goes by it, and may reclaim idle ones for waiting ones."""

    def memory_observed(self, node: str, free_gb: float, idle_after_s: float, now: float,
                        schedule: Callable[[], list[Effect]]) -> list[Effect]:
        """The effects (reclaims, what a pass started: ``schedule`` runs every pool's);
        raises KeyError/ValueError naming the field for an unknown node or a bad figure."""
        ...


@runtime_checkable
class Locating(Protocol):
    """Where a trajectory runs and how busy a node is: the point queries and the views."""

    def node_of(self, trajectory: str) -> str | None:
        """The node ``trajectory`` is bound to (None: none of this side's)."""
        ...

    def placed_on(self, trajectory: str) -> str | None:
        """The node ``trajectory`` is bound to, else the one the side chose for it when it
        opened (a policy that places by image; None: neither, or none of this side's)."""
        ...

    def busy_fraction(self, node: str) -> float:
        """Fraction of ``node``'s units held exclusively (0.0: not this side's node)."""
        ...


@runtime_checkable
class Overstaying(Protocol):
    """Actions a pool starts on its own (a CPU node's light lane) that may overstay there:
    the core asks when the next one does and which pools have one due (``Overstay``)."""

    def lane_wakeup(self) -> float | None:
        """When the next such action overstays, unless it ends first (None: none runs)."""
        ...

    def overstayed(self, now: float) -> Sequence[PoolPoints]:
        """The pools with an action overstaying by ``now``."""
        ...

    def moved_off_lane(self) -> None:
        """Count one action moved off its lane (tangram/pool.py Books)."""
        ...
