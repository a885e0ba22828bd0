"""Images pulled from a registry (issue 50 #1, #2), on a real `tangram serve --backend docker`
and a real registry on 127.0.0.1 (tests/registry.py: Debian's docker-registry; a machine
without it fails these tests, `make registry` installs it). Each image is built here,
pushed, and removed from the engine before the test pulls it; every name is unique to
its test, and the default image is never removed.

* an open whose image is not on the node pulls it (by tag or pinned by digest) and says
  what the pull cost; the next open of it is a hit; /v1/status and /metrics count both;
* two opens of one missing image share one pull; at most --image-pulls run at once;
* a pull that fails (a missing tag or digest, a registry that is not there, a layer the
  registry lost half-way) refuses the open (502, naming the image, the registry and why)
  and leaves nothing: no trajectory, no container, no pull, the id free again;
* the cache (--image-cache-gb) goes over its budget rather than evict a held image (an
  open trajectory's, a container's) and evicts the least recently used of the others.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import httpx
import pytest
from conftest import TOKEN, sandbox_containers, start_server
from helpers import until_true
from registry import Pushed, Registry, free_port, remove_images, unique

from executor.backends.docker.backend import IMAGE
from tangram.protocol import PullImage, capabilities_of

H = {"Authorization": f"Bearer {TOKEN}"}
MB = 1_000_000
#: a minute of margin per step on a loaded machine (a hang guard, not a bound)
WAIT_S = 180.0


@pytest.fixture(scope="module")
def pushed(registry) -> Iterator[list[Pushed]]:
    """The images the module's tests pushed: removed from the engine at its end."""
    made: list[Pushed] = []
    yield made
    remove_images([ref for p in made for ref in (p.tag, p.digest)])


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator:
    """One pull at a time: the tests of the bound see a queue."""
    state = tmp_path_factory.mktemp("serve-pulls")
    s = start_server(state, "docker", extra_args=("--image-pulls", "1", "--record",
                                                  str(state / "recorded.jsonl")))
    yield s
    s.stop()


def push(registry: Registry, pushed: list[Pushed], prefix: str, size: int) -> Pushed:
    p = registry.build_and_push(unique(prefix), size)
    pushed.append(p)
    return p


def present(ref: str) -> bool:
    try:
        docker.from_env().images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def images_status(c: httpx.Client) -> dict:
    return c.get("/v1/status").json()["images"]


def owner_of(server) -> str:
    return hashlib.sha1(str((server.state_dir / "work").resolve()).encode()).hexdigest()[:16]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.mark.parametrize("by", ["digest", "tag"])
def test_an_open_pulls_its_missing_image_and_the_next_open_hits(server, registry, pushed, by):
    p = push(registry, pushed, f"pull-{by}", 3 * MB)
    ref = p.digest if by == "digest" else p.tag
    assert not present(ref)
    with httpx.Client(base_url=server.url, headers=H, timeout=WAIT_S) as c:
        before = images_status(c)["counters"]
        observed = re.search(r"^tangram_core_image_pulls_observed (\S+)$",
                             c.get("/metrics").text, re.M)  # (none before any image)
        observed_before = float(observed.group(1)) if observed else 0.0
        r = c.post("/v1/trajectories", json={"id": f"first-{by}", "image": ref})
        assert r.status_code == 201, r.text
        image = r.json()["image"]
        assert image["image"] == ref and image["pulled"] and not image["shared"], image
        assert image["bytes"] >= p.size and image["pull_s"] > 0, image
        assert present(ref)
        # its commands run in it: the pulled file is there, whole
        res = c.post(f"/v1/trajectories/first-{by}/actions", params={"wait": 120},
                     json={"id": f"wc-{by}", "argv": ["sh", "-c", "wc -c < /data/blob"]}).json()
        assert res["status"] == "ok" and res["output"].strip() == str(p.size), res
        again = c.post("/v1/trajectories", json={"id": f"again-{by}", "image": ref})
        assert again.status_code == 201 and again.json()["image"] == {
            "image": ref, "pulled": False}, again.text
        after = images_status(c)
        assert after["counters"]["pulls"] == before["pulls"] + 1
        assert after["counters"]["misses"] == before["misses"] + 1
        assert after["counters"]["hits"] == before["hits"] + 1
        assert after["counters"]["pulled_bytes"] >= before["pulled_bytes"] + p.size
        assert any(i["image"] == ref and i["held"] for i in after["cached"]), after["cached"]
        text = c.get("/metrics").text
        assert metric(text, "tangram_image_pulls_total") == after["counters"]["pulls"]
        assert metric(text, "tangram_image_cache_hits_total") == after["counters"]["hits"]
        assert metric(text, "tangram_image_pulled_bytes_total") == pytest.approx(
            after["counters"]["pulled_bytes"], rel=1e-5)
        # the core booked the image and ordered it to the node (carried out by the docker
        # backend's pull_image: here already, nothing pulled twice)
        assert metric(text, 'tangram_effects_total{effect="PullImage"}') >= 1
        # the pull's rate reached the core with the trajectory's first outcome (what it
        # places the next trajectories by): one more pull observed
        assert metric(text, "tangram_core_image_pulls_observed") == observed_before + 1
        assert metric(text, "tangram_core_image_pull_gbps") > 0
        for tid in (f"first-{by}", f"again-{by}"):
            assert c.delete(f"/v1/trajectories/{tid}").status_code == 200
    # the recording (serve --record) carries the image and the size the node stored, so a
    # replay of it pulls what the run pulled
    rows = [json.loads(line) for line in
            (server.state_dir / "recorded.jsonl").read_text().splitlines()[1:]]
    row = next(r for r in rows if r["trajectory"] == f"first-{by}")
    assert row["image"] == ref and row["image_gb"] * 1e9 >= p.size, row


