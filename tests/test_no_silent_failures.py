"""Nothing fails silently (issue 33), against a real `tangram serve`, through the
frameworks' own code as tests/test_integrations.py drives it:

* the API: cancel (``DELETE /v1/actions/{id}``), closing a trajectory with actions in
  flight, the list of trajectories, and ``POST /v1/actions:batch`` (all or nothing);
* the adapters: a wrong URL or token fails the framework's loader (verl's
  ``initialize_tools_from_config`` and ``get_custom_reward_fn``, ``gymnasium.make``,
  ``skyrl_gym.make``); a reward that could not run is ``reward_status: "error"`` with
  its exit code and output tail; ``compute_score`` closes the sandbox whatever happens;
  a call verl gave up on is cancelled on the server;
* a lost sandbox (its container killed between two calls, docker backend) reaches the
  model (the text's first line), ``compute_score``, gymnasium's ``info`` and SkyRL's
  metadata; it is never scored as a test result unless ``state_lost_score`` says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TOKEN, sandbox_containers, start_server
from verl_torchfree import (
    AgentData,
    OneRowData,
    custom_reward_fn,
    function_call,
    load_verl_tools,
    naive_reward_manager,
    stock_loop,
)

from tangram_sdk.client import TangramClient, TangramError

tool_registry = load_verl_tools()  # before tangram_sdk.integrations.verl, so it sees verl

from tangram_sdk.integrations.common import (  # noqa: E402
    STATE_LOST_NOTE,
    RewardConfig,
    SandboxLost,
)
from tangram_sdk.integrations.verl import TangramTool  # noqa: E402


async def call(tool, command: str, agent_data) -> tuple:
    """verl 0.9.1's own ToolAgentLoop._call_tool (its source) with its default truncation."""
    loop = stock_loop([tool])  # max_tool_response_length 256, truncated in the middle
    return await loop._call_tool(function_call(tool.name, json.dumps({"command": command})),
                                 agent_data.tools_kwargs, agent_data)


async def score(compute_score, agent_data: AgentData) -> dict:
    """verl's NaiveRewardManager.run_single (source) on the rollout: its reward extra info."""

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    data = OneRowData(
        {"responses": np.array([5, 6, 7]), "attention_mask": np.array([1, 1, 1, 1])},
        {"data_source": "tangram", "reward_model": {"ground_truth": None}, "extra_info": {},
         "tool_extra_fields": dict(agent_data.extra_fields)})
    out = await naive_reward_manager(compute_score, Tokenizer())(data)
    return out["reward_extra_info"] | {"reward_score": out["reward_score"]}


async def gone(url: str, trajectory: str) -> bool:
    async with TangramClient(url, TOKEN) as tg:
        try:
            await tg.trajectory(trajectory)
        except TangramError as e:
            return e.status == 404
    return False


async def until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


