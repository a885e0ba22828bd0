"""What the core has learnt from observation: durations and arrivals.

A scheduling decision may use only what a deployment knows: what the user
declared on the action (``t1_s``, ``elasticity``) and what was observed of
earlier actions. Both models here are fed by the core (``observe_*``) and read
by the scheduler through :class:`Estimates`, the one argument ``plan()`` gets
for them.

* :class:`DurationModel`: running means of execution time per (task, kind), of
  the one-unit time T1 of elastic actions whose E(m) is known, and per pool of
  its non-elastic actions (the expected length of a closed-loop arrival); and,
  for elastic actions nobody profiled, a :class:`SpeedupCurve` per (task, kind)
  fitted online from the runs observed at different unit counts, and per command
  of that kind (:class:`CommandCurves`: the kind's shape, the command's own scale).
* :class:`LaneModel`: which one-core actions are light (short enough for a CPU node's
  light lane), learnt per command: ``ls`` and ``python -c "import sympy"`` are the same
  kind, not the same command.
* :class:`ArrivalModel`: closed-loop arrivals (docs/design.md: agentic
  workloads are closed loop). Trajectories that are thinking after an action on a pool will
  most likely submit their next action there; each counts with the observed
  probability that an action of its last (task, kind) is followed by another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING

import numpy as np

from tangram.model import Action

if TYPE_CHECKING:
    from tangram.model import Pending

Key = tuple[str, str]  # (task, kind)


@dataclass(slots=True)
class _Mean:
    n: int = 0
    mean: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.mean += (x - self.mean) / self.n


def _solve_small(a: list[list[float]], y: list[float],
                 idx: tuple[int, ...]) -> list[float] | None:
    """The solution of the normal equations restricted to ``idx`` (one to three terms,
    Cramer's rule), None if singular."""
    if len(idx) == 1:
        (i,) = idx
        return [y[i] / a[i][i]] if a[i][i] != 0 else None
    if len(idx) == 2:
        i, j = idx
        det = a[i][i] * a[j][j] - a[i][j] * a[j][i]
        if det == 0:
            return None
        return [(y[i] * a[j][j] - a[i][j] * y[j]) / det,
                (a[i][i] * y[j] - a[j][i] * y[i]) / det]
    det = _det3(a)  # (three terms: all of them)
    if det == 0:
        return None
    # (column c replaced by y)
    return [_det3([[y[r] if k == c else a[r][k] for k in range(3)] for r in range(3)]) / det
            for c in range(3)]


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


class SpeedupCurve:
    """Mean execution time of one (task, kind) on ``m`` units, learnt online:

        t(m) = A + B / m + C * (m - 1),   A, B, C >= 0

    A is the serial part, B the parallel part (Amdahl: T1 = A + B, p = B / T1) and C a
    per-unit overhead (worker start-up) that lets the curve turn upwards: ``pytest -n 2``
    can be slower than ``-n 1``, which Amdahl alone cannot express. Each run of the kind
    is a sample of its own size, so the fit is of the *mean* curve. Least squares over
    sufficient statistics (O(1) per observation), non-negative by trying every subset of
    the three terms; C is fitted only once three distinct unit counts were seen (with
    two it is not identifiable).
    """

    #: runs before the curve is trusted (and at least two distinct unit counts)
    MIN_RUNS = 3

    __slots__ = ("_xtx", "_xty", "_yty", "n", "_fit", "_scatter", "runs_at")

    def __init__(self) -> None:
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._yty = 0.0
        self.n = 0
        self._fit: tuple[float, float, float] | None = None
        #: :meth:`scatter` of the fit (None: not computed since the last observation)
        self._scatter: float | None = None
        #: unit count -> runs observed at it (its keys: the distinct counts)
        self.runs_at: dict[int, int] = {}

    @staticmethod
    def features(m: int) -> np.ndarray:
        """A run's row in the least squares: the terms A, B and C multiply."""
        return np.array([1.0, 1.0 / m, m - 1.0])

    def observe(self, units: int, elapsed: float) -> None:
        x = self.features(max(units, 1))
        self._xtx += np.outer(x, x)
        self._xty += x * elapsed
        self._yty += elapsed * elapsed
        self.n += 1
        m = max(units, 1)
        self.runs_at[m] = self.runs_at.get(m, 0) + 1
        self._fit = self._scatter = None

    def mean_time(self) -> float:
        return self._xty[0] / self.n if self.n else 0.0

    def mean_units(self) -> float:
        """Harmonic mean of the unit counts observed (what the mean time was run at)."""
        return self.n / self._xtx[0, 1] if self.n else 1.0

    def fit(self) -> tuple[float, float, float] | None:
        """(A, B, C), or None until it can be trusted."""
        if self.n < self.MIN_RUNS or len(self.runs_at) < 2:
            return None
        if self._fit is None:
            self._fit = self._solve(self._xtx, self._xty, self._yty)
        return self._fit

    def _solve(self, xtx: np.ndarray, xty: np.ndarray,
               yty: float) -> tuple[float, float, float]:
        """Non-negative least squares over the sufficient statistics: every subset of the
        terms (C only with three distinct unit counts) solved in closed form, the least
        residual of those with no negative coefficient. (Plain floats: numpy's per-call
        overhead on 3x3 systems was most of the cost, and the censored fit solves twice
        per table read.)"""
        a = xtx.tolist()
        y = xty.tolist()
        terms = (0, 1, 2) if len(self.runs_at) >= 3 else (0, 1)
        best, best_res = (0.0, 0.0, 0.0), float("inf")
        for k in range(1, len(terms) + 1):
            for sub in combinations(terms, k):
                coef = _solve_small(a, y, sub)
                if coef is None or min(coef) < 0:
                    continue
                full = [0.0, 0.0, 0.0]
                for i, c in zip(sub, coef, strict=True):
                    full[i] = c
                # (the residual yty - 2 f.y + f.A.f; f solves A f = y on its terms, so
                # f.A.f = f.y there)
                res = yty - sum(c * y[i] for i, c in zip(sub, coef, strict=True))
                if res < best_res - 1e-12:
                    best, best_res = (full[0], full[1], full[2]), res
        return best

    def censored(self, elapsed: np.ndarray,
                 features: np.ndarray) -> tuple[float, float, float] | None:
        """(A, B, C) with the runs still in flight read as right-censored: run ``i`` has
        been running ``elapsed[i]`` s on the unit count of ``features[i]`` (its row of
        :meth:`features`). None while :meth:`fit` is.

        Why: runs end in order of length, so the first results at a unit count are its
        short runs; a count the scheduler just moved to looked faster than the counts
        whose runs had all ended, the fit went flat and grants stepped down a count at a
        time to 1 core (coding 1,024 on 15 nodes, a kind's first 55 results at
        1 core averaged 4.0 s, all 416 of them 16.9 s). A run at ``m`` units running for
        ``e`` s says its time there is at least ``e``; it is counted at its expected time
        given that (:func:`residual_mean`) on the curve itself: two EM steps from
        :meth:`fit`.
        """
        f = self.fit()
        if f is None or not len(elapsed):
            return f
        cv = self.scatter()
        xtx = self._xtx + features.T @ features
        for _ in range(2):
            pred = np.maximum(features @ np.array(f), 1e-6)
            f = self._solve(xtx, self._xty + features.T @ residual_mean(elapsed, pred, cv),
                            self._yty)
        return f

    def scatter(self) -> float:
        """The runs' coefficient of variation about the fitted curve (0 to 1): how far a
        run outlives its expected time (:func:`residual_mean`). Once per fit: every table
        read with runs in flight asks for it."""
        if self._scatter is None:
            self._scatter = self._scatter_of_fit()
        return self._scatter

    def _scatter_of_fit(self) -> float:
        f = self.fit()
        if f is None or self.n < 2:
            return 1.0
        full = np.array(f)
        res = self._yty - 2 * full @ self._xty + full @ self._xtx @ full
        mean = self.mean_time()
        if mean <= 0:
            return 1.0
        return min(math.sqrt(max(res, 0.0) / self.n) / mean, 1.0)

    def duration(self, units: int) -> float | None:
        f = self.fit()
        if f is None:
            return None
        a, b, c = f
        return a + b / units + c * (units - 1)

    def table(self, choices: tuple[int, ...],
              running: tuple[np.ndarray, np.ndarray] | None = None) -> dict[int, float] | None:
        """:meth:`duration` of each of ``choices`` (at least 1e-6), the fit read once
        (with the runs in flight, ``running``: :meth:`censored`'s arguments); None until
        it can be trusted."""
        f = self.censored(*running) if running is not None else self.fit()
        if f is None:
            return None
        a, b, c = f
        return {u: max(a + b / u + c * (u - 1), 1e-6) for u in choices}


def residual_mean(elapsed: np.ndarray, expected: np.ndarray | float,
                  cv: float) -> np.ndarray:
    """Expected times of runs still in flight after ``elapsed`` s each, of a kind whose
    runs take ``expected`` s on average with coefficient of variation ``cv`` (0 to 1):

        max(e, expected) + cv * min(e, expected)

    cv 1 is the memoryless case (an exponential's mean residual life is its mean: a run
    e s in is expected to end at e + expected; within 10% of a lognormal's with the
    coding trace's spread, t1 mean 17 s, std 18 s, for e >= 5 s); cv 0 are runs of one
    length (one past its expected time ends about now)."""
    return np.maximum(elapsed, expected) + cv * np.minimum(elapsed, expected)


class CommandCurves:
    """Speedup curves of one (task, kind) per *command* (a test file, a suite), with the
    kind as the prior: every command of a kind shares the curve's shape, each has its own
    size.

    Why: the runs of one kind are often different suites (sizes spread by an order of
    magnitude); a single curve per kind fits their *mean* and needs hundreds of runs to
    settle, while what repeats is the command (a GRPO group runs the same hidden suite;
    an agent reruns the same test file). Model (Amdahl with a per-unit start-up cost,
    as :class:`SpeedupCurve`, the parallel fraction shared by the kind):

        t(c, m) = a[c] * ((1 - p) + p / m) + C * (m - 1),   a[c], C >= 0

    least squares over per-(command, m) sufficient statistics: for each ``p`` of a grid
    the sizes ``a`` and the start-up cost ``C`` have a closed form, and the ``p`` with the
    least residual wins (residuals relative to each cell's mean). The shape is learnt
    only from commands observed at two or more unit counts; the others only set their
    own size. A command never seen gets the kind's curve (DurationModel).
    """

    #: the grid of parallel fractions tried (0.01 steps)
    GRID = np.linspace(0.0, 1.0, 101)

    __slots__ = ("_index", "_units", "_n", "_s", "runs", "_fit", "_contrasted")

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._units: dict[int, int] = {}
        self._n = np.zeros((0, 0))
        self._s = np.zeros((0, 0))  # sum of elapsed per (command, unit count)
        self.runs = 0
        self._fit: tuple[float, float, np.ndarray] | None = None
        #: some command has run at two or more unit counts: the shape rests on those (with
        #: none, each command's size absorbs its runs and every shape fits equally; the
        #: grid's first, a flat one, won, and a suite once run on 16 units was then planned
        #: at its minimum)
        self._contrasted = False

    def observe(self, command: str, units: int, elapsed: float) -> None:
        m = max(units, 1)
        c = self._index.setdefault(command, len(self._index))
        k = self._units.setdefault(m, len(self._units))
        if c >= self._n.shape[0] or k >= self._n.shape[1]:
            shape = (len(self._index), len(self._units))
            n, s = np.zeros(shape), np.zeros(shape)
            n[: self._n.shape[0], : self._n.shape[1]] = self._n
            s[: self._s.shape[0], : self._s.shape[1]] = self._s
            self._n, self._s = n, s
        self._n[c, k] += 1
        self._s[c, k] += elapsed
        if not self._contrasted and self._n[c, k] == 1:  # (a new count for this command)
            self._contrasted = int((self._n[c] > 0).sum()) >= 2
        self.runs += 1
        self._fit = None

    def fit(self) -> tuple[float, float, np.ndarray] | None:
        """(p, C, a per command), or None until some command ran at two unit counts and
        there are three runs."""
        if not self._contrasted or self.runs < SpeedupCurve.MIN_RUNS:
            return None
        if self._fit is None:
            m = np.array(sorted(self._units, key=self._units.get), dtype=float)
            d = m - 1.0
            # relative errors: every (command, m) cell weighted by 1 / its mean^2, so a
            # large suite's seconds of noise do not outweigh a small one's fractions
            mean = np.divide(self._s, self._n, out=np.ones_like(self._s), where=self._n > 0)
            wt = 1.0 / np.maximum(mean, 1e-9) ** 2
            n, s = self._n * wt, self._s * wt
            g = (1.0 - self.GRID)[:, None] + self.GRID[:, None] / m[None, :]  # [P, M]
            u = s @ g.T                      # [C, P]: sum_m g S
            v = (n * d) @ g.T                # sum_m n g d
            w = n @ (g * g).T                # sum_m n g^2
            w = np.where(w > 0, w, np.inf)
            sd, nd2 = float((s * d).sum()), float((n * d * d).sum())
            den = nd2 - (v * v / w).sum(axis=0)
            cost = np.where(den > 1e-12, (sd - (u * v / w).sum(axis=0)) / np.where(
                den > 1e-12, den, 1.0), 0.0)
            cost = np.maximum(cost, 0.0)
            # residual up to the constant sum of squares: -(U - C V)^2 / W - 2 C Sd + C^2 nd2
            res = -((u - cost * v) ** 2 / w).sum(axis=0) - 2 * cost * sd + cost ** 2 * nd2
            best = int(np.argmin(res))
            a = np.maximum((u[:, best] - cost[best] * v[:, best]) / w[:, best], 0.0)
            self._fit = (float(self.GRID[best]), float(cost[best]), a)
        return self._fit

    def table(self, command: str, choices: tuple[int, ...]) -> dict[int, float] | None:
        """Expected duration per unit count of ``command`` (the kind's mean size if never
        seen) on the kind's shape; None until the shape is known."""
        f = self.fit()
        if f is None:
            return None
        p, cost, a = f
        c = self._index.get(command)
        size = float(a[c]) if c is not None else float(a.mean())
        return {u: max(size * ((1 - p) + p / u) + cost * (u - 1), 1e-6) for u in choices}

    def seen(self, command: str) -> bool:
        return command in self._index


class LaneModel:
    """Which one-core actions are *light* (expected to take at most a lane's ``light_s``),
    by the finest identity an action has: its command.

    Per (task, kind) the lane never engaged where a kind mixes commands (``ls``: 10 ms,
    ``python -c "import sympy"``: 2-5 s, both ``shell``), and once it did, the slow one
    took the lane's only slot. So, for an action naming its command:

    * a command seen before is light iff its runs' mean is within ``light_s`` and none of
      its runs is overstaying the lane right now (:meth:`overstaying`: known long before
      it ends);
    * a command never seen: its declared ``t1_s`` if any; else the kind's prior: light iff
      at least half of the kind's observed runs (of any command, at least two) were. A
      wrong guess costs little: an action overstaying the lane is moved off it
      (tangram/cpu/pool.py) and its command is known long from then on.

    An action naming no command (a trace's rows) has nothing finer than its kind: a
    declared ``t1_s`` within ``light_s`` is believed until two runs of the kind took
    longer on average, and an undeclared one is light once two runs of its
    kind were, on average.
    """

    __slots__ = ("_runs", "_kinds", "_over")

    def __init__(self) -> None:
        #: (task, kind, command) -> its runs' mean
        self._runs: dict[tuple[str, str, str], _Mean] = {}
        #: (task, kind) -> (runs within light_s, runs) of actions naming a command
        self._kinds: dict[Key, tuple[int, int]] = {}
        #: action id -> the command it runs, for actions overstaying a lane now
        self._over: dict[str, tuple[str, str, str]] = {}

    def observe(self, action: Action, command: str, elapsed: float, light_s: float) -> None:
        """A one-core run of ``command`` ended after ``elapsed`` s (``light_s``: the lane's
        bound for the kind's prior)."""
        key = (action.task, action.kind, command)
        mean = self._runs.get(key)
        if mean is None:
            mean = self._runs[key] = _Mean()
        mean.add(elapsed)
        light, runs = self._kinds.get(key[:2], (0, 0))
        self._kinds[key[:2]] = (light + (elapsed <= light_s), runs + 1)

    def overstaying(self, action: Action) -> None:
        """``action`` (naming its command) ran on the lane past its bound: its command is
        not light, from now on (its end is observed as any run's)."""
        command = command_of(action)
        if command:
            self._over[action.id] = (action.task, action.kind, command)

    def ended(self, action_id: str) -> None:
        """``action_id`` ended (however): no longer overstaying (its run, if it was
        observed, says what its command takes)."""
        if self._over:
            self._over.pop(action_id, None)

    def light(self, action: Action, command: str, light_s: float,
              kind_n: int, kind_mean: float) -> bool:
        """Is ``action`` (a one-core action naming ``command``; "" when it names none)
        expected to take at most ``light_s``? ``kind_n``/``kind_mean``: its (task, kind)'s
        runs and their mean (DurationModel.mean_n)."""
        t1 = action.t1_s
        if not command:
            if t1 is not None:
                return t1 <= light_s and not (kind_n >= 2 and kind_mean > light_s)
            return kind_n >= 2 and kind_mean <= light_s
        key = (action.task, action.kind, command)
        mean = self._runs.get(key)
        if key in self._over.values():
            return False
        if mean is not None:
            return mean.mean <= light_s
        if t1 is not None:
            return t1 <= light_s
        light, runs = self._kinds.get(key[:2], (0, 0))
        return runs >= 2 and 2 * light >= runs


class _InFlight:
    """Runs in flight of one (task, kind) as arrays (start times, feature rows of
    :meth:`SpeedupCurve.features`) kept dense: a run ending is replaced by the last one,
    so a start or an end is O(1) and a read is a slice (the table of every queued action
    reads them)."""

    __slots__ = ("ids", "pos", "starts", "features", "n")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.pos: dict[str, int] = {}
        self.starts = np.zeros(16)
        self.features = np.zeros((16, 3))
        self.n = 0

    def add(self, action_id: str, units: int, start_s: float) -> None:
        n = self.n
        if n == len(self.starts):
            self.starts = np.concatenate((self.starts, np.zeros(n)))
            self.features = np.concatenate((self.features, np.zeros((n, 3))))
        self.starts[n] = start_s
        self.features[n] = SpeedupCurve.features(units)
        self.pos[action_id] = n
        self.ids.append(action_id)
        self.n = n + 1

    def remove(self, action_id: str) -> None:
        i, last = self.pos.pop(action_id), self.n - 1
        moved = self.ids.pop()
        if i != last:  # (the last run takes its slot)
            self.starts[i], self.features[i] = self.starts[last], self.features[last]
            self.ids[i] = moved
            self.pos[moved] = i
        self.n = last


@dataclass(frozen=True, slots=True)
class Speedup:
    """The shape of an elastic (task, kind)'s time over its unit count, as the core learnt
    it: ``t(m) = T1 * ((1 - p) + p / m) + unit_overhead_s * (m - 1)``. ``source``: whose
    curve it is, ``"command"`` (:class:`CommandCurves`, the command seen at two or more
    widths or sized on its kind's shape) or ``"kind"`` (:class:`SpeedupCurve`). What a
    recording writes beside each run so that a replay at other widths has a model."""

    parallel_fraction: float
    unit_overhead_s: float
    source: str


class DurationModel:
    """Observed execution times."""

    #: unprofiled elastic kinds: runs during which the prior curve lets the DP try wider
    #: grants (exploration); past it without two distinct unit counts observed, the
    #: kind runs at its minimum (nothing was ever free to learn from)
    EXPLORE_RUNS = 8
    #: the exploration prior: Amdahl with this parallel fraction (assumption: midway)
    PRIOR_PARALLEL = 0.5
    #: runs at other unit counts than the kind's most-run one before its curve is read:
    #: until then the next runs are held at a second, middle width (_middle_width)
    CONTRAST_RUNS = 4

    def __init__(self, default_s: float = 1.0, short_prior_s: float = 1.0) -> None:
        #: what an action of a never-seen (task, kind) is expected to take
        self.default_s = default_s
        self._short_prior_s = short_prior_s
        self._mean: dict[Key, _Mean] = {}
        self._t1: dict[Key, _Mean] = {}
        self._curves: dict[Key, SpeedupCurve] = {}
        self._commands: dict[Key, CommandCurves] = {}
        #: which one-core commands are light (a CPU node's light lane)
        self.lane = LaneModel()
        #: pool name -> moving average of its non-elastic actions' execution time
        self._short: dict[str, float] = {}
        #: pool name -> [elastic actions, all actions] observed there
        self._kinds_seen: dict[str, list[int]] = {}
        #: the core's clock at its last read of a table (:meth:`learnt_table` reads the
        #: runs in flight as of it)
        self.now = 0.0
        #: unprofiled elastic runs in flight (:meth:`started`): action id -> its (task,
        #: kind); per (task, kind), its runs in flight (:class:`_InFlight`)
        self._inflight: dict[str, Key] = {}
        self._running: dict[Key, _InFlight] = {}

    def mean(self, key: Key) -> float | None:
        m = self._mean.get(key)
        return m.mean if m else None

    def mean_n(self, key: Key) -> tuple[int, float]:
        """(runs observed, their mean execution time) of a (task, kind)."""
        m = self._mean.get(key)
        return (m.n, m.mean) if m else (0, 0.0)

    def learnt_t1(self, key: Key) -> float | None:
        """T1 back-computed from observed elastic runs (their E(m) declared)."""
        m = self._t1.get(key)
        return m.mean if m else None

    def curve(self, key: Key) -> SpeedupCurve | None:
        return self._curves.get(key)

    def speedup(self, key: Key, command: str = "") -> Speedup | None:
        """The shape learnt for ``key`` (its ``command``'s curves first), None while no
        curve can be trusted (the fits :meth:`learnt_table` reads, without the prior)."""
        cmds = self._commands.get(key)
        if command and cmds is not None and cmds.seen(command):
            f = cmds.fit()
            if f is not None:
                return Speedup(f[0], f[1], "command")
        c = self._curves.get(key)
        fit = c.fit() if c is not None else None
        if fit is None:
            return None
        a, b, cost = fit
        return Speedup(b / (a + b) if a + b > 0 else 0.0, cost, "kind")

    def learnt_table(self, key: Key, choices: tuple[int, ...],
                     command: str = "") -> dict[int, float] | None:
        """Expected duration per unit count of an unprofiled elastic (task, kind): for an
        action naming its ``command`` that was seen before, its own scale on the kind's
        shape (:class:`CommandCurves`); else the kind's fitted curve; while it cannot be
        trusted, the exploration prior scaled to what was observed; None once exploring
        has stopped paying (run it at the minimum)."""
        cmds = self._commands.get(key)
        if command and cmds is not None and cmds.seen(command):
            table = cmds.table(command, choices)
            if table is not None:
                return table
        c = self._curves.get(key)
        p = self.PRIOR_PARALLEL
        if c is not None and c.n:
            # the observed mean, back to one unit under the prior
            t1 = c.mean_time() / ((1 - p) + p / c.mean_units())
        else:
            t1 = self.default_s
        prior = {u: t1 * ((1 - p) + p / u) for u in choices}
        mid = self._middle_width(c, choices)
        if mid is not None:
            # (wider than mid: no faster, its extra units idle, so the DP stops at mid)
            return {u: prior[u] if u <= mid else prior[mid] * u / mid for u in choices}
        fitted = c.table(choices, self.running(key)) if c is not None else None
        if fitted is not None:
            # the fit weighed against the prior as if the prior were EXPLORE_RUNS runs
            # (shrinkage): the runs of one kind are suites of different sizes, and a few
            # of them fit any shape. Without it, after 12 runs the kind's curve was flat,
            # the next tests ran on 1 core of 63 free, and those runs then confirmed the
            # flat curve; and a per-unit cost fitted to the size scatter (0.19 s/unit on
            # an Amdahl-only trace) held every test at 6 of 64 free cores.
            w = c.n / (c.n + self.EXPLORE_RUNS)
            return {u: max(w * fitted[u] + (1 - w) * prior[u], 1e-6) for u in choices}
        if c is not None and c.n >= self.EXPLORE_RUNS:
            return None
        return prior

    def _middle_width(self, c: SpeedupCurve | None, choices: tuple[int, ...]) -> int | None:
        """The width the kind's next runs are held at while its curve rests on one unit
        count (None: no need): the choice nearest the geometric midpoint of the minimum and
        the most-run count, once that count has half of EXPLORE_RUNS runs and until
        CONTRAST_RUNS runs were at other counts.

        Without it, exploration ran nearly every test at one width (38 runs at 16 cores, 2 at
        1 core, both small suites), so the curve rested on two 1-core runs and came out
        flat; runs at a middle width (4 of 16 cores, not the minimum) contrast unit counts
        at a small cost. Only counts of observed runs decide it."""
        if c is None or not c.runs_at:
            return None
        dominant, top = max(c.runs_at.items(), key=lambda kv: (kv[1], kv[0]))
        if top < self.EXPLORE_RUNS // 2 or c.n - top >= self.CONTRAST_RUNS:
            return None
        lo = choices[0]
        between = [u for u in choices if lo < u < dominant]
        if not between:
            return None
        target = (lo * dominant) ** 0.5
        return min(between, key=lambda u: abs(math.log(u / target)))

    def started(self, action: Action, units: int, start_s: float) -> None:
        """An unprofiled elastic ``action`` started running on ``units`` units at
        ``start_s``: until it ends, the kind's curve reads it as censored
        (:meth:`SpeedupCurve.censored`)."""
        if action.elastic and action.elasticity is None and action.t1_s is None:
            if action.id in self._inflight:  # (announced twice: the first start counts)
                return
            key = (action.task, action.kind)
            self._inflight[action.id] = key
            runs = self._running.get(key)
            if runs is None:
                runs = self._running[key] = _InFlight()
            runs.add(action.id, max(units, 1), start_s)

    def ended(self, action_id: str) -> None:
        """``action_id`` ended (observed or not): no longer in flight."""
        key = self._inflight.pop(action_id, None)
        if key is not None:
            self._running[key].remove(action_id)

    def running(self, key: Key) -> tuple[np.ndarray, np.ndarray] | None:
        """The (task, kind)'s runs in flight: their elapsed times as of :attr:`now` and
        their feature rows (:meth:`SpeedupCurve.censored`); None if none."""
        runs = self._running.get(key)
        if runs is None or not runs.n:
            return None
        n = runs.n
        return np.maximum(self.now - runs.starts[:n], 0.0), runs.features[:n]

    def short_s(self, pool: str) -> float:
        return self._short.get(pool, self._short_prior_s)

    def observe(self, action: Action, units: int, elapsed: float, pool: str,
                elastic: bool, light_s: float = 0.0) -> None:
        """A run of ``action`` on ``units`` units (0: on a light lane) took ``elapsed`` s
        in ``pool`` (``light_s``: that pool's light-lane bound, 0 for none)."""
        key = (action.task, action.kind)
        # (get before setdefault: every finish observes, a new _Mean only for a new key)
        mean = self._mean.get(key)
        if mean is None:
            mean = self._mean[key] = _Mean()
        mean.add(elapsed)
        if action.elasticity is not None and action.elastic:
            t1 = elapsed * action.elasticity.efficiency(units) * units  # back to one unit
            m1 = self._t1.get(key)
            if m1 is None:
                m1 = self._t1[key] = _Mean()
            m1.add(t1)
        elif action.elastic and action.t1_s is None:  # nobody profiled it: learn its curve
            self._curves.setdefault(key, SpeedupCurve()).observe(units, elapsed)
            command = command_of(action)
            if command:
                self._commands.setdefault(key, CommandCurves()).observe(command, units, elapsed)
        seen = self._kinds_seen.get(pool)
        if seen is None:
            seen = self._kinds_seen[pool] = [0, 0]
        seen[0] += elastic
        seen[1] += 1
        if not elastic:
            s = self._short.get(pool, self._short_prior_s)
            self._short[pool] = s + 0.05 * (elapsed - s)
            if light_s and units <= 1:
                command = command_of(action)
                if command:
                    self.lane.observe(action, command, elapsed, light_s)

    def elastic_share(self, pool: str) -> float:
        """Share of the actions observed on ``pool`` that were elastic (Laplace prior
        1/2): how many of a pool's next arrivals will want a wide grant."""
        e, n = self._kinds_seen.get(pool, (0, 0))
        return (e + 1) / (n + 2)


def command_of(action: Action) -> str:
    """The command an action runs (its payload's ``command``, else its ``argv`` joined),
    "" when it names none."""
    payload = action.payload
    if not isinstance(payload, dict):
        return ""
    command = payload.get("command")
    if command:
        return str(command)
    argv = payload.get("argv")
    return " ".join(map(str, argv)) if isinstance(argv, list | tuple) and argv else ""


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
