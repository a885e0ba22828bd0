"""What every command shares: the consoles, the user-error exit, the progress bar and the
summary table. Light on purpose (no pandas, no core): `tangram burn` imports it."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

out_console = Console()
err = Console(stderr=True)

SAMPLES = Path(__file__).parent.parent / "traces" / "samples"
DEFAULT_TRACE = SAMPLES / "coding.parquet"

T = TypeVar("T")


def command_app(**settings) -> typer.Typer:
    """The app a command module registers its command(s) on (cli.py loads it lazily)."""
    return typer.Typer(add_completion=False, pretty_exceptions_enable=False, **settings)


def fail(message: str, code: int = 2) -> NoReturn:
    """Report a user error without a traceback."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def settle() -> None:
    """Long runs: freeze everything imports created so the cyclic GC stops rescanning
    it (tens of milliseconds a full collection otherwise)."""
    gc.collect()
    gc.freeze()


def with_progress(work: Callable[[Callable[..., None] | None], T], quiet: bool,
                  label: str) -> T:
    """Run ``work(progress)`` under a progress bar on stderr (none with --quiet).
    ``progress(done, total)``, and from a live replay also ``queued=`` and ``running=``
    (actions waiting for resources and executing now; the rest of its trajectories think)."""
    settle()
    if quiet:
        return work(None)
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[state]}"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task(label, total=None, state="")

        def cb(done: int, total: int, queued: int | None = None,
               running: int | None = None) -> None:
            state = "" if running is None else f"{running} running, {queued} queued"
            bar.update(task, completed=done, total=total, state=state)

        return work(cb)


def print_summary(s: dict) -> None:
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
