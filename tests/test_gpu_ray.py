"""GPU workers on Ray nodes (executor/backends/gpu/ray_worker.py), on a real local Ray cluster.

The cpu device stands in for GPUs; a node declares its GPUs by label. Checked: GPU
actions (a batch as one command) through a Ray node's worker actor with the residency
checks, the actor killed mid-batch (every member fails ``node_lost``, the core forgets
the node's residency, its GPUs leave and come back with a fresh actor), and `tangram run
--ray local:2 --gpu-device cpu` on a slice of the MOPD sample.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import yaml
from conftest import TOKEN, start_server
from helpers import free_gpus, gpu_node, until

from executor.backends.gpu.config import load_gpu_cluster
from executor.backends.gpu.model import random_size_bytes
from executor.backends.gpu.ray_worker import GPU_MEM_LABEL, GPUS_LABEL, NODE_LOST, attach_gpus
from executor.backends.ray.backend import RayBackend
from executor.backends.ray.cluster import CPUS_LABEL, OBJECT_STORE_BYTES
from executor.driver import LiveExecutor
from tangram.core import Tangram
from tangram.model import Action, Demand
from tangram.protocol import NodeJoined, NodeLost

ROOT = Path(__file__).parent.parent
TINY = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2}
#: slow enough (about a second per request on 2 cores) to be killed mid-batch
BIG = {"vocab_size": 2048, "hidden_size": 512, "num_hidden_layers": 8,
       "num_attention_heads": 8}


def gpu_action(aid: str, traj: str, service: str, tokens: list[list[int]]) -> Action:
    return Action(aid, "mopd", traj, "teacher_logprob", {"gpu": Demand.fixed(1)},
                  service=service, t1_s=0.01, payload={"op": "logprobs", "tokens": tokens})


def test_gpu_actions_on_a_ray_node_and_its_worker_actor_killed_mid_batch(ray_cluster) -> None:
    # one more node of the session's local cluster: no cores for CPU actions, one GPU
    # declared by label, room for both services on it
    mem = 3 * random_size_bytes(BIG, 4) / 1e9
    node = ray_cluster.cluster.add_node(
        num_cpus=0, object_store_memory=OBJECT_STORE_BYTES,
        labels={CPUS_LABEL: "none", GPUS_LABEL: "1", GPU_MEM_LABEL: repr(mem)})
    ray_cluster.cluster.wait_for_nodes()
    gpu = load_gpu_cluster({"gpu_nodes": [{"gpus": 1, "gpu_mem_gb": mem}],
                            "services": [{"name": "small", "model": {"init": "random",
                                                                     "config": TINY}},
                                         {"name": "big", "model": {"init": "random",
                                                                   "config": BIG}}]}, "cpu")

    async def go() -> None:
        live = attach_gpus(RayBackend(ray_cluster), gpu, "cpu")
        backend = live.gpu
        try:
            (name,) = backend.ray_nodes  # only the labelled node has GPUs
            assert backend.ray_nodes[name].ray_node_id == node.node_id
            backend.wait_ready(120)
            core = Tangram(live.cluster())
            ex = LiveExecutor(core, live)
            told: list = []  # what the GPU backend tells the core about its nodes
            into_core = backend._sink
            assert into_core is not None
            backend._sink = lambda c: (told.append(c), into_core(c))[1]
            for t in ("t", "u0", "u1", "u2"):
                ex.open_trajectory(t)
            rec, out = await ex.run(gpu_action("s1", "t", "small", [[1, 2, 3, 4]]))
            assert out.ok and out.extra["node"] == name and out.extra["restored"], out.error
            assert rec.node == name
            assert await backend.worker_resident(name) == frozenset(gpu_node(core, name).resident)
            # a batch behind a blocker: one command for its three members, then killed
            rows = np.random.default_rng(0).integers(0, 2048, size=(16, 96)).tolist()
            blocker = ex.submit(gpu_action("blk", "t", "big", [[1, 2, 3]]))
            members = [ex.submit(gpu_action(f"m{i}", f"u{i}", "big", rows)) for i in range(3)]
            await blocker
            await until(lambda: backend.computing("m0"), 120, "the batch to compute")
            assert {f.command is backend.workers[name].inflight["m0"].command
                    for f in backend.workers[name].inflight.values()} == {True}
            import ray

            ray.kill(backend.worker_actor(name), no_restart=True)
            outs = [o for _, o in await asyncio.gather(*members)]
            assert [o.status for o in outs] == ["failed"] * 3
            assert all(o.extra["reason"] == NODE_LOST and NODE_LOST in o.error for o in outs)
            # the core was told the node left (its GPU out of the pool, its residency
            # forgotten), then that it is back with a fresh actor (nothing resident)
            await until(lambda: len(told) == 2, 120, "the node to come back")
            assert told[0] == NodeLost(name)
            assert told[1] == NodeJoined(backend.ray_nodes[name].spec)
            assert not gpu_node(core, name).down and free_gpus(core) == 1
            assert backend.crashes == 1
            # (the core may pre-restore onto the idle GPU at once: the fresh worker follows)
            rec, out = await ex.run(gpu_action("s2", "t", "small", [[5, 6, 7]]))
            assert out.ok, out.error
            assert await backend.worker_resident(name) == frozenset(gpu_node(core, name).resident)
            assert backend.mismatches == 0
        finally:
            live.shutdown()

    try:
        asyncio.run(go())
    finally:
        ray_cluster.cluster.remove_node(node, allow_graceful=False)


def test_run_replays_gpu_rows_on_a_local_ray_cluster(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, str(ROOT / "cli.py"), "run", "--trace",
                          str(ROOT / "traces/samples/mopd.parquet"), "--gpu-device", "cpu",
                          "--limit", "10", "--think-scale", "0", "--ray", "local:2",
                          "--out", str(out), "-q"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["actions"] == 10 and summary["failed"] == 0
    assert summary["gpu"]["residency_mismatches"] == 0
    frame = pd.read_parquet(out / "actions.parquet")
    assert (frame["status"] == "ok").all()
    # the GPU nodes are the two Ray nodes (each declared by label), one scheduler for both
    spec = json.loads((out / "config.json").read_text())["cluster"]
    gpu_nodes = {n["name"] for n in spec["gpu_nodes"]}
    assert len(gpu_nodes) == 2 and gpu_nodes == {n["name"] for n in spec["cpu_nodes"]}
    assert set(frame["node"]) <= gpu_nodes


def test_serve_on_a_local_ray_cluster_runs_gpu_actions_on_its_gpu_nodes(tmp_path: Path) -> None:
    """A GPU action sent to a `serve --ray` server runs on a Ray node's GPU worker (before
    issue 19: 422 "unknown service")."""
    spec = tmp_path / "gpu.yaml"
    mem = 3 * random_size_bytes(TINY, 4) / 1e9
    spec.write_text(yaml.safe_dump({
        "gpu_nodes": [{"count": 1, "prefix": "g", "gpus": 2, "gpu_mem_gb": mem}],
        "services": [{"name": "teacher", "model": {"init": "random", "config": TINY}}]}))
    server = start_server(tmp_path / "st", extra_args=(
        "--ray", "local:2", "--gpu-cluster", str(spec), "--gpu-device", "cpu"))
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=60) as c:
            tid = c.post("/v1/trajectories", json={"task": "mopd"}).json()["id"]
            r = c.post(f"/v1/trajectories/{tid}/actions", json={
                "id": "g0", "kind": "teacher", "service": "teacher", "gpus": "1",
                "inputs": {"op": "logprobs", "tokens": [[5, 6, 7]]}})
            assert r.status_code == 202, r.text
            result = c.get("/v1/actions/g0", params={"wait": 60}).json()
            assert result["status"] == "ok", result
            assert len(json.loads(result["output"])["logprobs"][0]) == 2
            gpus = c.get("/v1/gpus").json()
            # both local nodes declared 2 GPUs by label: one GPU worker actor on each
            assert len(gpus["nodes"]) == 2 and result["node"] in gpus["nodes"]
            assert gpus["services"]["teacher"]["restores"] == 1
    finally:
        server.stop()