def test_opens_of_one_missing_image_share_one_pull_and_pulls_wait_for_a_slot(
        server, registry, pushed):
    """Two opens of image A, one each of B and C, at once, one pull at a time (the
    server's --image-pulls 1): A is pulled once, and no two pulls ever run together."""
    a, b, cc = (push(registry, pushed, f"share-{x}", 16 * MB) for x in "abc")
    opens = [("s-a1", a.digest), ("s-a2", a.digest), ("s-b", b.tag), ("s-c", cc.digest)]
    seen_running: list[int] = []

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=H, timeout=WAIT_S) as c:
            before = (await c.get("/v1/status")).json()["images"]["counters"]
            tasks = [asyncio.ensure_future(c.post("/v1/trajectories",
                                                  json={"id": tid, "image": ref}))
                     for tid, ref in opens]
            while not all(t.done() for t in tasks):  # watch the pulls while they run
                im = (await c.get("/v1/status")).json()["images"]
                seen_running.append(sum(p["state"] == "pulling" for p in im["pulling"]))
                await asyncio.sleep(0.05)
            after = (await c.get("/v1/status")).json()["images"]["counters"]
            assert after["pulls"] - before["pulls"] == 3, (before, after)
            assert after["shared"] - before["shared"] == 1, (before, after)
            return [t.result() for t in tasks]

    answers = asyncio.run(main())
    assert [r.status_code for r in answers] == [201] * 4, [r.text for r in answers]
    shared = sorted(r.json()["image"]["shared"] for r in answers[:2])
    assert shared == [False, True], [r.json() for r in answers[:2]]
    assert answers[0].json()["image"]["bytes"] == answers[1].json()["image"]["bytes"]
    assert max(seen_running) <= 1, seen_running
    with httpx.Client(base_url=server.url, headers=H, timeout=WAIT_S) as c:
        for tid, _ in opens:
            assert c.delete(f"/v1/trajectories/{tid}").status_code == 200


@pytest.mark.parametrize("fault", ["missing-tag", "missing-digest", "no-registry",
                                   "layer-lost-half-way"])
