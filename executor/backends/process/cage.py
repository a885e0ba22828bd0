"""A memory limit for each trajectory's commands on the process backend.

Without one, a trajectory's commands could use all of the machine's memory: the kernel's
OOM killer would then pick by size alone, the server or another job of the machine
included. So every command joins, before it runs, a memory cgroup of its trajectory whose
limit is the trajectory's declared ``mem_gb`` (else the sandbox default), and raises its
own ``oom_score_adj`` to :data:`OOM_SCORE_ADJ`: past its limit the kernel kills inside
the trajectory only, and when the whole machine is short the kernel picks the sandboxes'
processes before the server and before anything else on the machine.

How a command joins: its exec chain starts with ``sh -c`` (:func:`prefix`), which, still
as root, writes itself into the cgroup and its ``oom_score_adj`` and then execs the rest
(``setpriv`` dropping to the sandbox user, then the command). Where the trajectory has
private mounts (its own ``/tmp``: executor/backends/process/scratch.py), the chain starts with
``unshare --mount --propagation private`` and the script mounts them (``mount --all
--fstab``) before the exec. Everything the command
starts inherits both, from its first instruction on: nothing it forks escapes, which a
move by the server after the start could not promise. It costs the child ~0.5 ms of CPU
per start (one ``dash`` exec; measured 2026-12-02 on this kind of machine).

Where: under the server's own memory cgroup (cgroup v1's memory hierarchy, where a root
server may make children of its own cgroup: this kind of machine), in a folder of this
run, one child per trajectory. cgroup v2 would need the server to move itself into a leaf
first (no process may sit in a cgroup whose children have controllers); it does not, and
there, as for a server that is not root, each process is limited by ``RLIMIT_DATA`` instead
(per process, and of its private writable mappings - heap, anonymous maps, stacks - rather
than of the memory it touches: a weaker bound, but a bound; not ``RLIMIT_AS``, which counts
address space merely reserved, and stops a JVM or a many-threaded program from starting).

The kernel counts each OOM kill in the victim's own cgroup, whichever limit was passed
(the trajectory's, an enclosing container's, or the machine's): :meth:`Cage.oom_kills`
read before and after an action tells the backend it ended ``oom``. The count is raised
before the kill's SIGKILL is sent (mm/oom_kill.c: "Raise event before sending signal: task
reaper must see this"), so a read once the command was reaped sees it: no wait needed. A
shed (:meth:`MemoryLimits.shed`) is counted the same way, before its SIGKILL, and compared
the same way: by count, not by the wall clock, which may step back between an action's
start and the shed (NTP, a VM restored from a snapshot) and made the shed's kill an ``ok``.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from executor.node import cgroups

log = logging.getLogger("tangram.process")

#: the OOM killer's preference for sandbox processes (1000: first, whatever their size)
OOM_SCORE_ADJ = 1000
#: the exec prefix: join the action's own cgroup ($1, its cgroup.procs, or /dev/null where
#: it has none: executor/backends/process/tree.py) and the memory cgroup ($2), take the OOM
#: preference ($3), then run the rest (a failed write stops here: no command runs unconfined)
_JOIN = ('echo 0 >"$1" && echo 0 >"$2" && echo "$3" >/proc/self/oom_score_adj && shift 3 '
         '&& exec "$@"')
#: without a memory cgroup: the action's cgroup ($1), a data limit ($2, KiB: RLIMIT_DATA)
#: and the OOM preference ($3)
_RLIMIT = ('echo 0 >"$1" && echo "$3" >/proc/self/oom_score_adj && ulimit -d "$2" '
           '&& shift 3 && exec "$@"')
#: the same two, then the trajectory's private mounts ($4: its fstab) in the namespace the
#: chain's ``unshare`` made (executor/backends/process/scratch.py); ``-n``: no /etc/mtab written
#: (absolute paths, found on the server's PATH: the script runs as root with the command's
#: environment, whose PATH is the caller's to choose)
MOUNT_BIN = shutil.which("mount")
UNSHARE_BIN = shutil.which("unshare")
_MOUNTS = (f' && {shlex.quote(MOUNT_BIN or "/bin/mount")} -n --all --fstab "$4" && shift 4 '
           '&& exec "$@"')
_JOIN_NS = _JOIN.replace(' && shift 3 && exec "$@"', _MOUNTS)
_RLIMIT_NS = _RLIMIT.replace(' && shift 3 && exec "$@"', _MOUNTS)
SH = "/bin/sh"
#: a mount namespace of the command's own, nothing in it propagated to the host
UNSHARE = [UNSHARE_BIN or "/usr/bin/unshare", "--mount", "--propagation", "private", "--"]


@dataclass(frozen=True)
class Cage:
    """One trajectory's memory cgroup (cgroup v1)."""

    path: Path
    limit_bytes: int

    def oom_kills(self) -> int:
        """Processes of this cgroup the kernel killed for memory so far (-1: unknown)."""
        try:
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return -1

    def used_bytes(self) -> int:
        """What it holds that only a kill frees (its working set; 0 where unreadable)."""
        return cgroups.working_set(self.path) or 0


