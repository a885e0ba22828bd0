"""What every pool is: the units a scheduling pass runs on (paper 5.2: one pass per CPU
node), the queued action (:class:`Pending`), a grant, the extension points
(:class:`PoolPoints`, made of one protocol per point every pool implements:
:class:`Queueing`, :class:`Filtering`, :class:`Reserving`; the optional ones a pool
implements only if it uses them, checked with isinstance: :class:`Batching`,
:class:`AfterPass`, :class:`Waking`, :class:`Resizable`, :class:`LightLane`) and their
defaults (:class:`Pool`, a pool with no key resource: API-only actions). The pools
themselves live by resource: ``tangram/cpu/pool.py`` (a CPU node with its light lane),
``tangram/cpu/pods.py`` (Kubernetes), ``tangram/gpu/pool.py`` (evict-on-execution; its
scheduler in ``eoe.py``), ``tangram/gpu/static.py`` (fixed deployments),
``tangram/gpu/cold.py`` (serverless).

A pool owns a FIFO wait queue and knows, for its key resource, how to check
that a prefix of minimums fits the free resources *and their topology*, what
capacity the elastic group shares, which DP operator describes that topology,
and how to reserve and release the real units through its manager.

Extension points, named as kube-scheduler names its plugins (a policy builds its
pools from these; the core and the schedulers call nothing else). The first ones are the
:class:`PoolPoints` protocol (below), :class:`Pool` implementing each with a default; the
ones marked *optional* are protocols of their own that a pool implements only if it uses
them (the core asks ``isinstance`` once, never at every pass).

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
``usage``            units in use, per resource, for utilisation sampling
``batch``            *optional* (:class:`Batching`): queued actions that ride on a
                     granted lease (continuous batching)
``after_pass``       *optional* (:class:`AfterPass`): end of a scheduling pass (a static
                     GPU pool deploys its replicas)
``next_wakeup``      *optional* (:class:`Waking`): when the pool wants a pass although
                     nothing arrives or ends
``share``, ``begin`` *optional* (:class:`Resizable`): running grants that grow and shrink
                     (a malleable CPU node)
``light``, ``run``   *optional* (:class:`LightLane`): a light lane, its queue and its own
                     starts before each pass (a CPU node)
==================== ================================================================

Ordering (QueueSort) is the scheduler's: ``Ordering`` in tangram/scheduler.py.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from itertools import repeat
from operator import add, itemgetter
from typing import Any, Protocol, TypeVar, runtime_checkable

from tangram.api.quota import QuotaManager
from tangram.arrange import DPOperator, LinearOperator
from tangram.estimates import DurationModel, Estimates
from tangram.model import Action, Elasticity, GpuPlan, Pending, slot_init
from tangram.protocol import Effect


@slot_init
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


@slot_init
@dataclass(frozen=True, slots=True)
class LaneSlot:
    """A place on a node's light lane (shared cores, no exclusive grant)."""

    action_id: str
    node: str


@dataclass(frozen=True, slots=True)
class Books:
    """The core's books that a pool's own starts (outside its scheduler's plan: a CPU node's
    light lane) write in: the queued and the running actions by id, what the core learns,
    and its count of actions moved off a lane."""

    queued: dict[str, Pending]
    running: dict[str, Pending]
    estimates: Estimates
    moved_off_lane: Callable[[], None]


class PoolScheduler(Protocol):
    """What the core asks of a pool's scheduler (tangram/scheduler.py ElasticScheduler and
    its kinds): a pass's plan, and what it reads of an action when it is queued."""

    #: an elastic action may get more than its minimum
    elastic_enabled: bool

    def plan(self, pool: PoolPoints, now: float, estimates: Estimates,
             quota: QuotaManager) -> list[tuple[Pending, int]]: ...
    def min_units(self, choices: tuple[int, ...]) -> int: ...
    def profile(self, action: Action, choices: tuple[int, ...],
                estimates: Estimates) -> dict[int, float]: ...
    def declared_profile(self, action: Action,
                         estimates: Estimates) -> tuple[Elasticity, float] | None: ...


#: a scheduling pass's own state for the Filter point (``new_scratch``/``fits_min``: what
#: is left of the pool's free units, in its topology), the capacity the elastic group
#: shares (``elastic_capacity``), and what a pool holds per lease (``Grant.part``): each
#: pool's own type (a CPU node: free cores per NUMA domain; the GPU pool: chunk counts)
Scratch = TypeVar("Scratch")
Capacity = TypeVar("Capacity", covariant=True)
Part = TypeVar("Part", contravariant=True)


