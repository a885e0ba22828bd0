"""Pools: the units a scheduling pass runs on (paper 5.2: one pass per CPU node).

A pool owns a FIFO wait queue and knows, for its key resource, how to check
that a prefix of minimums fits the free resources *and their topology*, what
capacity the elastic group shares, which DP operator describes that topology,
and how to reserve and release the real units through its manager.

Extension points, named as kube-scheduler names its plugins (a policy builds its
pools from these; the core and the schedulers call nothing else). They are the
:class:`PoolPoints` protocol below; :class:`Pool` implements each with a default.

==================== ================================================================
``unit_choices``     PreFilter: the feasible unit counts of an action on this pool
``new_scratch``,     Filter: does the next candidate's minimum fit what is left
``fits_min``
``option_costs``     Score: what each feasible unit count costs the action now
``elastic_capacity`` the capacity the elastic group shares after the fixed ones
``free_units``       units free now (a pass stops when none is left)
``reserve``          Reserve: take the units (``None``: placement refused them)
``release``          Unreserve: give them back (idempotent)
``admit``,           an action joined the pool's queue(s) (a GPU pool learns request
``arrived``          rates); ``queues``: every queue an action may wait in
``take``,            actions left the queue: started (``take``), cancelled (``withdraw``),
``withdraw``,        their node left (``drain``)
``drain``
``started``,         an action started on / ended its lease (``running``: what is
``ended``            running, for the schedulers' expected ends)
``batch``            queued actions that ride on a granted lease (continuous batching)
``after_pass``       end of a scheduling pass (a GPU pool pre-restores while idle)
``next_wakeup``      when the pool wants a pass although nothing arrives or ends
``usage``            units in use, per resource, for utilisation sampling
``lane``             the pool's light lane (:class:`LightLane`), or None
==================== ================================================================

Ordering (QueueSort) is the scheduler's: ``Ordering`` in tangram/scheduler.py.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from tangram.arrange import CHUNK_SIZES, ChunkOperator, DPOperator, LinearOperator, take_chunk
from tangram.batching import DEFAULT_BATCHING, BatchModel
from tangram.managers.cpu import CpuManager, pick_domains
from tangram.managers.gpu import GpuLease, GpuManager
from tangram.model import Action, GpuPlan


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
    #: a GPU grant of the evict-on-execution manager: its residency plan
    plan: GpuPlan | None = None


@dataclass(frozen=True, slots=True)
class LaneSlot:
    """A place on a node's light lane (shared cores, no exclusive grant)."""

    action_id: str
    node: str


class LightLane(Protocol):
    """A node's light lane (see :class:`CpuNodePool`): light actions wait in ``light``
    and start on shared cores while fewer than ``lane_slots`` run there."""

    light: deque[Pending]
    #: actions expected to take at most this long (s) may use the lane (0: no lane)
    light_s: float
    lane_slots: int

    def lane_reserve(self, p: Pending) -> Grant | None: ...

    def reserve(self, p: Pending, units: int, now: float) -> Grant | None: ...


class PoolPoints(Protocol):
    """The extension points a pool offers the core and the schedulers."""

    name: str
    key: str | None
    scheduler: Any
    queue: deque[Pending]
    running: dict[str, tuple[float, int, float]]
    lane: LightLane | None

    def admit(self, p: Pending) -> None: ...
    def arrived(self, p: Pending, now: float) -> None: ...
    def queues(self) -> tuple[deque[Pending], ...]: ...
    def take(self, started: list[Pending]) -> None: ...
    def withdraw(self, p: Pending) -> bool: ...
    def drain(self) -> list[Pending]: ...
    def unit_choices(self, action: Action) -> tuple[int, ...]: ...
    def new_scratch(self) -> Any: ...
    def fits_min(self, scratch: Any, p: Pending) -> bool: ...
    def option_costs(self, p: Pending) -> dict[int, float]: ...
    def elastic_capacity(self, nonelastic: list[Pending]) -> Any: ...
    def free_units(self) -> int: ...
    def reserve(self, p: Pending, units: int, now: float) -> Grant | None: ...
    def release(self, part: Any) -> None: ...
    def started(self, action_id: str, end_s: float, units: int, now: float) -> None: ...
    def ended(self, action_id: str) -> None: ...
    def batch(self, p: Pending, units: int, now: float,
              estimates: Any) -> tuple[list[Pending], float | None]: ...
    def after_pass(self, now: float, estimates: Any) -> None: ...
    def next_wakeup(self, now: float) -> float | None: ...
    def usage(self) -> dict[str, float]: ...


