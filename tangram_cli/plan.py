"""`tangram plan`: the smallest cluster per policy that meets a target (analysis/plan.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from analysis.plan import (
    MIN_RESAMPLES,
    PlanConfig,
    PlanError,
    default_cores,
    draw,
    parse_target,
)
from analysis.plan import plan as run_plan
from sim.cluster import load_cluster
from tangram.cluster import ClusterError
from tangram.policies import make_policy
from tangram_cli.common import command_app, err, fail, out_console, reporting, settle
from traces.schema import TraceError, load, torn_tail

app = command_app()


@app.command()
def plan(
    trace: Annotated[Path, typer.Option(help="Trace to plan for: a recording "
                                             "(`serve --record`) or any trace.")],
    target: Annotated[str, typer.Option(
        help="What the cluster must meet: step<=SECONDS, p99<=SECONDS or mean_act<=SECONDS "
             "(unit s, m or h; e.g. \"step<=300s\").")],
    cluster: Annotated[str | None, typer.Option(
        help="The cluster whose node shape (memory per core, NUMA, GPU node, services, "
             "quotas) is sized. Default: <trace stem>-cluster.yaml beside the trace (what "
             "--record writes), else the built-in default.")] = None,
    policies: Annotated[str, typer.Option(
        help="Policies to size for, comma-separated (see `tangram policies`).")]
    = "tangram,fixed-dop:1,k8s",
    trajectories: Annotated[int | None, typer.Option(
        min=1, help="Trajectories per batch to plan for, drawn with replacement from the "
                    "trace's (default: as many as it has).")] = None,
    resamples: Annotated[int, typer.Option(
        min=MIN_RESAMPLES, help="Resamplings of the trajectories: the answer is an interval "
                                "over them.")] = MIN_RESAMPLES,
    cores_per_node: Annotated[str | None, typer.Option(
        help="Node shapes to try, comma-separated core counts (default: the cluster's first "
             "node's cores, half and twice as many).")] = None,
    max_nodes: Annotated[int, typer.Option(min=1, help="Most CPU nodes tried.")] = 256,
    jobs: Annotated[int | None, typer.Option(
        min=1, help="Simulations in parallel (default: this machine's cores).")] = None,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the resamplings.")] = 0,
    out: Annotated[Path | None, typer.Option(
        help="Where plan.json, frontier.json and frontier.png go (default runs/plan-<trace>).")]
    = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or table.")] = False,
) -> None:
    """Size a cluster for a trace: the smallest configuration per policy that meets a target.

    Searches the number of nodes (by bisection) for each node shape (--cores-per-node) and,
    with GPU rows, the number of GPU nodes, on --resamples resamplings of the trace's
    trajectories (--trajectories for a larger batch), simulating in parallel. Prints per
    policy the smallest configuration (the median over resamplings and their range), and
    writes the frontier (capacity against the target's metric, one line per policy) as
    frontier.png and frontier.json, and every simulation in plan.json.
    """
    try:
        goal = parse_target(target)
    except PlanError as e:
        fail(str(e))
    names = tuple(p.strip() for p in policies.split(",") if p.strip())
    if not names:
        fail("--policies: name at least one policy (see `tangram policies`)")
    for name in names:
        try:
            make_policy(name)
        except ValueError as e:
            fail(f"--policies: {e}")
    beside = trace.with_name(f"{trace.stem}-cluster.yaml")
    source = cluster if cluster is not None else (str(beside) if beside.exists() else None)
    try:
        rows = load(trace)
        base = load_cluster(source)
    except (TraceError, ClusterError) as e:
        fail(str(e))
    if not base.cpu_nodes:
        fail(f"--cluster: {source or 'default'} has no CPU node to take a node's shape from")
    # (said, not silent: a recording whose cluster file was lost would be sized in nodes
    # of another machine's shape, and a crashed recording's cut-off row is skipped)
    if source is None:
        err.print(f"[bold yellow]note:[/] no --cluster and no {escape(beside.name)} beside "
                  "the trace: nodes are shaped as the built-in default cluster's",
                  highlight=False, soft_wrap=True)
    torn = torn_tail(trace)
    if torn:
        err.print(f"[bold yellow]warning:[/] {escape(torn)}", highlight=False, soft_wrap=True)
    try:
        shapes = (tuple(int(c) for c in cores_per_node.split(",") if c.strip())
                  if cores_per_node else default_cores(base))
    except ValueError:
        fail(f"--cores-per-node: expected core counts separated by commas, got "
             f"{cores_per_node!r}")
    n = trajectories or int(rows["trajectory"].nunique())
    config = PlanConfig(goal, names, shapes, n, resamples, max_nodes, seed,
                        jobs or len(os.sched_getaffinity(0)))
    out = out or Path("runs") / f"plan-{trace.stem}"
    try:  # (before the search: a plan's minutes are not lost to a path that cannot be used)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--out: cannot make the directory {out}: {e.strerror or e}")
    settle()
    try:
        with reporting(f"planning {trace.name} for {goal}", quiet) as progress:
            answer = run_plan(rows, base, config, progress,
                              progress.phase if progress is not None else None)
    except PlanError as e:
        fail(str(e))
    answer["trace"] = str(trace)
    answer["cluster"] = source or "default"
    (out / "plan.json").write_text(json.dumps(answer, indent=1) + "\n")
    front = {k: answer[k] for k in ("target", "metric", "trajectories", "resamples",
                                    "frontier_x", "frontier")}
    (out / "frontier.json").write_text(json.dumps(front, indent=1) + "\n")
    draw(answer, out / "frontier.png")
    if not quiet:
        print_plan(answer)
    out_console.print(f"wrote {out}/ (plan.json, frontier.json, frontier.png): "
                      f"{answer['simulations']} simulations in {answer['wall_s']:.0f} s")
    if not any(p["met"] for p in answer["policies"].values()):
        fail(f"no policy meets {goal} within {max_nodes} nodes (see {out}/frontier.png)",
             code=1)


def print_plan(answer: dict) -> None:
    metric = answer["metric"]
    table = Table(title=escape(f"smallest cluster meeting {answer['target']} "
                               f"({answer['trajectories']} trajectories; median [min-max] "
                               f"over {answer['resamples']} resamplings)"))
    for col in ("policy", "nodes x cores", "cores", "GPUs", f"{metric} at that size (s)"):
        table.add_column(col)

    def span(s: dict, fmt: str = "{:g}") -> str:
        return (fmt.format(s["median"]) + " [" + fmt.format(s["min"]) + "-"
                + fmt.format(s["max"]) + "]")

    for policy, p in answer["policies"].items():
        if not p["met"]:
            table.add_row(policy, p["why"], "", "", "")
            continue
        table.add_row(policy, escape(f"{span(p['nodes'])} x {p['cores_per_node']}"),
                      escape(span(p["cores"])), escape(span(p["gpus"])),
                      escape(span(p[metric + "_s"], "{:.1f}")))
    out_console.print(table)
