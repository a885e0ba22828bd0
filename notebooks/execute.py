"""Execute the notebooks with a real Jupyter kernel (nbclient) and report how long each took.

    .venv/bin/python notebooks/execute.py                   # all, outputs discarded
    .venv/bin/python notebooks/execute.py --out runs/nb     # keep executed copies
    .venv/bin/python notebooks/execute.py ablations         # just one
    .venv/bin/python notebooks/execute.py --in-place        # refresh the shipped outputs

Prints one JSON line per notebook ({"notebook", "seconds"}); exits 1 naming the cell that
failed. CI runs the same function (tests/test_notebooks.py), so no notebook can rot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

HERE = Path(__file__).parent
#: seconds a single cell may run before the notebook counts as failed
CELL_TIMEOUT_S = 120


def notebooks() -> list[Path]:
    return sorted(HERE.glob("*.ipynb"))


def execute(path: Path, out: Path | None = None) -> float:
    """Run every cell of ``path`` in a fresh python3 kernel (cwd: notebooks/); seconds taken.
    Raises CellExecutionError with the failing cell's traceback."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(HERE)}})
    t0 = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - t0
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        nbformat.write(_without_timings(nb), out / path.name)
    return seconds


def _without_timings(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The executed notebook less what changes on every run (kernel timings), so a
    refresh of the shipped outputs diffs only where an output changed."""
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)
    return nb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook names (default: all)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, help="write executed copies here")
    where.add_argument("--in-place", action="store_true",
                       help="write the executed notebooks over notebooks/*.ipynb (the "
                            "outputs the repository ships)")
    args = parser.parse_args()
    out = HERE if args.in_place else args.out
    chosen = [p for p in notebooks() if not args.names or p.stem in args.names]
    unknown = set(args.names) - {p.stem for p in chosen}
    if unknown:
        sys.exit(f"unknown notebook(s): {sorted(unknown)} (have {[p.stem for p in notebooks()]})")
    for path in chosen:
        try:
            seconds = execute(path, out)
        except CellExecutionError as e:
            print(f"{path.name} failed:\n{e}", file=sys.stderr)
            sys.exit(1)
        print(json.dumps({"notebook": path.name, "seconds": round(seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
