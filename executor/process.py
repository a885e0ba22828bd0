"""Process backend (the embedded default): a working directory per trajectory,
each action a subprocess pinned to exactly its granted cores.

This is not isolation (see the README): commands run as the server's user.
What it does guarantee: a command sees none of the server's ``TANGRAM_*``
variables (nor other names that look like secrets), runs in its own process
group, and every process it started - even one that left the group with
``setsid`` - is killed when the action times out and when the trajectory
closes. Output is read as it comes and only its last ``MAX_OUTPUT`` bytes are
kept, so a command printing gigabytes costs the server 1 MiB.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import quote

from executor import marks, spawner
from executor.commands import EXCLUSIVE_NICE, CommandError, argv_of, elastic_argv, priority_prefix
from executor.files import MAX_FILE_BYTES, read_file, write_file
from executor.local import allowed_cpus
from tangram.model import Dispatch, Outcome
from tangram.protocol import Capabilities

MAX_OUTPUT = 1 << 20  # keep at most the last 1 MiB of an action's output
#: environment variables a command never inherits from the server
SECRET_NAME = re.compile(r"^TANGRAM_|TOKEN|SECRET|PASSW|API_?KEY|CREDENTIAL", re.IGNORECASE)
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        watcher = asyncio.PidfdChildWatcher()
        watcher.attach_loop(loop)
        asyncio.set_child_watcher(watcher)


class ProcessBackend:
    name = "process"
    capabilities = Capabilities(files=True)

    def __init__(self, root: str | Path, cpu_map: list[int] | None = None,
                 env: Mapping[str, str] | None = None, keep_workdirs: bool = False) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.root = self.root.resolve()
        self.cpu_map = cpu_map or allowed_cpus()
        self.env = scrubbed_env(env if env is not None else os.environ)
        self.keep_workdirs = keep_workdirs
        # Pinning through taskset (one extra exec, ~1 ms) instead of preexec_fn: a
        # preexec_fn forces a full fork of this (large) Python process, ~15 ms.
        self._taskset = shutil.which("taskset")
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._tasks: set[asyncio.Task] = set()
        #: trajectory -> the random mark its processes carry (this run only)
        self._marks: dict[str, str] = {}
        self._run_mark = secrets.token_hex(6)
        use_pidfd_watcher()

    def workdir(self, trajectory: str) -> Path:
        path = self.root / dir_name(trajectory)
        # the name cannot escape by construction; this check keeps it that way
        if path.resolve().parent != self.root:
            raise ValueError(f"trajectory: {trajectory!r} maps outside the work root")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _mark(self, trajectory: str) -> str:
        if trajectory not in self._marks:
            self._marks[trajectory] = f"{self._run_mark}.{secrets.token_hex(6)}"
        return self._marks[trajectory]

    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        task = asyncio.get_running_loop().create_task(self._guarded(d, on_done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        """Whatever fails, the action ends with a status (its lease is released then)."""
        try:
            await self._run(d, on_done)
        except asyncio.CancelledError:
            on_done(Outcome(d.action.id, "cancelled", None, error="cancelled"))
            raise
        except Exception as e:  # noqa: BLE001 - any failure must end the action
            on_done(Outcome(d.action.id, "failed", None,
                            error=f"process backend: {type(e).__name__}: {e}"))

    async def _run(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        t_start = time.time()
        payload = d.action.payload or {}
        try:
            argv = elastic_argv(argv_of(payload), d.units, d.action.elastic == "cpu")
        except CommandError as e:
            on_done(Outcome(d.action.id, "failed", None, error=str(e)))
            return
        cores = {self.cpu_map[c] for c in d.lease.cores} or set(self.cpu_map)
        timeout = float(payload.get("timeout_s") or 0) or None
        env = {**self.env, **{k: str(v) for k, v in (payload.get("env") or {}).items()
                              if not k.startswith("TANGRAM_")}}
        env["TANGRAM_CORES"] = ",".join(map(str, sorted(cores)))
        mark = f"{self._mark(d.action.trajectory)}.{secrets.token_hex(4)}"
        env[MARK] = mark
        if self._taskset:
            pin: dict = {}
            full = [self._taskset, "-c", ",".join(map(str, sorted(cores))),
                    *priority_prefix(d.lease.lane), *argv]
        else:
            def pin_and_nice() -> None:
                os.sched_setaffinity(0, cores)
                if not d.lease.lane:
                    os.nice(EXCLUSIVE_NICE)

            pin = {"preexec_fn": pin_and_nice}
            full = argv
        try:
            proc = await spawner.create_subprocess_exec(
                *full, cwd=self.workdir(d.action.trajectory), env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, **pin)
        except (OSError, ValueError) as e:  # ValueError: e.g. NUL in an argument
            on_done(Outcome(d.action.id, "failed", None, error=f"cannot start {argv[0]!r}: {e}"))
            return
        t_spawned = time.time()
        self._procs[d.action.id] = proc
        timed_out = False
        assert proc.stdout is not None
        reader = asyncio.ensure_future(read_tail(proc.stdout))
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            timed_out = True
            self._kill_group(proc)
            await proc.wait()
        finally:
            self._procs.pop(d.action.id, None)
        # background children may still hold the pipe open: after the timeout, or once
        # the command itself exited, they are not waited for - and not left running
        if timed_out:
            await asyncio.to_thread(kill_marked, mark)
        try:
            output = await asyncio.wait_for(asyncio.shield(reader), 0.5 if not timed_out else 1.0)
        except TimeoutError:
            await asyncio.to_thread(kill_marked, mark)
            try:
                output = await asyncio.wait_for(reader, 1.0)
            except TimeoutError:
                reader.cancel()
                output = b""
        t_exited = time.time()
        extra = {"argv": argv, "cores": sorted(cores), "spawn_s": t_spawned - t_start,
                 "t_spawned": t_spawned, "t_exited": t_exited}
        on_done(outcome_of(d, proc.returncode, output, timed_out, timeout or 0, extra,
                           overhead_s=t_spawned - t_start))

    @staticmethod
    def _kill_group(proc: asyncio.subprocess.Process) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole process group, children too
        except ProcessLookupError:
            pass

    def cancel(self, action_id: str) -> None:
        proc = self._procs.get(action_id)
        if proc is not None:
            self._kill_group(proc)

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None:
        self.workdir(trajectory)

    def close_trajectory(self, trajectory: str) -> None:
        mark = self._marks.pop(trajectory, None)
        path = self.root / dir_name(trajectory)
        gone = None
        if not self.keep_workdirs and path.exists():
            # moved aside at once (a reopened id starts empty), removed off the loop; a
            # name with a space is never one dir_name makes
            gone = self.root / f" closing {secrets.token_hex(8)}"
            path.rename(gone)

        def clean() -> None:
            if mark is not None:
                kill_marked(mark + ".")  # every process any of its actions left behind
            if gone is not None:
                shutil.rmtree(gone, ignore_errors=True)

        try:
            asyncio.get_running_loop().run_in_executor(None, clean)
        except RuntimeError:  # no loop (tests, tools): inline
            clean()

    def shutdown(self) -> None:
        for proc in list(self._procs.values()):
            self._kill_group(proc)
        kill_marked(self._run_mark + ".")

    # -- files (executor/files_api.py): confined to the trajectory's working directory ------
    def put_file(self, trajectory: str, parts: tuple[str, ...], data: bytes) -> None:
        write_file(self.workdir(trajectory), parts, data)

    def get_file(self, trajectory: str, parts: tuple[str, ...],
                 limit: int = MAX_FILE_BYTES) -> bytes:
        return read_file(self.workdir(trajectory), parts, limit)