class Pool:
    """Base: a pool with no key resource (API-only actions)."""

    key: str | None = None
    operator: DPOperator = LinearOperator()
    #: no light lane
    lane: LightLane | None = None

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

    def take(self, started: list[Pending]) -> None:
        """``started`` (granted by a pass) leave the queue."""
        queue = self.queue
        ids = {id(p) for p in started}
        while queue and id(queue[0]) in ids:  # dispatches are mostly a queue prefix
            ids.discard(id(queue.popleft()))
        for p in started:
            if id(p) in ids:
                queue.remove(p)

    def withdraw(self, p: Pending) -> bool:
        """Take a cancelled ``p`` off whichever queue holds it (False: none does)."""
        for q in self.queues():
            if p in q:
                q.remove(p)
                return True
        return False

    def drain(self) -> list[Pending]:
        """The pool's capacity left (its node did): empty its queues, returning what
        waited there."""
        waiting = [p for q in self.queues() for p in q]
        for q in self.queues():
            q.clear()
        return waiting

    def started(self, action_id: str, end_s: float, units: int, now: float) -> None:
        """``action_id`` started on ``units``, expected to end at ``end_s``."""
        self.running[action_id] = (end_s, units, now)

    def ended(self, action_id: str) -> None:
        self.running.pop(action_id, None)

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

    def arrived(self, p: Pending, now: float) -> None:
        return None

    def batch(self, p: Pending, units: int, now: float,
              estimates: Any) -> tuple[list[Pending], float | None]:
        """Queued actions (taken off the queue) that ``p``'s lease of ``units`` also
        serves, and the batch's expected time; ([], None): ``p`` runs alone."""
        return [], None

    def after_pass(self, now: float, estimates: Any) -> None:
        return None

    def next_wakeup(self, now: float) -> float | None:
        """When this pool wants a pass although nothing arrives or ends (None: never)."""
        return None


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

    @property
    def lane(self) -> LightLane | None:  # type: ignore[override]
        """The node's light lane: this pool itself (it holds the lane's queue and slots)."""
        return self

    def admit(self, p: Pending) -> None:
        (self.light if p.light and self.lane_slots else self.queue).append(p)

    def queues(self) -> tuple[deque[Pending], ...]:
        return (self.queue, self.light)

    def drain(self) -> list[Pending]:
        self.lane_slots = 0  # no capacity left to report
        return super().drain()

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


def accepts(p: Pending) -> tuple[int, ...]:
    """The GPU counts ``p`` may run on (a non-elastic request: its one amount)."""
    return p.choices or (p.key_min,)


def solo_s(p: Pending, units: int, estimates: Any) -> float:
    """Expected time of ``p`` alone on ``units`` GPUs."""
    d = p.durations.get(units)
    return d if d is not None else estimates.duration(p.action, units, p.durations)


def work_s(p: Pending, estimates: Any) -> float:
    """One-GPU seconds of ``p`` (what a batch's token budget counts)."""
    if p.action.t1_s is not None:
        return p.action.t1_s
    return solo_s(p, p.key_min, estimates) * p.key_min


def take_riders(queue: deque[Pending], lead: Pending, units: int, estimates: Any,
                batching: BatchModel, limit: int | None = None) -> list[Pending]:
    """Queued requests of ``lead``'s service that join its batch, in queue order, while
    the batch's token budget admits them (no quota-holding action rides: its quota is
    reserved with its own lease)."""
    service = lead.action.service
    work, riders = work_s(lead, estimates), []
    for q in queue:
        if limit is not None and len(riders) >= limit:
            break
        if q.action.service != service or q.quotas or units not in accepts(q):
            continue
        w = work_s(q, estimates)
        if not batching.admits(work, w, 1 + len(riders)):
            break
        work += w
        riders.append(q)
    for r in riders:
        queue.remove(r)
    return riders


def batch_expected(lead: Pending, riders: list[Pending], units: int, estimates: Any,
                   batching: BatchModel) -> float:
    return batching.batch_s([solo_s(q, units, estimates) for q in (lead, *riders)])


def _first(pair: tuple) -> Any:
    return pair[0]


