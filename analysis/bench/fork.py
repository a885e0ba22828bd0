"""`tangram bench fork`: a GRPO group of rollouts, each preparing its sandbox, against
one preparation forked into the others, on a real `tangram serve`.

The setup is a real one, offline: ``git clone`` of a small local repository (uploaded as
a ``git bundle``) and ``pip install`` of one small local wheel (uploaded too) into the
sandbox, both made by the bench; on the process or the docker backend. Per
group (``size`` rollouts, started together at t0):

* ``separate``: every rollout opens its sandbox and runs the setup, then its first
  agent action (it imports the installed package from the cloned repository);
* ``fork``: one rollout opens and runs the setup, forks ``size - 1`` copies
  (``POST /v1/trajectories {"fork_of", "count"}``), then all run their first action.

Reported (medians over ``rounds``, the two variants alternating): each rollout's time
from t0 to the end of its first agent action, the group's total CPU (the server and
every command it ran: /proc's utime+stime of it and its reaped children), and the
fork's own figures (how the files were copied, seconds per copy, bytes per copy).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from analysis.bench import QUIET, BenchError, Opt, Progress
from analysis.bench.serving import stop, wait_healthy
from tangram_sdk.client import TangramClient

#: files of the bench's repository (a small Python project: sources and tests)
REPO_FILES = 120
REPO_FILE_BYTES = 4096


def make_repo(root: Path) -> Path:
    """A small git repository: ``REPO_FILES`` source files, one commit."""
    repo = root / "origin"
    (repo / "src").mkdir(parents=True)
    for i in range(REPO_FILES):
        body = f"# module {i}\n" + "".join(f"def f{i}_{k}(x):\n    return x + {k}\n"
                                          for k in range(REPO_FILE_BYTES // 32))
        (repo / "src" / f"mod{i:03d}.py").write_text(body)
    (repo / "README.md").write_text("bench repository\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "b@x",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "b@x"}
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"],
                 ["git", "commit", "-q", "-m", "bench"]):
        subprocess.run(argv, cwd=repo, env=env, check=True)
    return repo


def make_wheel(root: Path, name: str = "forkbench", version: str = "1.0") -> Path:
    """One pure-Python wheel, written as the format says (no build backend needed)."""
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n".encode(),
             f"{name}/util.py": b"def double(x):\n    return 2 * x\n"}
    info = f"{name}-{version}.dist-info"
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\n"
                                 f"Version: {version}\n").encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: tangram-bench\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = root / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return wheel


def make_bundle(repo: Path) -> bytes:
    """The repository as one file (``git bundle``): uploaded into the sandbox, cloned
    there - the same on both backends, and no other user's repository for git to refuse."""
    out = repo.parent / "repo.bundle"
    subprocess.run(["git", "bundle", "create", "-q", str(out), "--all"], cwd=repo, check=True)
    return out.read_bytes()


def python_of(backend: str) -> str:
    """The interpreter commands run: the server's on the process backend, the host's in
    a docker sandbox (which mounts the host's /usr)."""
    return sys.executable if backend == "process" else "/usr/bin/python3"


def setup_command(backend: str, wheel: str) -> str:
    git = shutil.which("git") or "git"
    return (f"{git} clone -q repo.bundle repo && {python_of(backend)} -m pip install -q "
            f"--no-index --no-deps --no-cache-dir --disable-pip-version-check --target site "
            f"{wheel}")


def first_action(backend: str) -> str:
    return (f"PYTHONPATH=site {python_of(backend)} -c "
            "\"import forkbench.util as u; assert u.double(2) == 4\" && ls repo/src | wc -l")


def _cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its reaped children (every command it ran)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Setup:
    """What a rollout's sandbox is prepared with: files uploaded, then a command."""

    files: tuple[tuple[str, bytes], ...]
    command: str
    first: str
    mem_gb: float


async def _first(tg: TangramClient, tid: str, t0: float, setup: Setup) -> float:
    res = await tg.run(tid, command=setup.first, shell=True)
    if res["status"] != "ok" or res["exit_code"] != 0:
        raise RuntimeError(f"first action of {tid}: {res}")
    return time.perf_counter() - t0


async def _prepare(tg: TangramClient, setup: Setup) -> str:
    tid = await tg.open_trajectory(task="bench-fork", mem_gb=setup.mem_gb)
    for path, data in setup.files:
        await tg.put_file(tid, path, data)
    res = await tg.run(tid, command=setup.command, shell=True, timeout_s=600)
    if res["status"] != "ok" or res["exit_code"] != 0:
        raise RuntimeError(f"setup: {res}")
    return tid


async def _separate(tg: TangramClient, size: int, setup: Setup) -> dict:
    t0 = time.perf_counter()

    async def one() -> tuple[str, float]:
        tid = await _prepare(tg, setup)
        return tid, await _first(tg, tid, t0, setup)

    done = await asyncio.gather(*(one() for _ in range(size)))
    for tid, _ in done:
        await tg.close_trajectory(tid)
    return {"open_to_first_s": [round(s, 3) for _, s in done]}


