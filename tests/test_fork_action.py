"""A fork is an action like others (issue 45 #7), through a real `tangram serve` (process
backend: real work directories, real processes): looked up and listed while it runs,
cancelled mid-copy (no half-made copy left anywhere, its source thawed), cancelled by its
source's close (the close no longer waits and fails with 409), journalled."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from conftest import TOKEN, sandbox_containers
from helpers import until_true

from tangram_sdk.client import TangramError, TangramSyncClient

#: files in the source, and copies: the whole fork would run for minutes (about 3 s a copy
#: on this project's machine), far past the 30 s a cancel waits for an action to stop
#: (service.CANCEL_WAIT_S): a cancel answered ``cancelled`` stopped it mid-way
FILES = 20_000
COPIES = 64


def _state(pid: int) -> str:
    """A process's state letter ('T': stopped, as the fork's freeze leaves it)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    raise AssertionError(f"no State in /proc/{pid}/status")


def _large_source(c: TangramSyncClient, tid: str) -> int:
    """Open ``tid`` with FILES files and a background process left running in it; its pid."""
    c.open_trajectory(tid, task="grpo", mem_gb=0.05)
    made = c.run(tid, command=f"mkdir d && cd d && seq 1 {FILES} | xargs touch && "
                 "(setsid sh -c 'echo $$ > ../bg.pid; while :; do sleep 0.05; done' "
                 ">/dev/null 2>&1 &)", shell=True, timeout_s=600)
    assert made["status"] == "ok" and made["exit_code"] == 0, made
    def written() -> bytes | None:
        try:
            return c.get_file(tid, "bg.pid").strip()
        except TangramError as e:  # (not yet written: the process is on its way)
            assert e.status == 404, e
            return None

    pid = int(until_true(written, 60, "the background process's pid"))
    assert _state(pid) != "T"
    return pid


def _fork_in_background(url: str, src: str, prefix: str, action: str) -> dict:
    """Start the fork's request in a thread; the dict gets its answer or its error."""
    got: dict = {}

    def go() -> None:
        with TangramSyncClient(url, TOKEN, timeout_s=600) as c:
            try:
                got["answer"] = c.fork(src, COPIES, prefix=prefix, action=action)
            except TangramError as e:
                got["error"] = e

    got["thread"] = threading.Thread(target=go, daemon=True)
    got["thread"].start()
    return got


def _running(c: TangramSyncClient, src: str, aid: str, pid: int) -> None:
    """The fork ``aid`` of ``src`` is seen running: looked up, listed, its source frozen."""
    def status() -> str | None:
        try:
            return c.wait(aid, 0)["status"]
        except TangramError as e:  # (its request is on its way in the other thread)
            assert e.status == 404, e
            return None

    until_true(lambda: status() == "running", 120, f"fork {aid} to run")
    view = c.wait(aid, 0)
    assert view["trajectory"] == src, view
    listed = c.trajectory(src)
    assert listed["forks"] == [aid] and listed["state"] == "running", listed
    until_true(lambda: _state(pid) == "T", 120, "the source's background process to be "
               "frozen by the fork")


def _nothing_left(c: TangramSyncClient, work: Path, copies: list[str], pid: int) -> None:
    """No copy open, none in the work root, no staged tree; the source thawed."""
    assert _state(pid) != "T", "the source is left frozen"
    for t in copies:
        with pytest.raises(TangramError) as e:
            c.trajectory(t)
        assert e.value.status == 404
        assert not (work / t).exists(), f"{t}'s directory is left in the work root"
    assert not [p for p in work.iterdir() if p.name.startswith(" forking ")], \
        sorted(p.name for p in work.iterdir())
    until_true(lambda: not [p for p in work.iterdir() if p.name.startswith(" closing ")],
               120, "the closed copies' directories to be removed")
    # a copy's id opened again is an empty sandbox, nothing of the cancelled copy in it
    fresh = c.open_trajectory(copies[0], task="t")
    listing = c.run(fresh, command="ls -A", shell=True)
    assert listing["status"] == "ok" and listing["output"] == "", listing
    c.close_trajectory(fresh)


