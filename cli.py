"""The `tangram` command: the app and its table of commands.

Each command lives in a module of tangram_cli/ that is imported only when that command runs
(click's "lazily loading subcommands" pattern): `tangram burn` or `tangram --help` does not
import pandas, FastAPI and matplotlib for the commands it does not run. The command list
of `tangram --help` is drawn from the table below; tests/test_cli.py checks that every
line there is the first paragraph of its command's own help.
"""

from __future__ import annotations

import importlib
import sys
from difflib import get_close_matches
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup  # (typer vendors click: its types are typer's)

#: command -> (module of tangram_cli/ that defines it, the first paragraph of its help),
#: in the order `tangram --help` lists them
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("simulate", "Simulate a trace on a cluster under one policy (virtual time, "
                             "same scheduler as live)."),
    "policies": ("policies", "List the scheduling policies `simulate`, `run` and `serve` accept "
                             "(--policy)."),
    "reproduce": ("report", "Reproduce the paper's studies (Figs. 6-9, Table 1) and ours "
                            "beyond it."),
    "plot": ("report", "Draw the standard figures for a set of runs: ACT CDF, ACT per kind, "
                       "where the time goes, allocation over time (the same functions "
                       "notebooks call: analysis/figures.py)."),
    "burn": ("burn", "Burn CPU like a test suite: t1*(1-p) CPU seconds serially, then t1*p "
                     "split over -n processes (wall time on k free cores: t1*((1-p)+p/k))."),
    "compare": ("report", "Mean/p50/p99 ACT, queueing, execution and makespan of runs side "
                          "by side, with the % difference from the first run, and "
                          "`same_units`: the share of the actions both ran that got the same "
                          "number of units (did a simulation make the live run's decisions?)."),
    "plan": ("plan", "Size a cluster for a trace: the smallest configuration per policy that "
                     "meets a target."),
    "run": ("run", "Replay a trace on this machine's real cores (process or docker backend), "
                   "or on the nodes of a Ray cluster (--ray)."),
    "serve": ("serve", "Serve the live executor over HTTP (OpenAPI at /docs)."),
    "trace": ("trace", "Validate and generate workload traces."),
    "bench": ("bench", "Benchmarks that print their figures as JSON lines."),
    "image": ("image", "The local Docker image the docker backend runs in."),
}
#: the entries of COMMANDS that are groups of subcommands (the module's whole app)
GROUPS = frozenset({"trace", "bench", "image"})


def load_command(name: str) -> Any:
    """The click command ``name``, built from its module's typer app."""
    module, _ = COMMANDS[name]
    built = typer.main.get_command(importlib.import_module(f"tangram_cli.{module}").app)
    if name not in GROUPS and isinstance(built, TyperGroup):  # one of the module's commands
        built = built.commands[name]
    built.name = name
    return built


class LazyGroup(TyperGroup):
    """The top-level group: a command's module is imported when the command is looked up;
    while the group's own help is drawn, each command stands as its COMMANDS line."""

    def __init__(self, **attrs) -> None:
        super().__init__(**attrs)
        self._listing = False

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:
        if cmd_name not in COMMANDS:
            return None
        if cmd_name not in self.commands:
            if self._listing:
                return TyperCommand(cmd_name, help=COMMANDS[cmd_name][1])
            self.commands[cmd_name] = load_command(cmd_name)
        return self.commands[cmd_name]

    def resolve_command(self, ctx: typer.Context, args: list[str]) -> Any:
        # typer suggests close names from the commands loaded so far: from all of them here
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in COMMANDS:
            close = get_close_matches(name, list(COMMANDS))
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            ctx.fail(f"No such command {name!r}.{hint}")
        return super().resolve_command(ctx, args)

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    cls=LazyGroup,
    help="Tangram: action-level scheduling of the external resources of agentic RL "
         "(CPU sandboxes, GPU reward/teacher models, rate-limited APIs).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _tangram() -> None:
    """(typer builds a group only for an app with a callback or registered commands)"""


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