# -- the API -------------------------------------------------------------------------------
async def _api(url: str) -> None:
    async with TangramClient(url, TOKEN) as tg:
        cores = int(float(next(line.split()[-1] for line in (await tg.metrics()).splitlines()
                               if line.startswith('tangram_resource_capacity{resource="cpu"}'))))
        a = await tg.open_trajectory(task="api", mem_gb=0.5)
        b = await tg.open_trajectory(task="api")
        listed = {t["id"]: t for t in await tg.trajectories()}
        assert listed[a]["state"] == "idle" and listed[a]["mem_gb"] == 0.5
        assert listed[a]["in_flight"] == 0 and listed[a]["task"] == "api" and b in listed

        # a batch is checked in full before any of it is accepted; the refusal names the item
        with pytest.raises(TangramError) as refused:
            await tg.submit_batch([(a, {"id": "batch-ok", "command": "true", "shell": True}),
                                   (b, {"command": "true", "cpu": "two"})])
        assert refused.value.status == 422
        assert refused.value.detail[0]["loc"] == ["body", "actions", 1, "action", "cpu"]
        for bad, where in (((b, {"command": "true", "cpu": "4096"}), "actions[1].action.cost['cpu']"),
                           (("no-such-trajectory", {"command": "true"}), "actions[1].trajectory")):
            with pytest.raises(TangramError) as refused:
                await tg.submit_batch([(a, {"id": "batch-ok", "command": "true"}), bad])
            assert where in str(refused.value), refused.value
        with pytest.raises(TangramError) as unknown:
            await tg.wait("batch-ok", 0)
        assert unknown.value.status == 404  # the valid first item was not accepted either
        # all the cores on one long action; the next one queues behind it
        states = await tg.submit_batch([
            (a, {"id": "long", "command": "sleep 60", "shell": True, "cpu": str(cores)}),
            (b, {"id": "behind", "command": "echo never", "shell": True})])
        assert [s["id"] for s in states] == ["long", "behind"]
        await until(lambda: _status(tg, "long", "running"), "the long action never started")
        assert (await tg.trajectory(a))["state"] == "running"
        assert (await tg.wait("behind", 0))["status"] == "queued"
        again = await tg.submit_batch([  # a repeat (same id, same body) answers its state
            (a, {"id": "long", "command": "sleep 60", "shell": True, "cpu": str(cores)})])
        assert again[0]["status"] == "running" and (await tg.trajectory(a))["actions"] == 1
        # cancelling the queued one answers at once; the running one once it stopped
        assert (await tg.cancel("behind"))["status"] == "cancelled"
        cancelled = await tg.cancel("long")
        assert cancelled["status"] == "cancelled" and cancelled["trajectory"] == a
        metrics = await tg.metrics()  # its cores are back as the cancel answers
        assert "tangram_running_actions 0" in metrics.splitlines(), metrics
        assert (await tg.wait("long", 0))["status"] == "cancelled"
        assert (await tg.cancel("long"))["status"] == "cancelled"  # again: as it ended
        done = await tg.run(b, command="echo ok", shell=True)
        assert done["status"] == "ok" and (await tg.cancel(done["id"]))["status"] == "ok"
        with pytest.raises(TangramError) as missing:
            await tg.cancel("no-such-action")
        assert missing.value.status == 404

        # a cancel right after the submit (its process may not be spawned yet: a stop sent
        # then found nothing to kill, 2 times in 5 here) still stops it
        for i in range(3):
            await tg.submit(b, action_id=f"at-once-{i}", command="sleep 120", shell=True)
            assert (await tg.cancel(f"at-once-{i}"))["status"] == "cancelled"
        # closing a trajectory cancels what it has in flight
        await tg.submit(a, action_id="in-flight", command="sleep 60", shell=True)
        await until(lambda: _status(tg, "in-flight", "running"), "it never started")
        assert (await tg.close_trajectory(a))["cancelled"] == 1
        assert (await tg.wait("in-flight", 0))["status"] == "cancelled"
        assert await gone(url, a) and a not in {t["id"] for t in await tg.trajectories()}
        assert (await tg.trajectory(b))["actions"] == 5
        await tg.close_trajectory(b)


async def _status(tg: TangramClient, aid: str, status: str) -> bool:
    return (await tg.wait(aid, 0))["status"] == status


def test_cancel_close_list_and_batch(process_server):
    asyncio.run(_api(process_server.url))


# -- misconfiguration and rewards that could not run ---------------------------------------
def _tool_yaml(tmp_path, url: str, token: str) -> str:
    path = tmp_path / "tool.yaml"
    path.write_text(f"""tools:
  - class_name: tangram_sdk.integrations.verl.TangramTool
    config: {{type: native, base_url: "{url}", token: "{token}", task: loud}}
""")
    return str(path)


def test_a_wrong_url_or_token_fails_every_loader(process_server, tmp_path, monkeypatch):
    import gymnasium
    import skyrl_gym

    import tangram_sdk.integrations.gym  # noqa: F401  (registers tangram/Shell-v0)
    import tangram_sdk.integrations.skyrl  # noqa: F401  (registers tangram-shell)

    url = process_server.url
    dead = "http://127.0.0.1:9"  # discard: nothing answers
    for loader, fields in (
        (lambda u, t: tool_registry.initialize_tools_from_config(_tool_yaml(tmp_path, u, t)),
         ("config.base_url", "config.token")),
        (lambda u, t: gymnasium.make("tangram/Shell-v0", base_url=u, token=t),
         ("config.base_url", "config.token")),
        (lambda u, t: skyrl_gym.make("tangram-shell", env_config={"base_url": u, "token": t}),
         ("env_config.base_url", "env_config.token"))):
        with pytest.raises(ValueError, match=f"{fields[0]}: no Tangram server answers"):
            loader(dead, TOKEN)
        with pytest.raises(ValueError, match=f"{fields[1]}: the server at .* refused it"):
            loader(url, "wrong-token")
    assert tool_registry.initialize_tools_from_config(_tool_yaml(tmp_path, url, TOKEN))

    # compute_score: verl's get_custom_reward_fn checks the reward workers' environment
    monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
    monkeypatch.setenv("TANGRAM_URL", url)
    with pytest.raises(ValueError, match="TANGRAM_TOKEN is not set"):
        custom_reward_fn("pkg://tangram_sdk.integrations.verl", "compute_score")
    monkeypatch.setenv("TANGRAM_TOKEN", "wrong-token")
    with pytest.raises(ValueError, match="compute_score: TANGRAM_TOKEN: the server .* refused"):
        custom_reward_fn("pkg://tangram_sdk.integrations.verl", "compute_score")
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    assert custom_reward_fn("pkg://tangram_sdk.integrations.verl", "compute_score")


