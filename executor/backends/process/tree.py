"""An action's whole process tree, ended at once on cancel and timeout (process backend).

A command can leave its process group (``setsid``) and its parent (``&`` in a subshell
that exits: the child is re-parented to init): neither a group kill nor a walk of its
children finds such a daemon. Seen: ``setsid sh -c 'while :; do :; done' &`` ran on
at 93% of a core after the action was cancelled, while the server counted the core free.

So, where the server can make one, each action runs in a cgroup (v2) of its own: the
command joins it in its exec chain before it runs (executor/backends/process/cage.py's
prefix), everything it starts is born there, and a sandbox user cannot move a process out
(that takes write access to ``cgroup.procs`` files owned by root). Ending the action is one
write to its ``cgroup.kill`` (Linux >= 5.14), and it is over once ``cgroup.events`` says
``populated 0``: then the backend reports the outcome, which frees the cores. Only the v2
hierarchy can do this; it needs no controller, so it works on a hybrid host too (v1
controllers, the v2 hierarchy at ``/sys/fs/cgroup/unified``: this kind of machine), where
the cgroup tells membership only.

Where there is none (not root, no cgroup v2, a kernel without ``cgroup.kill``, or a
server in a cgroup that may not have child cgroups with processes), the backend kills the
process group and every process carrying the action's environment mark
(executor/backends/process/marks.py), and waits until none is left. A process that
cleared its environment and left the group escapes that sweep; it dies with its
trajectory (its user id, as root).

Layout: ``<the server's v2 cgroup>/tangram-<pid>-<run mark>/a<n>``, one cgroup per running
action. Making and removing one costs ~0.9 ms of the event loop (measured here: mkdir 0.53
ms, rmdir 0.33 ms, against ~1.3 ms of server CPU per action in all), so a cgroup an action
left empty is used again by a later action (a read of ``cgroup.events``, ~0.09 ms): nothing
can enter an empty cgroup but by a write of root's. One a background child keeps (a daemon
the command left, allowed while the trajectory is open) stays its trajectory's, and is
killed and removed with it, after the trajectory's processes were killed.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tangram.process")

#: how long ending a tree waits for its processes to exit after SIGKILL (a killed process
#: exits when it is next scheduled; a loaded machine, or one in uninterruptible I/O, delays
#: that). Past it the outcome is reported anyway, with a warning naming what is left.
END_WAIT_S = 30.0
_POLL_S = 0.005


@dataclass(frozen=True)
class ActionGroup:
    """One action's cgroup (v2)."""

    path: Path

    @property
    def procs(self) -> Path:
        """What the command's exec chain writes itself into (``echo 0 >``)."""
        return self.path / "cgroup.procs"

    def kill(self) -> None:
        """SIGKILL every process in it, those it starts meanwhile too (the kernel's
        ``cgroup.kill``: no scan to race). Quick: it may run on the event loop."""
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError:  # removed meanwhile: nothing left to kill
            pass

    def populated(self) -> bool:
        try:
            return "populated 1" in (self.path / "cgroup.events").read_text()
        except OSError:
            return False

    def end(self, wait_s: float = END_WAIT_S) -> bool:
        """Kill it and wait until no process is left in it; False if some still were
        after ``wait_s`` (blocking: off the event loop)."""
        self.kill()
        deadline = time.monotonic() + wait_s
        while self.populated():
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def remove(self) -> bool:
        """Remove it if it is empty; False if a process still holds it."""
        try:
            self.path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False


#: empty cgroups kept for later actions (past it, one is removed when its action ends)
SPARE = 256


