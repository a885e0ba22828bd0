"""A sandbox's own ``/tmp``, ``/var/tmp`` and ``/dev/shm`` on the process backend
(every open sandbox shared the host's ``/tmp``; one rollout read another's
``/tmp/t0``, and of 8 setups writing one fixed ``/tmp`` path 7 failed with "Permission
denied", the first writer's file being another user's).

How (a root server): each command runs in a mount namespace of its own, made by its exec
chain (``unshare --mount --propagation private``, executor/backends/process/cage.py) while
it is still root, in which the trajectory's own directories are bind-mounted over
``/tmp``, ``/var/tmp`` and ``/dev/shm`` (one ``mount --all --fstab`` of the trajectory's
``fstab``); only then does it become the sandbox user. The directories are the
trajectory's, not the command's: what setup wrote to ``/tmp/x`` the next command reads; a
daemon an action left keeps its namespace, which shows the same directories. Nothing is
mounted on the host (private propagation), so nothing is left mounted when a server dies.

Where they are: ``<work root>/ private/<its directory's name>/`` (``P``), beside the work
directories but outside them and outside what the files API reaches. ``P`` is root's,
mode 0710 with the sandbox user's group: only that sandbox (and root) may pass through
it; ``P/tmp``, ``P/var-tmp``, ``P/shm`` are root's, 1777 like the host's ``/tmp``. So
every path a mount resolves as root is root's: a sandbox cannot swap a link into one
(it can neither rename nor replace an entry of ``P``, nor a root-owned entry of a sticky
directory), and another sandbox cannot reach them at all.

A work root below one of the three (a state directory under ``/tmp``): the mount over it
would hide the work directories, the commands' own ``$HOME`` and cwd. So the work root is
bind-mounted first into a root-owned skeleton of its path inside the trajectory's
directory for that place (``P/tmp/<path of the work root below /tmp>``), and that
directory is mounted recursively: the work root stays where it was. So are the programs
the server gives its commands (``KEPT``: its Python's prefix and base prefix, a venv, and
this checkout, whose modules ``python -m executor.bench.burn`` and the like import): a
clone under ``/tmp`` whose venv is there too runs its commands as from anywhere else.

Cost (measured 2026-12-06 on this kind of machine, load ~6 on 2 cores; ``unshare`` and
one ``mount`` exec per command): through ``tangram serve`` (``python -m
analysis.bench.tmp_cost``, alternating rounds) the commands' exec chains took 2.95 -> 5.51
ms of CPU per trivial action, the server's own CPU 1.78 -> 2.05 ms (within the rounds'
spread: one start per action, as before). A persistent namespace per trajectory entered
with ``nsenter`` cost ~1 ms less per command, but leaves a mount on the host per open
trajectory, to undo at close and after a crash; three ``mount --bind`` execs instead of
one ``mount --all`` cost ~3 ms more.

What it does not make private: System V IPC and POSIX message queues (an IPC namespace
per command would also part one command's objects from the next's), ``/run/lock``,
abstract unix sockets and loopback ports (no network namespace). Those are still removed
at close (executor/backends/process/sweep.py). Where the namespace cannot be had (the
server is not root, or ``unshare``/``mount`` is missing) ``TMPDIR`` points at ``P/tmp``
instead: programs that honour it (Python's ``tempfile``, ``mktemp``, most) use the
sandbox's own; a fixed ``/tmp`` path is still shared, and a warning says so at start.

A fork copies ``P``'s three directories with the work directory (executor/backends/process/fork.py):
a copy sees the source's ``/tmp``. A close moves ``P`` aside at once (a reopened id starts
empty) and removes it once the trajectory's processes are gone.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

from executor.backends.process.cage import MOUNT_BIN, UNSHARE_BIN
from executor.backends.process.sweep import remove_tree

log = logging.getLogger("tangram.process")

#: the sandbox's directories in ``P`` and where its commands see them
PLACES = (("tmp", "/tmp"), ("var-tmp", "/var/tmp"), ("shm", "/dev/shm"))
#: what commands run from, kept visible in a private place that holds it: the server's
#: Python (its venv's prefix and the interpreter's own) and this checkout (its modules)
KEPT = tuple(Path(p) for p in dict.fromkeys(
    (sys.prefix, sys.base_prefix, str(Path(__file__).resolve().parents[3]))))
#: the area of the work root that holds every trajectory's ``P`` (a space: never the name
#: of a work directory, executor/backends/process/backend.py ``dir_name``)
AREA = " private"
#: a ``P`` moved aside by a close, until its removal
CLOSING = " closing "
FSTAB = "fstab"
STICKY_ALL = 0o1777


def _outermost(paths: list[Path]) -> list[Path]:
    """``paths`` resolved, less those inside another of them (mounted with it)."""
    out: list[Path] = []
    for p in sorted({q.resolve() for q in paths}, key=lambda q: len(q.parts)):
        if not any(p.is_relative_to(o) for o in out):
            out.append(p)
    return out


def _fstab_escape(path: str) -> str:
    """A path as an fstab field (its spaces, tabs, newlines and backslashes octal)."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


