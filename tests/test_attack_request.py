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
