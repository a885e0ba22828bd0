"""Issue 45 #10 / deliver 6: a journal the server cannot use stops `tangram serve` at start
with one message naming the file and the choices (move it aside, or --reset-state), exit 2,
no traceback; `--reset-state` moves it aside (kept, never deleted) and the server starts.
Every case runs the real command as a subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, TOKEN, free_port, start_server
from helpers import until

from executor.server.journal import Journal

STRANGER = 12345  # a uid that is not the server's


def _serve(state_dir: Path) -> tuple[int, str]:
    """`tangram serve` on ``state_dir``, which must exit by itself: (exit code, stderr). A
    server that starts serving instead is stopped and reported at once."""
    port = free_port()
    args = [sys.executable, str(ROOT / "cli.py"), "serve", "--port", str(port),
            "--state-dir", str(state_dir), "--reward-command", ""]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "TANGRAM_TOKEN": TOKEN})

    def serving() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        asyncio.run(until(lambda: proc.poll() is not None or serving(), 300,
                          "`tangram serve` to exit"))
    finally:
        if proc.poll() is None:
            proc.kill()
    _, stderr = proc.communicate()
    assert proc.returncode != -signal.SIGKILL, f"the server started instead: {stderr[-2000:]}"
    return proc.returncode, stderr


def _good_journal(state_dir: Path) -> Path:
    """A journal with an open trajectory and 200 actions, as a server leaves it."""
    path = state_dir / "journal.sqlite"
    j = Journal(path)
    j.opened("kept", "default", None, None)
    for i in range(200):
        j.submitted(f"a{i}", "kept", '{"argv": ["true"]}' + " " * 2000)
    j.close()
    return path


def _truncated(d: Path) -> None:
    path = _good_journal(d)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def _garbage(d: Path) -> None:
    (d / "journal.sqlite").write_bytes(os.urandom(8192))


def _directory(d: Path) -> None:
    (d / "journal.sqlite").mkdir()
    (d / "journal.sqlite" / "x").write_text("x")


def _symlink(d: Path) -> None:
    _good_journal(d / "elsewhere")
    (d / "journal.sqlite").symlink_to(d / "elsewhere" / "journal.sqlite")


def _not_ours(d: Path) -> None:
    os.chown(_good_journal(d), STRANGER, STRANGER)


def _wal_not_ours(d: Path) -> None:
    _good_journal(d)
    wal = d / "journal.sqlite-wal"
    wal.write_bytes(b"")
    os.chown(wal, STRANGER, STRANGER)


CASES = {"truncated": (_truncated, "cannot be read"), "garbage": (_garbage, "cannot be read"),
         "directory": (_directory, "is a directory"),
         "symlink": (_symlink, "not a regular file"),
         "not-ours": (_not_ours, f"owned by uid {STRANGER}"),
         "wal-not-ours": (_wal_not_ours, f"owned by uid {STRANGER}")}


@pytest.mark.parametrize("case", CASES)
def test_an_unusable_journal_stops_the_start_with_one_clear_message(tmp_path, case):
    if case.endswith("not-ours") and os.geteuid() != 0:
        pytest.skip("needs root to give a file to another uid")
    make, why = CASES[case]
    state = tmp_path / "state"
    state.mkdir()
    make(state)
    before = sorted(p.name for p in state.iterdir())
    code, stderr = _serve(state)
    assert code == 2, (code, stderr[-2000:])
    text = " ".join(stderr.split())  # rich wraps long lines
    assert "Traceback" not in stderr and "sqlite3." not in stderr, stderr
    assert text.count("error:") == 1, text
    assert str(state / "journal.sqlite") in text and why in text, text
    assert "--reset-state" in text and "move it aside" in text, text
    assert sorted(p.name for p in state.iterdir()) == before  # nothing touched


def test_reset_state_moves_a_corrupt_journal_aside_and_starts(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    _truncated(state)
    bad = (state / "journal.sqlite").read_bytes()
    server = start_server(state, extra_args=("--reset-state", "--reward-command", ""))
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            assert c.post("/v1/trajectories", json={"id": "fresh"}).status_code == 201
            listed = [t["id"] for t in c.get("/v1/trajectories").json()["trajectories"]]
            assert listed == ["fresh"], listed  # the moved journal's 'kept' is not restored
    finally:
        server.stop()
    aside = [p for p in state.iterdir() if p.name.startswith("journal.sqlite.reset-")]
    assert [p.read_bytes() for p in aside] == [bad], sorted(p.name for p in state.iterdir())
    assert "moved aside as" in server.log.read_text()
    # the journal it started with is a good one: a plain restart uses it (start_server
    # raises, with the server's log, if it exits instead)
    start_server(state).stop()


def test_a_good_journal_is_used_as_before(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    _good_journal(state)
    server = start_server(state)
    try:
        r = httpx.get(f"{server.url}/v1/trajectories", timeout=60,
                      headers={"Authorization": f"Bearer {TOKEN}"})
        assert [t["id"] for t in r.json()["trajectories"]] == ["kept"], r.text
    finally:
        server.stop()
