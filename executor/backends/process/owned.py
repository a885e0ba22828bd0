"""Every file a closed sandbox user owns wherever sandboxes may write, removed before its
id is handed out again.

executor/backends/process/sweep.py looks in ``/tmp`` and friends only where the user
itself could write (``o+w`` directories). But another sandbox may move what it left
further: sandbox C makes its work directory 0777, A writes a file there, C moves it into
a 0700 directory of its own. So:

* the work root is walked whole: every sandbox's tree, whatever its modes now (they
  may have been open when the file was written);
* the shared places (``/tmp``, ``/dev/shm``, ...) are walked into every directory a
  sandbox user could write or own: ``o+w``/``g+w`` ones and those owned by any sandbox id
  (:data:`~executor.backends.process.uids.BASE` and up), not other host users' private
  ones.

The listing is ``find -P -xdev`` (no link followed, no other file system entered; a walk
in C, off the server's interpreter), the removal is descriptor-relative: each directory
on the way is opened with ``O_NOFOLLOW`` under the one before, and the entry is checked
again there before it is removed, so a sandbox that swaps a directory for a link between
the listing and the removal makes it fail, never lands it outside (``rm`` of a listed
path as root would follow the link: ``/tmp/c/d/passwd`` with ``d -> /etc``).

What escapes: a file that a live sandbox keeps renaming between directories while the
walk runs may be listed nowhere. It is still only a file: sandbox commands run with no
new privileges (executor/backends/process/uids.py), so a setuid bit on it makes no one
its owner, and its id comes back only after every other id of the block was used.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Collection, Iterable
from pathlib import Path

from executor.backends.process.uids import BASE, BLOCK, BLOCKS

log = logging.getLogger("tangram.process")

#: the sandbox ids of every block (any server's): their directories may hold anything
SANDBOX_IDS = (BASE, BASE + BLOCK * BLOCKS - 1)


def remove_owned(ids: Collection[int], whole: Iterable[Path] = (),
                 shared: Iterable[Path] = ()) -> int:
    """Remove every file, directory (with what it holds) and link whose owner or group is
    one of ``ids`` (a set, or a ``range``: a whole block) below the
    ``whole`` roots (walked entirely) and the ``shared`` ones (walked where sandboxes
    can write); how many entries were removed."""
    removed = 0
    for root, prune in [*((r, False) for r in whole), *((r, True) for r in shared)]:
        for rel in _listed(root, ids, prune):
            removed += _remove_beneath(root, rel, ids)
    return removed


def _matches(ids: Collection[int]) -> list[str]:
    """``find``'s test for "owned by one of ``ids``" (a range in two comparisons)."""
    if isinstance(ids, range) and ids.step == 1 and len(ids) > 1:
        lo, hi = ids.start - 1, ids.stop
        return ["(", "-uid", f"+{lo}", "-uid", f"-{hi}", ")", "-o",
                "(", "-gid", f"+{lo}", "-gid", f"-{hi}", ")"]
    out: list[str] = []
    for i in sorted(set(ids)):
        out += [*(["-o"] if out else []), "-uid", str(i), "-o", "-gid", str(i)]
    return out


def _listed(root: Path, ids: Collection[int], prune: bool) -> list[str]:
    """Paths relative to ``root`` of the outermost entries ``ids`` own (what a removed
    directory holds is not listed again)."""
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            return []
    except OSError:
        return []
    match = _matches(ids)
    if not match:
        return []
    argv = ["find", "-P", str(root), "-xdev", "-mindepth", "1", "(", *match, ")",
            "-prune", "-printf", "%P\\0"]
    if prune:  # not into a directory no sandbox user could write nor owns
        lo, hi = SANDBOX_IDS
        argv += ["-o", "-type", "d", "!", "-perm", "/022",
                 "!", "(", "-uid", f"+{lo - 1}", "-uid", f"-{hi + 1}", ")",
                 "!", "(", "-gid", f"+{lo - 1}", "-gid", f"-{hi + 1}", ")", "-prune"]
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          check=False)
    return [p.decode("utf-8", "surrogateescape") for p in done.stdout.split(b"\0") if p]


def _remove_beneath(root: Path, rel: str, ids: Collection[int]) -> int:
    """Remove ``root/rel`` if ``ids`` still own it, reaching it only through directories
    opened without following a link; 1 if removed."""
    *dirs, name = rel.split("/")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fds: list[int] = []
    try:
        fds.append(os.open(root, flags))
        for d in dirs:
            fds.append(os.open(d, flags, dir_fd=fds[-1]))
        here = fds[-1]
        st = os.stat(name, dir_fd=here, follow_symlinks=False)
        if st.st_uid not in ids and st.st_gid not in ids:
            return 0
        if stat.S_ISDIR(st.st_mode):
            _remove_dir(here, name)
        else:
            os.unlink(name, dir_fd=here)
        return 1
    except OSError as e:  # moved or swapped for a link meanwhile, or gone
        log.warning("cannot remove %s/%s left by a closed sandbox user: %s", root, rel, e)
        return 0
    finally:
        for fd in fds:
            os.close(fd)


def _remove_dir(parent: int, name: str) -> None:
    """``shutil.rmtree`` relative to ``parent`` (it opens each level without following a
    link); past its recursion limit, ``rm -rf`` through the descriptor (``rm`` walks
    with ``openat`` too)."""
    try:
        shutil.rmtree(name, dir_fd=parent)
        return
    except RecursionError:
        pass
    subprocess.run(["rm", "-rf", "--one-file-system", "--", f"/dev/fd/{parent}/{name}"],
                   pass_fds=(parent,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False)