class Queueing(Protocol):
    """The pool's wait queue(s): an action joins (``admit``, ``admit_many``; ``arrived``: a
    GPU pool learns request rates) and leaves (``take``: started, ``withdraw``: cancelled,
    ``drain``: its node left)."""

    queue: deque[Pending]

    def admit(self, p: Pending) -> None: ...
    def arrived(self, p: Pending, now: float) -> None: ...
    def admit_many(self, ps: list[Pending], now: float) -> None: ...
    def queues(self) -> tuple[deque[Pending], ...]: ...
    def take(self, started: list[Pending]) -> None: ...
    def withdraw(self, p: Pending) -> bool: ...
    def drain(self) -> list[Pending]: ...


class Filtering(Protocol[Scratch, Capacity]):
    """PreFilter (``unit_choices``), Filter (``new_scratch``, ``fits_min``: a pass's own
    state, one per pass), Score (``option_costs``), and what the elastic group shares."""

    def unit_choices(self, action: Action) -> tuple[int, ...]: ...
    def new_scratch(self) -> Scratch: ...
    def fits_min(self, scratch: Scratch, p: Pending) -> bool: ...
    def option_costs(self, p: Pending) -> dict[int, float]: ...
    def elastic_capacity(self, nonelastic: list[Pending]) -> Capacity: ...
    def free_units(self) -> int: ...


class Reserving(Protocol[Part]):
    """Reserve and Unreserve, and what runs on the pool (for the expected ends)."""

    running: dict[str, tuple[float, int, float]]

    def reserve(self, p: Pending, units: int, now: float) -> Grant | None: ...
    def release(self, part: Part) -> None: ...
    def started(self, action_id: str, end_s: float, units: int, now: float) -> None: ...
    def ended(self, action_id: str) -> None: ...
    def expected_ends(self, now: float) -> list[tuple[float, int]]: ...


# The optional points: a pool implements those it uses, and the core asks
# ``isinstance(pool, Batching)`` (kube-scheduler plugins: a plugin registers the points it
# implements). A pool that implements none runs alone, does nothing after a pass and
# wants no pass of its own.
@runtime_checkable
class Batching(Protocol):
    """Continuous batching: queued actions that ride on a granted lease."""

    def batch(self, p: Pending, units: int, now: float,
              estimates: Estimates) -> tuple[list[Pending], float | None]:
        """Queued actions (taken off the queue) that ``p``'s lease of ``units`` also
        serves, and the batch's expected time; ([], None): ``p`` runs alone."""
        ...


@runtime_checkable
class AfterPass(Protocol):
    """The end of a pass (a static GPU pool deploys its replicas)."""

    def after_pass(self, now: float, estimates: Estimates) -> None: ...


@runtime_checkable
class Resizable(Protocol):
    """A pool whose running grants change size while they run (tangram/cpu/malleable.py):
    they share its units with the queue before each plan, and it chooses each
    started action's worker count. ``grows``: whether it does so now
    (only while the backend carries resizes out)."""

    grows: bool

    def share(self, now: float, books: Books) -> list[Effect]:
        """Before each plan, and once the queue is empty: the running grants and the
        queue's heads share the idle units (a grant grows onto one where that lowers the
        objective more than starting the head would) and grants shrink to admit a head
        where that pays. The Resized effects ([] if none)."""
        ...

    def begin(self, p: Pending, units: int, now: float) -> int:
        """``p`` starts on ``units``: the workers its command starts (0: its units)."""
        ...

    def cores_of(self, action_id: str) -> tuple[int, ...] | None:
        """The cores a running grant holds now, if it was resized (None: as it started)."""
        ...

    def closing(self, action_id: str, units: int, now: float) -> int:
        """``action_id`` (started on ``units``) ended well at ``now``: the units its run
        should be observed at (its width over its run), before the pool forgets it."""
        ...


#: (pool class, optional point) -> whether the class implements it, asked once per class:
#: an isinstance against a runtime-checkable Protocol walks the class's attributes every
#: time (~14 us), and the core asks at every pass, every queued batch and every finish. A
#: pool's members are set in its ``__init__``, so every instance of a class answers alike
#: (a pool joining later is of a class seen or asked then).
_IMPLEMENTS: dict[tuple[type, type], bool] = {}


def _point(pool: object, point: type) -> Any:
    key = (type(pool), point)
    got = _IMPLEMENTS.get(key)
    if got is None:
        got = _IMPLEMENTS[key] = isinstance(pool, point)
    return pool if got else None


def resizable(pool: object) -> Resizable | None:
    """``pool`` if its grants resize (:class:`Resizable`), else None."""
    return _point(pool, Resizable)


@runtime_checkable
class Waking(Protocol):
    """A pool that wants a pass although nothing arrives or ends (a GPU request stops
    waiting by choice)."""

    def next_wakeup(self, now: float) -> float | None:
        """When (None: not now)."""
        ...


