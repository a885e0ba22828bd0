"""A CPU node's pool (paper 5.2: one pass per node), with its light lane."""

from __future__ import annotations

from collections import deque
from typing import Any

from tangram.arrange import LinearOperator
from tangram.cpu.lane import TICK, LightTest, lane_pass, light_test
from tangram.cpu.manager import CpuLease, CpuManager, pick_domains
from tangram.estimates import DurationModel
from tangram.model import Action, Lease, Pending
from tangram.pool import Books, Grant, LaneSlot, Pool, PoolScheduler
from tangram.protocol import Effect


class CpuNodePool(Pool):
    """One CPU node (paper 5.2), with a light lane (beyond the paper): the pool is its own
    lane, implementing the optional ``LightLane`` point (tangram/pool.py) whether or not
    the lane has slots (``light_s`` 0: it has none, and every action queues as in any pool).

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

    An action the pool expected light may not be (a command never seen, a wrong
    declaration): one still running ``hold_s`` after it started on the lane is *moved* off
    it. Its place on the lane is free at once (the next light action starts),
    and it is accounted on the node's exclusive cores from then on: it takes an idle core
    now (the backend runs it there, at the exclusive actions' priority), or the first core
    that frees, before the queue (it is running: finishing it frees what it uses); until
    then it runs on at the lowest priority, yielding to every exclusive action, and
    counts on no core. We chose this over leaving it on the lane (one slow command held
    the only slot) and over killing and requeueing it (its work lost, and a
    command may not be safe to run twice). So a light action waits at most ``hold_s`` per
    ``lane_slots`` actions ahead of it on the lane, whatever runs on the cores.
    """

    key = "cpu"
    operator = LinearOperator()

    def __init__(self, name: str, node: str, manager: CpuManager,
                 scheduler: PoolScheduler | None = None, light_s: float = 0.0,
                 lane_slots: int = 0, hold_s: float = 1.0) -> None:
        super().__init__(name, scheduler)
        self.node = node
        self.manager = manager
        self.host = manager.nodes[node]
        #: actions expected to take at most this long (s) may use the lane (0: no lane)
        self.light_s = light_s
        self.lane_slots = lane_slots if light_s > 0 else 0
        #: the longest an action holds a place on the lane (then it is moved off)
        self.hold_s = hold_s
        #: action id -> when it overstays, of the actions on the lane (in start order, so
        #: the first is the first to overstay)
        self._lane: dict[str, float] = {}
        #: actions moved off the lane waiting for an exclusive core, in the order they
        #: left it (an insertion-ordered set), and those holding one, with its lease
        self._waiting: dict[str, None] = {}
        self._booked: dict[str, CpuLease] = {}
        self._all_cores = tuple(range(self.host.spec.cores))
        self._choices: dict[tuple[float, ...], tuple[int, ...]] = {}
        #: light actions wait here, for the lane (or an idle core), never behind the queue
        self.light: deque[Pending] = deque()

    def admit(self, p: Pending) -> None:
        (self.light if p.light and self.lane_slots else self.queue).append(p)

    def admit_many(self, ps: list[Pending], now: float) -> None:
        # (admit, in one loop; ``arrived`` is the base's: nothing to do)
        to_queue = self.queue.append
        if not self.lane_slots:
            for p in ps:
                to_queue(p)
            return
        to_lane = self.light.append
        for p in ps:
            if p.light:
                to_lane(p)
            else:
                to_queue(p)

    def queues(self) -> tuple[deque[Pending], ...]:
        return (self.queue, self.light)

    def drain(self) -> list[Pending]:
        self.lane_slots = 0  # no capacity left to report
        # its running actions end as failed (Tangram._remove_node): none is moved or booked
        self._lane.clear()
        self._waiting.clear()
        self._booked.clear()
        return super().drain()

    # The lane's two leases are built here, as the core builds one from a grant (a light
    # action holds no quota: no quota lease), without the Grant in between: a burst
    # starts hundreds, and a frozen value costs ~1/4 of a lane dispatch to build.
    def lane_lease(self, p: Pending, now: float) -> Lease | None:
        """``p``'s lease of a place on the lane from ``now`` (None: the lane is full)."""
        if len(self._lane) >= self.lane_slots:
            return None
        aid = p.action.id
        self._lane[aid] = now + self.hold_s
        # (positional: units 0, gpus (), restore_s 0.0, lane)
        return Lease(aid, 0, (LaneSlot(aid, self.node), None), self.node, self._all_cores, (),
                     0.0, True)

    def core_lease(self, p: Pending) -> Lease | None:
        """``p``'s lease of one idle exclusive core (None: none is idle): what ``reserve``
        grants for one unit."""
        aid = p.action.id
        lease = self.manager.reserve(aid, self.node, 1, p.elastic)
        if lease is None:
            return None
        return Lease(aid, 1, (lease, None), self.node, lease.cores)

    def overstayed(self, now: float) -> list[str]:
        """The lane's actions running ``hold_s`` or longer at ``now``, in start order: they
        leave the lane (their places are free) and wait for an exclusive core (``book``)."""
        lane = self._lane
        out: list[str] = []
        for aid, until in lane.items():  # (in start order: stops at the first not due)
            if until > now:
                break
            out.append(aid)
        for aid in out:
            del lane[aid]
            self._waiting[aid] = None
        return out

    def book(self) -> list[tuple[str, tuple[int, ...]]]:
        """Actions moved off the lane that now get an exclusive core (while one is idle),
        in the order they left it: (action id, the core)."""
        out: list[tuple[str, tuple[int, ...]]] = []
        waiting = self._waiting
        while waiting and self.host.free_cores:
            aid = next(iter(waiting))
            lease = self.manager.reserve(aid, self.node, 1, False)
            if lease is None:
                break
            del waiting[aid]
            self._booked[aid] = lease
            end, _, start = self.running[aid]
            self.started(aid, end, 1, start)  # (the objective sees the core it holds)
            out.append((aid, lease.cores))
        return out

    def lane_wakeup(self) -> float | None:
        """When the next action on the lane overstays (None: none runs there)."""
        return next(iter(self._lane.values()), None)  # (in start order)

    def light_test(self, durations: DurationModel) -> LightTest:
        return light_test(self.light_s, durations)

    def due(self, now: float) -> bool:
        at = self.lane_wakeup()
        return at is not None and at <= now + TICK

    def run(self, now: float, books: Books) -> list[Effect]:
        return lane_pass(self, now, books)

    def unit_choices(self, action: Action) -> tuple[int, ...]:
        # elastic actions stay inside one NUMA domain; cached per feasible set (a burst
        # of thousands asks for a few distinct ones), bounded as a set of ranges is
        choices = action.cost["cpu"].choices
        got = self._choices.get(choices)
        if got is None:
            cap = self.host.domain_size
            got = tuple(int(c) for c in choices if c <= cap)
            if len(self._choices) < 4096:
                self._choices[choices] = got
        return got

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
        return Grant(lease, self.node, lease.cores)

    def release(self, part: Any) -> None:
        if isinstance(part, LaneSlot):
            aid = part.action_id
            if self._lane.pop(aid, None) is None:  # (mostly: it ended on the lane)
                self._waiting.pop(aid, None)
                lease = self._booked.pop(aid, None)
                if lease is not None:
                    self.manager.release(lease)
            return
        self.manager.release(part)

    def usage(self) -> dict[str, float]:
        # (a core held by an action moved off the lane is in the manager's count)
        return {"cpu": float(self.manager.in_use(self.node)), "cpu_lane": float(len(self._lane))}
