"""Malleable grants: a running elastic action's cores grow onto cores that free
up and shrink to admit arrivals.

Why: a grant fixed at an action's start is right only for the moment it starts. A test
that starts on 1 core of a full node stays narrow while cores free up around it (the
oversubscribed tails: 7 of the 8 slowest actions ran on 1 core for 55-120 s while 0.75-12
of their node's 24 cores sat idle), and one that starts wide on an idle node keeps its
cores when others arrive. With concave speedups, re-sharing the cores as actions come and
go is what keeps the tail short (EQUI, heSRPT: Berg, Harchol-Balter et al. 2020).

The policy ``tangram-malleable`` (MalleableCores); not the default: it wins the quick
regret matrix's coding cells and loses mean ACT at the paper's size (docs/evidence/
decisions.md, "Malleable grants").

What a malleable action is: a CPU elastic action with a speedup profile (declared or
learnt) that starts its command with a fixed worker count (``Dispatch.workers``, its
``TANGRAM_WORKERS``: ``pytest -n W``) and runs on whatever cores it holds; the backend
re-pins its processes when the core sends :class:`~tangram.protocol.Resized`.

The rules (each decided from what the core observed only):

* **Workers.** An action starts ``W`` workers: the unit count, up to its NUMA domain (its
  cores never leave it), at which its expected duration is least. Its profile prices each
  unit count with what it learnt of the per-unit cost, so a command whose workers cost
  more than they give is started narrower. It may grow up to ``W`` cores, never past it
  (more cores than workers do nothing).
* **Progress.** The pool follows each malleable action's work left, as a fraction of its
  expected duration: at ``u`` cores it goes at ``1 / D(min(u, W))`` per second (``D``: its
  profile). An action past its expected end is taken to have :data:`LEFT_FLOOR` of its
  work left (it is not known how much; the same floor for all keeps them comparable).
* **The objective** is the starts' (tangram/scheduler.py ``flow_cost``): the sum of each
  action's squared completion time from its arrival, so an old action weighs its age.
* **Share** (``share``), before each plan and once the queue is empty. The queue's first
  heads are taken in order, as the plan takes them: one that fits starts (the plan gives
  it its width); one that does not is admitted by shrinking running grants (never below
  their minimum, the cheapest per core first) when what it gains by starting now, instead
  of when enough running actions are expected to end, outweighs what the shrunk actions
  lose. Idle cores go to running grants only once nothing is queued: one step of an
  action's unit choices at a time, to the grant whose objective falls most per core.
  (Tried and rejected: letting a running grant take a core a head fits on when that
  lowers the objective more. The plan takes its queue as a prefix, so a head held back
  held back every shell behind it: the coding sample's mean ACT went from 4.2 to 5.8-7.9 s.)
* **No waiting for a wider grant.** Where grants grow, an elastic head starts at what is
  free and widens as cores free, instead of waiting for them (the rigid policy's
  ``may_wait``, which with malleable grants measured worse on mean ACT and step time).
* **The cost of a resize** (re-pinning, caches gone cold, workers contending on fewer
  cores) is paid by the resized action: every rule above adds it to the resized
  action's remaining time, and a resize is made only when it saves the action at least
  :data:`PAYBACK` times that cost; so an action is not resized more often than it pays.
  The cost is learnt (:class:`ResizeCost`) from how far each resized run overran what its
  width history predicted, starting from :data:`RESIZE_PRIOR_S`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

from tangram.cpu.pool import CpuNodePool
from tangram.model import Pending
from tangram.pool import Books
from tangram.protocol import Effect, Resized
from tangram.scheduler import ElasticScheduler

#: work left assumed of an action past its expected end (fraction of its expected duration)
LEFT_FLOOR = 0.1
#: a resize is made only when it saves the resized action this many times its cost
PAYBACK = 2.0
#: the cost of one resize before any is observed (s of the action's time): re-pinning its
#: processes takes milliseconds (a /proc scan, sched_setaffinity per thread); what costs is
#: the caches its workers leave warm, assumed a few tens of milliseconds
RESIZE_PRIOR_S = 0.05
#: weight of the prior, in resizes observed
PRIOR_WEIGHT = 4.0
#: queued actions a pass may shrink running grants for (the queue's first, in order)
ROOM_HEADS = 8

flow_cost = ElasticScheduler.flow_cost


class ResizeCost:
    """What one resize costs an action, learnt from the resized runs that ended.

    Each such run overran (or beat) what its width history predicted by ``r`` seconds.
    Profiles are wrong in proportion to an action's length, and long actions are resized
    most, so ``r`` is fitted as ``a * elapsed + b * resizes`` (least squares, the prior
    ``b = RESIZE_PRIOR_S`` weighing PRIOR_WEIGHT resizes): ``b`` is the cost, the profile's
    error stays in ``a``. Never below 0."""

    __slots__ = ("_ee", "_en", "_nn", "_er", "_nr", "runs")

    def __init__(self) -> None:
        self._ee = self._en = self._er = 0.0
        self._nn = PRIOR_WEIGHT
        self._nr = PRIOR_WEIGHT * RESIZE_PRIOR_S
        self.runs = 0

    def observe(self, elapsed: float, resizes: int, overrun: float) -> None:
        self._ee += elapsed * elapsed
        self._en += elapsed * resizes
        self._nn += resizes * resizes
        self._er += elapsed * overrun
        self._nr += resizes * overrun
        self.runs += 1

    @property
    def cost_s(self) -> float:
        det = self._ee * self._nn - self._en * self._en
        if self._ee <= 0 or det <= 1e-12 * self._ee * self._nn:
            b = self._nr / self._nn
        else:
            b = (self._ee * self._nr - self._en * self._er) / det
        return max(b, 0.0)


class Progress:
    """One running malleable action: its work left (a fraction of its expected duration)
    as of ``since``, at ``units`` cores with ``workers`` workers."""

    __slots__ = ("pending", "units", "workers", "left", "since", "start", "resizes",
                 "unit_s", "counts", "_table")

    def __init__(self, p: Pending, units: int, workers: int, now: float) -> None:
        self.pending = p
        self.units = units
        self.workers = workers
        self.left = 1.0
        self.since = now
        self.start = now
        self.resizes = 0
        #: the core-seconds it held (its width over its run: the units it is observed at)
        self.unit_s = 0.0
        self._table = p.durations
        #: its feasible unit counts its profile has a duration for, ascending
        self.counts = tuple(u for u in p.choices if u in self._table)

    def duration(self, units: int) -> float:
        """Its expected duration at ``units`` cores (its profile at its widest count that
        uses at most ``units`` cores and ``workers`` workers)."""
        cap = min(units, self.workers)
        best = self.counts[0]
        for u in self.counts:
            if u > cap:
                break
            best = u
        return self._table[best]

    def left_at(self, now: float) -> float:
        return self.left - (now - self.since) / max(self.duration(self.units), 1e-9)

    def remaining(self, now: float, units: int, cost: float) -> float:
        """Its expected time left at ``now`` if it runs on ``units`` from now (a change
        costs ``cost``)."""
        extra = cost if units != self.units else 0.0
        return max(self.left_at(now), LEFT_FLOOR) * self.duration(units) + extra

    def steps_up(self, units: int) -> Iterator[int]:
        for u in self.counts:
            if units < u <= self.workers:
                yield u

    def step_down(self, units: int) -> int | None:
        """The next count below ``units`` (None: ``units`` is its minimum)."""
        below = [u for u in self.counts if self.pending.key_min <= u < units]
        return below[-1] if below else None

    def resize(self, now: float, units: int, cost: float) -> None:
        self.left = self.left_at(now) + cost / max(self.duration(units), 1e-9)
        self.unit_s += self.units * (now - self.since)
        self.since = now
        self.units = units
        self.resizes += 1


@dataclass(frozen=True, slots=True)
class _Step:
    """A grant's step up or down: to ``units`` (``cores`` more or fewer), and what it
    changes in the objective per core."""

    aid: str
    units: int
    cores: int
    value: float


class MalleableNodePool(CpuNodePool):
    """A CPU node's pool whose elastic grants resize while they run (module docstring).

    Resizes only while ``grows`` (set when a backend that carries Resized out attaches:
    tangram/cpu/nodes.py); until then it is a CpuNodePool."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.grows = False
        self.cost = ResizeCost()
        #: running malleable actions, by id
        self._progress: dict[str, Progress] = {}
        #: resizes made (for the snapshot's counters)
        self.resized = 0

    # -- start and end -------------------------------------------------------------------
    def begin(self, p: Pending, units: int, now: float) -> int:
        if not self.grows or not p.elastic or not p.durations:
            return 0
        if (p.action.payload or {}).get("rigid"):  # it reads its core count once: fixed
            return 0
        table = p.durations
        cap = self.host.domain_size
        counts = [u for u in p.choices if u in table and u <= cap]
        if not counts:
            return 0
        # the count at which it is expected to end first (its profile prices workers)
        workers = max(min(counts, key=lambda u: (table[u], u)), units)
        self._progress[p.action.id] = Progress(p, units, workers, now)
        return workers

    def cores_of(self, action_id: str) -> tuple[int, ...] | None:
        pr = self._progress.get(action_id)
        return self.manager.lease_of(action_id).cores if pr and pr.resizes else None

    def closing(self, action_id: str, units: int, now: float) -> int:
        pr = self._progress.pop(action_id, None)
        if pr is None or not pr.resizes:
            return units
        elapsed = now - pr.start
        overrun = -pr.left_at(now) * pr.duration(pr.units)
        self.cost.observe(elapsed, pr.resizes, overrun)
        held = pr.unit_s + pr.units * (now - pr.since)
        width = held / elapsed if elapsed > 0 else float(pr.units)
        # (observed at the count of its profile nearest its mean width)
        return min(pr.counts, key=lambda u: abs(u - width))

    def ended(self, action_id: str) -> None:
        self._progress.pop(action_id, None)  # (ended without closing: cancelled, a batch)
        super().ended(action_id)

    def drain(self) -> list[Pending]:
        self._progress.clear()
        return super().drain()

    # -- resizing ------------------------------------------------------------------------
    def _domain(self, action_id: str) -> int:
        """The NUMA domain a malleable action's cores are in (one: ``reserve`` placed them)."""
        return self.manager.lease_of(action_id).cores[0] // self.host.domain_size

    def _apply(self, now: float, units: dict[str, int], cost: float) -> list[Effect]:
        """The grants resized to ``units``: the shrinks first (their cores may be another's
        growth, in the manager's books and in the backend's carrying out, in order)."""
        out: list[Effect] = []
        changed = [(u - self._progress[aid].units, aid, u) for aid, u in units.items()
                   if u != self._progress[aid].units]
        for _, aid, u in sorted(changed):
            pr = self._progress[aid]
            lease = self.manager.resize(aid, u)
            if lease is None:  # (cannot happen: the steps were checked against the domains)
                continue
            pr.resize(now, u, cost)
            end, _, start = self.running[aid]
            self.started(aid, now + pr.remaining(now, u, 0.0), u, start)
            self.resized += 1
            out.append(Resized(aid, self.node, lease.cores))
        return out

    def share(self, now: float, books: Books) -> list[Effect]:
        if not self.grows or not self._progress or self.light or self._waiting:
            return []  # (a light action or one moved off the lane has first call on a core)
        cost = self.cost.cost_s
        free = self.host.free_per_domain()
        domain = {aid: self._domain(aid) for aid in self._progress}
        units = {aid: pr.units for aid, pr in self._progress.items()}
        ends: list[tuple[float, int]] | None = None
        heads = islice(self.queue, ROOM_HEADS)
        head = next(heads, None)
        taken = 0  # cores the heads admitted so far take from running grants
        # (a head held by a quota, not by cores, ends the heads: freed cores would idle)
        while head is not None and not head.quotas:
            scratch = list(free)
            if self.fits_min(scratch, head):  # (takes its minimum from ``scratch``)
                free = scratch
                head = next(heads, None)
                continue
            trial = self._shrunk_for(now, head, units, free, domain, cost)
            if trial is None:
                break
            need, loss, shrunk = trial
            # what it gains: it starts now, not when enough running actions end
            if ends is None:
                ends = self.expected_ends(now)
            wait = _wait_for(ends, taken + need, now)
            run = head.durations.get(head.key_min) or books.estimates.estimate(head)
            age = now - head.submit_s
            if flow_cost(age + wait + run) - flow_cost(age + run) <= loss:
                break
            for aid, u in shrunk.items():
                free[domain[aid]] += units[aid] - u
            units = shrunk
            taken += need
            if not self.fits_min(free, head):  # (cannot happen: ``need`` was freed for it)
                break
            head = next(heads, None)
        if not self.queue:
            # idle cores go to running grants only once nothing is queued (the plan gives
            # a head that fits its width first)
            while (grow := self._best_growth(now, units, free, domain, cost)) is not None:
                free[domain[grow.aid]] -= grow.cores
                units[grow.aid] = grow.units
        return self._apply(now, units, cost)

    def _best_growth(self, now: float, units: dict[str, int], free: list[int],
                     domain: dict[str, int], cost: float) -> _Step | None:
        """The step up of a running grant that lowers the objective most per core, among
        those its domain has cores for and whose resize pays (PAYBACK); None: none."""
        best: _Step | None = None
        for aid, pr in self._progress.items():
            u = units[aid]
            dom = free[domain[aid]]
            if not dom:
                continue
            age = now - pr.pending.submit_s
            here = flow_cost(age + pr.remaining(now, u, cost))
            now_left = pr.remaining(now, pr.units, cost)
            for nxt in pr.steps_up(u):
                if nxt - u > dom:
                    break
                left = pr.remaining(now, nxt, cost)
                if now_left - left < PAYBACK * cost:
                    continue
                value = (here - flow_cost(age + left)) / (nxt - u)
                if value > 0 and (best is None or value > best.value):
                    best = _Step(aid, nxt, nxt - u, value)
        return best

    def _shrunk_for(self, now: float, head: Pending, units: dict[str, int], free: list[int],
                    domain: dict[str, int], cost: float
                    ) -> tuple[int, float, dict[str, int]] | None:
        """Running grants shrunk, the cheapest per core first, so ``head`` fits: (the cores
        it needs from them, what the objective loses, the grants' units then); None: they
        cannot give as many."""
        give = [0] * len(free)
        for aid, u in units.items():
            give[domain[aid]] += u - self._progress[aid].pending.key_min
        if head.elastic:  # (its cores come from one domain: the one that can give most)
            d = max(range(len(free)), key=lambda k: free[k] + give[k])
            need, donors = head.key_min - free[d], [a for a in units if domain[a] == d]
        else:
            need, donors = head.key_min - sum(free), list(units)
        if need <= 0 or need > sum(units[a] - self._progress[a].pending.key_min
                                   for a in donors):
            return None
        trial = dict(units)
        loss = 0.0
        got = 0
        while got < need:
            best: _Step | None = None
            for aid in donors:
                pr = self._progress[aid]
                u = trial[aid]
                lower = pr.step_down(u)
                if lower is None:
                    continue
                left = pr.remaining(now, u, cost)
                age = now - pr.pending.submit_s
                # (it stays narrower to its end: a head that ends first gives its
                # cores back, but to whichever action the next share finds best)
                value = (flow_cost(age + pr.remaining(now, lower, cost))
                         - flow_cost(age + left)) / (u - lower)
                if best is None or value < best.value:
                    best = _Step(aid, lower, u - lower, value)
            if best is None:
                return None
            loss += best.value * best.cores
            got += best.cores
            trial[best.aid] = best.units
        return need, loss, trial


def _wait_for(ends: list[tuple[float, int]], need: int, now: float) -> float:
    """How long until running actions expected to end free ``need`` units (ends in order)."""
    freed = 0
    for end, units in ends:
        freed += units
        if freed >= need:
            return max(end - now, 0.0)
    return float("inf")