def test_a_failed_pull_refuses_the_open_and_leaves_nothing(server, registry, pushed, fault):
    tid = f"fail-{fault}"
    if fault == "no-registry":
        host = f"127.0.0.1:{free_port()}"  # nothing listens there
        ref, want = f"{host}/{unique('nowhere')}:1", "connection refused"
    else:
        p = push(registry, pushed, f"fail-{fault}", 2 * MB)
        host = registry.host
        if fault == "missing-tag":
            ref, want = p.tag.rsplit(":", 1)[0] + ":no-such-tag", "not found"
        elif fault == "missing-digest":
            ref, want = p.digest.split("@")[0] + "@sha256:" + "0" * 64, "not found"
        else:  # the manifest is there, its layer is not: the pull fails after it began
            name = p.tag.split("/", 1)[1].rsplit(":", 1)[0]
            layer = registry.manifest(name, "1")["layers"][0]["digest"]
            registry.blob_file(layer).unlink()
            ref, want = p.digest, "unknown"
    with httpx.Client(base_url=server.url, headers=H, timeout=WAIT_S) as c:
        before = c.get("/v1/status").json()
        r = c.post("/v1/trajectories", json={"id": tid, "image": ref})
        assert r.status_code == 502, r.text
        detail = r.json()["detail"]
        assert ref in detail and repr(host) in detail and want in detail.lower(), detail
        # nothing half-made: no trajectory, no container, no pull, no image, the id free
        assert c.get(f"/v1/trajectories/{tid}").status_code == 404
        after = c.get("/v1/status").json()
        assert after["totals"]["trajectories"] == before["totals"]["trajectories"]
        assert after["images"]["pulling"] == [], after["images"]
        assert after["images"]["counters"]["pull_failures"] == \
            before["images"]["counters"]["pull_failures"] + 1
        assert not present(ref)
        assert sandbox_containers(tid, owner_of(server)) == []
        assert c.post("/v1/trajectories", json={"id": tid}).status_code == 201
        assert c.delete(f"/v1/trajectories/{tid}").status_code == 200


def test_a_malformed_reference_is_refused_before_any_pull(server):
    with httpx.Client(base_url=server.url, headers=H, timeout=WAIT_S) as c:
        r = c.post("/v1/trajectories", json={"id": "bad-ref", "image": "127.0.0.1:1/UPPER:1"})
        assert r.status_code == 422 and "UPPER" in r.text, r.text
        assert c.get("/v1/trajectories/bad-ref").status_code == 404


def gone(c: httpx.Client, ref: str, what: str) -> None:
    """Wait until ``ref`` is not on the node; the failure shows the server's image status."""
    try:
        until_true(lambda: not present(ref), WAIT_S, what)
    except AssertionError as e:
        raise AssertionError(f"{e}; images: {images_status(c)}") from None


def test_the_cache_keeps_held_images_over_budget_and_evicts_the_least_recently_used(
        tmp_path: Path, registry, pushed):
    """Budget 20 MB, images of 8 MB. Four open trajectories hold A, B, C, D (32 MB): the
    cache stays over budget. Closing B's frees it: B is evicted. Closing A's, C's and D's
    in turn: A, the least recently used, is run by a container the server does not know
    of and is never removed; C, the next, is evicted, which brings the cache within its
    budget: D stays."""
    a, b, cc, d = (push(registry, pushed, f"cache-{x}", 8 * MB) for x in "abcd")
    refs = {"a": a.digest, "b": b.tag, "c": cc.digest, "d": d.digest}
    s = start_server(tmp_path / "state", "docker", extra_args=("--image-cache-gb", "0.02"))
    client = docker.from_env()
    outsider = None
    try:
        with httpx.Client(base_url=s.url, headers=H, timeout=WAIT_S) as c:
            for x, ref in refs.items():
                r = c.post("/v1/trajectories", json={"id": f"c-{x}", "image": ref})
                assert r.status_code == 201, r.text
            im = images_status(c)
            assert im["over_budget"] and im["counters"]["evictions"] == 0, im
            assert all(present(ref) for ref in refs.values())
            outsider = client.containers.create(refs["a"], command=["/bin/true"])

            assert c.delete("/v1/trajectories/c-b").status_code == 200
            gone(c, refs["b"], "B evicted once unheld")
            assert c.delete("/v1/trajectories/c-a").status_code == 200
            assert c.delete("/v1/trajectories/c-c").status_code == 200
            assert c.delete("/v1/trajectories/c-d").status_code == 200
            gone(c, refs["c"], "C evicted once unheld")
            im = until_true(lambda: (lambda s: s if s["counters"]["evictions"] == 2
                                     and not s["over_budget"] else None)(images_status(c)),
                            WAIT_S, "two evictions and the cache within its budget")
            assert present(refs["a"]), "an image a container runs was removed"
            assert present(refs["d"]), "the most recently used image was evicted"
            assert present(IMAGE)
            assert {i["image"] for i in im["cached"]} == {refs["a"], refs["d"]}, im
            text = c.get("/metrics").text
            assert metric(text, "tangram_image_evictions_total") == 2
            assert metric(text, "tangram_image_cache_budget_bytes") == 20 * MB
    finally:
        if outsider is not None:
            outsider.remove(force=True)
        s.stop()


