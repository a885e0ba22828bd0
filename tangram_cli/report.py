"""`tangram reproduce`, `plot` and `compare`: the analysis of runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from analysis import figures
from analysis.compare import figure, table
from analysis.reproduce import reproduce as run_all
from analysis.runs import RunError, load_run
from tangram_cli.common import command_app, err, fail, out_console, run_warnings, with_progress

app = command_app()


@app.command()
def reproduce(
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("runs/reproduce"),
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes (<= 5 CPU-minutes).")] = False,
    full: Annotated[bool, typer.Option(
        "--full", help="The paper's sizes (hours on 2 cores: resumable).")] = False,
    only: Annotated[list[str], typer.Option(help="Run only these experiments (repeatable).")] = [],  # noqa: B006
    workers: Annotated[int, typer.Option(min=1, help="Parallel simulations.")] = 2,
    cache: Annotated[Path | None, typer.Option(
        help="Where every simulation's result and generated trace is kept, by the hash of "
             "its inputs and of the code (default: OUT/cache). Run the same command again "
             "to resume a run that stopped.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
) -> None:
    """Reproduce the paper's studies (Figs. 6-9, Table 1) and ours beyond it.

    Writes results.json (paper vs ours, every headline with its 95% interval over 5 seeds
    and against the best baseline for its metric), evidence.json, report.md, report.html
    and figures/ to --out.
    """
    if quick == full:  # neither, or both: the two differ by hours, so never a default
        fail(("--quick and --full: choose one" if quick else "choose a scale: ")
             + "--quick (small sizes, about 2-5 minutes on 2 cores) or --full (the paper's "
             "sizes: 945 simulations, ~50 CPU-minutes, 26 minutes on 2 idle cores; resumable)")
    try:
        results = with_progress(lambda cb: run_all(out, quick, only or None, workers, cb,
                                                   cache), quiet, "reproducing")
    except ValueError as e:
        fail(str(e))
    if not quiet:
        shown = Table(title="paper vs ours")
        for col in ("figure", "paper", "ours", "unit"):
            shown.add_column(col)
        for r in results:
            shown.add_row(r["name"], str(r["paper"] if r["paper"] is not None else "-"),
                          "n/a" if r["ours"] is None else f"{r['ours']:.3g}", r["unit"])
        out_console.print(shown)
    out_console.print(f"wrote {out}/ (results.json, report.md, report.html, figures/)")


@app.command()
def plot(
    runs: Annotated[list[Path], typer.Argument(help="Run directories (from simulate or run).")],
    out: Annotated[Path | None, typer.Option(help="Where figures go (default: first run/figures).")] = None,
) -> None:
    """Draw the standard figures for a set of runs: ACT CDF, ACT per kind, where the time
    goes, allocation over time (the same functions notebooks call: analysis/figures.py)."""
    try:
        loaded = [load_run(run_dir) for run_dir in runs]
    except RunError as e:
        fail(str(e))
    names = [r.name for r in loaded]
    if len(set(names)) != len(names):  # e.g. a/run and b/run: label them by their path
        loaded = [load_run(run_dir, name=str(run_dir)) for run_dir in runs]
    for p in figures.standard(loaded, out or runs[0] / "figures"):
        out_console.print(f"wrote {p}")


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
    for run in loaded:  # a run with failures can look fastest: its failed actions ended early
        for warning in run_warnings(run.summary):
            err.print(f"[bold yellow]warning:[/] {escape(run.name)}: {escape(warning)}",
                      highlight=False)
    path = figure(loaded, out)
    out_console.print(f"wrote {out / 'compare.json'} and {path}")
