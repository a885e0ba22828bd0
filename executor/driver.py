"""The asyncio driver: the shared runtime on an asyncio clock, with live backends.

Every core call happens on the loop thread. Backends that block (docker) run
in worker threads and hand completions back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from executor.backends.docker.pulls import NodeImageOpening, PullDone
from tangram.core import Tangram
from tangram.model import Action, Dispatch, Outcome
from tangram.protocol import (
    ImageOpening,
    NodeWatching,
    Snapshot,
    TrajectoryView,
)
from tangram.runtime import EffectFailed, Record, Runtime

log = logging.getLogger("tangram.executor")


class AsyncioClock:
    """The Clock protocol on an asyncio loop (seconds since the executor started)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.t0 = loop.time()

    def now(self) -> float:
        return self.loop.time() - self.t0

    def call_later(self, delay: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
        return self.loop.call_later(max(delay, 0.0), fn)


class LiveBackend(Protocol):
    """A Backend (tangram/protocol.py) that also owns per-trajectory environments: every
    method the live driver and the API call. The optional ones (a docker image, the files
    API, node events, eviction, ...) are tangram.protocol's runtime-checkable protocols
    (ImageOpening, FileHolding, NodeWatching, Evicting, ...): a backend has them when it
    implements them, and callers check with ``isinstance``."""

    name: str

    def start(self, dispatch: Dispatch, on_done: Callable[[Outcome], None]) -> None: ...

    def cancel(self, action_id: str) -> None: ...

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None: ...

    def close_trajectory(self, trajectory: str) -> None: ...

    def shutdown(self) -> None: ...


class RunObserver(Protocol):
    """Told of what a live run does, on the loop thread, as it happens (a recorder:
    executor/record.py): trajectories opened, actions queued, actions ended. ``close``
    once, when the executor shuts down."""

    def opened(self, trajectory: str, task: str, mem_gb: float | None, now: float,
               image: str = "", image_gb: float = 0.0) -> None: ...

    def closed(self, trajectory: str) -> None: ...

    def submitted(self, action: Action, now: float) -> None: ...

    def finished(self, action: Action, record: Record, outcome: Outcome) -> None: ...

    def close(self) -> None: ...


class LiveExecutor:
    """Core + runtime + backend on the running loop."""

    def __init__(self, core: Tangram, backend: LiveBackend,
                 loop: asyncio.AbstractEventLoop | None = None,
                 max_records: int | None = None,
                 observer: RunObserver | None = None) -> None:
        """``max_records``: a long-running server, whose results live in its journal,
        keeps only the latest records in memory (flat RSS however many actions).
        ``observer``: told of every open, submit and end (``tangram serve --record``)."""
        self.loop = loop or asyncio.get_running_loop()
        self.core = core
        self.backend = backend
        self.observer = observer
        self.clock = AsyncioClock(self.loop)
        self.runtime = Runtime(core, self.clock, backend, stopwatch=time.perf_counter,
                               on_error=self._effect_failed)
        self.max_records = max_records
        #: effects whose carrying out raised (their actions ended failed with the error);
        #: ``failed`` is set at the first, for a driver that stops on it (`tangram run`)
        self.failures: deque[EffectFailed] = deque(maxlen=256)
        self.failed = asyncio.Event()
        if isinstance(backend, NodeWatching):  # a multi-node backend (Ray)
            backend.watch(self.runtime.apply)

    def _effect_failed(self, failure: EffectFailed) -> None:
        log.error("%s", failure)
        self.failures.append(failure)
        self.failed.set()

    def open_trajectory(self, trajectory: str, task: str = "default",
                        mem_gb: float | None = None, image: str | None = None) -> None:
        """Open it in the core and the backend; ``image``: its sandbox's docker image
        (backends without images refuse one with ValueError)."""
        if image is not None:
            if not isinstance(self.backend, ImageOpening):
                raise ValueError(f"image: the {self.backend.name} backend "
                                 "runs no images (use --backend docker)")
            # checked before the core commits to it
            image_gb = self.backend.open_trajectory_image(trajectory, mem_gb, image) or 0.0
            # the core books it too (its image counters; a PullImage it orders for a
            # later trajectory of the same image is the backend's pull_image, idempotent)
            try:
                self.runtime.open_trajectory(trajectory, task, mem_gb, image=image,
                                             image_gb=image_gb)
            except BaseException:
                self.backend.close_trajectory(trajectory)  # all or nothing
                raise
        else:
            image_gb = 0.0
            self.runtime.open_trajectory(trajectory, task, mem_gb)
            try:
                self.backend.open_trajectory(trajectory, mem_gb)
            except BaseException:
                self.runtime.close_trajectory(trajectory)  # all or nothing
                raise
        if self.observer is not None:
            self.observer.opened(trajectory, task, mem_gb, self.clock.now(),
                                 image=image or "", image_gb=image_gb)

    async def open_trajectory_placed(self, trajectory: str, task: str, mem_gb: float | None,
                                     image: str) -> tuple[str | None, PullDone | None]:
        """Open a trajectory naming ``image`` on a backend whose nodes pull their own
        (NodeImageOpening: Ray). The node must be known before the image can be had, so the
        order is the reverse of one machine's: the core opens it first and places it (by
        where its image is held or soonest pulled), then that node pulls the image and opens
        its sandbox, awaited here. All or nothing: if that fails it is closed in the core
        again and the error (PullFailed naming the node, ValueError) raised. Its node and how
        its image came there; (None, None) where the policy places no trajectory at open
        (its first action's node then pulls the image as its sandbox starts)."""
        backend = self.backend
        assert isinstance(backend, NodeImageOpening) and isinstance(backend, ImageOpening)
        # validates (a backend whose nodes run no images refuses) and gives a learnt size
        image_gb = backend.open_trajectory_image(trajectory, mem_gb, image) or 0.0
        try:
            self.runtime.open_trajectory(trajectory, task, mem_gb, image=image,
                                         image_gb=image_gb)
        except BaseException:
            backend.close_trajectory(trajectory)
            raise
        node = self.core.placed_on(trajectory)
        done = None
        if node is not None:
            try:
                size, done = await backend.open_image_on(trajectory, mem_gb, image, node)
            except BaseException:  # (a cancelled open too: the server stopping)
                self.runtime.close_trajectory(trajectory)
                backend.close_trajectory(trajectory)
                raise
            image_gb = size or image_gb
        if self.observer is not None:
            self.observer.opened(trajectory, task, mem_gb, self.clock.now(), image=image,
                                 image_gb=image_gb)
        return node, done

    def close_trajectory(self, trajectory: str) -> None:
        self.runtime.close_trajectory(trajectory)
        self.backend.close_trajectory(trajectory)
        if self.observer is not None:
            self.observer.closed(trajectory)

    def submit(self, action: Action,
               on_result: Callable[[Record, Outcome], None] | None = None,
               on_queued: Callable[[], None] | None = None
               ) -> asyncio.Future[tuple[Record, Outcome]]:
        """Queue ``action``; the future resolves with its record and outcome. The core
        checks it (a refusal raises ValueError/KeyError naming the field, nothing queued);
        ``on_queued`` runs once it is queued, before it can end (Runtime.submit_many)."""
        [fut] = self.submit_many([action], on_result, on_queued)
        return fut

    def submit_many(self, actions: list[Action],
                    on_result: Callable[[Record, Outcome], None] | None = None,
                    on_queued: Callable[[], None] | None = None
                    ) -> list[asyncio.Future[tuple[Record, Outcome]]]:
        """Queue ``actions`` all or nothing, in one Submit; a future per action, each
        resolving with its record and outcome."""
        futures = {a.id: self.loop.create_future() for a in actions}
        observer = self.observer
        if observer is not None:
            by_id = {a.id: a for a in actions}
            then = on_queued

            def on_queued() -> None:
                now = self.clock.now()
                for a in actions:
                    observer.submitted(a, now)
                if then is not None:
                    then()

        def done(rec: Record, out: Outcome) -> None:
            if observer is not None:
                observer.finished(by_id[rec.action_id], rec, out)
            if self.max_records is not None:
                records = self.runtime.records
                if len(records) > 2 * self.max_records:  # trimmed rarely: O(1) amortised
                    del records[:-self.max_records]
                self.runtime.timing.decision_s.pop(rec.action_id, None)
            if on_result:
                on_result(rec, out)
            fut = futures.get(rec.action_id)
            if fut is not None and not fut.done():
                fut.set_result((rec, out))

        self.runtime.submit_many(actions, done, on_queued)
        return list(futures.values())

    async def run(self, action: Action) -> tuple[Record, Outcome]:
        return await self.submit(action)

    def cancel(self, action_id: str) -> bool:
        """Drop a queued action (its result comes at once, ``cancelled``) or have the
        backend stop a running one (its result comes when it stopped); False if neither."""
        return self.runtime.cancel(action_id)

    # -- reads (the core's door: tangram/protocol.py) -------------------------------------
    def snapshot(self, detail: bool = True) -> Snapshot:
        return self.runtime.snapshot(detail)

    def trajectory(self, trajectory: str) -> TrajectoryView | None:
        return self.core.trajectory(trajectory)

    def has_trajectory(self, trajectory: str) -> bool:
        return self.core.trajectory(trajectory) is not None

    def is_running(self, action_id: str) -> bool:
        return self.core.is_running(action_id)

    def why_queued(self, action_id: str) -> str:
        """Why a queued action waits for a node ("" when it does not)."""
        return self.core.why_queued(action_id)

    def validate(self, action: Action) -> None:
        """Raise ValueError/KeyError naming the field when the core would refuse it."""
        self.core.validate(action)

    def shutdown(self) -> None:
        try:
            self.backend.shutdown()
        finally:
            if self.observer is not None:
                self.observer.close()
