"""Attack: `request` actions aimed at the server itself, the host's loopback or
private networks (the sandbox has no network; the host running the call does).
Destinations are allow-listed per quota key; loopback and private ranges are
refused unless listed explicitly."""

from __future__ import annotations

import socket

import httpx
import pytest
from conftest import TOKEN, start_server

H = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("serve-request"), "process",
                     quotas=("ext=concurrency:2", "api=concurrency:2"),
                     extra_args=("--allow-url", "ext=*", "--allow-url", "api=http://127.0.0.1:9/v1/"))
    yield s
    s.stop()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers=H, timeout=60) as c:
        c.post("/v1/trajectories", json={"id": "caller"})
        yield c


def _submit(http, aid: str, url: str, quota: dict) -> httpx.Response:
    return http.post("/v1/trajectories/caller/actions",
                     json={"id": aid, "request": {"url": url}, "quota": quota})


@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}/healthz", "http://localhost:{port}/",
                                 "http://[::1]:{port}/", "http://10.0.0.1/",
                                 "http://169.254.169.254/latest/meta-data",
                                 "http://192.168.1.1/", "http://0.0.0.0:{port}/"])
def test_private_destinations_are_refused_under_a_wildcard(http, server, url):
    url = url.format(port=server.url.rsplit(":", 1)[1])
    r = _submit(http, "w-" + str(abs(hash(url))), url, {"ext": 1})
    assert r.status_code == 403 and "private" in r.json()["detail"], r.text


def test_unlisted_destinations_are_refused(http):
    for i, (url, quota) in enumerate([("http://127.0.0.1:9/other", {"api": 1}),
                                      ("http://example.com/", {}),
                                      ("http://127.0.0.1:9/v1/x", {"nokey": 1})]):
        r = _submit(http, f"u{i}", url, quota)
        assert r.status_code in (403, 422), (url, r.text)
        assert http.get(f"/v1/actions/u{i}").status_code == 404


def test_a_name_resolving_to_loopback_fails_at_run_time(http):
    """A wildcard cannot check names at submit (DNS may change): the backend does."""
    r = _submit(http, "by-name", f"http://{socket.gethostname()}:9/", {"ext": 1})
    assert r.status_code == 202, r.text
    res = http.get("/v1/actions/by-name", params={"wait": 30}).json()
    assert res["status"] == "failed" and "private" in res["error"], res


def test_a_listed_destination_is_called(http):
    r = _submit(http, "listed", "http://127.0.0.1:9/v1/ping", {"api": 1})
    assert r.status_code == 202  # allowed; nothing listens on port 9, so it fails there


class _Recorder(__import__("http.server").server.BaseHTTPRequestHandler):
    """A local API with a public /ok/ and a secret /internal; records every path hit."""

    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.hits.append(self.path)
        body = b"SECRET" if not self.path.startswith("/ok/") else b"public"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def local_api():
    import http.server
    import threading

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


@pytest.fixture(scope="module")
def listed_server(tmp_path_factory, local_api):
    s = start_server(tmp_path_factory.mktemp("serve-allow"), "process",
                     quotas=("api=concurrency:2", "loose=concurrency:2"),
                     extra_args=("--allow-url", f"api=http://127.0.0.1:{local_api}/ok/",
                                 "--allow-url", "loose=http://api.test"))
    yield s
    s.stop()


@pytest.mark.parametrize("url,quota,headers", [
    ("http://127.0.0.1:{port}/ok/../../internal", "api", None),  # dot segments
    ("http://127.0.0.1:{port}/ok/%2e%2e/internal", "api", None),  # encoded dot segments
    ("http://127.0.0.1:{port}/ok/..%2finternal", "api", None),  # encoded slash
    ("http://127.0.0.1:{port}/okay", "api", None),  # a prefix of a segment
    ("http://127.0.0.1:{port}\\@127.0.0.1:{port}/ok/", "api", None),  # backslash
    ("http://api.test@127.0.0.1:{port}/", "loose", None),  # user info
    ("http://api.test.127.0.0.1.nip.io:{port}/", "loose", None),  # a longer host
    ("http://api.test:{port}/", "loose", None),  # another port than the entry's
    ("http://127.0.0.1:{port}/ok/x", "api", {"Host": "internal.example"}),  # Host header
])
def test_allow_list_bypasses_are_refused(listed_server, local_api, url, quota, headers):
    """Issue 21 #3: the allow-list compared raw string prefixes; httpx normalises before
    sending, so ``/ok/../../internal`` reached ``/internal`` and ``api.test@127.0.0.1``
    passed a ``http://api.test`` prefix. Now every one of these is refused at submit and
    the local API never sees a request."""
    before = list(_Recorder.hits)
    request = {"url": url.format(port=local_api), **({"headers": headers} if headers else {})}
    with httpx.Client(base_url=listed_server.url, headers=H, timeout=60) as c:
        c.post("/v1/trajectories", json={"id": "bypass"})
        r = c.post("/v1/trajectories/bypass/actions", json={
            "id": f"b{abs(hash((url, str(headers))))}", "request": request, "quota": {quota: 1}})
    assert r.status_code == 403, r.text
    assert _Recorder.hits == before


def test_a_listed_destination_is_reached_as_listed(listed_server, local_api):
    with httpx.Client(base_url=listed_server.url, headers=H, timeout=60) as c:
        c.post("/v1/trajectories", json={"id": "good"})
        r = c.post("/v1/trajectories/good/actions", json={
            "id": "g1", "request": {"url": f"http://127.0.0.1:{local_api}/ok/./x"},
            "quota": {"api": 1}})
        assert r.status_code == 202, r.text
        res = c.get("/v1/actions/g1", params={"wait": 30}).json()
    assert res["status"] == "ok" and res["output"] == "public", res
    assert _Recorder.hits[-1] == "/ok/x"