@runtime_checkable
class LightLane(Protocol):
    """A node's light lane (see tangram/cpu/pool.py CpuNodePool), as the core sees it:
    light actions wait in ``light`` and start on shared cores (``run``, before the node's
    passes, which also moves actions that overstay the lane off it). A pool without one
    queues every action in ``queue`` and starts nothing outside its scheduler's plan."""

    light: deque[Pending]
    #: actions expected to take at most this long (s) may use the lane (0: no lane)
    light_s: float
    lane_slots: int

    def run(self, now: float, books: Books) -> list[Effect]:
        """The lane's starts and moves at ``now``, before the node's scheduling passes."""
        ...

    def lane_wakeup(self) -> float | None:
        """When the next action on the lane overstays (None: none runs there)."""
        ...

    def due(self, now: float) -> bool:
        """An action on the lane overstays it by ``now`` (an ``Overstay`` is for it)."""
        ...

    def light_test(self, durations: DurationModel
                   ) -> Callable[[Action, int, Mapping[str, float]], bool]:
        """Which actions of a batch queued at once are light (tangram/cpu/lane.py)."""
        ...


def light_lane(pool: object) -> LightLane | None:
    """``pool`` if it has a light lane (:class:`LightLane`), else None."""
    return _point(pool, LightLane)


class PoolPoints(Queueing, Filtering[object, object], Reserving[object], Protocol):
    """The extension points every pool implements, as the core and the schedulers see any
    pool (each pool's own Scratch, Capacity and Part: ``object`` here, where pools of every
    kind meet; the optional points: :class:`Batching`, :class:`AfterPass`,
    :class:`Resizable`, :class:`Waking`, :class:`LightLane`)."""

    name: str
    key: str | None
    scheduler: PoolScheduler | None

    def usage(self) -> dict[str, float]: ...


def by_pool(actions: list[Action], pools: list[PoolPoints | None]
            ) -> tuple[dict[PoolPoints, list[Action]], list[Action]]:
    """``actions`` by the pool each was routed to, in order, the pools in the order first
    routed to (the order of their passes: ``Tangram._schedule``); and those routed to none
    (not bound to a node yet)."""
    if pools and pools.count(pools[0]) == len(pools):  # (mostly: one pool, a C loop)
        one = pools[0]
        return ({}, actions) if one is None else ({one: actions}, [])
    groups: dict[PoolPoints, list[Action]] = {}
    fresh: list[Action] = []
    for action, pool in zip(actions, pools, strict=True):
        if pool is None:
            fresh.append(action)
            continue
        group = groups.get(pool)
        if group is None:
            groups[pool] = [action]
        else:
            group.append(action)
    return groups, fresh


#: an overdue entry's start, negated, and its units (``Pool._overdue_sorted``'s)
_NEG_START, _UNITS = itemgetter(0), itemgetter(1)


def _remove(ordered: list[tuple[float, int]], entry: tuple[float, int]) -> None:
    """Take one ``entry`` out of the sorted list ``ordered`` (it holds it)."""
    del ordered[bisect_left(ordered, entry)]