def test_a_fork_is_looked_up_listed_and_cancelled(process_server):
    work = process_server.state_dir / "work"
    with TangramSyncClient(process_server.url, TOKEN, timeout_s=120) as c:
        # a fork that ends: its action is there to read afterwards, ok, of its source
        small = c.open_trajectory("fa-small", task="grpo", mem_gb=0.1)
        done = c.fork(small, 1, prefix="fa-small-copy", action="fa-small-fork")
        assert done["action"] == "fa-small-fork", done
        view = c.wait("fa-small-fork", 0)
        assert view["status"] == "ok" and view["trajectory"] == small, view
        assert c.trajectory(small)["forks"] == []
        with pytest.raises(TangramError) as e:  # an action's id is taken once
            c.fork(small, 1, action="fa-small-fork")
        assert e.value.status == 409 and "action" in str(e.value)

        src = "fa-src"
        pid = _large_source(c, src)
        got = _fork_in_background(process_server.url, src, "fa-copy", "fa-fork")
        _running(c, src, "fa-fork", pid)
        cancelled = c.cancel("fa-fork")
        assert cancelled["status"] == "cancelled", cancelled
        # when the cancel answers, nothing of the fork is left and the source runs on
        _nothing_left(c, work, [f"fa-copy-{i}" for i in range(COPIES)], pid)
        got["thread"].join(120)
        assert "error" in got and got["error"].status == 409, got
        assert "cancelled" in str(got["error"]), got
        assert c.wait("fa-fork", 0)["status"] == "cancelled"
        assert c.trajectory(src)["forks"] == [] and c.trajectory(src)["state"] == "idle"
        still = c.run(src, command="ls d | wc -l", shell=True)
        assert still["output"].strip() == str(FILES), still
        c.close_trajectory(src)
        c.close_trajectory(small)
        c.close_trajectory("fa-small-copy-0")


def test_closing_the_source_cancels_its_fork(process_server):
    work = process_server.state_dir / "work"
    with TangramSyncClient(process_server.url, TOKEN, timeout_s=120) as c:
        src = "fc-src"
        pid = _large_source(c, src)
        got = _fork_in_background(process_server.url, src, "fc-copy", "fc-fork")
        _running(c, src, "fc-fork", pid)
        closed = c.close_trajectory(src)  # (was: 409 for the whole of the fork)
        assert closed == {"id": src, "status": "closed", "cancelled": 1}, closed
        assert c.wait("fc-fork", 0)["status"] == "cancelled"
        got["thread"].join(120)
        assert "error" in got and got["error"].status == 409, got
        copies = [f"fc-copy-{i}" for i in range(COPIES)]
        for t in copies:
            with pytest.raises(TangramError) as e:
                c.trajectory(t)
            assert e.value.status == 404
            assert not (work / t).exists()
        assert not [p for p in work.iterdir() if p.name.startswith(" forking ")]
        # the source's processes went with its close (thawed first: a stopped process
        # would outlive a SIGKILL sweep only as a zombie of nobody)
        until_true(lambda: not Path(f"/proc/{pid}").exists() or _state(pid) == "Z", 120,
                   "the closed source's background process to end")


def test_a_docker_fork_is_cancelled_between_its_steps(docker_server):
    """The docker backend's fork runs in a worker thread, steps that are not cut short (a
    copy's container made, the pack, a copy's unpack): a cancel stops it before its next
    step, and the service closes every copy (its container removed)."""
    with TangramSyncClient(docker_server.url, TOKEN, timeout_s=300) as c:
        src = c.open_trajectory("fd-src", task="grpo", mem_gb=0.05)
        made = c.run(src, command="echo kept > f && (setsid sh -c 'echo $$ > bg.pid; "
                     "while :; do sleep 0.05; done' >/dev/null 2>&1 &)", shell=True)
        assert made["status"] == "ok", made
        # 64 copies: a container each before anything is copied, minutes of engine calls
        got = _fork_in_background(docker_server.url, src, "fd-copy", "fd-fork")

        def status() -> str | None:
            try:
                return c.wait("fd-fork", 0)["status"]
            except TangramError as e:
                assert e.status == 404, e
                return None

        until_true(lambda: status() == "running", 300, "the docker fork to run")
        assert c.trajectory(src)["forks"] == ["fd-fork"]
        cancelled = c.cancel("fd-fork")
        assert cancelled["status"] == "cancelled", cancelled
        got["thread"].join(300)
        assert "error" in got and got["error"].status == 409, got
        copies = [f"fd-copy-{i}" for i in range(COPIES)]
        for t in copies:
            with pytest.raises(TangramError) as e:
                c.trajectory(t)
            assert e.value.status == 404
        until_true(lambda: not [t for t in copies if sandbox_containers(t)], 300,
                   "the cancelled copies' containers to be removed")
        # the source runs on, its files and its background process (not left stopped)
        state = c.run(src, command="cat f && grep State /proc/$(cat bg.pid)/status",
                      shell=True)
        assert state["status"] == "ok" and state["output"].startswith("kept\n"), state
        assert "stopped" not in state["output"], state
        c.close_trajectory(src)
