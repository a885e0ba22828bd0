"""`tangram bench ...`: benchmarks that print their figures as JSON lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from analysis.bench.adapters import main as adapters_main
from analysis.bench.executor import executor_bench, ray_executor_bench, serve_bench
from analysis.bench.gpu import gpu_bench
from analysis.bench.scheduler import learning_bench, scheduler_bench, simulate_bench
from analysis.bench.sim_scale import POINTS as SCALE_POINTS
from analysis.bench.sim_scale import run as scale_run
from analysis.experiments import gpu_target_jobs, gpu_target_verdict, run_jobs
from tangram_cli.common import command_app, fail
from tangram_cli.options import RAY_HELP, check_gpu_device, ray_spec
from traces.generate import WORKLOADS

app = command_app(help="Benchmarks that print their figures as JSON lines.", no_args_is_help=True)


def _emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


@app.command("scheduler")
def bench_scheduler(
    actions: Annotated[int, typer.Option(help="Queued actions per scenario.")] = 2048,
    seed: int = 0,
) -> None:
    """Scheduling pass latency and dispatch throughput on one core (JSON lines)."""
    for row in scheduler_bench(actions, seed):
        _emit(row)


@app.command("regret")
def bench_regret(
    out: Annotated[Path, typer.Option(help="Directory for regret.json and regret.png.")]
    = Path("runs/regret"),
    seeds: Annotated[str | None, typer.Option(
        help="Trace seeds, comma-separated (default: 1009,2027,3041, used nowhere else).")] = None,
    workloads: Annotated[str | None, typer.Option(
        help="Workloads, comma-separated (default: coding,deepsearch,mopd,mixed).")] = None,
    full: Annotated[bool, typer.Option(
        "--full", help="The paper's batch sizes and node shape, every profile error "
                       "(hours). Default: the quick scale (minutes).")] = False,
    workers: Annotated[int, typer.Option(min=1, help="Parallel simulations.")] = 2,
) -> None:
    """The regret matrix: per cell (workload x seed x cluster x arrival rate x profile
    error) and metric (mean ACT, p99 ACT, step time, reward time), the default policy's
    figure over the best competitor's (every policy of `tangram policies`, fixed DoP
    1-16, k8s pod cores x in-pod -n, static GPU splits, tangram-paper, one ablation per
    GPU extension), and which competitor that was. One JSON line per cell, then the
    summary; regret.json and a heat map (regret.png) in --out."""
    import time

    from analysis.regret import heatmap, report, run_matrix, scale_for

    try:
        sc = scale_for(full, [int(x) for x in seeds.split(",") if x.strip()] if seeds else None,
                       [w.strip() for w in workloads.split(",") if w.strip()]
                       if workloads else None)
    except ValueError as e:
        fail(f"bench regret: {e}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--out: cannot create {out}: {e}")
    t0 = time.perf_counter()
    rows = []
    for row in run_matrix(sc, workers):
        rows.append(row)
        _emit({k: v for k, v in row.items() if k != "runs"})
    doc = report(rows, sc, round(time.perf_counter() - t0, 1))
    (out / "regret.json").write_text(json.dumps(doc, indent=1) + "\n")
    heatmap(rows, str(out / "regret.png"))
    _emit({"summary": doc["summary"], "losses": len(doc["losses"]),
           "regret_json": str(out / "regret.json"), "figure": str(out / "regret.png"),
           "elapsed_s": doc["elapsed_s"]})


@app.command("gpu-target")
def bench_gpu_target(
    trajectories: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")]
    = "256,1024,2048",
    seeds: Annotated[str, typer.Option(help="Trace seeds, comma-separated.")] = "0",
    think_scale: Annotated[float, typer.Option(
        min=0.01, help="Scale generation times (< 1: the same requests in less time).")] = 1.0,
    arrival: Annotated[str, typer.Option(help="burst | spread")] = "burst",
    workers: Annotated[int, typer.Option(min=1, help="Parallel simulations.")] = 2,
) -> None:
    """The GPU target: burst MOPD on the paper's cluster under tangram, tangram-paper,
    static (every teacher on 4 GPUs) and serverless, one JSON line per run, then the
    verdict (Tangram's mean ACT <= static's, restore overhead <= 0.25, not growing)."""
    try:
        sizes = [int(x) for x in trajectories.split(",") if x.strip()]
        seed_list = [int(x) for x in seeds.split(",") if x.strip()]
        jobs = gpu_target_jobs(sizes, seed_list, think_scale, arrival)
    except ValueError as e:
        fail(f"bench gpu-target: {e}")
    keep = ("seed", "trajectories", "policy", "act_mean_s", "act_p99_s", "queue_mean_s",
            "exec_mean_s", "restores", "restore_overhead", "gpu_busy", "error")
    rows = run_jobs(jobs, workers)
    for row in rows:
        _emit({k: row[k] for k in keep if k in row})
    _emit(gpu_target_verdict(rows))


@app.command("learning")
def bench_learning(
    seeds: Annotated[int, typer.Option(min=1, help="Repetitions per curve.")] = 20,
) -> None:
    """Runs the online speedup model needs to come within 10% of the true curve (JSON lines):
    per command with the kind as prior (counted in that command's runs and in the kind's),
    and per kind alone."""
    for row in learning_bench(seeds):
        _emit(row)


@app.command("sim-scale")
def bench_sim_scale(
    points: Annotated[str, typer.Option(
        help="workload:trajectories pairs, comma-separated (default: coding at 2048, 8192, "
             "32768, 65536 and mopd at 2048, 16384 — the full run takes tens of minutes)")]
    = ",".join(f"{w}:{n}" for w, n in SCALE_POINTS),
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="Also append each row to this JSON-lines file.")]
    = None,
) -> None:
    """The simulator's cost at fleet scale beside a bare SimPy model of the same trace and
    closed loop, run in the same process (the floor): actions per CPU-second, the ratio to
    the floor (the figure that holds across machines), the core's share, peak RSS (JSON
    lines, one per point, each point in a fresh process)."""
    try:
        chosen = [(w.strip(), int(n)) for w, n in (p.split(":") for p in points.split(",") if p)]
    except ValueError:
        fail(f"bench sim-scale: --points: expected workload:trajectories,..., got {points!r}")
    for w, n in chosen:
        if w not in WORKLOADS or n < 1:
            fail(f"bench sim-scale: --points: {w}:{n}: workload one of {sorted(WORKLOADS)}, "
                 "trajectories >= 1")
    scale_run(chosen, seed, out, emit=_emit)


@app.command("simulate")
def bench_simulate(
    trajectories: Annotated[int, typer.Option(help="Trajectories in the AI-coding batch.")] = 2048,
    seed: int = 0,
) -> None:
    """Wall time of one paper-scale AI-coding step on the paper's CPU cluster (JSON)."""
    _emit(simulate_bench(trajectories, seed))


