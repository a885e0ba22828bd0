"""Developer scripts' argument handling (scripts/burst_instructions.py needs valgrind,
which no test runs: only what it says without it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "scripts/burst_instructions.py")


def _run(args: list[str], path: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=path, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_burst_instructions_without_valgrind_says_so_in_one_line(tmp_path: Path) -> None:
    res = _run(["cpu", "--gc", "off"], str(tmp_path))  # an empty PATH: no valgrind
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "valgrind" in lines[0] and "not found" in lines[0]
    assert "Traceback" not in res.stderr


def test_burst_instructions_rejects_an_unknown_scenario(tmp_path: Path) -> None:
    res = _run(["tpu"], str(tmp_path))
    assert res.returncode == 2
    assert "invalid choice" in res.stderr and "Traceback" not in res.stderr
