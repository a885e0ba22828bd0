"""The `tangram` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="Tangram: action-level scheduling of the external resources of agentic RL "
         "(CPU sandboxes, GPU reward/teacher models, rate-limited APIs).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
trace_app = typer.Typer(help="Validate and generate workload traces.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print their figures as JSON lines.",
                        no_args_is_help=True)
image_app = typer.Typer(help="The local Docker image the docker backend runs in.",
                        no_args_is_help=True)
app.add_typer(trace_app, name="trace")
app.add_typer(bench_app, name="bench")
app.add_typer(image_app, name="image")

out_console = Console()
err = Console(stderr=True)

SAMPLES = Path(__file__).parent / "traces" / "samples"


def fail(message: str, code: int = 2) -> None:
    """Report a user error without a traceback."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _default_trace() -> Path:
    return SAMPLES / "coding.parquet"


# -- the policy options `simulate`, `run` and `serve` share (same names, same meaning) -------
PolicyOpt = Annotated[str, typer.Option(
    help="Scheduling policy (see `tangram policies`): tangram, tangram-paper, k8s, static, "
         "serverless, fixed-dop:N, per-trajectory-api, baseline.")]
DepthOpt = Annotated[int, typer.Option(min=0, help="Alg. 1 depth (remaining actions that explore).")]
LookaheadOpt = Annotated[int, typer.Option(min=1, help="Alg. 2: queued actions the objective simulates.")]
OrderingOpt = Annotated[str, typer.Option(
    help="Queue order: fcfs, or sef (shortest expected first, aging-bounded).")]
PodCoresOpt = Annotated[int, typer.Option(min=1, help="k8s/baseline: cores per trajectory pod.")]
GpuDopOpt = Annotated[int | None, typer.Option(help="static/serverless: GPUs per instance.")]
POLICY_OPTIONS = ("policy", "depth", "lookahead", "ordering", "pod_cores", "gpu_dop")


def _policy(policy: str, depth: int, lookahead: int, ordering: str, pod_cores: int,
            gpu_dop: int | None):
    from tangram.policies import make_policy

    try:
        return make_policy(policy, {"depth": depth, "lookahead": lookahead, "ordering": ordering,
                                    "pod_cores": pod_cores, "gpu_dop": gpu_dop})
    except ValueError as e:
        fail(str(e))


