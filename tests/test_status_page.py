"""The live status page of `tangram serve`: its snapshot, its auth, and what a person sees in
a real headless Chromium (Debian's chromium + chromium-driver, driven by Selenium) while a
small replay runs on a real server. The browser test fails, never skips, when Chromium or
its driver is missing: `make test` installs them."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, TOKEN, Server, start_server
from helpers import EventLoop, cluster, gpu_call, shell

from executor.server.status import snapshot
from tangram.core import Tangram

ARTIFACTS = ROOT / "test-artifacts"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


# -- the snapshot, on the pure core ----------------------------------------------------------
def test_snapshot_shows_holders_queues_gpus_and_quotas():
    core = Tangram(cluster(cores=4, gpu_nodes=1, services=(("judge", 40),),
                           quotas=(("quota:api", "concurrency", 3, 1.0),)))
    loop = EventLoop(core)
    for t in ("ta", "tb", "tc"):
        loop.runtime.open_trajectory(t, "t", 1.0)
    loop.runtime.submit(shell("ta", t1=5.0, cores=3, aid="big"))
    loop.runtime.open_trajectory("td", "t", 1.0)
    loop.runtime.submit(shell("td", t1=0.01, aid="ls"))  # light: on the lane, no core of its own
    loop.runtime.submit(shell("tb", t1=1.0, cores=2, aid="waits"))  # 1 core left: queued
    loop.runtime.submit(gpu_call("tc", "judge", t1=2.0, choices=(2,), aid="judge-1"))
    snap = snapshot(core.snapshot(), loop.runtime.records, 0.5, {"ok": 0})
    assert [h["action"] for h in snap["nodes"][0]["lane"]] == ["ls"]
    assert snap["nodes"][0]["lane_slots"] >= 1

    cores = snap["nodes"][0]["cores"]
    assert [c["action"] if c else None for c in cores].count("big") == 3
    assert cores.count(None) == 1
    queued = {w["action"]: w for q in snap["queues"] for w in q["waiting"]}
    assert set(queued) == {"waits"} and queued["waits"]["units_min"] == 2
    assert queued["waits"]["waiting_s"] == pytest.approx(0.5)
    gpu = snap["gpu_nodes"][0]
    busy = [c for c in gpu["chunks"] if c["state"] == "busy"]
    assert [(c["start"], c["size"], c["service"], c["action"]) for c in busy] == [(0, 2, "judge", "judge-1")]
    assert sum(c["size"] for c in gpu["chunks"]) == 8  # busy + free chunks tile the node
    assert gpu["resident"] == [{"service": "judge", "dop": 2, "start": 0, "mem_gb": 40.0}]
    assert snap["quotas"] == [{"key": "api", "mode": "concurrency", "limit": 3.0,
                               "window_s": 1.0, "used": 0.0}]


def test_snapshot_shows_pods_holding_cores_between_actions():
    from tangram.policies import make_policy

    core = Tangram(cluster(cores=4), make_policy("k8s", {"pod_cores": 2}))
    loop = EventLoop(core)
    loop.runtime.open_trajectory("ta", "t", 1.0)
    loop.runtime.submit(shell("ta", t1=1.0, aid="first"))
    loop.clock.run()  # the action ends; the pod keeps its cores
    held = [c for c in snapshot(core.snapshot(), loop.runtime.records, 2.0)["nodes"][0]["cores"] if c]
    assert [(h["action"], h["trajectory"], h["kind"]) for h in held] == [(None, "ta", "pod")] * 2


# -- HTTP ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    # GPU workers on the CPU (the real worker path, `--gpu-device cpu`): the GPU section live
    srv = start_server(tmp_path_factory.mktemp("serve-status"), "process",
                       quotas=("api=concurrency:2",),
                       extra_args=("--gpu-cluster",
                                   str(ROOT / "executor/backends/gpu/clusters/cpu-tiny.yaml"),
                                   "--gpu-device", "cpu"))
    yield srv
    srv.stop()


def test_page_is_public_but_its_data_needs_the_token(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "<title>Tangram status</title>" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "http" not in page.text.replace("http-equiv", "")  # nothing loaded from outside
    for path in ("/v1/status", "/v1/status/events"):
        assert httpx.get(server.url + path).status_code == 401
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer no"}).status_code == 401
    snap = httpx.get(server.url + "/v1/status", headers=AUTH).json()
    assert snap["nodes"][0]["name"] == "local"
    assert snap["quotas"][0]["key"] == "api"


def test_event_stream_sends_a_snapshot_at_once(server):
    with httpx.stream("GET", server.url + "/v1/status/events", headers=AUTH, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(lines) == "event: snapshot"
        assert next(lines).startswith('data: {"now_s"')


# -- a real browser --------------------------------------------------------------------------
def chrome():
    """Headless Chromium from the distribution, or a failure saying how to install it."""
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        pytest.fail("the status page test needs Chromium and its driver: `make test` installs "
                    "them (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000"):
        opts.add_argument(arg)
    try:  # an explicit driver path: Selenium never tries to download one
        return webdriver.Chrome(service=Service(driver), options=opts)
    except WebDriverException as e:
        pytest.fail(f"Chromium did not start: {e.msg}")


def holding_command(flag: Path) -> list[str]:
    """An action that runs until the test creates ``flag`` (the test decides when it ends)."""
    return [sys.executable, "-c",
            f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.05)"]


def submit(server: Server, tid: str, aid: str, cores: int, flag: Path) -> None:
    r = httpx.post(f"{server.url}/v1/trajectories/{tid}/actions", headers=AUTH,
                   json={"id": aid, "kind": "test_run" if cores > 1 else "shell",
                         "argv": holding_command(flag), "cpu": str(cores), "timeout_s": 120})
    assert r.status_code == 202, r.text


def status_of(server: Server, aid: str) -> str:
    return httpx.get(f"{server.url}/v1/actions/{aid}", headers=AUTH).json()["status"]


@pytest.fixture(scope="module")
def browser():
    b = chrome()
    yield b
    b.quit()


def test_status_page_in_a_browser(server, browser, shared_dir):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 120, poll_frequency=0.1,
                         ignored_exceptions=(StaleElementReferenceException,))

    # The page redraws a section whenever a snapshot arrives, so what a person sees is read
    # in one script call (an element handle found a moment before may be gone already).
    def text(selector: str) -> str | None:
        """The visible text of the first element matching ``selector`` (None: not shown)."""
        return browser.execute_script(
            "const e = document.querySelector(arguments[0]);"
            "return e && e.offsetParent !== null ? e.innerText : null", selector)

    def shown(selector: str) -> bool:
        return text(selector) is not None

    def cells(action: str) -> list[dict]:
        """The highlighted core cells of ``action``: their data attributes and text."""
        return browser.execute_script(
            "return [...document.querySelectorAll(arguments[0])]"
            ".map(e => ({...e.dataset, text: e.innerText}))",
            f'.core.busy[data-action="{action}"]')

    try:
        browser.get(server.url + "/")
        # a person first sees the token form; a wrong token is refused, in words
        token = wait.until(lambda b: b.find_element(By.ID, "token"))
        token.send_keys("not-the-token")
        browser.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
        wait.until(lambda b: "not this server" in b.find_element(By.ID, "login-error").text)
        assert "not-the-token" not in browser.current_url
        token.clear()
        token.send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
        wait.until(lambda b: b.find_element(By.ID, "conn").text == "live")
        assert TOKEN not in browser.current_url
        browser.execute_script("window.__notReloaded = true")

        # a GPU request: the page shows the service it left resident on the GPUs it ran on
        assert httpx.post(server.url + "/v1/trajectories", headers=AUTH,
                          json={"id": "traj-g", "task": "mopd"}).status_code == 201
        r = httpx.post(f"{server.url}/v1/trajectories/traj-g/actions", headers=AUTH, json={
            "id": "act-g", "kind": "teacher", "service": "teacher0", "gpus": "2",
            "inputs": {"op": "logprobs", "tokens": [[5, 6, 7]]}})
        assert r.status_code == 202, r.text
        done = httpx.get(f"{server.url}/v1/actions/act-g", params={"wait": 60}, headers=AUTH,
                         timeout=70).json()
        assert done["status"] == "ok", done
        gpus = "-".join(str(g) for g in (min(done["gpus"]), max(done["gpus"])))
        wait.until(lambda b: f"teacher0 \u00d72 on GPU {gpus}" in (text(".gpu-node") or ""))
        wait.until(lambda b: shown('tr.finished[data-action="act-g"][data-status="ok"]'))
        assert shown(f'.resident[data-service="teacher0"][data-start="{min(done["gpus"])}"]')

        # a small replay: one action takes all but one core, another the last one, a third
        # waits; every action holds until the test lets it finish
        n = len(httpx.get(server.url + "/v1/status", headers=AUTH).json()["nodes"][0]["cores"])
        for tid in ("traj-a", "traj-b", "traj-c"):
            assert httpx.post(server.url + "/v1/trajectories", headers=AUTH,
                              json={"id": tid, "mem_gb": 0.1}).status_code == 201
        flags = {k: shared_dir / k for k in ("a", "b", "c")}  # (seen by the commands)
        big = max(n - 1, 1)
        submit(server, "traj-a", "act-a", big, flags["a"])
        if n > 1:
            submit(server, "traj-c", "act-c", 1, flags["c"])
        submit(server, "traj-b", "act-b", 1, flags["b"])
        assert status_of(server, "act-b") == "queued"

        # the running action's cores are highlighted, the queued one is listed with its wait
        wait.until(lambda b: len(cells("act-a")) == big)
        held = cells("act-a")
        assert {c["trajectory"] for c in held} == {"traj-a"} and len(held) == big
        assert all("test_run" in c["text"] for c in held) or big == 1
        wait.until(lambda b: shown('tr.queued[data-action="act-b"]'))
        assert "traj-b" in text('tr.queued[data-action="act-b"]')
        waited = 'tr.queued[data-action="act-b"] td:last-child'
        first = float(text(waited))
        wait.until(lambda b: float(text(waited) or 0) > first)  # its waiting time ticks
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "status-page.png"))

        # the big action finishes: without a reload, its cores change hands, the waiting
        # action starts and leaves the queue, and the finished one is listed as ok
        flags["a"].touch()
        wait.until(lambda b: shown('tr.finished[data-action="act-a"][data-status="ok"]'))
        wait.until(lambda b: len(cells("act-b")) == 1 and not cells("act-a"))
        wait.until(lambda b: not shown('tr.queued[data-action="act-b"]'))
        assert browser.execute_script("return window.__notReloaded === true")
        browser.save_screenshot(str(ARTIFACTS / "status-page-after.png"))

        for flag in flags.values():
            flag.touch()
        wait.until(lambda b: not shown(".core.busy"))
        deadline = time.time() + 120
        while time.time() < deadline and any(status_of(server, a) in ("queued", "running")
                                             for a in ("act-a", "act-b", "act-c")):
            time.sleep(0.1)
        for tid in ("traj-a", "traj-b", "traj-c", "traj-g"):
            assert httpx.delete(f"{server.url}/v1/trajectories/{tid}", headers=AUTH).status_code == 200

        # forgetting the token returns to the form
        browser.find_element(By.ID, "logout").click()
        wait.until(lambda b: b.find_element(By.ID, "login").is_displayed())
        assert browser.execute_script("return sessionStorage.length") == 0
    finally:
        for flag in flags.values() if "flags" in locals() else ():
            flag.touch()


def test_status_page_draws_gpu_chunks_and_quotas(server, browser):
    """The live server here has no GPUs: draw a snapshot of a core that has some."""
    from selenium.webdriver.common.by import By

    core = Tangram(cluster(cores=4, gpu_nodes=1, services=(("judge", 40),),
                           quotas=(("quota:api", "concurrency", 4, 1.0),)))
    loop = EventLoop(core)
    loop.runtime.open_trajectory("tg", "t", 1.0)
    loop.runtime.submit(gpu_call("tg", "judge", t1=2.0, choices=(2,), aid="judge-1"))
    loop.runtime.open_trajectory("tl", "t", 1.0)
    loop.runtime.submit(shell("tl", t1=0.01, aid="light-ls"))
    snap = snapshot(core.snapshot(), loop.runtime.records, 0.1)
    snap["quotas"][0]["used"] = 3.0
    browser.get(server.url + "/")
    browser.execute_script("document.getElementById('view').hidden = false; show(arguments[0])",
                           snap)
    chunk = browser.find_element(By.CSS_SELECTOR, '.chunk.busy[data-action="judge-1"]')
    assert "judge" in chunk.text and chunk.get_attribute("data-size") == "2"
    assert len(browser.find_elements(By.CSS_SELECTOR, ".chunk.free")) == 2  # GPUs 2-3, 4-7
    node = browser.find_element(By.CSS_SELECTOR, '.gpu-node[data-node="g0"]').text
    assert "resident: judge \u00d72 on GPU 0-1" in node
    lane = browser.find_element(By.CSS_SELECTOR, '.lane[data-node="n0"]')
    assert "light lane (shared cores): 1/" in lane.text
    assert lane.find_element(By.CSS_SELECTOR, '.chip[data-action="light-ls"]').is_displayed()
    assert not browser.find_elements(By.CSS_SELECTOR, ".core.busy")  # it holds no core
    quota = browser.find_element(By.CSS_SELECTOR, '.quota[data-key="api"]')
    assert "3 / 4 in flight" in quota.text
    assert quota.find_element(By.CSS_SELECTOR, ".bar > span").value_of_css_property("width") != "0px"
