"""Long commands show they are alive when their output is not a terminal (issue 46 #6): a CI
log or a pipe gets a line when a step begins, a line every ~10 s while it lasts (done /
total, the rate and the time left where the work is counted, else 'still running: <step>,
<elapsed>') and its duration when it ends. Run as a user runs them: the CLI as a
subprocess, its output piped; ``TANGRAM_PROGRESS_EVERY_S`` makes the periodic lines come
sooner. No assert depends on how fast anything runs: a periodic line is waited for (a
start-up step held until it came), never counted on.

`run`, `simulate` and `reproduce` share this machinery (tangram_cli/common.py
with_progress); every `tangram bench` command's lines are checked in test_e2e_cli.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from conftest import free_port
from helpers import until_true

from tangram_cli.common import ProgressLines

ROOT = Path(__file__).resolve().parent.parent
#: hang guards (s): a loaded 2-core CI machine, never a speed bound
WAIT_S = 300
#: a periodic line every this many seconds (instead of ~10)
ENV = {**os.environ, "TANGRAM_PROGRESS_EVERY_S": "0.1"}


class Output:
    """A subprocess's output lines as they come (a thread reads them)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines = proc, []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str) -> str:
        """The first line matching ``pattern`` (a regex, from the line's start), once it
        came; an AssertionError with the output when the process ends without it."""
        def seen() -> str | None:
            found = next((x for x in list(self.lines) if re.match(pattern, x)), None)
            if found is None and self.proc.poll() is not None:
                self._reader.join(10)
                found = next((x for x in self.lines if re.match(pattern, x)), None)
                assert found, f"exited {self.proc.returncode} without {pattern!r}:\n{self.text()}"
            return found

        try:
            return until_true(seen, WAIT_S, pattern)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.text()}") from None


def test_serve_says_each_start_up_step_and_one_that_lasts_is_still_running(shared_dir,
                                                                              tmp_path):
    """The reward-command probe is held (its program waits on a lock this test holds)
    until a 'still running' line for it came; then every step of the start says when it
    began and how long it took, all before the server listens."""
    lock = shared_dir / "hold"
    lock.touch()
    lock.chmod(0o666)  # (as root the probe runs as a sandbox user)
    prog = shared_dir / "reward-prog"
    prog.write_text(f"#!/bin/sh\nflock {lock} true\n")  # then exits 0: the reward can run
    prog.chmod(0o755)
    reward = f"{prog} -m pytest"
    held = lock.open()
    fcntl.flock(held, fcntl.LOCK_EX)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), "serve", "--port", str(free_port()),
         "--state-dir", str(tmp_path / "state"), "--reward-command", reward],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**ENV, "TANGRAM_TOKEN": "t"}, cwd=ROOT)
    try:
        out = Output(proc)
        probe = f"serve: checking the reward command {reward!r}"
        out.wait_for(re.escape(f"still running: {probe}, ") + r"\d+ s elapsed$")
        held.close()  # the probe goes on
        out.wait_for(r"INFO: +Uvicorn running on ")
        lines, text = list(out.lines), out.text()
        steps = [probe, "serve: opening the journal", "serve: starting the process backend",
                 "serve: restoring the journal's open trajectories"]
        said = []  # where each step began and ended
        for step in steps:
            ends = [i for i, x in enumerate(lines)
                    if re.fullmatch(re.escape(step) + r": done in \d+\.\d s", x)]
            assert f"{step} ..." in lines and len(ends) == 1, (step, text)
            said += [lines.index(f"{step} ..."), ends[0]]
        # one after another, in this order, all before the server listens
        listening = next(i for i, x in enumerate(lines) if "Uvicorn running on" in x)
        assert said == sorted(said) and said[-1] < listening, text
        assert "warning:" not in text, text  # the held program did pass the reward's check
    finally:
        held.close()
        proc.terminate()
        proc.wait(60)
        proc.stdout.close()


def test_a_bench_off_a_terminal_says_its_phases_and_done_of_total(tmp_path):
    """`tangram bench fork-sim` (four simulations): a line when it starts and when each
    simulation begins, any periodic line in between a count of the simulations (with the
    rate and the time left) or 'still running', and at the end 4/4 with how long it took.
    Its JSON lines on stdout are untouched; --quiet says nothing on stderr."""
    args = [sys.executable, str(ROOT / "cli.py"), "bench", "fork-sim", "--trajectories", "16",
            "--group", "2"]
    res = subprocess.run(args, capture_output=True, text=True, env=ENV, cwd=ROOT,
                         timeout=WAIT_S)
    assert res.returncode == 0, res.stderr
    assert len([json.loads(line) for line in res.stdout.splitlines()]) == 4, res.stdout
    lines = res.stderr.splitlines()
    assert lines[0] == "bench fork-sim ...", res.stderr
    assert re.fullmatch(r"bench fork-sim: 4/4 \(100%\), \d+\.\d\d/s, done in \d+\.\d s",
                        lines[-1]), res.stderr
    phase = r"\d+ CPU nodes?, with(out)? fork"
    began = [x for x in lines if re.fullmatch(rf"bench fork-sim: {phase} \.\.\.", x)]
    assert len(began) == 4, res.stderr
    periodic = (rf"bench fork-sim \({phase}\): \d/4 \(\d+%\), \d+\.\d\d/s, \d+ s elapsed, "
                r"(~\d+ s left|time left unknown)"
                r"|still running: bench fork-sim, \d+ s elapsed")  # (the trace, uncounted)
    odd = [x for x in lines[1:-1] if x not in began and not re.fullmatch(periodic, x)]
    assert not odd, res.stderr

    quiet = subprocess.run([*args, "--quiet"], capture_output=True, text=True, env=ENV,
                           cwd=ROOT, timeout=WAIT_S)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert len(quiet.stdout.splitlines()) == 4, quiet.stdout


def test_a_progress_line_estimates_the_time_left(capsys):
    """The periodic line's figures: done / total, the rate since counting began (not over
    a phase before it, e.g. a bench's server starting) and the time left at that rate; a
    phase names what runs; work that counts nothing is 'still running'."""
    now = [100.0]
    lines = ProgressLines("bench x", every_s=3600, clock=lambda: now[0])  # (not started)
    now[0] += 20
    assert lines.line() == "still running: bench x, 20 s elapsed"
    lines.phase("step 2")
    assert capsys.readouterr().err == "bench x: step 2 ...\n"
    assert lines.line() == "still running: bench x (step 2), 20 s elapsed"
    lines(0, 10)  # counting begins, 20 s in
    assert lines.line() == "bench x (step 2): 0/10 (0%), 0.00/s, 20 s elapsed, time left unknown"
    now[0] += 20
    lines(5, 10)  # 5 in the 20 s since: 5 more take another 20 s
    assert lines.line() == "bench x (step 2): 5/10 (50%), 0.25/s, 40 s elapsed, ~20 s left"
    now[0] += 5
    lines(10, 10)
    assert lines.line(final=True) == "bench x: 10/10 (100%), 0.40/s, done in 45.0 s"
    lines.counted = False
    assert lines.line(final=True) == "bench x: done in 45.0 s"
