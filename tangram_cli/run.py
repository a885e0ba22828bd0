"""`tangram run`: replay a trace's actions for real (executor/replay.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from analysis.outputs import analyse, write_run
from executor.assemble import AssemblyError, no_phase, ray_backend, replay_gpu_cluster
from executor.backends.docker.limits import SandboxLimits
from executor.replay import RunFailed, replay
from sim.cluster import load_cluster
from tangram.cluster import ClusterError
from tangram_cli.checks import all_failed, sandbox_reach_problem
from tangram_cli.common import command_app, fail, out_console, phase, print_summary, with_progress
from tangram_cli.options import (
    RAY_HELP,
    DepthOpt,
    GpuDopOpt,
    LookaheadOpt,
    OrderingOpt,
    PerfettoOpt,
    PodCoresOpt,
    PolicyOpt,
    RecordCommandsOpt,
    RecordOpt,
    WorkScaleOpt,
    check_work_scale,
    checked_record,
    chosen_policy,
    quota_specs,
    ray_spec,
    warn_fixed_work,
)
from traces.schema import TraceError, load
from traces.select import head, scale_work

app = command_app()


@app.command()
def run(
    trace: Annotated[Path, typer.Option(help="Trace whose actions' commands are run for real.")],
    out: Annotated[Path, typer.Option(help="Output directory (same files as simulate).")],
    backend: Annotated[str, typer.Option(help="process (working dir per trajectory) or docker.")] = "process",
    limit: Annotated[int | None, typer.Option(min=1, help="Replay only the first N trajectories.")] = None,
    think_scale: Annotated[float, typer.Option(min=0, help="Multiply think times (0: none).")] = 1.0,
    work_scale: WorkScaleOpt = 1.0,
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
    perfetto: PerfettoOpt = False,
    record: RecordOpt = None,
    record_commands: RecordCommandsOpt = False,
    image_pulls: Annotated[int, typer.Option(
        min=1, help="docker: images pulled at once from their registries.")] = 2,
    image_cache_gb: Annotated[float | None, typer.Option(
        min=0.001, help="docker: disk the images pulled may take (docs/images.md). "
        "Default: no budget.")] = None,
) -> None:
    """Replay a trace on this machine's real cores (process or docker backend), or on
    the nodes of a Ray cluster (--ray).

    GPU rows run on GPU workers with --gpu-device (restores and their seconds in the
    summary are measured; the core's modelled ones are beside them, in summary.gpu).

    Writes the same files as `simulate`, so a live run and its simulation are compared
    with the same analysis.
    """
    chosen = chosen_policy(policy, depth, lookahead, ordering, pod_cores, gpu_dop)
    check_work_scale(work_scale)
    checked_record(record, record_commands)
    try:
        df = load(trace)
    except TraceError as e:
        fail(str(e))
    fixed = warn_fixed_work(head(df, limit), work_scale)
    df = scale_work(df, work_scale)  # before replay's own --limit/--think-scale, as simulate
    specs = quota_specs(quota)
    if backend not in ("process", "docker"):
        fail(f"--backend: unknown backend {backend!r} (process or docker)")
    if backend == "process" and not ray:  # as root: sandbox users run the commands
        problem = sandbox_reach_problem()
        if problem:
            fail(problem)
    gpu = live = None
    try:
        if gpu_device is not None:
            scaled = load_cluster(cluster) if gpu_cluster is None else None
            gpu = replay_gpu_cluster(gpu_device, gpu_cluster, scaled, gpu_scale)
        if ray:  # with --gpu-device: a GPU worker actor on each node that has GPUs
            # (a local cluster, its agents and GPU workers: minutes; each step said)
            live = ray_backend(ray_spec(ray), backend, gpu, gpu_device or "cpu",
                               phase=no_phase if quiet else lambda step: phase(f"run: {step}"))
    except (AssemblyError, ClusterError) as e:
        fail(str(e))
    try:
        result, config = with_progress(lambda cb: asyncio.run(replay(
            df, backend, out, limit=limit, think_scale=think_scale, quotas=specs, policy=chosen,
            progress=cb, live=live, gpu=gpu, gpu_device=gpu_device or "cpu",
            gpu_tokens=gpu_tokens, record=record, record_commands=record_commands,
            sandboxes=SandboxLimits(image_pulls=image_pulls, image_cache_gb=image_cache_gb))),
            quiet,
            f"running {trace.name} on {backend}" + (" via Ray" if ray else ""))
    except RunFailed as e:  # an effect failed: stopped, what ran is in outputs.jsonl
        fail(f"the run stopped: {e}; the outputs of what ran are in {out}/outputs.jsonl",
             code=1)
    except (ValueError, KeyError, RuntimeError, TimeoutError) as e:
        fail(str(e.args[0]) if e.args else str(e))
    run_ = analyse(result)
    write_run(out, run_, {"trace": str(trace), **config, "work_scale": work_scale,
                          "work_unscaled_rows": fixed}, perfetto=perfetto)
    if not quiet:
        print_summary(run_.summary)
    out_console.print(f"wrote {out}/ (summary.json, actions.parquet"
                      + (", trace.json)" if perfetto else ")"))
    nothing_ran = all_failed(out)
    if nothing_ran:
        fail(nothing_ran, code=1)
