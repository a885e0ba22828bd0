"""``tangram bench sim-scale``: what `tangram simulate` costs a user at the scale of large
sandbox fleets, phase by phase, beside a floor that holds across machines.

Each point generates one trace (coding on the paper cluster at 2,048 and 8,192
trajectories by default; 65,536 with ``--fleet``, which takes many minutes), writes it as
a trace file, and runs the **whole command** on it as a user does, in a process of its
own: ``tangram simulate --trace FILE --cluster paper --out DIR -q``. Its user + system CPU
and peak RSS come from the operating system (``wait4``); its phases from the CPU laps the
command writes into summary.json's ``timing.cpu_s`` (analysis/phases.py):

* ``start``: the interpreter and the imports, up to the command's first line;
* ``read``: reading and validating the trace (and its selections and scales);
* ``run``: the simulation itself, records streamed to actions.parquet in row groups;
* ``summary``: the summary, from actions.parquet's columns;
* ``write``: the rest of the run directory (actions.parquet's footer, timing, utilisation,
  config, cluster.yaml, summary.json);
* ``exit``: what the operating system counted and no lap did (printing, tearing the
  interpreter down).

Beside it, in a fresh child process, the **floor**: a minimal SimPy model of the same
trace and closed loop (analysis/bench/floor.py), with no scheduler, no records and no
outputs. Absolute speeds differ up to 3x between machines and with their load; each
phase's CPU over the floor's (``*_x_floor``), measured a moment apart, is the figure to
compare. ``whole_x_floor`` is what a user pays; ``run_x_floor`` the simulation alone.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any

from analysis.bench import QUIET, BenchError, Opt, Progress
from analysis.bench.floor import floor_model

#: the command's phases, in order (``exit``: the whole command's CPU that no lap counted)
PHASES = ("start", "read", "run", "summary", "write", "exit")

#: (workload, trajectories) of the default run, and what ``--fleet`` adds
POINTS: tuple[tuple[str, int], ...] = (("coding", 2048), ("coding", 8192))
FLEET: tuple[tuple[str, int], ...] = (("coding", 65536),)

ROOT = Path(__file__).resolve().parents[2]


def write_trace(workload: str, n: int, seed: int, folder: Path) -> tuple[Path, float]:
    """A point's trace, generated and written as a trace file, and the CPU seconds that
    took (in the bench's own process: the generator's memory is not the command's)."""
    from traces.generate import generate
    from traces.schema import write

    c0 = time.process_time()
    path = write(generate(workload, n, seed=seed), folder / f"{workload}-{n}-{seed}.parquet")
    return path, time.process_time() - c0


def whole_command(trace: Path, out: Path, seed: int = 0) -> tuple[float, float, dict[str, Any]]:
    """``tangram simulate`` on ``trace`` as a user runs it, in a process of its own: (its
    user + system CPU seconds, its peak RSS in MB, its summary.json)."""
    cmd = [sys.executable, str(ROOT / "cli.py"), "simulate", "--trace", str(trace),
           "--cluster", "paper", "--out", str(out), "--seed", str(seed), "-q"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # (wait4: this child's own rusage, not every child's so far)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"tangram simulate exited {proc.returncode}: {err[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024.0, summary


def floor_point(trace: Path) -> tuple[int, float]:
    """The floor on ``trace`` (read and validated outside its time): (actions, CPU s)."""
    from sim.cluster import load_cluster
    from traces.schema import load, trajectories

    cluster = load_cluster("paper")
    capacity = {"cpu": float(sum(nd.cores for nd in cluster.cpu_nodes)),
                "gpu": float(sum(g.gpus for g in cluster.gpu_nodes))}
    df = load(trace)
    c0 = time.process_time()
    actions = floor_model(trajectories(df), capacity)
    return actions, time.process_time() - c0


def _floor_child(trace: Path, conn: Any) -> None:
    try:
        conn.send(("ok", floor_point(trace)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent, with its type
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def _floor(trace: Path) -> tuple[int, float]:
    """:func:`floor_point` in a fresh process (spawned: nothing inherited but the code)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_floor_child, args=(trace, child))
    proc.start()
    child.close()
    status, value = parent.recv()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"the floor: {value}")
    return value


def point_row(workload: str, n: int, whole_s: float, peak_mb: float,
              summary: dict[str, Any], floor_actions: int, floor_s: float,
              generate_s: float = 0.0, load_1m: float = 0.0) -> dict[str, Any]:
    """One point's row: the whole command and each phase, in CPU seconds and over the
    floor's; microseconds per action; peak RSS; the core's share of the run."""
    actions = int(summary["actions"])
    if floor_actions != actions:
        raise RuntimeError(f"sim-scale: the floor ran {floor_actions} actions, "
                           f"the command {actions}")
    timing = summary.get("timing", {})
    laps = timing.get("cpu_s")
    if not laps:
        raise RuntimeError("sim-scale: summary.json has no timing.cpu_s (the command's "
                           "phases)")
    phases = {p: float(laps.get(p, 0.0)) for p in PHASES if p != "exit"}
    # (the kernel splits a process's CPU between user and system time from sampled ticks:
    # its count at exit may fall a tick short of the laps' sum)
    whole_s = max(whole_s, sum(phases.values()))
    phases["exit"] = whole_s - sum(phases.values())
    row: dict[str, Any] = {
        "workload": workload, "trajectories": n, "actions": actions,
        "floor_cpu_s": round(floor_s, 3), "whole_cpu_s": round(whole_s, 3),
        "whole_x_floor": round(whole_s / floor_s, 2),
        "us_per_action": round(1e6 * whole_s / actions, 1),
        "run_us_per_action": round(1e6 * phases["run"] / actions, 1),
        "floor_us_per_action": round(1e6 * floor_s / actions, 1),
    }
    for p in PHASES:
        row[f"{p}_cpu_s"] = round(phases[p], 3)
    for p in PHASES:
        row[f"{p}_x_floor"] = round(phases[p] / floor_s, 3)
    row.update({
        "core_share": round(float(timing.get("core_s", 0.0)) / phases["run"], 3)
        if phases["run"] else 0.0,
        "peak_rss_mb": round(peak_mb, 1), "generate_cpu_s": round(generate_s, 3),
        "load_1m": round(load_1m, 2)})
    return row


def run(points: Iterable[tuple[str, int]], seed: int = 0,
        out: Path | None = None, progress: Progress = QUIET) -> Iterator[dict[str, Any]]:
    """Every point, one after another; each row is yielded as it finishes and, with
    ``out``, appended to ``out`` as a JSON line."""
    todo = list(points)
    for i, (workload, n) in enumerate(todo):
        progress(i, len(todo))
        with tempfile.TemporaryDirectory(prefix="tangram-sim-scale-") as tmp:
            progress.phase(f"{workload} x {n}: generating the trace")
            trace, generate_s = write_trace(workload, n, seed, Path(tmp))
            load = os.getloadavg()[0]
            progress.phase(f"{workload} x {n}: tangram simulate")
            whole_s, peak, summary = whole_command(trace, Path(tmp) / "run", seed)
            progress.phase(f"{workload} x {n}: the floor")
            floor_actions, floor_s = _floor(trace)
        row = point_row(workload, n, whole_s, peak, summary, floor_actions, floor_s,
                        generate_s, load)
        if out is not None:
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        progress(i + 1, len(todo))
        yield row


def command(
    points: Annotated[str, Opt(
        "workload:trajectories pairs, comma-separated (default: coding at 2048 and 8192).")]
    = ",".join(f"{w}:{n}" for w, n in POINTS),
    fleet: Annotated[bool, Opt(
        "Also coding at 65,536 trajectories (~1.9 M actions: many minutes, a few GB).",
        flag="--fleet")] = False,
    seed: int = 0,
    out: Annotated[Path | None, Opt("Also append each row to this JSON-lines file.")] = None,
    progress: Progress = QUIET,
) -> Iterator[dict[str, Any]]:
    """The whole `tangram simulate` command's CPU and each of its phases (start, read,
    run, summary, write, exit), in seconds and over a bare SimPy model of the same trace
    (the figure that holds across machines), per action, and peak RSS (JSON lines, one
    per point)."""
    from traces.generate import WORKLOADS

    try:
        chosen = [(w.strip(), int(n)) for w, n in (p.split(":") for p in points.split(",") if p)]
    except ValueError:
        raise BenchError(f"--points: expected workload:trajectories,..., got {points!r}") from None
    for w, n in chosen:
        if w not in WORKLOADS or n < 1:
            raise BenchError(f"--points: {w}:{n}: workload one of {sorted(WORKLOADS)}, "
                             "trajectories >= 1")
    if fleet:
        chosen += [p for p in FLEET if p not in chosen]
    yield from run(chosen, seed, out, progress)
