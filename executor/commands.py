"""Turning an action's payload into the argv a backend executes.

A command string is split with ``shlex`` and run as argv, unless the action
asks for a shell (``shell: true``): then it runs as ``sh -c <command>``, the
command passed as one argument (never interpolated into another command line),
by the ``sh`` of wherever the backend runs it (inside the container for the
docker backend). A shell command is never rewritten. The one
rewrite is the paper's elastic test run (section 5.2): a ``pytest`` command
granted ``k >= 2`` cores gets ``-n k`` (pytest-xdist), inserted right after
``pytest``; ``-n 1`` would only add a worker process, so one core runs it as
written. ``tangram burn`` (the replay's CPU worker, executor/bench/burn.py) takes the
same ``-n`` and is rewritten the same way. Any other command is never rewritten.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Any


class CommandError(ValueError):
    pass


def argv_of(payload: Mapping[str, Any] | None) -> list[str]:
    """The argv of a payload: ``{"argv": [...]}`` or ``{"command": "..."}``."""
    if not payload:
        raise CommandError("payload: no command (give 'argv' or 'command')")
    argv = payload.get("argv")
    if argv is not None and payload.get("shell"):
        raise CommandError("payload.shell: applies to 'command' only; argv never runs in a shell")
    if argv is not None:
        if not isinstance(argv, Sequence) or isinstance(argv, str) or not argv or \
                not all(isinstance(a, str) for a in argv):
            raise CommandError("payload.argv: must be a non-empty list of strings")
        return list(argv)
    command = payload.get("command")
    if not isinstance(command, str) or not command.strip():
        raise CommandError("payload: no command (give 'argv' or 'command')")
    if payload.get("shell"):
        return ["sh", "-c", command]
    try:
        return shlex.split(command)
    except ValueError as e:
        raise CommandError(f"payload.command: cannot split {command!r}: {e}") from None


def pytest_position(argv: Sequence[str]) -> int | None:
    """Index right after ``pytest`` in ``pytest ...`` or ``python -m pytest ...``."""
    if not argv:
        return None
    if os.path.basename(argv[0]) in ("pytest", "py.test"):
        return 1
    if os.path.basename(argv[0]).startswith("python") and list(argv[1:3]) == ["-m", "pytest"]:
        return 3
    return None


def burn_position(argv: Sequence[str]) -> int | None:
    """Index right after ``tangram burn`` or ``python -m executor.bench.burn``."""
    if len(argv) >= 2 and os.path.basename(argv[0]) == "tangram" and argv[1] == "burn":
        return 2
    if argv and os.path.basename(argv[0]).startswith("python") and \
            list(argv[1:3]) == ["-m", "executor.bench.burn"]:
        return 3
    return None


def elastic_argv(argv: list[str], units: int, elastic: bool) -> list[str]:
    """Insert ``-n units`` into an elastic pytest or burn run (unless it already chose):
    ``units`` is the worker count (``Dispatch.worker_count``; a malleable grant's cores
    change under its workers, tangram/cpu/malleable.py)."""
    pos = pytest_position(argv)
    if pos is None:
        pos = burn_position(argv)
    if not elastic or pos is None or units < 2:
        return argv
    if any(a == "-n" or a.startswith("-n") and a[2:].isdigit() or a.startswith("--numprocesses")
           for a in argv[pos:]):
        return argv
    return argv[:pos] + ["-n", str(units)] + argv[pos:]


#: niceness of actions on exclusive cores; light-lane actions keep 0 (tangram/cpu/pool.py,
#: CpuNodePool): under CFS a nice-0 task sharing a core with a nice-10 one gets 1024/1134
EXCLUSIVE_NICE = 10
