"""The `tangram` app: its command table tells the truth, a command imports only its own
module, and a simulation needs nothing from the extras (`make simulate` installs none)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cli

ROOT = Path(__file__).parent.parent
#: top-level modules of the optional extras (pyproject: dev, ray, notebooks)
EXTRAS = ("ray", "schemathesis", "gymnasium", "skyrl_gym", "sympy", "verl", "transformers",
          "omegaconf", "nbclient", "nbformat", "ipykernel", "selenium", "hypothesis", "pytest",
          "jupyterlab")


def _first_paragraph(text: str) -> str:
    return " ".join(inspect.cleandoc(text).split("\n\n")[0].split())


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_the_command_table_shows_each_commands_own_help(name):
    command = cli.load_command(name)
    assert command.name == name
    assert _first_paragraph(cli.COMMANDS[name][1]) == _first_paragraph(command.help)


def test_groups_are_groups_and_commands_are_commands():
    for name in cli.COMMANDS:
        assert hasattr(cli.load_command(name), "commands") == (name in cli.GROUPS), name


def _modules_after(args: list[str], cwd: Path) -> set[str]:
    """Run ``tangram ARGS`` in a fresh interpreter; the top-level modules it imported."""
    probe = ("import sys\nimport cli\nsys.argv = ['tangram', *sys.argv[1:]]\n"
             "try:\n    cli.app()\nexcept SystemExit as e:\n    code = e.code\n"
             "print('MODULES', ' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
             "sys.exit(code)\n")
    res = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True,
                         cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("MODULES "))
    return set(line.split()[1:])


def test_help_and_burn_import_neither_pandas_nor_the_server(tmp_path):
    for args in (["--help"], ["burn", "--t1", "0"]):
        loaded = _modules_after(args, tmp_path)
        assert not loaded & {"pandas", "fastapi", "matplotlib", "simpy", "analysis"}, args


def test_a_simulation_imports_nothing_from_the_extras(tmp_path):
    loaded = _modules_after(["simulate", "--limit", "2", "-q", "--out", str(tmp_path / "o")],
                            tmp_path)
    assert "sim" in loaded and "pandas" in loaded  # it did simulate
    assert not loaded & set(EXTRAS)


def test_a_mistyped_command_exits_2_with_the_close_names():
    res = subprocess.run([sys.executable, str(ROOT / "cli.py"), "simulat"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "Did you mean 'simulate'?" in res.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["serve", "--ray", "auto", "--mem-overcommit", "2"],
     "the nodes of a Ray cluster are not observed"),
    (["image", "build", "--wheels", "/nonexistent/wheels"], "not a directory"),
    (["image", "build", "--bare", "--wheels", "."], "a bare image has no python packages"),
])
def test_memory_and_image_options_refuse_what_cannot_apply(args, says, tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2 and says in " ".join(res.stderr.split()), res.stderr
    assert "Traceback" not in res.stderr
