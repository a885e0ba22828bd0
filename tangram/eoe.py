"""Evict-on-execution that survives bursts: the ``tangram`` policy's GPU scheduler.

The paper's GPU manager (5.3) restores a service variant wherever the scheduler's
grant lands; under a burst of requests for several services that bounces variants in
and out (a restore for most requests). This scheduler works per *service*, not per
request, with four rules:

1. **Residency affinity.** A service's requests go first to chunks where one of its
   variants is resident and idle, at that variant's DoP (a resident service keeps
   its DoP instead of restoring a new variant per grant size).
2. **Batching.** Each placed request takes the queued requests of its service that
   fit one batch (:mod:`tangram.batching`) - but only those that would otherwise
   wait: first every idle resident variant gets a lead request.
3. **Restore-aware ordering, bounded.** Services are considered in the order of their
   oldest waiting request. A service whose variants are all busy waits for them
   (rather than restoring another copy) while its expected wait - the earliest end of
   its running batches plus half its backlog spread over its variants - is below the
   time a new restore takes; it restores a new variant as soon as waiting costs more,
   or as soon as its oldest request has already waited that restore time. A new
   variant gets the DoP of the service's share of recent demand (a fair share at
   least: ``gpus * max(share, 1 / services)``, rounded down to a chunk size) and goes
   where it evicts nothing if it can, else the least recently used variants of
   services with nothing waiting (only what is needed: variants stay co-resident
   while their memory fits).
4. **Predictive pre-restore.** After a pass, free chunks restore the service whose
   resident GPUs fall furthest short of its share of recent demand (observed request
   rates, decayed over two minutes), where that evicts nothing, so the next requests
   find it resident.

**Starvation bound.** A younger service never takes a chunk the oldest waiting
request could use: if no free chunk fits even the smallest DoP of the oldest
service that wants one, the pass stops there, so the chunk it needs is the next one
that frees (at most the longest running batch away). Waiting by choice (rule 3) is
capped by the restore time of its variant. Within a service, requests start in
arrival order. So a request, once its service's request is the oldest waiting, starts
within max(restore time of its variant, the longest running batch) - plus, for the
k-th request of a service's queue, the k / (batch size) batches of its own service
ahead of it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from tangram.arrange import CHUNK_SIZES
from tangram.estimates import Estimates
from tangram.managers.gpu import GpuLease, Site
from tangram.managers.quota import QuotaManager
from tangram.pools import Pending, solo_s, work_s
from tangram.scheduler import Decision, ElasticScheduler

if TYPE_CHECKING:
    from tangram.pools import GpuPool


def _chunk_floor(x: float) -> int:
    """The largest chunk size <= x (1 at least)."""
    out = 1
    for size in CHUNK_SIZES:
        if size <= x:
            out = size
    return out


class EoeScheduler(ElasticScheduler):
    name = "tangram-eoe"

    # -- the DoP of a new variant --------------------------------------------------------
    def target_dop(self, pool: GpuPool, service: str, choices: tuple[int, ...],
                   now: float, shares: dict[str, float] | None = None) -> int:
        """Chunk size of a new variant of ``service`` (one of ``choices``): its share of
        recent demand, a fair share at least."""
        services = pool.manager.services
        if shares is None:
            shares = pool.demand.shares(list(services), now)
        want = _chunk_floor(pool.total_gpus * max(shares.get(service, 0.0),
                                                  1.0 / max(len(services), 1)))
        fits = [c for c in choices if c <= want]
        return fits[-1] if fits else choices[0]

    # -- one pass ------------------------------------------------------------------------
    def plan(self, pool: GpuPool, now: float, estimates: Estimates,  # type: ignore[override]
             quota: QuotaManager) -> list[Decision]:
        mgr = pool.manager
        if mgr.free_gpus() <= 0:
            return []  # every chunk is running something: nothing can start
        decisions: list[Decision] = []
        groups = pool.groups()
        waiting_services = {g[0].action.service for g in groups}
        idle_sites = mgr.idle_sites()
        shares: dict[str, float] | None = None
        for q in groups:
            members = _Cursor(q, pool)
            head = members.peek()
            if head is None:
                continue
            service = head.action.service or ""
            # 1. idle resident variants first, widest first
            sites = idle_sites.get(service)
            idle = sorted((s for s in sites if s[2] in head.choices),
                          key=lambda s: -s[2]) if sites else []
            placed: list[tuple[Pending, GpuLease, int]] = []
            for site in idle:
                lead = members.peek()
                if lead is None:
                    break
                lease = mgr.reserve_at(lead.action.id, service, site, now)
                if lease is not None:
                    members.pop()
                    placed.append((lead, lease, site[2]))
            # 2. restore another variant, or wait for a busy one
            blocked = False
            ends = self._busy_ends(pool, service, now)
            while (nxt := members.peek()) is not None and mgr.free_gpus() > 0:
                if shares is None:
                    shares = pool.demand.shares(list(mgr.services), now)
                k = self.target_dop(pool, service, nxt.choices, now, shares)
                restore_s = mgr.variant_restore_s(service, k)
                mine = ends + [now + lease.restore_s + solo_s(lead, units, estimates)
                               for lead, lease, units in placed]
                if mine and now - nxt.submit_s < restore_s:
                    backlog = pool.waiting_count(service) * solo_s(nxt, k, estimates)
                    if min(mine) - now + backlog / (2 * len(mine)) <= restore_s:
                        break  # waiting for its own variants costs less than a restore
                site = None
                for dop in [k, *sorted((c for c in nxt.choices if c < k), reverse=True)]:
                    site = mgr.restore_site(service, dop, waiting_services)
                    if site is not None:
                        break
                if site is None:
                    blocked = not mine  # nothing of its own will free either
                    break
                lease = mgr.reserve_at(nxt.action.id, service, site, now)
                if lease is None:  # pragma: no cover - restore_site returned a free chunk
                    break
                members.pop()
                placed.append((nxt, lease, site[2]))
            # 3. batches: what is left rides along, spread over this pass's placements
            if placed:
                self._fill_batches(pool, placed, members, ends, now, estimates)
                decisions.extend((lead, units) for lead, _, units in placed)
            if blocked or mgr.free_gpus() <= 0:
                break  # starvation bound: nothing younger takes the chunk it waits for
        return decisions

    @staticmethod
    def _busy_ends(pool: GpuPool, service: str, now: float) -> list[float]:
        """Expected ends of the running batches of ``service``."""
        out = []
        running = pool.running
        for aid in pool.manager.live_of(service):
            run = running.get(aid)
            if run is not None:
                end, _, start = run
                # past its expected end: expect it to run about as long again
                out.append(end if end > now else now + (now - start))
        return out

    def _fill_batches(self, pool: GpuPool, placed: list[tuple[Pending, GpuLease, int]],
                      left: _Cursor, busy_ends: list[float], now: float,
                      estimates: Estimates) -> None:
        """Spread the requests left over this pass's placements as batch riders, each
        only while riding pays: under the batching curve every member of a batch ends
        with it, so a rider delays the ``b`` members already in it by its time less the
        shared overhead ``f``, and saves itself the wait for the earliest free variant
        ``E``, and each of the ``Q`` requests behind it ``f``. Ride iff
        ``E - T + f * (1 + Q) > b * (s - f)`` (``T``: the batch's end before it joins)."""
        behind = pool.waiting_count(placed[0][0].action.service or "") - len(placed)
        if behind <= 0:
            for lead, lease, _ in placed:
                pool.plan_batch(lead, lease, [])
            return
        batching = pool.batching
        f = batching.fixed_s
        batches = [[lead] for lead, _, _ in placed]
        work = [work_s(lead, estimates) for lead, _, _ in placed]
        ends = [now + lease.restore_s + solo_s(lead, units, estimates)
                for lead, lease, units in placed]
        behind = pool.waiting_count(placed[0][0].action.service or "") - len(placed)
        while (r := left.peek()) is not None:
            behind -= 1
            j = min(range(len(batches)), key=lambda b: ends[b])
            lead, lease, units = placed[j]
            w = work_s(r, estimates)
            if units not in r.choices or not batching.admits(work[j], w, len(batches[j])):
                break
            s_r = solo_s(r, units, estimates)
            earliest = min([*busy_ends, *ends])
            # without riding it starts when the earliest variant frees and runs alone
            gain = earliest - ends[j] + f * (1 + behind)
            if gain <= len(batches[j]) * max(s_r - f, 0.0):
                break
            batches[j].append(left.pop())
            work[j] += w
            ends[j] += max(s_r - f, 0.0)
        for (lead, lease, _), batch in zip(placed, batches, strict=True):
            pool.plan_batch(lead, lease, batch[1:])

    # -- predictive pre-restore ----------------------------------------------------------
    def prerestore(self, pool: GpuPool, now: float, estimates: Estimates) -> None:
        """Restore, into free chunks where that evicts nothing, the services whose
        resident GPUs fall furthest short of their share of recent demand."""
        mgr = pool.manager
        if mgr.free_gpus() <= 0 or pool.queue:
            return  # requests wait: the free chunks are theirs
        services = [s for s in mgr.services if pool.demand.value(s, now) > 0]
        if not services:
            return
        shares = pool.demand.shares(services, now)
        gpus = sum(n.spec.gpus for n in mgr.nodes.values())
        for _ in range(gpus):
            best, best_deficit = None, 0.0
            for s in services:
                resident = sum(site[2] for site in mgr.sites(s))
                deficit = gpus * shares[s] - resident
                if deficit > best_deficit:
                    best, best_deficit = s, deficit
            if best is None:
                return
            dop = self._dop_for(pool, best, now)
            if dop is None or best_deficit < dop:
                services.remove(best)
                if not services:
                    return
                continue
            site = mgr.restore_site(best, dop, frozenset(mgr.services))
            if site is None or self._evicts(pool, best, site):
                services.remove(best)
                if not services:
                    return
                continue
            mgr.prerestore(best, site, now)

    def _dop_for(self, pool: GpuPool, service: str, now: float) -> int | None:
        choices = tuple(c for c in CHUNK_SIZES if pool.manager.check(service, c) is None)
        return self.target_dop(pool, service, choices, now) if choices else None

    @staticmethod
    def _evicts(pool: GpuPool, service: str, site: Site) -> bool:
        mgr = pool.manager
        name, start, k = site
        node = mgr.nodes[name]
        need = mgr.services[service].size_gb / k
        victims = mgr._victims(node, list(node.resident), start, k, need, node.spec.gpu_mem_gb)
        return victims is None or bool(victims)


class _Cursor:
    """The waiting requests of one service's queue, front first. The requests a pass
    takes are always a prefix of them, and the pool prunes taken ones off the front
    (and rebuilds after a cancel), so the deque holds only waiting requests."""

    __slots__ = ("_q", "_i")

    def __init__(self, queue: deque[Pending], pool: GpuPool) -> None:
        self._q = queue
        self._i = 0

    def peek(self) -> Pending | None:
        return self._q[self._i] if self._i < len(self._q) else None

    def pop(self) -> Pending:
        p = self._q[self._i]
        self._i += 1
        return p