class ServiceDemand:
    """Observed request rate of each GPU service: one-GPU seconds requested, decayed
    exponentially with time constant ``tau_s`` (what the next minutes will likely ask)."""

    def __init__(self, tau_s: float = 120.0) -> None:
        self.tau_s = tau_s
        self._value: dict[str, float] = {}
        self._at: dict[str, float] = {}
        #: shares until the next add (decay scales every service alike: it does not
        #: change shares, only adds do)
        self._shares: dict[tuple[str, ...], dict[str, float]] = {}

    def add(self, service: str, work: float, now: float) -> None:
        self._value[service] = self.value(service, now) + work
        self._at[service] = now
        self._shares.clear()

    def value(self, service: str, now: float) -> float:
        v = self._value.get(service, 0.0)
        if v and now > self._at[service]:
            v *= math.exp(-(now - self._at[service]) / self.tau_s)
        return v

    def shares(self, services: list[str], now: float) -> dict[str, float]:
        """Each service's share of the demand (equal before anything was observed)."""
        key = tuple(services)
        cached = self._shares.get(key)
        if cached is not None:
            return cached
        vals = {s: self.value(s, now) for s in services}
        total = sum(vals.values())
        if total <= 0:
            out = {s: 1.0 / len(services) for s in services} if services else {}
        else:
            out = {s: v / total for s, v in vals.items()}
        self._shares[key] = out
        return out


class GpuPool(Pool):
    """All GPU services on one pool of aligned chunks (evict-on-execution).

    The scheduler's decisions are placed by the manager's smallest-chunk rule and a
    granted request takes the queued requests of its service that fit its batch
    (``tangram-paper``, serverless). :class:`EoeGpuPool` (the ``tangram`` policy) adds
    the burst-proof rules of tangram/eoe.py.
    """

    key = "gpu"
    operator = ChunkOperator()

    def __init__(self, name: str, manager: GpuManager, scheduler: Any = None,
                 batching: BatchModel = DEFAULT_BATCHING) -> None:
        super().__init__(name, scheduler)
        self.manager = manager
        self.batching = batching
        self.demand = ServiceDemand()
        #: service -> the GPU counts its latest request accepted
        self.accepted: dict[str, tuple[int, ...]] = {}
        self.total_gpus = sum(n.spec.gpus for n in manager.nodes.values())

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

    # -- requests and batches -----------------------------------------------------------
    def arrived(self, p: Pending, now: float) -> None:
        service = p.action.service or ""
        self.demand.add(service, work_s(p, None) if p.action.t1_s is not None else 1.0, now)
        self.accepted[service] = accepts(p)

    def reserve(self, p: Pending, units: int, now: float) -> Grant | None:
        lease = self.manager.reserve(p.action.id, p.action.service or "", units, now)
        return None if lease is None else self._grant(lease)

    @staticmethod
    def _grant(lease: GpuLease) -> Grant:
        return Grant(lease, lease.node, gpus=lease.gpus, restore_s=lease.restore_s,
                     plan=lease.plan)

    def batch(self, p: Pending, units: int, now: float,
              estimates: Any) -> tuple[list[Pending], float | None]:
        riders = take_riders(self.queue, p, units, estimates, self.batching)
        return self._batch(p, riders, units, estimates)

    def _batch(self, p: Pending, riders: list[Pending], units: int,
               estimates: Any) -> tuple[list[Pending], float | None]:
        if not riders:
            return [], None
        return riders, batch_expected(p, riders, units, estimates, self.batching)

    def release(self, part: Any) -> None:
        self.manager.release(part)

    def usage(self) -> dict[str, float]:
        return {"gpu": float(self.manager.busy_gpus())}


