"""Review of `--record` (issue 52): a recording that cannot be made is refused before the
run with the path and the reason (exit 2, no traceback), and leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from executor.record import Recorder, RecordError, check_record_path, cluster_path
from sim.cluster import load_cluster

ROOT = Path(__file__).resolve().parent.parent


def test_a_directory_no_file_can_be_made_in_is_refused():
    # (os.access says yes to root in /proc: the run started, then failed with a traceback)
    with pytest.raises(RecordError, match=r"--record: cannot write in /proc"):
        check_record_path(Path("/proc/r.jsonl"))


def test_a_recorder_that_cannot_write_its_cluster_leaves_no_trace(tmp_path: Path):
    trace = tmp_path / "r.jsonl"
    cluster_path(trace).mkdir()  # (its cluster file cannot be made)
    with pytest.raises(RecordError, match=r"--record: cannot write .*r-cluster.yaml"):
        Recorder(trace, load_cluster("default"), lambda *a: None)
    assert not trace.exists()


def test_run_refuses_a_recording_it_cannot_make_without_a_traceback(tmp_path: Path):
    trace = tmp_path / "r.jsonl"
    cluster_path(trace).mkdir()
    done = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "run", "--trace",
         str(ROOT / "traces/samples/coding.parquet"), "--limit", "1", "--out",
         str(tmp_path / "o"), "--record", str(trace), "-q"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 2, done.stderr
    assert "--record: cannot write" in done.stderr and "Traceback" not in done.stderr, \
        done.stderr
    assert not trace.exists()
