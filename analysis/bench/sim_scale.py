"""``tangram bench sim-scale``: the simulator's cost at the scale of large sandbox fleets,
beside a floor that holds across machines.

Each point simulates one generated trace (coding on the paper cluster at 2,048 ... 65,536
trajectories; MOPD at 2,048 and 16,384) under the default policy, and, in the same child
process, the **floor**: a minimal SimPy model of the same trace and closed loop (each
trajectory thinks, takes its action's minimum units from one shared pool per resource for
the action's true duration on them, gives them back), with no scheduler, no records and
no outputs. Absolute speeds differ up to 3x between machines and with their load; the
ratio to the floor, measured in the same process a moment apart, is the figure to compare.

Per point (one JSON line): actions, CPU seconds and actions per CPU-second of Tangram and
of the floor, their ratio, the core's share of Tangram's CPU (the injected stopwatch's
seconds inside ``Tangram.handle``), CPU microseconds per action, and peak RSS (each point
runs in a child process of its own, so its peak is its own; the floor runs after Tangram,
so it is Tangram's). The bench's own process generates each trace and writes it as a trace
file, which the child reads as `tangram simulate --trace` does: the generator's memory (it
builds rows as dicts, ~100 MB per 1,000 trajectories of coding, not handed back to the OS)
is not the simulator's.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import resource
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

from analysis.bench import QUIET, BenchError, Opt, Progress
from analysis.bench.floor import floor_model

#: (workload, trajectories) of the full bench
POINTS: tuple[tuple[str, int], ...] = (
    ("coding", 2048), ("coding", 8192), ("coding", 32768), ("coding", 65536),
    ("mopd", 2048), ("mopd", 16384))


@dataclass(frozen=True)
class ScalePoint:
    workload: str
    trajectories: int
    actions: int
    tangram_cpu_s: float
    floor_cpu_s: float
    #: actions per CPU-second
    tangram_rate: float
    floor_rate: float
    #: Tangram's CPU per action over the floor's (1.0: as cheap as a bare SimPy model)
    ratio_to_floor: float
    #: CPU microseconds per action, Tangram (whole simulation: trace to results)
    us_per_action: float
    #: share of Tangram's CPU spent inside the core (Tangram.handle)
    core_share: float
    peak_rss_mb: float
    generate_cpu_s: float
    #: load average of the machine when the point started (a figure of a loaded machine
    #: reads slower; the ratio to the floor much less so)
    load_1m: float


def _cpu() -> float:
    return time.process_time()


def write_trace(workload: str, n: int, seed: int, folder: Path) -> tuple[Path, float]:
    """A point's trace, generated and written as a trace file, and the CPU seconds that
    took. The bench does this in its own process: what the generator holds (its rows
    as dicts) is not the simulator's memory, and `tangram simulate` reads a file."""
    from traces.generate import generate
    from traces.schema import write

    c0 = _cpu()
    path = write(generate(workload, n, seed=seed), folder / f"{workload}-{n}-{seed}.parquet")
    return path, _cpu() - c0


