"""The process backend's fork: a copy of the source's work directory per copy.

How the files are copied is chosen once per file system and reported with every fork
(the action's ``extra["method"]``):

* ``reflink``: ``cp -a --reflink=always`` - the copy shares the source's blocks until
  either side writes (btrfs, XFS with reflink, bcachefs, ZFS 2.2+): a copy costs
  metadata only;
* ``copy``: ``cp -a`` - every byte read and written again (ext4, overlayfs, tmpfs).

Hard links with a copy-on-write by the server before each write were left out: a
command writes its files itself (``pip``, ``git``, an editor), not through the server,
so the server could not copy a file before that write. Processes are not copied: the
source has no action in flight when it is forked (the service refuses otherwise) and
a copy starts with no process of its own.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from executor.backends.process import spawner
from tangram.fork import copies_of
from tangram.model import Dispatch, Outcome

#: st_dev of a file system -> whether cp --reflink=always works on it (probed once)
_REFLINK: dict[int, bool] = {}


class Forkable(Protocol):
    """What a fork needs of the process backend."""

    cpu_map: list[int]

    def workdir(self, trajectory: str) -> Path: ...

    def _uid(self, trajectory: str) -> int | None: ...


def reflinks(root: Path) -> bool:
    """Whether ``root``'s file system shares blocks between copies (probed once: a
    one-byte file cloned with ``cp --reflink=always``)."""
    dev = os.stat(root).st_dev
    if dev not in _REFLINK:
        with tempfile.TemporaryDirectory(prefix=" reflink-probe ", dir=root) as tmp:
            src = Path(tmp) / "a"
            src.write_bytes(b"x")
            done = subprocess.run(["cp", "--reflink=always", str(src), str(Path(tmp) / "b")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  check=False)
            _REFLINK[dev] = done.returncode == 0
    return _REFLINK[dev]


def copy_argv(src: Path, dst: Path, reflink: bool) -> list[str]:
    """``cp`` of the *contents* of ``src`` into the existing directory ``dst``."""
    return ["cp", "-a", *(["--reflink=always"] if reflink else []), "--", f"{src}/.", f"{dst}/"]


def chown_tree(path: Path, uid: int) -> None:
    """Give a copy to its trajectory's sandbox user (as root, ``cp -a`` kept the source's)."""
    os.chown(path, uid, uid)
    for parent, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(parent, name), uid, uid, follow_symlinks=False)


async def run_fork(backend: Forkable, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
    """Copy the source's work directory into each copy's (already made, empty), on the
    fork's granted cores; one Outcome, ``extra``: method, copies, bytes, fork_s."""
    t0 = time.perf_counter()
    copies: Sequence[str] = copies_of(d.action)
    src = backend.workdir(d.action.trajectory)
    reflink = await asyncio.to_thread(reflinks, src.parent)
    cores = {backend.cpu_map[c] for c in d.lease.cores} or set(backend.cpu_map)
    for copy in copies:
        dst = backend.workdir(copy)
        proc = await _exec_pinned(copy_argv(src, dst, reflink), cores)
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            await asyncio.to_thread(_empty, dst)
            on_done(Outcome(d.action.id, "failed", proc.returncode, out.decode(errors="replace"),
                            f"fork: copying the sandbox into {copy!r} failed "
                            f"(cp exit {proc.returncode})"))
            return
        uid = backend._uid(copy)
        if uid is not None:
            await asyncio.to_thread(chown_tree, dst, uid)
    size = await asyncio.to_thread(_bytes, src)
    fork_s = time.perf_counter() - t0
    on_done(Outcome(d.action.id, "ok", 0, "", "", 0.0,
                    {"method": "reflink" if reflink else "copy", "copies": list(copies),
                     "bytes": size, "fork_s": fork_s, "cores": sorted(cores)}))


async def _exec_pinned(argv: list[str], cores: set[int]) -> asyncio.subprocess.Process:
    """``argv`` as the server (it must read every sandbox's files), pinned to ``cores``."""
    return await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, preexec_fn=lambda: spawner.place(cores, 0))


def _empty(path: Path) -> None:
    """Leave a failed copy's directory empty (the copy trajectory is closed after)."""
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (what one copy wrote)."""
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(parent, name))
            except OSError:
                continue
            total += st.st_size
    return total
