"""DPArrange (paper Alg. 3) and its DP operators (Alg. 3 base operator, Alg. 4 chunks).

``dp[i][s]`` is the least total duration of the first ``i`` elastic candidates
that leaves the pool in resource state ``s``. Topology lives only in the
operator, which here is an explicit *transition table*: for every state and
every unit count ``u`` the state left after granting ``u`` units (or -1 when
``u`` cannot be carved out of that state). That table subsumes the paper's
``Start / Prev / IsValid`` primitives and is computed once per capacity and
cached, so the DP itself is a handful of vectorised numpy operations per
candidate.

Departure from the paper: Alg. 4's ``Prev`` decomposes ``k`` GPUs into several
smaller free chunks and never splits a larger chunk, so it both returns illegal
(non-contiguous) groups and misses feasible allocations (one free 8-chunk
cannot serve a 2-GPU action). Here an action of ``k`` GPUs always receives one
aligned chunk of size ``k``: an exact free chunk if there is one, otherwise the
smallest larger chunk split buddy-style (which leaves one free chunk of each
size ``k, 2k, ..., b/2``). Taking an exact chunk, or splitting the smallest
larger one, leaves a state that dominates any other choice, so the greedy
transition loses no feasible allocation (checked against brute force in the
tests).

One DP pass keeps every row, so :meth:`DPTable.best` answers the optimum for
*every prefix* ``C[:t]`` — what greedy eviction needs — without rerunning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np

CHUNK_SIZES = (1, 2, 4, 8)


class StateSpace:
    """States of one pool and the transitions of granting ``u`` units."""

    __slots__ = ("n_states", "initial", "_succ", "_succ_fn", "_mats", "_lists")

    def __init__(self, n_states: int, initial: int, succ_fn) -> None:
        self.n_states = n_states
        self.initial = initial
        self._succ_fn = succ_fn
        self._succ: dict[int, np.ndarray] = {}
        self._mats: dict[tuple[int, ...], np.ndarray] = {}
        self._lists: dict[int, list[int]] = {}

    def succ(self, units: int) -> np.ndarray:
        arr = self._succ.get(units)
        if arr is None:
            arr = self._succ_fn(units)
            arr.setflags(write=False)
            self._succ[units] = arr
        return arr

    def succ_list(self, units: int) -> list[int]:
        """:meth:`succ` as a list (what the sparse pass indexes one state at a time)."""
        out = self._lists.get(units)
        if out is None:
            out = self._lists[units] = self.succ(units).tolist()
        return out

    def succ_matrix(self, choices: tuple[int, ...]) -> np.ndarray:
        mat = self._mats.get(choices)
        if mat is None:
            mat = np.stack([self.succ(u) for u in choices])
            self._mats[choices] = mat
        return mat


class DPOperator(Protocol):
    """Topology of one resource for DPArrange."""

    def space(self, capacity) -> StateSpace: ...

    def check_units(self, units: int) -> None: ...


class LinearOperator:
    """Counted units (cores): any ``u <= free`` can be granted."""

    def space(self, capacity: int) -> StateSpace:
        if not isinstance(capacity, int | np.integer) or capacity < 0:
            raise ValueError(f"capacity: expected an int >= 0, got {capacity!r}")
        return _linear_space(int(capacity))

    def check_units(self, units: int) -> None:
        if units < 1:
            raise ValueError(f"options: unit count must be >= 1, got {units}")


@lru_cache(maxsize=512)
def _linear_space(capacity: int) -> StateSpace:
    free = np.arange(capacity + 1)

    def succ(u: int) -> np.ndarray:
        out = free - u
        out[out < 0] = -1
        return out

    return StateSpace(capacity + 1, capacity, succ)


def take_chunk(state: tuple[int, int, int, int], k: int) -> tuple[int, int, int, int] | None:
    """Free-chunk counts left after granting one aligned chunk of ``k`` GPUs."""
    level = CHUNK_SIZES.index(k)
    counts = list(state)
    if counts[level] > 0:
        counts[level] -= 1
        return tuple(counts)  # type: ignore[return-value]
    for b in range(level + 1, len(CHUNK_SIZES)):
        if counts[b] > 0:
            counts[b] -= 1
            for lower in range(level, b):  # buddies left over by the split
                counts[lower] += 1
            return tuple(counts)  # type: ignore[return-value]
    return None


class ChunkOperator:
    """GPU chunks of 1/2/4/8 (Alg. 4); capacity is ``(n1, n2, n4, n8)`` free chunks."""

    def space(self, capacity: Sequence[int]) -> StateSpace:
        cap = tuple(int(c) for c in capacity)
        if len(cap) != 4 or any(c < 0 for c in cap):
            raise ValueError(f"capacity: expected (n1, n2, n4, n8) >= 0, got {capacity!r}")
        return _chunk_space(cap)  # type: ignore[arg-type]

    def check_units(self, units: int) -> None:
        if units not in CHUNK_SIZES:
            raise ValueError(f"options: GPU unit count must be one of {CHUNK_SIZES}, got {units}")


@lru_cache(maxsize=512)
def _chunk_space(cap: tuple[int, int, int, int]) -> StateSpace:
    # Enumerate the states reachable from the capacity (mixed-radix encoding
    # in the paper; an explicit index here because splits make n1 exceed c1).
    index = {cap: 0}
    order = [cap]
    for state in order:
        for k in CHUNK_SIZES:
            nxt = take_chunk(state, k)
            if nxt is not None and nxt not in index:
                index[nxt] = len(order)
                order.append(nxt)

    def succ(k: int) -> np.ndarray:
        out = np.full(len(order), -1, dtype=np.int64)
        if k in CHUNK_SIZES:
            for i, state in enumerate(order):
                nxt = take_chunk(state, k)
                if nxt is not None:
                    out[i] = index[nxt]
        return out

    return StateSpace(len(order), 0, succ)


@dataclass(slots=True)
class DPTable:
    """All rows of one DPArrange pass; answers the optimum of every prefix."""

    rows: list[np.ndarray]
    choice: list[np.ndarray]
    parent: list[np.ndarray]

    @property
    def n(self) -> int:
        return len(self.rows) - 1

    def best(self, t: int) -> tuple[float, list[int]] | None:
        """Least total duration of candidates ``[:t]`` and their unit counts."""
        row = self.rows[t]
        s = int(np.argmin(row))
        total = float(row[s])
        if not np.isfinite(total):
            return None
        units = [0] * t
        for i in range(t, 0, -1):
            units[i - 1] = int(self.choice[i][s])
            s = int(self.parent[i][s])
        return total, units


@dataclass(slots=True)
class SparseTable:
    """:class:`DPTable`'s rows as dicts of the states reached (state -> least total, and
    the unit count and parent state that give it): the same answers."""

    rows: list[dict[int, float]]
    choice: list[dict[int, int]]
    parent: list[dict[int, int]]

    @property
    def n(self) -> int:
        return len(self.rows) - 1

    def best(self, t: int) -> tuple[float, list[int]] | None:
        row = self.rows[t]
        if not row:
            return None
        # the least total; among equal totals the lowest state (what argmin takes)
        s = min(row, key=lambda k: (row[k], k))
        total = float(row[s])
        units = [0] * t
        for i in range(t, 0, -1):
            units[i - 1] = int(self.choice[i][s])
            s = self.parent[i][s]
        return total, units


#: a pass is run over the states it reaches (Python dicts, :class:`SparseTable`) while it
#: visits at most this many (state, unit count) pairs, else over every state (numpy): a
#: numpy pass costs ~20 array operations per candidate however few states are reached,
#: tens of microseconds for the common pass of one elastic candidate (up to 32 counts)
SPARSE_PAIRS = 1024


def arrange(options: Sequence[Mapping[int, float]], space: StateSpace) -> DPTable | SparseTable:
    """One DP pass over ``options`` (per candidate: unit count -> duration)."""
    pairs, reached = 0, 1  # a bound on the pairs the sparse pass visits
    for opt in options:
        pairs += reached * len(opt)
        if pairs > SPARSE_PAIRS:
            return _arrange_dense(options, space)
        reached = min(reached * len(opt), space.n_states)
    return _arrange_sparse(options, space)


def _arrange_sparse(options: Sequence[Mapping[int, float]], space: StateSpace) -> SparseTable:
    """:func:`_arrange_dense` over the reached states only. Ties resolve as there: among
    equal totals for a state, the last pair in (unit count, state) order wins (numpy's
    assignment with repeated indices keeps the last)."""
    inf = math.inf
    lists = space._lists  # (succ_list's cache, read here without a call per unit count)
    dp: dict[int, float] = {space.initial: 0.0}
    rows, choices_out, parents_out = [dp], [{}], [{}]
    for opt in options:
        new: dict[int, float] = {}
        choice: dict[int, int] = {}
        parent: dict[int, int] = {}
        states = sorted(dp.items())
        for u in sorted(opt):
            d = float(opt[u])
            succ = lists.get(u)
            if succ is None:
                succ = space.succ_list(u)
            for s, base in states:
                t = succ[s]
                if t < 0:
                    continue
                v = base + d
                if not -inf < v < inf:
                    continue
                old = new.get(t)
                if old is None or v <= old:
                    new[t] = v
                    choice[t] = u
                    parent[t] = s
        rows.append(new)
        choices_out.append(choice)
        parents_out.append(parent)
        dp = new
    return SparseTable(rows, choices_out, parents_out)


def _arrange_dense(options: Sequence[Mapping[int, float]], space: StateSpace) -> DPTable:
    """The DP over every state of ``space``, one candidate at a time in numpy."""
    n_states = space.n_states
    dp = np.full(n_states, np.inf)
    dp[space.initial] = 0.0
    rows = [dp]
    choices_out: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    parents_out: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    states = np.arange(n_states)
    for opt in options:
        units = tuple(sorted(opt))
        durs = np.fromiter((opt[u] for u in units), dtype=float, count=len(units))
        succ = space.succ_matrix(units)  # (k, S)
        vals = dp[None, :] + durs[:, None]
        ok = (succ >= 0) & np.isfinite(vals)
        tgt = succ[ok]
        val = vals[ok]
        new = np.full(n_states, np.inf)
        np.minimum.at(new, tgt, val)
        win = val == new[tgt]
        choice = np.zeros(n_states, dtype=np.int64)
        parent = np.full(n_states, -1, dtype=np.int64)
        u_idx, s_idx = np.nonzero(ok)
        choice[tgt[win]] = np.asarray(units, dtype=np.int64)[u_idx[win]]
        parent[tgt[win]] = states[s_idx[win]]
        rows.append(new)
        choices_out.append(choice)
        parents_out.append(parent)
        dp = new
    return DPTable(rows, choices_out, parents_out)


def dp_arrange(
    options: Sequence[Mapping[int, float]],
    capacity,
    operator: DPOperator | None = None,
) -> tuple[float, list[int]] | None:
    """Least total duration of all candidates and the unit count of each.

    ``options[i]`` maps every feasible unit count of candidate ``i`` to its
    duration. Returns None when even the minimums do not fit ``capacity``.
    """
    op = operator or LinearOperator()
    for i, opt in enumerate(options):
        if not opt:
            raise ValueError(f"options[{i}]: empty feasible set")
        for u, d in opt.items():
            op.check_units(u)
            if not np.isfinite(d) or d < 0:
                raise ValueError(f"options[{i}][{u}]: duration must be finite and >= 0, got {d}")
    table = arrange(options, op.space(capacity))
    return table.best(len(options))