def run_point(workload: str, n: int, trace: Path, seed: int = 0,
              generate_cpu_s: float = 0.0) -> ScalePoint:
    """One point, in this process (the bench runs each in a child of its own), on the
    trace file ``trace`` (:func:`write_trace`). Tangram's cost is what ``tangram simulate
    --trace`` does with a trace once read: validate it, simulate it under the default
    policy, write the run directory (into a temporary one)."""
    import os
    import tempfile

    from analysis.runs import settle, simulate
    from sim.cluster import load_cluster
    from traces.schema import read_raw, trajectories, validate

    load = os.getloadavg()[0]
    raw, _ = read_raw(trace)
    # as `tangram simulate` does once its trace is read
    settle()
    c1 = _cpu()
    cluster = load_cluster("paper")
    with tempfile.TemporaryDirectory() as tmp:
        # (simulate validates a frame it is given: once, as a trace file read is)
        run = simulate(raw, cluster, "tangram", seed=seed, out=Path(tmp) / "run")
    c2 = _cpu()
    actions = len(run.actions)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    capacity = {"cpu": float(sum(nd.cores for nd in cluster.cpu_nodes)),
                "gpu": float(sum(g.gpus for g in cluster.gpu_nodes))}
    df = validate(raw)  # (the floor's own copy, outside its time: it models the loop only)
    c3 = _cpu()
    floor_actions = floor_model(trajectories(df), capacity)
    c4 = _cpu()
    if floor_actions != actions:
        raise RuntimeError(f"sim-scale: the floor ran {floor_actions} actions, Tangram {actions}")
    t_cpu, f_cpu = c2 - c1, c4 - c3
    core_s = float(run.summary.get("timing", {}).get("core_s", 0.0))
    return ScalePoint(workload, n, actions, round(t_cpu, 3), round(f_cpu, 3),
                      round(actions / t_cpu, 1), round(actions / f_cpu, 1),
                      round(t_cpu / f_cpu, 2), round(1e6 * t_cpu / actions, 1),
                      round(core_s / t_cpu, 3), round(peak, 1), round(generate_cpu_s, 3),
                      round(load, 2))


def _child(workload: str, n: int, trace: Path, seed: int, generate_cpu_s: float,
           conn: Any) -> None:
    try:
        conn.send(("ok", asdict(run_point(workload, n, trace, seed, generate_cpu_s))))
    except BaseException as e:  # noqa: BLE001 - reported by the parent, with its type
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def run(points: Iterable[tuple[str, int]], seed: int = 0,
        out: Path | None = None, progress: Progress = QUIET) -> Iterator[dict[str, Any]]:
    """Every point in a fresh child process (spawned: nothing inherited but the code), one
    after another; each row is yielded as it finishes and, with ``out``, appended to
    ``out`` as a JSON line."""
    ctx = mp.get_context("spawn")
    todo = list(points)
    for i, (workload, n) in enumerate(todo):
        progress(i, len(todo))
        with tempfile.TemporaryDirectory(prefix="tangram-sim-scale-") as tmp:
            progress.phase(f"{workload} x {n}: generating the trace")
            trace, generate_cpu_s = write_trace(workload, n, seed, Path(tmp))
            progress.phase(f"{workload} x {n}: simulating it and its floor")
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child,
                               args=(workload, n, trace, seed, generate_cpu_s, child))
            proc.start()
            child.close()
            status, value = parent.recv()
            proc.join()
        if status != "ok":
            raise RuntimeError(f"sim-scale {workload} x {n}: {value}")
        if out is not None:
            with out.open("a") as f:
                f.write(json.dumps(value) + "\n")
        progress(i + 1, len(todo))
        yield value


def command(
    points: Annotated[str, Opt(
        "workload:trajectories pairs, comma-separated (default: coding at 2048, 8192, "
        "32768, 65536 and mopd at 2048, 16384 — the full run takes tens of minutes)")]
    = ",".join(f"{w}:{n}" for w, n in POINTS),
    seed: int = 0,
    out: Annotated[Path | None, Opt("Also append each row to this JSON-lines file.")] = None,
    progress: Progress = QUIET,
) -> Iterator[dict[str, Any]]:
    """Actions per CPU-second, the ratio to the floor (the figure that holds across
    machines), the core's share, peak RSS (JSON lines, one per point, each point in a
    fresh process)."""
    from traces.generate import WORKLOADS

    try:
        chosen = [(w.strip(), int(n)) for w, n in (p.split(":") for p in points.split(",") if p)]
    except ValueError:
        raise BenchError(f"--points: expected workload:trajectories,..., got {points!r}") from None
    for w, n in chosen:
        if w not in WORKLOADS or n < 1:
            raise BenchError(f"--points: {w}:{n}: workload one of {sorted(WORKLOADS)}, "
                             "trajectories >= 1")
    yield from run(chosen, seed, out, progress)
