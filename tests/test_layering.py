"""The layers hold (README, Layout: tangram/ <- traces/ <- {sim/, executor/} <- analysis/ <-
tangram_cli/ <- cli.py):
every module's imports are parsed, and an upward import, a sim<->executor import or an
import cycle fails here, so the structure stays true as the code grows."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGES = ("tangram", "traces", "sim", "executor", "analysis", "tangram_cli")
#: package -> the packages it may import (besides itself)
ALLOWED = {
    "tangram": set(),
    "traces": {"tangram"},
    "sim": {"tangram", "traces"},
    "executor": {"tangram", "traces"},
    "analysis": {"tangram", "traces", "sim", "executor"},
    "tangram_cli": {"tangram", "traces", "sim", "executor", "analysis"},
    "cli": set(PACKAGES),
}
#: the HTTP client talks to a server, and the framework adapters built on it (idle TTL of
#: a verl rollout's sandbox) live beside it: the modules of tangram/ allowed a wall clock
WALL_CLOCK_OK = {"tangram/client.py"}
WALL_CLOCK_OK_DIRS = ("tangram/integrations/",)


def modules() -> dict[str, Path]:
    out = {"cli": ROOT / "cli.py"}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports_of(path: Path, name: str) -> set[str]:
    """Project modules ``path`` imports (at any depth: lazy imports count too)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                base = name.split(".")[: -node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    top = set(PACKAGES) | {"cli"}
    return {m for m in found if m.split(".")[0] in top}


GRAPH = {name: imports_of(path, name) for name, path in modules().items()}


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_no_upward_or_sideways_import(name):
    layer = name.split(".")[0]
    bad = sorted(m for m in GRAPH[name]
                 if m.split(".")[0] != layer and m.split(".")[0] not in ALLOWED[layer])
    assert not bad, f"{name} ({layer}/) imports {bad}: not allowed by the layering"


def test_no_import_cycles():
    known = set(GRAPH)
    edges = {n: {m for m in deps if m in known and m != n} for n, deps in GRAPH.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == 1:
                cycle = path[path.index(m):] + [m]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        path.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)


def test_the_core_reads_no_wall_clock():
    for path in (ROOT / "tangram").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if rel in WALL_CLOCK_OK or rel.startswith(WALL_CLOCK_OK_DIRS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            clocks = [n for n in names if n.split(".")[0] in ("time", "datetime")]
            assert not clocks, f"{rel} imports {clocks}: the core must be given the time"
