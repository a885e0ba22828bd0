"""`tangram policies`."""

from __future__ import annotations

from rich.table import Table

from tangram.policies import REGISTRY
from tangram_cli.common import command_app, out_console

app = command_app()


@app.command()
def policies() -> None:
    """List the scheduling policies `simulate`, `run` and `serve` accept (--policy)."""
    table = Table()
    table.add_column("policy")
    table.add_column("what it models")
    table.add_column("API calls admitted by")
    for name, cls in REGISTRY.items():
        table.add_row(name, cls.description, cls.api.name)
    out_console.print(table)