async def _rewards(url: str) -> None:
    tool = TangramTool({"type": "native", "base_url": url, "token": TOKEN, "task": "loud"})
    compute_score = custom_reward_fn("pkg://tangram_sdk.integrations.verl", "compute_score")
    cases = {  # reward command -> (reward_status, score, words of reward_error)
        'test "$(cat answer.txt)" = 42': ("ok", 1.0, ""),
        'test "$(cat answer.txt)" = 7': ("failed", 0.0, ""),
        "no-such-program-xyz -q tests": ("error", 0.0, "not found"),
        "python3 -m no_such_module_xyz": ("error", 0.0, "No module named"),
        "printf 'ERROR collecting tests/test_x.py\\n'; exit 2": ("error", 0.0, "collecting"),
    }
    rollouts = []
    for i, command in enumerate(cases):
        rollout = AgentData(f"loud-{i}")
        tool.settings = dataclasses.replace(tool.settings, reward=RewardConfig(command))
        resp, _, _ = await call(tool, "echo 42 > answer.txt", rollout)
        assert resp.text.rstrip().endswith("[exit code 0]")
        rollouts.append(rollout)
    # verl scores a batch concurrently
    outs = await asyncio.gather(*(score(compute_score, r) for r in rollouts))
    for (command, (status, value, why)), out in zip(cases.items(), outs, strict=True):
        assert out["reward_status"] == status and out["reward_score"] == value, (command, out)
        assert why in out["reward_error"], (command, out)
        assert set(out) == {"score", "reward_exit_code", "reward_status", "reward_output",
                            "reward_error", "infra_error", "reward_score"}
        assert out["infra_error"] is (status == "error"), (command, out)
    assert outs[2]["reward_exit_code"] == 127 and "no-such-program-xyz" in outs[2]["reward_output"]
    assert outs[1]["reward_exit_code"] == 1
    for r in rollouts:  # scored, then closed
        assert await gone(url, r.extra_fields["tangram"]["trajectory"])

    # compute_score closes the sandbox even when it cannot score (no reward command)
    bare = TangramTool({"type": "native", "base_url": url, "token": TOKEN, "task": "loud"})
    rollout = AgentData("loud-bare")
    await call(bare, "true", rollout)
    with pytest.raises(ValueError, match="no reward command"):
        await score(compute_score, rollout)
    assert await gone(url, rollout.extra_fields["tangram"]["trajectory"])

    # a call verl gave up on (its task cancelled) is cancelled on the server
    # (its timeout, 600 s, is far beyond the wait below: only the cancel ends it)
    patient = TangramTool({"type": "native", "base_url": url, "token": TOKEN, "task": "loud",
                           "timeout_s": 600})
    rollout = AgentData("loud-abandoned")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(call(patient, "sleep 600", rollout), 2.0)
    tid = rollout.extra_fields["tangram"]["trajectory"]
    async with TangramClient(url, TOKEN) as tg:
        async def idle() -> bool:
            return (await tg.trajectory(tid))["in_flight"] == 0
        await until(idle, "the abandoned call kept running on the server", timeout_s=120)
    for t in (tool, bare, patient):
        await t.close_all()


def test_a_reward_that_could_not_run_is_an_error_not_a_test_result(process_server, monkeypatch):
    monkeypatch.setenv("TANGRAM_URL", process_server.url)
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    asyncio.run(_rewards(process_server.url))


def test_gymnasium_and_skyrl_say_why_a_reward_is_not_a_test_result(process_server):
    import gymnasium
    import skyrl_gym

    import tangram_sdk.integrations.gym  # noqa: F401
    import tangram_sdk.integrations.skyrl  # noqa: F401

    env = gymnasium.make("tangram/Shell-v0", base_url=process_server.url, token=TOKEN,
                         reward={"command": "python3 -m no_such_module_xyz"})
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("submit")
    assert terminated and reward == 0.0 and info["reward_status"] == "error"
    assert "No module named" in info["reward_error"] and "No module named" in obs
    assert info["infra_error"] is True, info
    env.close()

    sky = skyrl_gym.make("tangram-shell", env_config={
        "base_url": process_server.url, "token": TOKEN, "reward": {"command": "no-such-xyz"}})
    sky.init([{"role": "user", "content": "go"}])
    out = sky.step("<submit/>")
    assert out["done"] and out["reward"] == 0.0
    assert out["metadata"]["reward_status"] == "error" and out["metadata"]["reward_exit_code"] == 127
    assert out["metadata"]["infra_error"] is True, out
    sky.close()


