"""`tangram burn`: the CPU work of a trace row that names no command."""

from __future__ import annotations

from typing import Annotated

import typer

from executor.bench.burn import burn as run_burn
from tangram_cli.common import command_app

app = command_app()


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
    code = run_burn(t1, parallel_fraction, numprocesses)
    raise typer.Exit(code or exit_code)
