"""The layers hold (docs/design.md: tangram/ <- traces/ <- {sim/, executor/} <- analysis/ <-
tangram_cli/ <- cli.py; scripts/, examples/ and notebooks/ on top; the SDK, tangram_sdk/,
below them all, importing nothing of the core): every module's imports
are parsed (a notebook's code cells too), and an upward import, a
sim<->executor import or an import cycle fails here, so the structure stays true as the code
grows; and the core has one door (tangram/protocol.py): nothing outside tangram/ imports its
inside (every module tangram/__init__.py does not declare public) or reaches into its
state (tests neither, but the white-box checks named in WHITE_BOX), and backends declare
capabilities instead of being probed."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGES = ("tangram_sdk", "tangram", "traces", "sim", "executor", "analysis", "tangram_cli")
#: package -> the packages it may import (besides itself)
ALLOWED = {
    # the SDK (client, framework adapters, the unit-set parser of the wire format) is
    # installable without the core: it imports nothing of the repository's other packages
    "tangram_sdk": set(),
    # the core reads unit sets with the SDK's parser, and keeps the SDK's old names
    # (test_the_core_imports_of_the_sdk_only_the_wire_format_and_its_old_names)
    "tangram": {"tangram_sdk"},
    "traces": {"tangram"},
    "sim": {"tangram", "traces"},
    "executor": {"tangram", "traces"},
    "analysis": {"tangram", "tangram_sdk", "traces", "sim", "executor"},
    "tangram_cli": {"tangram", "tangram_sdk", "traces", "sim", "executor", "analysis"},
    "cli": set(PACKAGES),
    # developer tools, users' examples and notebooks sit on top of everything; the door
    # rules below hold for them as for any code outside tangram/
    # (and cli.py: scripts/command_table.py draws the README's command table from its app)
    "scripts": set(PACKAGES) | {"cli"},
    "examples": set(PACKAGES),
    "notebooks": set(PACKAGES),
}
#: folders of loose files (not packages) checked like the packages
LOOSE = ("scripts", "examples", "notebooks")
#: the SDK's old names in tangram/ (tangram.client, tangram.integrations.*): each module is
#: the SDK's module of the same name (sys.modules), and imports nothing else
SDK_OLD_NAMES = ("tangram.client", "tangram.integrations")


def modules() -> dict[str, Path]:
    out = {"cli": ROOT / "cli.py"}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts)
            out[name.removesuffix(".__init__")] = path
    for folder in LOOSE:
        for path in [*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.ipynb")]:
            rel = path.relative_to(ROOT).with_suffix("")
            out[".".join(rel.parts)] = path
    return out


def source_of(path: Path) -> str:
    """A module's text, or a notebook's code cells (without IPython's magics)."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return "\n".join(line for cell in code for line in cell.splitlines()
                     if not line.lstrip().startswith(("%", "!")))


def imports_of(path: Path, name: str) -> set[str]:
    """Project modules ``path`` imports (at any depth: lazy imports count too)."""
    tree = ast.parse(source_of(path), str(path))
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
    """(The HTTP client and the adapters that read one, an idle TTL, live in tangram_sdk/.)"""
    for path in (ROOT / "tangram").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            clocks = [n for n in names if n.split(".")[0] in ("time", "datetime")]
            assert not clocks, f"{rel} imports {clocks}: the core must be given the time"



def test_the_sdk_imports_nothing_of_the_core():
    """tangram_sdk/ (the HTTP client, the framework adapters) is its own layer: a training
    job installs it without the core (tests/test_sdk.py imports it with the core blocked)."""
    sdk = sorted(n for n in GRAPH if n.split(".")[0] == "tangram_sdk")
    assert "tangram_sdk.client" in sdk and "tangram_sdk.integrations.verl" in sdk, sdk
    bad = {n: sorted(m for m in GRAPH[n] if m.split(".")[0] != "tangram_sdk") for n in sdk}
    assert not any(bad.values()), {n: b for n, b in bad.items() if b}


def _is_old_name(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in SDK_OLD_NAMES)