def warm_of(c: httpx.Client, image: str) -> int:
    return images_status(c)["warm"].get(image, 0)


def test_a_warm_pool_is_kept_per_image_and_forks_of_a_pulled_image_take_it(
        tmp_path: Path, registry, pushed):
    """Issue 50 #3, #6: a burst of three openings of a pulled image W leaves three warm
    sandboxes of W for the next (its demand); the next openings of W take those very
    containers; a fork of one of them copies into warm sandboxes of W too, and the copies
    run in W."""
    w = push(registry, pushed, "warm", 1 * MB)
    s = start_server(tmp_path / "state", "docker")
    owner = owner_of(s)
    try:
        with httpx.Client(base_url=s.url, headers=H, timeout=WAIT_S) as c:
            for i in range(3):
                assert c.post("/v1/trajectories", json={"id": f"w{i}", "image": w.digest}
                              ).status_code == 201
            for i in range(3):
                res = c.post(f"/v1/trajectories/w{i}/actions", params={"wait": 120},
                             json={"id": f"w{i}-1", "command": "true"}).json()
                assert res["status"] == "ok", res
            until_true(lambda: warm_of(c, w.digest) >= 3, WAIT_S, "three warm sandboxes of W")
            client = docker.from_env()
            # a warm container's label names no trajectory (it is fixed at its creation)
            warm_ids = {ct.id for ct in client.containers.list(sparse=True, filters={
                "label": f"tangram.owner={owner}"})
                if not (ct.attrs.get("Labels") or {}).get("tangram.trajectory")
                and ct.attrs.get("ImageID") == client.images.get(w.digest).id}
            assert len(warm_ids) >= 3, warm_ids
            for i in range(3, 5):
                assert c.post("/v1/trajectories", json={"id": f"w{i}", "image": w.digest}
                              ).status_code == 201
                (box,) = until_true(lambda i=i: sandbox_containers(f"w{i}", owner),
                                    WAIT_S, f"w{i}'s container")
                assert box.id in warm_ids, (box.id, warm_ids)
            r = c.post("/v1/trajectories", json={"fork_of": "w3", "count": 2, "id": "wf"})
            assert r.status_code == 201, r.text
            for t in r.json()["ids"]:
                res = c.post(f"/v1/trajectories/{t}/actions", params={"wait": 120},
                             json={"id": f"{t}-1", "argv": ["sh", "-c", "wc -c < /data/blob"]}
                             ).json()
                assert res["status"] == "ok" and res["output"].strip() == str(w.size), res
                (box,) = sandbox_containers(t, owner)
                assert box.attrs["Config"]["Image"] == w.digest
            assert images_status(c)["counters"]["pulls"] == 1
    finally:
        s.stop()


def test_pull_image_pulls_ahead_once_within_the_bound(registry, pushed):
    """DockerBackend.pull_image and .pull (the core's PullImage): idempotent, in the background, as
    many at once as --image-pulls; a later open of the image is a hit."""
    from executor.backends.docker.backend import DockerBackend

    x, y = (push(registry, pushed, f"ahead-{n}", 8 * MB) for n in "xy")
    backend = DockerBackend(owner=unique("ahead").replace("/", "-"), image_pulls=1)
    try:
        # the core's effect (tangram.protocol.Pulling) is the same pull
        assert capabilities_of(backend).pulls
        backend.pull(PullImage("local", x.digest))
        for ref in (x.digest, y.tag, x.digest):
            backend.pull_image(ref)
        running: list[int] = []

        def both_pulled() -> bool:
            st = backend.image_status()
            running.append(sum(p["state"] == "pulling" for p in st["pulling"]))
            return st["counters"]["pulls"] == 2 and not st["pulling"]

        until_true(both_pulled, WAIT_S, "the two pulls ahead done")
        assert max(running) <= 1, running
        assert present(x.digest) and present(y.tag)
        backend.pull_image(x.digest)  # here already: nothing
        st = backend.image_status()
        assert st["counters"]["pulls"] == 2 and not st["pulling"], st
        done = backend.want_image("t-ahead", x.digest).result(timeout=WAIT_S)
        assert not done.pulled
        backend.unwant_image("t-ahead")
    finally:
        backend.shutdown()


