"""GPU pools (paper 5.3, evict-on-execution): all services on one pool of aligned
chunks, batching requests; :class:`EoeGpuPool` with the state of the EOE scheduler
(tangram/gpu/eoe.py)."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from tangram.arrange import ChunkOperator, take_chunk
from tangram.estimates import Estimates
from tangram.gpu.batching import DEFAULT_BATCHING, BatchModel
from tangram.gpu.manager import GpuLease, GpuManager
from tangram.model import Action, Pending
from tangram.pool import Grant, Pool, PoolScheduler


def accepts(p: Pending) -> tuple[int, ...]:
    """The GPU counts ``p`` may run on (a non-elastic request: its one amount)."""
    return p.choices or (p.key_min,)


def solo_s(p: Pending, units: int, estimates: Estimates) -> float:
    """Expected time of ``p`` alone on ``units`` GPUs."""
    d = p.durations.get(units)
    return d if d is not None else estimates.duration(p.action, units, p.durations)


def work_s(p: Pending, estimates: Estimates) -> float:
    """One-GPU seconds of ``p`` (what a batch's token budget counts)."""
    if p.action.t1_s is not None:
        return p.action.t1_s
    return solo_s(p, p.key_min, estimates) * p.key_min


def take_riders(queue: deque[Pending], lead: Pending, units: int, estimates: Estimates,
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


def by_service(ps: Iterable[Pending]) -> dict[str, list[Pending]]:
    """``ps`` by the service they call, in order, the services in the order first called."""
    out: dict[str, list[Pending]] = {}
    for p in ps:
        service = p.action.service or ""
        group = out.get(service)
        if group is None:
            out[service] = [p]
        else:
            group.append(p)
    return out


def batch_expected(lead: Pending, riders: list[Pending], units: int, estimates: Estimates,
                   batching: BatchModel) -> float:
    return batching.batch_s([solo_s(q, units, estimates) for q in (lead, *riders)])


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

    def add_many(self, service: str, works: Iterable[float], now: float) -> None:
        """Add each of ``works`` of ``service``, in order (a burst adds thousands)."""
        v = self.value(service, now)
        for work in works:  # (in order, one at a time: the sum add gave)
            v += work
        self._value[service] = v
        self._at[service] = now
        if self._shares:
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
    the burst-proof rules of tangram/gpu/eoe.py.
    """

    key = "gpu"
    operator = ChunkOperator()

    def __init__(self, name: str, manager: GpuManager, scheduler: PoolScheduler | None = None,
                 batching: BatchModel = DEFAULT_BATCHING) -> None:
        super().__init__(name, scheduler)
        self.manager = manager
        self.batching = batching
        self.demand = ServiceDemand()
        #: service -> the GPU counts its latest request accepted
        self.accepted: dict[str, tuple[int, ...]] = {}
        self.total_gpus = sum(n.spec.gpus for n in manager.nodes.values())
        self._choices: dict[tuple[str, tuple[float, ...]], tuple[int, ...]] = {}

    def unit_choices(self, action: Action) -> tuple[int, ...]:
        # (the manager's feasible counts, cached here too, a lookup with no call: a burst
        # asks for every request; through the manager's cache, ~10 more opcodes each)
        key = (action.service or "", action.cost["gpu"].choices)
        got = self._choices.get(key)
        if got is None:
            got = self.manager.feasible(*key)[0]
            if key[0] in self.manager.services:  # bounded, as the manager's
                self._choices[key] = got
        return got

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
        self._arrived((p,), now)

    def admit_many(self, ps: list[Pending], now: float) -> None:
        self.queue.extend(ps)  # (admit each; ``_arrived`` does not read the queue)
        self._arrived(ps, now)

    def _arrived(self, ps: Sequence[Pending], now: float) -> None:
        """``ps``, in order, arrived at ``now`` (a service at a time: a burst queues
        thousands)."""
        self._requested(by_service(ps), now)

    def _requested(self, groups: dict[str, list[Pending]], now: float) -> None:
        """Requests arrived at ``now``, by service (``by_service``): the counts each accepts
        and the demand."""
        for service, group in groups.items():
            last = group[-1]
            self.accepted[service] = accepts(last)
            # (work_s is the declared T1 when there is one)
            self.demand.add_many(service, [1.0 if p.action.t1_s is None else p.action.t1_s
                                           for p in group], now)

    def reserve(self, p: Pending, units: int, now: float) -> Grant | None:
        lease = self.manager.reserve(p.action.id, p.action.service or "", units, now)
        return None if lease is None else self._grant(lease)

    @staticmethod
    def _grant(lease: GpuLease) -> Grant:
        return Grant(lease, lease.node, (), lease.gpus, lease.restore_s, False, lease.plan)

    def batch(self, p: Pending, units: int, now: float,
              estimates: Estimates) -> tuple[list[Pending], float | None]:
        riders = take_riders(self.queue, p, units, estimates, self.batching)
        return self._batch(p, riders, units, estimates)

    def _batch(self, p: Pending, riders: list[Pending], units: int,
               estimates: Estimates) -> tuple[list[Pending], float | None]:
        if not riders:
            return [], None
        return riders, batch_expected(p, riders, units, estimates, self.batching)

    def release(self, part: Any) -> None:
        self.manager.release(part)

    def usage(self) -> dict[str, float]:
        return {"gpu": float(self.manager.busy_gpus())}


class EoeGpuPool(GpuPool):
    """The ``tangram`` policy's GPU pool and the state of its scheduler,
    :class:`tangram.gpu.eoe.EoeScheduler`: it keeps each service's queue in order
    (``waiting``), lets the scheduler place whole batches on chosen chunks
    (``plan_batch``), remembers the requests that wait by choice for a busy variant of
    their own (``defer``) and learns request rates."""

    def __init__(self, name: str, manager: GpuManager, scheduler: PoolScheduler | None,
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
        #: services ordered by their oldest waiting request, kept incrementally (only a
        #: service whose head may have changed is looked at again): ``_heads`` holds each
        #: one's (submit time, arrival number, first-arrival index) - the key the order
        #: sorts by - and ``_dirty`` the services to look at on the next ``groups()``
        self._order: list[tuple[float, int, int, str]] = []
        #: each service's queue in ``_order``'s order (what ``groups`` returns), kept with it
        self._groups: list[deque[Pending]] = []
        self._heads: dict[str, tuple[float, int, int, str]] = {}
        self._dirty: set[str] = set()
        self._index: dict[str, int] = {}

    def _arrived(self, ps: Sequence[Pending], now: float) -> None:
        groups = by_service(ps)
        self._requested(groups, now)
        # each service's queue, a service at a time; the arrival numbers in C loops
        keys = list(map(id, ps))
        self._queued.update(keys)
        n = self._arrivals
        self._seq.update(zip(keys, range(n, n + len(keys)), strict=True))
        self._arrivals = n + len(keys)
        waiting, count = self.waiting, self._count
        for service, group in groups.items():
            q = waiting.get(service)
            if q is None:
                q = waiting[service] = deque()
                self._index[service] = len(self._index)
            if not q:  # its first becomes its service's oldest
                self._dirty.add(service)
            q.extend(group)
            count[service] = count.get(service, 0) + len(group)

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
            self._dirty.update(self.waiting)
        if self._dirty:
            self._reorder()
        return list(self._groups)

    def _reorder(self) -> None:
        """Prune the taken requests off the front of each service whose head may have
        changed, and move it to its new place in ``_order`` (or out of it)."""
        queued, seq, order, groups = self._queued, self._seq, self._order, self._groups
        for service in self._dirty:
            q = self.waiting[service]
            while q and id(q[0]) not in queued:  # taken by an earlier pass
                q.popleft()
            old = self._heads.pop(service, None)
            if old is not None:
                i = bisect_left(order, old)
                del order[i]
                del groups[i]
            if q:
                head = (q[0].submit_s, seq.get(id(q[0]), 0), self._index[service], service)
                self._heads[service] = head
                i = bisect_right(order, head)  # (insort's place)
                order.insert(i, head)
                groups.insert(i, q)
        self._dirty.clear()

    def waiting_services(self) -> Collection[str]:
        """The services with requests waiting as of the last ``groups()`` (a live view:
        read it before the next)."""
        return self._heads.keys()

    def waiting_count(self, service: str) -> int:
        return self._count.get(service, 0)

    def plan_batch(self, lead: Pending, lease: GpuLease, riders: list[Pending]) -> None:
        """The EOE scheduler placed ``lead`` (and ``riders``) on ``lease``."""
        self._planned[lead.action.id] = (lease, riders, lead)
        service = lead.action.service or ""
        self._dirty.add(service)
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
              estimates: Estimates) -> tuple[list[Pending], float | None]:
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
            self._dirty.add(service)
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

