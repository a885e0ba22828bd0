"""Starting an action's process for the process backend: cheaply, and off the event loop
when the machine is loaded.

What ``asyncio.create_subprocess_exec`` costs a server, measured on this kind of
machine: it blocks the event loop until the child has exec'd (``Popen`` waits for the
exec's outcome): ~1 ms quiet, tens of ms on a loaded machine, during which the server
serves nothing - it capped `true` starts at ~300-450/s with 8 in flight on 2 loaded
cores. :func:`create_subprocess_exec` here starts the process with ``Popen`` (its own
``vfork``/``exec``) on the loop while starts are quick, and in a few threads of its own
once one took longer than ``SLOW_START_S`` (a loaded machine: the loop goes on, starts
overlap: ~900-1,150/s in that run), and waits for the process on the loop with a pidfd
(Linux >= 5.3) and a non-blocking read of its one output pipe, without asyncio's
transport and protocols. Measured through `tangram bench serve` (32 x 25 `true`, load
~4.5): ~1.2-1.4 ms of server CPU per action and ~370-400 actions/s starting on the loop,
~1.4-1.5 ms and ~300/s always in threads. It returns an object with what the
backend uses of an asyncio ``Process`` (``pid``, ``returncode``, ``stdout.read(n)``,
``wait()``), and falls back to asyncio for anything else (another stdio layout, a
``preexec_fn``, a ``user``, no pidfd).

We chose this over a pre-forked spawner process (the fork/exec would leave the server,
but every start would then be a round trip to another process, and its children would
not be the server's: the backend kills and waits for them by process group) and over
``os.posix_spawn`` (Python 3.11 cannot set the child's working directory with it).

Pinning and priority (``cores=``, ``nice=``) cost no exec: on Linux a thread's CPU
affinity and nice value are its own, and a child inherits those of the thread that
forked it, so the starting thread takes the child's for the ``vfork`` and its own back
after (:func:`_popen_placed`). The exec chain this replaced, ``taskset -c C nice -n 10
cmd``, cost ~1.6 ms of the child's CPU per start before the command's own exec (measured
2026-12-02: ``setpriv ... -- taskset ... nice ... true`` 4.4 ms of child CPU per start,
``setpriv ... -- true`` 2.0 ms, ``true`` 0.6 ms). The user is still become by an exec of
``setpriv`` (:func:`as_user`), not the same way: credentials are per-thread in the kernel
too, and a thread that took the sandbox user's for the fork would cost ~0.1 ms instead
of ~1.4 ms, but for that moment the sandbox's own processes (a daemon left by an earlier
action of the trajectory) could ``tgkill`` that thread - SIGKILL or SIGSTOP the server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

log = logging.getLogger("tangram.spawner")

#: keyword arguments this path implements; any other goes to asyncio
_OURS = frozenset({"cwd", "env", "stdin", "stdout", "stderr", "start_new_session"})
_READ = 1 << 16


class PipeReader:
    """The read end of a child's output pipe, read on the loop as data comes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self._loop = loop
        self._fd = fd
        self._buf = bytearray()
        self._eof = False
        self._waiter: asyncio.Future[None] | None = None
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._ready)

    def _ready(self) -> None:
        try:
            data = os.read(self._fd, _READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self._buf += data
        else:
            self.close()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        """Stop reading and close the pipe (idempotent): a pending read gets the end."""
        if not self._eof:
            self._eof = True
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all there is with -1); b"" at the end of the output."""
        while not self._buf and not self._eof:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if n < 0 or n >= len(self._buf):
            out = bytes(self._buf)
            self._buf.clear()
        else:
            out = bytes(self._buf[:n])
            del self._buf[:n]
        return out


class SpawnedProcess:
    """A started process, waited for on the loop through its pidfd."""

    def __init__(self, loop: asyncio.AbstractEventLoop, popen: subprocess.Popen,
                 stdout: PipeReader | None) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdout = stdout
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(self.pid)
        self._loop = loop
        loop.add_reader(self._pidfd, self._reap)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    @property
    def exited(self) -> asyncio.Future[int]:
        """Set when the process itself exits, whoever still holds its pipe."""
        return self._exited

    # the same two calls as the process backend's asyncio protocol (_Watched)
    def drop_output(self) -> None:
        """Read no more of the output pipe (a background child may keep it open)."""
        if self.stdout is not None:
            self.stdout.close()

    def close(self) -> None:
        self.drop_output()

    def _reap(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        code = self._popen.wait()  # it has exited: this reaps it at once
        if not self._exited.done():
            self._exited.set_result(code)

    async def wait(self) -> int:
        # shielded: a caller's timeout cancels its wait, not the process's exit
        return await asyncio.shield(self._exited)


_SETPRIV = shutil.which("setpriv")


def as_user(uid: int) -> list[str] | None:
    """An exec prefix that runs the command as ``uid`` (group ``uid``, no supplementary
    groups, no new privileges: a setuid file runs as its caller), or None
    where ``setpriv`` is missing. Measured: ``Popen(user=...)`` cannot
    ``vfork`` and copies the server's memory map (~3.2 ms of server CPU per start for a
    150 MB process), the extra exec of ``setpriv`` costs the server ~0.1 ms; the ids,
    groups and capabilities it leaves are the same (all four uids and gids, no groups,
    no capabilities)."""
    if _SETPRIV is None:
        return None
    return [_SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
            "--"]


def usable() -> bool:
    """Whether this path works here (a pidfd: Linux >= 5.3)."""
    return hasattr(os, "pidfd_open")


def place(cores: Set[int] | None, nice: int) -> None:
    """Pin this thread to ``cores`` and make it ``nice`` nicer (``nice -n`` adds too): in
    the starting thread for a fork, or in a child before its exec (a preexec_fn)."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, min(os.getpriority(os.PRIO_PROCESS, 0) + nice, 19))


