"""`tangram bench gpu-target`: the GPU target, simulated: burst MOPD on the paper's cluster
under tangram, tangram-paper, static (every teacher on 4 GPUs) and serverless, and the
verdict (Tangram's mean ACT at most static's, restore overhead at most 0.25 and not
growing with the batch size)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Annotated, Any

from analysis.bench import QUIET, BenchError, Opt, Progress
from analysis.experiments import Job, run_jobs

#: the issue's GPU target: on the paper's cluster, burst MOPD at these batch sizes
GPU_TARGET_BATCHES = (256, 1024, 2048)
GPU_TARGET_POLICIES = ("tangram", "tangram-paper", "static", "serverless")


def gpu_target_jobs(batches: Iterable[int] = GPU_TARGET_BATCHES, seeds: Iterable[int] = (0,),
                    think_scale: float = 1.0, arrival: str = "burst") -> list[Job]:
    """Burst MOPD on the paper's cluster under every GPU policy. ``think_scale`` < 1
    compresses the generations (the same requests in less time: a harder burst)."""
    return [Job("gpu_target", "mopd", b, p, "paper", seed=seed, think_scale=think_scale,
                arrival=arrival, tags=(("x", b), ("think_scale", think_scale)))
            for seed in seeds for b in batches for p in GPU_TARGET_POLICIES]


def gpu_target_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the target holds: per seed and batch, Tangram's mean ACT at most static's,
    restore overhead at most 0.25 and not growing with the batch size."""
    by = {(r["seed"], r["trajectories"], r["policy"]): r for r in rows}
    failures = []
    for seed in sorted({r["seed"] for r in rows}):
        sizes = sorted({r["trajectories"] for r in rows if r["seed"] == seed})
        prev = None
        for n in sizes:
            t, s = by.get((seed, n, "tangram")), by.get((seed, n, "static"))
            if t is None or s is None:
                continue
            if not t["act_mean_s"] <= s["act_mean_s"]:
                failures.append(f"seed {seed}, {n}: ACT {t['act_mean_s']:.3f} s > static "
                                f"{s['act_mean_s']:.3f} s")
            if not t["restore_overhead"] <= 0.25:
                failures.append(f"seed {seed}, {n}: restore overhead {t['restore_overhead']:.3f}")
            if prev is not None and t["restore_overhead"] > prev + 0.02:
                failures.append(f"seed {seed}, {n}: restore overhead grew "
                                f"{prev:.3f} -> {t['restore_overhead']:.3f}")
            prev = t["restore_overhead"]
    return {"verdict": "met" if not failures else "not met", "failures": failures}


def command(
    trajectories: Annotated[str, Opt("Batch sizes, comma-separated.")] = "256,1024,2048",
    seeds: Annotated[str, Opt("Trace seeds, comma-separated.")] = "0",
    think_scale: Annotated[float, Opt(
        "Scale generation times (< 1: the same requests in less time).", min=0.01)] = 1.0,
    arrival: Annotated[str, Opt("burst | spread")] = "burst",
    workers: Annotated[int, Opt("Parallel simulations.", min=1)] = 2,
    progress: Progress = QUIET,
) -> Iterator[dict[str, Any]]:
    """One JSON line per run, then the verdict (Tangram's mean ACT <= static's, restore
    overhead <= 0.25, not growing)."""
    try:
        sizes = [int(x) for x in trajectories.split(",") if x.strip()]
        seed_list = [int(x) for x in seeds.split(",") if x.strip()]
        jobs = gpu_target_jobs(sizes, seed_list, think_scale, arrival)
    except ValueError as e:
        raise BenchError(str(e)) from None
    keep = ("seed", "trajectories", "policy", "act_mean_s", "act_p99_s", "queue_mean_s",
            "exec_mean_s", "restores", "restore_overhead", "gpu_busy", "error")
    rows = run_jobs(jobs, workers, progress)
    for row in rows:
        yield {k: row[k] for k in keep if k in row}
    yield gpu_target_verdict(rows)
