"""Cleaning up after closed trajectories in batches (executor/backends/process/reaper.py), on real
processes: what each closed trajectory left is killed in one pass, nothing else is,
trees of any depth are removed, and each close's follow-up runs only after."""

from __future__ import annotations

import os
import subprocess
import time

from helpers import procs_with

from executor.backends.process.reaper import Leftovers, Reaper, clean

VAR = "TANGRAM_REAPER_TEST"


def _escapee(mark: str, arg: str) -> subprocess.Popen:
    """A process in a session of its own (what a group kill misses), carrying ``mark``."""
    return subprocess.Popen(["sleep", arg], env={**os.environ, VAR: mark},
                            start_new_session=True)


def _gone(p: subprocess.Popen, within_s: float = 60.0) -> bool:
    deadline = time.monotonic() + within_s  # a hang guard: a kill ends a process when run
    while p.poll() is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_one_batch_kills_what_each_closed_trajectory_left_and_nothing_else(tmp_path):
    a, b = _escapee("ta.1.x", "96.11"), _escapee("tb.7.y", "96.12")
    other = _escapee("tc.1.x", "96.13")  # a trajectory still open
    lookalike = _escapee("ta", "96.14")  # its mark is not under "ta."
    trees = []
    for name in ("ta", "tb"):
        deep = tmp_path / name
        deep.mkdir()
        # past shutil.rmtree's recursion (and PATH_MAX: made one level at a time)
        subprocess.run(["sh", "-c", "for i in $(seq 1500); do mkdir d && cd d; done; "
                        "echo x > f"], cwd=deep, check=True)
        trees.append(deep)
    done: list[str] = []
    try:
        clean(VAR, [Leftovers("ta.", None, trees[0], lambda: done.append("ta")),
                    Leftovers("tb.", None, trees[1], lambda: done.append("tb"))])
        assert _gone(a) and _gone(b)
        assert other.poll() is None and lookalike.poll() is None
        assert not trees[0].exists() and not trees[1].exists()
        assert done == ["ta", "tb"]
    finally:
        for p in (a, b, other, lookalike):
            p.kill()
            p.wait()


def test_the_reaper_thread_cleans_closes_as_they_come_and_drains():
    reaper = Reaper(VAR)
    procs = [_escapee(f"t{k}.1", f"96.2{k}") for k in range(4)]
    order: list[int] = []
    try:
        for k in range(4):  # closes arriving while a batch runs join the next one
            reaper.add(Leftovers(f"t{k}.", None, None, lambda k=k: order.append(k)))
        assert reaper.drain(120)
        assert sorted(order) == [0, 1, 2, 3]
        assert all(_gone(p) for p in procs)
        assert procs_with("96.21") == []
    finally:
        for p in procs:
            p.kill()
            p.wait()
