"""Freezing a sandbox's processes while its files are copied (a fork), stdlib only.

A fork copies the source's files while nothing of the source runs: a background
process the source left (a daemon, a ``setsid`` child) could otherwise change the tree
under the copy - swap a directory for a symlink in the middle of it, or write into the
copy's files through a descriptor it kept - and the copy would be no snapshot.

How: ``SIGSTOP`` to every process the caller's ``find`` lists, scan after scan, until a
scan finds every thread of every one stopped (a group stop reaches all threads; a
process that forked meanwhile shows up in the next scan; the kernel restarts a ``fork``
that a stop interrupts, so no child slips out). A stopped process is inside no system
call (a rename, a write) and can signal nothing: none can ``SIGCONT`` another. Each
process is held by a pidfd, so the ``SIGCONT`` that thaws it reaches that process, not
one that took its pid after it died. Not the cgroup freezer: the process backend's
sandboxes have no freezer cgroup of their own, and inside a container the copier is in
the container's cgroup itself.

Used by the process backend (executor/backends/process/fork.py) on the host and, imported
as ``freeze``, by the docker sandbox's agent (executor/backends/docker/agent.py) inside the
container.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable

#: a thread in one of these states runs no code of its own (stopped, traced, dead)
_STILL = frozenset("TtZX")
#: how long a freeze may take before the fork gives up (a process stuck in an
#: uninterruptible sleep, e.g. on a hung network file system)
FREEZE_S = 30.0


class FreezeError(OSError):
    """The processes could not all be stopped in time (they are running again)."""


def _state(path: str) -> str:
    try:
        with open(path, "rb") as f:
            stat = f.read()
    except OSError:
        return "X"  # gone
    return chr(stat[stat.rfind(b")") + 2])


def stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (or it is gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return all(_state(f"/proc/{pid}/task/{t}/stat") in _STILL for t in tasks)


class Frozen:
    """The processes a freeze stopped, each held by a pidfd (or its pid where pidfds are
    missing); :meth:`thaw` continues them."""

    def __init__(self) -> None:
        self._held: dict[int, int | None] = {}  # pid -> pidfd

    def __len__(self) -> int:
        return len(self._held)

    def stop(self, pid: int) -> None:
        if pid not in self._held:
            try:
                self._held[pid] = os.pidfd_open(pid)
            except (AttributeError, OSError):
                self._held[pid] = None
        fd = self._held[pid]
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.SIGSTOP)
            else:
                os.kill(pid, signal.SIGSTOP)
        except OSError:  # gone meanwhile
            pass

    def thaw(self) -> None:
        held, self._held = self._held, {}
        for pid, fd in held.items():
            try:
                if fd is not None:
                    signal.pidfd_send_signal(fd, signal.SIGCONT)
                else:
                    os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
            finally:
                if fd is not None:
                    os.close(fd)


def freeze(find: Callable[[], Iterable[int]], within_s: float = FREEZE_S) -> Frozen:
    """Stop every process ``find`` lists until one scan finds them all stopped; the
    stopped ones (thaw them). FreezeError (all thawed again) after ``within_s``."""
    frozen = Frozen()
    deadline = time.monotonic() + within_s
    pause = 0.0005
    while True:
        running = [pid for pid in find() if not stopped(pid)]
        if not running:
            return frozen
        if time.monotonic() > deadline:
            frozen.thaw()
            raise FreezeError(f"{len(running)} process(es) of the sandbox could not be "
                              f"stopped within {within_s:g} s (e.g. pid {running[0]})")
        for pid in running:
            frozen.stop(pid)
        time.sleep(pause)  # a stop lands when the process is next scheduled
        pause = min(pause * 2, 0.02)
