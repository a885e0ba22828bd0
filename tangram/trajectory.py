"""An open trajectory's state as the core keeps it (its own module: the core and the CPU
side's binding both read it, and the binding must not import the core)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TrajectoryState:
    task: str
    mem_gb: float | None
    #: its actions queued or running (a count, not their ids: each is counted once, at
    #: submit, and uncounted once, when it finishes or is cancelled; a set per trajectory
    #: was one more object for the cyclic GC to track, thousands of them in a burst)
    in_flight: int = 0
    #: while it thinks (LLM generation): the pool of its last action, when and of what
    #: (task, kind) that ended, and its weight in that pool's expected arrivals
    thinking_in: str | None = None
    last_end: float = 0.0
    last_kind: tuple[str, str] = ("", "")
    will_continue: float = 0.0
