"""Attack: long-polls that would hold a shutdown. SIGTERM must end the server
without waiting for them, answer every waiting client, and record in-flight actions
failed. (How fast it ends is a figure for a benchmark, not a bound here: the CI is
loaded.)"""

from __future__ import annotations

import signal
import threading
import time

import httpx
from conftest import TOKEN, start_server

H = {"Authorization": f"Bearer {TOKEN}"}


def test_sigterm_ends_long_polls_and_exits(tmp_path):
    server = start_server(tmp_path / "state")
    answers: list[int] = []
    try:
        with httpx.Client(base_url=server.url, headers=H, timeout=60) as c:
            c.post("/v1/trajectories", json={"id": "t"})
            c.post("/v1/trajectories/t/actions", json={"id": "slow", "argv": ["sleep", "120"]})

            def poll() -> None:
                try:
                    answers.append(httpx.get(server.url + "/v1/actions/slow", headers=H,
                                             params={"wait": 3600}, timeout=60).status_code)
                except httpx.HTTPError:
                    answers.append(-1)

            pollers = [threading.Thread(target=poll) for _ in range(3)]
            for p in pollers:
                p.start()
            time.sleep(0.5)
            server.proc.send_signal(signal.SIGTERM)
            # ends well before the action (120 s) or the long-polls (3600 s) would: it
            # did not wait for them; this wait() is a hang guard, not a speed bound
            server.proc.wait(60)
            for p in pollers:
                p.join(10)
        assert len(answers) == 3  # every waiter got an answer (or a closed connection)
    finally:
        server.stop()
    again = start_server(tmp_path / "state")
    try:
        res = httpx.get(again.url + "/v1/actions/slow", headers=H).json()
        assert res["status"] == "failed" and "shut down" in res["error"], res
        # it never ran to its end: the same id and body runs it now
        with httpx.Client(base_url=again.url, headers=H, timeout=60) as c:
            c.post("/v1/trajectories", json={"id": "t"})
            r = c.post("/v1/trajectories/t/actions", params={"wait": 0.5},
                       json={"id": "slow", "argv": ["sleep", "120"]})
            assert r.status_code == 202 and r.json()["status"] == "running", r.text
    finally:
        again.stop()


def test_sigterm_answers_a_long_poll_failed_not_running(tmp_path):
    """Issue 21 #10: SIGTERM woke a pending long-poll with ``running``: the client waited
    for a result that would never come. It now answers ``failed`` (shut down), as the
    journal records it."""
    server = start_server(tmp_path / "state")
    answers: list[dict] = []
    try:
        with httpx.Client(base_url=server.url, headers=H, timeout=60) as c:
            c.post("/v1/trajectories", json={"id": "t"})
            c.post("/v1/trajectories/t/actions", json={"id": "slow", "argv": ["sleep", "120"]})
            assert c.get("/v1/actions/slow", params={"wait": 2}).json()["status"] == "running"

            def poll() -> None:
                r = httpx.get(server.url + "/v1/actions/slow", headers=H,
                              params={"wait": 3600}, timeout=60)
                answers.append(r.json())

            poller = threading.Thread(target=poll)
            poller.start()
            time.sleep(0.5)
            server.proc.send_signal(signal.SIGTERM)
            poller.join(30)
            server.proc.wait(30)
        assert len(answers) == 1 and answers[0]["status"] == "failed", answers
        assert "shut down" in answers[0]["error"], answers
    finally:
        server.stop()
