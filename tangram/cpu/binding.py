"""Binding trajectories to CPU nodes (paper 5.2): the binding queue of first actions whose
trajectory no node holds yet, environments that start at open (a pod per trajectory), and
the reclaim of idle trajectories for waiting ones when a node's free memory is observed
(tangram/cpu/admission.py). The core asks it before every pass (``bind_waiting``) and on
the commands that change what a node holds (open, close, a node joined or lost, memory
observed); binding never waits for a core, only for memory."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter

from tangram.cluster import CpuNodeSpec
from tangram.cpu.limits import NodeLimits
from tangram.cpu.manager import CpuManager
from tangram.model import Action, Pending
from tangram.parts import EnvStart
from tangram.pool import PoolPoints, by_pool
from tangram.protocol import Effect, QueueView, Reclaim, Shed, Waiting
from tangram.trajectory import TrajectoryState

_TRAJECTORY = attrgetter("trajectory")


class Binding:
    """The trajectories waiting for a CPU node, and the binding of them: a side of the core
    (tangram/sides.py: ``Admitting``, ``Observing``)."""

    def __init__(self, cpu: CpuManager, cpu_nodes: Iterable[CpuNodeSpec], env: EnvStart,
                 trajectories: Mapping[str, TrajectoryState], queued: dict[str, Pending],
                 route: Callable[[Action], PoolPoints], node_pool: Callable[[str], PoolPoints],
                 queue_many: Callable[[PoolPoints, list[Action], float], None]) -> None:
        """``route``: the pool an action of a bound trajectory waits in; ``node_pool``: a
        CPU node's pool; ``queue_many``: queue actions in a pool (the core's)."""
        self._cpu = cpu
        self._env = env
        self._trajectories = trajectories
        self._queued = queued
        self._route, self._node_pool, self._queue_many = route, node_pool, queue_many
        #: first actions of trajectories not bound to a node, in submit order
        self.unbound: deque[Pending] = deque()
        #: trajectories whose environment starts at open (the policy's ``env`` part asked
        #: for it) that no node has had room for yet, in open order (an insertion-ordered set)
        self.opening: dict[str, None] = {}
        #: what the CPU nodes can ever hold (validation)
        self.limits = NodeLimits.of(cpu_nodes)
        #: the attached backend frees an idle trajectory's memory when it is reclaimed
        #: (Capabilities.evicts)
        self.evicts = False
        #: idle trajectories unbound for waiting ones (MemoryObserved)
        self.reclaimed = 0
        #: something waits for a node (else binding has nothing to do): a plain attribute,
        #: kept by every change of ``unbound`` and ``opening`` (``_update``), read before
        #: every pass without calling in here (a GPU action's pass runs no CPU code)
        self.waiting = False

    def _update(self) -> None:
        """``unbound`` or ``opening`` changed: whether something waits for a node."""
        self.waiting = bool(self.unbound or self.opening)

    def why_queued(self, p: Pending, state: TrajectoryState) -> str:
        """Why the queued ``p`` waits, when it waits for a node to admit its trajectory
        ("" when it does not)."""
        tid = p.action.trajectory
        if self._cpu.node_of(tid) is not None:
            return ""
        first = any(q is p for q in self.unbound)
        if not first and tid not in self.opening:
            return ""  # e.g. an API call of an unbound trajectory: it waits in its pool
        need = self._trajectory_mem(p.action) if first else (state.mem_gb or 0.0)
        return self._cpu.why_unbound(need)

    def waiting_counts(self) -> tuple[int, int]:
        """What waits for a node (environments that start at open and first actions), and
        the first actions alone."""
        return len(self.opening) + len(self.unbound), len(self.unbound)

    def queue_view(self) -> QueueView:
        return QueueView("binding", "binding", tuple(Waiting(p.action, p.submit_s, p.key_min)
                                                     for p in self.unbound))

    # -- trajectories ------------------------------------------------------------------
    def opened(self, trajectory: str) -> None:
        """``trajectory`` opened: its environment may start now (the policy's ``env``)."""
        self._env.opened(trajectory, self._request_env)

    def closed(self, trajectory: str) -> bool:
        """``trajectory`` closed: its memory is freed. True when that may let a waiting
        trajectory be bound (a pass is due)."""
        self.opening.pop(trajectory, None)
        self._update()
        if self._cpu.node_of(trajectory) is None:
            return False
        self._cpu.unbind(trajectory)
        # freed memory can only unblock binding; cores and quotas are unchanged
        return self.waiting

    def withdraw(self, pending: Pending) -> bool:
        """Take a cancelled ``pending`` off the binding queue (False: it is not there)."""
        if pending in self.unbound:
            self.unbound.remove(pending)
            self._update()
            return True
        return False

    def _trajectory_mem(self, action: Action) -> float:
        state = self._trajectories[action.trajectory]
        return state.mem_gb if state.mem_gb is not None else action.min("mem_gb")

    # -- queueing first actions --------------------------------------------------------
    def queue_fresh(self, fresh: list[Action], now: float,
                    touched: dict[PoolPoints, list[Action]]) -> None:
        """Queue ``fresh``, first CPU actions of trajectories not bound to a node,
        submitted at ``now``. When nothing waits for a node before them, they are bound
        here, in order, until one fits no node: what the pass's ``bind_waiting`` would
        do first (then it stops at that one too), without a Pending in the binding queue
        for each. The pools they are queued in are added to ``touched``. The rest wait in
        the binding queue."""
        bound = 0
        if not self.unbound and not self.opening:
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
                node_pool = {n: self._node_pool(n) for n in set(nodes)}
                done = fresh[:bound] if bound < len(fresh) else fresh
                groups, _ = by_pool(done, list(map(node_pool.__getitem__, nodes)))
                for pool, group in groups.items():
                    self._queue_many(pool, group, now)
                    touched.setdefault(pool, group)
        if bound < len(fresh):
            queued, unbound = self._queued, self.unbound
            for action in fresh[bound:]:
                pending = Pending(action, now, int(action.cost["cpu"].choices[0]))
                queued[action.id] = pending
                unbound.append(pending)
            self._update()

    def _request_env(self, trajectory: str) -> None:
        """The trajectory's environment starts now: bind it in open order."""
        self.opening[trajectory] = None
        self._bind_opening()
        self._update()

    def _bind_opening(self) -> bool:
        """Environments that start at open (a pod per trajectory): bind them in open
        order, each holding its memory (and the pool's cores) until it closes. True
        when one was bound."""
        bound = False
        while self.opening:
            trajectory = next(iter(self.opening))
            state = self._trajectories[trajectory]
            if self._cpu.bind(trajectory, state.mem_gb or 0.0, 0) is None:
                break
            del self.opening[trajectory]
            bound = True
        return bound

    def bind_waiting(self, touched: dict[str, None]) -> None:
        """Bind queued first actions to nodes, in FCFS order (paper 5.2). A first
        action whose environment still waits for a node in open order stays queued
        without blocking the ones behind it (their environments may be bound). The names
        of the pools they are queued in are added to ``touched``."""
        newly = self._bind_opening()
        if not self.unbound or (not newly and self.unbound[0].action.trajectory in self.opening):
            self._update()
            return
        waiting: deque[Pending] = deque()
        unbound, opening = self.unbound, self.opening
        bind, route = self._cpu.bind, self._route
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
            pool = route(action)
            self._queue_many(pool, [action], p.submit_s)
            touched[pool.name] = None
        unbound.extendleft(reversed(waiting))
        self._update()

    # -- memory admission (tangram/cpu/admission.py) -----------------------------------
    def memory_observed(self, node: str, free_gb: float, idle_after_s: float, now: float,
                        schedule: Callable[[], list[Effect]]) -> list[Effect]:
        """``node``'s free memory as just observed: admission goes by it from now on.
        While trajectories wait for a node, idle ones give their place for the first one
        waiting (``_reclaim``) and a scheduling pass follows (``schedule``: every pool's),
        so memory freed by a sandbox's processes (not only by a close) admits them. Still
        short of the headroom after that (no evicting backend freed memory), the node is
        told to shed its largest sandbox (Shed). The effects: the trajectories reclaimed
        (Reclaim), what started (Dispatch), then a Shed."""
        if node not in self._cpu.nodes:
            raise KeyError(f"node: unknown CPU node {node!r}")
        if not free_gb >= 0:
            raise ValueError(f"free_gb: must be >= 0, got {free_gb!r}")
        if not idle_after_s >= 0:
            raise ValueError(f"idle_after_s: must be >= 0, got {idle_after_s!r}")
        self._cpu.observe_free(node, free_gb)
        out: list[Effect] = []
        again = True
        while again and (self.unbound or self.opening):  # someone waits for a node
            reclaimed, again = self._reclaim(node, now, idle_after_s)
            out.extend(Reclaim(t) for t in reclaimed)
            out.extend(schedule())  # binds the first one
        keep = self._cpu.admission.headroom * self._cpu.nodes[node].spec.mem_gb
        freed = self.evicts and any(isinstance(e, Reclaim) for e in out)
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
        if not self.unbound or not self._env.reclaimable:
            return [], False  # e.g. a pod per trajectory holds its place until it closes
        need = self._trajectory_mem(self.unbound[0].action)
        if self._cpu.mem_refusal(host, need) is None:
            return [], False
        idle = sorted((st.last_end, tid) for tid, st in self._trajectories.items()
                      if not st.in_flight and self._cpu.node_of(tid) == node
                      and now - st.last_end >= idle_after_s)
        out: list[str] = []
        for _, tid in idle:
            over_cap = self._cpu.admission.over_cap(host.spec.mem_gb, host.mem_reserved, need)
            if not over_cap and not self.evicts:
                break  # nothing held in memory to free: the shortage is not theirs
            self._cpu.unbind(tid)
            self.reclaimed += 1
            out.append(tid)
            if not over_cap:
                break  # observed shortage: one per observation
            if self._cpu.mem_refusal(host, need) is None:
                return out, True
        return out, False

    # -- membership (multi-node executors, e.g. Ray: a node joins or leaves) -----------
    def node_lost(self, node: str, pool: PoolPoints) -> None:
        """``node`` left: its cores and bindings go; what its ``pool`` queued goes back
        to the binding queue in submit order (re-bound elsewhere)."""
        self._cpu.remove_node(node)
        # The pool stays registered, empty, until its running actions are finished
        # (Tangram._finish reschedules the pool it ran on); a node joining under the same
        # name replaces it.
        waiting = sorted(pool.drain(), key=lambda p: p.submit_s)
        requeued = [Pending(p.action, p.submit_s, int(p.action.min("cpu"))) for p in waiting]
        for p in requeued:
            self._queued[p.action.id] = p
        self.unbound = deque(sorted([*self.unbound, *requeued], key=lambda p: p.submit_s))
        self._update()

    def nodes_changed(self, cpu_nodes: Iterable[CpuNodeSpec]) -> None:
        """The cluster's CPU nodes are now ``cpu_nodes`` (what validation holds to)."""
        self.limits = NodeLimits.of(cpu_nodes)

