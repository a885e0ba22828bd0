"""Attack: hostile request bodies, ids and tokens against a real `tangram serve`.

Every case must be refused with a 4xx naming the problem (never a 5xx), touch
nothing outside its trajectory's directory, and leave the server responsive.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from conftest import TOKEN

H = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture()
def http(process_server):
    with httpx.Client(base_url=process_server.url, headers=H, timeout=60) as c:
        yield c


def _open(http, tid: str) -> None:
    r = http.post("/v1/trajectories", json={"id": tid, "task": "t"})
    assert r.status_code == 201, r.text


def _run(http, tid: str, aid: str, **body) -> dict:
    r = http.post(f"/v1/trajectories/{tid}/actions", json={"id": aid, **body})
    assert r.status_code == 202, r.text
    r = http.get(f"/v1/actions/{aid}", params={"wait": 30})
    return r.json()


@pytest.mark.parametrize("tid", [".", "..", "...", "a/b", "a\\b", "a\x00b", "a\nb", "", " ",
                                 "x" * 129, "é", "a b", "%2E"])
def test_bad_trajectory_ids_are_refused(http, tid):
    r = http.post("/v1/trajectories", json={"id": tid})
    assert r.status_code == 422, (tid, r.status_code, r.text)


def test_dot_paths_cannot_delete_other_data(http, process_server):
    _open(http, "victim-dots")
    assert _run(http, "victim-dots", "vd1", argv=["sh", "-c", "echo keep > f.txt"])["exit_code"] == 0
    journal = process_server.state_dir / "journal.sqlite"
    for path in ("%2E", "%2E%2E", "..%2F..", "victim-dots%2F..", ".", "%2e%2e%2fwork"):
        r = http.delete(f"/v1/trajectories/{path}")
        assert r.status_code in (404, 405, 422), (path, r.status_code)
    assert journal.exists()
    assert (process_server.state_dir / "work" / "victim-dots" / "f.txt").read_text() == "keep\n"
    res = _run(http, "victim-dots", "vd2", argv=["cat", "f.txt"])
    assert res["output"] == "keep\n"
    assert http.delete("/v1/trajectories/victim-dots").status_code == 200


def test_similar_ids_get_distinct_directories(http):
    for tid in ("a_b", "a:b", "a.b", "a-b"):
        _open(http, f"sim-{tid}")
        _run(http, f"sim-{tid}", f"sim-w-{tid}", argv=["sh", "-c", f"echo {tid} > who"])
    for tid in ("a_b", "a:b", "a.b", "a-b"):
        assert _run(http, f"sim-{tid}", f"sim-r-{tid}", argv=["cat", "who"])["output"] == f"{tid}\n"
        http.delete(f"/v1/trajectories/sim-{tid}")


BAD_ACTIONS = [
    {"argv": ["echo", "a\x00b"]},                      # H1: NUL in an argument
    {"argv": ["env"], "env": {"A=B": "x"}},            # H1: '=' in an env name
    {"argv": ["env"], "env": {"A": "x\x00y"}},         # H1: NUL in an env value
    {"argv": []}, {"argv": [""]}, {"command": ""}, {"command": "   "},
    {"command": "echo 'unterminated"},                 # unsplittable: 422 now, not at run time
    {"argv": ["true"], "command": "true"},             # two commands
    {},                                                 # none
    {"argv": ["true"], "time_out": 5},                 # unknown field (typo)
    {"argv": ["true"], "privileged": True},
    {"argv": ["true"], "cwd": "/"},
    {"argv": ["true"], "timeout_s": "inf"}, {"argv": ["true"], "timeout_s": "5"},
    {"argv": ["true"], "timeout_s": 10 ** 9}, {"argv": ["true"], "timeout_s": 0},
    {"argv": ["true"], "cpu": "1-5000000"}, {"argv": ["true"], "cpu": "0"},
    {"argv": ["true"], "cpu": "3-1"}, {"argv": ["true"], "cpu": ",".join(["1"] * 100)},
    {"argv": ["true"], "cpu": 2},
    {"argv": ["true"], "elastic": "yes"}, {"argv": ["true"], "t1_s": True},
    {"argv": ["true"], "quota": {"api": True}}, {"argv": ["true"], "quota": {"cpu": 1}},
    {"argv": "true"}, {"argv": [1, 2]},
    {"command": "x" * (64 * 1024 + 1)},                # command length limit
    {"argv": ["true"], "kind": "a\nb"},
]


@pytest.mark.parametrize("body", BAD_ACTIONS, ids=range(len(BAD_ACTIONS)))
def test_bad_action_bodies_are_refused_before_anything_runs(http, body):
    tid = "bad-bodies"
    http.post("/v1/trajectories", json={"id": tid})
    r = http.post(f"/v1/trajectories/{tid}/actions", json={"id": "bad-1", **body})
    assert r.status_code == 422, (body, r.status_code, r.text[:300])
    assert "detail" in r.json()
    assert http.get("/v1/actions/bad-1").status_code == 404  # nothing was recorded


def test_bad_trajectory_bodies(http):
    for body in ({"mem_gb": True}, {"mem_gb": "1"}, {"mem_gb": -1}, {"task": "a/b"},
                 {"id": "ok", "extra": 1}, {"image": "$(reboot)"}):
        r = http.post("/v1/trajectories", json=body)
        assert r.status_code == 422, (body, r.text)


def test_body_size_limit(http):
    big = {"id": "big", "argv": ["true"], "env": {"X": "y" * (2 << 20)}}
    r = http.post("/v1/trajectories/bad-bodies/actions", json=big)
    assert r.status_code == 413
    # without a content-length (chunked): counted as it arrives
    r = http.post("/v1/trajectories/bad-bodies/actions", headers={"content-type": "application/json"},
                  content=iter([b"{" + b" " * (1 << 19)] * 4))
    assert r.status_code == 413


def test_idempotency_conflict(http):
    _open(http, "idem")
    assert _run(http, "idem", "same-id", argv=["echo", "one"])["output"] == "one\n"
    r = http.post("/v1/trajectories/idem/actions", json={"id": "same-id", "argv": ["echo", "one"]})
    assert r.status_code == 200 and r.json()["output"] == "one\n"  # same body: its result
    r = http.post("/v1/trajectories/idem/actions", json={"id": "same-id", "argv": ["echo", "two"]})
    assert r.status_code == 409 and "different body" in r.json()["detail"]
    _open(http, "idem-other")
    r = http.post("/v1/trajectories/idem-other/actions",
                  json={"id": "same-id", "argv": ["echo", "one"]})
    assert r.status_code == 409


@pytest.mark.parametrize("token", ["tést", "\u2603", "x" * 10000, "-", TOKEN + "x"])
def test_odd_bearer_tokens_get_401(process_server, token):
    r = httpx.get(process_server.url + "/metrics",
                  headers={"Authorization": b"Bearer " + token.encode()})
    assert r.status_code == 401


def test_long_commands_do_not_stall_the_loop(http):
    """H3: commands are split off the event loop (and at most 64 KiB); /healthz keeps
    answering while 32 maximal commands (~0.15 s of shlex each, ~5 s in all) arrive at
    once. No time bound here (it failed at load ~6, issue 21 #11): the latency is a
    figure of analysis/bench/loop_stall.py. What is checked: every probe is answered
    while the burst is accepted, and the commands run as sent."""
    _open(http, "long-cmd")
    command = "echo " + "x" * (64 * 1024 - 5)
    lat: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=str(http.base_url)) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get("/healthz").status_code == 200
                lat.append(time.perf_counter() - t0)
                time.sleep(0.01)

    def submit(i: int) -> None:
        with httpx.Client(base_url=str(http.base_url), headers=H, timeout=60) as c:
            r = c.post("/v1/trajectories/long-cmd/actions", json={"id": f"lc{i}",
                                                                   "command": command})
            assert r.status_code == 202

    t = threading.Thread(target=probe)
    t.start()
    time.sleep(0.1)
    try:
        senders = [threading.Thread(target=submit, args=(i,)) for i in range(32)]
        for s in senders:
            s.start()
        for s in senders:
            s.join()
    finally:
        stop.set()
        t.join()
    assert lat, "no /healthz answer while the commands arrived"
    res = http.get("/v1/actions/lc31", params={"wait": 60}).json()
    assert res["status"] == "ok" and len(res["output"]) == 64 * 1024 - 4


def test_json_with_a_byte_order_mark_is_refused(http):
    """Issue 21 #10: a body starting with a UTF-8 BOM was accepted as JSON."""
    r = http.post("/v1/trajectories", content=b"\xef\xbb\xbf" + b'{"id": "bom"}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "byte order mark" in r.json()["detail"], r.text
    assert http.post("/v1/trajectories", json={"id": "bom"}).status_code == 201  # not opened
