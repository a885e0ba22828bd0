"""Process backend (the embedded default): a working directory per trajectory,
each action a subprocess pinned to exactly its granted cores.

This is not isolation (see docs/serve.md). What it does guarantee: a command sees
none of the server's ``TANGRAM_*`` variables (nor other names that look like
secrets), runs in its own process group, and every process it started - even one
that left the group with ``setsid`` - is killed when the action is cancelled or times
out (its own cgroup's ``cgroup.kill``, else its environment mark:
executor/backends/process/tree.py; its outcome, which frees its cores, is reported only
once they are gone) and when the trajectory closes. An action ends when its command exits: a background
child still holding the output pipe 0.5 s later is killed and the pipe dropped,
so it never holds the action's cores. When the server runs as root, each
trajectory's commands run under a user id of their own (executor/backends/process/uids.py):
they cannot read the server's environment nor signal it, and are found by that id.
Output is read as it comes and only its last ``MAX_OUTPUT`` bytes are kept, so a
command printing gigabytes costs the server 1 MiB.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import BinaryIO, cast
from urllib.parse import quote

from executor.backends.process import marks, spawner
from executor.backends.process.cage import Before, Cages, MemoryLimits
from executor.backends.process.fork import Freezes, run_fork
from executor.backends.process.reaper import Leftovers, Reaper, clean
from executor.backends.process.scratch import AREA, Scratches
from executor.backends.process.sweep import remove_tree, sweep
from executor.backends.process.tree import END_WAIT_S, ActionGroup, ActionGroups, remove_groups
from executor.backends.process.uids import (
    BLOCK,
    UidBlock,
    dropping,
    kill_uids,
    no_new_privileges,
    pids_of_uids,
    unreachable,
)
from executor.commands import EXCLUSIVE_NICE, CommandError, argv_of, elastic_argv
from executor.files import MAX_FILE_BYTES, read_file, write_file
from executor.node.local import allowed_cpus
from executor.node.memwatch import largest_sandbox
from tangram.fork import FORK
from tangram.model import Dispatch, Outcome
from tangram.protocol import Moved, Resized, Shed

log = logging.getLogger("tangram.process")

MAX_OUTPUT = 1 << 20  # keep at most the last 1 MiB of an action's output
#: environment variables a command never inherits from the server
SECRET_NAME = re.compile(r"^TANGRAM_|TOKEN|SECRET|PASS|PRIVATE|CREDENTIAL|AUTH|COOKIE|SESSION"
                         r"|(^|_)(API_?|ACCESS_?)?KEY(_|$)|APIKEY", re.IGNORECASE)
#: how long a background child may keep the output pipe after the command exited
PIPE_GRACE_S = 0.5
#: a light-lane action the core moved off the lane while no core was free runs at the
#: lowest priority (``move``): the lane's nice 0 is for actions expected to take a
#: fraction of a second, not for one whose declaration (or guess) was wrong
DEMOTED_NICE = 19
#: seconds shutdown waits for closed trajectories' cleanup (then it kills what is left)
REAPER_DRAIN_S = 60.0
#: set in every command's environment; how its processes are found again to be killed
MARK = "TANGRAM_SANDBOX"


def dir_name(trajectory: str) -> str:
    """The directory of a trajectory: one-to-one, never ``.``/``..``, never a ``/``.

    Ids of the documented pattern (letters, digits, ``-_.:``) are used as they are;
    anything else is percent-encoded (``%`` is not in the pattern, so no two ids share
    a name), and a name too long for the file system gets a hash suffix.
    """
    name = quote(trajectory, safe="-_.:") if trajectory not in (".", "..") else \
        trajectory.replace(".", "%2E")
    if not name:
        name = "%00empty"
    if len(name) > 200:
        import hashlib

        name = name[:120] + "%" + hashlib.sha256(trajectory.encode()).hexdigest()
    return name


def outcome_of(d: Dispatch, code: int | None, output: bytes, timed_out: bool, timeout: float,
               extra: Mapping, overhead_s: float = 0.0) -> Outcome:
    text = output[-MAX_OUTPUT:].decode(errors="replace")
    if timed_out:
        return Outcome(d.action.id, "timeout", code, text,
                       f"killed after the {timeout:g} s timeout", overhead_s, extra)
    return Outcome(d.action.id, "ok", code, text, "", overhead_s, extra)


async def read_tail(stream: asyncio.StreamReader, limit: int = MAX_OUTPUT) -> bytes:
    """Everything ``stream`` gives until EOF, keeping only the last ``limit`` bytes."""
    buf = bytearray()
    while True:
        chunk = await stream.read(1 << 16)
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > 2 * limit:  # trim rarely: amortised O(1) per byte
            del buf[:-limit]


def scrubbed_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not SECRET_NAME.search(k)}


def kill_marked(value_prefix: str) -> int:
    """SIGKILL every process this backend marked ``MARK=<value_prefix>...``."""
    return marks.kill_marked(MARK, value_prefix)


def use_pidfd_watcher() -> None:
    """Python 3.11 waits for each child in a thread of its own (a thread start per
    action); a pidfd watcher waits on the event loop instead. 3.12+ does this itself."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
        loop = asyncio.get_running_loop()
    except (OSError, RuntimeError):
        return
    if not isinstance(loop, asyncio.BaseEventLoop):
        return  # uvloop (`serve`, Ray's async actors when it is installed) waits itself
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        watcher = asyncio.PidfdChildWatcher()
        watcher.attach_loop(loop)
        try:
            asyncio.set_child_watcher(watcher)
        except NotImplementedError:  # a policy without child watchers (uvloop's)
            watcher.close()


