"""Attack (issue 21 #6, #7): clients that hold connections without finishing a request,
and many status streams, against a real `tangram serve` on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from conftest import TOKEN, start_server

H = {"Authorization": f"Bearer {TOKEN}"}
MAX_FDS = 512  # the server's open-file limit in this test (hosts often have 1,024)


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    # the deadlines shortened from 10 s (headers) and 30 s (a body's silence) by the options
    s = start_server(tmp_path_factory.mktemp("serve-fds"), "process", max_fds=MAX_FDS,
                     extra_args=("--header-timeout-s", "5", "--read-timeout-s", "5"))
    yield s
    s.stop()


def _half_requests(url: str, n: int) -> list[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        socks.append(s)
    return socks


def _closed(s: socket.socket) -> bool:
    s.settimeout(0.01)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_unfinished_headers_cannot_take_the_servers_descriptors(small_server):
    """Before: uvicorn never timed out a connection whose headers were unfinished, and
    ~MAX_FDS of them made every action fail "Too many open files". Now connections past
    the cap are closed at once, the rest after the header deadline, and actions run."""
    socks = _half_requests(small_server.url, MAX_FDS + 100)
    try:
        with httpx.Client(base_url=small_server.url, headers=H, timeout=60) as c:
            assert c.post("/v1/trajectories", json={"id": "fds"}).status_code == 201
            r = c.post("/v1/trajectories/fds/actions", json={"id": "fds1", "argv": ["true"]})
            assert r.status_code == 202, r.text
            res = c.get("/v1/actions/fds1", params={"wait": 60}).json()
            assert res["status"] == "ok", res
            c.delete("/v1/trajectories/fds")
        # every half-request is eventually dropped by the server (header deadline: 5 s)
        deadline = time.time() + 60
        while time.time() < deadline and not all(_closed(s) for s in socks):
            time.sleep(0.5)
        assert all(_closed(s) for s in socks)
    finally:
        for s in socks:
            s.close()


def test_a_stalled_body_gets_408(small_server):
    host, port = small_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/trajectories HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  + TOKEN.encode() + b"\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"id\":")
        answer = b""
        while b"}" not in answer and (chunk := s.recv(4096)):  # headers, then the body
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"5 s" in answer, answer[:400]


def test_many_status_streams_share_one_snapshot(small_server):
    """Issue 21 #7: each /v1/status/events stream rebuilt the snapshot 4 times a second
    (1,000 streams: loop at 100% CPU, healthz 1.6 s). Now one snapshot per change is
    shared by all streams, and a token gets at most MAX_STREAMS of them (429 past it)."""
    from executor.server.status import MAX_STREAMS, POLL_S

    stop = threading.Event()
    opened: list[int] = []

    def stream() -> None:
        with httpx.Client(base_url=small_server.url, headers=H, timeout=30) as c:
            with c.stream("GET", "/v1/status/events") as r:
                opened.append(r.status_code)
                if r.status_code != 200:
                    return
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(MAX_STREAMS + 5)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while len(opened) < len(threads) and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert opened.count(200) == MAX_STREAMS and opened.count(429) == 5, opened
        with httpx.Client(base_url=small_server.url, headers=H, timeout=60) as c:
            first = c.get("/v1/status").json()["streams"]
            t0 = time.monotonic()
            time.sleep(2.0)
            last = c.get("/v1/status").json()["streams"]
            elapsed = time.monotonic() - t0
        assert first["open"] == last["open"] == MAX_STREAMS, (first, last)
        # one build per poll for all streams (a loaded machine only polls less often);
        # before, every stream built its own: MAX_STREAMS times as many
        polls = elapsed / POLL_S
        assert last["built"] - first["built"] <= polls + 2, (first, last, elapsed)
    finally:
        stop.set()
