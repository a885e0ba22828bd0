"""GPU workers on the cpu device: real worker processes, real copies, real forward passes.

The core's GpuManager decides; the worker executes. After every step the worker's
resident set (asked of the worker process itself) must equal the core's model.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from conftest import ROOT, TOKEN, free_port
from helpers import counts, gpu_node

from executor.backends.gpu.arrays import NumpyOps
from executor.backends.gpu.backend import GpuBackend
from executor.backends.gpu.config import load_gpu_cluster, read_gpu_cluster
from executor.backends.gpu.model import ModelError, ModelSource, TinyLM, load_model, random_size_bytes
from executor.driver import LiveExecutor
from tangram.cluster import ClusterError, ClusterSpec, GpuNodeSpec, ServiceSpec
from tangram.core import Tangram
from tangram.gpu.batching import MeasuredGpu
from tangram.model import Action, Demand
from tangram.policies import REGISTRY

TINY = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2}
TINY_GB = random_size_bytes(TINY, 4) / 1e9
#: slow enough (about a second per request on 2 cores) to be killed mid-action
BIG = {"vocab_size": 2048, "hidden_size": 512, "num_hidden_layers": 8,
       "num_attention_heads": 8}


def cluster(services: dict[str, dict], gpus: int = 8, fit: float = 2.5,
            restore_gbps: float = 20.0) -> ClusterSpec:
    """One GPU node whose GPUs each hold ``fit`` copies of the largest service."""
    sizes = {n: random_size_bytes(c, 4) / 1e9 for n, c in services.items()}
    return ClusterSpec(gpu_nodes=(GpuNodeSpec("g0", gpus, max(sizes.values()) * fit),),
                       services=tuple(ServiceSpec(n, s) for n, s in sizes.items()),
                       restore_gbps=restore_gbps)


class Rig:
    """Core + GPU backend + live executor on the running loop."""

    def __init__(self, services: dict[str, dict], **kw: Any) -> None:
        spec = cluster(services, **kw)
        self.core = Tangram(spec)
        sources = {n: ModelSource.random(c, seed=i) for i, (n, c) in enumerate(services.items())}
        self.backend = GpuBackend(spec, sources, "cpu")
        self.backend.start_workers()
        self.backend.wait_ready(60)
        self.ex = LiveExecutor(self.core, self.backend)
        self.ex.open_trajectory("t")
        self.n = 0

    def action(self, service: str, k: int = 1, tokens: list[list[int]] | None = None,
               op: str = "logprobs") -> Action:
        self.n += 1
        return Action(f"a{self.n}", "mopd", "t", "teacher_logprob", {"gpu": Demand.fixed(k)},
                      service=service, payload={"op": op, "tokens": tokens or [[1, 2, 3, 4, 5]]})

    async def run(self, service: str, k: int = 1, **kw: Any):
        rec, out = await self.ex.run(self.action(service, k, **kw))
        return out

    async def check(self) -> frozenset:
        """The worker holds exactly what the core says is resident."""
        core_set = frozenset(gpu_node(self.core, "g0").resident)
        worker_set = await self.backend.worker_resident("g0")
        assert worker_set == core_set
        assert self.backend.mismatches == 0
        return worker_set

    def close(self) -> None:
        self.ex.shutdown()


def on_loop(services: dict[str, dict], body: Callable[[Rig], Coroutine], **kw: Any) -> None:
    async def go() -> None:
        rig = Rig(services, **kw)
        try:
            await body(rig)
        finally:
            rig.close()

    asyncio.run(go())


def test_residency_equals_the_core_after_a_sequence() -> None:
    services = {s: TINY for s in ("a", "b", "c", "d", "e")}
    rng = np.random.default_rng(7)

    async def body(rig: Rig) -> None:
        restores = 0
        for _ in range(12):
            batch = [rig.action(str(rng.choice(list(services))), int(rng.choice([1, 2, 4])))
                     for _ in range(int(rng.integers(1, 4)))]
            results = await asyncio.gather(*(rig.ex.run(a) for a in batch))
            for _, out in results:
                assert out.ok, out.error
                restores += out.extra["restored"]
            await rig.check()
        counters = counts(rig.core).counters
        assert restores == counters["gpu_restores"]  # every restore the core decided happened
        assert counters["gpu_restore_hits"] > 0  # and some actions reused a resident variant

    on_loop(services, body)


def test_restore_copies_the_staged_bytes_and_a_layer_split_computes_the_same() -> None:
    async def body(rig: Rig) -> None:
        one = await rig.run("a", 1, tokens=[[3, 1, 4, 1, 5, 9, 2, 6]])
        two = await rig.run("a", 2, tokens=[[3, 1, 4, 1, 5, 9, 2, 6]])
        assert one.ok and two.ok and two.extra["restored"]
        resident = await rig.check()
        (variant,) = [v for v in resident if v[1] == 2]
        report = await rig.backend.verify("g0", variant)
        assert report["equal"] and not report["shares_host_memory"]
        assert report["bytes"] == report["host_bytes"] == random_size_bytes(TINY, 4)
        assert all(b > 0 for b in report["bytes_per_gpu"]) and len(report["bytes_per_gpu"]) == 2
        a = np.array(json.loads(one.output)["logprobs"])
        b = np.array(json.loads(two.output)["logprobs"])
        assert a.shape == (1, 7) and np.allclose(a, b, atol=1e-5)
        assert (a < 0).all()  # log-probabilities

    on_loop({"a": TINY}, body)


def test_lru_eviction_order() -> None:
    async def body(rig: Rig) -> None:
        for s in ("a", "b", "a"):  # a is now the most recently used
            assert (await rig.run(s)).ok
        assert gpu_node(rig.core, "g0").resident == (("b", 1, 0), ("a", 1, 0))
        out = await rig.run("c")  # room for two: the least recently used (b) goes
        assert out.extra["restored"] and out.extra["evicted"] == [["b", 1, 0]]
        assert await rig.check() == {("a", 1, 0), ("c", 1, 0)}
        out = await rig.run("b")
        assert out.extra["evicted"] == [["a", 1, 0]]
        assert await rig.check() == {("c", 1, 0), ("b", 1, 0)}

    on_loop({s: TINY for s in "abc"}, body, gpus=1, fit=2.5)


def test_worker_crash_mid_action_fails_it_and_the_next_gets_a_fresh_worker() -> None:
    async def body(rig: Rig) -> None:
        assert (await rig.run("small")).ok
        pid = rig.backend.worker_pid("g0")
        rows = np.random.default_rng(0).integers(0, 2048, size=(16, 96)).tolist()
        action = rig.action("big", 1, tokens=rows)
        fut = rig.ex.submit(action)
        deadline = time.monotonic() + 120
        while not rig.backend.computing(action.id):  # restored; now serving the request
            assert time.monotonic() < deadline and not fut.done()
            await asyncio.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        _, out = await fut
        assert out.status == "failed" and "died" in out.error and "reset" in out.error
        # the core forgot the node's residency (the fresh worker holds nothing either)
        assert not gpu_node(rig.core, "g0").resident
        assert counts(rig.core).usage["gpu"] == 0  # its lease was released
        out = await rig.run("small")
        assert out.ok
        assert rig.backend.worker_pid("g0") not in (None, pid)
        assert ("small", 1, 0) in await rig.check()
        assert rig.backend.crashes == 1
        slow = rig.action("big", 1, tokens=rows)  # a timeout stops it between two layers
        slow = Action(slow.id, slow.task, slow.trajectory, slow.kind, slow.cost,
                      service="big", payload={**slow.payload, "timeout_s": 0.2})
        _, out = await rig.ex.run(slow)
        assert out.status == "timeout" and "0.2 s timeout" in out.error
        assert counts(rig.core).usage["gpu"] == 0
        await rig.check()

    on_loop({"small": TINY, "big": BIG}, body)


def test_concurrent_actions_on_disjoint_chunks_do_not_interfere() -> None:
    services = {s: TINY for s in "abcd"}
    tokens = {s: np.random.default_rng(i).integers(0, 128, size=(4, 24)).tolist()
              for i, s in enumerate(services)}

    async def body(rig: Rig) -> None:
        alone = {}
        for s in services:  # reference: each service alone
            out = await rig.run(s, 2, tokens=tokens[s])
            alone[s] = json.loads(out.output)["logprobs"]
        rig.ex.runtime.records.clear()
        for _ in range(3):
            actions = [rig.action(s, 2, tokens=tokens[s]) for s in services]
            results = await asyncio.gather(*(rig.ex.run(a) for a in actions))
            chunks = [tuple(rec.gpus.split(",")) for rec, _ in results]
            assert len(set(chunks)) == 4  # four disjoint 2-GPU chunks of one node
            for s, (_, out) in zip(services, results, strict=True):
                assert out.ok, out.error
                assert np.allclose(json.loads(out.output)["logprobs"], alone[s], atol=1e-5)
            await rig.check()

    on_loop(services, body)


def test_a_bad_request_fails_alone_and_releases_its_gpus() -> None:
    async def body(rig: Rig) -> None:
        out = await rig.run("a", tokens=[[1, 999]])
        assert out.status == "failed" and "payload.tokens[0]: token 999" in out.error
        assert counts(rig.core).usage["gpu"] == 0
        out = await rig.run("a", op="score", tokens=[[1, 2, 3], [4]])
        scores = json.loads(out.output)["scores"]
        assert out.ok and len(scores) == 2 and all(s < 0 for s in scores)
        await rig.check()

    on_loop({"a": TINY}, body)


def test_model_loaders_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="hidden_size 30 must divide by num_attention_heads 4"):
        TinyLM(NumpyOps(), {**TINY, "hidden_size": 30})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="needs torch and transformers"):
        load_model(ModelSource.hf(str(tmp_path)), NumpyOps())
    bad = {"gpu_nodes": [{"gpus": 8, "gpu_mem_gb": 1}],
           "services": [{"name": "a", "model": {"init": "random", "config": {"hidden": 3}}},
                        {"name": "b"}, {"name": "c", "model": {"init": "zeros"}}]}
    with pytest.raises(ClusterError) as e:
        load_gpu_cluster(bad, "cpu")
    text = str(e.value)
    assert "model.config.hidden: unknown key" in text and "(b): no model" in text
    assert "model.init: expected 'random'" in text
    ok = load_gpu_cluster({"gpu_nodes": [{"gpus": 2, "gpu_mem_gb": 1}],
                           "services": [{"name": "a", "model": {"init": "random",
                                                                "config": TINY}}]}, "cpu")
    assert ok.spec.services[0].size_gb == pytest.approx(TINY_GB)  # computed from the config
    shipped = read_gpu_cluster(ROOT / "executor/backends/gpu/clusters/cpu-tiny.yaml", "cpu")
    assert sorted(shipped.sources) == ["judge", "teacher0", "teacher1"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def _nvml_works() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_gpus_auto_without_a_driver_is_a_clear_error(tmp_path: Path) -> None:
    spec = tmp_path / "gpu.yaml"
    spec.write_text(yaml.safe_dump({"services": [{"name": "a", "model": {
        "init": "random", "config": TINY}}]}))
    res = _cli("serve", "--gpus", "auto", "--gpu-cluster", str(spec), "--port",
               str(free_port()), "--state-dir", str(tmp_path / "st"), timeout=180)
    if _nvml_works():  # a machine with a driver: discovery must work instead
        from executor.backends.gpu.config import discover

        node, physical, info = discover()
        assert node.gpus in (1, 2, 4, 8) and info["driver"]
        return
    assert res.returncode == 2, res.stderr
    assert "--gpus auto: NVML cannot start" in res.stderr and "no NVIDIA driver" in res.stderr
    assert "Traceback" not in res.stderr


def test_cuda_device_without_torch_or_gpu_is_a_clear_error() -> None:
    from executor.backends.gpu.arrays import torch_available

    res = _cli("bench", "gpu", "--device", "cuda", timeout=180)
    if torch_available():
        import torch

        if torch.cuda.is_available():
            assert res.returncode == 0, res.stderr
            return
        assert "torch sees no CUDA device" in res.stderr
    else:
        assert "needs torch" in res.stderr
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_serve_runs_gpu_actions_over_http(tmp_path: Path) -> None:
    spec = tmp_path / "gpu.yaml"
    spec.write_text(yaml.safe_dump({
        "gpu_nodes": [{"count": 1, "prefix": "g", "gpus": 8, "gpu_mem_gb": TINY_GB * 1.5}],
        "services": [{"name": n, "model": {"init": "random", "config": TINY, "seed": i}}
                     for i, n in enumerate(("judge", "teacher"))]}))
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), "serve", "--port", str(port), "--state-dir",
         str(tmp_path / "st"), "--gpu-cluster", str(spec), "--gpu-device", "cpu"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "TANGRAM_TOKEN": TOKEN},
        cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        deadline = time.time() + 180  # a hang guard (a loaded machine starts slowly)
        while True:
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            tid = c.post("/v1/trajectories", json={"task": "mopd"}).json()["id"]
            bad = c.post(f"/v1/trajectories/{tid}/actions",
                         json={"id": "x0", "service": "teacher", "gpus": "3",
                               "inputs": {"tokens": [[1, 2]]}})
            assert bad.status_code == 422 and "GPU counts must be 1, 2, 4 or 8" in bad.text
            bad = c.post(f"/v1/trajectories/{tid}/actions",
                         json={"id": "x1", "service": "nope", "inputs": {"tokens": [[1, 2]]}})
            assert bad.status_code == 422 and "unknown service 'nope'" in bad.text
            results = []
            for i, (svc, op) in enumerate([("teacher", "logprobs"), ("judge", "score"),
                                           ("teacher", "logprobs")]):
                r = c.post(f"/v1/trajectories/{tid}/actions", json={
                    "id": f"g{i}", "kind": "reward_judge" if op == "score" else "teacher",
                    "service": svc, "gpus": "1,2", "inputs": {"op": op, "tokens": [[5, 6, 7]]}})
                assert r.status_code == 202, r.text
                results.append(c.get(f"/v1/actions/g{i}", params={"wait": 30}).json())
            assert [r["status"] for r in results] == ["ok"] * 3, results
            assert len(json.loads(results[0]["output"])["logprobs"][0]) == 2
            assert len(json.loads(results[1]["output"])["scores"]) == 1
            assert results[0]["output"] == results[2]["output"]  # same weights, same answer
            assert results[0]["gpus"] and results[0]["units"] == len(results[0]["gpus"])
            gpus = c.get("/v1/gpus").json()
            assert gpus["device"] == "cpu" and gpus["services"]["teacher"]["restores"] >= 1
            worker = gpus["nodes"]["g0"]["worker_pid"]
            metrics = c.get("/metrics").text
            assert 'tangram_service_restores_total{service="teacher"}' in metrics
            assert 'tangram_gpu_weights_bytes{node="g0",gpu="0"}' in metrics
            assert "tangram_service_restore_seconds" in metrics
            c.delete(f"/v1/trajectories/{tid}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    deadline = time.time() + 60  # the worker process ended with the server
    while Path(f"/proc/{worker}").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{worker}").exists()


def test_run_replays_gpu_rows_with_measured_restores(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = _cli("run", "--trace", str(ROOT / "traces/samples/mopd.parquet"), "--gpu-device",
               "cpu", "--limit", "12", "--think-scale", "0", "--out", str(out), "-q")
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    gpu = summary["gpu"]
    assert summary["actions"] == 12 and summary["failed"] == 0
    # every restore an action's record carries was measured; the worker also counts the
    # core's pre-restores (an effect, issued while an action waits): one that no action
    # then rode on (the timing of a live run decides) is measured without a record
    pre = sum(s["prerestores"] for s in gpu["per_service"].values())
    assert 0 < gpu["restores_modelled"] <= gpu["restores_measured"] \
        <= gpu["restores_modelled"] + pre, gpu
    assert gpu["restore_s_measured"] > 0 and gpu["restore_bytes"] > 0
    assert gpu["residency_mismatches"] == 0
    # what the run measured, in its cluster.yaml for the simulator
    written = yaml.safe_load((out / "cluster.yaml").read_text())
    spec = ClusterSpec.from_dict(written)
    measured = MeasuredGpu.from_extra(spec.extra, spec.restore_gbps)
    assert measured is not None and measured.tokens == 32 and not measured.parallel_restore
    assert set(measured.restore_gbps) == {n.name for n in spec.gpu_nodes}
    assert all(v > 0 for v in measured.restore_gbps.values())
    assert set(measured.forward) == {s.name for s in spec.services}
    assert all(f.seconds([32]) > 0 for f in measured.forward.values())
    assert measured.overhead_s > 0
    # the simulator models those services: a GPU action takes the measured forward pass
    # of its batch, plus the workers' overhead (and a restore at the measured bandwidth);
    # 48 requests, so that some ride on a resident variant (12 may all restore: a new
    # variant is as wide as its share of the free GPUs)
    sim = tmp_path / "sim"
    res = _cli("simulate", "--trace", str(ROOT / "traces/samples/mopd.parquet"), "--cluster",
               str(out / "cluster.yaml"), "--limit", "48", "--think-scale", "0", "--out",
               str(sim), "-q")
    assert res.returncode == 0, res.stderr
    import pandas as pd

    from traces.schema import load

    trace = load(ROOT / "traces/samples/mopd.parquet")
    service = {f"{r.trajectory}#{r.seq}": r.service for r in trace.itertuples()}
    acts = pd.read_parquet(sim / "actions.parquet")
    gpu_rows = acts[acts["gpus"].astype(bool)]
    assert len(gpu_rows) == 48
    lead = gpu_rows["batch_of"].where(gpu_rows["batch_of"].astype(bool), gpu_rows["action_id"])
    size = lead.map(lead.value_counts())
    checked = 0
    for (_, row), n in zip(gpu_rows.iterrows(), size, strict=True):
        if row["restore_s"] == 0:
            want = measured.exec_s(service[row["action_id"]], n)
            assert want is not None
            assert row["end_s"] - row["start_s"] == pytest.approx(want + measured.overhead_s)
            checked += 1
    assert checked > 0
    res = _cli("run", "--trace", str(ROOT / "traces/samples/mopd.parquet"), "--limit", "1",
               "--out", str(tmp_path / "no"), "-q")
    assert res.returncode == 2 and "--gpu-device cpu" in res.stderr


#: every policy of `tangram policies` (fixed-dop at 2 GPUs)
LIVE_POLICIES = [p if p != "fixed-dop:N" else "fixed-dop:2" for p in REGISTRY]


@pytest.mark.parametrize("policy", LIVE_POLICIES)
def test_every_policy_runs_live_on_gpu_workers(tmp_path: Path, policy: str) -> None:
    """A slice of the MOPD sample live on the cpu device under each policy: exit 0, every
    action ok, the workers held what the core's plans said (no mismatch). Static: each
    replica deployed once and never evicted; serverless: every cold start a real load.
    `tangram run` in this process (typer's CliRunner: the command's own code and exit
    code, its GPU workers real processes), not a fresh interpreter per policy: importing
    the command again was a third of each run's CPU (the run as a subprocess:
    test_run_replays_gpu_rows_with_measured_restores)."""
    from typer.testing import CliRunner

    import cli

    out = tmp_path / "run"
    res = CliRunner().invoke(cli.app, [
        "run", "--trace", str(ROOT / "traces/samples/mopd.parquet"), "--gpu-device", "cpu",
        "--limit", "10", "--think-scale", "0", "--policy", policy, "--pod-cores", "1",
        "--out", str(out), "-q"])  # k8s pods fit a 1-core CI box
    assert res.exit_code == 0, (res.output, res.exception)
    summary = json.loads((out / "summary.json").read_text())
    gpu = summary["gpu"]
    assert summary["actions"] == 10 and summary["failed"] == 0
    assert gpu["residency_mismatches"] == 0 and gpu["worker_crashes"] == 0
    assert gpu["restores_measured"] > 0  # every variant served was loaded for real
    if policy in ("static", "baseline"):
        assert gpu["evictions"] == 0 and gpu["restores_modelled"] == 0
        # the replicas were loaded ahead of demand: the core's pre-restore effects, each
        # carried out and counted by a worker
        assert sum(s["prerestores"] for s in gpu["per_service"].values()) >= 1, gpu
        # deployments only: at most one load per replica (a replica owns its GPUs)
        spec = ClusterSpec.from_dict(yaml.safe_load((out / "cluster.yaml").read_text()))
        assert gpu["restores_measured"] <= sum(n.gpus for n in spec.gpu_nodes)
    if policy == "serverless":  # no residency shared between requests of one instance size
        assert gpu["restores_measured"] == gpu["restores_modelled"]


# -- batches: one command, one forward pass, one result per member ----------------------------
def _submit_behind_blocker(rig: Rig, service: str, payloads: list[dict],
                           blocker_tokens: list[list[int]]) -> tuple[Any, list[Any], list[str]]:
    """A blocker holds the node's only GPU; the actions submitted behind it queue and then
    start as one batch (the core's continuous batching: the first queued one leads, the
    others ride its lease)."""
    rig.n += 1
    blocker = Action(f"blk{rig.n}", "mopd", "t", "teacher_logprob", {"gpu": Demand.fixed(1)},
                     service=service, t1_s=0.01,
                     payload={"op": "logprobs", "tokens": blocker_tokens})
    first = rig.ex.submit(blocker)
    futs, ids = [], []
    for i, payload in enumerate(payloads):
        rig.n += 1
        a = Action(f"m{rig.n}", "mopd", f"t{i}", "teacher_logprob", {"gpu": Demand.fixed(1)},
                   service=service, t1_s=0.01, payload=payload)
        rig.ex.open_trajectory(f"t{i}")
        ids.append(a.id)
        futs.append(rig.ex.submit(a))
    return first, futs, ids


def test_a_batch_of_8_is_one_worker_call_and_one_forward_pass_equal_to_8_solo_runs() -> None:
    rng = np.random.default_rng(3)
    payloads = [{"op": "logprobs", "tokens": [rng.integers(0, 128, size=int(n)).tolist()
                                              for n in rng.integers(3, 20, size=2)]}
                for _ in range(7)]
    payloads.append({"op": "score", "tokens": [[5, 6, 7]], "yes_token": 9})

    async def body(rig: Rig) -> None:
        solo = []
        for p in payloads:  # each alone, one after another: 8 commands, 8 forward passes
            out = await rig.run("a", tokens=p["tokens"], op=p["op"]) if "yes_token" not in p \
                else (await rig.ex.run(Action("solo-score", "mopd", "t", "judge",
                                              {"gpu": Demand.fixed(1)}, service="a",
                                              payload=p)))[1]
            assert out.ok, out.error
            solo.append(json.loads(out.output))
        before = await rig.backend.worker_counters("g0")
        first, futs, ids = _submit_behind_blocker(rig, "a", payloads, [[1, 2, 3]])
        assert (await first)[1].ok
        results = await asyncio.gather(*futs)
        after = await rig.backend.worker_counters("g0")
        # the blocker, then the 8 as ONE command and ONE forward pass
        assert after["runs"] - before["runs"] == 2
        assert after["forwards"] - before["forwards"] == 2
        for (rec, out), want, aid in zip(results, solo, ids, strict=True):
            assert out.ok, out.error
            assert rec.batch_of == ids[0] and out.extra["batch"] == 8
            got = json.loads(out.output)
            assert got.keys() == want.keys()
            for key in got:
                assert np.allclose(np.concatenate([np.ravel(x) for x in got[key]]),
                                   np.concatenate([np.ravel(x) for x in want[key]]),
                                   atol=1e-4), aid
        assert rig.backend.snapshot()["services"]["a"]["batches"] >= 2
        await rig.check()

    on_loop({"a": TINY}, body, gpus=1)


def test_a_bad_or_cancelled_member_ends_alone_and_the_batch_goes_on() -> None:
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 2048, size=(6, 64)).tolist() for _ in range(4)]
    payloads = [{"op": "logprobs", "tokens": r} for r in rows]
    payloads[1] = {"op": "logprobs", "tokens": [[1, 99999]]}  # not a token id: fails alone
    payloads[3] = {**payloads[3], "timeout_s": 0.05}  # stopped between two layers

    async def body(rig: Rig) -> None:
        solo0 = json.loads((await rig.run("big", tokens=rows[0])).output)
        first, futs, ids = _submit_behind_blocker(rig, "big", payloads, [[1, 2, 3]])
        await first
        deadline = time.monotonic() + 120
        while not rig.backend.computing(ids[2]):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        assert rig.ex.runtime.cancel(ids[2])
        results = [out for _, out in await asyncio.gather(*futs)]
        assert [o.status for o in results] == ["ok", "failed", "cancelled", "timeout"]
        assert "payload.tokens[0]: token 99999" in results[1].error
        assert np.allclose(json.loads(results[0].output)["logprobs"], solo0["logprobs"],
                           atol=1e-4)
        assert counts(rig.core).usage["gpu"] == 0  # the lease went with the last member
        await rig.check()

    on_loop({"big": BIG}, body, gpus=1)


# -- dtypes: the YAML's in the worker; transformers' float32 buffers kept -------------------------
def test_the_yaml_dtype_is_the_workers_and_the_cores_size() -> None:
    data = {"gpu_nodes": [{"gpus": 1, "gpu_mem_gb": 1}],
            "services": [{"name": "h", "model": {"init": "random", "config": TINY,
                                                 "dtype": "float16"}},
                         {"name": "f", "model": {"init": "random", "config": TINY}}]}
    spec = load_gpu_cluster(data, "cpu")
    sizes = {s.name: s.size_gb for s in spec.spec.services}
    assert sizes == {"h": pytest.approx(TINY_GB / 2), "f": pytest.approx(TINY_GB)}

    async def go() -> None:
        core = Tangram(spec.spec)
        backend = GpuBackend(spec.spec, spec.sources, "cpu")
        backend.start_workers()
        ready = backend.wait_ready(60)["gpu0-0"]
        assert ready["dtypes"] == {"h": "float16", "f": "float32"}
        assert ready["services"]["h"] == random_size_bytes(TINY, 2)
        ex = LiveExecutor(core, backend)
        ex.open_trajectory("t")
        try:
            outs = [(await ex.run(Action(f"d{s}", "mopd", "t", "teacher_logprob",
                                         {"gpu": Demand.fixed(1)}, service=s,
                                         payload={"op": "logprobs",
                                                  "tokens": [[1, 2, 3, 4]]})))[1]
                    for s in ("h", "f")]
            assert all(o.ok for o in outs), [o.error for o in outs]
            half, full = (np.array(json.loads(o.output)["logprobs"]) for o in outs)
            assert half.shape == full.shape == (1, 3)
            assert (await backend.verify("gpu0-0", ("h", 1, 0)))["bytes"] == \
                random_size_bytes(TINY, 2)
        finally:
            ex.shutdown()

    asyncio.run(go())
    bad = {**data, "services": [{"name": "x", "model": {"init": "random", "config": TINY,
                                                         "dtype": "int8"}}]}
    with pytest.raises(ClusterError, match=r"services\[0\].model.dtype: expected one of"):
        load_gpu_cluster(bad, "cpu")
    from executor.backends.gpu.arrays import torch_available

    bf16 = {**data, "services": [{"name": "x", "model": {"init": "random", "config": TINY,
                                                          "dtype": "bfloat16"}}]}
    if torch_available():  # torch computes in bfloat16 on the cpu device too
        assert load_gpu_cluster(bf16, "cpu").spec.services[0].size_gb == \
            pytest.approx(TINY_GB / 2)
    else:
        with pytest.raises(ClusterError, match="numpy here, which has no bfloat16"):
            load_gpu_cluster(bf16, "cpu")


def _torch_check() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_check", ROOT / "scripts/torch_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.device
def test_torch_check_catches_a_bfloat16_rotary_table(tmp_path: Path) -> None:
    """The loader keeps transformers' float32 rotary buffers in a bfloat16 model, and the
    float32-reference comparison of torch_check fails a model whose rotary table was
    converted to bfloat16 (what staging every tensor in the model's dtype did).

    Needs torch and transformers (the ``gpu`` extra): marked ``device``, deselected by
    default (pyproject's addopts) and run by scripts/gpu_check.sh on a GPU machine."""
    tc = _torch_check()
    path = tc.llama_checkpoint(str(tmp_path), 4096)
    tokens = tc.sequence(4096)
    want = tc.reference(path, "cpu", tokens)
    drift = tc.rotary_drift(path, "cpu", tokens, want)
    assert drift["staged_rotary_dtypes"] == {"model.rotary_emb.inv_freq": "float32",
                                             "model.rotary_emb.original_inv_freq": "float32"}
    assert drift["staged"]["ok"], drift
    assert drift["rotary_bf16_detected"] and \
        drift["rotary_bf16"]["max_abs_diff_long"] > tc.TOLERANCE, drift


def test_gpu_check_prints_one_json_with_verdicts_and_the_reason_of_a_failed_step() -> None:
    """The cpu dry run of scripts/gpu_check.sh, its torch step given 1 s: it fails (too
    short, or no torch here) and the JSON says why; the bench step's figures are there."""
    env = {**os.environ, "DEVICE": "cpu", "SIZES": "0.004,0.008", "TORCH_LIMIT": "1",
           "DEVICE_TESTS_LIMIT": "1",
           "PYTHON": sys.executable}
    res = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], capture_output=True,
                         text=True, timeout=300, env=env, cwd=ROOT)
    out = json.loads(res.stdout)  # one JSON object, nothing else on stdout
    assert res.returncode == 1 and out["ok"] is False
    assert out["steps"]["bench"] == {"ok": True, "rc": 0, "reason": ""}
    # the torch-free wiring of the torch step (core -> GpuBackend -> worker) runs here too
    assert out["steps"]["wiring"] == {"ok": True, "rc": 0, "reason": ""}
    assert not out["steps"]["device_tests"]["ok"]  # 1 s is too short for pytest
    torch_step = out["steps"]["torch"]
    assert not torch_step["ok"] and torch_step["rc"] in (1, 124)
    assert torch_step["reason"].startswith("timed out after 1 s" if torch_step["rc"] == 124
                                           else "exit status 1: ")
    targets = out["targets"]
    assert set(targets) == {"restore_vs_pinned_copy", "numerics", "nvml", "layer_split"}
    restore = targets["restore_vs_pinned_copy"]
    assert restore["pass"] is None and "cpu device" in restore["reason"]  # a GPU's target
    assert len(restore["per_service"]) == 2 and restore["value"] > 0
    assert targets["nvml"]["pass"] is None
    assert targets["numerics"]["pass"] is False
    assert targets["numerics"]["reason"] == "torch check did not finish: " + torch_step["reason"]


