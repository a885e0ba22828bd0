"""Images on a Ray cluster: a real `tangram serve --ray local:2 --backend docker` (two
simulated nodes on this machine, each with a node agent over its own docker backend) and a
real registry on 127.0.0.1 (tests/registry.py); images built here, pushed, and removed from
the engine before the test pulls them. No mocks.

* a trajectory naming an image opens on the node the core placed it on (the open's answer,
  its actions' node, the trajectory's view agree), and that node's agent pulled the image
  (its own cache's counters, under /v1/status ``images.nodes``); the other node pulled
  nothing;
* a second trajectory of the same image opens where it is held: a hit, no second pull;
* a pull that fails refuses the open (502 naming the image, its registry, the node and the
  reason) and leaves nothing: no trajectory, no container, the id free again;
* a policy that does not place by image leaves the pull to the first action's node; a
  trajectory whose node is lost runs its next action in its image again;
* a trajectory no node has room for yet has its image pulled ahead on the node it is
  expected on: its first action, bound there once a trajectory there closes, pulls
  nothing.

The two nodes share this machine's one Docker engine, so an image one node pulled is in the
engine for the other too: what tells the nodes apart is each agent's own cache (what it
pulled, its hits), as on a real cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator

import docker
import httpx
import pytest
from conftest import TOKEN, sandbox_containers, start_server
from helpers import until, until_true
from registry import Pushed, remove_images, unique

from executor.backends.gpu.config import load_gpu_cluster
from executor.backends.gpu.ray_worker import GPU_MEM_LABEL, GPUS_LABEL, attach_gpus
from executor.backends.ray.backend import RayBackend
from executor.backends.ray.cluster import CPUS_LABEL, OBJECT_STORE_BYTES
from executor.driver import LiveExecutor
from tangram.core import Tangram
from tangram.model import Action, Demand

H = {"Authorization": f"Bearer {TOKEN}"}
MB = 1_000_000
#: a hang guard per step on a loaded 2-core machine, not a bound
WAIT_S = 180.0
#: the GPU service of the test with GPU workers (a random-weight model on the cpu device)
TINY = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def images(registry) -> Iterator[list[Pushed]]:
    """Two small images in the registry, not in the engine."""
    made = [registry.build_and_push(unique(f"ray-{n}"), MB) for n in ("a", "b")]
    yield made
    remove_images([ref for p in made for ref in (p.tag, p.digest)])


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator:
    s = start_server(tmp_path_factory.mktemp("serve-ray-images"), "docker",
                     extra_args=("--ray", "local:2", "--image-pulls", "1"))
    yield s
    s.stop()


def node_images(c: httpx.Client) -> dict[str, dict]:
    """Each node's image status (its agent's docker cache), by node name."""
    return c.get("/v1/status").json()["images"]["nodes"]


def node_counter(c: httpx.Client, node: str, key: str) -> float:
    return node_images(c).get(node, {}).get("counters", {}).get(key, 0)


def run(c: httpx.Client, tid: str, aid: str, command: str) -> dict:
    r = c.post(f"/v1/trajectories/{tid}/actions", params={"wait": WAIT_S},
               json={"id": aid, "argv": ["sh", "-c", command]})
    assert r.status_code in (200, 202), r.text
    return r.json()


def test_an_image_opens_on_the_node_the_core_chose_and_the_next_hits_there(server, images):
    a, b = images
    with httpx.Client(base_url=server.url, headers=H, timeout=WAIT_S) as c:
        nodes = until_true(lambda: node_images(c) if len(node_images(c)) == 2 else None,
                           WAIT_S, "both nodes' image status")
        assert all(s["counters"].get("pulls", 0) == 0 for s in nodes.values()), nodes

        r = c.post("/v1/trajectories", json={"id": "a1", "image": a.digest})
        assert r.status_code == 201, r.text
        opened = r.json()["image"]
        home = opened["node"]
        assert home in nodes and opened["image"] == a.digest and opened["pulled"], opened
        # that node's agent pulled it; the other node pulled nothing
        until_true(lambda: node_counter(c, home, "pulls") == 1, WAIT_S, f"a pull on {home}")
        other = next(n for n in nodes if n != home)
        assert node_counter(c, other, "pulls") == 0
        assert any(i["image"] == a.digest for i in node_images(c)[home]["cached"])

        # its commands run there, in its image
        res = run(c, "a1", "a1-wc", "wc -c < /data/blob")
        assert res["status"] == "ok" and res["output"].strip() == str(a.size), res
        assert res["node"] == home, res
        assert c.get("/v1/trajectories/a1").json()["node"] == home

        # a second trajectory of the image opens where it is held: a hit, no pull
        hits = node_counter(c, home, "hits")
        r = c.post("/v1/trajectories", json={"id": "a2", "image": a.digest})
        assert r.status_code == 201, r.text
        assert r.json()["image"] == {"image": a.digest, "pulled": False, "node": home}
        until_true(lambda: node_counter(c, home, "hits") == hits + 1, WAIT_S, "the hit")
        assert node_counter(c, home, "pulls") == 1 and node_counter(c, other, "pulls") == 0
        res = run(c, "a2", "a2-wc", "wc -c < /data/blob")
        assert res["status"] == "ok" and res["node"] == home, res

        # another image is pulled on the node the core chose for it, once
        r = c.post("/v1/trajectories", json={"id": "b1", "image": b.tag})
        assert r.status_code == 201, r.text
        b_home = r.json()["image"]["node"]
        assert r.json()["image"]["pulled"] and b_home in nodes, r.json()
        res = run(c, "b1", "b1-wc", "wc -c < /data/blob")
        assert res["status"] == "ok" and res["node"] == b_home, res
        until_true(lambda: sum(s["counters"].get("pulls", 0)
                               for s in node_images(c).values()) == 2, WAIT_S, "two pulls")
        # /metrics: a series per node (labelled), each node's own pulls
        metrics = c.get("/metrics").text
        pulls = {m[0]: float(m[1]) for m in re.findall(
            r'^tangram_image_pulls_total\{node="([^"]+)"\} (\S+)$', metrics, re.M)}
        assert set(pulls) == set(nodes) and sum(pulls.values()) == 2, metrics[-3000:]
        assert pulls[home] >= 1 and pulls[b_home] >= 1, pulls
        # the core ordered the pulls ahead (PullImage, carried to the nodes' agents) and
        # learnt the pull rate from the first actions' outcomes, as on one machine
        assert float(re.search(r'^tangram_effects_total\{effect="PullImage"\} (\S+)$',
                               metrics, re.M)[1]) == 2, metrics[-3000:]
        assert float(re.search(r"^tangram_core_image_pulls_observed (\S+)$", metrics,
                               re.M)[1]) >= 1, metrics[-3000:]

        for tid in ("a1", "a2", "b1"):
            assert c.delete(f"/v1/trajectories/{tid}").status_code == 200
        until_true(lambda: not any(sandbox_containers(t) for t in ("a1", "a2", "b1")),
                   WAIT_S, "the closed trajectories' containers gone")


def test_a_failed_pull_refuses_the_open_and_leaves_nothing(server, registry, images):
    missing = f"{registry.host}/{unique('ray-missing')}:1"
    with httpx.Client(base_url=server.url, headers=H, timeout=WAIT_S) as c:
        r = c.post("/v1/trajectories", json={"id": "bad", "image": missing})
        assert r.status_code == 502, r.text
        text = r.json()["detail"] if "detail" in r.json() else r.text
        assert missing in str(text) and f"registry '{registry.host}'" in str(text), text
        assert re.search(r"to node '[^']+'", str(text)), text
        assert "manifest unknown" in str(text) or "not found" in str(text), text
        assert c.get("/v1/trajectories/bad").status_code == 404
        assert not sandbox_containers("bad")
        # the id is free again, and a good image opens under it
        r = c.post("/v1/trajectories", json={"id": "bad", "image": images[0].digest})
        assert r.status_code == 201, r.text
        assert c.delete("/v1/trajectories/bad").status_code == 200


def test_a_policy_that_places_at_binding_pulls_at_the_first_action(tmp_path, registry, images):
    """A policy that does not place trajectories by image (the ablation
    ``tangram-images-on-demand``, like a Kubernetes pod) leaves the node to the first action:
    the open answers at once (no node yet), the first action's node pulls the image as its
    sandbox starts and runs it there; a pull that fails there fails that action (naming the
    node), and the next action tries again rather than run in the default image."""
    c_image = registry.build_and_push(unique("ray-c"), MB)  # not in the engine yet
    images.append(c_image)  # (removed at the module's end)
    s = start_server(tmp_path / "state", "docker",
                     extra_args=("--ray", "local:2", "--policy", "tangram-images-on-demand"))
    missing = f"{registry.host}/{unique('ray-lazy-missing')}:1"
    try:
        with httpx.Client(base_url=s.url, headers=H, timeout=WAIT_S) as c:
            r = c.post("/v1/trajectories", json={"id": "lazy", "image": c_image.digest})
            assert r.status_code == 201, r.text
            assert r.json()["image"] == {"image": c_image.digest, "node": None}, r.json()
            res = run(c, "lazy", "lazy-wc", "wc -c < /data/blob")
            assert res["status"] == "ok" and res["output"].strip() == str(c_image.size), res
            home = res["node"]
            until_true(lambda: node_counter(c, home, "pulls") == 1, WAIT_S,
                       f"the first action's pull on {home}")

            r = c.post("/v1/trajectories", json={"id": "lazy-bad", "image": missing})
            assert r.status_code == 201, r.text
            for i in range(2):
                res = run(c, "lazy-bad", f"lazy-bad-{i}", "cat /data/blob")
                assert res["status"] == "failed", res
                assert missing in res["error"] and "to node '" in res["error"], res
            assert not sandbox_containers("lazy-bad")
            for tid in ("lazy", "lazy-bad"):
                assert c.delete(f"/v1/trajectories/{tid}").status_code == 200
    finally:
        s.stop()


def test_a_trajectory_whose_node_is_lost_opens_its_image_again_on_its_next(ray_cluster,
                                                                          images):
    """In process, on the session's 3-node cluster with docker agents: a trajectory opened
    with its image on the core's node, whose agent then dies, runs its next action in its
    image again (pulled or found where it is re-bound), told ``state_lost``: never in the
    default image."""
    a = images[0]

    def wc(aid: str) -> Action:
        return Action(aid, "t", "lost", "shell", {"cpu": Demand.fixed(1)},
                      payload={"command": "sh -c 'wc -c < /data/blob'"})

    async def go() -> None:
        backend = RayBackend(ray_cluster, "docker", poll_s=0.2)
        ex = LiveExecutor(Tangram(backend.cluster()), backend)
        try:
            node, _ = await ex.open_trajectory_placed("lost", "t", 0.5, a.digest)
            assert node in backend.agents
            rec, out = await ex.run(wc("lost-0"))
            assert (out.status, out.output.strip(), rec.node) == ("ok", str(a.size), node), out
            backend.ray.kill(backend.agents[node].handle, no_restart=True)
            await until(lambda: node not in backend.agents, WAIT_S, "its node lost")
            rec, out = await ex.run(wc("lost-1"))
            assert out.status == "ok" and out.output.strip() == str(a.size), out
            assert out.extra.get("state_lost"), out
        finally:
            with contextlib.suppress(KeyError, ValueError):
                ex.close_trajectory("lost")
            ex.shutdown()

    asyncio.run(go())


def test_a_trajectory_waiting_for_a_node_has_its_image_pulled_ahead(ray_cluster, registry,
                                                                   images):
    """In process, on the session's 3-node cluster with docker agents: every node's memory
    held by a trajectory, a trajectory naming an image (in no node's cache) opens without
    a node, and the core orders its image pulled ahead on the node it expects it on, whose
    agent pulls it and keeps a warm sandbox of it for it (the latest burst there had none
    of the image) while its first action waits for memory; once the trajectory on that
    node closes, the first action binds there, finds its image (no pull on its time: no
    ``pull_s`` in its outcome, and no second pull anywhere) and runs in that sandbox."""
    d = registry.build_and_push(unique("ray-ahead"), MB)  # not in the engine yet
    images.append(d)  # (removed at the module's end)

    def action(tid: str, aid: str, command: str) -> Action:
        return Action(aid, "t", tid, "shell", {"cpu": Demand.fixed(1)},
                      payload={"command": command})

    async def go() -> None:
        backend = RayBackend(ray_cluster, "docker", poll_s=0.2)
        ex = LiveExecutor(Tangram(backend.cluster()), backend)
        fillers = [f"full-{i}" for i in range(len(ex.core.snapshot().cpu_nodes))]
        opened: list[str] = []
        try:
            for tid, node in zip(fillers, ex.core.snapshot().cpu_nodes, strict=True):
                ex.open_trajectory(tid, "t", node.mem_gb)  # its node's whole memory
                opened.append(tid)
            await asyncio.gather(*(ex.run(action(t, f"{t}-0", "true")) for t in fillers))
            assert len({ex.core.node_of(t) for t in fillers}) == len(fillers)

            node, _ = await ex.open_trajectory_placed("wait", "t", 0.5, d.digest)
            opened.append("wait")
            assert node is None  # no node has room for it: not placed, no sandbox made

            def pulled() -> str | None:  # the node that pulled it, once its pull ended
                nodes = backend.image_status()["nodes"]
                done = [n for n, s in nodes.items() if s["counters"].get("pulls", 0)]
                return done[0] if len(done) == 1 and not any(
                    s.get("pulling") for s in nodes.values()) else None

            await until(pulled, WAIT_S, "the pull ahead", backend.image_status)
            home = pulled()
            await until(lambda: backend.image_status()["nodes"][home]["warm"].get(d.digest),
                        WAIT_S, "its warm sandbox", backend.image_status)
            warm = {c.id for c in docker.from_env().containers.list(
                all=True, filters={"ancestor": d.digest, "label": "tangram.executor"})}
            assert len(warm) == 1, warm
            run = asyncio.ensure_future(ex.run(action("wait", "wait-0",
                                                      "sh -c 'wc -c < /data/blob'")))
            await until(lambda: ex.core.why_queued("wait-0"), WAIT_S, "its action queued")
            assert ex.core.why_queued("wait-0").startswith("waiting for a node")
            there = next(t for t in fillers if ex.core.node_of(t) == home)
            ex.close_trajectory(there)
            opened.remove(there)
            rec, out = await run
            assert (out.status, out.output.strip(), rec.node) == ("ok", str(d.size), home), out
            assert "pull_s" not in out.extra, out.extra
            assert {c.id for c in sandbox_containers("wait")} == warm
            # (the nodes' statuses are read every 2 s): its open there was a hit
            await until(lambda: backend.image_status()["nodes"][home]["counters"].get(
                "hits", 0) >= 1, WAIT_S, "its hit", backend.image_status)
            assert backend.image_status()["counters"].get("pulls") == 1
        finally:
            for tid in opened:
                with contextlib.suppress(KeyError, ValueError):
                    ex.close_trajectory(tid)
            ex.shutdown()

    asyncio.run(go())


def test_with_gpu_workers_attached_images_open_on_the_cpu_nodes(ray_cluster, images):
    """`serve --ray ... --gpu-cluster` (the Ray backend with GPU workers attached) passes
    images on to the CPU nodes' agents: an open is placed and pulled on a CPU node, and
    its action runs there in its image (a GPU-labelled node of its own, cpu device)."""
    gpu_node = ray_cluster.cluster.add_node(
        num_cpus=0, object_store_memory=OBJECT_STORE_BYTES,
        labels={CPUS_LABEL: "none", GPUS_LABEL: "1", GPU_MEM_LABEL: "1"})
    ray_cluster.cluster.wait_for_nodes()
    gpu = load_gpu_cluster({"gpu_nodes": [{"gpus": 1, "gpu_mem_gb": 1}],
                            "services": [{"name": "small", "model": {"init": "random",
                                                                     "config": TINY}}]},
                           "cpu")
    b = images[1]

    async def go() -> None:
        live = attach_gpus(RayBackend(ray_cluster, "docker"), gpu, "cpu")
        try:
            live.gpu.wait_ready(120)
            ex = LiveExecutor(Tangram(live.cluster()), live)
            node, _ = await ex.open_trajectory_placed("g", "t", 0.5, b.digest)
            cpu_nodes = {n.name for n in ex.core.snapshot().cpu_nodes}
            assert node in cpu_nodes, (node, cpu_nodes)
            rec, out = await ex.run(Action("g-0", "t", "g", "shell", {"cpu": Demand.fixed(1)},
                                           payload={"command": "sh -c 'wc -c < /data/blob'"}))
            assert (out.status, out.output.strip(), rec.node) == ("ok", str(b.size), node), out
            ex.close_trajectory("g")
        finally:
            live.shutdown()

    try:
        asyncio.run(go())
    finally:
        ray_cluster.cluster.remove_node(gpu_node, allow_graceful=False)
