"""`tangram serve` as a user runs it, driven by the Python client (tangram_sdk/client.py), on
workloads built so that every kind of effect the core has happens (issue 46 #3).

Each test starts the server as a subprocess (``tangram serve``), drives it with
``TangramSyncClient``, reads which effects were carried out from ``/metrics``
(``tangram_effects_total{effect=...}``, and the core's counters ``tangram_core_*``),
checks every result the client got, then stops the server with SIGTERM and checks it
exited 0 with no traceback in its log. Three workloads, since one server cannot provoke
them all: the CPU one (a light command that overstays the lane: ``Moved``; a cancel of a
queued and of a running action: ``Cancelled``, ``Stop``; a fork; an idle trajectory
reclaimed under ``--mem-overcommit 1``: ``Reclaim``), a machine short of memory (a
cgroup the test makes: ``Shed``) and GPU services on the cpu device under the static
policy (replicas loaded ahead of demand: ``PreRestore``; requests served as one batch).
:data:`COVERED` must name every effect kind of tangram/protocol.py.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
from pathlib import Path
from typing import get_args

import httpx
import pytest
import yaml
from conftest import TOKEN, Server, start_server
from helpers import until_true
from test_attack_oom import OWN, _alloc, _remove, needs_cgroups

from executor.node.local import mem_total_gb
from tangram.protocol import Effect
from tangram_sdk.client import TangramSyncClient

ROOT = Path(__file__).resolve().parent.parent
#: generous hang guards (s): a loaded 2-core CI machine, never a speed bound
WAIT_S = 240

#: the effect kinds each workload below provokes (the union: every kind there is)
CPU_EFFECTS = {"Dispatch", "Moved", "Stop", "Cancelled", "Reclaim"}
SHED_EFFECTS = {"Dispatch", "Shed"}
GPU_EFFECTS = {"Dispatch", "PreRestore"}
#: (its workload, `serve --policy tangram-malleable` growing a real pytest-xdist run, is
#: tests/test_malleable_live.py's, which asserts the Resized count in /metrics)
RESIZE_EFFECTS = {"Dispatch", "Resized"}
#: tests/test_images_live.py's, which asserts the PullImage count in /metrics (the core books
#: an opened trajectory's image and orders it pulled to its node)
PULL_EFFECTS = {"PullImage"}
COVERED = CPU_EFFECTS | SHED_EFFECTS | GPU_EFFECTS | RESIZE_EFFECTS | PULL_EFFECTS


def test_the_workloads_cover_every_effect_kind():
    """A new effect kind in tangram/protocol.py needs a workload here that provokes it."""
    assert COVERED == {kind.__name__ for kind in get_args(Effect)}


def get(url: str, path: str) -> httpx.Response:
    """A GET of the server at ``url`` with the token (the sync client has no such call)."""
    resp = httpx.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"},
                     timeout=120)
    resp.raise_for_status()
    return resp


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {name or name{labels}: value} (Prometheus text, comments skipped)."""
    text = get(url, "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def effects(url: str) -> dict[str, float]:
    """Effects carried out so far, by kind (every kind is listed, 0 included)."""
    return {m.group(1): v for k, v in metrics(url).items()
            if (m := re.fullmatch(r'tangram_effects_total\{effect="(\w+)"\}', k))}


def state(c: TangramSyncClient, aid: str) -> str:
    return c.wait(aid, 0)["status"]


def result(c: TangramSyncClient, aid: str) -> dict:
    return c.wait(aid, WAIT_S)


def stopped_cleanly(server: Server) -> None:
    """SIGTERM ends `tangram serve` after a complete shutdown, nothing raised on the way.
    Its status: the signal (uvicorn re-raises it once shut down, so that a supervisor sees
    how it ended; systemd counts that as a clean stop), or 0."""
    server.stop(signal.SIGTERM)
    log = server.log.read_text()
    assert server.proc.returncode in (0, -signal.SIGTERM), log[-3000:]
    assert "Application shutdown complete." in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("backend", ["process", "docker"])
def test_serve_carries_out_moves_cancels_a_fork_and_a_reclaim(tmp_path: Path, backend: str):
    """One server, ``--mem-overcommit 1`` (each declared ``mem_gb`` reserved in full, so
    two trajectories of 60% of the machine cannot both hold it)."""
    server = start_server(tmp_path / "state", backend, extra_args=("--mem-overcommit", "1"))
    cores = len(os.sched_getaffinity(0))  # the server schedules this machine's cores
    small = 0.1  # GB: the small trajectories' declared memory (many fit beside the big)
    try:
        with TangramSyncClient(server.url, TOKEN, timeout_s=120) as c:
            # a test run holding every core: what a light command then finds
            c.open_trajectory("holder", mem_gb=small)
            c.submit("holder", action_id="hold", kind="test_run", cpu=str(cores),
                     command="sleep 600")
            until_true(lambda: state(c, "hold") == "running", WAIT_S, "the holder running")
            # an exclusive action queues behind it, and is cancelled there: Cancelled
            c.open_trajectory("waiter", mem_gb=small)
            c.submit("waiter", action_id="queued", kind="test_run", cpu="1", command="true")
            assert state(c, "queued") == "queued"
            gone = c.cancel("queued")
            assert gone["status"] == "cancelled" and gone["exec_s"] in (None, 0.0), gone
            # declared light (t1_s 0), runs 4 s: it takes the lane, overstays its bound
            # (lane_hold_s, 1 s) and is moved off it: Moved
            c.open_trajectory("liar", mem_gb=small)
            c.submit("liar", action_id="light", command="sleep 4; echo slept", shell=True,
                     t1_s=0.0)
            until_true(lambda: effects(server.url)["Moved"] >= 1, WAIT_S, "the light command moved")
            res = result(c, "light")
            assert res["status"] == "ok" and res["lane"] and res["output"] == "slept\n", res
            # the holder is stopped while it runs: Stop, and it ends cancelled
            assert state(c, "hold") == "running"
            stopped = c.cancel("hold")
            assert stopped["status"] == "cancelled", stopped
            # a fork: two copies of a prepared sandbox, each with its files
            c.open_trajectory("src", mem_gb=small)
            assert c.run("src", command="echo forked > f.txt", shell=True)["status"] == "ok"
            forked = c.fork("src", 2, prefix="copy")
            assert forked["ids"] == ["copy-0", "copy-1"], forked
            for copy in forked["ids"]:
                res = c.run(copy, command="cat f.txt", shell=True)
                assert res["status"] == "ok" and res["output"] == "forked\n", res
            for t in ("holder", "waiter", "liar", "src", *forked["ids"]):
                c.close_trajectory(t)
            # two trajectories of 60% of the machine: the idle one is reclaimed for the
            # one waiting
            big = round(mem_total_gb() * 0.6, 2)
            a = c.open_trajectory(task="reclaim", mem_gb=big)
            assert c.run(a, command="echo kept > f.txt", shell=True)["status"] == "ok"
            b = c.open_trajectory(task="reclaim", mem_gb=big)
            res = c.run(b, command="echo b", shell=True)
            assert res["status"] == "ok" and res["output"] == "b\n", res
            res = c.run(a, command="cat f.txt", shell=True)  # b is the one reclaimed now
            if backend == "process":  # its files stayed on disk: nothing was lost
                assert res["status"] == "ok" and res["output"] == "kept\n", res
            else:  # docker evicts: its container was removed to free the memory, said so
                assert res["state_lost"] and res["exit_code"] != 0, res
            c.close_trajectory(a)
            c.close_trajectory(b)

            seen = effects(server.url)
            assert {k for k, v in seen.items() if v >= 1} >= CPU_EFFECTS, seen
            core = metrics(server.url)
            assert core["tangram_core_lane_moves"] >= 1, core
            assert core["tangram_core_trajectories_reclaimed"] >= 1, core
            # every action the client submitted has its end: nothing failed or hangs
            assert core['tangram_actions_total{status="cancelled"}'] == 2, core
            assert 'tangram_actions_total{status="failed"}' not in core, core
            assert core["tangram_running_actions"] == core["tangram_queued_actions"] == 0
    finally:
        stopped_cleanly(server)


@needs_cgroups
def test_serve_sheds_the_largest_sandbox_of_a_machine_short_of_memory(tmp_path: Path):
    """The server in a 1.5 GB cgroup (its machine, as it sees it) keeping 30% free:
    one sandbox (declared 1.2 GB, within its limit) grows to 1.1 GB and holds it: past
    what the machine keeps free (0.45 GB), under what the kernel would kill at (1.5 GB,
    the server's own memory well under the 0.4 GB left). The server sheds it (``oom``,
    "short of memory") before the kernel has to; a small trajectory is untouched."""
    cg = OWN / f"tangram-test-{secrets.token_hex(4)}"  # type: ignore[operator]
    cg.mkdir()
    server = None
    try:
        (cg / "memory.limit_in_bytes").write_text(str(int(1.5 * 2**30)))
        server = start_server(tmp_path / "state", "process", cgroup=cg,
                              extra_args=("--mem-headroom", "0.3"))
        with TangramSyncClient(server.url, TOKEN, timeout_s=120) as c:
            c.open_trajectory("big", mem_gb=1.2)
            c.submit("big", action_id="grow", argv=_alloc(1100, step=10, pause=0.02,
                                                          hold=WAIT_S), timeout_s=WAIT_S * 2)
            until_true(lambda: effects(server.url)["Shed"] >= 1, WAIT_S, "a shed")
            res = result(c, "grow")
            assert res["status"] == "oom" and "short of memory" in res["error"], res
            c.open_trajectory("small", mem_gb=0.1)
            res = c.run("small", argv=["echo", "fine"])
            assert res["status"] == "ok" and res["output"] == "fine\n", res
            seen = effects(server.url)
            assert {k for k, v in seen.items() if v >= 1} >= SHED_EFFECTS, seen
    finally:
        if server is not None:
            stopped_cleanly(server)
        _remove(cg)


#: two services on one node of 8 cpu-device "GPUs" (executor/backends/gpu/clusters/cpu-tiny.yaml)
TINY = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4}