async def _forked(tg: TangramClient, size: int, setup: Setup) -> dict:
    t0 = time.perf_counter()
    lead = await _prepare(tg, setup)
    forked = await tg.fork(lead, size - 1) if size > 1 else {"ids": [], "fork_s": 0.0,
                                                             "method": "", "bytes": 0}
    ids = [lead, *forked["ids"]]
    times = await asyncio.gather(*(_first(tg, t, t0, setup) for t in ids))
    for t in ids:
        await tg.close_trajectory(t)
    copies = max(size - 1, 1)
    return {"open_to_first_s": [round(s, 3) for s in times], "method": forked["method"],
            "fork_s": forked["fork_s"], "fork_s_per_copy": forked["fork_s"] / copies,
            "fork_queue_s": forked.get("queue_s", 0.0), "bytes_per_copy": forked["bytes"]}


async def _rounds(url: str, token: str, pid: int, size: int, rounds: int,
                  setup: Setup, progress: Progress = QUIET) -> dict:
    runs: dict[str, list[dict]] = {"separate": [], "fork": []}
    async with TangramClient(url, token, timeout_s=900) as tg:
        for r in range(rounds):
            for name, play in (("separate", _separate), ("fork", _forked)):
                progress(len(runs["separate"]) + len(runs["fork"]), 2 * rounds)  # groups played
                progress.phase(f"round {r + 1}: the group {name}")
                cpu0, wall0 = _cpu_s(pid), time.perf_counter()
                row = await play(tg, size, setup)
                await asyncio.sleep(0.5)  # closed sandboxes' cleanup is off the loop
                row["cpu_s"] = _cpu_s(pid) - cpu0
                row["wall_s"] = time.perf_counter() - wall0
                runs[name].append(row)
    out: dict = {}
    for name, rows in runs.items():
        firsts = [s for r in rows for s in r["open_to_first_s"]]
        out[name] = {"open_to_first_s_median": statistics.median(firsts),
                     "open_to_first_s_max_median": statistics.median(
                         max(r["open_to_first_s"]) for r in rows),
                     "cpu_s_median": statistics.median(r["cpu_s"] for r in rows),
                     "rounds": rows}
        if name == "fork":
            out[name]["method"] = rows[0]["method"]
            out[name]["fork_s_per_copy_median"] = statistics.median(
                r["fork_s_per_copy"] for r in rows)
            out[name]["bytes_per_copy"] = rows[0]["bytes_per_copy"]
    return out


def fork_bench(size: int = 8, rounds: int = 3, backend: str = "process",
               mem_gb: float = 0.5, progress: Progress = QUIET) -> dict:
    """The group of ``size`` rollouts, ``rounds`` times each way, on ``backend``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "bench-" + os.urandom(8).hex()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # commands may run as sandbox users: they read the repo and wheel
        repo, wheel = make_repo(root), make_wheel(root)
        setup = Setup((("repo.bundle", make_bundle(repo)), (wheel.name, wheel.read_bytes())),
                      setup_command(backend, wheel.name), first_action(backend), mem_gb)
        state = root / "state"
        cmd = [sys.executable, "-m", "cli", "serve", "--port", str(port), "--backend",
               backend, "--state-dir", str(state)]
        log = root / "server.log"
        proc = subprocess.Popen(cmd, env={**os.environ, "TANGRAM_TOKEN": token},
                                stdout=subprocess.DEVNULL, stderr=log.open("w"),
                                cwd=Path(__file__).parents[2])
        try:
            url = f"http://127.0.0.1:{port}"
            progress.phase(f"starting a {backend} server")
            wait_healthy(url, proc, log)
            result = asyncio.run(_rounds(url, token, proc.pid, size, rounds, setup, progress))
            progress(2 * rounds, 2 * rounds)
        finally:
            stop(proc)
    sep, fk = result["separate"], result["fork"]
    return {"bench": "fork", "backend": backend, "group": size, "rounds": rounds,
            "setup": f"git clone (local repo, {REPO_FILES} files) + pip install (local wheel)",
            "loadavg_1m": os.getloadavg()[0], "cpus": os.cpu_count(),
            "fork_method": fk["method"], "fork_s_per_copy": fk["fork_s_per_copy_median"],
            "bytes_per_copy": fk["bytes_per_copy"],
            "open_to_first_s_median": {"separate": sep["open_to_first_s_median"],
                                       "fork": fk["open_to_first_s_median"]},
            "group_ready_s_median": {"separate": sep["open_to_first_s_max_median"],
                                     "fork": fk["open_to_first_s_max_median"]},
            "cpu_s_median": {"separate": sep["cpu_s_median"], "fork": fk["cpu_s_median"]},
            "cpu_scope": ("the server and every command it ran (its reaped children)"
                          if backend == "process" else "the server only: the commands run "
                          "in containers, not as its children"),
            "detail": result}


def command(
    size: Annotated[int, Opt("Rollouts per group.", min=1, max=65)] = 8,
    rounds: Annotated[int, Opt("Groups played each way.", min=1)] = 3,
    backend: Annotated[str, Opt("process or docker.")] = "process",
    progress: Progress = QUIET,
) -> Iterator[dict]:
    """Every rollout preparing its sandbox (git clone of a local repository + pip install
    of a local wheel, offline) against one preparation forked into the others. One JSON
    line: open-to-first-action per rollout, the group's total CPU, the fork's method and
    seconds per copy."""
    if backend not in ("process", "docker"):
        raise BenchError(f"--backend must be process or docker, got {backend!r}")
    yield fork_bench(size, rounds, backend, progress=progress)
