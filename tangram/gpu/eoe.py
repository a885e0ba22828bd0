"""Evict-on-execution that survives bursts: the ``tangram`` policy's GPU scheduler.

The paper's GPU manager (5.3) restores a service variant wherever the scheduler's
grant lands; under a burst of requests for several services that bounces variants in
and out (a restore for most requests). This scheduler works per *service*, not per
request, with three rules:

1. **Residency affinity.** A service's requests go first to chunks where one of its
   variants is resident and idle, at that variant's DoP (a resident service keeps
   its DoP instead of restoring a new variant per grant size).
2. **Batching.** Each placed request takes the queued requests of its service that
   fit one batch (:mod:`tangram.gpu.batching`) - but only those that would otherwise
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

(A fourth rule, predictive pre-restore - free chunks restoring, while nothing waits, the
service whose resident GPUs fell short of its recent demand - was removed:
its ablation row equalled the default in all 216 GPU cells of the regret matrix; on the
shipped MOPD sample it fired 0 times.)

**Starvation bound.** Services are served first come, first served by their oldest
request, and a pass takes of a service only requests no younger than the next
service's oldest. The oldest waiting request R is passed over by a younger one only
(a) while R waits by choice for a busy variant of its own service - at most the
restore time of its variant, counted from when it first chose to wait - or (b) while
a variant of its service that R can use is running (R takes it when it ends). If no
free chunk fits even R's smallest DoP and (b) does not hold, nothing younger starts:
the chunk R needs is the next one to free. So R starts within max(the restore time of
its variant, the longest running batch) of becoming the oldest waiting request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from typing import TYPE_CHECKING

from tangram.api.quota import QuotaManager
from tangram.arrange import CHUNK_SIZES
from tangram.estimates import Estimates
from tangram.gpu.manager import GpuLease, GpuManager, Site
from tangram.gpu.pool import accepts, solo_s, work_s
from tangram.model import Pending
from tangram.scheduler import Decision, ElasticScheduler

if TYPE_CHECKING:
    from tangram.gpu.pool import EoeGpuPool


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
    def target_dop(self, pool: EoeGpuPool, service: str, choices: tuple[int, ...],
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

    def widen(self, pool: EoeGpuPool, p: Pending, k: int, waiting: int,
              estimates: Estimates) -> int:
        """A wider DoP than the demand share ``k`` when the free GPUs allow it: the
        services still waiting in this pass (``waiting``, this one among them) each get an
        equal part of the free GPUs, and within its part the request takes the DoP that
        ends it first (restore + run, both observed or declared). Under a burst the part
        is small and ``k`` stands; on an idle pool a request no longer runs on one GPU
        while seven sit free (what the paper's DP does, and why it won at low load)."""
        mgr = pool.manager
        room = mgr.free_gpus() / max(waiting, 1)
        service = p.action.service or ""
        best, best_s = k, mgr.variant_restore_s(service, k) + solo_s(p, k, estimates)
        for c in accepts(p):
            if k < c <= room:
                t = mgr.variant_restore_s(service, c) + solo_s(p, c, estimates)
                if t < best_s:
                    best, best_s = c, t
        return best

    # -- one pass ------------------------------------------------------------------------
    def plan(self, pool: EoeGpuPool, now: float, estimates: Estimates,  # type: ignore[override]
             quota: QuotaManager) -> list[Decision]:
        mgr = pool.manager
        if mgr.free_gpus() <= 0:
            return []  # every chunk is running something: nothing can start
        decisions: list[Decision] = []
        pool.new_pass()
        groups = pool.groups()
        # the services with requests waiting (what a restore should not evict): only a
        # pass that restores needs them
        waiting_services: Collection[str] | None = None
        shares: dict[str, float] | None = None
        floor = float("inf")  # the oldest request a service's limit held back this pass
        for gi, q in enumerate(groups):
            # FCFS across services: this pass takes of this service only requests no
            # younger than the next service's oldest (its head always); a request held
            # back so is served by the core's next pass, before anything younger
            limit = groups[gi + 1][0].submit_s if gi + 1 < len(groups) else float("inf")
            members = _Cursor(q, min(limit, floor))
            head = members.peek()
            if head is None or head.submit_s > floor:
                break
            service = head.action.service or ""
            # 1. idle resident variants first, widest first (a request only on a DoP it
            # accepts)
            # (per service, not for every resident variant: a pass rarely looks past one
            # or two services; a site an earlier service took is no longer idle)
            sites = self.resident_sites(mgr, service)
            idle = sorted(sites, key=lambda s: -s[2]) if sites else []
            placed: list[tuple[Pending, GpuLease, int]] = []
            while idle and (lead := members.peek()) is not None:
                site = next((s for s in idle if s[2] in accepts(lead)), None)
                if site is None:
                    break
                idle.remove(site)
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
                k = self.target_dop(pool, service, accepts(nxt), now, shares)
                k = self.widen(pool, nxt, k, len(groups) - gi, estimates)
                restore_s = mgr.variant_restore_s(service, k)
                # its own variants it can use, running or just placed
                mine = [end for end, units in ends if units in accepts(nxt)]
                mine += [now + lease.restore_s + solo_s(lead, units, estimates)
                         for lead, lease, units in placed if units in accepts(nxt)]
                since = pool.deferred_since(nxt, now)
                if (mine and now - since < restore_s - 1e-9 and self.waits_for_own
                        and not self._restores_freely(pool, service, k)):
                    backlog = pool.waiting_count(service) * solo_s(nxt, k, estimates)
                    if min(mine) - now + backlog / (2 * len(mine)) <= restore_s:
                        # waiting for its own variants costs less than a restore; it
                        # waits so at most as long as the restore would have taken
                        pool.defer(nxt, since, since + restore_s)
                        break
                if waiting_services is None:
                    waiting_services = pool.waiting_services()
                site = mgr.restore_site(service, k, waiting_services)
                if site is None:  # the smaller DoPs it accepts, widest first
                    for dop in sorted((c for c in accepts(nxt) if c < k), reverse=True):
                        site = mgr.restore_site(service, dop, waiting_services)
                        if site is not None:
                            break
                if site is None:
                    # no chunk fits: unless one of its own variants it can use will free,
                    # nothing younger may start (it would take the chunks it waits for)
                    blocked = not mine
                    break
                lease = mgr.reserve_at(nxt.action.id, service, site, now)
                if lease is None:  # pragma: no cover - restore_site returned a free chunk
                    break
                members.pop()
                placed.append((nxt, lease, site[2]))
            # 3. batches: what is left rides along, spread over this pass's placements
            if placed:
                self._fill_batches(pool, placed, members, ends, now, estimates)
                for lead, _, units in placed:
                    decisions.append((lead, units))
            held = members.held_back()
            if held is not None and held < floor:
                floor = held
            if blocked or mgr.free_gpus() <= 0:
                break  # starvation bound: nothing younger takes the chunk it waits for
        return decisions

    # -- the extensions' hooks (each has an ablation below: tangram-no-*) --------------
    #: rule 3: a service whose variants are busy may wait for them instead of restoring
    waits_for_own = True

    def resident_sites(self, mgr: GpuManager, service: str) -> list[Site]:
        """Rule 1: the idle chunks where a variant of ``service`` is resident."""
        return mgr.idle_sites_of(service)

    @staticmethod
    def _restores_freely(pool: EoeGpuPool, service: str, k: int) -> bool:
        """Whether a new variant of ``k`` GPUs would go where it evicts nothing: then
        waiting for a busy variant of its own saves no restore of anyone else's, only
        delays the request (the ablation row of rule 3 won every cell where GPUs sat
        free), so rule 3 applies only when a restore would evict."""
        mgr = pool.manager
        site = mgr.restore_site(service, k)
        return site is not None and not mgr.victims_at(service, site)

    @staticmethod
    def _busy_ends(pool: EoeGpuPool, service: str, now: float) -> list[tuple[float, int]]:
        """(expected end, DoP) of the running batches of ``service``."""
        out = []
        running = pool.running
        for aid in pool.manager.live_of(service):
            run = running.get(aid)
            if run is not None:
                end, units, start = run
                # past its expected end: expect it to run about as long again
                out.append((end if end > now else now + (now - start), units))
        return out

    def _fill_batches(self, pool: EoeGpuPool, placed: list[tuple[Pending, GpuLease, int]],
                      left: _Cursor, busy: list[tuple[float, int]], now: float,
                      estimates: Estimates) -> None:
        """Spread the requests left over this pass's placements as batch riders, each
        only while riding pays: under the batching curve every member of a batch ends
        with it, so a rider delays the ``b`` members already in it by its time less the
        shared overhead ``f``, and saves itself the wait for the earliest free variant
        ``E``, and each of the ``Q`` requests behind it ``f``. Ride iff
        ``E - T + f * (1 + Q) > b * (s - f)`` (``T``: the batch's end before it joins;
        ``busy``: (end, DoP) of the service's running batches)."""
        batching = pool.batching
        r = left.peek()
        if r is not None and len(placed) == 1:
            # the common case, one placement: is there room for even one rider?
            lead = placed[0][0]
            if not batching.admits(work_s(lead, estimates), work_s(r, estimates), 1):
                r = None
        if r is None:
            for lead, lease, _ in placed:
                pool.plan_batch(lead, lease, [])
            return
        f = batching.fixed_s
        batches = [[lead] for lead, _, _ in placed]
        work = [work_s(lead, estimates) for lead, _, _ in placed]
        ends = [now + lease.restore_s + solo_s(lead, units, estimates)
                for lead, lease, units in placed]
        behind = pool.waiting_count(placed[0][0].action.service or "") - len(placed)
        busy_ends = [e for e, _ in busy]  # (the running batches' ends: ``busy``'s DoPs aside)
        while (r := left.peek()) is not None:
            behind -= 1
            j = min(range(len(batches)), key=lambda b: ends[b])
            lead, lease, units = placed[j]
            w = work_s(r, estimates)
            if units not in accepts(r) or not batching.admits(work[j], w, len(batches[j])):
                break
            s_r = solo_s(r, units, estimates)
            earliest = min(min(busy_ends, default=ends[j]), min(ends))
            # without riding it starts when the earliest variant frees and runs alone
            gain = earliest - ends[j] + f * (1 + behind)
            if gain <= len(batches[j]) * max(s_r - f, 0.0):
                break
            batches[j].append(left.pop())
            work[j] += w
            ends[j] += max(s_r - f, 0.0)
        for (lead, lease, _), batch in zip(placed, batches, strict=True):
            pool.plan_batch(lead, lease, batch[1:])


class _Cursor:
    """The waiting requests of one service's queue, front first, up to those younger
    than ``limit`` (the head is always offered). The requests a pass takes are always a
    prefix, and the pool prunes taken ones off the front (and rebuilds after a cancel),
    so the deque holds only waiting requests."""

    __slots__ = ("_q", "_i", "_limit")

    def __init__(self, queue: deque[Pending], limit: float) -> None:
        self._q = queue
        self._i = 0
        self._limit = limit

    def peek(self) -> Pending | None:
        i, q = self._i, self._q
        if i >= len(q):
            return None
        p = q[i]
        return p if not i or p.submit_s <= self._limit else None

    def pop(self) -> Pending:
        p = self._q[self._i]
        self._i += 1
        return p

    def held_back(self) -> float | None:
        """Submit time of the next request when the limit held it back (else None)."""
        if self._i < len(self._q) and self.peek() is None:
            return self._q[self._i].submit_s
        return None


# -- ablations: the default without one extension (rows of the regret matrix) ------------
class NoAffinity(EoeScheduler):
    """Without residency affinity: every request goes through the restore path."""

    name = "tangram-eoe-no-affinity"

    def resident_sites(self, mgr: GpuManager, service: str) -> list[Site]:
        return []


class NoOrdering(EoeScheduler):
    """Without restore-aware ordering: a request never waits for its service's busy
    variants, it restores another as soon as a chunk is free."""

    name = "tangram-eoe-no-ordering"
    waits_for_own = False
