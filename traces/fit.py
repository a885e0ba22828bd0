"""Does a trace fit a cluster? One check for `simulate`, `run` and `trace validate`."""

from __future__ import annotations

from collections.abc import Iterable

from tangram.core import Tangram
from tangram.protocol import Close, Open
from traces.schema import TrajectorySpec

MAX_PROBLEMS = 200


def misfits(core: Tangram, specs: Iterable[TrajectorySpec]) -> list[str]:
    """Every action that can never run on ``core``'s cluster (at most 200), before a run
    starts. Uses a throwaway core: its trajectories are opened and closed again."""
    problems: list[str] = []
    for spec in specs:
        try:
            core.handle(Open(spec.id, spec.task, spec.mem_gb), 0.0)
        except ValueError as e:
            problems.append(f"trajectory {spec.id!r}: {e.args[0] if e.args else e}")
            continue
        for step in spec.steps:
            try:
                core.validate(step.action)
            except (ValueError, KeyError) as e:
                msg = e.args[0] if e.args else str(e)
                problems.append(f"trajectory {spec.id!r}, action {step.action.id!r}: {msg}")
                if len(problems) >= MAX_PROBLEMS:
                    return problems
        core.handle(Close(spec.id), 0.0)
    return problems


def check_fits(core: Tangram, specs: Iterable[TrajectorySpec]) -> None:
    """Raise ValueError listing every misfit (nothing has started yet)."""
    problems = misfits(core, specs)
    if problems:
        raise ValueError("trace does not fit the cluster:\n  " + "\n  ".join(problems))