def test_measured_costs_fit_and_read_back() -> None:
    from executor.backends.gpu.measure import fit_forward, probe_dop, shapes_for

    node = GpuNodeSpec("n", 4, 10.0)
    assert [probe_dop(gb, node) for gb in (5, 15, 30, 50)] == [1, 2, 4, None]

    truth = {"fixed_s": 0.004, "per_member_s": 0.001, "per_token_s": 2e-5}
    points = [[m, t, truth["fixed_s"] + truth["per_member_s"] * m + truth["per_token_s"] * m * t]
              for m, t in shapes_for(32)]
    fitted = fit_forward(points)
    assert fitted == pytest.approx(truth, rel=1e-6)
    extra = {"gpu_measured": {"tokens": 32, "forward": {"a": fitted},
                              "restore_gbps": {"g0": 2.0}, "parallel_restore": False,
                              "overhead_s": 0.01}}
    m = MeasuredGpu.from_extra(extra, modelled_gbps=20.0)
    assert m is not None
    assert m.exec_s("a", 3) == pytest.approx(0.004 + 0.003 + 2e-5 * 96)
    assert m.exec_s("b", 1) is None
    # the core modelled 0.1 s at 20 GB/s on 2 GPUs; measured 2 GB/s, shards one by one
    assert m.restore_s("g0", 0.1, 2) == pytest.approx(0.1 * 10 * 2)
    assert MeasuredGpu.from_extra({}, 20.0) is None
    with pytest.raises(ValueError, match=r"gpu_measured.forward.a.per_token_s: expected"):
        MeasuredGpu.from_extra({"gpu_measured": {"tokens": 32, "forward": {
            "a": {"per_token_s": -1}}}}, 20.0)


