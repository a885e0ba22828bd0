"""`tangram simulate`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import sim.driver  # noqa: F401  (the simulator's imports are the start's CPU, not the run's)
from analysis.phases import Phases
from analysis.runs import settle, simulate_into
from sim.cluster import load_cluster
from tangram.cluster import ClusterError
from tangram_cli.common import DEFAULT_TRACE, command_app, fail, out_console, print_summary, with_progress
from tangram_cli.options import (
    DepthOpt,
    GpuDopOpt,
    LookaheadOpt,
    OrderingOpt,
    PerfettoOpt,
    PodCoresOpt,
    PolicyOpt,
    WorkScaleOpt,
    check_work_scale,
    chosen_policy,
    policy_options,
    warn_fixed_work,
)
from traces.schema import TraceError, ValidTrace, load
from traces.select import head, scale_think, scale_work

app = command_app()


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
    work_scale: WorkScaleOpt = 1.0,
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
    perfetto: PerfettoOpt = False,
    fork: Annotated[bool, typer.Option(
        "--fork", help="GRPO groups (the trace's group column) prepare their sandbox once "
                       "and fork it into the other rollouts, at the cluster file's "
                       "extra.fork_s per copy (default: every rollout prepares its own).")] = False,
) -> None:
    """Simulate a trace on a cluster under one policy (virtual time, same scheduler as live).

    Writes summary.json, actions.parquet, timing.parquet, utilisation.parquet, config.json
    and cluster.yaml to --out; trace.json (Chrome/Perfetto) with --perfetto.
    """
    phases = Phases()  # (summary.json's timing.cpu_s: what each phase cost)
    phases.lap("start")
    trace = trace or DEFAULT_TRACE
    check_work_scale(work_scale)
    try:
        spec = load_cluster(cluster)
        df = scale_think(head(load(trace), limit), think_scale)
    except (TraceError, ClusterError) as e:
        fail(str(e))
    fixed = warn_fixed_work(df, work_scale)
    df = scale_work(df, work_scale)
    chosen_policy(policy, depth, lookahead, ordering, pod_cores, gpu_dop)  # bad options: exit 2
    options = policy_options(depth, lookahead, ordering, pod_cores, gpu_dop)
    out = out or Path("runs") / f"{trace.stem}-{policy.replace(':', '')}"
    settle()
    phases.lap("read")
    try:
        summary = with_progress(
            lambda cb: simulate_into(out, ValidTrace(df), spec, policy, seed=seed, steps=steps,
                                     train_s=train_s, asynchronous=asynchronous, progress=cb,
                                     source=str(trace),
                                     extra_config={"limit": limit, "think_scale": think_scale,
                                                   "work_scale": work_scale,
                                                   "work_unscaled_rows": fixed},
                                     perfetto=perfetto, fork=fork, phases=phases, **options),
            quiet, f"simulating {trace.name} under {policy}")
    except ValueError as e:
        fail(str(e))
    if not quiet:
        print_summary(summary)
    out_console.print(f"wrote {out}/ (summary.json, actions.parquet"
                      + (", trace.json)" if perfetto else ")"))
