"""Review of `--record` (issue 52): a recording that cannot be made is refused before the
run with the path and the reason (exit 2, no traceback), and leaves nothing behind."""

from __future__ import annotations

import os
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
    with pytest.raises(RecordError, match=r"--record: .*r-cluster.yaml"):
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
    # (refused before the run: its cluster file's path is taken)
    assert "--record: " in done.stderr and "r-cluster.yaml" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not trace.exists()


def test_an_existing_cluster_file_beside_the_recording_is_not_overwritten(tmp_path: Path):
    trace = tmp_path / "r.jsonl"
    cluster_path(trace).write_text("mine\n")
    with pytest.raises(RecordError, match=r"r-cluster.yaml exists"):
        check_record_path(trace)
    assert cluster_path(trace).read_text() == "mine\n"


def test_a_recording_of_nothing_is_not_kept(tmp_path: Path):
    # (a `serve --record` whose port was taken left a header and a cluster file, and the
    # next try at the same path was refused: "exists")
    trace = tmp_path / "r.jsonl"
    recorder = Recorder(trace, load_cluster("default"), lambda *a: None)
    assert trace.exists() and cluster_path(trace).exists()
    recorder.close()
    assert not trace.exists() and not cluster_path(trace).exists()
    check_record_path(trace)  # free for the next try


def test_serve_whose_port_is_taken_leaves_no_recording(tmp_path: Path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        trace = tmp_path / "srv.jsonl"
        done = subprocess.run(
            [sys.executable, str(ROOT / "cli.py"), "serve", "--backend", "process", "--port",
             str(port), "--record", str(trace), "--state-dir", str(tmp_path / "state")],
            capture_output=True, text=True, cwd=ROOT, timeout=600,
            env={**os.environ, "TANGRAM_TOKEN": "t"})
    assert done.returncode != 0 and "address already in use" in done.stderr, done.stderr
    assert not trace.exists() and not cluster_path(trace).exists()


def test_a_closed_recording_and_its_cluster_keep_the_modes_of_files_made_there(tmp_path):
    # (both were rewritten through mkstemp: 0600, while the appended recording was 0644)
    from tangram.model import Action, Demand, Outcome
    from tangram.runtime import Record

    trace = tmp_path / "r.jsonl"
    recorder = Recorder(trace, load_cluster("default"), lambda *a: None)
    appended = trace.stat().st_mode & 0o777
    a = Action("t#0", "task", "t", "shell", {"cpu": Demand.fixed(1)})
    recorder.opened("t", "task", None, 0.0)
    recorder.submitted(a, 0.0)
    record = Record("t#0", "task", "t", "shell", 0.0, 0.0, 1.0, 1, "local", "0", "", 0.0,
                    0.0, "ok", 0, None)
    recorder.finished(a, record, Outcome("t#0", "ok", 0))
    recorder.close()
    assert trace.exists() and (trace.stat().st_mode & 0o777) == appended
    assert (cluster_path(trace).stat().st_mode & 0o777) == appended