class Pool:
    """Base: a pool with no key resource (API-only actions)."""

    key: str | None = None
    operator: DPOperator = LinearOperator()

    def __init__(self, name: str, scheduler: PoolScheduler | None = None) -> None:
        self.name = name
        #: a pool-specific scheduler (a baseline's fixed DoP); None: the policy's
        self.scheduler = scheduler
        self.queue: deque[Pending] = deque()
        #: action id -> (expected end, units of the key resource, start)
        self.running: dict[str, tuple[float, int, float]] = {}
        # expected_ends, kept incrementally once first asked (None until then: a pool whose
        # scheduler never asks pays nothing): the running actions not past their expected
        # end as of the last call, (end, units), by id and as one sorted list; those past
        # it, as ``running`` has them; a heap of (end, id) of the former (lazily pruned)
        # that finds who went past; and the last answer, while nothing started or ended
        # (a pass asks twice: the width caps and the objective)
        self._ahead: dict[str, tuple[float, int]] = {}
        self._ahead_sorted: list[tuple[float, int]] = []
        self._overdue: dict[str, tuple[float, int, float]] = {}
        #: the same, as (-start, units), sorted: in order of the end they are expected at
        #: (``now + (now - start)``), so a pass's answer is two sorted runs to merge, not
        #: a run and hundreds of entries in no order to sort in
        self._overdue_sorted: list[tuple[float, int]] = []
        #: the latest expected end among those moved to ``_overdue`` (from a ``now`` on,
        #: every one of them is past its end)
        self._overdue_end = float("-inf")
        self._by_end: list[tuple[float, str]] | None = None
        self._last_ends: tuple[float, list[tuple[float, int]]] | None = None

    def admit(self, p: Pending) -> None:
        """Queue ``p`` (a pool may keep some actions in a queue of their own)."""
        self.queue.append(p)

    def admit_many(self, ps: list[Pending], now: float) -> None:
        """``ps``, in order, arrived at ``now``: ``admit`` then ``arrived`` each (a pool
        may do it in one loop: a burst queues thousands)."""
        admit, arrived = self.admit, self.arrived
        for p in ps:
            admit(p)
            arrived(p, now)

    def queues(self) -> tuple[deque[Pending], ...]:
        """Every queue an action of this pool may wait in."""
        return (self.queue,)

    def take(self, started: list[Pending]) -> None:
        """``started`` (granted by a pass) leave the queue."""
        queue = self.queue
        if len(started) == 1:  # (most passes start one)
            p = started[0]
            if queue and queue[0] is p:
                queue.popleft()
            else:
                queue.remove(p)
            return
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
        by_end = self._by_end
        if by_end is None:
            return
        # (started again, as a lane action that booked a core: its entry replaced)
        old = self._ahead.pop(action_id, None)
        if old is not None:
            _remove(self._ahead_sorted, old)
        held = old is not None or self._drop_overdue(action_id)
        if held or units:  # (what the expected ends hold changed)
            self._last_ends = None
        if not units:  # (a light lane's action frees none when it ends: the walks skip it)
            return
        entry = (end_s, units)
        self._ahead[action_id] = entry
        insort(self._ahead_sorted, entry)
        heappush(by_end, (end_s, action_id))
        if len(by_end) > 2 * len(self.running) + 64:
            # entries of actions that ended before their expected end: drop them (a
            # pool whose scheduler rarely asks would otherwise grow the heap forever)
            by_end[:] = [(e, aid) for aid, (e, _) in self._ahead.items()]
            heapify(by_end)

    def ended(self, action_id: str) -> None:
        if self.running.pop(action_id, None) is not None and self._by_end is not None:
            self._last_ends = None
            entry = self._ahead.pop(action_id, None)
            if entry is None:
                self._drop_overdue(action_id)
            else:
                _remove(self._ahead_sorted, entry)

    def _drop_overdue(self, action_id: str) -> bool:
        """Take ``action_id`` out of those past their expected end (False: not there)."""
        entry = self._overdue.pop(action_id, None)
        if entry is None:
            return False
        _remove(self._overdue_sorted, (-entry[2], entry[1]))
        return True

    def expected_ends(self, now: float) -> list[tuple[float, int]]:
        """(expected end, units) of every running action holding units, for the schedulers'
        objective, sorted (a new list: the caller's to change). An action past its expected end is
        expected to run as long again as it has so far (heavy tails), not to finish this
        instant. Kept incrementally: a pass is not an O(running) Python loop (a 256-core
        node runs hundreds), only those past their end are computed again."""
        last = self._last_ends
        if last is not None and last[0] == now:
            return last[1].copy()
        by_end, ahead, overdue = self._by_end, self._ahead, self._overdue
        if by_end is None:  # first asked: from now on kept by started/ended
            for aid, (end, units, _) in self.running.items():
                if units:  # (one on a light lane frees none when it ends)
                    ahead[aid] = (end, units)
            by_end = self._by_end = [(end, aid) for aid, (end, _) in ahead.items()]
            heapify(by_end)
            self._ahead_sorted = sorted(ahead.values())
        while by_end and by_end[0][0] <= now:  # reached their expected end since
            end, aid = heappop(by_end)
            got = ahead.get(aid)
            if got is not None and got[0] == end:  # (else: ended, a stale entry)
                del ahead[aid]
                _remove(self._ahead_sorted, got)
                entry = overdue[aid] = self.running[aid]
                insort(self._overdue_sorted, (-entry[2], entry[1]))
                if end > self._overdue_end:
                    self._overdue_end = end
        out = self._ahead_sorted.copy()
        if overdue:
            if now >= self._overdue_end:  # (as ever, time going forward)
                # each ``now + (now - start)`` (``now - start`` is ``now + -start`` to the
                # bit), in C loops: a saturated node holds hundreds past their end, and every
                # pass at a new time computes them again
                ordered = self._overdue_sorted
                out.extend(zip(map(add, repeat(now), map(add, repeat(now),
                                                         map(_NEG_START, ordered))),
                               map(_UNITS, ordered), strict=True))
            else:  # (also right if ``now`` went back: the same rule as for one not yet moved)
                out += [(end if end > now else now + (now - start), units)
                        for end, units, start in overdue.values()]
            out.sort()  # (two sorted runs, above: a merge)
        self._last_ends = (now, out)
        return out.copy()

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

