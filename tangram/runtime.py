"""The one loop both drivers share: core + Clock + Backend.

The runtime knows nothing about SimPy or asyncio: it asks the Clock for the
time and for timers, hands dispatches to the Backend, and feeds completions
back into the core. Completed actions are kept as :class:`Record` rows (the
``actions.parquet`` of every run, simulated or live): they hold only clock
times, so two simulations with the same seed give identical rows. How long the
core itself took is measured with an injected ``stopwatch`` (the drivers pass
``time.perf_counter``; tangram/ reads no wall clock) into :class:`Timing`.

The virtual clock (SimPy) is sim/clock.py; the asyncio one is executor/driver.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from tangram.core import Tangram
from tangram.model import Action, Dispatch, Lease, Outcome
from tangram.protocol import (
    Attach,
    Backend,
    Cancel,
    Cancelled,
    Close,
    Command,
    Effect,
    Evicting,
    Finish,
    Moved,
    Moving,
    Open,
    Overstay,
    Poll,
    PreRestore,
    PreRestoring,
    PullImage,
    Pulling,
    Reclaim,
    Resized,
    Resizing,
    Shed,
    Shedding,
    Snapshot,
    Stop,
    Submit,
    capabilities_of,
)

__all__ = ["Backend", "Clock", "Record", "RecordSink", "RunResult", "Runtime", "Timing"]


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer: ...


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
    status: str
    exit_code: int | None
    expected_s: float | None
    #: ran on its node's light lane (shared cores; ``units`` 0)
    lane: bool = False
    #: the lead action of the batch this action ran in ("" when it ran alone): records
    #: with the same ``batch_of`` shared one lease (and paid its restore once)
    batch_of: str = ""
    #: its grant's resizes while it ran (tangram/cpu/malleable.py), ``"t:cores"`` each,
    #: ``;`` apart ("" when never resized): ``cores`` held from ``start_s`` until the first
    resized: str = ""

    @property
    def act_s(self) -> float:
        return self.end_s - self.submit_s


@functools.lru_cache(maxsize=4096)
def unit_ids(units: tuple[int, ...]) -> str:
    """A lease's units as a record's text (``"0,1,2"``). Cached: a node's light lane hands
    every action on it the same tuple of all its cores (hundreds of ids, a quarter of a
    coding run's records), and most other leases repeat too."""
    return ",".join(map(str, units))


ResultCallback = Callable[[Record, Outcome], None]


class RecordSink(Protocol):
    """Where a runtime puts each finished action's record (by default a list; a simulation
    at scale streams them to a file instead of holding them)."""

    def append(self, record: Record, /) -> None: ...

    def __len__(self) -> int: ...


def no_stopwatch() -> float:
    """A stopwatch that never moves (timings all zero): the default."""
    return 0.0


@dataclass(slots=True)
class Timing:
    """Seconds the core took, by the injected stopwatch (not part of the schedule)."""

    #: seconds inside the core (submit / finish / poll / close)
    core_s: float = 0.0
    #: calls of the core that dispatched something, and their seconds
    dispatching_calls: int = 0
    dispatching_s: float = 0.0
    #: action id -> decision seconds attributed to it (its call's time / its dispatches)
    decision_s: dict[str, float] = field(default_factory=dict)
    #: when a list: every core call's (seconds, dispatches) — for benchmarks
    calls: list[tuple[float, int]] | None = None


@dataclass(slots=True)
class RunResult:
    """What a run (simulated or live) hands to analysis: records, not summaries."""

    policy: str
    #: the finished actions' records (empty when they were streamed: see ``streamed``)
    records: list[Record]
    #: per RL step: {"step", "rollout_s", "step_s"}
    steps: list[dict[str, float]]
    capacity: dict[str, float]
    #: deterministic counts of the run (restores, retries, scheduling passes, ...)
    counters: dict[str, Any]
    timing: Timing
    #: usage samples {"t_s", resource: units, ...} (None: not sampled)
    utilisation: list[dict[str, float]] | None = None
    #: wall seconds the whole run took
    wall_s: float = 0.0
    #: the core's state at the end of the run (counters: restores, passes, ...)
    snapshot: Snapshot | None = None
    #: records written to a sink instead of ``records`` (0: all are in ``records``)
    streamed: int = 0


class DoubleReport(RuntimeError):
    """A backend reported the same dispatch done twice (a backend bug)."""


@dataclass(frozen=True, slots=True)
class EffectFailed:
    """Carrying out an effect raised: which effect (its class name), the action it was
    for ("" when it was for none: a pre-restore, a reclaim, a shed) and the error."""

    effect: str
    action_id: str
    error: str

    def __str__(self) -> str:
        what = f" of action {self.action_id!r}" if self.action_id else ""
        return f"{self.effect}{what} failed: {self.error}"


#: what a driver does with a failed effect (the runtime has already ended the action)
ErrorSink = Callable[[EffectFailed], None]


class Runtime:
    """Drives the core through its door (tangram/protocol.py): every call is a command,
    every effect is carried out here, in order, on the backend."""

    def __init__(self, core: Tangram, clock: Clock, backend: Backend,
                 stopwatch: Callable[[], float] = no_stopwatch,
                 records: RecordSink | None = None,
                 on_error: ErrorSink | None = None) -> None:
        """``on_error``: told of every effect whose carrying out raised, after the
        affected action was ended ``failed`` with the error (a live driver logs it, or
        stops the run); None re-raises it (a simulation: a failure there is a bug)."""
        self.core = core
        self.clock = clock
        self.backend = backend
        self.capabilities = capabilities_of(backend)
        self.on_error = on_error
        self.stopwatch = stopwatch
        core.handle(Attach(self.capabilities), clock.now())
        #: finished actions' records (a list unless a sink was given)
        self.records: RecordSink = records if records is not None else []
        self.timing = Timing()
        self._callbacks: dict[str, ResultCallback] = {}
        self._wakeup: Timer | None = None
        self._wakeup_at: float | None = None
        #: the light lanes' timer (``Overstay``), apart: a lane action that ends in time
        #: leaves a timer that fires for nothing, which must not cost a pass everywhere
        self._lane_timer: Timer | None = None
        self._lane_at: float | None = None
        #: running actions an effect failed for (a move, a stop): the error their outcome
        #: reports, whatever the backend says when it ends them
        self._failed: dict[str, str] = {}
        #: running actions whose grant was resized: the changes, as their record keeps them
        self._resized: dict[str, list[str]] = {}
        #: effect class -> how many were carried out without raising (a server's /metrics:
        #: which kinds a live run has seen; the core counts only some, e.g. lane moves)
        self.carried: dict[type, int] = {}

    def _timed(self, command: Command) -> list[Effect]:
        t0 = self.stopwatch()
        out: list[Effect] = []
        try:
            out = self.core.handle(command, self.clock.now())
            return out
        finally:
            dt = self.stopwatch() - t0
            t = self.timing
            t.core_s += dt
            started = [e for e in out if isinstance(e, Dispatch)]
            if t.calls is not None:
                # benchmarks count actions started: a batch starts several
                t.calls.append((dt, sum(1 + len(d.batch) for d in started)))
            if started:
                t.dispatching_calls += 1
                t.dispatching_s += dt
                for d in started:
                    t.decision_s[d.action.id] = dt / len(started)

    def snapshot(self, detail: bool = True) -> Snapshot:
        """The core's state, frozen (tangram/protocol.py Snapshot)."""
        return self.core.snapshot(detail)

    def apply(self, command: Command) -> None:
        """Carry out a command a driver or a backend originates (a node joined or was
        lost, a GPU worker was lost, time passed, a node's free memory was observed) and
        the effects it has."""
        self._carry_out(self._timed(command))

    def open_trajectory(self, trajectory: str, task: str = "default",
                        mem_gb: float | None = None, image: str = "",
                        image_gb: float = 0.0) -> None:
        self._carry_out(self._timed(Open(trajectory, task, mem_gb, image, image_gb)))

    def close_trajectory(self, trajectory: str) -> None:
        self._carry_out(self._timed(Close(trajectory)))

    def submit(self, action: Action, on_result: ResultCallback | None = None,
               on_queued: Callable[[], None] | None = None) -> None:
        """Queue ``action``; ``on_result`` is called once when it ends."""
        self.submit_many([action], on_result, on_queued)

    def submit_many(self, actions: list[Action], on_result: ResultCallback | None = None,
                    on_queued: Callable[[], None] | None = None) -> None:
        """Queue a batch with one scheduling pass per pool (all or nothing). The core's
        check is the one a submission gets: a refused batch raises (ValueError, KeyError:
        naming the field) with nothing queued. ``on_queued`` is called once the core took
        them, before anything it started is carried out (so before any of them can end):
        a caller records them there."""
        out = self._timed(Submit(tuple(actions)))  # raises: none queued
        if on_result is not None:
            for a in actions:
                self._callbacks[a.id] = on_result
        try:
            if on_queued is not None:
                on_queued()
        finally:  # (queued in the core: what it started runs whatever the caller raised)
            self._carry_out(out)

    def cancel(self, action_id: str) -> bool:
        """Cancel a queued action (its callback gets a 'cancelled' outcome) or ask
        the backend to stop a running one (its outcome arrives as usual)."""
        out = self.core.handle(Cancel(action_id), self.clock.now())
        self._carry_out(out)
        return bool(out)

    def _carry_out(self, effects: list[Effect]) -> None:
        carried = self.carried
        for e in effects:
            try:
                self._carry_out_one(e)
            except Exception as exc:  # noqa: BLE001 - any failure: its action ends, named
                self._effect_failed(e, exc)
            else:
                carried[type(e)] = carried.get(type(e), 0) + 1
        self._arm_wakeup()

    def _carry_out_one(self, e: Effect) -> None:
        backend, can = self.backend, self.capabilities
        if isinstance(e, Dispatch):
            if e.batch and not can.batches:
                self._start_serial(e, 0)
            else:
                backend.start(e, self._done_callback(e))
        elif isinstance(e, PreRestore):
            if not isinstance(backend, PreRestoring):  # planned only for one (Attach)
                raise TypeError(f"the {type(backend).__name__} backend has no prerestore")
            backend.prerestore(e)
        elif isinstance(e, Stop):
            backend.cancel(e.action_id)
        elif isinstance(e, Moved):
            # the core accounts it either way; a backend that cannot move a running
            # process (the simulator's model, docker, Ray) leaves it where it runs
            if isinstance(backend, Moving):
                backend.move(e)
        elif isinstance(e, Resized):
            if not isinstance(backend, Resizing):  # sent only to one (Attach)
                raise TypeError(f"the {type(backend).__name__} backend has no resize")
            backend.resize(e)
            self._resized.setdefault(e.action_id, []).append(
                f"{self.clock.now()!r}:{unit_ids(e.cores)}")
        elif isinstance(e, PullImage):
            if not isinstance(backend, Pulling):  # ordered only for one (Attach)
                raise TypeError(f"the {type(backend).__name__} backend has no pull")
            backend.pull(e)
        elif isinstance(e, Reclaim):
            # the core unbound it either way; only an evicting backend holds memory
            # for an idle trajectory (a busy one keeps it: the next observation shows it)
            if isinstance(backend, Evicting):
                backend.evict(e.trajectory)
        elif isinstance(e, Shed):
            if isinstance(backend, Shedding):
                backend.shed(e)
        elif isinstance(e, Cancelled):
            cb = self._callbacks.pop(e.action_id, None)
            if cb:
                now = self.clock.now()
                out = Outcome(e.action_id, status="cancelled", exit_code=None)
                cb(Record(e.action_id, "", "", "", now, now, now, 0, None, "", "", 0.0,
                          0.0, "cancelled", None, None), out)

    def _effect_failed(self, e: Effect, exc: Exception) -> None:
        """An effect raised: end what it was for (``failed``, with the error) so nothing
        waits for it, then tell the driver (or re-raise, without one)."""
        if self.on_error is None:
            raise exc
        error = f"{type(e).__name__}: {type(exc).__name__}: {exc}"
        if isinstance(e, Dispatch):
            # not started, or started in part: each member not yet reported ends now (a
            # member reported already keeps its outcome)
            done = self._done_callback(e)
            for a in e.actions:
                try:
                    done(Outcome(a.id, "failed", None, error=error))
                except DoubleReport:
                    pass
            failed = EffectFailed(type(e).__name__, e.action.id, error)
        elif isinstance(e, Moved | Resized | Stop):
            # it runs on in the backend: ask it to stop, and whatever outcome it reports
            # then, the action ends failed with this error
            self._failed[e.action_id] = error
            try:
                self.backend.cancel(e.action_id)
            except Exception:  # noqa: BLE001 - the outcome still comes when it ends
                pass
            failed = EffectFailed(type(e).__name__, e.action_id, error)
        else:
            failed = EffectFailed(type(e).__name__, "", error)
        self.on_error(failed)

    def _start_serial(self, d: Dispatch, i: int) -> None:
        """A batch on a backend that runs one action at a time: its actions one after
        another on the batch's lease (the restore is paid by the first only)."""
        if i == 0:
            action, submit, lease = d.action, d.submit_s, d.lease
        else:
            m = d.batch[i - 1]
            action, submit = m.action, m.submit_s
            lease = replace(d.lease, action_id=action.id, restore_s=0.0)
        plan = d.gpu if i == 0 or d.gpu is None else d.gpu.riding()
        single = Dispatch(action, lease, submit, self.clock.now() if i else d.start_s, None,
                          d.decision_s, gpu=plan)
        nxt = (lambda: self._start_serial(d, i + 1)) if i < len(d.batch) else None
        self.backend.start(single, self._done_callback(single, d.action.id, nxt))

    def _done_callback(self, d: Dispatch, batch_of: str = "",
                       then: Callable[[], None] | None = None) -> Callable[[Outcome], None]:
        members: dict[str, tuple[Action, float]] = {d.action.id: (d.action, d.submit_s)}
        if d.batch:  # (most dispatches are one action: no generator to build for them)
            members.update((m.action.id, (m.action, m.submit_s)) for m in d.batch)
            batch_of = d.action.id
        done: set[str] = set()

        def on_done(outcome: Outcome) -> None:
            aid = outcome.action_id if d.batch else d.action.id
            if aid not in members:
                raise DoubleReport(f"backend reported action {aid!r}, which is not in the "
                                   f"batch of {d.action.id!r}")
            if aid in done:
                raise DoubleReport(f"backend reported action {aid!r} done twice")
            done.add(aid)
            if aid in self._failed:
                outcome = replace(outcome, status="failed", error=self._failed.pop(aid))
            now = self.clock.now()
            lease: Lease = d.lease
            action, submit_s = members[aid]
            rec = Record(
                aid, action.task, action.trajectory, action.kind, submit_s,
                d.start_s, now, lease.units, lease.node,
                unit_ids(tuple(lease.cores)), unit_ids(tuple(lease.gpus)),
                lease.restore_s, outcome.overhead_s, outcome.status,
                outcome.exit_code, d.expected_s, lease.lane, batch_of,
                ";".join(self._resized.pop(aid, ())),
            )
            self.records.append(rec)
            effects = self._timed(Finish(aid, outcome))
            cb = self._callbacks.pop(aid, None)
            if cb:
                cb(rec, outcome)
            if then is not None:
                then()
            self._carry_out(effects)

        return on_done

    def _arm_wakeup(self) -> None:
        now = self.clock.now()
        lane_at = self.core.lane_wakeup()
        if lane_at is not None and (self._lane_at is None or lane_at < self._lane_at
                                    or self._lane_at < now):
            if self._lane_timer is not None:
                self._lane_timer.cancel()
            self._lane_at = lane_at

            def overstay() -> None:
                self._lane_timer = None
                self._lane_at = None
                self._carry_out(self._timed(Overstay()))

            self._lane_timer = self.clock.call_later(max(lane_at - now, 0.0), overstay)
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
            self._carry_out(self._timed(Poll()))

        self._wakeup = self.clock.call_later(max(at - now, 0.0), fire)
