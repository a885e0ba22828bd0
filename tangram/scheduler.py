"""ElasticScheduler: paper Alg. 1 (greedy eviction) with Alg. 2 (ACT approximation).

One pass over one pool:

1. candidates = the longest prefix of the ordered wait queue whose minimums
   fit the free resources and their topology (and the free quotas);
2. non-elastic candidates, and elastic ones whose duration or elasticity is
   unknown, get their minimum;
3. the elastic ones share what is left: one DPArrange pass gives the optimum
   of every prefix ``E[:t]``; starting from the full prefix, drop the last
   candidate while the approximate objective improves.

Departure from the paper's text: the paper starts greedy eviction from "all
candidates at their minimum" and only then evicts. With a short queue that
start would leave free cores idle (evicting the single candidate dispatches
nothing), so here the minimum allocation and the DP allocation of the full
prefix are both evaluated as starting points, and eviction proceeds from the
DP one.

Beyond the paper (``ElasticScheduler``, the ``tangram`` policy): the objective also
counts the actions that trajectories now thinking will submit (closed loop: each
weighted by how often its last kind of action was followed by another); eviction may
go down to the empty set so that the head waits, bounded by its own run time, for a
wider grant; and the DP prices each unit count with the pool's state-dependent
overhead (a GPU variant that is not resident pays its restore). ``PaperScheduler``
(the ``tangram-paper`` policy) turns these three hooks back into Alg. 1-2's rules:
no expected arrivals, no waiting, the plain duration table.

The objective (Alg. 2) sums, over candidates and the remaining queue, the
estimated completion time: candidates' durations are exact from the DP; each
remaining action gets its minimum and is inserted, in order, into a heap of
running completions to estimate its start. The first ``depth`` remaining
elastic actions also try the widest count free when they can start, keeping
whichever gives the least total over the rest of the queue. Only the
first ``lookahead`` remaining actions are simulated: those behind them shift
by about the same amount in every alternative, and the cap bounds a pass.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, islice
from operator import itemgetter
from typing import Protocol

from tangram.api.quota import QuotaManager
from tangram.arrange import arrange
from tangram.estimates import Estimates, command_of
from tangram.model import Action, Elasticity, Pending
from tangram.pool import Pool, resizable


class Ordering(Protocol):
    """Order in which the wait queue is considered."""

    name: str

    def order(self, queue: Sequence[Pending], now: float,
              estimates: Estimates) -> Iterable[Pending]: ...


class FCFS:
    name = "fcfs"

    def order(self, queue: Sequence[Pending], now: float,
              estimates: Estimates) -> Iterable[Pending]:
        return queue


class ShortestExpectedFirst:
    """Shortest expected duration first, with an aging bound: an action that
    has waited ``max_wait_s`` jumps ahead of every younger one (no starvation)."""

    name = "sef"

    def __init__(self, max_wait_s: float = 30.0) -> None:
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s: must be > 0, got {max_wait_s!r}")
        self.max_wait_s = max_wait_s

    def order(self, queue: Sequence[Pending], now: float,
              estimates: Estimates) -> Iterable[Pending]:
        def key(p: Pending) -> tuple[int, float]:
            aged = now - p.submit_s >= self.max_wait_s
            return (0, p.submit_s) if aged else (1, estimates.estimate(p))

        return sorted(queue, key=key)


Decision = tuple[Pending, int]

INF = float("inf")

#: an expected end's parts: (end, units)
_END, _UNITS = itemgetter(0), itemgetter(1)


class ElasticScheduler:
    name = "tangram"
    #: whether elastic actions may get more than the units ``min_units`` gives
    elastic_enabled = True

    def __init__(self, depth: int = 2, lookahead: int = 32,
                 ordering: Ordering | None = None) -> None:
        if depth < 0:
            raise ValueError(f"depth: must be >= 0, got {depth}")
        if lookahead < 1:
            raise ValueError(f"lookahead: must be >= 1, got {lookahead}")
        self.depth = depth
        self.lookahead = lookahead
        self.ordering: Ordering = ordering or FCFS()
        #: pool name -> ids of the elastic actions started there (those still in the
        #: pool's ``running`` are running): how many share the pool now
        self._elastic_ids: dict[str, set[str]] = {}
        #: pool name -> moving average (over passes) of the elastic actions there
        self._concurrency: dict[str, float] = {}
        #: pool name -> what the last weighing saw when it left every elastic candidate
        #: waiting, and when the head expected the units it waits for
        self._waited: dict[str, _Waiting] = {}

    def min_units(self, choices: tuple[int, ...]) -> int:
        """Units an elastic action needs at least (its smallest feasible amount)."""
        return choices[0]

    def profile(self, action: Action, choices: tuple[int, ...],
                estimates: Estimates) -> dict[int, float]:
        """Expected duration per feasible unit count of an elastic action ({}: unknown, it
        runs at its minimum). No oracle: only what the user declared (``t1_s``, E(m)) and
        what was observed. Beyond the paper: T1 learnt for a declared E(m), and a speedup
        curve learnt per (task, kind) when nothing was declared (with bounded exploration,
        tangram.estimates.DurationModel)."""
        e = action.elasticity
        if e is not None:
            declared = self.declared_profile(action, estimates)
            return {} if declared is None else e.durations(declared[1], choices)
        if action.t1_s is not None:
            return {}  # a declared T1 without E(m) says nothing of other unit counts
        return estimates.durations.learnt_table((action.task, action.kind), choices,
                                                command_of(action)) or {}

    def declared_profile(self, action: Action,
                         estimates: Estimates) -> tuple[Elasticity, float] | None:
        """E(m) and T1 when the action declares E(m) and its T1 is known (declared, or
        learnt): :meth:`profile`'s table is then ``E.durations(T1, choices)``, which the
        core computes only when it is first read (tangram.pool.Pending). None:
        :meth:`profile` gives the table (learnt, or none). A subclass whose
        :meth:`profile` gives a declared action another table returns None here."""
        e = action.elasticity
        if e is None:
            return None
        t1 = (action.t1_s if action.t1_s is not None
              else estimates.durations.learnt_t1((action.task, action.kind)))
        return None if t1 is None else (e, t1)

    # -- Alg. 1 ------------------------------------------------------------------------
    def plan(self, pool: Pool, now: float, estimates: Estimates,
             quota: QuotaManager) -> list[Decision]:
        """Which queued actions of ``pool`` start now, and on how many units."""
        if not pool.queue:
            return []
        it = iter(self.ordering.order(pool.queue, now, estimates))
        scratch = pool.new_scratch()
        quotas: dict[str, float] | None = None
        cands: list[Pending] = []
        blocked: Pending | None = None
        for p in it:
            if p.quotas:
                if quotas is None:
                    quotas = {k: quota.available(k, now) for k in quota.specs}
                if any(quotas[k] < v for k, v in p.quotas.items()):
                    blocked = p
                    break
            if not pool.fits_min(scratch, p):
                blocked = p
                break
            if p.quotas:
                for k, v in p.quotas.items():
                    quotas[k] -= v  # type: ignore[index]
            cands.append(p)
        if not cands:
            return []
        fixed = [p for p in cands if not p.elastic]
        elastic = [p for p in cands if p.elastic]
        decisions: list[Decision] = [(p, p.key_min) for p in fixed]
        if elastic:
            rest = [] if blocked is None else [blocked]
            rest.extend(islice(it, self.lookahead - len(rest)))
            expected = (self.expected_arrivals(pool, now, estimates, self.lookahead - len(rest))
                        if len(rest) < self.lookahead else [])
            # the queue behind the window: each of those starts no earlier than the
            # window's last action, so it is delayed as much as that one is
            tail = max(0, len(pool.queue) - len(cands) - len(rest))
            chosen = self.allocate(pool, fixed, elastic, rest, now, estimates, expected, tail)
            ids = self._elastic_ids.setdefault(pool.name, set())
            ids.update(p.action.id for p, _ in chosen)
            decisions.extend(chosen)
        return decisions

    # -- the three hooks where we go beyond Alg. 1-2 (PaperScheduler undoes them) -----
    def expected_arrivals(self, pool: Pool, now: float, estimates: Estimates,
                          limit: int) -> list[tuple[float, int, float]]:
        """Actions not queued yet that the objective should count (closed loop)."""
        return estimates.expected_arrivals(pool.name, now, limit)

    def option_costs(self, pool: Pool, p: Pending) -> dict[int, float]:
        """What each unit count costs ``p`` in the DP (with state-dependent overhead)."""
        return pool.option_costs(p)

    def width_caps(self, pool: Pool, elastic: list[Pending], rest: list[Pending], now: float,
                   estimates: Estimates, tail: int) -> list[int] | None:
        """The widest grant each elastic candidate may get (None: no cap).

        A grant is irrevocable: the units an action takes are not there for the elastic
        actions that arrive while it runs. With sublinear speedups the mean completion
        time is least when the actions present share the units (heSRPT, Berg et al.
        2020: with speedup m^p every job gets a share, none the whole pool; EQUI when
        sizes are unknown), so an action takes at most the pool's units over the number
        of elastic actions expected to share the pool during its run: the elastic ones
        running and waiting now (itself among them), or, when more, how many the pool
        has held on average (closed loop: the actions that will arrive during its run
        are, on average, as many as have been there), and at most an equal share, with
        the elastic arrivals expected during its run, of what is free then. Only
        what the core observed: its grants, its queue, the learnt share of elastic
        actions, the expected ends of its grants, the trajectories now thinking."""
        avg = self.count_sharing(pool, elastic, rest, estimates, tail)
        free = pool.free_units()
        # (in order of end: what the running actions give back by a time is a prefix)
        ends = pool.expected_ends(now)
        # (a C loop: a saturated node runs hundreds; the ends are bisected in place)
        freed_by = list(accumulate(map(_UNITS, ends), initial=0))
        total = free + freed_by[-1]
        share = estimates.durations.elastic_share(pool.name)
        # the width an arriving elastic action should find: an equal share of the units
        # among as many as the pool holds on average
        fair = max(1.0, total / max(avg, 1.0))
        arrivals = estimates.arrivals
        thinking = arrivals.thinking(pool.name) * share
        think_s = max(arrivals.think_s, 1e-9)
        widest = min(free, self.FAIR_SPAN * fair)
        caps = []
        for p in elastic:
            cap = p.key_min
            for u, d in p.durations.items():
                if u > widest:
                    break  # (and every count after it: a table's counts ascend, as choices)
                if u <= cap:
                    continue
                # An equal split of the units free now and those the running actions give
                # back during its run, between itself and the elastic arrivals expected
                # meanwhile (the queue present is the objective's to weigh). The
                # rule before reserved a fair share for each expected arrival and fell back
                # to the minimum when that exceeded what was free; on a pool averaging one
                # elastic action the fair share is the whole pool, so one expected arrival
                # left a 38 s suite on 1 core of 22 free (and the arrival got 12).
                freed = freed_by[bisect_right(ends, now + d, key=_END)]
                coming = thinking * min(1.0, d / think_s)
                if u <= (free + freed) / (1.0 + coming):
                    cap = u
            caps.append(cap)
        return caps

    def count_sharing(self, pool: Pool, elastic: list[Pending], rest: list[Pending],
                      estimates: Estimates, tail: int) -> float:
        """The moving average, over passes, of the elastic actions that share ``pool``
        (running, candidates, queued), with this pass counted in."""
        ids = self._elastic_ids.get(pool.name)
        if ids:
            # (those that ended: a set's difference with a dict walks the set, its
            # intersection walks the dict, every action running on the node)
            ids.difference_update(ids.difference(pool.running))
        share = estimates.durations.elastic_share(pool.name)
        present = ((len(ids) if ids else 0) + len(elastic)
                   + sum(1 for p in rest if p.elastic) + share * tail)
        avg = self._concurrency.get(pool.name, present)
        avg += self.CONCURRENCY_ALPHA * (present - avg)
        self._concurrency[pool.name] = avg
        return avg

    #: the widest grant, in fair shares (an equal share among the elastic actions the
    #: pool holds on average): uneven grants cost more than they give (speedups are
    #: concave, so the same units spread evenly finish more work)
    FAIR_SPAN = 2.0

    #: candidates of a pass that try every width below the DP's (each a few walks)
    WIDTH_TRIES = 2

    #: weight of a pass's count in the average number of elastic actions in a pool
    CONCURRENCY_ALPHA = 0.05

    @staticmethod
    def flow_cost(act: float) -> float:
        """What an action's completion time from its arrival costs in the objective: its
        square, so the objective is the l2 norm of flow time (Bansal & Pruhs 2003, "Server
        scheduling in the Lp norm: a rising tide lifts all boats"; for jobs with speedup
        curves, as ours are, Edmonds, Im & Moseley 2011, whose WLAPS weighs a job by its
        age). The sum of completion times (Alg. 2's) is least when the short actions take
        the units and a long one runs narrow and last: the mean ACT's optimum is the
        tail's worst, and grants are irrevocable. Squared, an action weighs as much as the
        time it has already waited (the gradient of age^2 is 2 age) and a long one as much
        as it is long, so neither is left narrow until it becomes the p99. Measured
        (paired per cell: p99 ACT and reward time 1-3% lower, mean ACT within
        half a percent, lower on average)."""
        return act * act

    def may_wait(self, head: Pending, rest: list[Pending], now: float,
                 running: Ends, free: int) -> bool:
        """Whether eviction may go down to nothing so the head waits for a wider grant.
        Only with a short queue (behind a long one the units are contended anyway), and
        bounded: it never waits longer than its own run at the minimum, so its ACT at
        most doubles and nothing starves."""
        return (len(rest) < self.lookahead // 2
                and now - head.submit_s < head.durations[head.key_min]
                and _earliest_finish(running, free, now, head)[1] > now)

    def allocate(self, pool: Pool, fixed: list[Pending], elastic: list[Pending],
                 rest: list[Pending], now: float, estimates: Estimates,
                 expected: list[tuple[float, int, float]] = (), tail: int = 0
                 ) -> list[Decision]:
        """Greedy eviction over the elastic group (Alg. 1, lines 5-14)."""
        # A head that waits for a wider grant is weighed again only when what it weighs
        # changed (the free units, the candidates, the queue behind them; not the
        # arrivals expected of thinking trajectories, which move with the clock), when the
        # units it waits for were expected to be free by now, or once it has waited as
        # long as its own run at the minimum (``may_wait``'s bound: nothing starves);
        # not at every event of its node. Weighing it at every event of a saturated node
        # was most of a large simulation's cost, and grew with the nodes' size (a pass
        # walks the running actions' ends). Between those, only time passes: the ages
        # in the objective grow, which changed 1 wait in 60 to a start when it was
        # weighed at every event (coding, 4,096 trajectories). Also tried: not weighing
        # it again for arrivals at the queue's end (the same schedules' quality on the
        # quick matrix, one of its regression cells 13% worse on p99).
        free_after = pool.free_units() - sum(p.key_min for p in fixed)
        head = elastic[0]
        seen = (free_after, [p.action.id for p in elastic], [p.action.id for p in rest])
        last = self._waited.get(pool.name)
        if (last is not None and last.same_for(*seen) and now < last.until
                and now - head.submit_s < head.durations[head.key_min]):
            # (the pass still counts in the average of the elastic actions sharing the
            # pool, as width_caps counts every pass)
            self.count_sharing(pool, elastic, rest, estimates, tail)
            return []
        options = [self.option_costs(pool, p) for p in elastic]
        caps = self.width_caps(pool, elastic, rest, now, estimates, tail)
        chosen, until = self._allocate(pool, fixed, elastic, rest, now, estimates, expected,
                                       tail, caps, options)
        if chosen:
            self._waited.pop(pool.name, None)
        else:
            self._waited[pool.name] = _Waiting(*seen, until)
        return chosen

    def _allocate(self, pool: Pool, fixed: list[Pending], elastic: list[Pending],
                  rest: list[Pending], now: float, estimates: Estimates,
                  expected: list[tuple[float, int, float]], tail: int,
                  caps: list[int] | None, options: list[dict[int, float]]
                  ) -> tuple[list[Decision], float]:
        """:meth:`allocate`'s decisions, and, when every candidate waits, when the head
        expects the units it waits for (else infinity)."""
        estimate = estimates.estimate
        if caps is not None:
            options = [{u: c for u, c in o.items() if u <= cap} for o, cap in zip(
                options, caps, strict=True)]
        table = arrange(options, pool.operator.space(pool.elastic_capacity(fixed)))
        n = len(elastic)
        minimum = [p.key_min for p in elastic]
        full = table.best(n)
        if full is None:  # cannot happen: the minimums were checked to fit
            return list(zip(elastic, minimum, strict=True)), INF
        head = elastic[0]
        # (past its expected end: expected to run as long again as it has so far)
        ends = pool.expected_ends(now)
        if fixed:
            ends.extend((now + estimate(p), p.key_min) for p in fixed)
            ends.sort()
        running = Ends(ends)
        free0 = pool.free_units() - sum(p.key_min for p in fixed)
        # Beyond the paper: evicting down to nothing lets the head wait for more units
        # when that would finish it sooner (its depth exploration weighs "now at the
        # minimum" against "wider, later").
        # (not where grants grow as units free, tangram/cpu/malleable.py: it starts now
        # and widens then, instead of waiting for them)
        grants = resizable(pool)
        may_wait = ((grants is None or not grants.grows)
                    and self.may_wait(head, rest, now, running, free0))
        if n == 1 and full[1] == minimum and not may_wait:
            return [(head, minimum[0])], INF  # no room to grow, nothing to evict for
        # (units, estimated duration, pending, arrival) of every action the alternatives may
        # leave waiting: the queue (already here: its age counts in ``flow_cost``), then the
        # expected arrivals
        queued = [(p.key_min, estimate(p), p, p.submit_s) for p in elastic + rest]
        queued += [(units, dur, None, at) for at, units, dur in expected]

        flow_cost = self.flow_cost

        def objective(units: Sequence[int]) -> float:
            t = len(units)
            total = 0.0
            started = []
            for i, u in enumerate(units):
                d = options[i][u]
                total += flow_cost(now - elastic[i].submit_s + d)
                started.append((now + d, u))
            return total + self._walk(running.with_started(started), free0 - sum(units), now,
                                      queued[t: t + self.lookahead], now, self.depth, tail)

        best_units, best_obj = minimum, objective(minimum)
        prev_obj = best_obj if full[1] == minimum else objective(full[1])
        if prev_obj < best_obj:
            best_units, best_obj = full[1], prev_obj
        # the DP hands out the widest counts that fit; with the actions that will arrive
        # in the objective a narrower one can be better: the first WIDTH_TRIES candidates
        # each try every count between their minimum and the DP's (the others held)
        for i in range(min(n, self.WIDTH_TRIES)):
            top = full[1][i]
            for u in options[i]:
                if minimum[i] < u < top:
                    units = list(full[1])
                    units[i] = u
                    obj = objective(units)
                    if obj < best_obj:
                        best_units, best_obj = units, obj
        prev_obj = min(prev_obj, best_obj)
        for t in range(n - 1, -1 if may_wait else 0, -1):
            cand = table.best(t)
            if cand is None:
                break
            if t and free0 - sum(cand[1]) >= elastic[t].key_min:
                # the DP cannot hand the evicted action's units to the others (an action
                # takes at most its largest feasible count): evicting frees nothing
                break
            obj = objective(cand[1])
            if obj >= prev_obj:
                break  # evicting one more stopped improving
            prev_obj = obj
            if obj < best_obj:
                best_units, best_obj = cand[1], obj
        if best_units:
            return list(zip(elastic, best_units, strict=False)), INF
        return [], _earliest_finish(running, free0, now, head)[1]

    # -- Alg. 2 ------------------------------------------------------------------------
    def _walk(self, ends: Ends, free: int, clock: float,
              queued: list[tuple[int, float, Pending | None, float]], now: float,
              depth: int, tail: int = 0) -> float:
        """Sum of the ``flow_cost`` of the queued actions' estimated completion times (from
        arrival), each started in order once it has arrived and its units are free
        (``ends`` is this walk's own: it takes what it starts)."""
        flow_cost = self.flow_cost
        total = 0.0
        for idx, (need, dur, p, arrival) in enumerate(queued):
            if depth <= 0 or (p is None and _none_queued(queued, idx + 1)):
                # nothing left to explore (no depth left, or only expected arrivals
                # left, which are never explored): the rest in one tight loop
                total, free, clock = ends.place_all(total, free, clock, queued, idx,
                                                    flow_cost)
                break
            if arrival > clock:
                clock = arrival
            if p is not None:
                depth -= 1
                opts = self._options(ends, free, clock, p) if p.elastic else ()
                if len(opts) > 1:
                    # explore: at its minimum, or as wide as is free when it can start;
                    # keep whichever gives the least total over the rest of the queue
                    best = float("inf")
                    for u in opts:
                        e = ends.copy()
                        d = p.durations[u]
                        cost, f, clk = e.place(free, clock, u, d, arrival)
                        cost = flow_cost(cost) + self._walk(e, f, clk, queued[idx + 1:], now,
                                                            depth, tail)
                        best = min(best, cost)
                    return total + best
            cost, free, clock = ends.place(free, clock, need, dur, arrival)
            total += flow_cost(cost)
        return total + tail * flow_cost(clock - now)

    @staticmethod
    def _options(ends: Ends, free: int, clock: float, p: Pending) -> tuple[int, ...]:
        """Its minimum, and the unit count that would finish it first."""
        best_u, _ = _earliest_finish(ends, free, clock, p)
        return (p.key_min,) if best_u == p.key_min else (p.key_min, best_u)


@dataclass(frozen=True, slots=True)
class _Waiting:
    """What a pass weighed when it left every elastic candidate of a pool waiting, and
    when the head expected the units it waits for."""

    free: int
    elastic: list[str]
    rest: list[str]
    until: float

    def same_for(self, free: int, elastic: list[str], rest: list[str]) -> bool:
        """Whether a pass that sees these would weigh what this one did: the same free
        units, candidates and queue behind them."""
        return (free == self.free and elastic == self.elastic
                and rest == self.rest)


class Ends:
    """(expected end, units) of the running actions, popped in order of end, as the
    objective's walks see them: the actions running when the pass began, sorted once per
    pass and shared by every walk (read from an index, never copied), and a small heap of
    those the walk itself started. Each is taken from the least of the two heads: the
    sequence a heap of them all would give (equal entries are equal values), without
    copying and heapifying hundreds of running actions per alternative a pass weighs."""

    __slots__ = ("_base", "_next", "_started")

    def __init__(self, base: list[tuple[float, int]], start: int = 0,
                 started: list[tuple[float, int]] | None = None) -> None:
        #: sorted by (end, units); shared, never changed
        self._base = base
        self._next = start
        #: a heap
        self._started = started if started is not None else []

    def with_started(self, started: list[tuple[float, int]]) -> Ends:
        """A walk's own: these, and ``started`` (which it takes) begun now."""
        heapq.heapify(started)
        return Ends(self._base, self._next, started)

    def copy(self) -> Ends:
        return Ends(self._base, self._next, self._started.copy())

    def take(self, free: int, need: int, clock: float) -> tuple[int, float]:
        """Free units until ``need`` are free, or none is left, taking the entries that end
        first (the least of the two heads): (free, clock) after, the clock moved to the
        last one's end."""
        base, i, started = self._base, self._next, self._started
        n = len(base)
        while free < need:
            if i < n and (not started or base[i] <= started[0]):
                end, units = base[i]
                i += 1
            elif started:
                end, units = heapq.heappop(started)
            else:
                break
            free += units
            if end > clock:
                clock = end
        self._next = i
        return free, clock

    def place(self, free: int, clock: float, need: int, dur: float,
              now: float) -> tuple[float, int, float]:
        """Start an action of ``need`` units once they are free (:meth:`take`), for ``dur``;
        (its completion time from ``now``, free, clock) after."""
        if free < need:
            free, clock = self.take(free, need, clock)
        heapq.heappush(self._started, (clock + dur, need))
        return clock - now + dur, free - need, clock

    def place_all(self, total: float, free: int, clock: float,
                  queued: list[tuple[int, float, Pending | None, float]], first: int,
                  flow_cost: Callable[[float], float]) -> tuple[float, int, float]:
        """Start ``queued[first:]`` in order, each once it has arrived and its units are
        free, adding each one's ``flow_cost`` to ``total``: (total, free, clock) after.
        :meth:`place` each, its three lines written out around :meth:`take` (the walks
        place thousands of actions a pass, most needing nothing freed)."""
        take, heappush, started = self.take, heapq.heappush, self._started
        for k in range(first, len(queued)):
            need, dur, _, arrival = queued[k]
            if arrival > clock:
                clock = arrival
            if free < need:
                free, clock = take(free, need, clock)
            heappush(started, (clock + dur, need))
            total += flow_cost(clock - arrival + dur)
            free -= need
        return total, free, clock


def _none_queued(queued: list[tuple[int, float, Pending | None, float]], first: int) -> bool:
    """Whether ``queued[first:]`` holds only expected arrivals (no queued action: the
    objective lists those after the queue, so this is asked once per walk)."""
    return all(q[2] is None for q in islice(queued, first, None))


def _earliest_finish(ends: Ends, free: int, clock: float, p: Pending) -> tuple[int, float]:
    """The unit count that would finish ``p`` first given when the running actions free
    their units (waiting for them if that pays), and when it would start. (``ends``
    stays as it is: what is taken is taken from a copy.)"""
    mine = ends.copy()
    durations = p.durations
    avail, t = free, clock
    best_u, best_finish, best_start = p.key_min, float("inf"), clock
    for u in p.choices:
        if avail < u:
            avail, t = mine.take(avail, u, t)
            if avail < u:
                break
        finish = t + durations[u]
        if finish < best_finish:
            best_u, best_finish, best_start = u, finish, t
    return best_u, best_start


class PaperScheduler(ElasticScheduler):
    """Alg. 1-2 as published: the objective sees only the queue, the DP prices only
    durations, and greedy eviction keeps at least the head (it starts now)."""

    name = "tangram-paper"

    def profile(self, action: Action, choices: tuple[int, ...],
                estimates: Estimates) -> dict[int, float]:
        """The paper's rule: only declared profiles (T1 and E(m)); the rest at minimum."""
        declared = self.declared_profile(action, estimates)
        return {} if declared is None else declared[0].durations(declared[1], choices)

    def declared_profile(self, action: Action,
                         estimates: Estimates) -> tuple[Elasticity, float] | None:
        e = action.elasticity
        return None if action.t1_s is None or e is None else (e, action.t1_s)

    def expected_arrivals(self, pool: Pool, now: float, estimates: Estimates,
                          limit: int) -> list[tuple[float, int, float]]:
        return []

    def option_costs(self, pool: Pool, p: Pending) -> dict[int, float]:
        return p.durations

    def width_caps(self, pool: Pool, elastic: list[Pending], rest: list[Pending], now: float,
                   estimates: Estimates, tail: int) -> list[int] | None:
        return None

    def may_wait(self, head: Pending, rest: list[Pending], now: float,
                 running: Ends, free: int) -> bool:
        return False

    @staticmethod
    def flow_cost(act: float) -> float:
        return act  # Alg. 2 sums the completion times


class FixedDopScheduler(ElasticScheduler):
    """Baseline: elasticity off; every elastic action runs on exactly ``units``
    of its key resource (clamped to its feasible set) and waits until they are
    free, like a test command hard-coded to ``pytest -n units``."""

    def __init__(self, units: int, **kw) -> None:
        super().__init__(**kw)
        if units < 1:
            raise ValueError(f"fixed-dop: units must be >= 1, got {units}")
        self.units = units
        self.name = f"fixed-dop:{units}"

    elastic_enabled = False

    def min_units(self, choices: tuple[int, ...]) -> int:
        fit = [u for u in choices if u <= self.units]
        return fit[-1] if fit else choices[0]