class _Watched(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's protocol, plus a future set when the process itself exits.

    ``Process.wait()`` returns only once every pipe is closed too, so a background
    child holding stdout (``sleep 25 &``) would hold the action - and its cores - for
    as long as it lives."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=1 << 16, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()
        self._process: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # (uvloop's transport has the calls, not the asyncio class)
        self._process = cast(asyncio.SubprocessTransport, transport)

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)

    # the same two calls as executor/backends/process/spawner.py's SpawnedProcess: what _drain needs
    def drop_output(self) -> None:
        """Read no more of the output pipe (its reader gets the end)."""
        pipe = self._process.get_pipe_transport(1) if self._process else None
        if pipe is not None:
            pipe.close()

    def close(self) -> None:
        if self._process is not None:
            self._process.close()


class ProcessBackend:
    name = "process"

    def __init__(self, root: str | Path, cpu_map: list[int] | None = None,
                 env: Mapping[str, str] | None = None, keep_workdirs: bool = False,
                 run_mark: str | None = None, default_mem_gb: float = 2.0,
                 disk_gb: float | None = None, uids: int = BLOCK) -> None:
        """``default_mem_gb``: the memory limit of a trajectory that declares none;
        ``disk_gb``: the most a fork's copy may hold (executor/backends/process/fork.py; the
        backend bounds no sandbox's writes otherwise), None: no bound; ``uids``: as root,
        how many user ids of its block it hands out (executor/backends/process/uids.py)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.root = self.root.resolve()
        self.cpu_map = cpu_map or allowed_cpus()
        self.env = scrubbed_env(env if env is not None else os.environ)
        self.keep_workdirs = keep_workdirs
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        #: running action -> the mark its processes carry (a move finds them by it)
        self._action_marks: dict[str, str] = {}
        #: actions being started: a move that comes first waits here for the process
        self._starting: dict[str, Moved | Resized | None] = {}
        #: actions cancelled while their process was being started: killed once it exists
        self._cancelled_starting: set[str] = set()
        #: running actions a cancel reached: their whole tree is ended before their outcome
        self._cancelled: set[str] = set()
        #: shutdown killed what still ran: those commands end failed, saying so (_killed)
        self._shutting_down = False
        #: running action -> its own cgroup (executor/backends/process/tree.py)
        self._groups: dict[str, ActionGroup] = {}
        self._tasks: set[asyncio.Task] = set()
        #: fork actions running -> their task: a cancel cancels it, once (run_fork undoes
        #: what it made; a second cancel would cut that short)
        self._fork_tasks: dict[str, asyncio.Task] = {}
        #: trajectory -> the random mark its processes carry (this run only)
        self._marks: dict[str, str] = {}
        #: set after the scrub, so it is never scrubbed: a Ray agent passes its marker here
        #: and its guard kills ``MARK=<run_mark>.*`` (executor/backends/ray/guard.py)
        self._run_mark = run_mark or secrets.token_hex(6)
        self._reaper = Reaper(MARK, self.root)
        #: each trajectory's memory limit and OOM preference (executor/backends/process/cage.py)
        self._memory = MemoryLimits(self._run_mark, default_mem_gb)
        self.disk_gb = disk_gb
        self.fork_bytes = 0  # (executor/backends/process/fork.py)
        #: a cgroup per action where the server can make one (None: the marked sweep)
        self._trees = ActionGroups.here(self._run_mark)
        #: as root: trajectory -> the user id its commands run under
        self._uids = UidBlock(size=uids) if dropping() else None
        self._uid_of: dict[str, int] = {}
        #: trajectory -> its work directory (checked once, dropped at its close)
        self._dirs: dict[str, Path] = {}
        #: sources being forked: their processes stopped meanwhile (executor/backends/process/fork.py)
        self.freezes = Freezes()
        if self._uids is not None:
            self._sweep_block()
            self.root.chmod(0o711)  # sandboxes may enter their own directory, not list others
            for path in (sys.executable, self.root):
                blocked = unreachable(path)
                if blocked:
                    log.warning("commands run as sandbox users, who cannot pass through %s "
                                "to reach %s (no o+x): programs commands run, and the work "
                                "root, must be reachable by other users",
                                ", ".join(map(str, blocked)), path)
        #: each trajectory's own /tmp, /var/tmp, /dev/shm (executor/backends/process/scratch.py):
        #: mounted by the exec chain's root part, so only on the path that has one
        self._scratch = Scratches(self.root, self._uids is not None,
                                  spawner.usable() and spawner.as_user(0) is not None)
        self._scratched: set[str] = set()
        use_pidfd_watcher()

    def _sweep_block(self) -> None:
        """What an earlier holder of this block of ids left (a server killed, not shut
        down): its sandboxes' processes and files are no trajectory's to come."""
        first, last = self.uid_range  # type: ignore[misc]
        kill_uids(first, last)
        # (not the work root: what is kept there is the restored trajectories', given to
        # their new ids when they are opened again, and the rest goes in ``retain``)
        sweep(range(first, last + 1))

    @property
    def uid_range(self) -> tuple[int, int] | None:
        """The sandbox user ids this backend hands out (None: commands run as the server)."""
        return None if self._uids is None else (self._uids.first,
                                                self._uids.first + BLOCK - 1)

    @property
    def uid_lock(self) -> int | None:
        """The descriptor whose ``flock`` holds the uid block (a guard inherits it)."""
        return None if self._uids is None else self._uids.fd

    def workdir(self, trajectory: str) -> Path:
        path = self._dirs.get(trajectory)
        if path is None:
            path = self.root / dir_name(trajectory)
            # the name cannot escape by construction; this check keeps it that way (once
            # per trajectory: resolving is a system call per path component, per action)
            if path.resolve().parent != self.root:
                raise ValueError(f"trajectory: {trajectory!r} maps outside the work root")
            self._dirs[trajectory] = path
        try:  # (again each time: a command may have removed its directory)
            path.mkdir()
        except FileExistsError:
            return path
        uid = self._uid(trajectory)
        if uid is not None:
            os.chown(path, uid, uid)
            path.chmod(0o700)
        return path

    def _private(self, trajectory: str) -> str:
        """The name of ``trajectory``'s own /tmp directories, made on its first use."""
        name = dir_name(trajectory)
        if trajectory not in self._scratched:
            self._scratch.make(name, self._uid(trajectory))
            self._scratched.add(trajectory)
        return name

    def _uid(self, trajectory: str) -> int | None:
        if self._uids is None:
            return None
        if trajectory not in self._uid_of:
            self._uid_of[trajectory] = self._uids.take()
        return self._uid_of[trajectory]

    def _mark(self, trajectory: str) -> str:
        if trajectory not in self._marks:
            self._marks[trajectory] = f"{self._run_mark}.{secrets.token_hex(6)}"
        return self._marks[trajectory]

    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        aid = d.action.id
        # starting from now: a move or a cancel that comes before its process exists is
        # kept and carried out once it does (_run)
        if d.action.kind != FORK:  # (a fork has no process: it is cancelled as a task)
            self._starting[aid] = None
        task = asyncio.get_running_loop().create_task(self._guarded(d, on_done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if d.action.kind == FORK:
            self._fork_tasks[aid] = task
            task.add_done_callback(lambda _: self._fork_tasks.pop(aid, None))

    def fork(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        """Forking (tangram.protocol): a fork dispatch, run as any dispatch is (``_guarded``
        hands kind ``fork`` to run_fork)."""
        self.start(d, on_done)

    async def _guarded(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        """Whatever fails, the action ends with a status (its lease is released then)."""
        try:
            if d.action.kind == FORK:  # a copy of the sandbox (tangram/fork.py), no command
                await run_fork(self, d, on_done)
            else:
                await self._run(d, on_done)
        except asyncio.CancelledError:
            on_done(Outcome(d.action.id, "cancelled", None, error="cancelled"))
            raise
        except Exception as e:  # noqa: BLE001 - any failure must end the action
            on_done(Outcome(d.action.id, "failed", None,
                            error=f"process backend: {type(e).__name__}: {e}"))
        finally:  # (a fork, or a command refused before its start, leaves them here)
            self._starting.pop(d.action.id, None)
            self._cancelled_starting.discard(d.action.id)

    def _command_env(self, d: Dispatch, cores: set[int], mark: str, home: Path,
                     uid: int | None) -> dict[str, str]:
        payload = d.action.payload or {}
        env = {**self.env, **{k: str(v) for k, v in (payload.get("env") or {}).items()
                              if not k.startswith("TANGRAM_")}}
        if uid is not None:  # the server's HOME is not the sandbox user's to use
            env.update(HOME=str(home), USER=f"sandbox{uid}", LOGNAME=f"sandbox{uid}")
        env["TANGRAM_CORES"] = ",".join(map(str, sorted(cores)))
        # the workers to start (``pytest -n $TANGRAM_WORKERS``): a malleable action's is the
        # widest it may grow to, so it uses the cores its grant grows onto
        env["TANGRAM_WORKERS"] = str(d.worker_count)
        env[MARK] = mark
        return env

    async def _spawn(self, argv: list[str], d: Dispatch, cores: set[int], cwd: Path,
                     env: dict[str, str], uid: int | None, group: ActionGroup | None
                     ) -> tuple[asyncio.subprocess.Process | spawner.SpawnedProcess,
                                _Watched | spawner.SpawnedProcess]:
        """Start ``argv`` pinned to ``cores``, in a session of its own, as ``uid``, in the
        action's own cgroup ``group`` (when it has one) from before its first instruction."""
        nice = 0 if d.lease.lane else EXCLUSIVE_NICE
        drop = [] if uid is None else spawner.as_user(uid)
        procs = group.procs if group is not None else None
        confine = self._memory.prefix(d.action.trajectory, procs,
                                      self._scratch.fstab(dir_name(d.action.trajectory)))
        if drop is not None and spawner.usable():
            # pinned and niced by the starting thread, the user become by an exec: the
            # cheap start (executor/backends/process/spawner.py), whose process is also its own watch
            # (``exited``: the process, not its pipes)
            proc = await spawner.create_subprocess_exec(
                *confine, *drop, *argv, cores=cores, nice=nice, cwd=cwd, env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True)
            return proc, proc

        # no pidfd or no setpriv: pinned, niced and the user become in the child before its
        # exec (a preexec_fn forces a full fork: slower, but this is the fallback; not
        # ``user=``/``group=``, which uvloop's subprocess_exec does not take)
        def prepare() -> None:
            spawner.place(cores, nice)
            self._memory.join(d.action.trajectory, procs)
            if uid is not None:  # no supplementary group of the server's either
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                no_new_privileges()  # a setuid file left anywhere runs as its caller

        loop = asyncio.get_running_loop()
        transport, protocol = await loop.subprocess_exec(
            lambda: _Watched(loop), *argv, cwd=cwd, env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=prepare)
        return asyncio.subprocess.Process(transport, protocol, loop), protocol

    async def _run(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        t_start = time.time()
        payload = d.action.payload or {}
        try:
            argv = elastic_argv(argv_of(payload), d.worker_count, d.action.elastic == "cpu")
        except CommandError as e:
            on_done(Outcome(d.action.id, "failed", None, error=str(e)))
            return
        cores = {self.cpu_map[c] for c in d.lease.cores} or set(self.cpu_map)
        timeout = float(payload.get("timeout_s") or 0) or None
        mark = f"{self._mark(d.action.trajectory)}.{secrets.token_hex(4)}"
        cwd = self.workdir(d.action.trajectory)
        uid = self._uid(d.action.trajectory)
        env = self._command_env(d, cores, mark, cwd, uid)
        env.update(self._scratch.env(self._private(d.action.trajectory)))
        before = self._memory.before(d.action.trajectory)
        aid = d.action.id
        group = self._action_group(d.action.trajectory)
        try:
            proc, watched = await self._spawn(argv, d, cores, cwd, env, uid, group)
        except (OSError, ValueError, subprocess.SubprocessError) as e:  # ValueError: NUL in an arg
            if group is not None:
                self._trees.give(d.action.trajectory, group)  # type: ignore[union-attr]
            on_done(Outcome(aid, "failed", None, error=f"cannot start {argv[0]!r}: {e}"))
            return
        finally:
            early = self._starting.pop(aid, None)
            cancelled = aid in self._cancelled_starting
            self._cancelled_starting.discard(aid)
        t_spawned = time.time()
        self._procs[aid] = proc
        self._action_marks[aid] = mark
        if group is not None:
            self._groups[aid] = group
        if early is not None:  # moved off the lane or resized before its process existed
            self._place(early)
        if cancelled:  # cancelled before its process existed
            self._cancelled.add(aid)
            self._kill_now(proc, group)
        assert proc.stdout is not None
        reader = asyncio.ensure_future(read_tail(proc.stdout))
        try:
            timed_out = await self._wait_exit(proc, watched, timeout, group)
            # cancelled or timed out: the whole tree ends before the outcome frees the
            # cores (a daemon it left would run on, uncounted, until the trajectory closed)
            stop = timed_out or aid in self._cancelled
            output = await self._drain(proc, watched, reader, mark, group, stop)
            if aid in self._cancelled and not stop:  # a cancel during the drain
                await asyncio.to_thread(self._end_tree, proc, mark, group)
            was_cancelled = aid in self._cancelled
        finally:
            self._procs.pop(aid, None)
            self._action_marks.pop(aid, None)
            self._groups.pop(aid, None)
            self._cancelled.discard(aid)
        if group is not None:  # for a later action, unless a background child keeps it
            self._trees.give(d.action.trajectory, group)  # type: ignore[union-attr]
        t_exited = time.time()
        extra = {"argv": argv, "cores": sorted(cores), "spawn_s": t_spawned - t_start,
                 "t_spawned": t_spawned, "t_exited": t_exited}
        # (read now that the command was reaped: a shed and the kernel both count a memory
        # kill before they send its SIGKILL, executor/backends/process/cage.py)
        oom = self._memory.ended_for_memory(d.action.trajectory, before)
        if oom:
            on_done(Outcome(d.action.id, "oom", proc.returncode,
                            output[-MAX_OUTPUT:].decode(errors="replace"), oom,
                            t_spawned - t_start, extra))
            return
        killed = self._killed(d, proc.returncode, timed_out, was_cancelled, before)
        if killed is not None:
            status, error = killed
            on_done(Outcome(d.action.id, status, proc.returncode,
                            output[-MAX_OUTPUT:].decode(errors="replace"), error,
                            t_spawned - t_start, extra))
            return
        on_done(outcome_of(d, proc.returncode, output, timed_out, timeout or 0, extra,
                           overhead_s=t_spawned - t_start))

    def _killed(self, d: Dispatch, code: int | None, timed_out: bool, cancelled: bool,
                before: Before) -> tuple[str, str] | None:
        """The status and error of a command killed by a signal this backend sent (a
        cancel, its shutdown) or by a SIGKILL nothing here explains; None for a command
        that ended on its own, or by its timeout (:func:`outcome_of`) - a memory kill was
        told apart before (``oom``).

        A SIGKILL is not an end to report ``ok``: no command can catch it, and the
        kernel's OOM killer, a shed, a timeout and a cancel all end a command with it. One
        that none of ours explains - another process, an OOM killer outside the
        kernel's count, a kernel kill in a trajectory without a memory cgroup - fails,
        naming the signal, rather than passing for a command that ran to its end."""
        if code is None or code >= 0 or timed_out:
            return None
        if cancelled:
            return "cancelled", "cancelled"
        if self._shutting_down:  # (as the server records what its shutdown cut short)
            return "failed", "the process backend shut down before this command finished"
        if code != -signal.SIGKILL:
            return None  # the command's own crash (SIGSEGV, SIGABRT...): its exit code says so
        return "failed", ("killed by signal 9 (SIGKILL), not by tangram (no timeout, cancel "
                          "or memory shed of its sandbox); "
                          + self._memory.unknown_kill(d.action.trajectory, before))

    def _action_group(self, trajectory: str) -> ActionGroup | None:
        """A cgroup for an action of ``trajectory``; None where there are none, or this one
        cannot be made (e.g. the hierarchy's ``cgroup.max.descendants``): then its tree is
        found by its mark."""
        if self._trees is None:
            return None
        try:
            return self._trees.take()
        except OSError as e:
            log.warning("trajectory %r: no cgroup for an action (%s): its processes are "
                        "found by their mark", trajectory, e)
            return None

    async def _wait_exit(self, proc: asyncio.subprocess.Process, watched: _Watched,
                         timeout: float | None, group: ActionGroup | None) -> bool:
        """Wait for the command itself to exit (not for its pipes); True if it timed out
        and was killed (its tree: :meth:`_drain` waits for all of it)."""
        try:
            await asyncio.wait_for(asyncio.shield(watched.exited), timeout)
            return False
        except TimeoutError:
            self._kill_now(proc, group)
            await watched.exited
            return True

    async def _drain(self, proc: asyncio.subprocess.Process,
                     watched: _Watched | spawner.SpawnedProcess, reader: asyncio.Future,
                     mark: str, group: ActionGroup | None, stop: bool) -> bytes:
        """The command's output once it exited. ``stop`` (cancelled, timed out): its whole
        tree is ended first, and waited for. Otherwise what still holds the pipe
        PIPE_GRACE_S later (a background child) is killed, and the pipe is dropped either
        way: the action ends now, whatever escaped the kill."""
        if stop:
            await asyncio.to_thread(self._end_tree, proc, mark, group)
        try:
            return await asyncio.wait_for(asyncio.shield(reader), PIPE_GRACE_S)
        except TimeoutError:
            pass
        await asyncio.to_thread(self._end_tree, proc, mark, group)
        try:
            return await asyncio.wait_for(asyncio.shield(reader), PIPE_GRACE_S)
        except TimeoutError:  # an escapee holds it: read no more (feeds EOF to the reader)
            watched.drop_output()
            return await reader
        finally:
            watched.close()

    def move(self, effect: Moved) -> None:
        """The core moved a light-lane action off the lane (tangram/cpu/pool.py): every
        process of it runs on the core it now holds, at the exclusive actions' priority;
        while it holds none, at the lowest priority on the cores it shares, yielding to
        the exclusive actions there instead of preempting them (nice 0 on the lane)."""
        self._place(effect)

    def resize(self, effect: Resized) -> None:
        """Resizing (tangram.protocol): the core grew or shrank a running elastic action's
        grant (tangram/cpu/malleable.py): every process of it runs on its new cores from
        now, at the exclusive actions' priority. Its workers stay as many as it started
        (``TANGRAM_WORKERS``): they share the cores they are given."""
        self._place(effect)

    def _place(self, effect: Moved | Resized) -> None:
        """Every process of the action on ``effect.cores`` at the exclusive actions'
        priority (none: the lowest priority where it runs); kept until its process exists
        when it is still being started (``_run`` carries it out then)."""
        aid = effect.action_id
        if aid in self._starting:
            self._starting[aid] = effect
            return
        mark = self._action_marks.get(aid)
        if mark is None:  # ended meanwhile
            return
        own = os.getpriority(os.PRIO_PROCESS, 0)
        cores = {self.cpu_map[c] for c in effect.cores} or None
        nice = min(own + EXCLUSIVE_NICE, 19) if cores else DEMOTED_NICE
        self._repin(mark, cores, nice)

    @staticmethod
    def _repin(mark: str, cores: set[int] | None, nice: int) -> None:
        """Every process carrying ``mark`` on ``cores`` at ``nice``. A process that forks
        while the scan passes may leave a child on the old cores (it copied its parent's
        mask before the parent was re-pinned): the scan is repeated until it finds no
        process it has not pinned (a few rounds at most: each finds only what was forked
        during the previous one)."""
        # (a /proc scan, on the loop: resizes are a few per action, a few ms each, and
        # must apply in order)
        done: set[int] = set()
        for _ in range(8):
            fresh = [pid for pid in marks.marked_pids(MARK, mark) if pid not in done]
            if not fresh:
                return
            for pid in fresh:
                spawner.replace_running(pid, cores, nice)
            done.update(fresh)

    def _end_tree(self, proc: asyncio.subprocess.Process, mark: str,
                  group: ActionGroup | None) -> None:
        """Kill every process of the action - its own cgroup, else its group and every
        process carrying its mark - and wait until they are gone (blocking: a thread)."""
        self._kill_group(proc)
        if group is not None:
            gone = group.end()
        else:
            marks.kill_until_gone(lambda: marks.marked_pids(MARK, mark), rounds=5,
                                  wait_s=END_WAIT_S)
            gone = not marks.marked_pids(MARK, mark)
        if not gone:
            log.warning("action processes (mark %s) still running %g s after SIGKILL",
                        mark, END_WAIT_S)

    def _kill_now(self, proc: asyncio.subprocess.Process, group: ActionGroup | None) -> None:
        """What a kill can do on the event loop: the command's process group and, where
        the action has its own cgroup, every process in it (one write). The marked sweep,
        a pass over /proc, runs in :meth:`_end_tree`."""
        self._kill_group(proc)
        if group is not None:
            group.kill()

    @staticmethod
    def _kill_group(proc: asyncio.subprocess.Process) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole process group, children too
        except (ProcessLookupError, PermissionError):
            pass

    def cancel(self, action_id: str) -> None:
        """Stop a running action: its whole process tree (daemons and ``setsid`` children
        included) is killed, and its outcome comes once all of it is gone (_run). Asked
        again while it ends (the service repeats a cancel): the same, at no extra cost."""
        fork = self._fork_tasks.pop(action_id, None)
        if fork is not None:  # stopped where it is; run_fork removes what it staged and
            fork.cancel()  # thaws the source before the action ends (cancelled)
            return
        if action_id in self._starting:  # its process is being started: killed once it is
            self._cancelled_starting.add(action_id)
            return
        proc = self._procs.get(action_id)
        if proc is not None:
            self._cancelled.add(action_id)
            self._kill_now(proc, self._groups.get(action_id))

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None:
        """Its memory limit and work directory. A directory already there is a trajectory
        a previous run left open, restored after a restart (executor/server/service.py):
        its files are kept, given to the user id it has now."""
        self._memory.open(trajectory, mem_gb)
        restored = (self.root / dir_name(trajectory)).is_dir()
        path = self.workdir(trajectory)
        uid = self._uid(trajectory)
        if restored and uid is not None:  # (chown walks iteratively, links not followed:
            # a tree thousands of levels deep would exhaust os.walk's recursion)
            done = subprocess.run(["chown", "-R", "-P", "-h", f"{uid}:{uid}", "--", str(path)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise OSError(f"its files cannot be given to its user id: {done.stderr[-200:]}")
        self._scratched.discard(trajectory)  # (restored: its /tmp given to its id too)
        self._private(trajectory)

    def retain(self, trajectories: Collection[str]) -> int:
        """At a start, before the journal's open ``trajectories`` are opened again
        (executor/server/service.py): everything else in the work root is a previous run's
        leftover - the directory of a trajectory opened but not journalled
        (a kill -9 mid-open), a fork's copies not journalled yet (mid-fork: the service
        journals them once complete), a fork's stage (`` forking ``), a closed one not
        removed yet (`` closing ``) - and is removed now, so no later trajectory of the same
        id sees its files and no file of an id this run hands out again is left. (With
        ``keep_workdirs``, a leftover directory is moved aside, root's alone, instead.)
        How many entries were removed."""
        keep = {dir_name(t) for t in trajectories}
        removed = 0
        private = self.root / AREA  # the trajectories' private /tmp (scratch.py): by name too
        entries = list(os.scandir(self.root))
        if private.is_dir() and not private.is_symlink():
            entries = [e for e in entries if e.name != AREA] + list(os.scandir(private))
        for e in entries:
            try:
                is_dir = e.is_dir(follow_symlinks=False)
                if e.name in keep and is_dir:
                    continue
                if self.keep_workdirs and is_dir and not e.name.startswith(" "):
                    aside = self.root / f" kept {secrets.token_hex(8)} {e.name[:100]}"
                    os.rename(e.path, aside)
                    os.chown(aside, 0, 0, follow_symlinks=False)
                    aside.chmod(0o700)  # (its files keep ids this run may hand out)
                elif is_dir:
                    remove_tree(Path(e.path))
                else:
                    os.unlink(e.path)
                removed += 1
            except OSError as err:
                log.warning("cannot remove %s left by the previous run: %s", e.path, err)
        if removed:
            log.warning("removed %d entries of the work root %s that the previous run left "
                        "and no open trajectory holds (unjournalled opens or copies of a "
                        "run stopped mid-way, closed sandboxes not removed yet)",
                        removed, self.root)
        return removed

    def close_trajectory(self, trajectory: str) -> None:
        mark = self._marks.pop(trajectory, None)
        uid = self._uid_of.pop(trajectory, None)
        self._dirs.pop(trajectory, None)
        cage = self._memory.close(trajectory)
        groups = self._trees.forget(trajectory) if self._trees is not None else []
        path = self.root / dir_name(trajectory)
        self._scratched.discard(trajectory)
        private = None if self.keep_workdirs else self._scratch.aside(dir_name(trajectory))
        gone = None
        if not self.keep_workdirs and path.exists():
            # moved aside at once (a reopened id starts empty), removed off the loop; a
            # name with a space is never one dir_name makes
            gone = self.root / f" closing {secrets.token_hex(8)}"
            path.rename(gone)

        def give_back() -> None:  # once nothing of its id runs: for another trajectory
            if groups:  # its daemons' cgroups (emptied by the kill above)
                remove_groups(groups)
            if cage is not None:
                Cages.remove(cage)
            if private is not None:  # (before its id goes to another trajectory)
                remove_tree(private)
            if uid is not None and self._uids is not None:
                if self.keep_workdirs:
                    return  # its directory is kept as it was: the id is not handed out again
                self._uids.give(uid)

        # every process any of its actions left behind (by its id as root, else its
        # mark), then its directory (executor/backends/process/reaper.py: batched, off the loop)
        left = Leftovers(None if mark is None else mark + ".", uid, gone, give_back)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop (tests, tools): inline
            clean(MARK, [left], self.root)
            return
        self._reaper.add(left)

    def shutdown(self) -> None:
        self._shutting_down = True  # (what it kills now is not an unexplained SIGKILL)
        for proc in list(self._procs.values()):
            self._kill_group(proc)
        if not self._reaper.drain(REAPER_DRAIN_S):
            log.warning("process backend: closed trajectories still being cleaned up after "
                        "%g s", REAPER_DRAIN_S)
        kill_marked(self._run_mark + ".")
        if self._uids is not None:
            kill_uids(*self.uid_range)  # type: ignore[misc]
        if self._trees is not None:
            self._trees.close()
        self._memory.shutdown()

    def shed(self, effect: Shed) -> str | None:
        """Capabilities.sheds: the machine is short of memory (the core's Shed): kill every
        process of the trajectory that uses the most (its cgroup's working set, else its
        processes' resident memory); its running actions end ``oom``. The trajectory,
        None when no sandbox holds memory."""
        use = {t: self._memory.used_bytes(t) for t in self._marks}
        use = {t: (b if b is not None else self._rss(t)) for t, b in use.items()}
        shed = largest_sandbox(use, effect)
        if shed is None:
            return None
        worst, why = shed
        self._memory.shed(worst, why)  # (counted before the kill: its actions end oom)
        self._kill_trajectory(worst)
        return worst

    def _pids(self, trajectory: str) -> list[int]:
        uid = self._uid_of.get(trajectory)
        if uid is not None:
            return pids_of_uids(uid, uid)
        mark = self._marks.get(trajectory)
        return [] if mark is None else marks.marked_pids(MARK, mark + ".")

    def _rss(self, trajectory: str) -> int:
        page = os.sysconf("SC_PAGE_SIZE")
        total = 0
        for pid in self._pids(trajectory):
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * page
            except (OSError, ValueError, IndexError):
                pass
        return total

    def _kill_trajectory(self, trajectory: str) -> None:
        uid = self._uid_of.get(trajectory)
        if uid is not None:
            kill_uids(uid)
        else:
            mark = self._marks.get(trajectory)
            if mark is not None:
                kill_marked(mark + ".")

    # -- files (executor/server/routes/files.py): confined to the trajectory's working directory ------
    def put_file(self, trajectory: str, parts: tuple[str, ...], data: bytes | BinaryIO) -> int:
        return write_file(self.workdir(trajectory), parts, data, owner=self._uid(trajectory))

    def get_file(self, trajectory: str, parts: tuple[str, ...],
                 limit: int = MAX_FILE_BYTES) -> bytes:
        return read_file(self.workdir(trajectory), parts, limit)
