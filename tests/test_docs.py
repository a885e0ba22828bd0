"""The documentation cannot drift from the code (issue 48 #4): the README's table of every
`tangram` command is what scripts/command_table.py draws from the app, and docs/design.md's
lists - the core's commands and effects, the backend capabilities and traits, the door's
exports (tangram/__init__.py PUBLIC), the layers (tests/test_layering.py ALLOWED), the CLI's
commands and the modules of tangram/ - are compared with the code as it is when the test
runs. Each list sits between ``<!-- name -->`` and ``<!-- /name -->`` markers; a missing or
extra entry fails naming it and the line of docs/design.md to fix. Every relative link of
the README and of docs/ must lead to a file that exists."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import re
import typing
from pathlib import Path

import pytest

import cli
import tangram
from tangram import protocol

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"


# -- reading the marked lists --------------------------------------------------------------
def block(name: str, path: Path = DESIGN) -> tuple[int, list[str]]:
    """The lines between ``<!-- name -->`` and ``<!-- /name -->`` of ``path``, and the
    1-based line number of the first of them."""
    text = path.read_text()
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    assert begin in text and end in text, \
        f"{path.relative_to(ROOT)}: no {begin} ... {end} markers (around a list checked here)"
    start = text.index(begin) + len(begin)
    inner = text[start:text.index(end, start)]
    return text[:start].count("\n") + 1, inner.split("\n")


def rows(name: str) -> list[tuple[int, list[str]]]:
    """(line number, cells) of each body row of the Markdown table in block ``name``."""
    first, lines = block(name)
    out = []
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-", " ", ":"}:  # the separator
            continue
        out.append((first + i, cells))
    assert out, f"docs/design.md: the {name} table is empty"
    return out[1:]  # without the header


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def column(name: str) -> dict[str, int]:
    """The first column's name -> its line, for table ``name``."""
    out: dict[str, int] = {}
    for line, cells in rows(name):
        names = ticked(cells[0])
        assert len(names) == 1, f"docs/design.md:{line}: one `name` in the first column"
        assert names[0] not in out, f"docs/design.md:{line}: {names[0]} listed twice"
        out[names[0]] = line
    return out


def compare(what: str, documented: dict[str, int], actual: set[str], where: str) -> None:
    """Fail naming every entry of ``actual`` the doc lacks and every one it has too many."""
    missing = sorted(actual - set(documented))
    extra = sorted(set(documented) - actual)
    problems = [f"{n}: in {where} but not in docs/design.md's {what} list" for n in missing]
    problems += [f"{n}: docs/design.md:{documented[n]} lists it, but it is not in {where}"
                 for n in extra]
    assert not problems, "\n".join(problems)