def test_a_trajectory_expected_here_has_a_warm_sandbox_of_its_image(registry, pushed):
    """DockerBackend.expect_image (a node agent's, for a trajectory the core expects on
    this node while it waits for one): with its image pulled ahead, a warm sandbox of it
    and of its memory limit is kept (no opening here asked for the image), which its
    opening here takes; one expected and then closed here (it closed, or started on
    another node) is wanted no more: its image's warm target goes back to none."""
    from executor.backends.docker.backend import DockerBackend

    e, f = (push(registry, pushed, f"expect-{n}", MB) for n in "ef")
    backend = DockerBackend(owner=unique("expect").replace("/", "-"))
    try:
        for tid, image in (("t-e", e.digest), ("t-f", f.digest)):
            backend.expect_image(tid, image, 0.5)
            backend.pull(PullImage("local", image, tid))

        def warm() -> dict[str, int]:
            return backend.image_status()["warm"]

        until_true(lambda: warm().get(e.digest) == 1 and warm().get(f.digest) == 1, WAIT_S,
                   "a warm sandbox of each expected image")
        made = {c.id for c in docker.from_env().containers.list(
            all=True, filters={"ancestor": e.digest, "label": "tangram.executor"})}
        assert len(made) == 1
        # t-e opens here: it takes its warm sandbox (no container made for it)
        backend.want_image("t-e", e.digest).result(timeout=WAIT_S)
        backend.open_trajectory_image("t-e", 0.5, e.digest)
        until_true(lambda: {c.id for c in sandbox_containers("t-e")} == made, WAIT_S,
                   "t-e in the warm sandbox")
        # t-f goes elsewhere (or closes): its image is no longer a warm target here
        backend.close_trajectory("t-f")
        with backend._lock:
            assert f.digest not in backend.warm_targets()
        backend.close_trajectory("t-e")
    finally:
        backend.shutdown()


def test_a_registry_gone_mid_pull_refuses_the_open_after_the_engines_retries(
        server, tmp_path: Path):
    """The registry dies while a layer is half down (the status shows the pull's progress
    first): the engine retries for about a minute, then the open is refused (502, naming
    the registry and why) and nothing is left - no trajectory, container or image."""
    reg = Registry(tmp_path / "registry").start()
    p = None
    try:
        p = reg.build_and_push(unique("gone"), 300 * MB)

        async def main() -> httpx.Response:
            async with httpx.AsyncClient(base_url=server.url, headers=H,
                                         timeout=WAIT_S * 3) as c:
                opening = asyncio.ensure_future(c.post("/v1/trajectories", json={
                    "id": "gone", "image": p.digest}))
                deadline = asyncio.get_running_loop().time() + WAIT_S
                im: dict = {}
                while True:  # until the status shows part of the layer down
                    assert asyncio.get_running_loop().time() < deadline, \
                        f"no partial progress of the pull seen on /v1/status ({im})"
                    im = (await c.get("/v1/status")).json()["images"]
                    pulls = [x for x in im["pulling"] if x["image"] == p.digest]
                    if pulls and 0 < pulls[0]["downloaded_bytes"] < pulls[0]["total_bytes"]:
                        break
                    assert not opening.done(), (await opening).text
                    await asyncio.sleep(0.02)
                assert pulls[0]["state"] == "pulling" and pulls[0]["waiting"] == 1, pulls
                reg.proc.kill()
                return await opening

        r = asyncio.run(main())
        assert r.status_code == 502, r.text
        assert p.digest in r.text and repr(reg.host) in r.text and "refused" in r.text, r.text
        with httpx.Client(base_url=server.url, headers=H, timeout=WAIT_S) as c:
            assert c.get("/v1/trajectories/gone").status_code == 404
            assert c.get("/v1/status").json()["images"]["pulling"] == []
        assert not present(p.digest)
        assert sandbox_containers("gone", owner_of(server)) == []
    finally:
        reg.stop()
        if p is not None:
            remove_images([p.digest, p.tag])


