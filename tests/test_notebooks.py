"""The analysis notebooks: shipped with their outputs (a reader sees the figures without a
kernel), linked from the README, and executed
top to bottom with a real Jupyter kernel (nbclient + ipykernel). How long each takes is
printed as a figure (JSON), not bounded: the CI machine is loaded."""

from __future__ import annotations

import importlib.util
import json
import time

import nbformat
import pytest
from conftest import ROOT

NOTEBOOKS = ROOT / "notebooks"
EXPECTED = {"coding_vs_kubernetes", "gpu_burst_vs_static", "sim_vs_live", "ablations"}


def _executor():
    spec = importlib.util.spec_from_file_location("nb_execute", NOTEBOOKS / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_notebooks_are_there_and_linked_from_the_readme():
    names = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    assert EXPECTED <= names
    readme = (ROOT / "README.md").read_text()
    for name in names:
        assert f"notebooks/{name}.ipynb" in readme, f"README does not link {name}.ipynb"
    assert "tangram-rl[notebooks]" in readme and "jupyter lab notebooks/" in readme


def _figures(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells
               if c.cell_type == "code" for o in c.outputs)


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_committed_notebook_ships_its_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    unrun = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unrun, (f"{path.name}: cells {unrun} were not run; refresh the outputs with "
                       "`python notebooks/execute.py --in-place`")
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name}: cells ran out of order ({counts}); run it top to bottom")
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: ships an error output: {errors[0].get('ename')}"
    assert _figures(nb) >= 2, f"{path.name}: ships {_figures(nb)} figures, expected its figures"
    assert nb.cells[0].cell_type == "markdown", f"{path.name}: start with the story"


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebook_runs_in_a_kernel(path, tmp_path):
    t0 = time.perf_counter()
    _executor().execute(path, out=tmp_path)
    seconds = time.perf_counter() - t0
    print(json.dumps({"notebook": path.name, "seconds": round(seconds, 1)}))
    executed = nbformat.read(tmp_path / path.name, as_version=4)
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    assert _figures(executed) >= 2, f"{path.name}: expected its figures, got {_figures(executed)}"
