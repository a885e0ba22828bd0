"""`tangram bench NAME`: the benchmarks of analysis/bench/, one command per line of its
table (``analysis.bench.BENCHES``), each printing its rows as JSON lines.

A command is built from its benchmark's function: its parameters are the options (an
``analysis.bench.Opt`` in a parameter's annotation becomes the typer option's help and
bounds), its help is the table's line and then the function's docstring, and a
``BenchError`` it raises is a user error (exit 2, no traceback). While it runs, its
progress is on stderr (--quiet: none): done / total with the rate and the time left where
the benchmark counts its work (its ``progress`` parameter), else the phase it is in and
the time elapsed; a bar on a terminal, a line every ~10 s off one."""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Iterator
from typing import Annotated, Any, get_args, get_origin, get_type_hints

import typer

from analysis.bench import BENCHES, QUIET, BenchError, Opt
from tangram_cli.common import command_app, fail, reporting

#: the parameter of a benchmark's function that takes its progress (analysis.bench.Progress)
PROGRESS = "progress"

app = command_app(help="Benchmarks that print their figures as JSON lines.", no_args_is_help=True)


def _option(hint: Any) -> Any:
    """A parameter's annotation with its ``Opt`` made a typer option."""
    if get_origin(hint) is not Annotated:
        return hint
    base, *extra = get_args(hint)
    opt = next((e for e in extra if isinstance(e, Opt)), None)
    if opt is None:
        return hint
    bounds = {k: v for k, v in (("min", opt.min), ("max", opt.max)) if v is not None}
    return Annotated[base, typer.Option(*((opt.flag,) if opt.flag else ()),
                                        help=opt.help or None, **bounds)]


def bench_command(name: str) -> Callable[..., None]:
    """The command of ``BENCHES[name]``: runs its function, printing each row it yields as
    one JSON line as it comes."""
    target, summary = BENCHES[name]
    module, function = target.split(":")
    fn: Callable[..., Iterator[dict]] = getattr(
        importlib.import_module(f"analysis.bench.{module}"), function)
    hints = get_type_hints(fn, include_extras=True)
    params = [p.replace(annotation=_option(hints.get(p.name, p.annotation)))
              for p in inspect.signature(fn).parameters.values() if p.name != PROGRESS]
    counts = PROGRESS in inspect.signature(fn).parameters
    params.append(inspect.Parameter(
        "quiet", inspect.Parameter.KEYWORD_ONLY, default=False,
        annotation=Annotated[bool, typer.Option(
            "--quiet", "-q", help="No progress on stderr (the JSON lines only).")]))

    def run(quiet: bool = False, **options: Any) -> None:
        # progress on stderr: done / total where the bench counts, else its phase and the
        # time elapsed (no settle(): a bench measures its own process as it is)
        try:
            with reporting(f"bench {name}", quiet) as progress:
                if counts:
                    options[PROGRESS] = progress or QUIET
                for row in fn(**options):
                    print(json.dumps(row), flush=True)
        except BenchError as e:
            fail(f"bench {name}: {e}")

    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    run.__name__ = f"bench_{module}_{function}"
    run.__doc__ = summary + (f"\n\n{inspect.getdoc(fn)}" if fn.__doc__ else "")
    return run


for _name in BENCHES:
    app.command(_name)(bench_command(_name))