def test_the_status_page_shows_pulls_and_the_cache_in_a_browser(server, registry, pushed):
    """The status page's Images section, in a real Chromium (tests/test_status_page.py's):
    the counters and the pulled image with its size, once an open pulled it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    from test_status_page import chrome

    p = push(registry, pushed, "page", 2 * MB)
    with httpx.Client(base_url=server.url, headers=H, timeout=WAIT_S) as c:
        r = c.post("/v1/trajectories", json={"id": "page", "image": p.digest})
        assert r.status_code == 201, r.text
        counters = images_status(c)["counters"]
    browser = chrome()
    try:
        wait = WebDriverWait(browser, WAIT_S, poll_frequency=0.1)
        browser.get(server.url + "/")
        wait.until(lambda b: b.find_element(By.ID, "token")).send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
        wait.until(lambda b: b.find_element(By.ID, "conn").text == "live")
        shown = wait.until(lambda b: b.execute_script(
            "const e = document.querySelector(arguments[0]);"
            "return e && e.offsetParent !== null ? e.innerText : null",
            f'#cached tr[data-image="{p.digest}"]'))
        assert p.digest in shown and "in use" in shown, shown
        said = browser.find_element(By.ID, "image-counters").text
        assert f"{counters['pulls']} pulls" in said and f"{counters['hits']} hits" in said, said
    finally:
        browser.quit()
        with httpx.Client(base_url=server.url, headers=H, timeout=WAIT_S) as c:
            c.delete("/v1/trajectories/page")


def test_an_image_an_opening_trajectory_waits_for_is_not_evicted(registry, pushed):
    """A budget below one image: A pulled for opening trajectory t1 (not opened yet), then
    B for t2: both held, nothing evicted (over budget). Once t1 gives up its open, A is
    evicted at once; B, still wanted, stays."""
    from executor.backends.docker.backend import DockerBackend

    a, b = (push(registry, pushed, f"opening-{n}", 4 * MB) for n in "ab")
    backend = DockerBackend(owner=unique("opening").replace("/", "-"), image_cache_gb=0.001)
    try:
        assert backend.want_image("t1", a.digest).result(timeout=WAIT_S).pulled
        assert backend.want_image("t2", b.digest).result(timeout=WAIT_S).pulled
        backend.images.make_room()  # (what each pull's end does: nothing may go)
        st = backend.image_status()
        assert st["over_budget"] and st["counters"]["evictions"] == 0, st
        assert present(a.digest) and present(b.digest)
        backend.unwant_image("t1")
        until_true(lambda: not present(a.digest), WAIT_S, "A evicted once nobody wants it")
        assert present(b.digest)
        backend.unwant_image("t2")
        until_true(lambda: not present(b.digest), WAIT_S, "B evicted once nobody wants it")
        assert present(IMAGE)
    finally:
        backend.shutdown()


def test_a_warm_sandbox_dropped_over_budget_lets_its_image_go(registry, pushed):
    """Budget 20 MB. A (8 MB) is pulled and fits; the warm pool starts a sandbox of A.
    While it is being made, B and C (8 MB each) are pulled for two opening trajectories:
    their pulls' make_room must keep A (the sandbox being made holds it) and leaves the
    cache over budget. The refill then finds A's sandbox spare (no warm pool while over
    budget) and drops it: A, held by nothing now, is evicted without any other event."""
    from executor.backends.docker.backend import DockerBackend

    a, b, cc = (push(registry, pushed, f"warmdrop-{n}", 8 * MB) for n in "abc")
    backend = DockerBackend(owner=unique("warmdrop").replace("/", "-"), image_cache_gb=0.02)
    made = []
    create = backend._create

    def create_then_pull_more(trajectory, image, mem):
        box = create(trajectory, image, mem)
        if trajectory == "" and image == a.digest and not made:
            made.append(box)  # the race, made certain: pulls end while A's sandbox is made
            assert backend.want_image("t-b", b.digest).result(timeout=WAIT_S).pulled
            assert backend.want_image("t-c", cc.digest).result(timeout=WAIT_S).pulled
        return box

    backend._create = create_then_pull_more
    try:
        assert backend.want_image("t-a", a.digest).result(timeout=WAIT_S).pulled
        backend.unwant_image("t-a")  # A unheld, within the budget: it stays
        with backend._lock:
            backend._burst_images[a.digest] = 1  # the latest burst asked for A
        backend._refill_soon()
        until_true(lambda: made, WAIT_S, "a warm sandbox of A made")
        until_true(lambda: not present(a.digest), WAIT_S,
                   "A evicted once its spare warm sandbox was dropped")
        st = backend.image_status()
        assert present(b.digest) and present(cc.digest), st
        assert st["warm"].get(a.digest, 0) == 0 and not st["over_budget"], st
    finally:
        backend.unwant_image("t-b")
        backend.unwant_image("t-c")
        backend.shutdown()


def test_an_image_whose_container_is_being_removed_is_evicted_before_a_newer_one(
        registry, pushed):
    """Budget 20 MB; A, B, C (8 MB each) run by three open trajectories, opened and closed
    in that order (A the least recently used). A's container is slow to go (its removal
    held here); B's goes at once. The make_room after B's removal must not pass over A
    (the engine refuses it while its container exists) to evict B: A goes once its
    container has, and B stays."""
    import threading

    from executor.backends.docker.backend import DockerBackend

    a, b, cc = (push(registry, pushed, f"leaving-{n}", 8 * MB) for n in "abc")
    owner = unique("leaving").replace("/", "-")
    backend = DockerBackend(owner=owner, image_cache_gb=0.02)
    held_a = threading.Event()
    remove = backend._remove
    try:
        for t, p in (("t-a", a), ("t-b", b), ("t-c", cc)):
            assert backend.want_image(t, p.digest).result(timeout=WAIT_S).pulled
            backend.open_trajectory_image(t, None, p.digest)
            until_true(lambda t=t: sandbox_containers(t, owner), WAIT_S, f"{t}'s container")
        (box_a,) = sandbox_containers("t-a", owner)

        def slow_for_a(cid: str) -> None:
            if cid == box_a.id:
                held_a.wait(WAIT_S)
            remove(cid)

        backend._remove = slow_for_a
        backend.close_trajectory("t-a")
        backend.close_trajectory("t-b")
        until_true(lambda: not sandbox_containers("t-b", owner), WAIT_S, "B's container gone")
        backend.images.make_room()  # (what B's removal asks for: here, once it is done)
        assert present(a.digest) and present(b.digest), backend.image_status()
        held_a.set()
        until_true(lambda: not present(a.digest), WAIT_S, "A evicted once its container went")
        st = backend.image_status()
        assert present(b.digest) and present(cc.digest), st
        assert not st["over_budget"] and st["counters"]["evictions"] == 1, st
    finally:
        held_a.set()
        backend.close_trajectory("t-c")
        backend.shutdown()


def test_over_budget_the_warm_sandboxes_of_an_unused_image_go_and_then_the_image(
        tmp_path: Path, registry, pushed):
    """Budget 20 MB. Three trajectories of W (8 MB) leave three warm sandboxes of W; once
    they close, only those hold W. Pulling X and Y (8 MB each) puts the cache over budget:
    the warm sandboxes of W are removed and W, the least recently used, is evicted."""
    w, x, y = (push(registry, pushed, f"release-{n}", 8 * MB) for n in "wxy")
    s = start_server(tmp_path / "state", "docker", extra_args=("--image-cache-gb", "0.02"))
    try:
        with httpx.Client(base_url=s.url, headers=H, timeout=WAIT_S) as c:
            for i in range(3):
                assert c.post("/v1/trajectories", json={"id": f"r{i}", "image": w.digest}
                              ).status_code == 201
            for i in range(3):
                res = c.post(f"/v1/trajectories/r{i}/actions", params={"wait": 120},
                             json={"id": f"r{i}-1", "command": "true"}).json()
                assert res["status"] == "ok", res
            until_true(lambda: warm_of(c, w.digest) >= 3, WAIT_S, "three warm sandboxes of W")
            for i in range(3):
                assert c.delete(f"/v1/trajectories/r{i}").status_code == 200
            for n, ref in (("x", x.digest), ("y", y.digest)):
                assert c.post("/v1/trajectories", json={"id": f"r-{n}", "image": ref}
                              ).status_code == 201
            gone(c, w.digest, "W evicted once its warm sandboxes were dropped")
            im = images_status(c)
            assert im["warm"].get(w.digest, 0) == 0 and present(x.digest) and present(y.digest)
            assert not im["over_budget"], im
    finally:
        s.stop()
