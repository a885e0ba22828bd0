"""`tangram serve --record` and `tangram run --record` (issue 52 #1): what a live run did,
written as a trace while it runs, the cluster beside it, readable after a crash, and
replayed by `tangram simulate` on that cluster.

Each test runs the real thing: a `tangram serve` subprocess driven by the Python client,
or `tangram run` as a user types it, with the process backend; the trace is read back
with the project's own loader (traces/schema.py)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TOKEN, reachable_by_sandboxes, start_server
from helpers import procs_with, until_true

from analysis.recorded import replay_error
from executor.record import cluster_path, command_hash, elasticity
from sim.cluster import load_cluster
from tangram.estimates import Speedup
from tangram_sdk.client import TangramSyncClient
from traces.generate import generate
from traces.schema import Truth, load, read_raw, torn_tail, write

ROOT = Path(__file__).resolve().parent.parent
#: hang guards (s) on a loaded 2-core machine, never speed bounds
WAIT_S = 300


def tangram(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=WAIT_S * 2, **kw)


@pytest.mark.parametrize("units", [1, 2, 3, 8])
def test_a_rows_curve_gives_the_observed_time_at_its_granted_width(units: int):
    """The row's t1/p/overhead put the learnt shape through the observed point: a replay at
    the granted width takes what the run took, at other widths what the shape says."""
    t1, p, c = elasticity(12.0, units, Speedup(0.8, 0.1, "command"))
    truth = Truth(t1, p, 0.0, c)
    assert math.isclose(truth.duration(units), 12.0, rel_tol=1e-9)
    wider = Truth(t1, p, 0.0, c).duration(units + 4)
    assert wider != pytest.approx(12.0)  # the shape, not a constant
    # a start-up cost larger than the run itself: the run's time kept, no overhead
    t1, p, c = elasticity(0.5, 8, Speedup(0.5, 1.0, "kind"))
    assert c == 0.0 and math.isclose(Truth(t1, p, 0.0, c).duration(8), 0.5)


def test_serve_records_what_it_ran_and_simulate_replays_it(tmp_path: Path):
    """Through `tangram serve --record`: a row per action that ran (not one cancelled in
    the queue), in submit order per trajectory, the think time the client took, the
    requested and granted cores, statuses, commands hashed and no output; the cluster
    beside it; and `tangram simulate` on the two runs it."""
    record = tmp_path / "rec" / "served.jsonl"
    server = start_server(tmp_path / "state", extra_args=("--record", str(record)))
    try:
        with TangramSyncClient(server.url, TOKEN, timeout_s=WAIT_S) as c:
            c.open_trajectory("a", task="coding", mem_gb=0.5)
            c.open_trajectory("b", task="coding")
            first = c.run("a", action_id="a0", kind="shell", command="echo secret-output-1")
            assert first["status"] == "ok", first
            gap = 0.3  # the client "thinks" this long before its next action
            time.sleep(gap)
            done = c.run("a", action_id="a1", kind="test_run", cpu="1-2", elastic=True,
                         command="sh -c 'echo secret-output-2; sleep 0.2'")
            assert done["status"] == "ok", done
            bad = c.run("b", action_id="b0", kind="shell", command="sh -c 'exit 3'")
            assert bad["exit_code"] == 3, bad
            c.close_trajectory("a")
            c.close_trajectory("b")
            c.open_trajectory("b", task="coding")  # the id again: another trajectory
            assert c.run("b", action_id="b-again", kind="shell", command="true")["status"] == "ok"
            c.close_trajectory("b")
    finally:
        server.stop(signal.SIGTERM)
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    text = record.read_text()
    assert "secret-output" not in text and "sleep" not in text, text  # hashed, no outputs
    rows, _ = read_raw(record)
    trace = load(record)
    assert sorted(trace["trajectory"] + trace["seq"].astype(str)) == \
        ["a0", "a1", "b0", "b~10"], trace
    by = {f"{r.trajectory}{r.seq}": r for r in rows.itertuples()}
    assert by["a1"].think_s >= gap, by["a1"]  # at least the client's own pause
    assert by["a1"].cpu_cores == "1,2" and by["a1"].elastic == "cpu" and by["a1"].units >= 1
    assert by["a1"].parallel_fraction is not None and by["a1"].curve in ("prior", "kind", "command")
    assert by["a0"].command == command_hash("echo secret-output-1")
    assert by["a0"].mem_gb == 0.5 and by["b0"].status == bad["status"] and by["b0"].exit_code == 3
    header = json.loads(text.splitlines()[0])
    assert header["recorded"]["by"] == "tangram serve" and header["recorded"]["commands"] == "sha256"
    cluster = load_cluster(cluster_path(record))
    assert cluster.cpu_nodes[0].cores == len(os.sched_getaffinity(0))
    assert cluster.extra["env_start_s"] == 0.0  # a process sandbox is a directory
    sim = tangram("simulate", "--trace", str(record), "--cluster", str(cluster_path(record)),
                  "--out", str(tmp_path / "sim"), "-q")
    assert sim.returncode == 0, sim.stderr
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["actions"] == 4, summary


def test_run_records_with_commands_kept(tmp_path: Path):
    """`tangram run --record --record-commands` of a generated trace: every replayed action
    a row, its command line kept; the recording is a trace `tangram run` itself takes."""
    trace = tmp_path / "c.parquet"
    write(generate("coding", 2, 3), trace)
    reachable_by_sandboxes(tmp_path / "out")
    record = tmp_path / "run.jsonl"
    done = tangram("run", "--trace", str(trace), "--out", str(tmp_path / "out"), "-q",
                   "--think-scale", "0.02", "--work-scale", "0.05",
                   "--record", str(record), "--record-commands")
    assert done.returncode == 0, done.stderr
    recorded = load(record)
    assert len(recorded) == len(load(trace)), (len(recorded), len(load(trace)))
    assert recorded["command"].str.contains("executor.bench.burn").all()
    elastic = recorded[recorded["elastic"] == "cpu"]
    assert len(elastic) and elastic["parallel_fraction"].notna().all()
    assert load_cluster(cluster_path(record)).cpu_nodes
    # the recording against its replay (no bound asserted: a loaded machine's figure)
    checked = replay_error(record)
    assert checked["actions"] == len(recorded)
    assert all(math.isfinite(v) for v in checked["error_pct"].values()), checked


def test_a_bad_record_path_is_refused_before_the_run(tmp_path: Path):
    done = tangram("run", "--trace", str(ROOT / "traces/samples/coding.parquet"),
                   "--out", str(tmp_path / "o"), "--record", str(tmp_path / "r.parquet"))
    assert done.returncode == 2 and "*.jsonl" in done.stderr, done.stderr
    taken = tmp_path / "taken.jsonl"
    taken.write_text("someone's recording\n")
    again = tangram("run", "--trace", str(ROOT / "traces/samples/coding.parquet"),
                    "--out", str(tmp_path / "o"), "--record", str(taken))
    assert again.returncode == 2 and "exists" in again.stderr, again.stderr
    assert taken.read_text() == "someone's recording\n"
    alone = tangram("run", "--trace", str(ROOT / "traces/samples/coding.parquet"),
                    "--out", str(tmp_path / "o"), "--record-commands")
    assert alone.returncode == 2 and "only with --record" in alone.stderr, alone.stderr


def test_a_killed_run_leaves_a_readable_recording(tmp_path: Path):
    """`tangram run --record` killed (SIGKILL) mid-run: every row written before is there
    and loads; a row cut mid-line (what a kill during a write leaves) is skipped by the
    loader and named by `tangram trace validate`."""
    marker = f"6{os.getpid() % 1000}.5"  # the long action's `sleep` argument: its pid
    rows = [{"task": "t", "trajectory": "quick", "seq": k, "kind": "shell", "think_s": 0.0,
             "t1_s": 0.01, "cpu_cores": "1", "command": f"echo {k}"} for k in range(40)]
    rows.append({"task": "t", "trajectory": "slow", "seq": 0, "kind": "shell",
                 "think_s": 0.0, "t1_s": 600.0, "cpu_cores": "1", "command": f"sleep {marker}"})
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"tangram_trace": True, "schema_version": 1}) + "\n"
                     + "".join(json.dumps(r) + "\n" for r in rows))
    reachable_by_sandboxes(tmp_path / "out")
    record = tmp_path / "killed.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "run", "--trace", str(trace),
                             "--out", str(tmp_path / "out"), "-q", "--record", str(record)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        def written() -> int:
            return max(len(record.read_text().splitlines()) - 1, 0) if record.exists() else 0

        until_true(lambda: written() >= 40 and procs_with(marker), WAIT_S,
                   "the quick trajectory's 40 rows recorded while the slow action runs")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(WAIT_S)
        for pid in procs_with(marker):  # the sandbox's sleep, orphaned by the kill
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert torn_tail(record) == ""  # every line the recorder wrote ended
    loaded = load(record)
    assert len(loaded) == 40 and set(loaded["trajectory"]) == {"quick"}
    with record.open("a") as f:  # what a kill inside a write leaves: half a line
        f.write('{"task": "t", "trajectory": "slow", "seq": 0, "ki')
    assert len(load(record)) == 40
    assert "cut off" in torn_tail(record)
    checked = tangram("trace", "validate", str(record))
    assert checked.returncode == 0 and "cut off" in checked.stderr, checked.stderr
