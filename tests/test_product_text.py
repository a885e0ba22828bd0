"""Product code carries the why, not the project's history: no "issue N" / "stop N"
pointers in its docstrings, comments or strings (they belong in docs/evidence/decisions.md
and the commit log, where a reader of the code does not have to follow them)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the product's packages (tests, scripts and docs may cite the history)
PRODUCT = ("tangram", "sim", "executor", "analysis", "traces", "tangram_cli", "tangram_sdk")
#: ("issue #N" of another project is a citation, not a pointer)
POINTER = re.compile(r"\b(?:[Ii]ssues?|[Ss]tops?) \d+\b")


def test_no_research_pointers_in_product_code() -> None:
    files = [ROOT / "cli.py", *(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py"))]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if POINTER.search(line)]
    assert len(files) > 100
    assert not found, "\n".join(found)