@app.command("executor")
def bench_executor(
    backend: Annotated[str, typer.Option(help="process, docker or all.")] = "all",
    actions: Annotated[int, typer.Option(min=5, help="Short actions timed per backend.")] = 60,
    ray: Annotated[str | None, typer.Option(help=RAY_HELP + " Compares local vs via agents.")] = None,
) -> None:
    """Per-action overhead of the live backends: submit->start, end->result (JSON lines).

    With --ray: the same figures on this machine's executor and through Ray node agents
    (p50/p99), plus dispatch throughput across the nodes.
    """
    if ray is not None:
        name = "process" if backend == "all" else backend
        ray_spec(ray)
        try:
            rows = ray_executor_bench(ray, name, actions)
        except (ConnectionError, RuntimeError) as e:
            fail(str(e))
        for row in rows:
            _emit(row)
        return
    for name in (("process", "docker") if backend == "all" else (backend,)):
        _emit(executor_bench(name, actions))


@app.command("serve")
def bench_serve(
    backend: Annotated[str, typer.Option(help="process or docker.")] = "process",
    trajectories: Annotated[int, typer.Option(min=1, help="Concurrent trajectories.")] = 64,
    actions: Annotated[int, typer.Option(min=1, help="Trivial actions per trajectory.")] = 5,
    warm_pool: Annotated[int, typer.Option(min=0, help="docker: the server's --warm-pool.")] = 0,
) -> None:
    """Load on a real `tangram serve`: server CPU per action, throughput, first-action
    latency, RSS over the run (one JSON line). For a soak: many actions, e.g.
    --trajectories 200 --actions 100 (20,000 actions)."""
    _emit(serve_bench(backend, trajectories, actions, warm_pool))


@app.command("serve-scale")
def bench_serve_scale(
    trajectories: Annotated[int, typer.Option(min=1, help="Concurrent trajectories.")] = 2048,
    actions: Annotated[int, typer.Option(min=1, help="Trivial actions per trajectory.")] = 30,
    every: Annotated[float, typer.Option(min=0.5, help="Seconds between samples.")] = 10.0,
    clients: Annotated[int, typer.Option(
        min=1, help="Client processes the trajectories are spread over (as rollout workers; "
                    "one asyncio client cannot drive thousands of connections).")] = 8,
) -> None:
    """One paper-scale RL step through a real `tangram serve` (process backend): by
    default 2,048 trajectories x 30 trivial actions (`true`) at once. Prints a JSON line
    every --every seconds (actions done, actions/s and server CPU per action in the
    interval, server RSS), then the run's summary (`tangram bench serve`'s figures, the
    timeline, and how much the server's RSS grew from the first sample to the end).
    Takes minutes: the actions run on this machine's cores."""
    def show(row: dict) -> None:
        _emit({"sample": True, **row})

    _emit(serve_bench("process", trajectories, actions, every_s=every, on_sample=show,
                      clients=clients))