def test_the_core_imports_of_the_sdk_only_the_wire_format_and_its_old_names():
    """The core needs of the SDK only the unit-set parser (tangram_sdk.units, which the
    server reads the HTTP API's text with); tangram.client and tangram.integrations.* are
    the SDK's modules under their old names, each importing its own counterpart only."""
    for name in sorted(n for n in GRAPH if n.split(".")[0] == "tangram"):
        sdk = sorted(m for m in GRAPH[name] if m.split(".")[0] == "tangram_sdk")
        if _is_old_name(name):
            if name == "tangram.integrations":  # the package: imports nothing
                assert not GRAPH[name], (name, GRAPH[name])
                continue
            assert sdk == ["tangram_sdk" + name.removeprefix("tangram")], (name, sdk)
            assert GRAPH[name] == set(sdk), (name, GRAPH[name])
        else:
            assert all(m.startswith("tangram_sdk.units") for m in sdk), (name, sdk)

# -- one door into the core (tangram/protocol.py) ------------------------------------------
def declared_public() -> tuple[set[str], tuple[str, ...]]:
    """The modules tangram/__init__.py declares public (its ``PUBLIC`` table's keys) and
    the packages public whole (``PUBLIC_PACKAGES``), read from its text: the declaration
    is the one place that says what is inside."""
    tree = ast.parse((ROOT / "tangram" / "__init__.py").read_text())
    found: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = ast.literal_eval(node.value)  # type: ignore[arg-type]
    return set(found["PUBLIC"]), tuple(found["PUBLIC_PACKAGES"])  # type: ignore[arg-type]


PUBLIC, PUBLIC_PACKAGES = declared_public()
#: modules of tangram/ that are the core's inside: every module tangram/__init__.py does not
#: export (managers, pools, schedulers, the binding, the parts...) is reached through the
#: core's commands, effects and snapshot, never directly
CORE_INSIDE = frozenset(
    n for n in GRAPH if n.startswith("tangram.") and n not in PUBLIC
    and not any(n == p or n.startswith(p + ".") for p in PUBLIC_PACKAGES))


def is_inside(imported: str) -> bool:
    """``imported`` (a module, or a name imported from one) is of the core's inside."""
    if imported in CORE_INSIDE:
        return True
    return imported not in GRAPH and imported.rpartition(".")[0] in CORE_INSIDE
#: the core's mutable state (attributes of a Tangram)
CORE_STATE = {"cpu", "gpu", "quota", "pools", "running", "queued", "unbound", "opening",
              "trajectories", "passes", "scheduler", "estimates", "cluster", "policy"}
OUTSIDE = ("tangram_sdk", "sim", "executor", "analysis", "traces", "cli", "tangram_cli", *LOOSE)


def _coreish(node: ast.expr) -> bool:
    """An expression that names the core or the runtime around it (``core``, ``live_core``,
    ``executor.core``, ``cores[-1]``, ``self.runtime``...)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    name = node.id if isinstance(node, ast.Name) else \
        node.attr if isinstance(node, ast.Attribute) else ""
    return "core" in name.lower() or "runtime" in name.lower()


def reach_ins(path: Path) -> list[str]:
    """Places in ``path`` that reach past the core's door: an attribute of the core's state
    or a private attribute of the core or the runtime (also through getattr)."""
    out = []
    for node in ast.walk(ast.parse(source_of(path))):
        if isinstance(node, ast.Attribute) and _coreish(node.value) and (
                node.attr in CORE_STATE or node.attr.startswith("_")):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and _coreish(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and (node.args[1].value in CORE_STATE or str(node.args[1].value).startswith("_"))):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n.split(".")[0] in OUTSIDE))
def test_nothing_outside_the_core_imports_its_inside(name):
    bad = sorted(m for m in GRAPH[name] if is_inside(m))
    assert not bad, (f"{name} imports {bad}: outside tangram/, use the core's door "
                     "(tangram/protocol.py: commands, effects, Snapshot)")


def test_the_declared_api_resolves_and_keeps_the_inside_inside():
    """Every name tangram/__init__.py exports resolves, each public module exists, and the
    managers, pools and schedulers stay inside."""
    import tangram

    for name in tangram.__all__:
        assert getattr(tangram, name) is not None, name
    assert PUBLIC <= set(GRAPH), sorted(PUBLIC - set(GRAPH))
    for unit in ("tangram.cpu.manager", "tangram.cpu.pool", "tangram.cpu.binding",
                 "tangram.gpu.manager", "tangram.gpu.pool", "tangram.gpu.eoe",
                 "tangram.api.quota", "tangram.pool", "tangram.scheduler"):
        assert unit in CORE_INSIDE, unit


def test_nothing_outside_the_core_reaches_into_its_state():
    found = [hit for name, path in modules().items() if name.split(".")[0] in OUTSIDE
             for hit in reach_ins(path)]
    assert not found, ("reach-ins past the core's door (use Tangram.handle / snapshot / "
                       "the point queries of tangram/protocol.py):\n" + "\n".join(found))


#: tests that read a Tangram's inside on purpose (file -> the expressions allowed there), each
#: checking a property of the inside that the door does not show
WHITE_BOX = {
    # the EOE pool's starvation bound: when a request chose to wait is the pool's own state
    "tests/test_gpu_eoe.py": {"core._pools", "core._running"},
}


def test_no_test_reaches_into_the_core_but_the_white_box_ones():
    """Tests drive the core as any code outside it does (tests/helpers.py: Commands in
    through ``handle``, reads from ``snapshot`` and the point queries); a test of an inside
    unit imports that unit and builds it, and does not read a Tangram's private state."""
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        allowed = WHITE_BOX.get(str(path.relative_to(ROOT)), set())
        found += [hit for hit in reach_ins(path) if hit.split(": ", 1)[1] not in allowed]
    assert not found, "reach-ins past the core's door in tests:\n" + "\n".join(found)


