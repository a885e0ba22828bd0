"""Ownership (issue 45 #8) through a real `tangram serve` (process backend): several tokens
from --tokens-file beside TANGRAM_TOKEN; a trajectory, its actions, files and forks are
its opener's token's alone, and every other token's request for them is answered exactly
as for an id that does not exist (404, the same words). It survives a restart. Bad tokens
files stop the start with one message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, TOKEN, start_server

from tangram_sdk.client import TangramSyncClient

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef01"


def _tokens_file(tmp: Path) -> Path:
    path = tmp / "tokens"
    path.write_text(f"# the server's clients\n{ALICE} alice\n\n{BOB}   # no name: sha256\n")
    path.chmod(0o600)
    return path


def _h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _same_404(resp: httpx.Response, unknown: httpx.Response, tid: str, ghost: str) -> None:
    """``resp`` (another token's id) reads as ``unknown`` (an id nobody has) does."""
    assert resp.status_code == 404, (resp.status_code, resp.text)
    assert unknown.status_code == 404, (unknown.status_code, unknown.text)
    assert resp.text.replace(tid, "X") == unknown.text.replace(ghost, "X"), (resp.text,
                                                                             unknown.text)


@pytest.fixture(scope="module")
def owned_server(tmp_path_factory):
    state = tmp_path_factory.mktemp("serve-owned")
    tokens = _tokens_file(tmp_path_factory.mktemp("tokens"))
    server = start_server(state, "process", extra_args=("--tokens-file", str(tokens)))
    yield server, tokens
    server.stop()


def _crossed(url: str, theirs: str, mine: str, tid: str, ghost_t: str,
             done: str, running: str, ghost_a: str) -> None:
    """Every request of token ``mine`` for token ``theirs``'s trajectory ``tid`` and its
    actions ``done`` (ended) and ``running``: the answer an unknown id gets."""
    with httpx.Client(base_url=url, headers=_h(mine), timeout=60) as c:
        # reads: the trajectory, the list, the actions (fast path and FastAPI's), events
        _same_404(c.get(f"/v1/trajectories/{tid}"), c.get(f"/v1/trajectories/{ghost_t}"),
                  tid, ghost_t)
        assert tid not in {t["id"] for t in c.get("/v1/trajectories").json()["trajectories"]}
        for aid in (done, running):
            for query in ("", "?wait=0.5", "?wait=%30"):  # (the last: FastAPI's reading)
                _same_404(c.get(f"/v1/actions/{aid}{query}"),
                          c.get(f"/v1/actions/{ghost_a}{query}"), aid, ghost_a)
            _same_404(c.get(f"/v1/actions/{aid}/events"),
                      c.get(f"/v1/actions/{ghost_a}/events"), aid, ghost_a)
        # writes: submit (fast path, FastAPI's, a batch), cancel, close, fork, files
        body = {"id": "intruder", "argv": ["true"]}
        for query in ("", "?wait=1", "?wait=%31"):
            _same_404(c.post(f"/v1/trajectories/{tid}/actions{query}", json=body),
                      c.post(f"/v1/trajectories/{ghost_t}/actions{query}", json=body),
                      tid, ghost_t)
        batch = lambda t: {"actions": [{"trajectory": t, "action": body}]}  # noqa: E731
        _same_404(c.post("/v1/actions:batch", json=batch(tid)),
                  c.post("/v1/actions:batch", json=batch(ghost_t)), tid, ghost_t)
        _same_404(c.delete(f"/v1/actions/{running}"), c.delete(f"/v1/actions/{ghost_a}"),
                  running, ghost_a)
        _same_404(c.post("/v1/trajectories", json={"fork_of": tid, "count": 1}),
                  c.post("/v1/trajectories", json={"fork_of": ghost_t, "count": 1}),
                  tid, ghost_t)
        _same_404(c.put(f"/v1/trajectories/{tid}/files/x.txt", content=b"mine now"),
                  c.put(f"/v1/trajectories/{ghost_t}/files/x.txt", content=b"mine now"),
                  tid, ghost_t)
        _same_404(c.get(f"/v1/trajectories/{tid}/files/secret.txt"),
                  c.get(f"/v1/trajectories/{ghost_t}/files/secret.txt"), tid, ghost_t)
        _same_404(c.delete(f"/v1/trajectories/{tid}"), c.delete(f"/v1/trajectories/{ghost_t}"),
                  tid, ghost_t)
    # ...and nothing of it changed: still open, still running, its file its own
    with TangramSyncClient(url, theirs, timeout_s=60) as own:
        assert own.trajectory(tid)["id"] == tid
        assert own.wait(running, 0)["status"] in ("queued", "running")
        assert own.get_file(tid, "secret.txt") == b"alice's\n"
        with pytest.raises(Exception) as e:
            own.get_file(tid, "x.txt")
        assert getattr(e.value, "status", None) == 404


def test_another_tokens_requests_are_404s(owned_server):
    server, _ = owned_server
    with TangramSyncClient(server.url, ALICE, timeout_s=60) as a:
        tid = a.open_trajectory("alice-t", task="t")
        a.put_file(tid, "secret.txt", b"alice's\n")
        done = a.run(tid, id="alice-done", command="cat secret.txt", shell=True)
        assert done["status"] == "ok" and done["output"] == "alice's\n", done
        running = a.submit(tid, action_id="alice-sleep", command="sleep 600")["id"]
        # Bob, and the TANGRAM_TOKEN's `default`, each reach nothing of Alice's
        for other in (BOB, TOKEN):
            _crossed(server.url, ALICE, other, tid, "nobody-t", "alice-done", running,
                     "nobody-a")
        # Bob's own fork is Bob's: Alice reaches none of its copies nor its action
        with TangramSyncClient(server.url, BOB, timeout_s=60) as b:
            src = b.open_trajectory("bob-src", task="t")
            b.put_file(src, "f", b"bob's")
            forked = b.fork(src, 2, prefix="bob-copy", action="bob-fork")
            assert forked["action"] == "bob-fork"
            assert b.wait("bob-fork", 0)["status"] == "ok"
            assert {"bob-src", "bob-copy-0", "bob-copy-1"} <= {
                t["id"] for t in b.trajectories()}
            assert "bob-copy-0" not in {t["id"] for t in a.trajectories()}
        with httpx.Client(base_url=server.url, headers=_h(ALICE), timeout=60) as c:
            for copy in forked["ids"]:
                _same_404(c.get(f"/v1/trajectories/{copy}/files/f"),
                          c.get("/v1/trajectories/nobody-t/files/f"), copy, "nobody-t")
            _same_404(c.get("/v1/actions/bob-fork"), c.get("/v1/actions/nobody-a"),
                      "bob-fork", "nobody-a")
        # the owner's own requests work as ever
        cancelled = a.cancel(running)
        assert cancelled["status"] == "cancelled", cancelled
        assert a.close_trajectory(tid)["status"] == "closed"


def test_ownership_survives_a_restart(tmp_path):
    tokens = _tokens_file(tmp_path)
    server = start_server(tmp_path / "state", "process",
                          extra_args=("--tokens-file", str(tokens)))
    try:
        with TangramSyncClient(server.url, ALICE, timeout_s=60) as a:
            tid = a.open_trajectory("kept-t", task="t")
            a.put_file(tid, "secret.txt", b"alice's\n")
            assert a.run(tid, id="kept-done", command="true")["status"] == "ok"
            src = a.open_trajectory("kept-src", task="t")
            forked = a.fork(src, 1, prefix="kept-copy", action="kept-fork")
        server.stop(signal.SIGKILL)  # a crash: only the journal remembers
        server = start_server(tmp_path / "state", "process",
                              extra_args=("--tokens-file", str(tokens)))
        with TangramSyncClient(server.url, ALICE, timeout_s=60) as a:
            assert {tid, src, *forked["ids"]} <= {t["id"] for t in a.trajectories()}
            assert a.wait("kept-done", 0)["status"] == "ok"
            assert a.wait("kept-fork", 0)["status"] == "ok"  # the fork's action, journalled
            running = a.submit(tid, action_id="kept-sleep", command="sleep 600")["id"]
        _crossed(server.url, ALICE, BOB, tid, "nobody-t", "kept-done", running, "nobody-a")
        with httpx.Client(base_url=server.url, headers=_h(BOB), timeout=60) as c:
            _same_404(c.get(f"/v1/trajectories/{forked['ids'][0]}"),
                      c.get("/v1/trajectories/nobody-t"), forked["ids"][0], "nobody-t")
            _same_404(c.get("/v1/actions/kept-fork"), c.get("/v1/actions/nobody-a"),
                      "kept-fork", "nobody-a")
    finally:
        server.stop()


def _serve_fails(tmp: Path, tokens: Path, env_token: str | None = TOKEN) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_TOKEN"}
    if env_token:
        env["TANGRAM_TOKEN"] = env_token
    done = subprocess.run([sys.executable, str(ROOT / "cli.py"), "serve", "--port", "1",
                           "--state-dir", str(tmp / "state"), "--tokens-file", str(tokens)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    return " ".join(done.stderr.split())


@pytest.mark.parametrize(("text", "mode", "said"), [
    (f"{ALICE} alice\n", 0o644, "readable or writable by other users"),
    (f"{ALICE} alice\n{BOB} alice\n", 0o600, "the name 'alice' is given to two tokens"),
    (f"{ALICE} alice\n{ALICE} bob\n", 0o600, "the same token is given twice"),
    (f"{TOKEN}-but-longer default\n", 0o600, "`default` is TANGRAM_TOKEN's"),
    ("short alice\n", 0o600, ":1: a token is 16 to 512"),
    (f"{ALICE} alice extra\n", 0o600, ":1: expected `TOKEN [NAME]`"),
    ("# nothing\n", 0o600, "no token in it"),
])
def test_a_bad_tokens_file_stops_the_start(tmp_path, text, mode, said):
    tokens = tmp_path / "tokens"
    tokens.write_text(text)
    tokens.chmod(mode)
    assert said in _serve_fails(tmp_path, tokens)


def test_a_missing_tokens_file_stops_the_start(tmp_path):
    assert "cannot be read" in _serve_fails(tmp_path, tmp_path / "absent")


def test_a_journal_from_before_ownership_is_defaults(tmp_path):
    """A journal written before owners were (no owner column, no owners table): opened as
    it is, each of its trajectories and actions is `default`'s (TANGRAM_TOKEN's)."""
    import sqlite3

    from executor.server.journal import Journal

    path = tmp_path / "journal.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE actions (id TEXT PRIMARY KEY, trajectory TEXT, body TEXT, "
               "status TEXT, result TEXT, output BLOB)")
    db.execute("CREATE TABLE trajectories (id TEXT PRIMARY KEY, task TEXT, mem_gb REAL, "
               "image TEXT)")
    db.execute("INSERT INTO actions VALUES ('old-a', 'old-t', '{}', 'ok', NULL, NULL)")
    db.execute("INSERT INTO trajectories VALUES ('old-t', 't', NULL, NULL)")
    db.commit()
    db.close()
    journal = Journal(path)
    try:
        assert journal.owner("old-t") == "default"
        assert journal.action_owner("old-a") == "default"
        assert journal.action_owner("never") is None
        journal.submitted("new-a", "old-t", "{}", "alice")
        journal.owned("new-t", "alice")
        assert journal.action_owner("new-a") == "alice" and journal.owner("new-t") == "alice"
        journal.closed("new-t")
        assert journal.owner("new-t") == "default"  # (forgotten with its close)
    finally:
        journal.close()
