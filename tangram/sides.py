"""What a resource side (the CPU nodes, tangram/cpu/nodes.py; the GPU nodes,
tangram/gpu/nodes.py) does for the core besides its pools, as the core sees any side: one
small protocol per point, a side implementing the points it uses (kube-scheduler plugin
style: the core asks isinstance, once at construction, for a point a side may lack: only
the GPU side owes effects, :class:`Owing`). The core calls these and
names no resource: it never reads a manager of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tangram.cluster import CpuNodeSpec, GpuNodeSpec
from tangram.model import Action, Outcome
from tangram.pool import PoolPoints
from tangram.protocol import Capabilities, Effect
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
    """Effects a side decided outside any dispatch (the GPU pre-restores), carried out
    after every command."""

    def owed(self, out: list[Effect]) -> None:
        """Append what is owed to ``out`` (and owe it no more)."""
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
