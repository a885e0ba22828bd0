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
                   now: float) -> int:
        """Chunk size of a new variant of ``service`` (one of ``choices``): its share of
        recent demand, a fair share at least."""
        services = list(pool.manager.services)
        share = pool.demand.shares(services, now).get(service, 0.0)
        gpus = sum(n.spec.gpus for n in pool.manager.nodes.values())
        want = _chunk_floor(gpus * max(share, 1.0 / max(len(services), 1)))
        fits = [c for c in choices if c <= want]
        return fits[-1] if fits else choices[0]

    # -- one pass ------------------------------------------------------------------------
    def plan(self, pool: GpuPool, now: float, estimates: Estimates,  # type: ignore[override]
             quota: QuotaManager) -> list[Decision]:
        mgr = pool.manager
        decisions: list[Decision] = []
        waiting_services = None
        for q in pool.groups():
            members = [p for p in q if pool.is_waiting(p)]
            if not members:
                continue
            head = members[0]
            service = head.action.service or ""
            # 1. idle resident variants first, widest first
            idle = sorted((s for s in mgr.sites(service) if mgr.is_idle(s)
                           and s[2] in head.choices), key=lambda s: -s[2])
            placed: list[tuple[Pending, GpuLease, int]] = []
            for site in idle:
                if not members:
                    break
                lead = members.pop(0)
                lease = mgr.reserve_at(lead.action.id, service, site, now)
                if lease is None:
                    members.insert(0, lead)
                    continue
                placed.append((lead, lease, site[2]))
            # 2. restore another variant, or wait for a busy one
            blocked = False
            while members:
                k = self.target_dop(pool, service, members[0].choices, now)
                restore_s = mgr.variant_restore_s(service, k)
                ends = self._busy_ends(pool, service, now)
                ends += [now + lease.restore_s + solo_s(lead, units, estimates)
                         for lead, lease, units in placed]
                waited = now - members[0].submit_s
                if ends and waited < restore_s:
                    backlog = sum(solo_s(m, k, estimates) for m in members)
                    wait = min(ends) - now + backlog / (2 * len(ends))
                    if wait <= restore_s:
                        break  # waiting for its own variants costs less than a restore
                if waiting_services is None:
                    waiting_services = {g[0].action.service for g in pool.groups()}
                site = None
                for dop in [k, *sorted((c for c in members[0].choices if c < k), reverse=True)]:
                    site = mgr.restore_site(service, dop, waiting_services)
                    if site is not None:
                        break
                if site is None:
                    blocked = not ends  # nothing of its own will free either
                    break
                lead = members.pop(0)
                lease = mgr.reserve_at(lead.action.id, service, site, now)
                if lease is None:  # pragma: no cover - restore_site returned a free chunk
                    members.insert(0, lead)
                    break
                placed.append((lead, lease, site[2]))
            # 3. batches: what is left rides along, spread over this pass's placements
            self._fill_batches(pool, placed, members, estimates)
            decisions.extend((lead, units) for lead, _, units in placed)
            if blocked:
                break  # starvation bound: nothing younger takes the chunk it waits for
        return decisions

    @staticmethod
    def _busy_ends(pool: GpuPool, service: str, now: float) -> list[float]:
        """Expected ends of the running batches of ``service``'s variants."""
        out = []
        for aid, lease in pool.manager._live.items():
            if lease.service == service:
                run = pool.running.get(aid)
                if run is not None:
                    end, _, start = run
                    # past its expected end: expect it to run about as long again
                    out.append(end if end > now else now + (now - start))
        return out

    def _fill_batches(self, pool: GpuPool, placed: list[tuple[Pending, GpuLease, int]],
                      left: list[Pending], estimates: Estimates) -> None:
        batching = pool.batching
        batches = [[lead] for lead, _, _ in placed]
        work = [work_s(lead, estimates) for lead, _, _ in placed]
        while left and batches:
            # the batch with the least work takes the next request, if its budget admits it
            j = min(range(len(batches)), key=lambda b: work[b])
            lead, lease, units = placed[j]
            r = left[0]
            w = work_s(r, estimates)
            if units not in r.choices or not batching.admits(work[j], w, len(batches[j])):
                break
            batches[j].append(left.pop(0))
            work[j] += w
        for (lead, lease, _), batch in zip(placed, batches, strict=True):
            pool.plan_batch(lead, lease, batch[1:])

    # -- predictive pre-restore ----------------------------------------------------------
    def prerestore(self, pool: GpuPool, now: float, estimates: Estimates) -> None:
        """Restore, into free chunks where that evicts nothing, the services whose
        resident GPUs fall furthest short of their share of recent demand."""
        mgr = pool.manager
        if mgr.free_gpus() <= 0:
            return
        services = [s for s in mgr.services if pool.demand.value(s, now) > 0]
        if not services:
            return
        if pool.groups():
            return  # requests wait: the free chunks are theirs
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