class ActionGroups:
    """The actions' cgroups of one backend (used on the event loop: not thread-safe)."""

    def __init__(self, top: Path) -> None:
        self.top = top
        self._names = itertools.count(1)
        self._spare: list[ActionGroup] = []
        #: trajectory -> the cgroups its finished actions' background children keep
        self._kept: dict[str, list[ActionGroup]] = {}

    @classmethod
    def here(cls, mark: str) -> ActionGroups | None:
        """Where this process may give actions cgroups it can kill (see the module's
        docstring), else None (the marked-process sweep then)."""
        if os.geteuid() != 0:
            return None
        own = own_v2_cgroup()
        if own is None:
            return None
        remove_stale(own)
        top = own / f"tangram-{os.getpid()}-{mark}"
        try:
            top.mkdir(exist_ok=True)
        except OSError as e:
            log.warning("no cgroup for each action (%s): cancel and timeout find an action's "
                        "processes by their environment mark instead", e)
            return None
        groups = cls(top)
        if not groups._joinable():
            groups.close()
            return None
        return groups

    def _joinable(self) -> bool:
        """Whether a child can move itself into one (e.g. a cgroup whose parent enabled
        controllers may hold no process): tried once, with a process started for it."""
        probe = ActionGroup(self.top / "probe")
        try:
            probe.path.mkdir()
            if not (probe.path / "cgroup.kill").exists():
                return False
            done = subprocess.run(["/bin/sh", "-c", 'echo 0 >"$1"', "probe", str(probe.procs)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("no cgroup for each action (%s): cancel and timeout find an action's "
                        "processes by their environment mark instead", e)
            return False
        finally:
            probe.remove()
        if done.returncode != 0:
            log.warning("no cgroup for each action (%s): cancel and timeout find an action's "
                        "processes by their environment mark instead", done.stderr.strip())
        return done.returncode == 0

    def take(self) -> ActionGroup:
        """An empty cgroup for an action (OSError if none can be made)."""
        if self._spare:
            return self._spare.pop()
        path = self.top / f"a{next(self._names)}"
        path.mkdir()
        return ActionGroup(path)

    def give(self, trajectory: str, group: ActionGroup) -> None:
        """``group``'s action ended: it serves a later action if it is empty, else it stays
        ``trajectory``'s until that closes (:meth:`forget`)."""
        if not group.populated() and len(self._spare) < SPARE:
            self._spare.append(group)
        elif group.populated() or not group.remove():
            self._kept.setdefault(trajectory, []).append(group)

    def forget(self, trajectory: str) -> list[ActionGroup]:
        """The cgroups ``trajectory``'s background children keep: to end and remove
        (:func:`remove`) once it closed."""
        return self._kept.pop(trajectory, [])

    def close(self) -> None:
        remove(self.top)


def remove_groups(groups: list[ActionGroup], wait_s: float = END_WAIT_S) -> None:
    """Kill what is left in ``groups`` (a closed trajectory's) and remove them (blocking:
    off the event loop)."""
    for group in groups:
        remove(group.path, wait_s)


def remove(folder: Path, wait_s: float = END_WAIT_S) -> None:
    """Kill what is left in ``folder`` (a cgroup, or a whole backend's folder) and remove
    it with the cgroups below it (blocking: off the event loop)."""
    if not folder.is_dir():
        return
    group = ActionGroup(folder)
    if not group.end(wait_s):
        log.warning("cgroup %s: processes still there %g s after SIGKILL", folder, wait_s)
    for dirpath, _, _ in sorted(os.walk(folder), key=lambda w: -len(w[0])):
        if not ActionGroup(Path(dirpath)).remove():
            log.warning("cgroup %s not removed", dirpath)


def remove_stale(own: Path) -> None:
    """The cgroups of servers that died without removing them (their pid is gone)."""
    for d in own.glob("tangram-*-*"):
        pid = d.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            remove(d, wait_s=5.0)


def own_v2_cgroup() -> Path | None:
    """This process's cgroup in the v2 hierarchy (``0::<path>`` of /proc/self/cgroup) as
    a directory of the mounted hierarchy, None where none is mounted or writable."""
    try:
        rel = next((line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), None)
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    if rel is None:
        return None
    for m in mounts:
        pre, _, post = m.partition(" - ")
        fields, fs = pre.split(), post.split()
        if fs[:1] != ["cgroup2"] or "rw" not in fields[5].split(","):
            continue
        root, mount = fields[3], fields[4]
        if rel != root and not rel.startswith(root.rstrip("/") + "/"):
            continue  # mounted from another namespace's view: not ours
        path = Path(mount) / os.path.relpath(rel, root)
        if path.is_dir() and os.access(path, os.W_OK):
            return path.resolve()
    return None
