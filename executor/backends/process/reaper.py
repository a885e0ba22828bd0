"""Cleaning up after closed trajectories (process backend): what their actions left
running is killed, then their directories are removed and their sandbox user ids given
back - off the event loop, in one thread of the backend's, and together.

Why together: finding what a trajectory left is a pass over /proc (each process's
``status`` or ``environ`` read: ~1.5-2 ms of CPU with ~100 processes on this kind of
machine), and a server running short trajectories closes tens of them a second. The
closes that arrive while a cleanup runs share the next pass, so its cost is per batch,
not per close.

Which pass: as root, commands run as a sandbox user of their trajectory
(executor/backends/process/uids.py) and anything they started keeps that real user id (a setuid
program too), so the uids are searched; the environment mark is then redundant (a
process of another real id is one that became root through su/sudo, which a sandbox
user cannot). Otherwise the mark in each process's environment (executor/backends/process/marks.py).

Then, as root, what the uids own where any user may write (``/tmp``, ``/dev/shm``, IPC
objects, and every other sandbox's tree in the work root: executor/backends/process/sweep.py)
is removed, and only then are the ids given back: nothing of one trajectory is there for
the next one under the same id.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from executor.backends.process.marks import carries, kill_until_gone, pids_where
from executor.backends.process.sweep import remove_tree, sweep
from executor.backends.process.uids import real_uid

log = logging.getLogger("tangram.process")


@dataclass(frozen=True)
class Leftovers:
    """What one closed trajectory may have left."""

    mark: str | None  # the prefix of the mark its processes carry (``MARK=<mark>...``)
    uid: int | None  # the sandbox user its commands ran as (a root server)
    tree: Path | None  # its directory, already moved aside, to remove
    then: Callable[[], None] | None = None  # once all is gone (e.g. the uid given back)


def find(var: str, marks: tuple[str, ...], uids: frozenset[int]) -> list[int]:
    """One pass over /proc: the processes of ``uids`` (when any) or else those carrying
    ``var=<one of marks>...``."""
    if uids:
        return pids_where(lambda pid: real_uid(pid) in uids)
    needles = tuple(f"{var}={m}".encode() for m in marks)
    return pids_where(lambda pid: carries(pid, needles)) if needles else []


#: passes over /proc per batch while a fork races them
ROUNDS = 10


class Reaper:
    """One thread that cleans up after closed trajectories, in batches."""

    def __init__(self, var: str, work_root: Path | None = None) -> None:
        """``work_root``: where every sandbox's tree is (walked whole for what a closed
        sandbox user left in another's)."""
        self.var = var
        self.work_root = work_root
        self._queue: list[Leftovers] = []
        self._busy = 0  # batches being cleaned
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, left: Leftovers) -> None:
        with self._cond:
            self._queue.append(left)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True,
                                                name="tangram-reaper")
                self._thread.start()
            self._cond.notify_all()

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until every cleanup added so far is done; False if it took too long."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                batch, self._queue = self._queue, []
                self._busy += 1
            try:
                clean(self.var, batch, self.work_root)
            except Exception:  # the thread must outlive one bad batch (later closes wait on it)
                log.exception("cleaning up after closed trajectories")
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()


def clean(var: str, batch: list[Leftovers], work_root: Path | None = None) -> None:
    """Kill what ``batch`` left (one pass over /proc per round), then remove its trees,
    what its uids own anywhere else (``work_root`` included) and run each one's ``then``."""
    uids = frozenset(x.uid for x in batch if x.uid is not None)
    marks = tuple(x.mark for x in batch if x.mark is not None and x.uid is None)
    if uids or marks:
        kill_until_gone(lambda: find(var, marks, uids), rounds=ROUNDS)
    for x in batch:
        if x.tree is not None:
            remove_tree(x.tree)
    if uids:  # what they wrote outside their directories, before the ids go to another
        sweep(uids, whole=() if work_root is None else (work_root,))
    for x in batch:
        if x.then is not None:
            x.then()
