"""The one loop both drivers share: core + Clock + Backend.

The runtime knows nothing about SimPy or asyncio: it asks the Clock for the
time and for timers, hands dispatches to the Backend, and feeds completions
back into the core. Completed actions are kept as :class:`Record` rows (the
``actions.parquet`` of every run, simulated or live).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tangram.core import Tangram
from tangram.model import Action, Dispatch, Outcome


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer: ...


class Backend(Protocol):
    """Runs one dispatched action on its lease and reports exactly one Outcome."""

    def start(self, dispatch: Dispatch, on_done: Callable[[Outcome], None]) -> None: ...

    def cancel(self, action_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Record:
    """One finished action: the row of ``actions.parquet``."""

    action_id: str
    task: str
    trajectory: str
    kind: str
    submit_s: float
    start_s: float
    end_s: float
    units: int
    node: str | None
    cores: str
    gpus: str
    restore_s: float
    overhead_s: float
    decision_us: float
    status: str
    exit_code: int | None
    expected_s: float | None

    @property
    def act_s(self) -> float:
        return self.end_s - self.submit_s


ResultCallback = Callable[[Record, Outcome], None]


class Runtime:
    def __init__(self, core: Tangram, clock: Clock, backend: Backend) -> None:
        self.core = core
        self.clock = clock
        self.backend = backend
        self.records: list[Record] = []
        self._callbacks: dict[str, ResultCallback] = {}
        self._wakeup: Timer | None = None
        self._wakeup_at: float | None = None
        #: wall seconds spent inside the core (submit / finish / poll / close)
        self.core_s = 0.0

    def open_trajectory(self, trajectory: str, task: str = "default",
                        mem_gb: float | None = None) -> None:
        self.core.open_trajectory(trajectory, task, mem_gb)

    def close_trajectory(self, trajectory: str) -> None:
        self._launch(self.core.close_trajectory(trajectory, self.clock.now()))

    def submit(self, action: Action, on_result: ResultCallback | None = None) -> None:
        """Queue ``action``; ``on_result`` is called once when it ends."""
        t0 = time.perf_counter()
        try:
            dispatches = self.core.submit(action, self.clock.now())
        finally:
            self.core_s += time.perf_counter() - t0
        if on_result is not None:
            self._callbacks[action.id] = on_result
        self._launch(dispatches)

    def cancel(self, action_id: str) -> bool:
        """Cancel a queued action (its callback gets a 'cancelled' outcome) or ask
        the backend to stop a running one (its outcome arrives as usual)."""
        if self.core.cancel(action_id):
            cb = self._callbacks.pop(action_id, None)
            if cb:
                now = self.clock.now()
                out = Outcome(action_id, status="cancelled", exit_code=None)
                cb(Record(action_id, "", "", "", now, now, now, 0, None, "", "", 0.0, 0.0, 0.0,
                          "cancelled", None, None), out)
            return True
        if action_id in self.core.running:
            self.backend.cancel(action_id)
            return True
        return False

    def _launch(self, dispatches: list[Dispatch]) -> None:
        for d in dispatches:
            self.backend.start(d, self._done_callback(d))
        self._arm_wakeup()

    def _done_callback(self, d: Dispatch) -> Callable[[Outcome], None]:
        done = False

        def on_done(outcome: Outcome) -> None:
            nonlocal done
            if done:  # a backend must report once; ignore a second report
                return
            done = True
            now = self.clock.now()
            lease = d.lease
            rec = Record(
                d.action.id, d.action.task, d.action.trajectory, d.action.kind, d.submit_s,
                d.start_s, now, lease.units, lease.node,
                ",".join(map(str, lease.cores)), ",".join(map(str, lease.gpus)),
                lease.restore_s, outcome.overhead_s, d.decision_s * 1e6, outcome.status,
                outcome.exit_code, d.expected_s,
            )
            self.records.append(rec)
            t0 = time.perf_counter()
            next_dispatches = self.core.finish(d.action.id, now, outcome)
            self.core_s += time.perf_counter() - t0
            cb = self._callbacks.pop(d.action.id, None)
            if cb:
                cb(rec, outcome)
            self._launch(next_dispatches)

        return on_done

    def _arm_wakeup(self) -> None:
        now = self.clock.now()
        at = self.core.next_wakeup(now)
        if at is None or (self._wakeup_at is not None and self._wakeup_at <= at
                          and self._wakeup_at > now):
            return
        if self._wakeup is not None:
            self._wakeup.cancel()
        self._wakeup_at = at

        def fire() -> None:
            self._wakeup = None
            self._wakeup_at = None
            self._launch(self.core.poll(self.clock.now()))

        self._wakeup = self.clock.call_later(max(at - now, 0.0), fire)
