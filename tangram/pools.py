"""Pools: the units a scheduling pass runs on (paper 5.2: one pass per CPU node).

A pool owns a FIFO wait queue and knows, for its key resource, how to check
that a prefix of minimums fits the free resources *and their topology*, what
capacity the elastic group shares, which DP operator describes that topology,
and how to reserve and release the real units through its manager.

Extension points, named as kube-scheduler names its plugins (a policy builds its
pools from these; the core calls nothing else):

=================  =================================================================
``unit_choices``   PreFilter: the feasible unit counts of an action on this pool
``fits_min``       Filter: does the next candidate's minimum fit what is left
``option_costs``   Score: what each feasible unit count costs the action now
``elastic_capacity`` the capacity the elastic group shares after the fixed ones
``reserve``        Reserve: take the units (``None``: placement refused them)
``release``        Unreserve: give them back (idempotent)
``usage``          units in use, per resource, for utilisation sampling
=================  =================================================================

Ordering (QueueSort) is the scheduler's: ``Ordering`` in tangram/scheduler.py.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tangram.arrange import CHUNK_SIZES, ChunkOperator, DPOperator, LinearOperator, take_chunk
from tangram.managers.cpu import CpuManager, pick_domains
from tangram.managers.gpu import GpuManager
from tangram.model import Action


@dataclass(slots=True, eq=False)
class Pending:
    """A queued action with what the scheduler reads of it on every pass."""

    action: Action
    submit_s: float
    key_min: int  # minimum units of the pool's key resource
    quotas: dict[str, float] = field(default_factory=dict)
    elastic: bool = False  # schedulable elastic on this pool's key resource
    #: expected to be short enough for the pool's light lane (tangram/pools.py CpuNodePool)
    light: bool = False
    choices: tuple[int, ...] = ()
    #: modelled duration per feasible unit count (elastic actions only)
    durations: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Grant:
    part: Any
    node: str | None
    cores: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    restore_s: float = 0.0
    lane: bool = False


@dataclass(frozen=True, slots=True)
class LaneSlot:
    """A place on a node's light lane (shared cores, no exclusive grant)."""

    action_id: str
    node: str


class Pool:
    """Base: a pool with no key resource (API-only actions)."""

    key: str | None = None
    operator: DPOperator = LinearOperator()

    def __init__(self, name: str, scheduler: Any = None) -> None:
        self.name = name
        #: a pool-specific scheduler (a baseline's fixed DoP); None: the policy's
        self.scheduler = scheduler
        self.queue: deque[Pending] = deque()
        #: action id -> (expected end, units of the key resource, start)
        self.running: dict[str, tuple[float, int, float]] = {}

    def admit(self, p: Pending) -> None:
        """Queue ``p`` (a pool may keep some actions in a queue of their own)."""
        self.queue.append(p)

    def queues(self) -> tuple[deque[Pending], ...]:
        """Every queue an action of this pool may wait in."""
        return (self.queue,)

    def unit_choices(self, action: Action) -> tuple[int, ...]:
        return ()

    def new_scratch(self) -> Any:
        return None

    def option_costs(self, p: Pending) -> dict[int, float]:
        """What each feasible unit count would cost ``p`` now (its duration, plus any
        state-dependent overhead the pool knows of)."""
        return p.durations

    def fits_min(self, scratch: Any, p: Pending) -> bool:
        return True

    def elastic_capacity(self, nonelastic: list[Pending]) -> Any:
        return 0

    def free_units(self) -> int:
        return 1 << 30

    def reserve(self, p: Pending, units: int, now: float) -> Grant | None:
        return Grant(None, None)

    def release(self, part: Any) -> None:
        return None

    def usage(self) -> dict[str, float]:
        return {}


