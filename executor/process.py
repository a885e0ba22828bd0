"""Process backend (the embedded default): a working directory per trajectory,
each action a subprocess pinned to exactly its granted cores."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from executor.commands import EXCLUSIVE_NICE, CommandError, argv_of, elastic_argv, priority_prefix
from executor.files import MAX_FILE_BYTES, read_file, write_file
from executor.local import allowed_cpus
from tangram.model import Dispatch, Outcome

MAX_OUTPUT = 1 << 20  # keep at most 1 MiB of an action's output


def safe_name(trajectory: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", trajectory)[:120] or "_"


def outcome_of(d: Dispatch, code: int | None, output: bytes, timed_out: bool, timeout: float,
               extra: Mapping, overhead_s: float = 0.0) -> Outcome:
    text = output[-MAX_OUTPUT:].decode(errors="replace")
    if timed_out:
        return Outcome(d.action.id, "timeout", code, text,
                       f"killed after the {timeout:g} s timeout", overhead_s, extra)
    return Outcome(d.action.id, "ok", code, text, "", overhead_s, extra)


class ProcessBackend:
    name = "process"

    def __init__(self, root: str | Path, cpu_map: list[int] | None = None,
                 env: Mapping[str, str] | None = None, keep_workdirs: bool = False) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.cpu_map = cpu_map or allowed_cpus()
        self.env = dict(env or os.environ)
        self.keep_workdirs = keep_workdirs
        # Pinning through taskset (one extra exec, ~1 ms) instead of preexec_fn: a
        # preexec_fn forces a full fork of this (large) Python process, ~15 ms.
        self._taskset = shutil.which("taskset")
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._tasks: set[asyncio.Task] = set()

    def workdir(self, trajectory: str) -> Path:
        path = self.root / safe_name(trajectory)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        task = asyncio.get_running_loop().create_task(self._run(d, on_done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
        env = {**self.env, **{k: str(v) for k, v in (payload.get("env") or {}).items()}}
        env["TANGRAM_CORES"] = ",".join(map(str, sorted(cores)))
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
            proc = await asyncio.create_subprocess_exec(
                *full, cwd=self.workdir(d.action.trajectory), env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, **pin)
        except OSError as e:
            on_done(Outcome(d.action.id, "failed", None, error=f"cannot start {argv[0]!r}: {e}"))
            return
        t_spawned = time.time()
        self._procs[d.action.id] = proc
        timed_out = False
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            timed_out = True
            self._kill_group(proc)
            output = b""
            if proc.stdout:
                try:
                    output = await asyncio.wait_for(proc.stdout.read(), 1.0)
                except (TimeoutError, ValueError):
                    pass
            await proc.wait()
        finally:
            self._procs.pop(d.action.id, None)
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
        if not self.keep_workdirs:
            shutil.rmtree(self.root / safe_name(trajectory), ignore_errors=True)

    def shutdown(self) -> None:
        for proc in list(self._procs.values()):
            self._kill_group(proc)

    # -- files (executor/files_api.py): confined to the trajectory's working directory ------
    def put_file(self, trajectory: str, parts: tuple[str, ...], data: bytes) -> None:
        write_file(self.workdir(trajectory), parts, data)

    def get_file(self, trajectory: str, parts: tuple[str, ...],
                 limit: int = MAX_FILE_BYTES) -> bytes:
        return read_file(self.workdir(trajectory), parts, limit)