def prefix(cage: Cage | None, limit_bytes: int, action: Path | None = None,
           fstab: Path | None = None) -> list[str]:
    """The exec chain's start that confines a command: into ``cage``, else under an
    data limit (``RLIMIT_DATA``) of ``limit_bytes``; either way with :data:`OOM_SCORE_ADJ`,
    and first into the action's own cgroup (``action``: its ``cgroup.procs``) when it has
    one (one ``dash`` exec for both); with ``fstab``, in a mount namespace of its own
    where ``fstab``'s mounts are made (one ``unshare`` and one ``mount`` exec more)."""
    own = str(action) if action is not None else os.devnull
    ns = [] if fstab is None else [str(fstab)]
    start = [] if fstab is None else UNSHARE
    if cage is not None:
        return [*start, SH, "-c", _JOIN if fstab is None else _JOIN_NS, "tangram-cage", own,
                str(cage.path / "cgroup.procs"), str(OOM_SCORE_ADJ), *ns]
    return [*start, SH, "-c", _RLIMIT if fstab is None else _RLIMIT_NS, "tangram-cage", own,
            str(max(limit_bytes // 1024, 1)), str(OOM_SCORE_ADJ), *ns]


class Cages:
    """The trajectories' cgroups of one backend: ``<own cgroup>/tangram-<pid>-<mark>/<n>``."""

    def __init__(self, top: Path) -> None:
        self.top = top

    @classmethod
    def here(cls, mark: str) -> Cages | None:
        """Where this process may make memory cgroups (root, cgroup v1), else None."""
        if os.geteuid() != 0:
            return None
        own = cgroups.own_memory_cgroup()
        if own is None:
            return None
        _remove_stale(own)
        top = own / f"tangram-{os.getpid()}-{mark}"
        try:
            top.mkdir(exist_ok=True)
        except OSError as e:
            log.warning("no memory cgroup for sandboxes (%s): a data limit per process "
                        "instead", e)
            return None
        return cls(top)

    def make(self, name: str, limit_bytes: int) -> Cage:
        """A new cgroup ``name`` limited to ``limit_bytes`` (OSError if it cannot be)."""
        path = self.top / name
        path.mkdir(exist_ok=True)
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        return Cage(path, limit_bytes)

    @staticmethod
    def remove(cage: Cage) -> None:
        """Remove ``cage`` once its processes are gone (its charges go to the parent)."""
        try:
            cage.path.rmdir()
        except OSError as e:
            log.warning("memory cgroup %s not removed: %s", cage.path, e)

    def close(self) -> None:
        for child in self.top.iterdir() if self.top.is_dir() else ():
            if child.is_dir():
                try:
                    child.rmdir()
                except OSError:
                    pass
        try:
            self.top.rmdir()
        except OSError:
            pass


def _remove_stale(own: Path) -> None:
    """The cgroups of servers that died without removing them (their pid is gone)."""
    for d in own.glob("tangram-*-*"):
        pid = d.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            Cages(d).close()


@dataclass(frozen=True)
class Before:
    """A trajectory's memory kills so far, read as an action's command starts: what
    :meth:`MemoryLimits.ended_for_memory` compares the action's end with."""

    #: OOM kills the kernel counted in its cgroup (-1: it has none, or it was unreadable)
    kills: int
    #: times it was shed (:meth:`MemoryLimits.shed`)
    sheds: int


class MemoryLimits:
    """The process backend's memory bounds, per trajectory: its cgroup (or its limit for
    ``RLIMIT_DATA``), what its actions' exec chains start with, and whether an action
    ended for memory (a kernel OOM kill counted in its cgroup, or a :meth:`shed`)."""

    def __init__(self, run_mark: str, default_gb: float) -> None:
        self.default_gb = default_gb
        self.cages = Cages.here(run_mark)
        self._limit: dict[str, int] = {}
        self._cage: dict[str, Cage] = {}
        #: trajectory -> (how many times it was shed, why the last time): an action that
        #: saw fewer when its command started was running when one came, and ends ``oom``
        self._shed: dict[str, tuple[int, str]] = {}
        self._names = 0

    def open(self, trajectory: str, mem_gb: float | None) -> None:
        gb = mem_gb if mem_gb else self.default_gb
        self._limit[trajectory] = int(gb * 1024**3)
        if self.cages is not None and trajectory not in self._cage:
            self._names += 1
            try:
                self._cage[trajectory] = self.cages.make(f"t{self._names}",
                                                         self._limit[trajectory])
            except OSError as e:  # e.g. a limit below what the cgroup holds already
                log.warning("trajectory %r: no memory cgroup (%s): a data limit per "
                            "process instead", trajectory, e)

    def limit_bytes(self, trajectory: str) -> int:
        if trajectory not in self._limit:  # (an action before its open: a backend's tool)
            self.open(trajectory, None)
        return self._limit[trajectory]

    def prefix(self, trajectory: str, action: Path | None = None,
               fstab: Path | None = None) -> list[str]:
        """What the trajectory's commands' exec chain starts with (as root, before the
        user is dropped: :func:`prefix`); ``action``: the action's own ``cgroup.procs``;
        ``fstab``: its private mounts."""
        return prefix(self._cage.get(trajectory), self.limit_bytes(trajectory), action, fstab)

    def join(self, trajectory: str, action: Path | None = None) -> None:
        """In a child before its exec, still as root (the start through a preexec_fn):
        what :meth:`prefix` does by an exec."""
        import resource

        if action is not None:
            action.write_text("0")
        cage = self._cage.get(trajectory)
        if cage is not None:
            (cage.path / "cgroup.procs").write_text("0")
        else:
            limit = self.limit_bytes(trajectory)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        Path("/proc/self/oom_score_adj").write_text(str(OOM_SCORE_ADJ))

    def before(self, trajectory: str) -> Before:
        """What an action's end is compared with: read before its command starts."""
        cage = self._cage.get(trajectory)
        sheds = self._shed.get(trajectory, (0, ""))[0]
        return Before(cage.oom_kills() if cage is not None else -1, sheds)

    def ended_for_memory(self, trajectory: str, before: Before) -> str:
        """Why an action of ``trajectory`` ended for memory ("": it did not), ``before``
        read as its command started; asked once its command was reaped."""
        sheds, why = self._shed.get(trajectory, (0, ""))
        if sheds > before.sheds:
            return why
        cage = self._cage.get(trajectory)
        if cage is not None and before.kills >= 0 and cage.oom_kills() > before.kills:
            return (f"out of memory: the kernel killed a process of the command (the "
                    f"trajectory's limit is {cage.limit_bytes / 1024**3:g} GB, its mem_gb; "
                    "or the machine ran short and its commands were the first to go)")
        return ""

    def unknown_kill(self, trajectory: str, before: Before) -> str:
        """For a command of ``trajectory`` that died by SIGKILL when no shed and no OOM kill
        counted explains it: what its memory count tells of who killed it."""
        cage = self._cage.get(trajectory)
        if cage is None:
            return ("its trajectory has no memory cgroup to count a kernel OOM kill in (a "
                    "data limit per process instead): the kernel's OOM killer, a process "
                    "(its own or another), or an OOM killer outside the kernel killed it")
        if before.kills < 0 or cage.oom_kills() < 0:
            return (f"its memory cgroup's OOM kill count ({cage.path}/memory.oom_control) "
                    "could not be read: the kernel's OOM killer, a process (its own or "
                    "another), or an OOM killer outside the kernel killed it")
        return ("its memory cgroup counted no OOM kill: a process (its own or another), or "
                "an OOM killer outside the kernel (a supervisor's), killed it")

    def used_bytes(self, trajectory: str) -> int | None:
        """What the trajectory's cgroup holds (None: it has none)."""
        cage = self._cage.get(trajectory)
        return cage.used_bytes() if cage is not None else None

    def shed(self, trajectory: str, why: str) -> None:
        """``trajectory`` is being shed: counted here before its commands are killed, so
        that every action running then ends ``oom`` with ``why``, however soon it is
        reaped."""
        self._shed[trajectory] = (self._shed.get(trajectory, (0, ""))[0] + 1, why)

    def close(self, trajectory: str) -> Cage | None:
        """Forget ``trajectory``; its cgroup, to remove once its processes are gone."""
        self._limit.pop(trajectory, None)
        self._shed.pop(trajectory, None)
        return self._cage.pop(trajectory, None)

    def shutdown(self) -> None:
        if self.cages is not None:
            self.cages.close()
