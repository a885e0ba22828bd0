"""The core's state machine, generic over resource kinds: no clock, no I/O, no threads,
and no CPU or GPU class (``Tangram``, tangram/core.py, builds one from a policy's parts).

Drivers send commands (tangram/protocol.py: ``Submit``, ``Finish``, ``Poll``...) to
``handle`` with the current time and get back the effects to carry out (the dispatches to
start); they read the core through ``snapshot`` and the point queries. Nothing else of a
Tangram is public. The same object is driven by the SimPy clock
(sim/) and by the asyncio loop (executor/).

The policy (tangram/policies.py) builds the managers and pools and routes
each action to the pool whose queue it waits in (by default: GPU actions to
the GPU pool, CPU actions to their trajectory's node pool, a trajectory not yet
bound waiting in the binding queue first, API calls to the API pool). Counted
resources (``quota:*``, ``net_mbps``) are checked inside every pool's candidate
prefix and reserved with the action, all or nothing. What the core learns from
completions lives in :class:`tangram.estimates.Estimates`.

What a resource kind needs besides its pools (the binding of trajectories to CPU nodes,
the lanes' overstays, the GPU pre-restores, node membership...) lives in its sides
(tangram/sides.py): the core asks each point of the sides implementing it and names no
side, so a new resource kind plugs in its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from operator import attrgetter
from types import MappingProxyType
from typing import TypeVar

from tangram.api.quota import QuotaManager
from tangram.cluster import ClusterSpec
from tangram.estimates import Estimates, Speedup
from tangram.model import (
    NONE,
    Action,
    BatchMember,
    Demand,
    Dispatch,
    GpuPlan,
    Lease,
    Outcome,
    Pending,
    counted,
)
from tangram.pool import (
    AfterPass,
    Batching,
    Books,
    PoolPoints,
    PoolScheduler,
    Resizable,
    Waking,
    by_pool,
    light_lane,
    resizable,
)
from tangram.protocol import (
    Attach,
    Cancel,
    Cancelled,
    Close,
    Command,
    Effect,
    Finish,
    MemoryObserved,
    NodeJoined,
    NodeLost,
    Open,
    Overstay,
    Poll,
    QueueView,
    QuotaView,
    Snapshot,
    Stop,
    Submit,
    TrajectoryView,
    Waiting,
    WorkerLost,
)
from tangram.sides import (
    Admitting,
    Attaching,
    Check,
    Checking,
    Hosting,
    Learning,
    Locating,
    Membership,
    Observing,
    Overstaying,
    Owing,
    Reporting,
)
from tangram.trajectory import TrajectoryState

#: resources that are never counted (tangram.model.counted): the common case, decided
#: without a string test per submission
_UNCOUNTED = frozenset({"cpu", "gpu", "mem_gb", "gpu_mem_gb"})
_ID, _TRAJECTORY = attrgetter("id"), attrgetter("trajectory")
_P = TypeVar("_P")


def _implementing(sides: Iterable[object], point: type[_P]) -> tuple[_P, ...]:
    """The sides implementing ``point`` (a runtime-checkable protocol of tangram/sides.py),
    in order: asked once, at construction."""
    return tuple(side for side in sides if isinstance(side, point))  # type: ignore[misc]


def _quotas(cost: Mapping[str, Demand]) -> Mapping[str, float]:
    """The quotas an action of ``cost`` holds while it runs (NONE, shared, for most: they
    hold none)."""
    for res in cost:  # (a loop: cheaper than a set test for the usual one or two)
        if res not in _UNCOUNTED and counted(res):
            return {k: d.min for k, d in cost.items() if counted(k) and d.min > 0}
    return NONE


#: queue actions in a pool, submitted at a time (the machine's own ``_queue_many``)
QueueMany = Callable[[PoolPoints, list[Action], float], None]


@dataclass(frozen=True, slots=True)
class Parts:
    """What a machine is made of (tangram/assembly.py builds them from a policy and a
    cluster): typed by what the machine asks of them, so it imports no resource kind."""

    #: the policy's label (the snapshot's)
    label: str
    #: the scheduler of the pools that bring none of their own
    scheduler: PoolScheduler
    #: every pool by name: the machine's own dict (a joining node's pool is added to it)
    pools: dict[str, PoolPoints]
    quota: QuotaManager
    #: the pool each of a submission's actions waits in (None: routed to none yet, its
    #: trajectory not placed: an admitting side's)
    route_many: Callable[[list[Action]], list[PoolPoints | None]]
    #: the sides (tangram/sides.py) in the order each point asks them
    sides: tuple[object, ...]
    #: the sides whose counters, views and figures the snapshot shows, in the order of the
    #: utilisation columns
    reporting: tuple[object, ...]


#: builds a machine's parts over its trajectories and queued actions (which the sides
#: read), queuing through its ``_queue_many``
Build = Callable[[dict[str, TrajectoryState], dict[str, Pending], QueueMany], Parts]


class Machine:
    """The action-level resource manager's state machine, over the pools and sides its
    ``build`` makes (``Tangram`` is the one the door names)."""

    def __init__(self, cluster: ClusterSpec, build: Build,
                 estimates: Estimates | None = None) -> None:
        self._cluster = cluster
        self._estimates = estimates or Estimates()
        self._trajectories: dict[str, TrajectoryState] = {}
        self._queued: dict[str, Pending] = {}
        #: started actions: their Pendings, with the dispatch, pool and batch set on them
        self._running: dict[str, Pending] = {}
        parts = build(self._trajectories, self._queued, self._queue_many)
        self._label, self._scheduler = parts.label, parts.scheduler
        self._quota, self._pools = parts.quota, parts.pools
        self._route_many = parts.route_many
        #: the optional points each pool implements (tangram/pool.py), asked once: an
        #: isinstance against a runtime-checkable Protocol walks the class's attributes
        #: every time (~14 us), and every pass asked it twice
        pools = parts.pools
        self._batching = frozenset(n for n, p in pools.items() if isinstance(p, Batching))
        self._after_pass = frozenset(n for n, p in pools.items() if isinstance(p, AfterPass))
        self._waking = tuple(p for p in pools.values() if isinstance(p, Waking))
        #: the sides (tangram/sides.py), built by tangram/assembly.py, in the order each
        #: point asks them; every point below is asked of the sides implementing it
        sides = parts.sides
        self._membership = _implementing(sides, Membership)
        self._checking = _implementing(sides, Checking)
        self._owing = _implementing(sides, Owing)
        self._learning = _implementing(sides, Learning)
        self._attaching = _implementing(sides, Attaching)
        self._hosting = _implementing(sides, Hosting)
        self._admitting = _implementing(sides, Admitting)
        self._observing = _implementing(sides, Observing)
        self._locating = _implementing(sides, Locating)
        self._overstaying = _implementing(sides, Overstaying)
        #: the sides' counters, node views and figures, in the order of the utilisation
        #: columns
        self._reporting = _implementing(parts.reporting, Reporting)
        #: what a pool's own starts write in (a light lane's)
        self._books = Books(self._queued, self._running, self._estimates, self._moved_off_lane)
        #: scheduling passes that dispatched something
        self._passes = 0

    # -- the door (tangram/protocol.py) ------------------------------------------------
    def handle(self, command: Command, now: float) -> list[Effect]:
        """Carry out ``command`` at ``now``; the effects to carry out, in order.
        Raises ValueError/KeyError (naming the field) for a command that cannot apply,
        having changed nothing."""
        out: list[Effect]
        kind = type(command)
        # the commands of every action but its submit, without the match's class patterns
        # (_finish and _close return a new list: the effects are appended to it)
        if kind is Finish:
            out = self._finish(command.action_id, now, command.outcome)  # type: ignore[attr-defined,assignment]
        elif kind is Close:
            out = self._close(command.trajectory, now)  # type: ignore[attr-defined,assignment]
        elif kind is Open:
            out = self._open(command.trajectory, command.task, command.mem_gb,  # type: ignore[attr-defined]
                             command.image, command.image_gb, now)  # type: ignore[attr-defined]
        else:
            out = self._handle_other(command, now)
        for side in self._owing:
            side.owed(out, now)
        return out

    def _handle_other(self, command: Command, now: float) -> list[Effect]:
        out: list[Effect]
        match command:  # the commands are disjoint classes: the most frequent first
            case Finish(action_id, outcome):  # (a subclass: handle takes the class itself)
                out = list(self._finish(action_id, now, outcome))
            case Close(trajectory):
                out = list(self._close(trajectory, now))
            case Submit(actions):
                out = list(self._submit(actions, now))
            case Poll():
                out = list(self._poll(now))
            case Overstay():
                out = self._schedule(now, [pool for side in self._overstaying
                                           for pool in side.overstayed(now)])
            case Open(trajectory, task, mem_gb, image, image_gb):
                out = self._open(trajectory, task, mem_gb, image, image_gb, now)
            case Cancel(action_id):
                again = self._cancel(action_id)
                if again is not None:
                    # what waited behind it may fit now: without a pass it waited for
                    # the next event (an end, a submit), however far off
                    out = [Cancelled(action_id), *(self._schedule(now, again) if again else ())]
                else:
                    out = [Stop(action_id)] if action_id in self._running else []
            case NodeJoined(spec):
                out = []
                for side in self._membership:
                    touched = side.joined(spec)
                    if touched is not None:
                        out = self._schedule(now, touched)
                        break
            case NodeLost(node):
                out = []
                for side in self._membership:
                    touched = side.lost(node)
                    if touched is not None:
                        out += self._schedule(now, touched)
            case WorkerLost(node):
                for side in self._membership:
                    side.worker_lost(node)
                out = []
            case MemoryObserved(node, free_gb, idle_after_s):
                if not self._observing:
                    raise KeyError(f"node: unknown node {node!r} (no node's memory is observed)")
                out = []
                for side in self._observing:
                    out += side.memory_observed(
                        node, free_gb, idle_after_s, now,
                        lambda: self._schedule(now, self._pools.values()))
            case Attach(capabilities):
                for side in self._attaching:
                    side.attached(capabilities)
                out = []
            case _:
                raise ValueError(f"command: unknown command {type(command).__name__}")
        return out

    def trajectory(self, trajectory: str) -> TrajectoryView | None:
        """The open trajectory ``trajectory`` (None: not open)."""
        s = self._trajectories.get(trajectory)
        return None if s is None else TrajectoryView(s.task, self.node_of(trajectory),
                                                     s.in_flight, s.mem_gb)

    def is_running(self, action_id: str) -> bool:
        return action_id in self._running

    def node_of(self, trajectory: str) -> str | None:
        """The node ``trajectory`` is bound to (a CPU node; None: not bound, or unknown)."""
        for side in self._locating:
            node = side.node_of(trajectory)
            if node is not None:
                return node
        return None

    def placed_on(self, trajectory: str) -> str | None:
        """The node ``trajectory`` is bound to, else the one a policy that places by image
        chose when it opened (a multi-node backend pulls its image there before the open
        returns); None: neither yet."""
        for side in self._locating:
            node = side.placed_on(trajectory)
            if node is not None:
                return node
        return None

    def why_queued(self, action_id: str) -> str:
        """Why the queued action ``action_id`` waits, when it waits for a node to admit its
        trajectory (memory: binding never waits for a core): a client can tell a full
        machine from a busy one. "" when it does not wait for a node (or is not queued)."""
        p = self._queued.get(action_id)
        if p is None:
            return ""
        state = self._trajectories.get(p.action.trajectory)
        if state is None:
            return ""
        return next((why for side in self._admitting if (why := side.why_queued(p, state))),
                    "")

    def learnt_speedup(self, task: str, kind: str, command: str = "") -> Speedup | None:
        """The speedup curve learnt for an unprofiled elastic (task, kind) and its
        ``command`` (tangram/estimates.py :class:`Speedup`); None while none can be trusted.
        A read for recorders (executor/record.py), never a decision."""
        return self._estimates.durations.speedup((task, kind), command)

    def busy_fraction(self, node: str) -> float:
        """Fraction of ``node``'s cores held exclusively (what a light-lane action shares)."""
        return max((side.busy_fraction(node) for side in self._locating), default=0.0)

    def snapshot(self, detail: bool = True) -> Snapshot:
        """A frozen copy of the core's state for readers (status page, service, sampler,
        replay); ``detail`` False: only the counts, usage, capacity and counters."""
        counters: dict[str, float] = {"scheduler_passes": self._passes}
        for side in self._reporting:
            counters.update(side.counters())
        unplaced = first = 0  # (what waits for a node; of those, first actions)
        for side in self._admitting:
            waiting, actions = side.waiting_counts()
            unplaced, first = unplaced + waiting, first + actions
        snap = Snapshot(self._label, len(self._queued), len(self._running),
                        len(self._trajectories), unplaced,
                        MappingProxyType(self._usage()), MappingProxyType(self._capacity()),
                        MappingProxyType(counters), waiting_for_node=first)
        if not detail:
            return snap
        return replace(
            snap, detail=True,
            trajectories=MappingProxyType({
                t: TrajectoryView(s.task, self.node_of(t), s.in_flight)
                for t, s in self._trajectories.items()}),
            running=MappingProxyType({aid: self._as_held(p) for aid, p in self._running.items()}),
            queues=self._queue_views(), quotas=self._quota_views(),
            **{k: v for side in self._reporting for k, v in side.views().items()})  # type: ignore[arg-type]

    @staticmethod
    def _as_held(p: Pending) -> Dispatch:
        """``p``'s dispatch with the cores it holds now (a malleable grant resized since it
        started: tangram/cpu/malleable.py), as the status page draws them."""
        d = p.dispatch
        pool = resizable(p.pool)
        if pool is not None:
            cores = pool.cores_of(d.action.id)
            if cores is not None:
                return replace(d, lease=replace(d.lease, cores=cores, units=len(cores)))
        return d

    def _queue_views(self) -> tuple[QueueView, ...]:
        def waiting(q: Iterable[Pending]) -> tuple[Waiting, ...]:
            return tuple(Waiting(p.action, p.submit_s, p.key_min) for p in q)

        out = [side.queue_view() for side in self._admitting]
        for name, pool in self._pools.items():
            out.append(QueueView(name, pool.key or "api", waiting(pool.queue)))
            lane = light_lane(pool)
            if lane is not None:  # a CPU node's light actions wait apart
                out.append(QueueView(f"{name} light", "light lane", waiting(lane.light)))
        return tuple(out)

    def _quota_views(self) -> tuple[QuotaView, ...]:
        used = self._quota.snapshot()
        return tuple(QuotaView(key, spec.mode, spec.limit, spec.window_s, used.get(key, 0.0))
                     for key, spec in self._quota.specs.items())

    # -- trajectories ------------------------------------------------------------------
    def _open(self, trajectory: str, task: str = "default", mem_gb: float | None = None,
              image: str = "", image_gb: float = 0.0, now: float = 0.0) -> list[Effect]:
        """Register a trajectory. ``mem_gb`` is reserved on its node for its whole
        life (None: the memory demand of its first CPU action). A trajectory naming an
        ``image`` may be placed now and its image pulled ahead (the policy's ``images``
        part: the effects, a PullImage or none)."""
        if not trajectory:
            raise ValueError("trajectory: must be a non-empty string")
        if trajectory in self._trajectories:
            raise ValueError(f"trajectory: {trajectory!r} is already open")
        if mem_gb is not None and (mem_gb != mem_gb or mem_gb < 0):
            raise ValueError(f"mem_gb: must be >= 0, got {mem_gb!r}")
        if image and not (isinstance(image_gb, int | float) and image_gb >= 0):
            raise ValueError(f"image_gb: must be a number >= 0, got {image_gb!r}")
        for side in self._hosting:
            side.check_open(mem_gb)
        self._trajectories[trajectory] = TrajectoryState(task, mem_gb)
        out: list[Effect] = []
        for side in self._hosting:
            out += side.opened(trajectory, mem_gb, image, image_gb, now)
        return out

    def _close(self, trajectory: str, now: float) -> list[Effect]:
        """Release the trajectory's memory. Refused while actions are in flight."""
        state = self._trajectories.get(trajectory)
        if state is None:
            raise KeyError(f"trajectory: unknown trajectory {trajectory!r}")
        if state.in_flight:
            raise ValueError(
                f"trajectory: {trajectory!r} still has {state.in_flight} action(s) in flight"
            )
        del self._trajectories[trajectory]
        due = False
        for side in self._hosting:
            due = side.closed(trajectory) or due
        if state.thinking_in is not None:  # it ended after that kind of action
            self._estimates.arrivals.stopped_thinking(state.thinking_in, state.last_kind,
                                                     state.will_continue, continued=False)
        # what it held can only let a waiting trajectory in: no pool's units or quotas
        # changed
        return self._schedule(now, ()) if due else []

    # -- actions -----------------------------------------------------------------------
    def validate(self, action: Action) -> None:
        """Raise ValueError naming the field when ``action`` can never run here."""
        self._check((action,))

    def _check(self, actions: Sequence[Action],
               ids: list[str] | None = None) -> list[TrajectoryState]:
        """:meth:`validate` each of ``actions`` (``ids``: their ids, when known), in order:
        the first refused raises. Their trajectories' states.

        For a batch, what every action is checked for first (an Action, a new id, an open
        trajectory) is checked for all at once, in C loops (a burst checks thousands);
        when one fails (or for a few actions), each action is checked one by one, so the
        first refused raises."""
        queued, running, trajectories = self._queued, self._running, self._trajectories
        states: list[TrajectoryState] = []  # (a batch's, checked at once)
        if len(actions) > 4 and all(map(isinstance, actions, repeat(Action))):
            if ids is None:
                ids = list(map(_ID, actions))
            if queued.keys().isdisjoint(ids) and running.keys().isdisjoint(ids):
                states = list(map(trajectories.get, map(_TRAJECTORY, actions)))
                if not all(states):  # (a TrajectoryState is true)
                    states = []
        one_by_one: list[TrajectoryState] = []
        # a side's check is built when an action first reaches it (a GPU batch never
        # builds the CPU side's): the first side that takes an action checks it
        checks: list[Check] = []
        sides = self._checking
        for action, state in (zip(actions, states, strict=True) if states
                              else zip(actions, repeat(None))):
            if state is None:  # (checked one by one)
                if not isinstance(action, Action):
                    raise ValueError(f"action: expected an Action, got {type(action).__name__}")
                aid = action.id
                if aid in queued or aid in running:
                    raise ValueError(f"action.id: duplicate id {aid!r}")
                state = trajectories.get(action.trajectory)
                if state is None:
                    raise KeyError(f"action.trajectory: unknown trajectory "
                                   f"{action.trajectory!r} (open it first)")
                one_by_one.append(state)
            cost = action.cost
            for res in cost:  # (a loop: cheaper than a set test for the usual one or two)
                if res not in _UNCOUNTED and counted(res):  # (most actions hold no quota)
                    demand = cost[res]
                    if demand.min > 0:
                        spec = self._quota.check(res)
                        if demand.min > spec.limit:
                            raise ValueError(f"cost[{res!r}]: {demand.min} exceeds the quota "
                                             f"limit {spec.limit}")
            for check in checks:
                if check(action, state):
                    break
            else:  # no side asked so far took it: the next sides, their checks built now
                for side in sides[len(checks):]:
                    check = side.checker()
                    checks.append(check)
                    if check(action, state):
                        break
        return states or one_by_one

    def _submit(self, actions: Iterable[Action], now: float) -> list[Effect]:
        """Queue a batch (e.g. a step's reward requests) with one scheduling pass per
        pool touched. All or nothing: one invalid action queues none of them.

        Queued a pool at a time (a burst queues thousands: each pool's lookups are done
        once per batch, ``_pendings``, ``admit_many``), in the order a submission at a time
        would give each queue; what the policy routes to no pool yet (the first CPU actions
        of trajectories no node holds) goes to the admitting side, which may queue it at
        once (tangram/sides.py ``Admitting.queue_fresh``)."""
        actions = list(actions)
        ids = list(map(_ID, actions)) if len(actions) > 1 else None
        if ids is not None and len(set(ids)) != len(ids):
            raise ValueError("action.id: duplicate ids in the batch")
        states = self._check(actions, ids)
        for state in states:  # (one per action, in order)
            if state.thinking_in is not None:  # it stopped thinking: learn how long that took
                self._estimates.arrivals.stopped_thinking(state.thinking_in, state.last_kind,
                                                         state.will_continue, continued=True,
                                                         think_s=now - state.last_end)
                state.thinking_in = None
            state.in_flight += 1
        groups, fresh = by_pool(actions, self._route_many(actions))
        for pool, group in groups.items():
            self._queue_many(pool, group, now)
        if fresh:  # routed to no pool (their trajectory is not placed): the first
            # admitting side's (the CPU binding's first actions)
            self._admitting[0].queue_fresh(fresh, now, groups)
        return self._schedule(now, groups)

    def _queue_many(self, pool: PoolPoints, actions: list[Action], submit_s: float) -> None:
        """Queue ``actions`` (submitted at ``submit_s``) in ``pool``, in order."""
        pendings = self._pendings(pool, actions, submit_s)
        queued = self._queued
        for p in pendings:
            queued[p.action.id] = p
        pool.admit_many(pendings, submit_s)

    def _finish(self, action_id: str, now: float, outcome: Outcome | None = None) -> list[Effect]:
        """Release what ``action_id`` held and return what can start now."""
        p = self._running.pop(action_id, None)
        if p is None:
            raise KeyError(f"action_id: {action_id!r} is not running")
        action = p.action
        pool, dispatch = p.pool, p.dispatch
        lease = dispatch.lease
        if p.batch_left is not None:
            p.batch_left.discard(action_id)
        last = not p.batch_left
        units = lease.units
        observed = (outcome is None or outcome.ok) and p.batch_left is None
        if last:
            if observed and (grants := resizable(pool)) is not None:  # (at its width over its run)
                units = grants.closing(action_id, units, now)
            pool.ended(dispatch.action.id)
            self._release(pool, lease)
        if outcome is not None:
            extra = outcome.extra
            for side in self._learning:
                if not side.learns_from.isdisjoint(extra):
                    side.ended(outcome)
        state = self._trajectories.get(action.trajectory)
        if state is not None:
            state.in_flight -= 1
            if not state.in_flight and pool.key is not None:
                state.thinking_in = pool.name  # its next action will most likely come here
                state.last_end = now
                state.last_kind = (action.task, action.kind)
                state.will_continue = self._estimates.arrivals.started_thinking(
                    pool.name, state.last_kind)
        if not last:  # the batch still holds the lease: nothing was freed
            return []
        if observed:
            # a batch member's elapsed time is the batch's, not its own: not observed
            elapsed = now - dispatch.start_s - lease.restore_s
            lane = light_lane(pool)
            self._estimates.durations.observe(action, units, max(elapsed, 0.0),
                                             pool.name, p.elastic,
                                             lane.light_s if lane is not None else 0.0)
        if p.elastic:
            self._estimates.durations.ended(action_id)
        if lease.lane:
            self._estimates.durations.lane.ended(action_id)
        touched: Iterable[PoolPoints] = [pool]
        if lease.parts[1] is not None:  # freed quota may unblock any pool's head
            touched = self._pools.values()
        return self._schedule(now, touched)

    def _cancel(self, action_id: str) -> list[PoolPoints] | None:
        """Drop a queued action: the pool it waited in, to pass again (none where it waited
        for a node), or None where it was not queued — running ones must be finished by
        their backend."""
        pending = self._queued.pop(action_id, None)
        if pending is None:
            return None
        again: list[PoolPoints] = []
        if not any(side.withdraw(pending) for side in self._admitting):
            pool = next((p for p in self._pools.values() if p.withdraw(pending)), None)
            again = [pool] if pool is not None else []
        state = self._trajectories.get(pending.action.trajectory)
        if state:
            state.in_flight -= 1
        return again

    def _poll(self, now: float) -> list[Effect]:
        """Re-run every pool (window quotas regain room as time passes)."""
        return self._schedule(now, self._pools.values())

    def next_wakeup(self, now: float) -> float | None:
        """When a time-based quota frees up, or a pool wants another pass (a GPU request
        stops waiting by choice), while something waits (else None)."""
        if not self._queued:
            return None
        at = self._quota.next_expiry(now)
        for pool in self._waking:
            w = pool.next_wakeup(now)
            if w is not None and (at is None or w < at):
                at = w
        return at

    def lane_wakeup(self) -> float | None:
        """When the next action on a light lane overstays it, unless it ends first (then
        ``Overstay``; None: no lane runs anything)."""
        return min((at for side in self._overstaying if (at := side.lane_wakeup()) is not None),
                   default=None)

    # -- internals ---------------------------------------------------------------------
    def _moved_off_lane(self) -> None:
        for side in self._overstaying:
            side.moved_off_lane()

    def _pending(self, action: Action, now: float, pool: PoolPoints) -> Pending:
        return self._pendings(pool, (action,), now)[0]

    def _pendings(self, pool: PoolPoints, actions: Sequence[Action],
                  now: float) -> list[Pending]:
        """What the scheduler reads of each of ``actions`` queued in ``pool`` at ``now``.
        One loop for a batch, the pool's and the scheduler's lookups done once (a burst
        queues thousands)."""
        out: list[Pending] = []
        append = out.append
        key = pool.key
        sched = pool.scheduler or self._scheduler
        unit_choices, estimates = pool.unit_choices, self._estimates
        lane = light_lane(pool)
        durations = estimates.durations
        durations.now = now  # (learnt tables read the runs in flight as of now)
        # the light lane's classification (a CPU node's: tangram/cpu/lane.py light_test)
        light_test = lane.light_test(durations) if lane is not None else None
        for action in actions:
            quotas = _quotas(action.cost)
            if key is None:  # (a pool with no key resource: API calls)
                append(Pending(action, now, 0, quotas))
                continue
            choices = unit_choices(action)
            if action.elastic == key and choices:
                key_min = sched.min_units(choices)
                if sched.elastic_enabled and len(choices) > 1:
                    declared = sched.declared_profile(action, estimates)
                    if declared is not None:  # its table, E.durations(T1, choices), on first read
                        append(Pending(action, now, key_min, quotas, True, False, choices,
                                       NONE, declared))
                        continue
                    durations = sched.profile(action, choices, estimates)
                    if durations:
                        append(Pending(action, now, key_min, quotas, True, False, choices,
                                       durations))
                        continue
            else:  # (unit choices are ints: PoolPoints.unit_choices)
                key_min = choices[0] if choices else int(action.min(key))
                choices = ()
            light = light_test is not None and light_test(action, key_min, quotas)
            append(Pending(action, now, key_min, quotas, False, light, choices))
        return out

    def _schedule(self, now: float, pools: Iterable[PoolPoints]) -> list[Effect]:
        # an insertion-ordered set: the pools' passes run in a fixed order (a set of
        # names would follow string hashing, which differs between processes, and the
        # order matters where pools share a quota: same-seed runs must be identical)
        names = {p.name: None for p in pools}
        for side in self._admitting:
            if side.waiting:  # (an attribute: else the side has nothing to do)
                side.bind_waiting(names)
        out: list[Effect] = []
        for name in list(names):
            out.extend(self._pass(self._pools[name], now))
        return out

    def _pass(self, pool: PoolPoints, now: float) -> list[Effect]:
        """Scheduling passes until nothing more starts. Greedy eviction may leave units
        free that an evicted action could have used (a DP prefix cannot always absorb
        them: an action takes at most 8 GPUs); the next pass offers them again."""
        lane = light_lane(pool)
        out: list[Effect] = []
        if lane is not None:  # (a CPU node: its lane starts light actions before any plan)
            out = lane.run(now, self._books)
        # a pool whose grants resize (tangram/cpu/malleable.py): before each plan and once
        # its queue is empty, its running grants and its queue share its idle units
        resizing = resizable(pool)
        if resizing is not None and not resizing.grows:
            resizing = None
        while pool.queue or resizing is not None:
            if resizing is not None:
                out.extend(resizing.share(now, self._books))
                if not pool.queue:
                    break
            got = self._pass_once(pool, now, resizing)
            out.extend(got)
            if not got or (resizing is None and pool.free_units() <= 0):
                break
        if pool.name in self._after_pass:  # e.g. a static GPU pool deploys replicas
            pool.after_pass(now, self._estimates)  # type: ignore[attr-defined]
        return out

    def _pass_once(self, pool: PoolPoints, now: float,
                   resizing: Resizable | None = None) -> list[Dispatch]:
        sched = pool.scheduler or self._scheduler
        decisions = sched.plan(pool, now, self._estimates, self._quota)
        if not decisions:
            return []
        # Largest grants first: NUMA placement is easiest while domains are whole.
        if len(decisions) > 1:
            decisions.sort(key=lambda d: -d[1])
        batcher = pool if pool.name in self._batching else None
        granted: list[tuple[Pending, Lease, GpuPlan | None]] = []
        for p, units in decisions:
            got = self._reserve(pool, p, units, now)
            if got is not None:
                granted.append((p, *got))
        pool.take([p for p, _, _ in granted])
        self._passes += 1
        out = []
        for p, lease, plan in granted:
            del self._queued[p.action.id]
            expected = p.durations.get(lease.units) or (
                p.action.duration(lease.units) if p.action.t1_s is not None else self._estimates.estimate(p))
            # continuous batching: the pool may let queued requests of the same service
            # ride on this lease (it takes them off its queue)
            riders, batch_s = (batcher.batch(p, lease.units, now, self._estimates)
                               if batcher is not None else ([], None))
            for r in riders:
                del self._queued[r.action.id]
            if riders and batch_s is not None:
                expected = batch_s
            batch = tuple([BatchMember(r.action, r.submit_s) for r in riders]) if riders else ()
            # (positional: no keyword parsing per dispatch; decision_s 0.0, the default)
            workers = resizing.begin(p, lease.units, now) if resizing and not riders else 0
            d = Dispatch(p.action, lease, p.submit_s, now, expected, 0.0, batch, plan, workers)
            left = {p.action.id, *(r.action.id for r in riders)} if riders else None
            p.dispatch, p.pool, p.batch_left = d, pool, left
            self._running[p.action.id] = p
            for r in riders:
                r.dispatch, r.pool, r.batch_left = d, pool, left
                self._running[r.action.id] = r
            pool.started(p.action.id, now + lease.restore_s + (expected or 0.0), lease.units, now)
            if p.elastic and not riders:  # (a batch's elapsed time is not observed)
                self._estimates.durations.started(p.action, lease.units, now + lease.restore_s)
            out.append(d)
        return out

    def _reserve(self, pool: PoolPoints, p: Pending, units: int,
                 now: float) -> tuple[Lease, GpuPlan | None] | None:
        """Pool units then quotas, all or nothing. NUMA placement may refuse the
        planned count: fall back to smaller feasible counts down to the minimum."""
        u = units
        grant = pool.reserve(p, u, now)
        if grant is None:  # (rarely: the fallbacks are only listed then)
            for u in reversed(p.choices):
                if p.key_min <= u < units:
                    grant = pool.reserve(p, u, now)
                    if grant is not None:
                        break
            else:
                return None
        qlease = None
        if p.quotas:
            qlease = self._quota.reserve(p.action.id, p.quotas, now)
            if qlease is None:
                pool.release(grant.part)
                return None
        return Lease(p.action.id, u, (grant.part, qlease), grant.node, grant.cores,
                     grant.gpus, grant.restore_s, grant.lane), grant.plan

    def _release(self, pool: PoolPoints, lease: Lease) -> None:
        part, qlease = lease.parts
        if qlease is not None:
            self._quota.release(qlease)
        if part is not None:
            pool.release(part)

    # -- introspection -----------------------------------------------------------------
    def _usage(self) -> dict[str, float]:
        """Units in use per resource (for utilisation sampling)."""
        figures = [side.usage() for side in self._reporting]
        out = {k: v for f in figures for k, v in f.units.items()}
        out.update({k: v for f in figures for k, v in f.other.items()})
        for pool in self._pools.values():
            for res, units in pool.usage().items():
                out[res] = out.get(res, 0.0) + units
        out.update(self._quota.snapshot())
        return out

    def _capacity(self) -> dict[str, float]:
        figures = [side.capacity() for side in self._reporting]
        out = {k: v for f in figures for k, v in f.units.items()}
        out.update({k: v for f in figures for k, v in f.other.items()})
        out.update({q.key: q.limit for q in self._cluster.quotas})
        return out
