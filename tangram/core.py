"""Tangram: the clock-free core. No clock, no I/O, no threads.

Drivers call ``submit`` / ``finish`` / ``poll`` with the current time and get
back the dispatches to start. The same object is driven by the SimPy clock
(sim/) and by the asyncio loop (executor/).

Routing: an action that needs GPUs waits in the GPU pool; one that needs
cores waits in its trajectory's node pool (a trajectory not yet bound waits in
the binding queue first); anything else (API calls) waits in the API pool.
Counted resources (``quota:*``, ``net_mbps``) are checked inside every pool's
candidate prefix and reserved with the action, all or nothing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from tangram.cluster import ClusterSpec, CpuNodeSpec
from tangram.managers.cpu import CpuManager
from tangram.managers.gpu import GpuManager
from tangram.managers.quota import QuotaManager
from tangram.model import QUOTA_PREFIX, Action, Dispatch, Lease, Outcome
from tangram.pools import CpuNodePool, GpuPool, Pending, Pool
from tangram.scheduler import ElasticScheduler

API_POOL = "api"
GPU_POOL = "gpu"


@dataclass(slots=True)
class TrajectoryState:
    task: str
    mem_gb: float | None
    in_flight: set[str] = field(default_factory=set)
    #: while it thinks (LLM generation): the pool of its last action, when and of what
    #: (task, kind) that ended, and how likely it is to submit another action at all
    thinking_in: Pool | None = None
    last_end: float = 0.0
    last_kind: tuple[str, str] = ("", "")
    will_continue: float = 0.0


@dataclass(slots=True)
class Running:
    dispatch: Dispatch
    pool: Pool
    pending: Pending


class Tangram:
    """The action-level resource manager's state machine."""

    def __init__(self, cluster: ClusterSpec, scheduler: ElasticScheduler | None = None,
                 default_duration_s: float = 1.0) -> None:
        self.cluster = cluster
        self.scheduler = scheduler or ElasticScheduler()
        self.default_duration_s = default_duration_s
        self.cpu = CpuManager(cluster.cpu_nodes)
        self.gpu = GpuManager(cluster.gpu_nodes, cluster.services, cluster.restore_gbps)
        self.quota = QuotaManager(cluster.quotas)
        self.pools: dict[str, Pool] = {p.name: p for p in self._build_pools()}
        self.unbound: deque[Pending] = deque()
        self.trajectories: dict[str, TrajectoryState] = {}
        self.queued: dict[str, Pending] = {}
        self.running: dict[str, Running] = {}
        self._mean: dict[tuple[str, str], tuple[int, float]] = {}
        self._t1_mean: dict[tuple[str, str], tuple[int, float]] = {}
        #: moving average of think time (LLM generation between actions), all trajectories
        self._think_s = 5.0
        #: (task, kind) -> (times a trajectory submitted again after it, times observed)
        self._follow: dict[tuple[str, str], tuple[int, int]] = {}
        self._max_node_cores = max((n.cores for n in cluster.cpu_nodes), default=0)
        self._max_domain = max((n.cores // n.numa for n in cluster.cpu_nodes), default=0)
        self._max_node_mem = max((n.mem_gb for n in cluster.cpu_nodes), default=0.0)
        #: scheduling passes that dispatched something, and their total wall seconds
        self.passes = 0
        self.pass_s = 0.0

    def _build_pools(self) -> list[Pool]:
        """One pool per CPU node (paper 5.2), one for the GPU cluster, one for APIs."""
        pools: list[Pool] = [CpuNodePool(f"cpu:{n}", n, self.cpu) for n in self.cpu.nodes]
        pools.append(GpuPool(GPU_POOL, self.gpu))
        pools.append(Pool(API_POOL))
        return pools

    # -- trajectories ------------------------------------------------------------------
    def open_trajectory(self, trajectory: str, task: str = "default",
                        mem_gb: float | None = None) -> None:
        """Register a trajectory. ``mem_gb`` is reserved on its node for its whole
        life (None: the memory demand of its first CPU action)."""
        if not trajectory:
            raise ValueError("trajectory: must be a non-empty string")
        if trajectory in self.trajectories:
            raise ValueError(f"trajectory: {trajectory!r} is already open")
        if mem_gb is not None and (mem_gb != mem_gb or mem_gb < 0):
            raise ValueError(f"mem_gb: must be >= 0, got {mem_gb!r}")
        if mem_gb is not None and self.cluster.cpu_nodes and mem_gb > self._max_node_mem:
            raise ValueError(f"mem_gb: {mem_gb} GB exceeds the largest node ({self._max_node_mem})")
        self.trajectories[trajectory] = TrajectoryState(task, mem_gb)

    def close_trajectory(self, trajectory: str, now: float) -> list[Dispatch]:
        """Release the trajectory's memory. Refused while actions are in flight."""
        state = self.trajectories.get(trajectory)
        if state is None:
            raise KeyError(f"trajectory: unknown trajectory {trajectory!r}")
        if state.in_flight:
            raise ValueError(
                f"trajectory: {trajectory!r} still has {len(state.in_flight)} action(s) in flight"
            )
        del self.trajectories[trajectory]
        if state.thinking_in is not None:  # it ended after that kind of action
            state.thinking_in.thinking -= state.will_continue
            self._followed(state.last_kind, False)
        if self.cpu.node_of(trajectory) is None:
            return []
        self.cpu.unbind(trajectory)
        # freed memory can only unblock binding; cores and quotas are unchanged
        return self._schedule(now, ()) if self.unbound else []

    # -- actions -----------------------------------------------------------------------
    def validate(self, action: Action) -> None:
        """Raise ValueError naming the field when ``action`` can never run here."""
        if not isinstance(action, Action):
            raise ValueError(f"action: expected an Action, got {type(action).__name__}")
        if action.id in self.queued or action.id in self.running:
            raise ValueError(f"action.id: duplicate id {action.id!r}")
        if action.trajectory not in self.trajectories:
            raise KeyError(f"action.trajectory: unknown trajectory {action.trajectory!r} "
                           "(open it first)")
        for res, demand in action.cost.items():
            if res.startswith(QUOTA_PREFIX) or res == "net_mbps":
                if demand.min > 0:
                    spec = self.quota.check(res)
                    if demand.min > spec.limit:
                        raise ValueError(f"cost[{res!r}]: {demand.min} exceeds the quota "
                                         f"limit {spec.limit}")
        if action.min("gpu") > 0:
            reasons = [self.gpu.check(action.service or "", int(u))
                       for u in action.cost["gpu"].choices]
            if all(reasons):  # no feasible GPU count can serve it
                raise ValueError(reasons[-1])
        elif action.min("cpu") > 0:
            need = action.min("cpu")
            if need != int(need):
                raise ValueError(f"cost['cpu']: cores must be whole, got {need}")
            limit = self._max_domain if action.elastic == "cpu" else self._max_node_cores
            if need > limit:
                raise ValueError(f"cost['cpu']: minimum {need} cores can never fit "
                                 f"(largest {'NUMA domain' if action.elastic else 'node'}: "
                                 f"{limit})")
            mem = self._trajectory_mem(action)
            if mem > self._max_node_mem:
                raise ValueError(f"cost['mem_gb']: {mem} GB exceeds the largest node "
                                 f"({self._max_node_mem} GB)")

    def submit(self, action: Action, now: float) -> list[Dispatch]:
        """Queue ``action`` and return what can start now."""
        return self.submit_many([action], now)

    def submit_many(self, actions: Iterable[Action], now: float) -> list[Dispatch]:
        """Queue a batch (e.g. a step's reward requests) with one scheduling pass per
        pool touched. All or nothing: one invalid action queues none of them."""
        actions = list(actions)
        ids = [a.id for a in actions]
        if len(set(ids)) != len(ids):
            raise ValueError("action.id: duplicate ids in the batch")
        for action in actions:
            self.validate(action)
        touched: dict[str, Pool] = {}
        for action in actions:
            pool = self._enqueue(action, now)
            if pool is not None:
                touched[pool.name] = pool
        return self._schedule(now, touched.values())

    def _enqueue(self, action: Action, now: float) -> Pool | None:
        pool = self._route(action)
        state = self.trajectories[action.trajectory]
        if state.thinking_in is not None:  # it stopped thinking: learn how long that took
            state.thinking_in.thinking -= state.will_continue
            state.thinking_in = None
            self._think_s += 0.05 * ((now - state.last_end) - self._think_s)
            self._followed(state.last_kind, True)
        state.in_flight.add(action.id)
        if pool is None:  # first CPU action of a trajectory: bind it to a node first
            pending = Pending(action, now, int(action.min("cpu")))
            self.queued[action.id] = pending
            self.unbound.append(pending)
            return None
        pending = self._pending(action, now, pool)
        self.queued[action.id] = pending
        pool.queue.append(pending)
        return pool

    def _route(self, action: Action) -> Pool | None:
        """The pool whose queue ``action`` waits in (None: not bound to a node yet)."""
        if action.min("gpu") > 0:
            return self.pools[GPU_POOL]
        if action.min("cpu") > 0:
            node = self.cpu.node_of(action.trajectory)
            return None if node is None else self.pools[f"cpu:{node}"]
        return self.pools[API_POOL]

    def finish(self, action_id: str, now: float, outcome: Outcome | None = None) -> list[Dispatch]:
        """Release what ``action_id`` held and return what can start now."""
        run = self.running.pop(action_id, None)
        if run is None:
            raise KeyError(f"action_id: {action_id!r} is not running")
        action = run.dispatch.action
        run.pool.running.pop(action_id, None)
        self._release(run.pool, run.dispatch.lease)
        state = self.trajectories.get(action.trajectory)
        if state is not None:
            state.in_flight.discard(action_id)
            if not state.in_flight and run.pool.key is not None:
                state.thinking_in = run.pool  # its next action will most likely come here
                state.last_end = now
                state.last_kind = (action.task, action.kind)
                state.will_continue = self._continue_p(state.last_kind)
                run.pool.thinking += state.will_continue
        if outcome is None or outcome.ok:
            elapsed = now - run.dispatch.start_s - run.dispatch.lease.restore_s
            self._learn(action, run.dispatch.units, max(elapsed, 0.0))
            if not run.pending.elastic:
                run.pool.short_s += 0.05 * (elapsed - run.pool.short_s)
        touched: Iterable[Pool] = [run.pool]
        if run.pending.quotas:  # freed quota may unblock any pool's head
            touched = self.pools.values()
        return self._schedule(now, touched)

    def cancel(self, action_id: str) -> bool:
        """Drop a queued action (True) — running ones must be finished by their backend."""
        pending = self.queued.pop(action_id, None)
        if pending is None:
            return False
        for q in [self.unbound, *(p.queue for p in self.pools.values())]:
            if pending in q:
                q.remove(pending)
                break
        state = self.trajectories.get(pending.action.trajectory)
        if state:
            state.in_flight.discard(action_id)
        return True

    def poll(self, now: float) -> list[Dispatch]:
        """Re-run every pool (window quotas regain room as time passes)."""
        return self._schedule(now, self.pools.values())

    def next_wakeup(self, now: float) -> float | None:
        """When a time-based quota frees up while something waits (else None)."""
        if not self.queued:
            return None
        return self.quota.next_expiry(now)

    # -- estimates ---------------------------------------------------------------------
    def estimate(self, p: Pending) -> float:
        """Expected duration at the minimum: profiled T1, else the running mean."""
        if p.durations:
            return p.durations[p.key_min]
        if p.action.t1_s is not None:
            return p.action.duration(p.key_min)  # type: ignore[return-value]
        mean = self._mean.get((p.action.task, p.action.kind))
        return mean[1] if mean else self.default_duration_s

    def expected_arrivals(self, pool: Pool, now: float,
                          limit: int) -> list[tuple[float, int, float]]:
        """The next actions of the trajectories thinking on ``pool``: spread over one mean
        think time (remaining think is about uniform), one unit each, the pool's mean
        duration of non-elastic actions."""
        n = int(pool.thinking)  # expected number of trajectories that will come back
        if n <= 0 or limit <= 0:
            return []
        step = self._think_s / n
        return [(now + step * (k + 0.5), 1, pool.short_s) for k in range(min(n, limit))]

    def _continue_p(self, key: tuple[str, str]) -> float:
        """How often a trajectory submitted again after an action of this (task, kind)
        (a reward is usually last); Laplace prior 1/2."""
        cont, total = self._follow.get(key, (0, 0))
        return (cont + 1) / (total + 2)

    def _followed(self, key: tuple[str, str], continued: bool) -> None:
        cont, total = self._follow.get(key, (0, 0))
        self._follow[key] = (cont + continued, total + 1)

    def _learn(self, action: Action, units: int, elapsed: float) -> None:
        key = (action.task, action.kind)
        n, mean = self._mean.get(key, (0, 0.0))
        self._mean[key] = (n + 1, mean + (elapsed - mean) / (n + 1))
        if action.elasticity is not None and action.elastic:
            t1 = elapsed * action.elasticity.efficiency(units) * units  # back to one unit
            n, mean = self._t1_mean.get(key, (0, 0.0))
            self._t1_mean[key] = (n + 1, mean + (t1 - mean) / (n + 1))

    # -- internals ---------------------------------------------------------------------
    def _trajectory_mem(self, action: Action) -> float:
        state = self.trajectories[action.trajectory]
        return state.mem_gb if state.mem_gb is not None else action.min("mem_gb")

    def _pending(self, action: Action, now: float, pool: Pool) -> Pending:
        quotas = {k: d.min for k, d in action.cost.items()
                  if (k.startswith(QUOTA_PREFIX) or k == "net_mbps") and d.min > 0}
        if pool.key is None:
            return Pending(action, now, 0, quotas)
        sched = pool.scheduler or self.scheduler
        choices = pool.unit_choices(action)
        if action.elastic != pool.key or not choices:
            return Pending(action, now, int(choices[0] if choices else action.min(pool.key)),
                           quotas)
        t1 = action.t1_s
        if t1 is None and action.elasticity is not None:
            # Beyond the paper: an unprofiled elastic action whose E(m) is known gets
            # T1 from the running mean of its (task, kind), once one has completed.
            learned = self._t1_mean.get((action.task, action.kind))
            t1 = learned[1] if learned else None
        elastic = (t1 is not None and action.elasticity is not None and len(choices) > 1
                   and sched.elastic_enabled)
        durations = ({u: t1 / (action.elasticity.efficiency(u) * u) for u in choices}
                     if elastic else {})
        return Pending(action, now, sched.min_units(choices), quotas,
                       elastic=elastic, choices=choices, durations=durations)

    def _bind_waiting(self, touched: set[str]) -> None:
        """Bind queued first actions to nodes, in FCFS order (paper 5.2)."""
        while self.unbound:
            p = self.unbound[0]
            mem = self._trajectory_mem(p.action)
            node = self.cpu.bind(p.action.trajectory, mem, p.key_min)
            if node is None:
                return
            self.unbound.popleft()
            pool = self._route(p.action)
            pending = self._pending(p.action, p.submit_s, pool)
            self.queued[p.action.id] = pending
            pool.queue.append(pending)
            touched.add(pool.name)

    def _schedule(self, now: float, pools: Iterable[Pool]) -> list[Dispatch]:
        names = {p.name for p in pools}
        self._bind_waiting(names)
        out: list[Dispatch] = []
        for name in list(names):
            out.extend(self._pass(self.pools[name], now))
        return out

    def _pass(self, pool: Pool, now: float) -> list[Dispatch]:
        """Scheduling passes until nothing more starts. Greedy eviction may leave units
        free that an evicted action could have used (a DP prefix cannot always absorb
        them: an action takes at most 8 GPUs); the next pass offers them again."""
        out: list[Dispatch] = []
        while pool.queue:
            got = self._pass_once(pool, now)
            out.extend(got)
            if not got or pool.free_units() <= 0:
                return out
        return out

    def _pass_once(self, pool: Pool, now: float) -> list[Dispatch]:
        t0 = time.perf_counter()
        sched = pool.scheduler or self.scheduler
        decisions = sched.plan(pool, self._quota_free(now), now, self.estimate,
                               self.expected_arrivals)
        if not decisions:
            return []
        # Largest grants first: NUMA placement is easiest while domains are whole.
        decisions.sort(key=lambda d: -d[1])
        granted: list[tuple[Pending, Lease]] = []
        for p, units in decisions:
            lease = self._reserve(pool, p, units, now)
            if lease is not None:
                granted.append((p, lease))
        started = {id(p) for p, _ in granted}
        queue = pool.queue
        while queue and id(queue[0]) in started:  # dispatches are mostly a queue prefix
            started.discard(id(queue.popleft()))
        for p in [p for p, _ in granted if id(p) in started]:
            queue.remove(p)
        decision_s = (time.perf_counter() - t0) / max(len(granted), 1)
        self.passes += 1
        self.pass_s += time.perf_counter() - t0
        out = []
        for p, lease in granted:
            del self.queued[p.action.id]
            expected = p.durations.get(lease.units) or (
                p.action.duration(lease.units) if p.action.t1_s is not None else self.estimate(p))
            d = Dispatch(p.action, lease, p.submit_s, now, expected, decision_s)
            self.running[p.action.id] = Running(d, pool, p)
            pool.running[p.action.id] = (now + lease.restore_s + (expected or 0.0), lease.units,
                                         now)
            out.append(d)
        return out

    def _quota_free(self, now: float):
        return lambda: {k: self.quota.available(k, now) for k in self.quota.specs}

    def _reserve(self, pool: Pool, p: Pending, units: int, now: float) -> Lease | None:
        """Pool units then quotas, all or nothing. NUMA placement may refuse the
        planned count: fall back to smaller feasible counts down to the minimum."""
        tries = [units] + [u for u in reversed(p.choices) if p.key_min <= u < units]
        for u in tries:
            grant = pool.reserve(p, u, now)
            if grant is None:
                continue
            qlease = None
            if p.quotas:
                qlease = self.quota.reserve(p.action.id, p.quotas, now)
                if qlease is None:
                    pool.release(grant.part)
                    return None
            return Lease(p.action.id, u, (grant.part, qlease), grant.node, grant.cores,
                         grant.gpus, grant.restore_s)
        return None

    def _release(self, pool: Pool, lease: Lease) -> None:
        part, qlease = lease.parts
        if qlease is not None:
            self.quota.release(qlease)
        if part is not None:
            pool.release(part)

    # -- introspection -----------------------------------------------------------------
    def usage(self) -> dict[str, float]:
        """Units in use per resource (for utilisation sampling)."""
        out = {"cpu": float(sum(self.cpu.in_use(n) for n in self.cpu.nodes)),
               "gpu": float(self.gpu.busy_gpus()),
               "mem_gb": sum(n.mem_reserved for n in self.cpu.nodes.values())}
        out.update(self.quota.snapshot())
        return out

    def capacity(self) -> dict[str, float]:
        out = {"cpu": float(sum(n.cores for n in self.cluster.cpu_nodes)),
               "gpu": float(sum(n.gpus for n in self.cluster.gpu_nodes)),
               "mem_gb": float(sum(n.mem_gb for n in self.cluster.cpu_nodes))}
        out.update({q.key: q.limit for q in self.cluster.quotas})
        return out

    # -- membership (multi-node executors, e.g. Ray: a node joins or leaves) -----------
    def add_node(self, spec: CpuNodeSpec, now: float) -> list[Dispatch]:
        """A CPU node joined: add its capacity and pool; return what can start now
        (trajectories waiting to be bound may fit on it)."""
        self.cpu.add_node(spec)
        name = f"cpu:{spec.name}"
        # built the way the constructor builds pools, so a policy's pool settings apply
        self.pools[name] = next(p for p in self._build_pools() if p.name == name)
        self._cpu_nodes_changed((*self.cluster.cpu_nodes, spec))
        return self._schedule(now, ())

    def remove_node(self, node: str, now: float) -> list[Dispatch]:
        """A CPU node left (its machine or its agent died). Idempotent.

        Its capacity goes; trajectories bound there are unbound (their state is gone)
        and their queued actions go back to the binding queue in submit order, so
        they are re-bound elsewhere. Actions *running* there stay running until the
        executor reports each one (failed): it reports them, exactly once, through
        ``finish``, which then releases nothing. Returns what can start now."""
        name = f"cpu:{node}"
        pool = self.pools.get(name)
        if pool is None or node not in self.cpu.nodes:
            return []
        self.cpu.remove_node(node)
        # The pool stays registered, empty, until its running actions are finished
        # (finish reschedules the pool it ran on); add_node of the same name replaces it.
        requeued = [Pending(p.action, p.submit_s, int(p.action.min("cpu"))) for p in pool.queue]
        pool.queue.clear()
        for p in requeued:
            self.queued[p.action.id] = p
        self.unbound = deque(sorted([*self.unbound, *requeued], key=lambda p: p.submit_s))
        self._cpu_nodes_changed(tuple(n for n in self.cluster.cpu_nodes if n.name != node))
        return self._schedule(now, ())

    def _cpu_nodes_changed(self, cpu_nodes: tuple[CpuNodeSpec, ...]) -> None:
        self.cluster = replace(self.cluster, cpu_nodes=cpu_nodes)
        self._max_node_cores = max((n.cores for n in cpu_nodes), default=0)
        self._max_domain = max((n.cores // n.numa for n in cpu_nodes), default=0)
        self._max_node_mem = max((n.mem_gb for n in cpu_nodes), default=0.0)