def replace_running(pid: int, cores: Set[int] | None, nice: int) -> None:
    """Pin every thread of the running process ``pid`` to ``cores`` (None: leave them)
    and set its niceness to ``nice`` (lowering it needs the privilege to: without, it
    keeps what it had). A process gone meanwhile is left alone."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if cores is not None:
                os.sched_setaffinity(tid, cores)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # gone, or a niceness it may not lower
            continue


def _popen_placed(argv: Sequence[str], kw: dict[str, Any], cores: Set[int] | None,
                  nice: int) -> subprocess.Popen:
    """``Popen(argv, **kw)`` whose child starts on ``cores``, ``nice`` nicer than this
    thread: the thread takes both for the fork (its child inherits them from it) and gets
    its own back, priority first (a nice thread on a busy core waits for its turn)."""
    if cores is None and not nice:
        return subprocess.Popen(argv, **kw)
    own_cpus = os.sched_getaffinity(0) if cores is not None else None
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)  # (PRIO_PROCESS 0: this thread, on Linux)
    try:
        place(cores, nice)
        return subprocess.Popen(argv, **kw)
    finally:  # never raises: a started child must reach its caller, not be lost here
        _take_back(own_cpus, own_nice if nice else None)


def _take_back(cpus: Set[int] | None, nice: int | None) -> None:
    """This thread's own affinity and priority again. Where its old CPUs are gone (its
    cpuset shrank meanwhile), every CPU: the kernel keeps those the cpuset allows."""
    try:
        if nice is not None:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as e:
        log.warning("the spawning thread keeps the nice value it took for a start: %s", e)
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))


_renice_back: bool | None = None


def renice_back() -> bool:
    """Whether a thread here may make itself less nice again (root, CAP_SYS_NICE or an
    RLIMIT_NICE that allows it): where not, a start's nice is a ``nice -n`` exec, so the
    starting thread never stays nice. Tried once, on a thread of its own."""
    global _renice_back
    if _renice_back is None:
        import threading

        ok: list[bool] = []

        def attempt() -> None:
            own = os.getpriority(os.PRIO_PROCESS, 0)
            try:
                os.setpriority(os.PRIO_PROCESS, 0, min(own + 1, 19))
                os.setpriority(os.PRIO_PROCESS, 0, own)
                ok.append(own < 19)
            except OSError:
                ok.append(False)

        t = threading.Thread(target=attempt, name="tangram-renice-check")
        t.start()
        t.join()
        _renice_back = ok == [True]
    return _renice_back


async def create_subprocess_exec(*argv: str, cores: Set[int] | None = None, nice: int = 0,
                                 **kw: Any) -> SpawnedProcess | Any:
    """Like ``asyncio.create_subprocess_exec``, the child pinned to ``cores`` (None: where
    the server may run) and ``nice`` nicer than the server; on the cheap path for the
    backend's layout (stdin from /dev/null or inherited, stdout a pipe, stderr into it or
    inherited), through asyncio otherwise."""
    pipe_out = kw.get("stdout") == subprocess.PIPE
    if (not set(kw) <= _OURS or not usable()
            or kw.get("stdin") not in (None, subprocess.DEVNULL)
            or kw.get("stderr") not in (None, subprocess.STDOUT if pipe_out else None)):
        if cores is not None or nice:  # placed in the child (a preexec_fn: a full fork)
            theirs = kw.get("preexec_fn")

            def prepare() -> None:
                place(cores, nice)
                if theirs is not None:
                    theirs()

            kw["preexec_fn"] = prepare
        return await asyncio.create_subprocess_exec(*argv, **kw)
    if nice and not renice_back():
        argv = ("nice", "-n", str(nice), *argv)
        nice = 0
    loop = asyncio.get_running_loop()
    read_end = write_end = -1
    if pipe_out:  # our own pipe: no file object around the read end
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        kw["stdout"] = write_end
    if kw.get("stdin") == subprocess.DEVNULL:
        kw["stdin"] = _devnull()
    # Popen returns once the child has exec'd (it reads the exec's outcome from the
    # child): ~1 ms on a quiet machine, where starting it here costs the least CPU; tens
    # of ms on a loaded one, where the loop must not wait: then starts go to threads
    # (for a second, then one start here tells whether the machine is still loaded)
    global _threads_until
    if time.monotonic() >= _threads_until:
        started = loop.create_future()
        t0 = time.perf_counter()
        try:
            started.set_result(_popen_placed(argv, kw, cores, nice))
        except Exception as e:  # (raised below, as from a thread)
            started.set_exception(e)
        if time.perf_counter() - t0 > SLOW_START_S:
            _threads_until = time.monotonic() + THREADS_FOR_S
    else:
        started = loop.run_in_executor(_threads(), _popen_placed, argv, kw, cores, nice)
    try:
        popen = await asyncio.shield(started)
    except asyncio.CancelledError:
        started.add_done_callback(partial(_abandon, pipe=(read_end, write_end)))
        raise
    except BaseException:
        for fd in (read_end, write_end) if pipe_out else ():
            os.close(fd)
        raise
    if pipe_out:
        os.close(write_end)  # the child has its copy: EOF comes when it (and whatever it
        # left holding the pipe) has gone
    try:
        reader = PipeReader(loop, read_end) if pipe_out else None
        return SpawnedProcess(loop, popen, reader)
    except BaseException:
        _kill(popen)
        raise


def _abandon(started: asyncio.Future, pipe: tuple[int, int]) -> None:
    """Its starter was cancelled while Popen ran: kill what it started."""
    for fd in pipe:
        if fd >= 0:
            os.close(fd)
    if not started.cancelled() and started.exception() is None:
        _threads().submit(_kill, started.result())


def _kill(popen: subprocess.Popen) -> None:
    try:
        os.killpg(popen.pid, signal.SIGKILL)  # its group: it was started in a session
    except (ProcessLookupError, PermissionError):
        popen.kill()
    popen.wait()


_null: int | None = None


def _devnull() -> int:
    """One descriptor on /dev/null for every start (``Popen`` opens and closes one per
    start with DEVNULL: ~3% of the server's samples at load). Close-on-exec: the child
    gets it as its stdin (dup2 clears the flag) and nothing else."""
    global _null
    if _null is None:
        _null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return _null


_pool: ThreadPoolExecutor | None = None
#: a start on the loop that took longer than this moves starts to threads for a while
#: (3 ms switched too often at load ~4 on 2 cores, and cost CPU; 20 ms is a loaded machine)
SLOW_START_S = 0.02
THREADS_FOR_S = 1.0
_threads_until = 0.0


def _threads() -> ThreadPoolExecutor:
    """The threads processes are started from (a few: each start is one fork/exec)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tangram-spawn")
    return _pool