class CpuNodePool(Pool):
    """One CPU node (paper 5.2), with a light lane (beyond the paper).

    Head-of-line blocking: with exclusive cores, a 10 ms ``ls`` waits for a whole core
    behind test runs that hold them all for seconds. The lane lets an action the pool
    expects to be light (expected duration <= ``light_s``, from what was declared or
    observed of its (task, kind); no oracle) start at once on the node's cores *shared*
    with the exclusive actions, instead of waiting for a core of its own. It is bounded
    (``lane_slots`` light actions at a time), and backends run exclusive-core actions at
    nice 10 and lane actions at nice 0: under CFS's weights (1024 vs 110) a light action
    gets ~90% of the core it shares, so it is barely slowed, and the CPU time it takes
    from the exclusive actions is bounded by the lane's load. We chose a shared lane over
    headroom held back (a core kept idle for light actions wastes a core whenever none
    comes) and over fractional cores (a cgroup quota below one core slows the light
    action itself, the one we want to finish now).
    """

    key = "cpu"
    operator = LinearOperator()

    def __init__(self, name: str, node: str, manager: CpuManager, scheduler: Any = None,
                 light_s: float = 0.0, lane_slots: int = 0) -> None:
        super().__init__(name, scheduler)
        self.node = node
        self.manager = manager
        self.host = manager.nodes[node]
        #: actions expected to take at most this long (s) may use the lane (0: no lane)
        self.light_s = light_s
        self.lane_slots = lane_slots if light_s > 0 else 0
        self._lane: set[str] = set()
        self._all_cores = tuple(range(self.host.spec.cores))
        #: light actions wait here, for the lane (or an idle core), never behind the queue
        self.light: deque[Pending] = deque()

    def admit(self, p: Pending) -> None:
        (self.light if p.light and self.lane_slots else self.queue).append(p)

    def queues(self) -> tuple[deque[Pending], ...]:
        return (self.queue, self.light)

    def lane_reserve(self, p: Pending) -> Grant | None:
        """A lane place for ``p`` (None: the lane is full)."""
        if len(self._lane) >= self.lane_slots:
            return None
        self._lane.add(p.action.id)
        return Grant(LaneSlot(p.action.id, self.node), self.node, cores=self._all_cores,
                     lane=True)

    def unit_choices(self, action: Action) -> tuple[int, ...]:
        # elastic actions stay inside one NUMA domain
        cap = self.host.domain_size
        return tuple(int(c) for c in action.cost["cpu"].choices if c <= cap)

    def new_scratch(self) -> list[int]:
        return self.host.free_per_domain()

    def fits_min(self, scratch: list[int], p: Pending) -> bool:
        plan = pick_domains(scratch, p.key_min, p.elastic)
        if plan is None:
            return False
        for d, count in plan:
            scratch[d] -= count
        return True

    def elastic_capacity(self, nonelastic: list[Pending]) -> int:
        return self.host.free_cores - sum(p.key_min for p in nonelastic)

    def free_units(self) -> int:
        return self.host.free_cores

    def reserve(self, p: Pending, units: int, now: float) -> Grant | None:
        lease = self.manager.reserve(p.action.id, self.node, units, p.elastic)
        if lease is None:
            return None
        return Grant(lease, self.node, cores=lease.cores)

    def release(self, part: Any) -> None:
        if isinstance(part, LaneSlot):
            self._lane.discard(part.action_id)
            return
        self.manager.release(part)

    def usage(self) -> dict[str, float]:
        return {"cpu": float(self.manager.in_use(self.node)), "cpu_lane": float(len(self._lane))}


class GpuPool(Pool):
    key = "gpu"
    operator = ChunkOperator()

    def __init__(self, name: str, manager: GpuManager, scheduler: Any = None) -> None:
        super().__init__(name, scheduler)
        self.manager = manager

    def unit_choices(self, action: Action) -> tuple[int, ...]:
        return tuple(int(c) for c in action.cost["gpu"].choices
                     if c in CHUNK_SIZES and self.manager.check(action.service, int(c)) is None)

    def new_scratch(self) -> list[tuple[int, int, int, int]]:
        return [self.manager.chunk_counts()]

    def option_costs(self, p: Pending) -> dict[int, float]:
        # Beyond the paper: each DoP of a service is its own variant (EOE), so a DoP
        # whose variant is not resident on a free chunk also pays its restore.
        service = p.action.service or ""
        return {u: d + self.manager.restore_estimate(service, u) for u, d in p.durations.items()}

    def fits_min(self, scratch: list, p: Pending) -> bool:
        nxt = take_chunk(scratch[0], p.key_min)
        if nxt is None:
            return False
        scratch[0] = nxt
        return True

    def elastic_capacity(self, nonelastic: list[Pending]) -> tuple[int, int, int, int]:
        state = self.manager.chunk_counts()
        for p in sorted(nonelastic, key=lambda p: -p.key_min):
            state = take_chunk(state, p.key_min) or state
        return state

    def free_units(self) -> int:
        return self.manager.free_gpus()

    def reserve(self, p: Pending, units: int, now: float) -> Grant | None:
        lease = self.manager.reserve(p.action.id, p.action.service or "", units)
        if lease is None:
            return None
        return Grant(lease, lease.node, gpus=lease.gpus, restore_s=lease.restore_s)

    def release(self, part: Any) -> None:
        self.manager.release(part)

    def usage(self) -> dict[str, float]:
        return {"gpu": float(self.manager.busy_gpus())}