class EoeGpuPool(GpuPool):
    """The ``tangram`` policy's GPU pool and the state of its scheduler,
    :class:`tangram.eoe.EoeScheduler`: it keeps each service's queue in order
    (``waiting``), lets the scheduler place whole batches on chosen chunks
    (``plan_batch``), remembers the requests that wait by choice for a busy variant of
    their own (``defer``), learns request rates and pre-restores while GPUs are idle
    (when the backend carries pre-restores out)."""

    def __init__(self, name: str, manager: GpuManager, scheduler: Any,
                 batching: BatchModel = DEFAULT_BATCHING) -> None:
        super().__init__(name, manager, scheduler, batching)
        #: service -> its queued requests in arrival order (lazily pruned)
        self.waiting: dict[str, deque[Pending]] = {}
        self._queued: set[int] = set()
        #: arrival order of the waiting requests (ties of submit time break by it)
        self._seq: dict[int, int] = {}
        self._arrivals = 0
        self._count: dict[str, int] = {}
        #: when a request waiting by choice for its own busy variant stops waiting
        self.wake_at: float | None = None
        #: requests waiting by choice -> when they first chose to
        self.deferred: dict[int, float] = {}
        #: lease, riders and lead the EOE scheduler planned, by lead action id
        self._planned: dict[str, tuple[GpuLease, list[Pending], Pending]] = {}

    def arrived(self, p: Pending, now: float) -> None:
        super().arrived(p, now)
        service = p.action.service or ""
        self.waiting.setdefault(service, deque()).append(p)
        self._queued.add(id(p))
        self._seq[id(p)] = self._arrivals
        self._arrivals += 1
        self._count[service] = self._count.get(service, 0) + 1

    def groups(self) -> list[deque[Pending]]:
        """Each service's waiting requests (oldest first), services ordered by their
        oldest request: restore-aware ordering serves a service's queue together."""
        if len(self._queued) != len(self.queue):  # a cancel took some off the queue
            alive = {id(p) for p in self.queue}
            self._queued &= alive
            self._seq = {k: v for k, v in self._seq.items() if k in alive}
            self.deferred = {k: v for k, v in self.deferred.items() if k in alive}
            for service, q in self.waiting.items():
                kept = [p for p in q if id(p) in alive]
                q.clear()
                q.extend(kept)
                self._count[service] = len(kept)
        out = []
        queued, seq = self._queued, self._seq
        for q in self.waiting.values():
            while q and id(q[0]) not in queued:
                q.popleft()
            if q:
                out.append(((q[0].submit_s, seq.get(id(q[0]), 0)), q))
        out.sort(key=_first)
        return [q for _, q in out]

    def is_waiting(self, p: Pending) -> bool:
        return id(p) in self._queued

    def waiting_count(self, service: str) -> int:
        return self._count.get(service, 0)

    def plan_batch(self, lead: Pending, lease: GpuLease, riders: list[Pending]) -> None:
        """The EOE scheduler placed ``lead`` (and ``riders``) on ``lease``."""
        self._planned[lead.action.id] = (lease, riders, lead)
        service = lead.action.service or ""
        self._count[service] -= 1 + len(riders)
        self._queued.discard(id(lead))
        self._seq.pop(id(lead), None)
        self.deferred.pop(id(lead), None)
        for r in riders:
            self._queued.discard(id(r))
            self._seq.pop(id(r), None)
            self.deferred.pop(id(r), None)

    def reserve(self, p: Pending, units: int, now: float) -> Grant | None:
        planned = self._planned.get(p.action.id)
        if planned is not None:
            return self._grant(planned[0])
        return super().reserve(p, units, now)

    def batch(self, p: Pending, units: int, now: float,
              estimates: Any) -> tuple[list[Pending], float | None]:
        planned = self._planned.pop(p.action.id, None)
        if planned is None:
            return super().batch(p, units, now, estimates)
        riders = planned[1]
        for r in riders:
            self.queue.remove(r)
        return self._batch(p, riders, units, estimates)

    def release(self, part: Any) -> None:
        planned = self._planned.pop(part.action_id, None)
        if planned is not None:  # planned but not started (its quota was refused): the
            # core left the lead queued, and its riders never left the queue
            for q in (*planned[1], planned[2]):
                self._queued.add(id(q))
            service = planned[2].action.service or ""
            self._count[service] += 1 + len(planned[1])
        super().release(part)

    def next_wakeup(self, now: float) -> float | None:
        if self.wake_at is not None and (self.wake_at <= now or not self.queue):
            self.wake_at = None
        return self.wake_at

    # -- requests waiting by choice for a busy variant of their own -----------------------
    def new_pass(self) -> None:
        """A pass starts: it decides afresh who waits by choice, and until when."""
        self.wake_at = None

    def deferred_since(self, p: Pending, now: float) -> float:
        """When ``p`` first chose to wait for a busy variant of its own (``now``: never)."""
        return self.deferred.get(id(p), now)

    def defer(self, p: Pending, since: float, until: float) -> None:
        """``p`` waits by choice, since ``since``, at most until ``until`` (a pass then)."""
        self.deferred[id(p)] = since
        if self.wake_at is None or until < self.wake_at:
            self.wake_at = until

    def after_pass(self, now: float, estimates: Any) -> None:
        if self.manager.prerestore_ok:
            self.scheduler.prerestore(self, now, estimates)
