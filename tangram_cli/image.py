"""`tangram image build`: the docker backend's sandbox image."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from executor.backends.docker import image as sandbox_image
from executor.backends.docker.backend import build_image
from tangram_cli.common import command_app, fail, out_console

app = command_app(help="The local Docker image the docker backend runs in.", no_args_is_help=True)


@app.callback()
def image() -> None:
    """A group of its own (typer folds a one-command app into that command)."""


@app.command("build")
def image_build(
    tag: Annotated[str, typer.Option(help="Image tag.")] = "tangram-sandbox:1",
    wheels: Annotated[Path | None, typer.Option(
        help="Directory of pure-python wheels of pytest, pytest-xdist and their "
             "dependencies (default: downloaded from PyPI with pip).")] = None,
    bare: Annotated[bool, typer.Option(
        help="No python packages: only the host's python (what an offline server "
             "builds by itself when the image is missing).")] = False,
) -> None:
    """Build the docker backend's sandbox image locally (no registry, no docker build):
    an empty root filesystem run on the host's /usr, plus pytest and pytest-xdist
    (the shipped reward commands run `python3 -m pytest -n <cores>`)."""
    if wheels is not None and not wheels.is_dir():
        fail(f"--wheels {wheels}: not a directory")
    if wheels is not None and bare:
        fail("--wheels with --bare: a bare image has no python packages")
    try:
        if bare:
            build_image(tag=tag)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                sandbox_image.build(tag, wheels, Path(scratch))
    except Exception as e:  # docker missing or refused, PyPI unreachable: say so plainly
        fail(f"cannot build {tag}: {e}", code=1)
    extra = "" if bare else f" (with {' + '.join(sandbox_image.PACKAGES)})"
    out_console.print(f"built {tag}{extra}")