def test_serve_prerestores_static_replicas_and_batches_gpu_requests(tmp_path: Path):
    """GPU services on the cpu device (no GPU needed) under the static policy: every
    replica is loaded ahead of its first request (the core's ``PreRestore``, carried out
    and counted by the worker), and requests sent together are served as batches (fewer
    forward passes than requests) with one correct answer each."""
    spec = tmp_path / "gpu.yaml"
    spec.write_text(yaml.safe_dump({
        "gpu_nodes": [{"count": 1, "prefix": "g", "gpus": 8, "gpu_mem_gb": 0.05}],
        "services": [{"name": n, "model": {"init": "random", "config": TINY, "seed": i}}
                     for i, n in enumerate(("judge", "teacher"))]}))
    server = start_server(tmp_path / "state", "process", extra_args=(
        "--gpu-cluster", str(spec), "--gpu-device", "cpu", "--policy", "static"))
    try:
        with TangramSyncClient(server.url, TOKEN, timeout_s=120) as c:
            t = c.open_trajectory(task="mopd")
            # many requests of one service in one submit (the client's batch call): the
            # core queues them in one pass, and a replica that starts takes those queued
            # behind it as one batch
            n = 16
            states = c.submit_batch([(t, {"id": f"s{i}", "kind": "reward_judge",
                                          "service": "judge", "gpus": "1",
                                          "inputs": {"op": "score", "tokens": [[3, 4, 5]]}})
                                     for i in range(n)])
            assert len(states) == n, states
            answers = {i: result(c, f"s{i}") for i in range(n)}
            assert all(a["status"] == "ok" for a in answers.values()), answers
            scores = {json.dumps(json.loads(a["output"])["scores"]) for a in answers.values()}
            assert len(scores) == 1, scores  # one replica's weights, one answer
            gpus = get(server.url, "/v1/gpus").json()
            # the replicas a request did not load first were loaded ahead of demand
            assert gpus["device"] == "cpu", gpus
            assert sum(s["prerestores"] for s in gpus["services"].values()) >= 1, gpus
            judge = gpus["services"]["judge"]
            assert judge["requests"] == n and judge["batches"] < n, judge
            seen = effects(server.url)
            assert {k for k, v in seen.items() if v >= 1} >= GPU_EFFECTS, seen
            c.close_trajectory(t)
    finally:
        stopped_cleanly(server)

