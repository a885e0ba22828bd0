"""The README's table of every `tangram` command, drawn from the typer app itself (cli.py):
each command and each subcommand of a group, with the first paragraph of its own help.

    PYTHONPATH=. python scripts/command_table.py            # print the table (Markdown)
    PYTHONPATH=. python scripts/command_table.py --write    # put it into README.md

The README holds the output between ``<!-- commands -->`` and ``<!-- /commands -->``;
tests/test_docs.py fails when the two differ, so a new command cannot be left out.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from typer.core import TyperGroup  # (typer vendors click: its types are typer's)

from cli import COMMANDS, load_command

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- commands -->", "<!-- /commands -->"


def first_paragraph(command) -> str:
    """The first paragraph of ``command``'s help, on one line, safe in a table cell."""
    text = (command.help or "").strip().split("\n\n")[0]
    return re.sub(r"\s+", " ", text).replace("|", "\\|")


def rows() -> list[tuple[str, str]]:
    """(`tangram ...`, its help's first paragraph) for every command, in `tangram --help`'s
    order, a group followed by its subcommands (hidden ones left out)."""
    out = []
    for name in COMMANDS:
        command = load_command(name)
        out.append((f"tangram {name}", first_paragraph(command)))
        if isinstance(command, TyperGroup):
            for sub, subcommand in command.commands.items():
                if not subcommand.hidden:
                    out.append((f"tangram {name} {sub}", first_paragraph(subcommand)))
    return out


def table() -> str:
    lines = ["| command | what it does |", "| --- | --- |"]
    lines += [f"| `{name}` | {text} |" for name, text in rows()]
    return "\n".join(lines) + "\n"


def readme_table(text: str) -> str | None:
    """The table between the markers of ``text`` (None when a marker is missing)."""
    match = re.search(rf"{re.escape(BEGIN)}\n(.*?){re.escape(END)}", text, re.DOTALL)
    return match.group(1) if match else None


def main() -> None:
    if sys.argv[1:] == ["--write"]:
        text = README.read_text()
        if readme_table(text) is None:
            sys.exit(f"{README}: no {BEGIN} ... {END} markers")
        new = re.sub(rf"({re.escape(BEGIN)}\n).*?({re.escape(END)})",
                     lambda m: m.group(1) + table() + m.group(2), text, flags=re.DOTALL)
        README.write_text(new)
    elif sys.argv[1:]:
        sys.exit("usage: scripts/command_table.py [--write]")
    else:
        sys.stdout.write(table())


if __name__ == "__main__":
    main()
