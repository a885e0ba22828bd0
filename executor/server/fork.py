"""A fork on the live executor: the checks, the copies' opening and closing.

The order is what makes it all-or-nothing and fair: the copies are opened first (the
core registers them with the source's declared memory: they count and wait for a node
like any open), then the fork is submitted as an action of the source and the core
schedules it like any other CPU action; the backend carries it out. The service
(executor/server/service.py) submits it as it submits any action: it is
tracked, journalled, looked up and cancelled by its id; if it ends other than ``ok``
(failed, cancelled, the source closed meanwhile) or the server stops, every copy opened
is closed again before anyone is told.

A source with an action in flight is refused (409), not waited for: its files are
changing, and a fork waiting behind a long test run would hold the request as long.
The caller forks between actions - when a rollout's setup has ended. Other forks of the
same source are no such action (a fork only reads the source): a group's rollouts may
fork one prepared sandbox all at once (:class:`Forking` counts them).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from executor.driver import LiveExecutor
from tangram.fork import MAX_COPIES
from tangram.protocol import TrajectoryView


class ForkRefused(Exception):
    """A fork the executor will not carry out; ``status`` is the HTTP status."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Forked:
    """What a fork did: the copies' ids and how the backend copied."""

    source: str
    ids: tuple[str, ...]
    action: str
    #: how the backend copied ("reflink", "copy", ...)
    method: str
    #: bytes of the source's files (what each copy holds)
    bytes: int
    #: seconds the fork waited in the queue, and ran
    queue_s: float
    fork_s: float

    def answer(self) -> dict[str, object]:
        return {"ids": list(self.ids), "fork_of": self.source, "action": self.action,
                "method": self.method, "bytes": self.bytes, "queue_s": self.queue_s,
                "fork_s": self.fork_s}


@dataclass(slots=True)
class Forking:
    """Forks in flight per source (the actions in flight that do not change its files)."""

    sources: dict[str, int] = field(default_factory=dict)

    def count(self, source: str) -> int:
        return self.sources.get(source, 0)

    def add(self, source: str) -> None:
        self.sources[source] = self.count(source) + 1

    def done(self, source: str) -> None:
        left = self.count(source) - 1
        if left > 0:
            self.sources[source] = left
        else:
            self.sources.pop(source, None)


def copy_ids(source: str, count: int, prefix: str | None) -> list[str]:
    """``<prefix>-<i>`` when the caller names them, else random ids."""
    if prefix is not None:
        return [f"{prefix}-{i}" for i in range(count)]
    return [secrets.token_hex(8) for _ in range(count)]


def unknown_source(source: str) -> str:
    return (f"fork_of: unknown trajectory {source!r} (never opened, closed, or lost with "
            "its node)")


def check_fork(executor: LiveExecutor, source: str, copies: list[str],
               forking: Forking) -> TrajectoryView:
    """The source's view if ``source`` may be forked into ``copies`` now; ForkRefused says
    why not. ``forking``: the forks in flight (across requests)."""
    view = executor.trajectory(source)
    if view is None:
        raise ForkRefused(404, unknown_source(source))
    if not executor.runtime.capabilities.forks:
        raise ForkRefused(501, f"fork_of: the {executor.backend.name} backend cannot fork "
                          "a sandbox (use --backend process or docker)")
    # (the server counts a fork in and out of ``forking`` where the core counts it in and
    # out of ``in_flight``: never below 0; were it, no action of the source's would run)
    busy = view.in_flight - forking.count(source)
    if busy > 0:
        raise ForkRefused(409, f"fork_of: trajectory {source!r} has {busy} "
                          "action(s) in flight; fork it between actions (once they ended)")
    if not 1 <= len(copies) <= MAX_COPIES:
        raise ForkRefused(422, f"count: 1 to {MAX_COPIES} copies, got {len(copies)}")
    taken = [c for c in copies if executor.has_trajectory(c)] + \
        ([source] if source in copies else [])
    if taken or len(set(copies)) != len(copies):
        raise ForkRefused(409, f"id: trajectory {(taken or copies)[0]!r} is already open "
                          "(or named twice)")
    return view


def open_copies(executor: LiveExecutor, view: TrajectoryView, copies: list[str],
                image: str | None) -> None:
    """Open every copy (empty, the source's task and memory; ``image``: the source's docker
    image), all or nothing."""
    opened: list[str] = []
    try:
        for c in copies:
            executor.open_trajectory(c, view.task, view.mem_gb, image)
            opened.append(c)
    except BaseException:
        close_copies(executor, opened)
        raise


def close_copies(executor: LiveExecutor, trajectories: list[str] | tuple[str, ...]) -> None:
    for t in trajectories:
        if executor.has_trajectory(t):
            executor.close_trajectory(t)
