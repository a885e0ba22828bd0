"""What every command shares: the consoles, the user-error exit, the progress bar and the
summary table. Light on purpose (no pandas, no core): `tangram burn` imports it."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn, Protocol, TypeVar

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


def with_progress(work: Callable[[Reporter | None], T], quiet: bool, label: str) -> T:
    """Run ``work(progress)`` under a progress bar on stderr (none with --quiet); when
    stderr is not a terminal (a CI log, a pipe), a plain line every ``LINE_EVERY_S``
    instead, so slow and hung never look the same. ``progress(done, total)``, and from a
    live replay also ``queued=`` and ``running=`` (actions waiting for resources and
    executing now; the rest of its trajectories think); ``progress.phase(name)`` names
    what runs now (a bench's step)."""
    settle()
    with reporting(label, quiet) as progress:
        return work(progress)


class Reporter(Protocol):
    """What ``with_progress`` hands its work (analysis.bench.Progress is the same shape)."""

    def __call__(self, done: int, total: int, queued: int | None = None,
                 running: int | None = None) -> None: ...

    def phase(self, name: str) -> None: ...


@contextmanager
def reporting(label: str, quiet: bool = False) -> Iterator[Reporter | None]:
    """The progress of a piece of work called ``label``, on stderr while the block runs:
    a transient bar on a terminal, :class:`ProgressLines` off one, nothing (None) when
    ``quiet``."""
    if quiet:
        yield None
        return
    if not err.is_terminal:
        with ProgressLines(label) as lines:
            yield lines
        return
    # rows a command prints to stdout meanwhile (a bench's JSON lines) go above the bar
    # when stdout is this terminal too, and to stdout itself when it is a file or a pipe
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[state]}"), TimeElapsedColumn(), console=err,
                  transient=True, redirect_stdout=out_console.is_terminal) as bar:
        yield _Bar(bar, label)


@contextmanager
def phase(label: str) -> Iterator[None]:
    """One step of a start-up (``tangram serve``'s checks, its backend): its start and,
    when it ends, how long it took, on stderr; off a terminal a 'still running' line every
    ``LINE_EVERY_S`` while it lasts, on one a transient bar with the elapsed time."""
    t0 = time.monotonic()
    with reporting(label):
        yield
    if err.is_terminal:  # (off one, ProgressLines said it)
        err.print(f"{escape(label)}: done in {time.monotonic() - t0:.1f} s", highlight=False)


class _Bar:
    """A rich progress bar's task as a :class:`Reporter`."""

    def __init__(self, bar: Progress, label: str) -> None:
        self.bar, self.label = bar, label
        self.task = bar.add_task(escape(label), total=None, state="")

    def __call__(self, done: int, total: int, queued: int | None = None,
                 running: int | None = None) -> None:
        state = "" if running is None else f"{running} running, {queued} queued"
        self.bar.update(self.task, completed=done, total=total, state=state)

    def phase(self, name: str) -> None:
        self.bar.update(self.task, description=escape(f"{self.label}: {name}"))


def _every_s() -> float:
    """``TANGRAM_PROGRESS_EVERY_S`` (e.g. a test that wants its lines sooner), else 10."""
    try:
        value = float(os.environ.get("TANGRAM_PROGRESS_EVERY_S", ""))
    except ValueError:
        return 10.0
    return value if value > 0 else 10.0


#: seconds between two progress lines off a terminal
LINE_EVERY_S = _every_s()


#: held while a progress line is printed, and across a fork: a child forked by the work
#: (a process pool) never inherits stderr's lock held by the ticker mid-line
_SAYING = threading.Lock()
os.register_at_fork(before=_SAYING.acquire, after_in_parent=_SAYING.release,
                    after_in_child=_SAYING.release)


def _say(line: str) -> None:
    with _SAYING:
        print(line, file=sys.stderr, flush=True)


class ProgressLines:
    """Progress as plain lines on stderr, one every ``every_s`` from a timer of its own
    (a line comes even while nothing moves: the elapsed time says it is alive): done of
    total, the rate (since the first count) and an estimate of the time left; for work
    that counts nothing,
    'still running: <label> (<phase>), <elapsed>'. A line when it starts, when a phase
    begins, and when it ends (the count, or how long it took)."""

    def __init__(self, label: str, every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.clock = label, clock
        self.every_s = LINE_EVERY_S if every_s is None else every_s
        self.done, self.total, self.state = 0, 0, ""
        self.counted = False  # whether update() was ever called
        #: when it was first called and the count then: the rate is measured from there
        #: (not over a phase that counted nothing, e.g. a bench's server starting)
        self.first: tuple[float, int] | None = None
        self.current = ""  # the phase now ('' for none)
        self.t0 = clock()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="progress")

    def __enter__(self) -> ProgressLines:
        _say(f"{self.label} ...")
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._ticker.join()
        if exc[0] is None:
            _say(self.line(final=True))

    def update(self, done: int, total: int, queued: int | None = None,
               running: int | None = None) -> None:
        self.done, self.total, self.counted = done, total, True
        if self.first is None:
            self.first = (self.clock(), done)
        self.state = "" if running is None else f", {running} running, {queued} queued"

    __call__ = update

    def phase(self, name: str) -> None:
        """What runs now: said at once, and named by the lines after it."""
        if name != self.current:
            self.current = name
            _say(f"{self.label}: {name} ...")

    def line(self, final: bool = False) -> str:
        """The line now; ``final``: the one said at the end (the count, and how long it
        all took)."""
        now = self.clock()
        elapsed = now - self.t0
        name = f"{self.label} ({self.current})" if self.current and not final else self.label
        if not self.counted:
            return (f"{name}: done in {elapsed:.1f} s" if final else
                    f"still running: {name}, {elapsed:.0f} s elapsed")
        since, base = self.first or (self.t0, 0)
        if self.done == base:  # nothing counted since the first count: over all the time
            since, base = self.t0, 0
        rate = (self.done - base) / (now - since) if now > since else 0.0
        when = f"done in {elapsed:.1f} s" if final else f"{elapsed:.0f} s elapsed"
        if not self.total:
            return f"{name}: {self.done} done, {when}{self.state}"
        left = ("" if final else f", ~{(self.total - self.done) / rate:.0f} s left"
                if rate > 0 else ", time left unknown")
        return (f"{name}: {self.done}/{self.total} ({self.done / self.total:.0%}), "
                f"{rate:.2f}/s, {when}{left}{self.state}")

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            _say(self.line())


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