# -- the README's command table --------------------------------------------------------------
def _command_table_script():
    spec = importlib.util.spec_from_file_location("command_table",
                                                  ROOT / "scripts" / "command_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_lists_every_command_as_the_app_has_it():
    script = _command_table_script()
    documented = script.readme_table(README.read_text())
    assert documented is not None, "README.md: no <!-- commands --> ... <!-- /commands --> markers"
    drawn = script.table()
    if documented != drawn:
        def names(table: str) -> set[str]:
            return set(re.findall(r"^\| `(tangram[^`]*)`", table, re.M))
        missing = sorted(names(drawn) - names(documented))
        extra = sorted(names(documented) - names(drawn))
        pytest.fail(f"README.md's command table is out of date (missing {missing}, extra "
                    f"{extra}, or a help line changed): run "
                    "`PYTHONPATH=. python scripts/command_table.py --write`")


def test_the_command_table_has_every_command_and_subcommand():
    names = [name for name, _ in _command_table_script().rows()]
    assert names[: 1] == ["tangram simulate"]
    for name in cli.COMMANDS:
        assert f"tangram {name}" in names
    for group in cli.GROUPS:
        subs = [n for n in names if n.startswith(f"tangram {group} ")]
        assert subs, f"tangram {group}: no subcommand in the table"


# -- docs/design.md against the code ---------------------------------------------------------
def test_design_lists_every_command_of_the_core():
    actual = {c.__name__ for c in typing.get_args(protocol.Command)}
    compare("commands", column("commands"), actual, "tangram/protocol.py Command")


def test_design_lists_every_effect_of_the_core():
    actual = {e.__name__ for e in typing.get_args(protocol.Effect)}
    compare("effects", column("effects"), actual, "tangram/protocol.py Effect")


def _protocol_methods(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}


def test_design_lists_every_capability_with_its_protocol_and_methods():
    table = {}
    for line, cells in rows("capabilities"):
        (name,), (proto,), methods = ticked(cells[0]), ticked(cells[1]), ticked(cells[2])
        table[name] = (line, proto, set(methods))
    compare("capabilities", {n: v[0] for n, v in table.items()},
            set(protocol.METHOD_CAPABILITIES), "tangram/protocol.py METHOD_CAPABILITIES")
    for name, proto in protocol.METHOD_CAPABILITIES.items():
        line, documented, methods = table[name]
        assert documented == proto.__name__, \
            f"docs/design.md:{line}: {name} is {proto.__name__}'s, not {documented}'s"
        assert methods == _protocol_methods(proto), \
            f"docs/design.md:{line}: {proto.__name__}'s methods are {sorted(_protocol_methods(proto))}"


def test_every_capability_protocol_is_in_the_table():
    """A runtime-checkable protocol of tangram/protocol.py that METHOD_CAPABILITIES does not
    name is a capability nothing reads (and the design's table would not list it)."""
    named = set(protocol.METHOD_CAPABILITIES.values())
    protocols = {name for name, obj in vars(protocol).items()
                 if inspect.isclass(obj) and getattr(obj, "_is_runtime_protocol", False)
                 and obj.__module__ == protocol.__name__ and not name.startswith("_")
                 and obj not in named}
    assert not protocols, f"runtime-checkable protocols no capability names: {sorted(protocols)}"


def test_design_lists_the_declared_traits():
    first, lines = block("traits")
    actual = {f.name for f in dataclasses.fields(protocol.Traits)}
    documented = {n: first for n in ticked("\n".join(lines))}
    compare("traits", documented, actual, "tangram/protocol.py Traits")


def test_design_lists_the_doors_exports_module_by_module():
    table: dict[str, tuple[int, set[str]]] = {}
    for line, cells in rows("exports"):
        (module,) = ticked(cells[0])
        names = ticked(cells[1])
        assert len(names) == len(set(names)), f"docs/design.md:{line}: a name listed twice"
        table[module] = (line, set(names))
    compare("exports (modules)", {m: v[0] for m, v in table.items()}, set(tangram.PUBLIC),
            "tangram/__init__.py PUBLIC")
    problems = []
    for module, names in tangram.PUBLIC.items():
        line, documented = table[module]
        problems += [f"{n}: exported from {module} (tangram/__init__.py PUBLIC) but not on "
                     f"docs/design.md:{line}" for n in sorted(set(names) - documented)]
        problems += [f"{n}: docs/design.md:{line} lists it under {module}, but PUBLIC does not"
                     for n in sorted(documented - set(names))]
    assert not problems, "\n".join(problems)
    first, lines = block("packages")
    compare("public packages", {p: first for p in ticked("\n".join(lines))},
            set(tangram.PUBLIC_PACKAGES), "tangram/__init__.py PUBLIC_PACKAGES")


def _layering_rules() -> dict[str, set[str]]:
    """tests/test_layering.py's ALLOWED, read from its source (PACKAGES, then ALLOWED,
    evaluated alone: importing it would parse the whole tree)."""
    tree = ast.parse((ROOT / "tests" / "test_layering.py").read_text())
    namespace: dict = {}
    for node in tree.body:
        targets = [getattr(t, "id", None) for t in getattr(node, "targets", [])]
        if isinstance(node, ast.AnnAssign):
            targets = [getattr(node.target, "id", None)]
        if {"PACKAGES", "ALLOWED"} & set(targets):
            exec(compile(ast.Module([node], []), "test_layering.py", "exec"), namespace)
    return namespace["ALLOWED"]


def test_design_lists_the_layers_as_test_layering_holds_them():
    allowed = _layering_rules()
    table: dict[str, tuple[int, set[str]]] = {}
    for line, cells in rows("layers"):
        (layer,) = ticked(cells[0])
        table[layer] = (line, set(ticked(cells[1])))
    compare("layers", {k: v[0] for k, v in table.items()}, set(allowed),
            "tests/test_layering.py ALLOWED")
    for layer, may in allowed.items():
        line, documented = table[layer]
        assert documented == set(may), (
            f"docs/design.md:{line}: {layer} may import {sorted(may)} "
            f"(tests/test_layering.py ALLOWED), the doc says {sorted(documented)}")


def test_design_lists_the_cli_commands_and_their_modules():
    table = {}
    for line, cells in rows("cli"):
        (name,), (module,) = ticked(cells[0]), ticked(cells[1])
        table[name] = (line, module)
    compare("cli", {n: v[0] for n, v in table.items()}, set(cli.COMMANDS), "cli.py COMMANDS")
    for name, (module, _) in cli.COMMANDS.items():
        line, documented = table[name]
        assert documented == f"tangram_cli/{module}.py", \
            f"docs/design.md:{line}: `tangram {name}` lives in tangram_cli/{module}.py"


def test_design_lists_every_module_of_tangram():
    """Both ways: every module docs/design.md lists exists (one moved or removed fails
    naming the line), and every module of tangram/ is listed. A package is listed whole
    (its ``tangram/pkg/`` row: its ``__init__.py``, and all its modules when the table lists
    none of them, as for the SDK's old names in tangram/integrations/) or module by module
    (then each of them)."""
    listed: dict[str, int] = {}
    problems = []
    for line, cells in rows("modules"):
        (path,) = ticked(cells[0])
        listed[path] = line
        if not (ROOT / path).exists():
            problems.append(f"docs/design.md:{line} lists {path}, which is not in the tree: "
                            "fix that line (or remove it)")
    for file in sorted((ROOT / "tangram").rglob("*.py")):
        path = str(file.relative_to(ROOT))
        package = f"{file.parent.relative_to(ROOT)}/"
        whole = package in listed and (file.name == "__init__.py" or not any(
            p.startswith(package) and p.endswith(".py") for p in listed))
        if path not in listed and not whole:
            problems.append(f"{path} is not in docs/design.md's modules table: add a row "
                            "for it (what it holds)")
    assert not problems, "\n".join(problems)


_PATH = re.compile(r"(?<![\w./-])((?:tangram|tangram_sdk|tangram_cli|executor|sim|traces|analysis|scripts|"
                   r"examples|notebooks|tests)/[\w./{},-]*)")


def _expand(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for alt in match.group(1).split(",")
            for p in _expand(path[:match.start()] + alt + path[match.end():])]


def test_every_path_design_names_exists():
    problems = []
    for number, line in enumerate(DESIGN.read_text().split("\n"), 1):
        for token in _PATH.findall(line):
            for path in _expand(token.rstrip(".,")):
                if not (ROOT / path).exists():
                    problems.append(f"docs/design.md:{number}: {path} is not in the tree")
    assert not problems, "\n".join(problems)


# -- links --------------------------------------------------------------------------------
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file(page: Path):
    problems = []
    for number, line in enumerate(page.read_text().split("\n"), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                problems.append(f"{page.relative_to(ROOT)}:{number}: {target} does not exist")
    assert not problems, "\n".join(problems)


def test_the_readme_stays_short_and_serves_the_process_backend_first():
    text = README.read_text()
    assert len(text.splitlines()) <= 400, "README.md: at most 400 lines (issue 48 #4)"
    serves = re.findall(r"tangram serve --backend (\w+)", text)
    assert serves and serves[0] == "process", \
        f"README.md: the first `tangram serve` must need nothing built (process), not {serves[:1]}"
    assert text.index("```python") < text.index("## Simulate"), \
        "README.md: the client example comes before the simulation sections"


# -- the SDK's names (issue 48) -----------------------------------------------------------
#: the SDK's names before it left tangram/ (tangram/client.py and tangram/integrations/ alias
#: them, for existing configs): what a reader copies uses the new ones
OLD_SDK_NAME = re.compile(r"\btangram[./](?:client|integrations)\b")


def _code_blocks(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each fenced code block of a Markdown page."""
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^ *```[^\n]*\n(.*?)^ *```", text, re.DOTALL | re.MULTILINE)]


def test_copied_code_uses_the_sdks_new_names():
    """The README's and docs' code blocks and the examples import the SDK as
    ``tangram_sdk.client`` / ``tangram_sdk.integrations.*``, never by the old names
    ``tangram.client`` / ``tangram.integrations.*`` (which still work)."""
    problems = []
    for page in PAGES:
        for first, code in _code_blocks(page.read_text()):
            for i, line in enumerate(code.split("\n")):
                if OLD_SDK_NAME.search(line):
                    problems.append(f"{page.relative_to(ROOT)}:{first + i}: {line.strip()}")
    for path in sorted((ROOT / "examples").rglob("*")):
        if path.is_file() and path.suffix in (".py", ".yaml", ".yml", ".md", ".toml"):
            for number, line in enumerate(path.read_text().split("\n"), 1):
                if OLD_SDK_NAME.search(line):
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not problems, "old SDK names (use tangram_sdk):\n" + "\n".join(problems)