def test_the_reach_in_check_catches_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(executor, core, runtime):\n"
                     "    return executor.core.running, core.gpu.restores, runtime._launch, "
                     "getattr(core, 'queued')\n")
    assert len(reach_ins_of(probe)) == 4


def reach_ins_of(path: Path) -> list[str]:
    """reach_ins for a file outside the repository (the check's own test)."""
    global ROOT
    saved, ROOT = ROOT, path.parent
    try:
        return reach_ins(path)
    finally:
        ROOT = saved


def test_the_simulator_reads_no_private_attribute():
    """sim/ drives SimPy through its public API (``env.peek()``, not ``env._queue``)."""
    for path in (ROOT / "sim").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)} is "
                            "private to another object")


def test_backends_declare_capabilities_instead_of_being_probed():
    """No getattr/hasattr stands in for what a backend can do: a capability is a method, read
    with isinstance of tangram.protocol's protocols (capabilities_of)."""
    probes = {"serves_batches", "prerestores", "watch_nodes", "watch", "open_trajectory_image",
              "env", "gpu", "put_file", "prerestore", "name", "capabilities", "evict",
              "move", "shed", "fork", "traits"}
    for name, path in modules().items():
        if name.split(".")[0] not in (*OUTSIDE, "tangram"):
            continue
        for node in ast.walk(ast.parse(source_of(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in probes):
                pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)} probes "
                            "a capability: implement the method and read it with "
                            "tangram.protocol.capabilities_of")


def _pauses(call: ast.Call) -> bool:
    """A call that sleeps: ``sleep(...)``, or ``x.wait(<seconds>)`` (an Event's wait with a
    constant timeout is a sleep by another name)."""
    name = getattr(call.func, "attr", "") or getattr(call.func, "id", "")
    if "sleep" in name:
        return True
    return (name == "wait" and len(call.args) == 1 and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, int | float))


def test_no_test_polls_with_a_count_of_tries():
    """A wait in a test is a condition with a generous deadline and a message saying what
    was awaited and seen (helpers.until / until_true), not ``for _ in range(N): ...
    sleep``: a loop of N tries is a wall-clock deadline under another name, tight on a
    loaded machine (issue 46 #4: the docker end-to-end test failed that way)."""
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.For | ast.AsyncFor) and isinstance(node.iter, ast.Call)
                    and getattr(node.iter.func, "id", "") == "range"):
                continue
            inside = list(ast.walk(node))
            sleeps = any(isinstance(sub, ast.Call) and _pauses(sub) for sub in inside)
            # polling: it leaves when a condition holds (a loop that sleeps as part of its
            # scenario, a kill point, runs every round)
            polls = any(isinstance(sub, ast.Break | ast.Return) for sub in inside)
            if sleeps and polls:
                pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno}: a loop of "
                            f"{ast.unparse(node.iter)} tries with a sleep: wait for a "
                            "condition instead (tests/helpers.py until)")