# -- a lost sandbox (docker: its container killed between two calls) ------------------------
def _kill_sandbox(trajectory: str) -> None:
    ids = [c.id for c in sandbox_containers(trajectory, all=False)]  # its own or a pool's
    assert ids, f"no container for {trajectory}"
    subprocess.run(["docker", "kill", *ids], capture_output=True, check=True)


async def _lost(url: str) -> None:
    reward = {"command": 'test "$(cat answer.txt)" = 42'}
    tool = TangramTool({"type": "native", "base_url": url, "token": TOKEN, "task": "loud",
                        "reward": reward})
    compute_score = custom_reward_fn("pkg://tangram_sdk.integrations.verl", "compute_score")
    scored = custom_reward_fn("pkg://tangram_sdk.integrations.verl", "compute_score",
                              {**reward, "state_lost_score": 0.0})
    rollouts = [AgentData("lost-0"), AgentData("lost-1")]
    for r in rollouts:
        await call(tool, "echo 42 > answer.txt", r)
        _kill_sandbox(r.extra_fields["tangram"]["trajectory"])
        resp, _, metrics = await call(tool, "cat answer.txt", r)
        # the first line (verl keeps the head of a truncated response) tells the model
        assert resp.text.startswith(STATE_LOST_NOTE[:60]) and metrics["state_lost"], resp.text
    # the reward does not test the empty sandbox: it fails by default, naming why ...
    with pytest.raises(SandboxLost, match="reset during the rollout.*state_lost_score"):
        await score(compute_score, rollouts[0])
    # ... or scores what the config chose, saying so
    out = await score(scored, rollouts[1])
    assert out["reward_status"] == "state_lost" and out["reward_score"] == 0.0
    assert out["infra_error"] is True, out  # a trainer masks it: no outcome of the model
    for r in rollouts:  # closed either way
        assert await gone(url, r.extra_fields["tangram"]["trajectory"])
    await tool.close_all()


def test_a_lost_sandbox_reaches_the_model_and_every_reward(docker_server, monkeypatch):
    import gymnasium
    import skyrl_gym

    import tangram_sdk.integrations.gym  # noqa: F401
    import tangram_sdk.integrations.skyrl  # noqa: F401

    monkeypatch.setenv("TANGRAM_URL", docker_server.url)
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    asyncio.run(_lost(docker_server.url))

    reward = {"command": 'test "$(cat answer.txt)" = 42'}
    for lost_score in (None, 0.5):
        env = gymnasium.make("tangram/Shell-v0", base_url=docker_server.url, token=TOKEN,
                             reward={**reward, "state_lost_score": lost_score}).unwrapped
        env.reset(seed=0)
        env.step("echo 42 > answer.txt")
        _kill_sandbox(env.trajectory)
        obs, _, _, _, info = env.step("cat answer.txt")
        assert obs.startswith(STATE_LOST_NOTE[:60]) and info["state_lost"] is True
        if lost_score is None:
            with pytest.raises(SandboxLost):
                env.step("submit")
        else:
            _, value, terminated, _, info = env.step("submit")
            assert terminated and value == 0.5 and info["reward_status"] == "state_lost"
            assert info["infra_error"] is True, info
        env.close()

    sky = skyrl_gym.make("tangram-shell", env_config={
        "base_url": docker_server.url, "token": TOKEN,
        "reward": {**reward, "state_lost_score": 0.0}})
    sky.init([{"role": "user", "content": "go"}])
    sky.step("<bash>echo 42 > answer.txt</bash>")
    _kill_sandbox(sky.trajectory)
    out = sky.step("<bash>cat answer.txt</bash>")
    assert out["observations"][0]["content"].startswith(STATE_LOST_NOTE[:60])
    assert out["metadata"]["state_lost"] is True
    out = sky.step("<submit/>")
    assert out["done"] and out["metadata"]["reward_status"] == "state_lost"
    assert out["metadata"]["infra_error"] is True, out
    sky.close()



