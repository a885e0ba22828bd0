"""`tangram image build`: the docker backend's sandbox image."""

from __future__ import annotations

from typing import Annotated

import typer

from executor.docker_backend import build_image
from tangram_cli.common import command_app, fail, out_console

app = command_app(help="The local Docker image the docker backend runs in.", no_args_is_help=True)


@app.callback()
def image() -> None:
    """A group of its own (typer folds a one-command app into that command)."""


@app.command("build")
def image_build(tag: Annotated[str, typer.Option(help="Image tag.")] = "tangram-sandbox:1") -> None:
    """Build the docker backend's sandbox image locally (no registry needed)."""
    try:
        build_image(tag=tag)
    except Exception as e:  # docker missing or refused: say so plainly
        fail(f"cannot build {tag}: {e}", code=1)
    out_console.print(f"built {tag}")
