"""Unprivileged user ids for the process backend's commands when the server runs as root.

A command that runs as root can read the server's environment (its token), signal the
server and every other trajectory's commands. So, as root, each open trajectory gets a
user id of its own, never used by anything else on the host: its commands cannot read
``/proc/<server>/environ`` nor signal a process of another user, by construction (not by a
filter), and every process carrying that uid - whatever it did to its environment, its
session or its process group - is found again and killed when the trajectory closes.

The ids come in blocks of :data:`BLOCK` claimed with ``flock`` on a file per block, so two
servers (or two Ray agents) on one host never hand out the same id; the lock is released
with the process that holds it (and with the guard it passed the descriptor to,
executor/backends/ray/guard.py), never left behind by a crash. A backend hands out the first
``size`` ids of its block (``--sandbox-uids``, default the whole block): at most that many
trajectories open at once; the rest of the block is claimed all the same.

Within a block the ids rotate: a closed trajectory's id goes to the back of the queue
(oldest freed first), and only once its processes are gone and every file it owns
anywhere a sandbox may write was removed (executor/backends/process/reaper.py,
executor/backends/process/owned.py). The next trajectory never gets the id that just
closed (last-freed-first handed it to the next open at once).
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from collections import deque
from pathlib import Path

from executor.backends.process.marks import kill_until_gone, pids_where

#: first id handed out (far above distributions' ranges and docker's userns maps)
BASE = 3_000_000
#: ids per block: at most this many trajectories open at once per backend
BLOCK = 4096
BLOCKS = 256
LOCK_DIR = Path(tempfile.gettempdir()) / "tangram-uids"


#: prctl(2) option: execve never grants privileges again (inherited, cannot be unset)
PR_SET_NO_NEW_PRIVS = 38


def no_new_privileges() -> None:
    """From now on, in this process and everything it starts, a setuid or setgid file (or
    one with file capabilities) runs with the caller's ids: a sandbox's commands cannot
    become another user through a file one left anywhere. For a child
    before its exec (a preexec_fn); ``spawner.as_user`` passes ``--no-new-privs``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def dropping() -> bool:
    """Whether commands run under ids of their own (only root can switch ids)."""
    return os.geteuid() == 0


class UidBlock:
    """A block of ids held by this process: ``take`` one per trajectory, ``give`` it back;
    ``size``: how many of the block's ids are handed out (the first ones; 2 to
    :data:`BLOCK`: with one the next trajectory would get the id that just closed)."""

    def __init__(self, lock_dir: Path = LOCK_DIR, size: int = BLOCK) -> None:
        if not 2 <= size <= BLOCK:
            raise ValueError(f"sandbox uids: {size} ids per backend (2 to {BLOCK})")
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for k in range(BLOCKS):
            fd = os.open(lock_dir / f"block-{k}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.fd = fd  # held for this process's life (and a guard's that inherits it)
            self.first = BASE + k * BLOCK
            break
        else:
            raise RuntimeError(f"no free block of sandbox user ids ({BLOCKS} held in {lock_dir})")
        self.size = size
        #: the quarantine: ids handed out from the left, given back on the right
        self._free = deque(range(self.first, self.first + size))

    def take(self) -> int:
        if not self._free:
            # an OSError (EAGAIN): the server answers 503 (retry), not 500 - the ids of
            # closed trajectories come back as their cleanup, off the loop, ends
            raise OSError(errno.EAGAIN, f"all {self.size} sandbox user ids are taken by open "
                          "trajectories or by closed ones still being cleaned up; retry "
                          "shortly, or raise --sandbox-uids")
        return self._free.popleft()

    def give(self, uid: int) -> None:
        """``uid`` is clean again (nothing of it runs or remains): last in the queue."""
        self._free.append(uid)

    def owns(self, uid: int) -> bool:
        return self.first <= uid < self.first + BLOCK


def pids_of_uids(first: int, last: int) -> list[int]:
    """Processes whose real user id is in ``[first, last]``."""
    return pids_where(lambda pid: first <= real_uid(pid) <= last)


def real_uid(pid: str) -> int:
    """Process ``pid``'s real user id (a setuid program run by a sandbox keeps it), or -1
    when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return int(next(line for line in f if line.startswith(b"Uid:")).split()[1])
    except (OSError, StopIteration, ValueError, IndexError):
        return -1


def kill_uids(first: int, last: int | None = None) -> int:
    """SIGKILL every process of the ids ``[first, last]``; repeated while forks race."""
    last = first if last is None else last
    return kill_until_gone(lambda: pids_of_uids(first, last), rounds=10)


def unreachable(path: str | Path) -> list[Path]:
    """The directories on the way to ``path`` that another user cannot pass through
    (no ``o+x``): a sandbox user cannot run a program below them (a Python in /root)."""
    out = []
    p = Path(os.path.realpath(path))
    for d in reversed(p.parents):
        try:
            if not os.stat(d).st_mode & 0o001:
                out.append(d)
        except OSError:
            out.append(d)
    return out
