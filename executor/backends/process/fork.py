"""The process backend's fork: a copy of the source's work directory per copy.

How the files are copied is chosen once per file system and reported with every fork
(the action's ``extra["method"]``):

* ``reflink``: ``cp -a --reflink=always`` - the copy shares the source's blocks until
  either side writes (btrfs, XFS with reflink, bcachefs, ZFS 2.2+): a copy costs
  metadata only;
* ``copy``: ``cp -a`` - every byte read and written again (ext4, overlayfs, tmpfs).

No file operation runs as root over a path a sandbox controls:

1. the source's processes are frozen (executor/freeze.py) for as long as it is copied:
   nothing of it renames, swaps a link in or writes meanwhile, and the copy is a snapshot;
2. ``cp`` runs as the *source's* user id: it reads exactly what the source's commands
   can (a link the source planted leads it nowhere the source could not go itself) and
   writes into a staging directory of that user inside a root-only (0700) directory of
   the work root, so no sandbox can reach the staged tree once the source runs again;
3. the staged tree is given to the copy's user id by ``chown -R -P -h`` (never following
   a link, each entry changed relative to its directory's descriptor), its top directory
   made 0700 like a fresh sandbox's (not the source's mode), and it is renamed over the
   copy's empty work directory: one ``rename`` inside the root-owned work root.

The source's own ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (executor/backends/process/scratch.py)
are copied the same way, by a second ``cp`` as the source's user into the same stage, and
become the copy's: a copy sees what setup wrote there.

Disk: a copy's work directory holds its source's bytes, counted against the copy's ``disk_gb``
(``--sandbox-disk-gb``, as docker bounds a copy's ``/work``): a source larger is refused. The
process backend bounds no sandbox's later writes (that would take project quotas). A copy by
``cp`` (not a reflink) costs the source's bytes again, per copy, on the work root's file
system. So the source's bytes are counted while it is frozen, before anything is copied, and
a fork whose copies (work directory and private places), with what the forks under way will
still write, would leave less than ``RESERVE_BYTES`` free on that file system (1 GiB; a
twentieth of a smaller one) is refused too (the action ``failed``, naming the sizes) instead
of filling the host's disk part way.

A fork can be cancelled (its action's cancel, or its source's close): its
task is cancelled where it is - the ``cp`` killed, the staged trees removed, the source
thawed - before the action ends ``cancelled``. A step that changes the file system (a
stage made, a staged tree settled into a copy's directory, a stage removed) is never cut
short: the cancel waits for it, so that what it made is known and undone (a settle cut
short could rename a tree into a copy's directory after its close removed it). The
service then closes the copies.

Hard links with a copy-on-write by the server before each write were left out: a
command writes its files itself (``pip``, ``git``, an editor), not through the server,
so the server could not copy a file before that write. Processes are not copied: the
source has no action in flight when it is forked (the service refuses otherwise) and
a copy starts with no process of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from executor.backends.process import spawner
from executor.backends.process.scratch import Scratches
from executor.backends.process.sweep import remove_tree
from executor.freeze import FreezeError, Frozen, freeze
from tangram.fork import copies_of
from tangram.model import Dispatch, Outcome

#: st_dev of a file system -> whether cp --reflink=always works on it (probed once)
_REFLINK: dict[int, bool] = {}
#: a staging directory's name in the work root (a space: never a trajectory's name)
STAGE_PREFIX = " forking "
#: what a fork by copy leaves free on the work root's file system at least (for the
#: server's journal and the sandboxes' own writes)
RESERVE_BYTES = 1 << 30


class Forkable(Protocol):
    """What a fork needs of the process backend."""

    cpu_map: list[int]
    root: Path
    freezes: Freezes

    _scratch: Scratches

    disk_gb: float | None
    #: bytes the forks under way will still write (counted against the free disk)
    fork_bytes: int

    def workdir(self, trajectory: str) -> Path: ...

    def _private(self, trajectory: str) -> str: ...

    def _uid(self, trajectory: str) -> int | None: ...

    def _pids(self, trajectory: str) -> list[int]: ...


class Freezes:
    """The sources being copied now, each frozen once for all its forks in flight (a
    group's rollouts fork one source at once): frozen by the first, thawed by the last."""

    def __init__(self) -> None:
        self._forks: dict[str, int] = {}
        self._frozen: dict[str, Frozen] = {}
        self._lock = asyncio.Lock()

    def frozen(self, source: str) -> bool:
        return source in self._forks

    @contextlib.asynccontextmanager
    async def held(self, source: str, find: Callable[[], list[int]]) -> AsyncIterator[None]:
        """``source``'s processes (``find``) stopped while the block runs."""
        async with self._lock:
            if not self._forks.get(source):
                work = asyncio.ensure_future(asyncio.to_thread(freeze, find))
                try:
                    self._frozen[source] = await asyncio.shield(work)
                except asyncio.CancelledError:  # the freeze goes on in its thread: undo it
                    work.add_done_callback(lambda f: f.cancelled() or f.exception()
                                           or f.result().thaw())
                    raise
            self._forks[source] = self._forks.get(source, 0) + 1
        try:
            yield
        finally:  # (no await: a cancelled fork still thaws)
            self._forks[source] -= 1
            if not self._forks[source]:
                del self._forks[source]
                self._frozen.pop(source).thaw()


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


def copy_argv(src: Path, reflink: bool) -> list[str]:
    """``cp`` of the *contents* of ``src`` into the working directory (the staged tree)."""
    return ["cp", "-a", *(["--reflink=always"] if reflink else []), "--", f"{src}/.", "./"]


class Stage:
    """``<root>/ forking <hex>/`` (root, 0700) holding ``tree`` and ``places`` (the
    source's /tmp directories: executor/backends/process/scratch.py), the copier's, 0700."""

    def __init__(self, root: Path, uid: int | None) -> None:
        self.outer = root / f"{STAGE_PREFIX}{secrets.token_hex(8)}"
        self.outer.mkdir(mode=0o700)
        self.tree = self.outer / "tree"
        self.places = self.outer / "places"
        for d in (self.tree, self.places):
            d.mkdir(mode=0o700)
            if uid is not None:
                os.chown(d, uid, uid)

    def settle(self, dst: Path, uid: int | None, scratch: Scratches, name: str) -> None:
        """The staged tree becomes ``dst`` (an empty directory), owned by ``uid``; the
        staged places become the /tmp directories of the work directory ``name``."""
        if uid is not None:  # out of every sandbox's reach here, and no link followed
            done = subprocess.run(["chown", "-R", "-P", "-h", f"{uid}:{uid}", "--",
                                   str(self.tree), str(self.places)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, check=False)
            if done.returncode != 0:
                raise OSError(f"the copy cannot be given to its user id: "
                              f"{done.stderr[-300:]}")
        os.chmod(self.tree, 0o700)  # a fresh sandbox's mode, not the source's
        os.rename(self.tree, dst)  # (over the empty directory the copy's open made)
        scratch.settle(name, self.places, uid)
        self.places.rmdir()
        self.outer.rmdir()

    def remove(self) -> None:
        if self.outer.exists():
            remove_tree(self.outer)


async def run_fork(backend: Forkable, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
    """Copy the source's work directory into each copy's (already made, empty), on the
    fork's granted cores; one Outcome, ``extra``: method, copies, bytes, fork_s."""
    t0 = time.perf_counter()
    copies: Sequence[str] = copies_of(d.action)
    source = d.action.trajectory
    src = backend.workdir(source)
    src_uid = backend._uid(source)
    places = backend._scratch.sources(backend._private(source))
    reflink = await asyncio.to_thread(reflinks, src.parent)
    cores = {backend.cpu_map[c] for c in d.lease.cores} or set(backend.cpu_map)
    stages: list[Stage] = []
    reserved = 0  # bytes of this fork's copies counted in backend.fork_bytes until it ends
    try:
        try:
            async with backend.freezes.held(source, lambda: backend._pids(source)):
                # (its processes frozen: the sizes hold while it is copied; a walk the
                # fork's cancel cannot cut short, so the source is not thawed under it)
                sizes: list[int] = []
                await _whole(lambda: sizes.extend(_allocated(p) for p in (src, *places)))
                refused = too_large(sizes[0], backend.disk_gb)
                if refused is None and not reflink:
                    # forks running at once (a group's rollouts fork one source together)
                    # each count what the others will still write
                    need = sum(sizes) * len(copies)
                    short = no_room(backend.root, need, backend.fork_bytes)
                    n = len(copies)
                    refused = (f"{n} {'copy needs' if n == 1 else 'copies need'} {short}"
                               if short else None)
                    if refused is None:
                        reserved = need
                        backend.fork_bytes += need
                if refused:
                    on_done(Outcome(d.action.id, "failed", None,
                                    error=f"fork of {source!r}: {refused}"))
                    return
                for _ in copies:
                    await _whole(lambda: stages.append(Stage(backend.root, src_uid)))
                    stage = stages[-1]
                    code, out = await _copy(copy_argv(src, reflink), stage.tree, src_uid,
                                            cores)
                    if code == 0:  # its /tmp, /var/tmp, /dev/shm as directories
                        code, out = await _copy(
                            ["cp", "-a", *(["--reflink=always"] if reflink else []), "--",
                             *map(str, places), "./"], stage.places, src_uid, cores)
                    if code != 0:
                        on_done(Outcome(d.action.id, "failed", code, out,
                                        f"fork: copying the sandbox of {source!r} failed "
                                        f"(cp exit {code}, run as its user)"))
                        return
        except FreezeError as e:
            on_done(Outcome(d.action.id, "failed", None, error=f"fork: {e}"))
            return
        size = await asyncio.to_thread(_bytes, stages[0].tree)
        for copy, stage in zip(copies, stages, strict=True):
            await _whole(stage.settle, backend.workdir(copy), backend._uid(copy),
                         backend._scratch, backend._private(copy))
    finally:
        backend.fork_bytes -= reserved
        for stage in stages:
            await _whole(stage.remove)
    fork_s = time.perf_counter() - t0
    on_done(Outcome(d.action.id, "ok", 0, "", "", 0.0,
                    {"method": "reflink" if reflink else "copy", "copies": list(copies),
                     "bytes": size, "fork_s": fork_s, "cores": sorted(cores)}))


async def _whole(fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)`` in a thread, waited for to its end even when the fork is cancelled
    meanwhile (the cancel is raised then): a step of the file system is never left half
    known."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    cancelled = False
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            if work.done() and work.cancelled():
                raise
            cancelled = True
    work.result()  # (its error, if any)
    if cancelled:
        raise asyncio.CancelledError


async def _copy(argv: list[str], tree: Path, uid: int | None,
                cores: set[int]) -> tuple[int, str]:
    """``argv`` (a ``cp`` into the working directory) run in ``tree`` as ``uid`` (None: as
    the server), pinned to ``cores``; its exit code and output."""

    def prepare() -> None:  # in the child, in this order: the copier's identity last
        spawner.place(cores, 0)
        os.chdir(tree)  # (as root: the stage's outer directory is root's alone)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        preexec_fn=prepare)
    try:
        out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:  # cancelled: the copier goes with the fork
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(errors="replace")[-4000:]


def too_large(size: int, disk_gb: float | None) -> str | None:
    """Why a copy of ``size`` bytes exceeds a sandbox's disk limit (None: it does not)."""
    if disk_gb is None or size <= disk_gb * 2**30:
        return None
    return (f"a copy would hold {_size(size)} in its work directory, more than its disk "
            f"limit ({_size(int(disk_gb * 2**30))}: --sandbox-disk-gb {disk_gb:g})")


def no_room(root: Path, need: int, pending: int = 0) -> str | None:
    """Why ``need`` more bytes on ``root``'s file system, beside the ``pending`` ones other
    forks will still write, would leave less than its reserve free: ``RESERVE_BYTES``, or
    a twentieth of a smaller file system (None: they fit)."""
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    reserve = min(RESERVE_BYTES, st.f_blocks * st.f_frsize // 20)
    if free - pending - need >= reserve:
        return None
    others = f", forks under way will write {_size(pending)} more" if pending else ""
    return (f"{_size(need)} and {root} has {_size(free)} free{others}, and "
            f"{_size(reserve)} is kept for the server (the process backend copies every "
            f"byte on this file system; fewer copies, a smaller sandbox, or a work root on a "
            f"file system with reflinks: btrfs, XFS made with reflink=1)")


def _size(n: int) -> str:
    """``n`` bytes for a person: MiB below a GiB, else GiB."""
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (what a fork reports)."""
    return sum(st.st_size for st in _files(path))


def _allocated(path: Path) -> int:
    """Bytes the regular files under ``path`` occupy on disk (a sparse file counts what
    it holds: ``cp`` copies it sparse; a file hard-linked twice, once: ``cp -a`` keeps
    the links)."""
    seen: dict[tuple[int, int], int] = {}
    for st in _files(path):
        seen[st.st_dev, st.st_ino] = st.st_blocks * 512
    return sum(seen.values())


def _files(path: Path) -> Iterator[os.stat_result]:
    """The stats of the regular files under ``path``, links not followed; a walk by a
    stack, not by recursion (a tree thousands of levels deep)."""
    stack = [str(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    yield e.stat(follow_symlinks=False)
            except OSError:
                continue
