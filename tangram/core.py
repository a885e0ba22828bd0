"""Tangram: the clock-free core. No clock, no I/O, no threads.

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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from operator import attrgetter
from types import MappingProxyType

from tangram.cluster import ClusterSpec, CpuNodeSpec, GpuNodeSpec
from tangram.cpu.admission import RESERVE, MemoryAdmission
from tangram.estimates import Estimates, command_of
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
from tangram.policies import Policy
from tangram.pool import LightLane, PoolPoints
from tangram.protocol import (
    Attach,
    Cancel,
    Cancelled,
    Close,
    Command,
    CpuNodeView,
    Effect,
    Finish,
    GpuNodeView,
    MemoryObserved,
    Moved,
    NodeJoined,
    NodeLost,
    Open,
    Overstay,
    Poll,
    PreRestore,
    QueueView,
    QuotaView,
    Reclaim,
    Shed,
    Snapshot,
    Stop,
    Submit,
    TrajectoryView,
    Waiting,
    WorkerLost,
)

#: resources that are never counted (tangram.model.counted): the common case, decided
#: without a string test per submission
_UNCOUNTED = frozenset({"cpu", "gpu", "mem_gb", "gpu_mem_gb"})
_ID, _TRAJECTORY = attrgetter("id"), attrgetter("trajectory")
#: a lane action overstays at its start + the lane's hold; a timer set for that instant
#: may fire a rounding error before it (now + (at - now) != at in floating point)
_TICK = 1e-9


def _quotas(cost: Mapping[str, Demand]) -> Mapping[str, float]:
    """The quotas an action of ``cost`` holds while it runs (NONE, shared, for most: they
    hold none)."""
    for res in cost:  # (a loop: cheaper than a set test for the usual one or two)
        if res not in _UNCOUNTED and counted(res):
            return {k: d.min for k, d in cost.items() if counted(k) and d.min > 0}
    return NONE


def _by_pool(actions: list[Action], pools: list[PoolPoints | None]
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


@dataclass(slots=True)
class TrajectoryState:
    task: str
    mem_gb: float | None
    #: its actions queued or running (a count, not their ids: each is counted once, at
    #: submit, and uncounted once, when it finishes or is cancelled; a set per trajectory
    #: was one more object for the cyclic GC to track, thousands of them in a burst)
    in_flight: int = 0
    #: while it thinks (LLM generation): the pool of its last action, when and of what
    #: (task, kind) that ended, and its weight in that pool's expected arrivals
    thinking_in: str | None = None
    last_end: float = 0.0
    last_kind: tuple[str, str] = ("", "")
    will_continue: float = 0.0


class Tangram:
    """The action-level resource manager's state machine."""

    def __init__(self, cluster: ClusterSpec, policy: Policy | None = None,
                 estimates: Estimates | None = None,
                 admission: MemoryAdmission = RESERVE) -> None:
        """``admission``: when a CPU node takes one more trajectory's memory (the default,
        RESERVE: every declared limit reserved in full, the paper's rule; a node whose free
        memory is observed, MemoryObserved, may admit by use: tangram/cpu/admission.py)."""
        self._cluster = cluster
        self._policy = policy or Policy()
        self._scheduler = self._policy.scheduler()
        self._estimates = estimates or Estimates()
        res = self._policy.build(cluster)
        self._cpu, self._gpu, self._quota, self._pools = res.cpu, res.gpu, res.quota, res.pools
        #: the CPU nodes' light lanes (asked for their next overstay after every event)
        self._lanes = self._lanes_of()
        self._cpu.admission = admission
        #: the attached backend frees an idle trajectory's memory when it is reclaimed
        #: (Capabilities.evicts)
        self._evicts = False
        #: idle trajectories unbound for waiting ones (MemoryObserved)
        self._reclaimed = 0
        self._lane_moves = 0  # light-lane actions that overstayed and were moved off it
        self._resources = res
        self._unbound: deque[Pending] = deque()
        #: trajectories whose environment starts at open (the policy's ``env`` part asked
        #: for it) that no node has had room for yet, in open order (an insertion-ordered set)
        self._opening: dict[str, None] = {}
        self._trajectories: dict[str, TrajectoryState] = {}
        self._queued: dict[str, Pending] = {}
        #: started actions: their Pendings, with the dispatch, pool and batch set on them
        self._running: dict[str, Pending] = {}
        self._max_node_cores = max((n.cores for n in cluster.cpu_nodes), default=0)
        self._max_domain = max((n.cores // n.numa for n in cluster.cpu_nodes), default=0)
        self._max_node_mem = max((n.mem_gb for n in cluster.cpu_nodes), default=0.0)
        #: the core counts within both limits (a NUMA domain's is the smaller)
        self._whole_fits = frozenset(range(1, self._max_domain + 1))
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
            self._open(command.trajectory, command.task, command.mem_gb)  # type: ignore[attr-defined]
            out = []
        else:
            out = self._handle_other(command, now)
        gpu = self._gpu
        if gpu.has_prerestores():
            for plan, at, restore_s in gpu.take_prerestores():
                out.append(PreRestore(plan, at, restore_s))
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
                out = self._schedule(now, [
                    pool for pool in self._pools.values() if pool.lane is not None
                    and (at := pool.lane.lane_wakeup()) is not None and at <= now + _TICK])
            case Open(trajectory, task, mem_gb):
                self._open(trajectory, task, mem_gb)
                out = []
            case Cancel(action_id):
                if self._cancel(action_id):
                    out = [Cancelled(action_id)]
                else:
                    out = [Stop(action_id)] if action_id in self._running else []
            case NodeJoined(spec) if isinstance(spec, GpuNodeSpec):
                out = list(self._gpu_node_back(spec.name, now))
            case NodeJoined(spec):
                out = list(self._add_node(spec, now))
            case NodeLost(node):
                out = []
                if node in self._gpu.nodes:  # a GPU node (it may have cores too)
                    self._gpu.fence(node)
                out += self._remove_node(node, now)
            case WorkerLost(node):
                if node in self._gpu.nodes:
                    self._gpu.reset_node(node)
                out = []
            case MemoryObserved(node, free_gb, idle_after_s):
                out = self._memory_observed(node, free_gb, idle_after_s, now)
            case Attach(capabilities):
                # pre-restores only for a backend that carries them out: another would not
                # hold what the core then believes resident
                self._gpu.prerestore_ok = capabilities.prerestores
                self._evicts = capabilities.evicts
                out = []
            case _:
                raise ValueError(f"command: unknown command {type(command).__name__}")
        return out

    def trajectory(self, trajectory: str) -> TrajectoryView | None:
        """The open trajectory ``trajectory`` (None: not open)."""
        s = self._trajectories.get(trajectory)
        return None if s is None else TrajectoryView(s.task, self._cpu.node_of(trajectory),
                                                     s.in_flight, s.mem_gb)

    def is_running(self, action_id: str) -> bool:
        return action_id in self._running

    def node_of(self, trajectory: str) -> str | None:
        """The CPU node ``trajectory`` is bound to (None: not bound, or unknown)."""
        return self._cpu.node_of(trajectory)

    def why_queued(self, action_id: str) -> str:
        """Why the queued action ``action_id`` waits, when it waits for a node to admit its
        trajectory (memory: binding never waits for a core): a client can tell a full
        machine from a busy one. "" when it does not wait for a node (or is not queued)."""
        p = self._queued.get(action_id)
        if p is None:
            return ""
        tid = p.action.trajectory
        state = self._trajectories.get(tid)
        if state is None or self._cpu.node_of(tid) is not None:
            return ""
        first = any(q is p for q in self._unbound)
        if not first and tid not in self._opening:
            return ""  # e.g. an API call of an unbound trajectory: it waits in its pool
        need = self._trajectory_mem(p.action) if first else (state.mem_gb or 0.0)
        return self._cpu.why_unbound(need)

    def busy_fraction(self, node: str) -> float:
        """Fraction of ``node``'s cores held exclusively (what a light-lane action shares)."""
        spec = self._cpu.nodes.get(node)
        return self._cpu.in_use(node) / spec.spec.cores if spec and spec.spec.cores else 0.0

    def snapshot(self, detail: bool = True) -> Snapshot:
        """A frozen copy of the core's state for readers (status page, service, sampler,
        replay); ``detail`` False: only the counts, usage, capacity and counters."""
        gpu = self._gpu
        counters = {"gpu_restores": gpu.restores, "gpu_restore_hits": gpu.hits,
                    "gpu_restore_s_total": gpu.restore_s_total, "scheduler_passes": self._passes,
                    "trajectories_reclaimed": self._reclaimed, "lane_moves": self._lane_moves}
        snap = Snapshot(self._policy.label, len(self._queued), len(self._running),
                        len(self._trajectories), len(self._opening) + len(self._unbound),
                        MappingProxyType(self._usage()), MappingProxyType(self._capacity()),
                        MappingProxyType(counters), waiting_for_node=len(self._unbound))
        if not detail:
            return snap
        return replace(
            snap, detail=True,
            trajectories=MappingProxyType({
                t: TrajectoryView(s.task, self._cpu.node_of(t), s.in_flight)
                for t, s in self._trajectories.items()}),
            running=MappingProxyType({aid: p.dispatch for aid, p in self._running.items()}),
            queues=self._queue_views(), cpu_nodes=self._cpu_views(),
            gpu_nodes=self._gpu_views(), quotas=self._quota_views(),
            service_gb=MappingProxyType({n: s.size_gb for n, s in gpu.services.items()}))

    def _queue_views(self) -> tuple[QueueView, ...]:
        def waiting(q: Iterable[Pending]) -> tuple[Waiting, ...]:
            return tuple(Waiting(p.action, p.submit_s, p.key_min) for p in q)

        out = [QueueView("binding", "binding", waiting(self._unbound))]
        for name, pool in self._pools.items():
            out.append(QueueView(name, pool.key or "api", waiting(pool.queue)))
            if pool.lane is not None:  # a CPU node's light actions wait apart
                out.append(QueueView(f"{name} light", "light lane", waiting(pool.lane.light)))
        return tuple(out)

    def _cpu_views(self) -> tuple[CpuNodeView, ...]:
        slots = {p.name.removeprefix("cpu:"): p.lane.lane_slots for p in self._pools.values()
                 if p.lane is not None}
        pods: dict[str, dict[int, str]] = {}
        for trajectory, lease in self._cpu.held_between_actions().items():
            for c in lease.cores:
                pods.setdefault(lease.node, {})[c] = trajectory
        return tuple(
            CpuNodeView(name, node.spec.cores, node.spec.numa, node.domain_size,
                        node.spec.mem_gb, node.mem_reserved,
                        frozenset(c for dom in node.domains for c in dom),
                        MappingProxyType(pods.get(name, {})), slots.get(name, 0))
            for name, node in self._cpu.nodes.items())

    def _gpu_views(self) -> tuple[GpuNodeView, ...]:
        return tuple(
            GpuNodeView(name, node.spec.gpus, node.spec.gpu_mem_gb,
                        tuple(sorted((start, size) for size, starts in node.free.items()
                                     for start in starts)),
                        tuple(node.resident), tuple(node.mem_used), node.down)
            for name, node in self._gpu.nodes.items())

    def _quota_views(self) -> tuple[QuotaView, ...]:
        used = self._quota.snapshot()
        return tuple(QuotaView(key, spec.mode, spec.limit, spec.window_s, used.get(key, 0.0))
                     for key, spec in self._quota.specs.items())

    # -- trajectories ------------------------------------------------------------------
    def _open(self, trajectory: str, task: str = "default",
                        mem_gb: float | None = None) -> None:
        """Register a trajectory. ``mem_gb`` is reserved on its node for its whole
        life (None: the memory demand of its first CPU action)."""
        if not trajectory:
            raise ValueError("trajectory: must be a non-empty string")
        if trajectory in self._trajectories:
            raise ValueError(f"trajectory: {trajectory!r} is already open")
        if mem_gb is not None and (mem_gb != mem_gb or mem_gb < 0):
            raise ValueError(f"mem_gb: must be >= 0, got {mem_gb!r}")
        if mem_gb is not None and self._cluster.cpu_nodes and mem_gb > self._max_node_mem:
            raise ValueError(f"mem_gb: {mem_gb} GB exceeds the largest node ({self._max_node_mem})")
        self._trajectories[trajectory] = TrajectoryState(task, mem_gb)
        if self._cluster.cpu_nodes:
            self._policy.env.opened(trajectory, self._request_env)

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
        self._opening.pop(trajectory, None)
        if state.thinking_in is not None:  # it ended after that kind of action
            self._estimates.arrivals.stopped_thinking(state.thinking_in, state.last_kind,
                                                     state.will_continue, continued=False)
        if self._cpu.node_of(trajectory) is None:
            return []
        self._cpu.unbind(trajectory)
        # freed memory can only unblock binding; cores and quotas are unchanged
        return self._schedule(now, ()) if self._unbound or self._opening else []

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
        # feasible's answers for this batch (the manager caches them too, behind a call and
        # a key built per action: without this, ~10 more opcodes per GPU request of a burst)
        seen: dict[tuple[str, tuple[float, ...]], str | None] = {}
        whole_fits, max_node_mem = self._whole_fits, self._max_node_mem
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
            if action.min("gpu") > 0:
                k = (action.service or "", cost["gpu"].choices)
                why = seen.get(k, False)
                if why is False:
                    why = seen[k] = self._gpu.feasible(*k)[1]
                if why:  # no feasible GPU count can serve it
                    raise ValueError(why)
                continue
            cpu = cost.get("cpu")
            if cpu is None:
                continue
            need = cpu.choices[0]
            if need > 0:
                if need not in whole_fits:  # (mostly: a whole count any NUMA domain holds)
                    if need != int(need):
                        raise ValueError(f"cost['cpu']: cores must be whole, got {need}")
                    limit = self._max_domain if action.elastic == "cpu" else self._max_node_cores
                    if need > limit:
                        raise ValueError(
                            f"cost['cpu']: minimum {need} cores can never fit (largest "
                            f"{'NUMA domain' if action.elastic else 'node'}: {limit})")
                mem = state.mem_gb
                if mem is None:
                    mem = action.min("mem_gb")
                if mem > max_node_mem:
                    raise ValueError(f"cost['mem_gb']: {mem} GB exceeds the largest node "
                                     f"({max_node_mem} GB)")
        return states or one_by_one

    def _submit(self, actions: Iterable[Action], now: float) -> list[Effect]:
        """Queue a batch (e.g. a step's reward requests) with one scheduling pass per
        pool touched. All or nothing: one invalid action queues none of them.

        Queued a pool at a time (a burst queues thousands: each pool's lookups are done
        once per batch, ``_pendings``, ``admit_many``), in the order a submission at a time
        would give each queue; the first CPU actions of unbound trajectories are bound
        right here when nothing waits for a node before them (``_queue_fresh``)."""
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
        groups, fresh = _by_pool(actions, self._policy.route_many(actions, self._resources))
        for pool, group in groups.items():
            self._queue_many(pool, group, now)
        if fresh:  # first CPU actions of trajectories not bound to a node
            self._queue_fresh(fresh, now, groups)
        return self._schedule(now, groups)

    def _queue_fresh(self, fresh: list[Action], now: float,
                     touched: dict[PoolPoints, list[Action]]) -> None:
        """Queue ``fresh``, first CPU actions of trajectories not bound to a node,
        submitted at ``now``. When nothing waits for a node before them, they are bound
        here, in order, until one fits no node: what the pass's ``_bind_waiting`` would
        do first (then it stops at that one too), without a Pending in the binding queue
        for each. The pools they are queued in are added to ``touched``. The rest wait in
        the binding queue."""
        bound = 0
        if not self._unbound and not self._opening:
            trajectories = self._trajectories
            mems = [trajectories[t].mem_gb for t in map(_TRAJECTORY, fresh)]
            if None in mems:  # (_trajectory_mem: the first action's memory demand)
                mems = [a.min("mem_gb") if m is None else m for a, m in zip(fresh, mems,
                                                                           strict=True)]
            cores = [a.cost["cpu"].choices[0] for a in fresh]  # (whole: validated)
            nodes = self._cpu.bind_many(zip(map(_TRAJECTORY, fresh), mems, cores, strict=True))
            bound = len(nodes)
            if nodes:
                # the pool route_many gives an action of a trajectory bound to its node
                node_pool = {n: self._policy.node_pool(n, self._resources) for n in set(nodes)}
                done = fresh[:bound] if bound < len(fresh) else fresh
                groups, _ = _by_pool(done, list(map(node_pool.__getitem__, nodes)))
                for pool, group in groups.items():
                    self._queue_many(pool, group, now)
                    touched.setdefault(pool, group)
        if bound < len(fresh):
            queued, unbound = self._queued, self._unbound
            for action in fresh[bound:]:
                pending = Pending(action, now, int(action.cost["cpu"].choices[0]))
                queued[action.id] = pending
                unbound.append(pending)

    def _queue_many(self, pool: PoolPoints, actions: list[Action], submit_s: float) -> None:
        """Queue ``actions`` (submitted at ``submit_s``) in ``pool``, in order."""
        pendings = self._pendings(pool, actions, submit_s)
        queued = self._queued
        for p in pendings:
            queued[p.action.id] = p
        pool.admit_many(pendings, submit_s)

    def _queue_in(self, pool: PoolPoints, action: Action, submit_s: float) -> None:
        """Queue ``action`` (submitted at ``submit_s``) in ``pool``."""
        self._queue_many(pool, [action], submit_s)

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
        if last:
            pool.ended(dispatch.action.id)
            self._release(pool, lease)
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
        if (outcome is None or outcome.ok) and p.batch_left is None:
            # a batch member's elapsed time is the batch's, not its own: not observed
            elapsed = now - dispatch.start_s - lease.restore_s
            lane = pool.lane
            self._estimates.durations.observe(action, lease.units, max(elapsed, 0.0),
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

    def _cancel(self, action_id: str) -> bool:
        """Drop a queued action (True) — running ones must be finished by their backend."""
        pending = self._queued.pop(action_id, None)
        if pending is None:
            return False
        if pending in self._unbound:
            self._unbound.remove(pending)
        else:
            for pool in self._pools.values():
                if pool.withdraw(pending):
                    break
        state = self._trajectories.get(pending.action.trajectory)
        if state:
            state.in_flight -= 1
        return True

    def _poll(self, now: float) -> list[Effect]:
        """Re-run every pool (window quotas regain room as time passes)."""
        return self._schedule(now, self._pools.values())

    def next_wakeup(self, now: float) -> float | None:
        """When a time-based quota frees up, or a pool wants another pass (a GPU request
        stops waiting by choice), while something waits (else None)."""
        if not self._queued:
            return None
        at = self._quota.next_expiry(now)
        for pool in self._pools.values():
            w = pool.next_wakeup(now)
            if w is not None and (at is None or w < at):
                at = w
        return at

    def lane_wakeup(self) -> float | None:
        """When the next action on a light lane overstays it, unless it ends first (then
        ``Overstay``; None: no lane runs anything)."""
        return min((at for lane in self._lanes if (at := lane.lane_wakeup()) is not None),
                   default=None)

    def _lanes_of(self) -> tuple[LightLane, ...]:
        return tuple(pool.lane for pool in self._pools.values()
                     if pool.lane is not None and pool.lane.lane_slots)

    # -- memory admission (tangram/cpu/admission.py) ---------------------------------------
    def _memory_observed(self, node: str, free_gb: float, idle_after_s: float,
                        now: float) -> list[Effect]:
        """``node``'s free memory as just observed: admission goes by it from now on.
        While trajectories wait for a node, idle ones give their place for the first one
        waiting (``_reclaim``) and a scheduling pass follows, so memory freed by a
        sandbox's processes (not only by a close) admits them. Still short of the
        headroom after that (no evicting backend freed memory), the node is told to shed
        its largest sandbox (Shed). The effects: the trajectories reclaimed (Reclaim), what
        started (Dispatch), then a Shed."""
        if node not in self._cpu.nodes:
            raise KeyError(f"node: unknown CPU node {node!r}")
        if not free_gb >= 0:
            raise ValueError(f"free_gb: must be >= 0, got {free_gb!r}")
        if not idle_after_s >= 0:
            raise ValueError(f"idle_after_s: must be >= 0, got {idle_after_s!r}")
        self._cpu.observe_free(node, free_gb)
        out: list[Effect] = []
        again = True
        while again and (self._unbound or self._opening):  # someone waits for a node
            reclaimed, again = self._reclaim(node, now, idle_after_s)
            out.extend(Reclaim(t) for t in reclaimed)
            out.extend(self._schedule(now, self._pools.values()))  # binds the first one
        keep = self._cpu.admission.headroom * self._cpu.nodes[node].spec.mem_gb
        freed = self._evicts and any(isinstance(e, Reclaim) for e in out)
        if free_gb < keep - 1e-9 and not freed:  # (an eviction shows in the next one)
            out.append(Shed(node, free_gb, keep))
        return out

    def _reclaim(self, node: str, now: float, idle_after_s: float) -> tuple[list[str], bool]:
        """Unbind idle trajectories of ``node`` (nothing in flight for ``idle_after_s``),
        least recently used first, for the first trajectory waiting for a node. Over the
        declared cap (MemoryAdmission.overcommit) as many as it needs; on an observed
        shortage one per observation (its freed memory shows in the next one), and only
        when the backend evicts (else what they hold is not memory: the process backend
        keeps an idle trajectory's files on disk, nothing in memory). Returns the
        trajectories reclaimed, and whether they made room (the next one may need more).

        Not in the paper (its trajectories hold their memory until they close): a rollout
        abandoned or slow to finish would otherwise hold its node's memory from the ones
        waiting; finished rollouts are closed by their reward (verl's compute_score)."""
        host = self._cpu.nodes[node]
        if not self._unbound or not self._policy.env.reclaimable:
            return [], False  # e.g. a pod per trajectory holds its place until it closes
        need = self._trajectory_mem(self._unbound[0].action)
        if self._cpu.mem_refusal(host, need) is None:
            return [], False
        idle = sorted((st.last_end, tid) for tid, st in self._trajectories.items()
                      if not st.in_flight and self._cpu.node_of(tid) == node
                      and now - st.last_end >= idle_after_s)
        out: list[str] = []
        for _, tid in idle:
            over_cap = self._cpu.admission.over_cap(host.spec.mem_gb, host.mem_reserved, need)
            if not over_cap and not self._evicts:
                break  # nothing held in memory to free: the shortage is not theirs
            self._cpu.unbind(tid)
            self._reclaimed += 1
            out.append(tid)
            if not over_cap:
                break  # observed shortage: one per observation
            if self._cpu.mem_refusal(host, need) is None:
                return out, True
        return out, False

    # -- internals ---------------------------------------------------------------------
    def _trajectory_mem(self, action: Action) -> float:
        state = self._trajectories[action.trajectory]
        return state.mem_gb if state.mem_gb is not None else action.min("mem_gb")

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
        lane = pool.lane
        # the light lane (a CPU node's): actions expected to take at most ``light_s`` on one
        # core, by their command, declared or observed (tangram/estimates.py LaneModel)
        light_s = lane.light_s if lane is not None else 0.0
        durations = estimates.durations
        durations.now = now  # (learnt tables read the runs in flight as of now)
        lane_model, mean_n = durations.lane, durations.mean_n
        # per (task, kind) of the batch: its runs and their mean
        kinds: dict[tuple[str, str], tuple[int, float]] = {}
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
            light = False
            if key_min == 1 and light_s and not quotas:
                command = command_of(action)
                if command:  # (its own runs, else its declaration, else its kind's)
                    light = lane_model.light(action, command, light_s, 0, 0.0)
                else:  # (by its kind: a batch looks each kind's runs up once)
                    k = (action.task, action.kind)
                    runs = kinds.get(k)
                    if runs is None:
                        runs = kinds[k] = mean_n(k)
                    light = lane_model.light(action, "", light_s, *runs)
            append(Pending(action, now, key_min, quotas, False, light, choices))
        return out

    def _request_env(self, trajectory: str) -> None:
        """The trajectory's environment starts now: bind it in open order."""
        self._opening[trajectory] = None
        self._bind_opening()

    def _bind_opening(self) -> bool:
        """Environments that start at open (a pod per trajectory): bind them in open
        order, each holding its memory (and the pool's cores) until it closes. True
        when one was bound."""
        bound = False
        while self._opening:
            trajectory = next(iter(self._opening))
            state = self._trajectories[trajectory]
            if self._cpu.bind(trajectory, state.mem_gb or 0.0, 0) is None:
                break
            del self._opening[trajectory]
            bound = True
        return bound

    def _bind_waiting(self, touched: dict[str, None]) -> None:
        """Bind queued first actions to nodes, in FCFS order (paper 5.2). A first
        action whose environment still waits for a node in open order stays queued
        without blocking the ones behind it (their environments may be bound)."""
        newly = self._bind_opening()
        if not self._unbound or (not newly and self._unbound[0].action.trajectory in self._opening):
            return
        waiting: deque[Pending] = deque()
        unbound, opening = self._unbound, self._opening
        bind, route, resources = self._cpu.bind, self._policy.route, self._resources
        while unbound:
            p = unbound[0]
            action = p.action
            if action.trajectory in opening:
                waiting.append(unbound.popleft())
                continue
            node = bind(action.trajectory, self._trajectory_mem(action), p.key_min)
            if node is None:
                break
            unbound.popleft()
            pool = route(action, resources)
            self._queue_in(pool, action, p.submit_s)
            touched[pool.name] = None
        unbound.extendleft(reversed(waiting))

    def _schedule(self, now: float, pools: Iterable[PoolPoints]) -> list[Effect]:
        # an insertion-ordered set: the pools' passes run in a fixed order (a set of
        # names would follow string hashing, which differs between processes, and the
        # order matters where pools share a quota: same-seed runs must be identical)
        names = {p.name: None for p in pools}
        if self._unbound or self._opening:  # (else binding has nothing to do)
            self._bind_waiting(names)
        out: list[Effect] = []
        for name in list(names):
            out.extend(self._pass(self._pools[name], now))
        return out

    def _pass(self, pool: PoolPoints, now: float) -> list[Effect]:
        """Scheduling passes until nothing more starts. Greedy eviction may leave units
        free that an evicted action could have used (a DP prefix cannot always absorb
        them: an action takes at most 8 GPUs); the next pass offers them again."""
        lane = pool.lane
        out: list[Effect] = []
        if lane is not None:
            out = self._move_off_lane(lane, now)
            if lane.light:
                out.extend(self._lane(pool, now))
        while pool.queue:
            got = self._pass_once(pool, now)
            out.extend(got)
            if not got or pool.free_units() <= 0:
                break
        pool.after_pass(now, self._estimates)  # e.g. a static GPU pool deploys replicas
        return out

    def _pass_once(self, pool: PoolPoints, now: float) -> list[Dispatch]:
        sched = pool.scheduler or self._scheduler
        decisions = sched.plan(pool, now, self._estimates, self._quota)
        if not decisions:
            return []
        # Largest grants first: NUMA placement is easiest while domains are whole.
        if len(decisions) > 1:
            decisions.sort(key=lambda d: -d[1])
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
            riders, batch_s = pool.batch(p, lease.units, now, self._estimates)
            for r in riders:
                del self._queued[r.action.id]
            if riders and batch_s is not None:
                expected = batch_s
            batch = tuple([BatchMember(r.action, r.submit_s) for r in riders]) if riders else ()
            # (positional: no keyword parsing per dispatch; decision_s 0.0, the default)
            d = Dispatch(p.action, lease, p.submit_s, now, expected, 0.0, batch, plan)
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

    def _move_off_lane(self, lane: LightLane, now: float) -> list[Effect]:
        """Actions overstaying the lane leave it (their commands are known long from now
        on), and those moved off it take idle exclusive cores (CpuNodePool)."""
        if lane.lane_slots == 0:
            return []
        moved = {}
        for aid in lane.overstayed(now + _TICK):
            self._estimates.durations.lane.overstaying(self._running[aid].action)
            moved[aid] = ()
            self._lane_moves += 1
        moved.update(lane.book())  # (one moved and booked at once: one effect)
        node = lane.node
        return [Moved(aid, node, cores) for aid, cores in moved.items()]

    def _lane(self, pool: PoolPoints, now: float) -> list[Dispatch]:
        """Start waiting light actions, in order, on the node's lane while it has room,
        then on idle exclusive cores (see CpuNodePool)."""
        out: list[Dispatch] = []
        lane = pool.lane
        assert lane is not None
        light = lane.light
        # (hoisted: a burst starts hundreds here)
        queued, running, started = self._queued, self._running, pool.started
        estimate, lane_lease, core_lease = self._estimates.estimate, lane.lane_lease, lane.core_lease
        full = False  # the lane is full: it stays full for this pass (nothing ends in it)
        queue = pool.queue
        while light:
            p = light[0]
            lease = None if full else lane_lease(p, now)
            if lease is None:
                full = True
                # an idle exclusive core goes to whichever waited first: a light action
                # does not overtake the queue's head (arrival order within the pool)
                if queue and queue[0].submit_s < p.submit_s:
                    break
                lease = core_lease(p)
                if lease is None:
                    break
            light.popleft()
            action = p.action
            aid = action.id
            del queued[aid]
            units = lease.units
            expected = estimate(p)
            d = Dispatch(action, lease, p.submit_s, now, expected)
            p.dispatch, p.pool, p.batch_left = d, pool, None
            running[aid] = p
            started(aid, now + expected, units, now)
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
        out = {"cpu": 0.0, "cpu_lane": 0.0, "gpu": 0.0,
               "mem_gb": sum(n.mem_reserved for n in self._cpu.nodes.values())}
        for pool in self._pools.values():
            for res, units in pool.usage().items():
                out[res] = out.get(res, 0.0) + units
        out.update(self._quota.snapshot())
        return out

    def _capacity(self) -> dict[str, float]:
        out = {"cpu": float(sum(n.cores for n in self._cluster.cpu_nodes)),
               "gpu": float(sum(n.gpus for n in self._cluster.gpu_nodes)),
               "mem_gb": float(sum(n.mem_gb for n in self._cluster.cpu_nodes)),
               "cpu_lane": float(sum(p.lane.lane_slots for p in self._pools.values()
                                     if p.lane is not None))}
        out.update({q.key: q.limit for q in self._cluster.quotas})
        return out

    # -- membership (multi-node executors, e.g. Ray: a node joins or leaves) -----------
    def _add_node(self, spec: CpuNodeSpec, now: float) -> list[Effect]:
        """A CPU node joined: add its capacity and pool; return what can start now
        (trajectories waiting to be bound may fit on it)."""
        pool = self._policy.cpu.grow(self._cpu, spec)  # the pool build would have made for it
        self._pools[pool.name] = pool
        self._lanes = self._lanes_of()
        self._cpu_nodes_changed((*self._cluster.cpu_nodes, spec))
        return self._schedule(now, ())

    def _gpu_node_back(self, node: str, now: float) -> list[Effect]:
        """A GPU node of the cluster that was lost is back: its free GPUs rejoin the pool
        (nothing resident). Returns what can start now. A GPU node the cluster never had
        is refused (the GPU pools are built from the cluster's nodes)."""
        if node not in self._gpu.nodes:
            raise ValueError(f"spec.name: unknown GPU node {node!r} (known: "
                             f"{sorted(self._gpu.nodes)}); a new GPU node needs a restart")
        self._gpu.unfence(node)
        return self._schedule(now, [p for p in self._pools.values() if p.key == "gpu"])

    def _remove_node(self, node: str, now: float) -> list[Effect]:
        """A CPU node left (its machine or its agent died). Idempotent.

        Its capacity goes; trajectories bound there are unbound (their state is gone)
        and their queued actions go back to the binding queue in submit order, so
        they are re-bound elsewhere. Actions *running* there stay running until the
        executor reports each one (failed): it reports them, exactly once, through
        ``Finish``, which then releases nothing. Returns what can start now."""
        name = f"cpu:{node}"
        pool = self._pools.get(name)
        if pool is None or node not in self._cpu.nodes:
            return []
        self._cpu.remove_node(node)
        # The pool stays registered, empty, until its running actions are finished
        # (_finish reschedules the pool it ran on); _add_node of the same name replaces it.
        waiting = sorted(pool.drain(), key=lambda p: p.submit_s)
        requeued = [Pending(p.action, p.submit_s, int(p.action.min("cpu"))) for p in waiting]
        for p in requeued:
            self._queued[p.action.id] = p
        self._unbound = deque(sorted([*self._unbound, *requeued], key=lambda p: p.submit_s))
        self._cpu_nodes_changed(tuple(n for n in self._cluster.cpu_nodes if n.name != node))
        return self._schedule(now, ())

    def _cpu_nodes_changed(self, cpu_nodes: tuple[CpuNodeSpec, ...]) -> None:
        self._cluster = replace(self._cluster, cpu_nodes=cpu_nodes)
        self._max_node_cores = max((n.cores for n in cpu_nodes), default=0)
        self._max_domain = max((n.cores // n.numa for n in cpu_nodes), default=0)
        self._max_node_mem = max((n.mem_gb for n in cpu_nodes), default=0.0)
        self._whole_fits = frozenset(range(1, self._max_domain + 1))