@app.command("gpu")
def bench_gpu(
    device: Annotated[str, typer.Option(help="cuda or cpu.")] = "cpu",
    sizes_gb: Annotated[str | None, typer.Option(
        help="Service sizes (GB), comma-separated. Default: 1,3,8 on cuda; 0.02,0.05,0.1 on cpu.")] = None,
    batches: Annotated[str, typer.Option(help="Request batch sizes.")] = "1,8,32",
    tokens: Annotated[int, typer.Option(min=2, help="Tokens per sequence of a request.")] = 128,
    cycles: Annotated[int, typer.Option(min=1, help="Restore cycles over all services.")] = 3,
) -> None:
    """Restore GB/s per service size (beside a plain host-to-device copy), evict latency,
    request latency per batch size, NVML readings on cuda (JSON)."""
    check_gpu_device(device)
    try:
        sizes = [float(x) for x in (sizes_gb or ("1,3,8" if device == "cuda" else
                                                 "0.02,0.05,0.1")).split(",")]
        batch = [int(x) for x in batches.split(",")]
    except ValueError:
        fail("--sizes-gb/--batches: comma-separated numbers")
    _emit(gpu_bench(device, sizes, batch, tokens, cycles))


@app.command("adapters")
def bench_adapters(
    backend: Annotated[str, typer.Option(help="Backend of the server it starts.")] = "process",
    calls: Annotated[int, typer.Option(min=10, help="Calls timed per path.")] = 200,
) -> None:
    """Per-call overhead of the verl, gymnasium and SkyRL adapters over the plain client (JSON)."""
    adapters_main(["--backend", backend, "--calls", str(calls)])


@app.command("live-mix")
def bench_live_mix(
    policies: Annotated[str, typer.Option(
        help="Policies, comma-separated; the first is compared with the others.")]
    = "tangram,fixed-dop:1,fixed-dop:2",
    trajectories: Annotated[int, typer.Option(min=1, help="Concurrent trajectories.")] = 8,
    cores: Annotated[int, typer.Option(min=1, help="Cores the server is pinned to.")] = 2,
    shorts: Annotated[int, typer.Option(min=2, help="Short commands per trajectory.")] = 6,
    think_s: Annotated[float, typer.Option(min=0.0, help="Mean think time between actions.")]
    = 1.0,
    modules: Annotated[str | None, typer.Option(
        help="Reward test modules (sympy's), comma-separated; default: four of a few "
             "seconds each on an idle core.")] = None,
    seed: int = 0,
) -> None:
    """A real test suite (sympy's own test modules, one per trajectory as its reward)
    beside short shell commands, through a real `tangram serve --backend process` pinned
    to --cores, under each policy in turn: makespan, the short commands' queue wait
    (mean/p99/max; light ones and those importing sympy apart), the rewards' wait, time and
    cores, and the machine's load (one JSON line per policy, then a summary). Takes
    minutes: the tests really run."""
    from analysis.bench.live_mix import REWARD_MODULES, check, live_mix_bench
    from tangram.policies import make_policy

    names = tuple(p.strip() for p in policies.split(",") if p.strip())
    try:
        for name in names:
            make_policy(name)
        check(cores)
        for row in live_mix_bench(names, trajectories, cores, shorts, seed, think_s,
                                  tuple(m.strip() for m in modules.split(",")) if modules
                                  else REWARD_MODULES):
            _emit(row)
    except (ValueError, RuntimeError) as e:
        fail(f"bench live-mix: {e}")


@app.command("fork")
def bench_fork(
    size: Annotated[int, typer.Option(min=1, max=65, help="Rollouts per group.")] = 8,
    rounds: Annotated[int, typer.Option(min=1, help="Groups played each way.")] = 3,
    backend: Annotated[str, typer.Option(help="process or docker.")] = "process",
) -> None:
    """A GRPO group on a real `tangram serve` (process or docker backend): every rollout preparing
    its sandbox (git clone of a local repository + pip install of a local wheel, offline)
    against one preparation forked into the others. One JSON line: open-to-first-action
    per rollout, the group's total CPU, the fork's method and seconds per copy."""
    from analysis.bench.fork import fork_bench

    if backend not in ("process", "docker"):
        fail(f"bench fork: --backend must be process or docker, got {backend!r}")
    _emit(fork_bench(size, rounds, backend))


@app.command("fork-sim")
def bench_fork_sim(
    trajectories: Annotated[int, typer.Option(min=1, help="Coding trajectories.")] = 1024,
    group: Annotated[int, typer.Option(min=2, max=65, help="Rollouts per GRPO group.")] = 8,
    cluster: Annotated[str, typer.Option(help="Cluster YAML or built-in name.")] = "paper",
    fork_s: Annotated[float | None, typer.Option(
        min=0, help="Seconds per copy (default: the cluster file's measured extra.fork_s).")] = None,
    seed: int = 0,
) -> None:
    """The coding workload in GRPO groups, simulated with and without forking the prepared
    sandbox, on the whole cluster and on one CPU node (oversubscribed): env time per
    trajectory, step time, mean ACT, first agent action, core-seconds of preparation
    (JSON lines)."""
    from analysis.bench.fork_sim import fork_sim_rows

    try:
        for row in fork_sim_rows(trajectories, group, cluster, seed=seed, fork_s=fork_s):
            _emit(row)
    except ValueError as e:
        fail(f"bench fork-sim: {e}")
