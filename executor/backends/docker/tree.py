"""An action's processes inside its container, found and killed from the host (docker
backend's cancel and timeout).

Killing the container was the only way the backend stopped a cancelled command, and it
took the rollout's files with it; the agent's own timeout killed every
process of the sandbox user, other actions' commands included. Now each command carries
an environment mark of its action (:data:`ACTION_MARK`, set by the backend; the agent
passes it on, and everything the command starts inherits it), and the host - root, with
every capability, seeing the container's processes under their host pids - kills what
carries it, and every descendant of those, until none is left. The container, its files
and the other actions' processes stay.

Which processes are the container's: its cgroup's ``cgroup.procs`` (the directory of the
cpuset file the backend writes), else the engine's ``top``. The environment is read through
``/proc/<pid>/environ``, which the host's root reads whatever the process did to itself
(``prctl(PR_SET_DUMPABLE, 0)`` included). What escapes: a process that both cleared its
environment (``env -i``) and was re-parented away from the marked ones before the scan (a
double fork); it dies with the container, at the trajectory's close.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

log = logging.getLogger("tangram.docker")

#: set in each command's environment: which action a process of the container belongs to
ACTION_MARK = "TANGRAM_ACTION"
#: how long ending an action's processes waits for them to exit after SIGKILL
END_WAIT_S = 30.0


def cgroup_pids(cgroup_dir: str) -> list[int] | None:
    """The host pids in a cgroup (``cgroup.procs``), None where it cannot be read."""
    try:
        with open(os.path.join(cgroup_dir, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return None


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])  # (the name may hold spaces)
    except (OSError, ValueError, IndexError):
        return -1


def action_pids(pids: list[int], mark: str) -> list[int]:
    """Of the container's ``pids``, those carrying ``ACTION_MARK=<mark>`` and every
    descendant of one (a child that cleared its environment is still its parent's)."""
    needles = (f"{ACTION_MARK}={mark}\0".encode(), f"{ACTION_MARK}={mark}".encode())
    marked = {p for p in pids if _carries_exactly(p, needles)}
    if not marked:
        return []
    children: dict[int, list[int]] = {}
    for p in pids:
        children.setdefault(_parent(p), []).append(p)
    out, stack = set(marked), list(marked)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in out:
                out.add(child)
                stack.append(child)
    return sorted(out)


def _carries_exactly(pid: int, needles: tuple[bytes, bytes]) -> bool:
    """Whether the environment holds the mark as a whole entry (one mark is never the
    prefix of another: each is a fixed-length token, but a command may set a longer one)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return (env.startswith(needles[0]) or b"\0" + needles[0] in env
            or env.endswith(b"\0" + needles[1]) or env == needles[1])


def end_action(list_pids: Callable[[], list[int] | None], mark: str,
               wait_s: float = END_WAIT_S) -> bool:
    """SIGKILL the action's processes (:func:`action_pids` of what ``list_pids`` gives)
    scan after scan until none is left; False where the container's processes cannot be
    listed, or some were still there after ``wait_s`` (with 0: one kill pass, False if it
    found any; blocking: off the event loop)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = list_pids()
        if pids is None:
            return False
        found = action_pids(pids, mark)
        if not found:
            return True
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if time.monotonic() > deadline:  # (wait_s 0: one pass, not waited for)
            if wait_s:
                log.warning("action processes %s (mark %s) still there %g s after SIGKILL",
                            found[:10], mark, wait_s)
            return False
        time.sleep(0.01)