# -- `tangram run` / `serve` refuse what cannot run -----------------------------------------
def _tiny_trace(tmp_path, command: str):
    import pandas as pd

    from traces.schema import COLUMNS, write

    base = {k: v[2] for k, v in COLUMNS.items()}
    rows = [{**base, "task": "t", "trajectory": f"j{j}", "seq": i, "kind": "shell",
             "think_s": 0.0, "t1_s": 0.05, "cpu_cores": "1", "mem_gb": 0.25,
             "command": command} for j in range(2) for i in range(2)]
    return write(pd.DataFrame(rows), tmp_path / "t.csv")


def test_run_exits_non_zero_when_every_action_failed(tmp_path):
    trace = _tiny_trace(tmp_path, "sh -c 'echo no such thing >&2; exit 3'")
    res = subprocess.run([sys.executable, str(ROOT / "cli.py"), "run", "--trace", str(trace),
                          "--out", str(tmp_path / "out"), "--quiet"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr
    assert "every action failed (4/4)" in res.stderr and "no such thing" in res.stderr
    assert "exit code 3" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox users exist only for a root server")
def test_run_and_serve_refuse_a_python_sandbox_users_cannot_reach(tmp_path):
    """A venv in a directory other users cannot enter (the /root trap): its python symlink
    points at a reachable interpreter, the venv and the package are not reachable."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(locked / "venv")],
                   check=True, timeout=120)
    python = locked / "venv" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = subprocess.run([sys.executable, "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # this venv's packages, Tangram's editable install included (its .pth files run)
    (Path(site) / "ours.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    locked.chmod(0o700)
    trace = _tiny_trace(tmp_path, "true")
    for args in (["run", "--trace", str(trace), "--out", str(tmp_path / "out"), "--quiet"],
                 ["serve", "--port", "1", "--state-dir", str(tmp_path / "state")]):
        res = subprocess.run([str(python), str(ROOT / "cli.py"), *args], capture_output=True,
                             text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 2, (args[0], res.stdout, res.stderr)
        assert str(locked) in res.stderr and "chmod o+x" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


def test_serve_warns_when_the_reward_commands_program_is_missing(tmp_path):
    server = start_server(tmp_path / "state", extra_args=(
        "--reward-command", "no-such-program-xyz -q tests"))
    try:
        said = server.log.read_text()
    finally:
        server.stop()
    assert "warning:" in said and "'no-such-program-xyz' not found on PATH" in said, said
    ok = start_server(tmp_path / "ok", extra_args=("--reward-command", "sh -c true"))
    ok.stop()
    assert "warning:" not in ok.log.read_text()


def test_docker_serve_checks_the_reward_command_in_its_images(tmp_path):
    """Docker: the check runs in the sandbox image itself (the default one, on the host's
    /usr with the image's PYTHONPATH): a program it has, no warning; a module it lacks is
    named (the default image has pytest only when `tangram image build` made it)."""
    ok = start_server(tmp_path / "ok", "docker", extra_args=("--reward-command", "sh -c true"))
    ok.stop()
    assert "warning:" not in ok.log.read_text(), ok.log.read_text()
    bad = start_server(tmp_path / "bad", "docker", extra_args=(
        "--reward-command", "python3 -m no_such_module_xyz tests"))
    said = bad.log.read_text()
    bad.stop()
    assert "warning:" in said and "no module 'no_such_module_xyz'" in said, said
    assert "docker image 'tangram-sandbox:1'" in said, said


def test_a_transient_failure_is_retried_and_logged_a_wrong_token_is_not(caplog):
    """call_retrying against a real HTTP server on 127.0.0.1 that answers 503 once."""
    import http.server
    import threading

    from tangram_sdk.client import TangramSyncClient
    from tangram_sdk.integrations.common import call_retrying

    answers = [(503, {"detail": "the server is shutting down"}), (201, {"id": "t1", "task": "x"}),
               (401, {"detail": "missing or wrong bearer token"})]

    class Stub(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            status, body = answers.pop(0)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with TangramSyncClient(f"http://127.0.0.1:{server.server_port}", TOKEN) as client:
            with caplog.at_level("WARNING", logger="tangram.integrations.common"):
                assert call_retrying(lambda: client.open_trajectory(), "opening") == "t1"
                assert "opening: HTTP 503" in caplog.text and "trying again" in caplog.text
                with pytest.raises(TangramError):
                    call_retrying(lambda: client.open_trajectory(), "opening")
        assert "opening failed: the server refused the token (HTTP 401)" in caplog.text
        assert not answers  # one try for the 401: not transient
    finally:
        server.shutdown()
