"""What every command shares: the consoles, the user-error exit, the progress bar and the
summary table. Light on purpose (no pandas, no core): `tangram burn` imports it."""

from __future__ import annotations

import gc
import sys
import threading
import time
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
    """Run ``work(progress)`` under a progress bar on stderr (none with --quiet); when
    stderr is not a terminal (a CI log, a pipe), a plain line every ``LINE_EVERY_S``
    instead, so slow and hung never look the same. ``progress(done, total)``, and from a
    live replay also ``queued=`` and ``running=`` (actions waiting for resources and
    executing now; the rest of its trajectories think)."""
    settle()
    if quiet:
        return work(None)
    if not err.is_terminal:
        with ProgressLines(label) as lines:
            return work(lines.update)
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[state]}"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task(label, total=None, state="")

        def cb(done: int, total: int, queued: int | None = None,
               running: int | None = None) -> None:
            state = "" if running is None else f"{running} running, {queued} queued"
            bar.update(task, completed=done, total=total, state=state)

        return work(cb)


#: seconds between two progress lines off a terminal
LINE_EVERY_S = 10.0


class ProgressLines:
    """Progress as plain lines on stderr, one every ``every_s`` from a timer of its own
    (a line comes even while nothing moves: the elapsed time says it is alive): done of
    total, the rate and an estimate of the time left."""

    def __init__(self, label: str, every_s: float = LINE_EVERY_S) -> None:
        self.label, self.every_s = label, every_s
        self.done, self.total, self.state = 0, 0, ""
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="progress")

    def __enter__(self) -> ProgressLines:
        print(f"{self.label} ...", file=sys.stderr, flush=True)
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._ticker.join()
        if exc[0] is None:
            print(self.line(), file=sys.stderr, flush=True)

    def update(self, done: int, total: int, queued: int | None = None,
               running: int | None = None) -> None:
        self.done, self.total = done, total
        self.state = "" if running is None else f", {running} running, {queued} queued"

    def line(self) -> str:
        elapsed = time.monotonic() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if not self.total:
            return f"{self.label}: {self.done} done, {elapsed:.0f} s elapsed{self.state}"
        left = (f", ~{(self.total - self.done) / rate:.0f} s left" if rate > 0
                else ", time left unknown")
        return (f"{self.label}: {self.done}/{self.total} ({self.done / self.total:.0%}), "
                f"{rate:.2f}/s, {elapsed:.0f} s elapsed{left}{self.state}")

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            print(self.line(), file=sys.stderr, flush=True)


#: the summary's metrics, in words with their unit (summary.json's keys on the left)
SUMMARY_METRICS = {
    "act_mean_s": "mean action completion time (ACT), s",
    "act_p50_s": "median ACT, s",
    "act_p99_s": "99th-percentile ACT, s",
    "queue_mean_s": "mean queueing (submit to start), s",
    "exec_mean_s": "mean execution (start to end), s",
    "step_time_s": "step time (first submit to last end), s",
    "restore_mean_s": "mean GPU restore per action, s",
    "failed": "failed actions",
}


def print_summary(s: dict) -> None:
    """The summary as a table, each metric in words with its unit; a run with failed
    actions or an over-allocated resource is marked above it, since its times are not
    comparable with a clean run's (a failed action can end sooner than a served one)."""
    table = Table(title=f"policy {s['policy']}: {s['actions']} actions, "
                        f"{s['trajectories']} trajectories")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, words in SUMMARY_METRICS.items():
        v = s[key]
        table.add_row(words, f"{v:.3f}" if isinstance(v, float) else str(v))
    for res, u in s["utilisation"].items():
        parts = [f"{k} {u[k]:.1%}" for k in ("allocated", "busy") if k in u]
        table.add_row(f"{res}: allocated / busy, of capacity",
                      " ".join(parts) or "-")
    for warning in run_warnings(s):
        err.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False)
    out_console.print(table)


def run_warnings(summary: dict) -> list[str]:
    """What makes a run's figures (its summary.json) not comparable with a clean run's:
    failed actions, a resource allocated past its capacity."""
    failed, actions = int(summary.get("failed", 0)), int(summary.get("actions", 0))
    over = [f"{res} allocated {u['allocated']:.1%}"
            for res, u in (summary.get("utilisation") or {}).items()
            if u.get("allocated", 0.0) > 1.0 + 1e-9]
    out = []
    if failed:
        out.append(f"{failed} of {actions} actions FAILED: the times above count them as "
                   "they ended, so this run is not comparable with one whose actions ran")
    if over:
        out.append("over-allocated: " + "; ".join(over) + " (more than the capacity: "
                   "the quota's calls were refused or retried)")
    return out
