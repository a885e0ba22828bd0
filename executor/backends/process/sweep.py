"""What a sandbox user left outside its work directory, found by owner and removed.

As root, a trajectory's commands run as a user id of its own (executor/backends/process/uids.py),
and that id goes to another trajectory once the first one closed. Its work directory is
removed at close; but a command may also write where every user may: ``/tmp``,
``/var/tmp``, ``/dev/shm`` (memory, charged to no one once its writer is gone),
``/run/lock``, and create System V IPC objects (shared memory too) and POSIX message
queues. Left there, the next trajectory under the same id would read and append to them
as their owner. So, once nothing of the id runs any more (executor/backends/process/reaper.py kills it
first), everything it owns in those places is removed, before the id is handed out again.

Where it looks: the work root whole, and below the shared roots every directory a
sandbox user could write or own (executor/backends/process/owned.py, which removes each
entry through descriptors opened without following a link: the path a walk saw may be a
link to ``/etc`` by the time it is removed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import shutil
import subprocess
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from executor.backends.process.owned import remove_owned

log = logging.getLogger("tangram.process")

#: where any user may create files (those that exist on this machine are swept)
WRITABLE_ROOTS = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"), Path("/run/lock"),
                  Path("/dev/mqueue"))
#: the System V IPC kinds, their /proc table and the libc call that removes one
_IPC = (("shm", "shmctl"), ("msg", "msgctl"), ("sem", "semctl"))
IPC_RMID = 0


def sweep(ids: Collection[int], roots: Iterable[Path] = WRITABLE_ROOTS,
          whole: Iterable[Path] = ()) -> int:
    """Remove every file, directory and IPC object that one of ``ids`` (a set, or a
    ``range``) owns below ``roots`` (where sandboxes may write), the ``whole`` roots (every
    sandbox's tree: the work root) and in the System V IPC tables; how many were removed."""
    return remove_owned(ids, whole, roots) + _sweep_ipc(ids.__contains__)


def remove_tree(path: Path) -> None:
    """Remove ``path`` whatever its depth. ``shutil.rmtree`` recurses once per level and
    gives up past ~1,000 (RecursionError, which ``ignore_errors`` does not catch): then
    ``rm -rf``, which walks iteratively, finishes it (a process start only then)."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:
        pass
    rm = shutil.which("rm")
    if path.exists() and rm is not None:
        subprocess.run([rm, "-rf", "--one-file-system", "--", str(path)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def _sweep_ipc(owned: Callable[[int], bool]) -> int:
    """Remove the System V IPC objects (shared memory, queues, semaphores) the owner left."""
    removed = 0
    libc = None
    for kind, call in _IPC:
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header = f.readline().split()
                rows = [line.split() for line in f]
        except OSError:
            continue
        cols = [header.index(c) for c in ("uid", "cuid") if c in header]
        for row in rows:
            # the owner, or the creator (who may have given it to another owner)
            if len(row) <= max(cols, default=0) or not any(owned(int(row[c])) for c in cols):
                continue
            if libc is None:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                                   use_errno=True)
            fn = getattr(libc, call)
            ipc_id = int(row[1])  # (shmid, msqid, semid: the second column of each)
            args = (ipc_id, 0, IPC_RMID) if kind == "sem" else (ipc_id, IPC_RMID, None)
            if fn(*args) == 0:
                removed += 1
    return removed
