"""Basic resource manager (paper 5.1): API quotas and other counted resources.

Two consumption modes: ``concurrency`` (at most N in flight; released when the
action ends) and ``window`` (at most N starts per sliding window; a start is
never given back, it ages out).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tangram.cluster import QuotaSpec


@dataclass(frozen=True, slots=True)
class QuotaLease:
    action_id: str
    amounts: tuple[tuple[str, float], ...]


class QuotaManager:
    def __init__(self, specs: Iterable[QuotaSpec]) -> None:
        self.specs = {s.key: s for s in specs}
        self._in_flight = {k: 0.0 for k in self.specs}
        self._starts: dict[str, deque[tuple[float, float]]] = {k: deque() for k in self.specs}
        self._window_used = {k: 0.0 for k in self.specs}
        self._live: dict[str, QuotaLease] = {}

    def check(self, key: str) -> QuotaSpec:
        spec = self.specs.get(key)
        if spec is None:
            raise ValueError(
                f"cost[{key!r}]: quota key was never configured (configured: {sorted(self.specs)})"
            )
        return spec

    def _expire(self, key: str, now: float) -> None:
        starts = self._starts[key]
        horizon = now - self.specs[key].window_s
        while starts and starts[0][0] <= horizon:
            _, amount = starts.popleft()
            self._window_used[key] -= amount

    def available(self, key: str, now: float) -> float:
        spec = self.check(key)
        if spec.mode == "window":
            self._expire(key, now)
            return spec.limit - self._window_used[key]
        return spec.limit - self._in_flight[key]

    def reserve(self, action_id: str, amounts: Mapping[str, float], now: float) -> QuotaLease | None:
        """All of ``amounts`` or nothing."""
        if action_id in self._live:
            raise ValueError(f"action_id: {action_id!r} already holds a lease")
        for key, amount in amounts.items():
            if self.available(key, now) < amount:
                return None
        for key, amount in amounts.items():
            if self.specs[key].mode == "window":
                self._starts[key].append((now, amount))
                self._window_used[key] += amount
            else:
                self._in_flight[key] += amount
        lease = QuotaLease(action_id, tuple(amounts.items()))
        self._live[action_id] = lease
        return lease

    def release(self, lease: QuotaLease) -> None:
        """Idempotent: a second release of the same lease does nothing."""
        if self._live.get(lease.action_id) is not lease:
            return
        del self._live[lease.action_id]
        for key, amount in lease.amounts:
            if self.specs[key].mode == "concurrency":
                self._in_flight[key] -= amount

    def next_expiry(self, now: float) -> float | None:
        """Earliest time a window-mode quota regains room (None when none will)."""
        times = [
            starts[0][0] + self.specs[key].window_s
            for key, starts in self._starts.items()
            if starts and starts[0][0] + self.specs[key].window_s > now
        ]
        return min(times) if times else None

    def snapshot(self) -> dict[str, float]:
        return {k: (self._window_used[k] if s.mode == "window" else self._in_flight[k])
                for k, s in self.specs.items()}
