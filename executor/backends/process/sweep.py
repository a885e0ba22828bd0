"""What a sandbox user left outside its work directory, found by owner and removed.

As root, a trajectory's commands run as a user id of its own (executor/backends/process/uids.py),
and that id goes to another trajectory once the first one closed. Its work directory is
removed at close; but a command may also write where every user may: ``/tmp``,
``/var/tmp``, ``/dev/shm`` (memory, charged to no one once its writer is gone),
``/run/lock``, and create System V IPC objects (shared memory too) and POSIX message
queues. Left there, the next trajectory under the same id would read and append to them
as their owner. So, once nothing of the id runs any more (executor/backends/process/reaper.py kills it
first), everything it owns in those places is removed, before the id is handed out again.

Where it looks: only where the id could have created something. Below the roots it
descends into a directory only when its owner could write there, i.e. one it owns
(removed whole) or one others may write into (``o+w``, the sticky ``/tmp`` and friends,
or a group-writable one of its group): a walk of a few directories, not of the machine's
``/tmp``. It never crosses into another file system and never follows a link.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger("tangram.process")

#: where any user may create files (those that exist on this machine are swept)
WRITABLE_ROOTS = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"), Path("/run/lock"),
                  Path("/dev/mqueue"))
#: the System V IPC kinds, their /proc table and the libc call that removes one
_IPC = (("shm", "shmctl"), ("msg", "msgctl"), ("sem", "semctl"))
IPC_RMID = 0


def sweep(owned: Callable[[int], bool], roots: Iterable[Path] = WRITABLE_ROOTS) -> int:
    """Remove every file, directory and IPC object whose owner ``owned`` accepts from
    ``roots`` and the System V IPC tables; how many were removed."""
    removed = 0
    for root in roots:
        try:
            top = os.lstat(root)
        except OSError:
            continue
        if stat.S_ISDIR(top.st_mode):
            removed += _sweep_dir(root, top.st_dev, owned)
    return removed + _sweep_ipc(owned)


def _sweep_dir(root: Path, dev: int, owned: Callable[[int], bool]) -> int:
    removed = 0
    stack = [root]
    while stack:
        here = stack.pop()
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            is_dir = stat.S_ISDIR(st.st_mode)
            if owned(st.st_uid):
                try:
                    if is_dir:
                        remove_tree(Path(e.path))
                    else:
                        os.unlink(e.path)
                    removed += 1
                except OSError as err:
                    log.warning("cannot remove %s left by sandbox user %d: %s", e.path,
                                st.st_uid, err)
            elif is_dir and st.st_dev == dev and (
                    st.st_mode & stat.S_IWOTH
                    or (st.st_mode & stat.S_IWGRP and owned(st.st_gid))):
                stack.append(Path(e.path))
    return removed


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
