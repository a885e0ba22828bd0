"""Every `tangram bench` command, and `tangram policies`, run once from the CLI as a user
runs them (issue 46 #3), at the smallest options that still exercise them: exit 0, every
line of stdout a JSON object (the benches print their figures as JSON lines), the files
they are asked for written and read back, and their progress said on stderr.

Covered elsewhere, from the CLI too: `simulate` (test_traces_cli, test_analysis_api,
test_reproduce), `reproduce --quick --only ...` (test_reproduce), `trace generate` and
`trace validate` (test_traces_cli), `plot` (test_reproduce, test_analysis_api), `compare`
(test_replay, test_failed_runs_flagged), `burn` (test_cli), `run` (test_run_effects,
test_replay, test_gpu_worker), `serve` (test_e2e_serve and most of the suite).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cli

ROOT = Path(__file__).resolve().parent.parent
#: a hang guard per command (s): a loaded 2-core CI machine, never a speed bound
TIMEOUT_S = 600

#: each bench and the smallest arguments that still run it end to end (``{out}``: a
#: directory of the test's own); each takes seconds of CPU (none needs `--help` only)
BENCHES: dict[str, tuple[str, ...]] = {
    "scheduler": ("--actions", "64"),
    "simulate": ("--trajectories", "16"),
    "learning": ("--seeds", "1"),
    "sim-scale": ("--points", "coding:64", "--out", "{out}/scale.jsonl"),
    "gpu-target": ("--trajectories", "16", "--workers", "1"),
    "fork-sim": ("--trajectories", "16", "--group", "2"),
    "gpu": ("--device", "cpu", "--sizes-gb", "0.02", "--batches", "1", "--tokens", "4",
            "--cycles", "1"),
    "executor": ("--backend", "process", "--actions", "5"),
    "serve": ("--trajectories", "2", "--actions", "2"),
    "serve-scale": ("--trajectories", "2", "--actions", "2", "--every", "0.5",
                    "--clients", "1"),
    "adapters": ("--calls", "10"),
    "fork": ("--size", "2", "--rounds", "1"),
    # the simulated half (its --live half: tests/test_images_bench.py)
    "images": ("--quick",),
    "live-mix": ("--policies", "tangram", "--trajectories", "1", "--shorts", "2",
                 "--think-s", "0", "--cores", "1",
                 "--modules", "sympy.ntheory.tests.test_primetest"),
    # the quick scale's cells of one workload and one seed, every competitor
    "regret": ("--workloads", "mopd", "--seeds", "1009", "--workers", "1", "--out", "{out}"),
}
#: files a bench writes when asked (relative to ``{out}``)
WRITES: dict[str, tuple[str, ...]] = {"sim-scale": ("scale.jsonl",),
                                      "regret": ("regret.json", "regret.png")}


def tangram(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=TIMEOUT_S)


def json_lines(text: str) -> list[dict]:
    """Every non-empty line as a JSON object (AssertionError naming a line that is not)."""
    rows = []
    for line in text.splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise AssertionError(f"not a JSON line: {line!r} ({e})") from None
    assert rows and all(isinstance(r, dict) for r in rows), text[-2000:]
    return rows


def test_every_bench_command_is_run_here():
    """A new `tangram bench` command needs a line in BENCHES."""
    assert set(BENCHES) == set(cli.load_command("bench").commands)


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_bench_runs_from_the_cli(bench: str, tmp_path: Path):
    args = [a.format(out=tmp_path) for a in BENCHES[bench]]
    res = tangram("bench", bench, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    rows = json_lines(res.stdout)
    assert not any(r.get("errors") for r in rows), rows  # a bench that counts its errors
    # off a terminal (here a pipe), its progress as lines on stderr (issue 46 #6; their
    # periodic lines: test_progress): when it starts, and at the end its count or its time
    said = [line for line in res.stderr.splitlines() if line.startswith(f"bench {bench}")]
    assert said and said[0] == f"bench {bench} ...", res.stderr[-3000:]
    assert re.fullmatch(rf"bench {bench}: (\d+/\d+ \(\d+%\), \d+\.\d\d/s, )?done in \d+\.\d s",
                        said[-1]), res.stderr[-3000:]
    for name in WRITES.get(bench, ()):
        read_back(tmp_path / name)


def read_back(path: Path) -> None:
    """A file a bench wrote parses as what its name says."""
    if path.suffix == ".jsonl":
        json_lines(path.read_text())
    elif path.suffix == ".json":
        assert json.loads(path.read_text()), path
    else:
        assert path.read_bytes().startswith(b"\x89PNG"), path


def test_policies_lists_every_policy_simulate_takes():
    from tangram.policies import REGISTRY

    res = tangram("policies")
    assert res.returncode == 0, res.stderr
    for name in REGISTRY:
        assert name in res.stdout, name
