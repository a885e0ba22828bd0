"""What the core has learnt from observation: durations and arrivals.

A scheduling decision may use only what a deployment knows: what the user
declared on the action (``t1_s``, ``elasticity``) and what was observed of
earlier actions. Both models here are fed by the core (``observe_*``) and read
by the scheduler through :class:`Estimates`, the one argument ``plan()`` gets
for them.

* :class:`DurationModel`: running means of execution time per (task, kind), of
  the one-unit time T1 of elastic actions whose E(m) is known, and per pool of
  its non-elastic actions (the expected length of a closed-loop arrival).
* :class:`ArrivalModel`: closed-loop arrivals (DESIGN: agentic workloads are
  closed loop). Trajectories that are thinking after an action on a pool will
  most likely submit their next action there; each counts with the observed
  probability that an action of its last (task, kind) is followed by another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tangram.model import Action

if TYPE_CHECKING:
    from tangram.pools import Pending

Key = tuple[str, str]  # (task, kind)


@dataclass(slots=True)
class _Mean:
    n: int = 0
    mean: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.mean += (x - self.mean) / self.n


class DurationModel:
    """Observed execution times."""

    def __init__(self, default_s: float = 1.0, short_prior_s: float = 1.0) -> None:
        #: what an action of a never-seen (task, kind) is expected to take
        self.default_s = default_s
        self._short_prior_s = short_prior_s
        self._mean: dict[Key, _Mean] = {}
        self._t1: dict[Key, _Mean] = {}
        #: pool name -> moving average of its non-elastic actions' execution time
        self._short: dict[str, float] = {}

    def mean(self, key: Key) -> float | None:
        m = self._mean.get(key)
        return m.mean if m else None

    def learnt_t1(self, key: Key) -> float | None:
        """T1 back-computed from observed elastic runs (their E(m) declared)."""
        m = self._t1.get(key)
        return m.mean if m else None

    def short_s(self, pool: str) -> float:
        return self._short.get(pool, self._short_prior_s)

    def observe(self, action: Action, units: int, elapsed: float, pool: str,
                elastic: bool) -> None:
        key = (action.task, action.kind)
        self._mean.setdefault(key, _Mean()).add(elapsed)
        if action.elasticity is not None and action.elastic:
            t1 = elapsed * action.elasticity.efficiency(units) * units  # back to one unit
            self._t1.setdefault(key, _Mean()).add(t1)
        if not elastic:
            s = self._short.get(pool, self._short_prior_s)
            self._short[pool] = s + 0.05 * (elapsed - s)


class ArrivalModel:
    """Trajectories thinking between actions, and when they come back."""

    def __init__(self, think_prior_s: float = 5.0) -> None:
        #: moving average of think time (LLM generation between actions), all trajectories
        self.think_s = think_prior_s
        #: (task, kind) -> (times a trajectory submitted again after it, times observed)
        self._follow: dict[Key, tuple[int, int]] = {}
        #: pool name -> expected number of thinking trajectories that will submit there
        self._thinking: dict[str, float] = {}

    def continue_p(self, key: Key) -> float:
        """How often a trajectory submitted again after an action of this (task, kind)
        (a reward is usually last); Laplace prior 1/2."""
        cont, total = self._follow.get(key, (0, 0))
        return (cont + 1) / (total + 2)

    def started_thinking(self, pool: str, key: Key) -> float:
        """A trajectory's last in-flight action on ``pool`` ended; returns its weight."""
        w = self.continue_p(key)
        self._thinking[pool] = self._thinking.get(pool, 0.0) + w
        return w

    def stopped_thinking(self, pool: str, key: Key, weight: float, continued: bool,
                         think_s: float | None = None) -> None:
        """It submitted again (``continued``) or closed; learn from it."""
        self._thinking[pool] = self._thinking.get(pool, 0.0) - weight
        cont, total = self._follow.get(key, (0, 0))
        self._follow[key] = (cont + continued, total + 1)
        if think_s is not None:
            self.think_s += 0.05 * (think_s - self.think_s)

    def thinking(self, pool: str) -> float:
        return self._thinking.get(pool, 0.0)


class Estimates:
    """The scheduler's view of the learnt models (one object; no closures)."""

    __slots__ = ("durations", "arrivals")

    def __init__(self, durations: DurationModel | None = None,
                 arrivals: ArrivalModel | None = None) -> None:
        self.durations = durations or DurationModel()
        self.arrivals = arrivals or ArrivalModel()

    def duration(self, action: Action, units: int, durations: dict[int, float]) -> float:
        """Expected execution time at ``units``: the pending action's modelled table,
        else its declared T1, else the running mean of its (task, kind)."""
        if durations:
            return durations[units]
        if action.t1_s is not None:
            return action.duration(units)  # type: ignore[return-value]
        mean = self.durations.mean((action.task, action.kind))
        return mean if mean is not None else self.durations.default_s

    def estimate(self, p: Pending) -> float:
        """Expected duration of a queued action at its minimum."""
        return self.duration(p.action, p.key_min, p.durations)

    def expected_arrivals(self, pool: str, now: float,
                          limit: int) -> list[tuple[float, int, float]]:
        """The next actions of the trajectories thinking on ``pool``: spread over one mean
        think time (remaining think is about uniform), one unit each, the pool's mean
        duration of non-elastic actions."""
        n = int(self.arrivals.thinking(pool))
        if n <= 0 or limit <= 0:
            return []
        step = self.arrivals.think_s / n
        short = self.durations.short_s(pool)
        return [(now + step * (k + 0.5), 1, short) for k in range(min(n, limit))]
