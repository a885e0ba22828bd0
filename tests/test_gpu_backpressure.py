"""Backpressure on the GPU endpoints (issue 33 item 7): a teacher / reward request the
GPU pool would not serve within its timeout is answered at once with HTTP 429 and a
``Retry-After`` header, estimated from what the server has seen (the GPU actions queued
and running, each service's observed GPU-seconds per request), and Tangram's teacher
client waits that long and asks again.

verl 0.9.1's own HTTP client for these endpoints (``RewardLoopWorker._post_request`` in
``verl/experimental/reward_loop/reward_loop.py``) retries 5xx and transport errors with
exponential backoff but raises at once on any 4xx, a 429 included, and never reads
``Retry-After``; its teacher path does not use HTTP at all (``LLMServerClient`` calls
Ray actors). So the retry is tested with Tangram's client (the one verl is handed as
``teacher_client``), not with verl's code.

A real server on 127.0.0.1 with the CPU GPU double (``--gpu-device cpu``) on a
one-"GPU" node, so that requests queue behind each other.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, TOKEN, start_server
from helpers import until_true

from executor.server.routes.openai import expected_done_s
from executor.server.schemas import MIN_TIMEOUT_S
from tangram.model import Action, Lease
from tangram.protocol import QueueView, Snapshot, Waiting
from tangram_sdk.integrations.teacher import TangramTeacherClient

H = {"Authorization": f"Bearer {TOKEN}"}
LIGHT = {"model": "teacher0", "prompt": [1, 2, 3, 4], "prompt_logprobs": 0, "max_tokens": 1}
#: a request that keeps the one GPU busy for a while on the CPU double (64 x 64 tokens)
HEAVY = {
    "model": "teacher1",
    "prompt": [[(7 * i + j) % 1000 for j in range(64)] for i in range(64)],
    "prompt_logprobs": 0,
}


@pytest.fixture(scope="module")
def one_gpu_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("backpressure")
    tiny = (ROOT / "executor/backends/gpu/clusters/cpu-tiny.yaml").read_text()
    assert "gpus: 8" in tiny
    cluster = tmp / "one-gpu.yaml"
    cluster.write_text(tiny.replace("gpus: 8", "gpus: 1"))
    server = start_server(
        tmp / "state", "process", extra_args=("--gpu-cluster", str(cluster), "--gpu-device", "cpu")
    )
    yield server
    server.stop()


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, headers=H, timeout=700)


def _services(url: str) -> dict:
    return httpx.get(url + "/v1/gpus", headers=H, timeout=30).json()["services"]


def _per_request(svc: dict) -> float:
    return svc["gpu_seconds"] / svc["requests"]


def _gpu_leased(url: str) -> bool:
    nodes = httpx.get(url + "/v1/gpus", headers=H, timeout=30).json()["nodes"]
    return any(g["leased"] for n in nodes.values() for g in n["gpus"])


def _blockers(url: str, n: int) -> tuple[list[threading.Thread], list[int]]:
    """``n`` heavy requests of another service in flight (each in a thread)."""
    codes: list[int] = []
    threads = [threading.Thread(target=lambda: codes.append(_post(url, HEAVY).status_code)) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, codes


def _wait_leased(url: str, threads: list[threading.Thread]) -> None:
    """Until the GPU runs a blocker (a condition, with a generous deadline)."""

    def leased() -> bool:
        if _gpu_leased(url):
            return True
        assert any(t.is_alive() for t in threads), "the blockers ended before one ran"
        threading.Event().wait(0.01)
        return False

    until_true(leased, 300, "a blocker to hold the GPU")


def test_the_estimate_reads_the_queue_and_the_observed_cost_only():
    """More GPU work ahead: later; a service never observed: no estimate (no guess); an
    unobserved service ahead counts at the observed mean; CPU queues do not count."""

    def snap(gpu_waiting: list[str], running: list[str], cpu_waiting: int = 0) -> Snapshot:
        def waiting(services: list[str | None]) -> tuple[Waiting, ...]:
            return tuple(
                Waiting(Action(id=f"a{i}", task="t", trajectory="t", kind="k", service=s), 0.0, 1)
                for i, s in enumerate(services)
            )

        run = {f"r{i}": _dispatch(s) for i, s in enumerate(running)}
        return Snapshot(
            "tangram",
            len(gpu_waiting) + cpu_waiting,
            len(run),
            0,
            0,
            {},
            {},
            {},
            detail=True,
            running=run,
            queues=(
                QueueView("gpu:n", "gpu", waiting(gpu_waiting)),
                QueueView("cpu:n", "cpu", waiting([None] * cpu_waiting)),
            ),
        )

    cost = {"a": 2.0, "b": 4.0}
    assert expected_done_s(snap([], []), cost, 2, "a") == 2.0
    assert expected_done_s(snap(["a", "b"], []), cost, 2, "a") == 2.0 + 6.0 / 2
    assert expected_done_s(snap(["a", "b"], ["b"]), cost, 2, "a") == 2.0 + 10.0 / 2
    assert expected_done_s(snap(["c"], []), cost, 1, "a") == 2.0 + 3.0  # c: the mean
    assert expected_done_s(snap([], [], cpu_waiting=50), cost, 1, "a") == 2.0
    assert expected_done_s(snap(["a"] * 9, []), cost, 1, "new") is None


def _dispatch(service: str):
    from tangram.model import Dispatch

    return Dispatch(
        Action(id="x", task="t", trajectory="t", kind="k", service=service),
        Lease(action_id="x", units=1, gpus=(0,), node="n"),
        0.0,
        0.0,
        None,
    )


def test_a_request_the_pool_would_not_serve_in_time_is_refused_with_retry_after(one_gpu_server, caplog):
    url = one_gpu_server.url
    # observations: each service served once (a service never served is never refused)
    assert _post(url, LIGHT).status_code == 200
    assert _post(url, HEAVY).status_code == 200
    svc = _services(url)
    light, heavy = _per_request(svc["teacher0"]), _per_request(svc["teacher1"])
    assert heavy > light / 2, (light, heavy)  # the precondition of the queue check below
    # (a timeout below a request's cost must be one the server accepts: >= MIN_TIMEOUT_S;
    # the heavy service's requests cost more than that on any machine this runs on)
    assert heavy > 2 * MIN_TIMEOUT_S, heavy

    # a timeout below what one request of the service has cost: refused at once
    before = _services(url)["teacher1"]["requests"]
    r = _post(url, {**HEAVY, "timeout_s": heavy / 2})
    assert r.status_code == 429, r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert "timeout" in r.json()["detail"] and "teacher1" in r.json()["detail"]
    r = httpx.post(
        url + "/classify",
        json={"model": "teacher1", "input": HEAVY["prompt"], "timeout_s": heavy / 2},
        headers=H,
        timeout=60,
    )
    assert r.status_code == 429 and "Retry-After" in r.headers, r.text
    assert _services(url)["teacher1"]["requests"] == before  # nothing was run
    # below the shortest timeout an action may ask for: a clear 422, never a late one
    r = _post(url, {**LIGHT, "timeout_s": MIN_TIMEOUT_S / 2})
    assert r.status_code == 422 and "timeout_s" in r.text, r.text

    # an idle pool meets 1.5x the observed cost; with heavy requests ahead it does not
    light = _per_request(_services(url)["teacher0"])
    assert _post(url, {**LIGHT, "timeout_s": max(1.5 * light, MIN_TIMEOUT_S)}).status_code == 200
    light = _per_request(_services(url)["teacher0"])
    threads, codes = _blockers(url, 4)
    _wait_leased(url, threads)
    r = _post(url, {**LIGHT, "timeout_s": max(1.5 * light, MIN_TIMEOUT_S)})
    still_busy = any(t.is_alive() for t in threads)
    assert r.status_code == 429, (r.status_code, r.text, still_busy)
    assert int(r.headers["Retry-After"]) >= 1

    # Tangram's teacher client waits Retry-After and asks again until it is served
    threads2, codes2 = _blockers(url, 4)
    _wait_leased(url, threads2)
    # (its timeout: half a heavy request's cost, far below the four heavy ones ahead of it,
    # so it is refused while they run, and far above its own cost, so once served it is not
    # timed out by a loaded machine: at 1.5x its cost, ~15 ms, a CI run beside another
    # worker saw it end unfinished, 503)
    client = TangramTeacherClient("teacher0", url, TOKEN,
                                  wait_s=max(1.5 * light, MIN_TIMEOUT_S, heavy / 2))
    with caplog.at_level(logging.WARNING, logger="tangram.teacher"):
        out = asyncio.run(
            client.generate(
                "r1", prompt_ids=LIGHT["prompt"], sampling_params={"max_tokens": 1, "prompt_logprobs": 0}
            )
        )
    assert len(out.extra_fields["prompt_ids"]) == len(LIGHT["prompt"])
    assert any("HTTP 429" in rec.getMessage() for rec in caplog.records), caplog.text
    for t in threads + threads2:
        t.join(600)
    assert codes + codes2 == [200] * 8  # the blockers were served: nothing was lost


def test_the_client_gives_up_after_retry_s_with_the_servers_reason(one_gpu_server):
    """A request no wait can help (its timeout below its own cost) is refused each time;
    past ``retry_s`` the client raises with the 429's reason."""
    url = one_gpu_server.url
    assert _post(url, HEAVY).status_code == 200
    heavy = _per_request(_services(url)["teacher1"])
    assert heavy > 2 * MIN_TIMEOUT_S, heavy  # a timeout below its cost the server accepts
    client = TangramTeacherClient("teacher1", url, TOKEN, wait_s=heavy / 2, retry_s=0)
    with pytest.raises(RuntimeError, match="HTTP 429.*timeout"):
        asyncio.run(
            client.generate(
                "r2", prompt_ids=HEAVY["prompt"][0], sampling_params={"max_tokens": 1, "prompt_logprobs": 0}
            )
        )


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([str(Path(__file__)), "-q"]))