class Scratches:
    """Every trajectory's ``P`` under one work root."""

    def __init__(self, root: Path, users: bool, mounts: bool) -> None:
        """``users``: commands run as sandbox users (a root server); ``mounts``: their exec
        chain has a root part to make the namespace in (else ``TMPDIR`` only)."""
        self.root = root
        self.area = root / AREA
        self.area.mkdir(exist_ok=True)
        self.area.chmod(0o711 if users else 0o700)  # (each P: its own sandbox user only)
        #: private mounts per command: root, and the tools to make them
        self.mounts = users and mounts and UNSHARE_BIN is not None and MOUNT_BIN is not None
        if users and not self.mounts:
            log.warning("no `unshare`/`mount` here: sandboxes get a /tmp of their own through "
                        "TMPDIR only; a fixed /tmp path is shared by every sandbox")
        #: what a place holds that commands must still see, mounted back into it (see the
        #: docstring): (its place's name in ``P``, its path below the place, the path)
        self.kept: list[tuple[str, Path, Path]] = []
        for path in _outermost([root, *KEPT]):
            for name, place in PLACES:
                try:
                    below = path.relative_to(Path(place).resolve())
                except ValueError:
                    continue
                if not below.parts:
                    if self.mounts:
                        log.warning("%s is %s itself: sandboxes get a %s of their own through "
                                    "TMPDIR only", path, place, place)
                    self.mounts = False
                else:
                    self.kept.append((name, below, path))
                break
        for stale in self.area.glob(f"{CLOSING}*"):  # a server killed before it removed them
            remove_tree(stale)

    def path(self, name: str) -> Path:
        return self.area / name

    def make(self, name: str, uid: int | None) -> Path:
        """``P`` of the work directory ``name`` for ``uid``: made when missing; when there
        (a trajectory restored after a restart), its files are given to ``uid``."""
        p = self.path(name)
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:
            if uid is not None:
                self._give(p, uid)
        for sub, _ in PLACES:
            (p / sub).mkdir(exist_ok=True)
        self._fix(p, uid)
        return p

    def fstab(self, name: str) -> Path | None:
        """What a command's ``mount --all --fstab`` reads (None: no private mounts)."""
        return self.path(name) / FSTAB if self.mounts else None

    def env(self, name: str) -> dict[str, str]:
        """What a command's environment gets: ``TMPDIR`` where there are no mounts."""
        return {} if self.mounts else {"TMPDIR": str(self.path(name) / "tmp")}

    def _fix(self, p: Path, uid: int | None) -> None:
        """``P``'s own modes and owners (see the docstring), its skeleton and fstab."""
        if uid is not None:
            os.chown(p, 0, uid)
            p.chmod(0o710)
        for sub, _ in PLACES:
            d = p / sub
            if uid is not None:
                os.chown(d, 0, 0, follow_symlinks=False)
            d.chmod(STICKY_ALL if uid is not None else 0o700)
        if self.mounts:
            for sub, below, _ in self.kept:
                self._skeleton(p / sub, below)
        if self.mounts:
            self._write_fstab(p)

    @staticmethod
    def _skeleton(top: Path, below: Path) -> None:
        """Root-owned directories ``top/below`` (``top``: a sticky directory, so no sandbox
        can move or replace them); whatever else stands on that path is removed."""
        here = top
        for part in below.parts:
            here = here / part
            try:
                st = os.lstat(here)
                if stat.S_ISDIR(st.st_mode) and st.st_uid == 0:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    remove_tree(here)
                else:
                    here.unlink()
            except FileNotFoundError:
                pass
            here.mkdir(mode=0o755)
            os.chown(here, 0, 0)

    def _write_fstab(self, p: Path) -> None:
        """The mounts in their order: the places not holding the work root, then the work
        root into its skeleton and, last and recursively, the place that holds it."""
        lines = []
        last = []
        for sub, place in PLACES:
            src = _fstab_escape(str(p / sub))
            kept = [(below, path) for name, below, path in self.kept if name == sub]
            if kept:
                last += [f"{_fstab_escape(str(path))} {_fstab_escape(str(p / sub / below))} "
                         "none bind 0 0" for below, path in kept]
                last.append(f"{src} {place} none rbind 0 0")
            else:
                lines.append(f"{src} {place} none bind 0 0")
        tab = p / FSTAB
        tmp = p / f".{FSTAB}.{secrets.token_hex(4)}"
        tmp.write_text("\n".join(lines + last) + "\n")
        tmp.chmod(0o600)
        os.replace(tmp, tab)

    @staticmethod
    def _give(p: Path, uid: int) -> None:
        """Everything in ``P``'s places to ``uid`` (no link followed): a restored one."""
        subs = [str(p / sub) for sub, _ in PLACES if (p / sub).is_dir()]
        if not subs:
            return
        done = subprocess.run(["chown", "-R", "-P", "-h", f"{uid}:{uid}", "--", *subs],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise OSError(f"its /tmp cannot be given to its user id: {done.stderr[-200:]}")

    def sources(self, name: str) -> list[Path]:
        """What a fork copies of ``P`` (its places, as directories)."""
        return [self.path(name) / sub for sub, _ in PLACES]

    def settle(self, name: str, staged: Path, uid: int | None) -> None:
        """A fork's staged copy of the source's places (``staged/<place>``, already the
        copy's user's) becomes the copy's ``P`` (made empty by its open)."""
        p = self.make(name, uid)
        for sub, _ in PLACES:
            new = staged / sub
            if not new.is_dir():
                continue
            for name, below, _ in self.kept:
                # the source's skeleton, copied as its user: never the copy's (root's only)
                if name == sub and os.path.lexists(new / below.parts[0]):
                    remove_tree(new / below.parts[0])
            remove_tree(p / sub)
            os.rename(new, p / sub)
        self._fix(p, uid)

    def aside(self, name: str) -> Path | None:
        """At close: ``P`` renamed out of the way (a reopened id starts empty); the path to
        remove once the trajectory's processes are gone."""
        p = self.path(name)
        if not p.exists():
            return None
        gone = self.area / f"{CLOSING}{secrets.token_hex(8)}"
        p.rename(gone)
        return gone
