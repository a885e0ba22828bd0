"""Forking a prepared sandbox: one action of the source trajectory (kind ``fork``).

A GRPO group rolls every prompt out N times, each rollout's sandbox starting from the
same prepared state (repository checked out, dependencies installed). Instead of N
setups, one trajectory prepares and the others start as copies of its files: the copy
is an action of the *source* trajectory, queued, scheduled and dispatched by the core
like any other CPU action (DESIGN.md's "one door"); the backend carries it out (the
process backend copies the work directory: executor/backends/process/fork.py). The
copies are ordinary trajectories, opened before the fork runs with the source's
declared memory, so they count against memory and wait for a node like any open.
"""

from __future__ import annotations

from collections.abc import Sequence

from tangram.model import Action, Demand

#: the kind of a fork action (the backends and the simulator recognise it by this)
FORK = "fork"
#: copies one fork may open (a GRPO group is 8-64 rollouts)
MAX_COPIES = 64


def fork_action(action_id: str, task: str, source: str, copies: Sequence[str],
                t1_s: float | None = None) -> Action:
    """The action that copies ``source``'s sandbox into each of ``copies`` (one core:
    a copy is bound by the disk, not the CPU). ``t1_s``: its declared (or modelled)
    duration, when known."""
    if not copies:
        raise ValueError("count: a fork needs at least one copy")
    if len(copies) > MAX_COPIES:
        raise ValueError(f"count: at most {MAX_COPIES} copies per fork, got {len(copies)}")
    if source in copies:
        raise ValueError(f"fork_of: {source!r} cannot be a copy of itself")
    return Action(action_id, task, source, FORK, {"cpu": Demand.fixed(1)}, t1_s=t1_s,
                  payload={"fork_to": list(copies)})


def copies_of(action: Action) -> list[str]:
    """The trajectories a fork action fills (its payload's ``fork_to``)."""
    return list((action.payload or {}).get("fork_to") or [])