@app.command()
def simulate(
    trace: Annotated[Path | None, typer.Option(
        help="Trace (.parquet/.csv/.jsonl). Default: the shipped AI-coding sample.")] = None,
    cluster: Annotated[str | None, typer.Option(
        help="Cluster YAML, or a built-in name (default, paper).")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Output directory (default runs/<trace>-<policy>).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the modelled overheads.")] = 0,
    limit: Annotated[int | None, typer.Option(
        min=1, help="Simulate only the first N trajectories (as `run --limit`).")] = None,
    think_scale: Annotated[float, typer.Option(
        min=0, help="Multiply think times (0: none), as `run --think-scale`.")] = 1.0,
    steps: Annotated[int, typer.Option(min=1, help="RL steps: the trace's batch replayed N times.")] = 1,
    train_s: Annotated[float, typer.Option(min=0, help="Training time per RL step (s).")] = 0.0,
    asynchronous: Annotated[bool, typer.Option(
        "--async", help="Overlap training with the next rollout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or table.")] = False,
    policy: PolicyOpt = "tangram",
    depth: DepthOpt = 2,
    lookahead: LookaheadOpt = 32,
    ordering: OrderingOpt = "fcfs",
    pod_cores: PodCoresOpt = 4,
    gpu_dop: GpuDopOpt = None,
) -> None:
    """Simulate a trace on a cluster under one policy (virtual time, same scheduler as live).

    Writes summary.json, actions.parquet, timing.parquet, trace.json (Chrome/Perfetto),
    utilisation.parquet and config.json to --out.
    """
    from analysis.runs import simulate as run_sim
    from sim.cluster import load_cluster
    from tangram.cluster import ClusterError
    from traces.schema import TraceError, load
    from traces.select import head, scale_think

    trace = trace or _default_trace()
    try:
        spec = load_cluster(cluster)
        df = scale_think(head(load(trace), limit), think_scale)
    except (TraceError, ClusterError) as e:
        fail(str(e))
    _policy(policy, depth, lookahead, ordering, pod_cores, gpu_dop)  # bad options: exit 2
    options = {"depth": depth, "lookahead": lookahead, "ordering": ordering,
               "pod_cores": pod_cores, "gpu_dop": gpu_dop}
    out = out or Path("runs") / f"{trace.stem}-{policy.replace(':', '')}"
    try:
        run_ = _with_progress(
            lambda cb: run_sim(df, spec, policy, seed=seed, steps=steps, train_s=train_s,
                               asynchronous=asynchronous, out=out, progress=cb,
                               source=str(trace),
                               extra_config={"limit": limit, "think_scale": think_scale},
                               **options),
            quiet, f"simulating {trace.name} under {policy}")
    except ValueError as e:
        fail(str(e))
    if not quiet:
        _print_summary(run_.summary)
    out_console.print(f"wrote {out}/ (summary.json, actions.parquet, trace.json)")


def _settle() -> None:
    """Long runs: freeze everything imports created so the cyclic GC stops rescanning
    it (tens of milliseconds a full collection otherwise)."""
    import gc

    gc.collect()
    gc.freeze()


def _with_progress(work, quiet: bool, label: str):
    _settle()
    if quiet:
        return work(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task(label, total=None)

        def cb(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return work(cb)


def _print_summary(s: dict) -> None:
    table = Table(title=f"policy {s['policy']}: {s['actions']} actions, "
                        f"{s['trajectories']} trajectories")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("act_mean_s", "act_p50_s", "act_p99_s", "queue_mean_s", "exec_mean_s",
                "step_time_s", "restore_mean_s", "failed"):
        v = s[key]
        table.add_row(key, f"{v:.3f}" if isinstance(v, float) else str(v))
    for res, u in s["utilisation"].items():
        parts = [f"{k} {u[k]:.1%}" for k in ("allocated", "busy") if k in u]
        table.add_row(f"utilisation {res}", " ".join(parts) or "-")
    out_console.print(table)


@app.command()
def policies() -> None:
    """List the scheduling policies `simulate`, `run` and `serve` accept (--policy)."""
    from tangram.policies import REGISTRY

    table = Table()
    table.add_column("policy")
    table.add_column("what it models")
    table.add_column("API calls admitted by")
    for name, cls in REGISTRY.items():
        table.add_row(name, cls.description, cls.api_admission)
    out_console.print(table)


@trace_app.command("validate")
def trace_validate(path: Path, cluster: Annotated[str | None, typer.Option(
        help="Also check that every action fits this cluster (YAML or built-in name).")] = None) -> None:
    """Exit 0 when PATH is a valid trace; else exit 2 listing every problem."""
    from sim.cluster import load_cluster
    from tangram.cluster import ClusterError
    from tangram.core import Tangram
    from traces.fit import misfits
    from traces.schema import TraceError, load, trajectories

    try:
        df = load(path)
        if cluster:
            spec = load_cluster(cluster)
            problems = misfits(Tangram(spec), trajectories(df))
            if problems:
                raise TraceError(problems)
    except (TraceError, ClusterError) as e:
        fail(str(e))
    out_console.print(f"{path}: valid ({len(df)} actions, {df['trajectory'].nunique()} trajectories)")


@trace_app.command("generate")
def trace_generate(
    workload: Annotated[str, typer.Option(help="coding | deepsearch | mopd | mixed")],
    out: Annotated[Path, typer.Option(help="Output file; format from the extension.")],
    trajectories: Annotated[int, typer.Option(min=1, help="Trajectories in the batch.")] = 256,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    arrival: Annotated[str | None, typer.Option(
        help="mopd / mixed: 'burst' (default; every trajectory starts together and sends "
             "its teacher request when its own generation ends) or 'spread' (starts spread "
             "over ~20 min by the Azure trace's inter-arrival gaps).")] = None,
) -> None:
    """Generate a calibrated synthetic trace (sources in traces/README.md)."""
    from traces.generate import generate
    from traces.schema import TraceError, write

    try:
        df = generate(workload, trajectories, seed, arrival)
        write(df, out)
    except (ValueError, TraceError) as e:
        fail(str(e))
    out_console.print(f"wrote {out} ({len(df)} actions, {trajectories} trajectories)")


@bench_app.command("scheduler")
def bench_scheduler(
    actions: Annotated[int, typer.Option(help="Queued actions per scenario.")] = 2048,
    seed: int = 0,
) -> None:
    """Scheduling pass latency and dispatch throughput on one core (JSON lines)."""
    from sim.bench import scheduler_bench

    for row in scheduler_bench(actions, seed):
        print(json.dumps(row), flush=True)


@bench_app.command("gpu-target")
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
    from analysis.experiments import gpu_target_jobs, gpu_target_verdict, run_jobs

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
        print(json.dumps({k: row[k] for k in keep if k in row}), flush=True)
    print(json.dumps(gpu_target_verdict(rows)), flush=True)


@bench_app.command("learning")
def bench_learning(
    seeds: Annotated[int, typer.Option(min=1, help="Repetitions per curve.")] = 20,
) -> None:
    """Runs the online speedup model needs to come within 10% of the true curve (JSON lines)."""
    from sim.bench import learning_bench

    for row in learning_bench(seeds):
        print(json.dumps(row), flush=True)


@bench_app.command("simulate")
def bench_simulate(
    trajectories: Annotated[int, typer.Option(help="Trajectories in the AI-coding batch.")] = 2048,
    seed: int = 0,
) -> None:
    """Wall time of one paper-scale AI-coding step on the paper's CPU cluster (JSON)."""
    from sim.bench import simulate_bench

    print(json.dumps(simulate_bench(trajectories, seed)), flush=True)


@app.command()
def reproduce(
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("runs/reproduce"),
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes (<= 5 min on 2 cores).")] = False,
    only: Annotated[list[str], typer.Option(help="Run only these experiments (repeatable).")] = [],  # noqa: B006
    workers: Annotated[int, typer.Option(min=1, help="Parallel simulations.")] = 2,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
) -> None:
    """Reproduce the paper's studies (Figs. 6-9, Table 1) and ours beyond it.

    Writes results.json (paper vs ours), report.md, report.html and figures/ to --out.
    """
    from analysis.reproduce import reproduce as run_all

    try:
        results = _with_progress(lambda cb: run_all(out, quick, only or None, workers, cb),
                                 quiet, "reproducing")
    except ValueError as e:
        fail(str(e))
    if not quiet:
        table = Table(title="paper vs ours")
        for col in ("figure", "paper", "ours", "unit"):
            table.add_column(col)
        for r in results:
            table.add_row(r["name"], str(r["paper"] if r["paper"] is not None else "-"),
                          "n/a" if r["ours"] is None else f"{r['ours']:.3g}", r["unit"])
        out_console.print(table)
    out_console.print(f"wrote {out}/ (results.json, report.md, report.html, figures/)")


@app.command()
def plot(
    runs: Annotated[list[Path], typer.Argument(help="Run directories (from simulate or run).")],
    out: Annotated[Path | None, typer.Option(help="Where figures go (default: first run/figures).")] = None,
) -> None:
    """Draw the standard figures for a set of runs: ACT CDF, ACT per kind, where the time
    goes, allocation over time (the same functions notebooks call: analysis/figures.py)."""
    from analysis import figures
    from analysis.runs import RunError, load_run

    try:
        loaded = [load_run(run_dir) for run_dir in runs]
    except RunError as e:
        fail(str(e))
    names = [r.name for r in loaded]
    if len(set(names)) != len(names):  # e.g. a/run and b/run: label them by their path
        loaded = [load_run(run_dir, name=str(run_dir)) for run_dir in runs]
    for p in figures.standard(loaded, out or runs[0] / "figures"):
        out_console.print(f"wrote {p}")


@app.command(context_settings={"allow_interspersed_args": True})
def burn(
    t1: Annotated[float, typer.Option("--t1", min=0,
                                      help="CPU seconds of the whole action on one core.")],
    parallel_fraction: Annotated[float, typer.Option(
        "--parallel-fraction", "-p", min=0, max=1, help="Amdahl parallel fraction.")] = 0.0,
    numprocesses: Annotated[int, typer.Option(
        "--numprocesses", "-n", min=1, help="Processes for the parallel part.")] = 1,
    exit_code: Annotated[int, typer.Option(min=0, max=255,
                                           help="Exit status after the work.")] = 0,
) -> None:
    """Burn CPU like a test suite: t1*(1-p) CPU seconds serially, then t1*p split over -n
    processes (wall time on k free cores: t1*((1-p)+p/k)).

    `tangram run` runs this for trace rows that name no command; the executor rewrites
    an elastic action's command to `-n <granted cores>`, as it does `pytest`.
    """
    from executor.burn import burn as run_burn

    code = run_burn(t1, parallel_fraction, numprocesses)
    raise typer.Exit(code or exit_code)


@app.command()
def compare(
    runs: Annotated[list[Path], typer.Argument(
        help="Two or more run directories (from simulate or run); the first is the reference.")],
    out: Annotated[Path | None, typer.Option(
        help="Where compare.json and the figure go (default: FIRST/compare).")] = None,
) -> None:
    """Mean/p50/p99 ACT, queueing, execution and makespan of runs side by side, with the
    % difference from the first run, and `same_units`: the share of the actions both ran
    that got the same number of units (did a simulation make the live run's decisions?)."""
    from analysis.compare import figure, table
    from analysis.runs import RunError, load_run

    if len(runs) < 2:
        fail("compare: give at least two run directories")
    try:
        loaded = [load_run(r) for r in runs]
        if len({r.name for r in loaded}) < len(loaded):  # same leaf names: whole paths
            loaded = [load_run(r, name=str(r)) for r in runs]
        frame = table(loaded)
    except (RunError, ValueError, OSError) as e:
        fail(str(e))
    out = out or runs[0] / "compare"
    out.mkdir(parents=True, exist_ok=True)
    frame.to_json(out / "compare.json", orient="records", indent=1)
    shown = Table(title=f"compare (% vs {loaded[0].name})")
    for col in frame.columns:
        shown.add_column(str(col), justify="left" if col == "metric" else "right")
    for row in frame.itertuples(index=False):
        shown.add_row(*("-" if isinstance(v, float) and v != v else
                        f"{v:+.1f}%" if str(c).startswith("%") else
                        f"{v:.4g}" if isinstance(v, float) else str(v)
                        for c, v in zip(frame.columns, row, strict=True)))
    out_console.print(shown)
    path = figure(loaded, out)
    out_console.print(f"wrote {out / 'compare.json'} and {path}")


@bench_app.command("executor")
def bench_executor(
    backend: Annotated[str, typer.Option(help="process, docker or all.")] = "all",
    actions: Annotated[int, typer.Option(min=5, help="Short actions timed per backend.")] = 60,
    ray: Annotated[str | None, typer.Option(help=RAY_HELP + " Compares local vs via agents.")] = None,
) -> None:
    """Per-action overhead of the live backends: submit->start, end->result (JSON lines).

    With --ray: the same figures on this machine's executor and through Ray node agents
    (p50/p99), plus dispatch throughput across the nodes.
    """
    from executor.bench import executor_bench

    if ray is not None:
        from executor.bench import ray_executor_bench

        name = "process" if backend == "all" else backend
        _ray_spec(ray)
        try:
            rows = ray_executor_bench(ray, name, actions)
        except (ConnectionError, RuntimeError) as e:
            fail(str(e))
        for row in rows:
            print(json.dumps(row), flush=True)
        return
    for name in (("process", "docker") if backend == "all" else (backend,)):
        print(json.dumps(executor_bench(name, actions)), flush=True)


@bench_app.command("serve")
def bench_serve(
    backend: Annotated[str, typer.Option(help="process or docker.")] = "process",
    trajectories: Annotated[int, typer.Option(min=1, help="Concurrent trajectories.")] = 64,
    actions: Annotated[int, typer.Option(min=1, help="Trivial actions per trajectory.")] = 5,
    warm_pool: Annotated[int, typer.Option(min=0, help="docker: the server's --warm-pool.")] = 0,
) -> None:
    """Load on a real `tangram serve`: server CPU per action, throughput, first-action
    latency, RSS over the run (one JSON line). For a soak: many actions, e.g.
    --trajectories 200 --actions 100 (20,000 actions)."""
    from executor.bench import serve_bench

    print(json.dumps(serve_bench(backend, trajectories, actions, warm_pool)), flush=True)


@bench_app.command("gpu")
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
    from executor.gpu.bench import gpu_bench

    _check_gpu_device(device)
    try:
        sizes = [float(x) for x in (sizes_gb or ("1,3,8" if device == "cuda" else
                                                 "0.02,0.05,0.1")).split(",")]
        batch = [int(x) for x in batches.split(",")]
    except ValueError:
        fail("--sizes-gb/--batches: comma-separated numbers")
    print(json.dumps(gpu_bench(device, sizes, batch, tokens, cycles)), flush=True)


@bench_app.command("adapters")
def bench_adapters(
    backend: Annotated[str, typer.Option(help="Backend of the server it starts.")] = "process",
    calls: Annotated[int, typer.Option(min=10, help="Calls timed per path.")] = 200,
) -> None:
    """Per-call overhead of the verl, gymnasium and SkyRL adapters over the plain client (JSON)."""
    from executor.bench_adapters import main as adapters_main

    adapters_main(["--backend", backend, "--calls", str(calls)])


RAY_HELP = ("Run on a Ray cluster, one agent per node: auto (the cluster this machine "
            "joined with `ray start`), a Ray address (HOST:PORT or ray://HOST:PORT), or "
            "local:N (start N nodes on this machine, splitting its cores). Needs the ray extra.")


def _ray_spec(text: str):
    """Check --ray before anything starts: exit 2 without Ray or with a bad value."""
    from executor.ray_cluster import RaySpec, RayUnavailable, require_ray

    try:
        spec = RaySpec.parse(text)
        require_ray()
    except (ValueError, RayUnavailable) as e:
        fail(str(e))
    return spec


def _ray_backend(text: str, backend: str):
    """Connect to Ray and start one agent per node (exit 2 when that cannot be done)."""
    from executor.ray_backend import RayBackend
    from executor.ray_cluster import connect

    spec = _ray_spec(text)
    try:
        conn = connect(spec)
    except ConnectionError as e:
        fail(str(e))
    try:
        return RayBackend(conn, backend, owns_connection=True)
    except (RuntimeError, ValueError) as e:
        conn.close()
        fail(str(e))


def _quota_specs(items: list[str]):
    from tangram.cluster import QuotaSpec
    from tangram.model import quota_resource

    out = []
    for item in items:
        try:
            key, spec = item.split("=", 1)
            parts = spec.split(":")
            mode, limit = parts[0], float(parts[1])
            window = float(parts[2]) if len(parts) > 2 else 1.0
            if mode not in ("concurrency", "window") or limit <= 0 or window <= 0:
                raise ValueError
        except (ValueError, IndexError):
            fail(f"--quota {item!r}: expected KEY=concurrency:LIMIT or KEY=window:LIMIT:WINDOW_S")
        out.append(QuotaSpec(quota_resource(key), mode, limit, window))
    return tuple(out)


@app.command()
def run(
    trace: Annotated[Path, typer.Option(help="Trace whose actions' commands are run for real.")],
    out: Annotated[Path, typer.Option(help="Output directory (same files as simulate).")],
    backend: Annotated[str, typer.Option(help="process (working dir per trajectory) or docker.")] = "process",
    limit: Annotated[int | None, typer.Option(min=1, help="Replay only the first N trajectories.")] = None,
    think_scale: Annotated[float, typer.Option(min=0, help="Multiply think times (0: none).")] = 1.0,
    quota: Annotated[list[str], typer.Option(help="KEY=concurrency:N or KEY=window:N:SECONDS.")] = [],  # noqa: B006
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
    policy: PolicyOpt = "tangram",
    depth: DepthOpt = 2,
    lookahead: LookaheadOpt = 32,
    ordering: OrderingOpt = "fcfs",
    pod_cores: PodCoresOpt = 4,
    gpu_dop: GpuDopOpt = None,
    ray: Annotated[str | None, typer.Option(help=RAY_HELP)] = None,
    gpu_device: Annotated[str | None, typer.Option(
        help="Replay GPU rows on GPU workers: cuda, or cpu (no GPU: tests the EOE path).")] = None,
    gpu_cluster: Annotated[Path | None, typer.Option(
        help="GPU nodes and services with their model loaders (YAML). Default: --cluster's "
             "GPU nodes and services, scaled by --gpu-scale, as random-weight models.")] = None,
    cluster: Annotated[str, typer.Option(
        help="Cluster (YAML or built-in) whose GPU part is scaled when no --gpu-cluster.")] = "default",
    gpu_scale: Annotated[float, typer.Option(
        min=1e-9, help="Scale of service sizes and GPU memory without --gpu-cluster.")] = 1e-4,
    gpu_tokens: Annotated[int, typer.Option(min=2, help="Tokens per GPU request.")] = 32,
) -> None:
    """Replay a trace on this machine's real cores (process or docker backend), or on
    the nodes of a Ray cluster (--ray).

    GPU rows run on GPU workers with --gpu-device (restores and their seconds in the
    summary are measured; the core's modelled ones are beside them, in summary.gpu).

    Writes the same files as `simulate`, so a live run and its simulation are compared
    with the same analysis.
    """
    import asyncio

    from analysis.outputs import analyse, write_run
    from executor.replay import replay
    from traces.schema import TraceError, load

    chosen = _policy(policy, depth, lookahead, ordering, pod_cores, gpu_dop)
    try:
        df = load(trace)
    except TraceError as e:
        fail(str(e))
    specs = _quota_specs(quota)
    if backend not in ("process", "docker"):
        fail(f"--backend: unknown backend {backend!r} (process or docker)")
    gpu = None
    if gpu_device is not None:
        if ray:
            fail("--ray with --gpu-device: GPU workers do not run through Ray agents yet")
        gpu = _replay_gpu_cluster(gpu_device, gpu_cluster, cluster, gpu_scale)
    live = _ray_backend(ray, backend) if ray else None
    try:
        result, config = _with_progress(lambda cb: asyncio.run(replay(
            df, backend, out, limit=limit, think_scale=think_scale, quotas=specs, policy=chosen,
            progress=cb, live=live, gpu=gpu, gpu_device=gpu_device or "cpu",
            gpu_tokens=gpu_tokens)), quiet,
            f"running {trace.name} on {backend}" + (" via Ray" if ray else ""))
    except (ValueError, KeyError, RuntimeError, TimeoutError) as e:
        fail(str(e.args[0]) if e.args else str(e))
    run_ = analyse(result)
    write_run(out, run_, {"trace": str(trace), **config})
    if not quiet:
        _print_summary(run_.summary)
    out_console.print(f"wrote {out}/ (summary.json, actions.parquet, trace.json)")


def _check_gpu_device(device: str) -> None:
    from executor.gpu.arrays import DEVICES, make_ops

    if device not in DEVICES:
        fail(f"--gpu-device: unknown device {device!r} (cuda or cpu)")
    if device == "cuda":
        try:
            make_ops("cuda")
        except RuntimeError as e:
            fail(f"--gpu-device cuda: {e}")


def _replay_gpu_cluster(device: str, path: Path | None, cluster: str, scale: float):
    from executor.gpu.config import read_gpu_cluster, scaled_cluster
    from executor.gpu.model import ModelError
    from sim.cluster import load_cluster
    from tangram.cluster import ClusterError

    _check_gpu_device(device)
    try:
        if path is not None:
            return read_gpu_cluster(path, device)
        return scaled_cluster(load_cluster(cluster), scale)
    except (ClusterError, ModelError) as e:
        fail(str(e))


def _serve_gpu_cluster(gpus: str | None, path: Path | None, device: str):
    """The GPU part of `serve`: nodes from NVML (--gpus auto) or the YAML; services from it."""
    from executor.gpu.config import NvmlUnavailable, discover, read_gpu_cluster
    from executor.gpu.model import ModelError
    from tangram.cluster import ClusterError

    if gpus not in (None, "auto"):
        fail(f"--gpus: expected 'auto' (discover this machine's GPUs with NVML), got {gpus!r}")
    if gpus is None and path is None:
        return None
    discovered = physical = info = None
    if gpus == "auto":
        try:
            discovered, physical, info = discover()
        except NvmlUnavailable as e:
            fail(f"--gpus auto: {e}")
    if path is None:
        fail("--gpu-cluster: give the YAML that lists the services to serve (name, model)")
    _check_gpu_device(device)
    try:
        gc = read_gpu_cluster(path, device, discovered, physical)
    except (ClusterError, ModelError) as e:
        fail(str(e))
    if info is not None:
        gc = type(gc)(gc.spec, gc.sources, gc.physical, info)
    return gc


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
    backend: Annotated[str, typer.Option(help="process or docker.")] = "process",
    state_dir: Annotated[Path, typer.Option(help="Journal and working directories.")] = Path(".tangram"),
    quota: Annotated[list[str], typer.Option(help="KEY=concurrency:N or KEY=window:N:SECONDS.")] = [],  # noqa: B006
    policy: PolicyOpt = "tangram",
    depth: DepthOpt = 2,
    lookahead: LookaheadOpt = 32,
    ordering: OrderingOpt = "fcfs",
    pod_cores: PodCoresOpt = 4,
    gpu_dop: GpuDopOpt = None,
    allow_url: Annotated[list[str], typer.Option(
        help="KEY=URL_PREFIX: `request` actions of quota KEY may call URLs starting with it; "
             "KEY=* allows any public host (loopback/private addresses only when listed).")] = [],  # noqa: B006
    image: Annotated[list[str], typer.Option(
        help="TASK=IMAGE: the docker image of that task's sandboxes (docker backend; default "
             "tangram-sandbox:1, see `tangram image build`).")] = [],  # noqa: B006
    sandbox_mem_gb: Annotated[float, typer.Option(
        min=0.01, help="docker: memory limit of a sandbox whose trajectory gives no mem_gb.")] = 2.0,
    sandbox_pids: Annotated[int, typer.Option(min=8, help="docker: most processes in a sandbox.")] = 512,
    warm_pool: Annotated[int, typer.Option(
        min=0, help="docker: sandboxes created ahead of time (default image only).")] = 0,
    result_ttl_s: Annotated[float, typer.Option(
        min=0, help="Seconds a finished result stays in memory (then: read from the journal).")] = 60.0,
    ray: Annotated[str | None, typer.Option(help=RAY_HELP)] = None,
    gpus: Annotated[str | None, typer.Option(
        help="'auto': this machine's GPUs (NVML) are the GPU node. Default: --gpu-cluster's "
             "gpu_nodes.")] = None,
    gpu_cluster: Annotated[Path | None, typer.Option(
        help="YAML: GPU services with their model loaders (and gpu_nodes without --gpus auto).")] = None,
    gpu_device: Annotated[str, typer.Option(
        help="cuda, or cpu (no GPU: workers hold 'GPU' copies in memory; tests the EOE path).")] = "cuda",
) -> None:
    """Serve the live executor over HTTP (OpenAPI at /docs).

    With --ray, one scheduler serves every node of a Ray cluster (see README). GPU actions
    (`service`, `gpus`) run on one GPU worker per node when --gpus auto or --gpu-cluster
    is given.

    The bearer token is read from TANGRAM_TOKEN, or generated and printed.
    """
    import os
    import secrets

    from executor.local import local_cluster
    from executor.replay import make_backend
    from executor.server import create_app
    from executor.server import serve as run_server
    from tangram.core import Tangram

    if backend not in ("process", "docker"):
        fail(f"--backend: unknown backend {backend!r} (process or docker)")
    chosen = _policy(policy, depth, lookahead, ordering, pod_cores, gpu_dop)
    specs = _quota_specs(quota)
    if ray:
        if gpus or gpu_cluster:
            fail("--ray with GPU workers: GPU workers do not run through Ray agents yet")
        _ray_spec(ray)  # a bad --ray, or no Ray, before anything is printed or started
    else:
        try:  # refuse a policy that cannot hold this machine before serving anything
            Tangram(local_cluster(specs), chosen)
        except ValueError as e:
            fail(str(e))
    allow = _pairs(allow_url, "--allow-url", "KEY=URL_PREFIX")
    try:  # parsed once here so a malformed entry stops the start (executor/urls.py)
        from executor.urls import parse_allow_list

        parse_allow_list(allow)
    except ValueError as e:
        fail(str(e))
    images = {k: v[-1] for k, v in _pairs(image, "--image", "TASK=IMAGE").items()}
    if images and backend != "docker":
        fail("--image: only the docker backend runs images")
    hardening = {"allow_urls": allow, "task_images": images, "result_ttl_s": result_ttl_s}
    gc = None if ray else _serve_gpu_cluster(gpus, gpu_cluster, gpu_device)
    token = os.environ.get("TANGRAM_TOKEN") or secrets.token_urlsafe(24)
    if not os.environ.get("TANGRAM_TOKEN"):
        err.print(f"bearer token (set TANGRAM_TOKEN to choose it): {token}", highlight=False)
    if ray:
        import signal

        live = _ray_backend(ray, backend)
        try:  # the policy must hold the Ray nodes too
            Tangram(live.cluster(specs), chosen)
        except ValueError as e:
            live.shutdown()
            fail(str(e))
        # ray.init installs a SIGTERM handler that exits with status 15; uvicorn re-raises
        # the signal after its graceful shutdown (which stops the agents): keep the default
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        app_ = create_app(lambda: live, lambda: Tangram(live.cluster(specs), chosen), token,
                          state_dir, **hardening)
    else:
        cluster = local_cluster(specs)
        if gc is not None:
            from dataclasses import replace

            from tangram.policies import SharedGpus

            cluster = replace(cluster, gpu_nodes=gc.spec.gpu_nodes, services=gc.spec.services,
                              restore_gbps=gc.spec.restore_gbps)
            if not isinstance(chosen.gpu, SharedGpus):
                fail(f"--policy {policy}: the GPU workers follow the evict-on-execution GPU "
                     "manager; static or cold-started GPU instances are not run live yet")
        cores: list[Tangram] = []  # the app builds the core, then the backend (which reads it)

        def make_core() -> Tangram:
            cores.append(Tangram(cluster, chosen))
            return cores[-1]

        def make_live_backend():
            gpu = None
            if gc is not None:
                from executor.gpu.backend import GpuBackend

                gpu = GpuBackend(lambda: cores[-1].gpu, gc.sources, gpu_device, gc.physical)
                gpu.start_workers()  # stage every service now, not at the first action
            return make_backend(backend, state_dir / "work", gpu=gpu, mem_gb=sandbox_mem_gb,
                                pids=sandbox_pids, warm=warm_pool)

        app_ = create_app(make_live_backend, make_core, token, state_dir, **hardening)
        if gc is not None:
            app_.state.gpu_discovery = gc.discovery
    _settle()
    run_server(app_, host, port)


def _pairs(items: list[str], option: str, shape: str) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            fail(f"{option} {item!r}: expected {shape}")
        out[key] = out.get(key, ()) + (value,)
    return out


@image_app.command("build")
def image_build(tag: Annotated[str, typer.Option(help="Image tag.")] = "tangram-sandbox:1") -> None:
    """Build the docker backend's sandbox image locally (no registry needed)."""
    from executor.docker_backend import build_image

    try:
        build_image(tag=tag)
    except Exception as e:  # docker missing or refused: say so plainly
        fail(f"cannot build {tag}: {e}", code=1)
    out_console.print(f"built {tag}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