@pytest.mark.device
def test_a_hugging_face_batch_is_one_forward_pass_with_an_attention_mask(tmp_path: Path) -> None:
    """The Hugging Face path pads the members' sequences with an attention mask: each
    member's result equals its solo run; a cancelled member ends alone.

    Needs torch and transformers (the ``gpu`` extra): marked ``device``, deselected by
    default (pyproject's addopts) and run by scripts/gpu_check.sh on a GPU machine."""
    import transformers

    from executor.backends.gpu.arrays import make_ops
    from executor.backends.gpu.model import Batch, HFModel, Request

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    model = HFModel(make_ops("cpu"), str(tmp_path / "m"), "float32")
    placed = model.place(2, [0, 1])
    rng = np.random.default_rng(2)
    payloads = [{"op": "logprobs", "tokens": [rng.integers(0, 256, size=int(n)).tolist()]}
                for n in (5, 17, 9)] + [{"op": "score", "tokens": [[3, 4, 5]], "yes_token": 7}]
    solo = [model.run(placed, [0, 1], p, lambda: False) for p in payloads]
    before = model.forwards
    reqs = [Request(f"r{i}", p) for i, p in enumerate(payloads)]
    ended: list[str] = []
    model.run_batch(placed, [0, 1], Batch(reqs, lambda _id: False, lambda r: ended.append(r.id)))
    assert model.forwards == before + 1 and sorted(ended) == ["r0", "r1", "r2", "r3"]
    for r, want in zip(reqs, solo, strict=True):
        assert r.status == "ok", r.error
        key = next(iter(want))
        assert np.allclose(np.concatenate([np.ravel(x) for x in r.output[key]]),
                           np.concatenate([np.ravel(x) for x in want[key]]), atol=1e-4)
    reqs = [Request(f"c{i}", p) for i, p in enumerate(payloads)]
    model.run_batch(placed, [0, 1], Batch(reqs, lambda aid: aid == "c1"))
    assert [r.status for r in reqs] == ["ok", "cancelled", "ok", "ok"]
    assert np.allclose(reqs[2].output["logprobs"], solo[2]["logprobs"], atol=1e-4)
