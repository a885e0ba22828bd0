"""The adapters against the real frameworks and a real `tangram serve`.

* verl 0.9.1: its tool modules are imported torch-free (see verl_torchfree.py: the
  package ``__init__`` files that import torch are skipped, the modules themselves
  are verl's own). The tool is constructed by verl's real loader
  ``initialize_tools_from_config`` from ``examples/verl_tool.yaml``; every tool call
  goes through ``ToolAgentLoop._call_tool`` compiled from verl's installed source
  (its module imports torch, the method does not need it), with verl's own
  ``FunctionCall``; the reward through ``compute_score`` loaded by verl's
  ``get_custom_reward_fn`` and called by ``NaiveRewardManager.run_single`` (both
  compiled from verl's source the same way, their modules import torch), on a
  one-row stand-in for ``DataProto`` (numpy arrays where verl has tensors);
  teachers with verl's ``_get_teacher_sampling_params`` and
  ``extract_prompt_logprobs`` (sources).
* gymnasium 1.4: ``gymnasium.make`` and the real ``check_env``.
* skyrl-gym 0.4: ``skyrl_gym.make`` and the real ``BaseTextEnv`` contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, TOKEN
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

from verl.tools.base_tool import BaseTool  # noqa: E402
from verl.tools.schemas import ToolResponse  # noqa: E402

from tangram_sdk.integrations.common import RewardConfig  # noqa: E402
from tangram_sdk.integrations.verl import TangramTool, rollout_scope  # noqa: E402


def run(coro):
    return asyncio.run(coro)


async def verl_call_tool(tool, args: dict, agent_data) -> tuple:
    """verl 0.9.1's own ToolAgentLoop._call_tool (its source, unmodified) on ``tool``."""
    loop = stock_loop([tool], max_tool_response_length=4096)
    return await loop._call_tool(function_call(tool.name, json.dumps(args)),
                                 agent_data.tools_kwargs, agent_data)


_AGENTS: dict[str, AgentData] = {}


def agent(request_id: str) -> AgentData:
    """The rollout's AgentData (one per name in a test, like one rollout's)."""
    return _AGENTS.setdefault(request_id, AgentData(request_id))


def key(request_id: str) -> str:
    """The sandbox key TangramTool gave that rollout (in its extra_fields)."""
    return _AGENTS[request_id].extra_fields["tangram"]["rollout"]


async def _gone(url: str, trajectory: str) -> bool:
    async with TangramClient(url, TOKEN) as tg:
        try:
            await tg.get_file(trajectory, "x")
        except TangramError as e:
            return e.status == 404 and "unknown trajectory" in str(e.detail)
    return False


# -- importable without any framework ------------------------------------------------------
def test_integrations_import_without_any_framework():
    code = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('verl', 'gymnasium', 'skyrl_gym', 'torch'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import tangram_sdk.integrations, tangram_sdk.integrations.common
from tangram_sdk.integrations.verl import HAVE_VERL, TangramTool
assert not HAVE_VERL
tool = TangramTool({'base_url': 'http://127.0.0.1:1', 'token': 't', 'check_server': False})
schema = tool.get_openai_tool_schema()['function']
assert tool.name == 'shell' and schema['parameters']['required'] == ['command']
for mod, hint in (('gym', 'pip install gymnasium'), ('skyrl', 'pip install skyrl-gym')):
    try:
        importlib.import_module('tangram_sdk.integrations.' + mod)
    except ImportError as e:
        assert hint in str(e), e
    else:
        raise SystemExit(mod + ' imported without its framework')
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", "import importlib\n" + code], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_adapter_config_errors_name_the_field():
    for config, field in (({"token": "t"}, "config.base_url"),
                          ({"base_url": "u", "token": "t", "mem_gb": -1}, "config.mem_gb"),
                          ({"base_url": "u", "token": "t", "kindd": "x"}, "unknown key"),
                          ({"base_url": "u", "token": "t", "reward": {"cmd": "x"}}, "config.reward"),
                          ({"base_url": "u", "token": "t",
                            "reward": {"command": "pytest", "elastic": True, "shell": True}},
                           "config.reward.elastic"),
                          ({"base_url": "u", "token": "t", "cpu": "two"}, "config.cpu"),
                          ({"base_url": "u", "token": "t", "cpu": "8-1"}, "config.cpu"),
                          ({"base_url": "u", "token": "t", "cpu": 1.5}, "config.cpu"),
                          ({"base_url": "u", "token": "t", "mem_gb": 5000}, "config.mem_gb"),
                          ({"base_url": "u", "token": "t", "timeout_s": 1e9}, "config.timeout_s"),
                          ({"base_url": "u", "token": "t", "idle_ttl_s": 0}, "config.idle_ttl_s"),
                          ({"base_url": "u", "token": "t", "reward": {"command": "x", "cpu": "1-x"}},
                           "config.reward.cpu")):
        env = {k: v for k, v in os.environ.items() if k != "TANGRAM_URL"}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "environ", env)
            with pytest.raises(ValueError, match=re.escape(field)):
                TangramTool(config)


def test_verl_loader_refuses_a_malformed_tool_config_at_load(tmp_path, monkeypatch):
    """A bad `cpu` fails when verl builds the tool, naming the field, not as a 422 the
    model reads on every call."""
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    good = (ROOT / "examples" / "verl_tool.yaml").read_text()
    assert 'cpu: "1"  ' in good
    bad = tmp_path / "tool.yaml"
    bad.write_text(good.replace('cpu: "1"  ', 'cpu: "one"', 1))
    with pytest.raises(ValueError, match=r"config\.cpu: expected .4., .1-32. or .1,2,4,8., got .one."):
        tool_registry.initialize_tools_from_config(str(bad))
    for n_cores in ("2", "1-8", "1,2,4", 3):
        assert TangramTool({"base_url": "u", "token": "t", "cpu": n_cores,
                            "check_server": False}).settings.cpu == \
            str(n_cores)


# -- verl ----------------------------------------------------------------------------------
async def _verl(url: str, yaml_path: Path) -> None:
    tools = tool_registry.initialize_tools_from_config(str(yaml_path))
    assert len(tools) == 1
    tool = tools[0]
    assert isinstance(tool, BaseTool) and isinstance(tool, TangramTool)
    assert tool.name == "shell"
    schema = tool.get_openai_tool_schema().model_dump(exclude_none=True)
    assert schema["function"]["parameters"]["required"] == ["command"]

    async with rollout_scope():
        # two calls of one rollout share its sandbox (verl creates and releases per call)
        a = agent("rollout-a")
        resp, reward, metrics = await verl_call_tool(
            tool, {"command": "echo 42 > answer.txt && pwd"}, a)
        assert isinstance(resp, ToolResponse) and reward == 0.0
        assert resp.text.rstrip().endswith("[exit code 0]") and metrics["exit_code"] == 0
        sandbox = tool.sandbox_of(key("rollout-a"))
        resp, _, _ = await verl_call_tool(tool, {"command": "cat answer.txt"}, a)
        assert resp.text.startswith("42\n") and tool.sandbox_of(key("rollout-a")) == sandbox
        # another rollout has its own sandbox; a failure's exit code reaches the model
        resp, _, metrics = await verl_call_tool(tool, {"command": "cat answer.txt"},
                                                agent("rollout-b"))
        assert "No such file" in resp.text and re.search(r"\[exit code [1-9]\d*\]$", resp.text)
        assert tool.sandbox_of(key("rollout-b")) not in (None, sandbox)
        # parallel calls of one rollout (max_parallel_calls) open one sandbox
        outs = await asyncio.gather(*(verl_call_tool(tool, {"command": f"echo {i} >> par.txt"},
                                                     agent("rollout-c")) for i in range(4)))
        assert all(o[2]["exit_code"] == 0 for o in outs)
        resp, _, _ = await verl_call_tool(tool, {"command": "wc -l < par.txt"}, agent("rollout-c"))
        assert resp.text.startswith("4\n")
        # the model cannot pick the kind or the resources; a missing command is explained
        resp, _, metrics = await verl_call_tool(
            tool, {"command": "true", "kind": "reward_test", "cpu": "8", "mem_gb": 99}, a)
        assert metrics["units"] <= 1 and metrics["status"] == "ok"  # cpu "8" would not fit
        resp, _, metrics = await verl_call_tool(tool, {"cmd": "ls"}, a)
        assert '"command"' in resp.text and metrics["error"] == "missing command"
        # the reward command runs in the rollout's sandbox (the YAML's, overridden here)
        tool.settings = dataclasses.replace(
            tool.settings, reward=RewardConfig('test "$(cat answer.txt)" = 42'))
        assert await tool.calc_reward("any", agent_data=a) == 1.0
        assert await tool.calc_reward("any", agent_data=agent("rollout-b")) == 0.0
        opened = [tool.sandbox_of(key(r)) for r in ("rollout-a", "rollout-b", "rollout-c")]
    # leaving the rollout scope closed every sandbox it opened
    assert all(tool.sandbox_of(key(r)) is None for r in ("rollout-a", "rollout-b", "rollout-c"))
    for tid in opened:
        assert await _gone(url, tid)

    # timeouts are reported to the model; the idle TTL closes an abandoned rollout's sandbox
    quick = TangramTool({"type": "native", "base_url": url, "token": TOKEN, "timeout_s": 0.5,
                         "idle_ttl_s": 0.5})
    resp, _, metrics = await verl_call_tool(quick, {"command": "sleep 5"}, agent("slow"))
    assert metrics["status"] == "timeout" and "[timed out" in resp.text
    abandoned = quick.sandbox_of(key("slow"))
    deadline = time.monotonic() + 60
    while quick.sandbox_of(key("slow")) is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert quick.sandbox_of(key("slow")) is None and await _gone(url, abandoned)

    # closing a rollout while one of its calls runs waits for the call, then closes (a
    # timeout far above the call's: beside stress --cpu 2 its 0.3 s took over 0.5 s)
    patient = TangramTool({"type": "native", "base_url": url, "token": TOKEN, "timeout_s": 120})
    busy = asyncio.create_task(verl_call_tool(patient, {"command": "sleep 0.3; echo done"},
                                              agent("busy")))
    while "tangram" not in agent("busy").extra_fields or patient.sandbox_of(key("busy")) is None:
        await asyncio.sleep(0.02)
    busy_tid = patient.sandbox_of(key("busy"))
    await asyncio.sleep(0.1)
    await patient.close_rollout(key("busy"))
    assert (await busy)[0].text.startswith("done") and await _gone(url, busy_tid)

    # the classic lifecycle (no agent_data): a sandbox per instance, closed by release
    iid, _ = await tool.create("classic-1")
    await tool.execute(iid, {"command": "echo 42 > answer.txt"})
    resp, _, _ = await tool.execute(iid, {"command": "cat answer.txt"})
    assert resp.text.startswith("42")
    classic = tool.sandbox_of(iid)
    assert await tool.calc_reward(iid) == 1.0
    await tool.release(iid)
    assert tool.sandbox_of(iid) is None and await _gone(url, classic)
    await tool.close_all()
    await quick.close_all()


def test_verl_loader_builds_the_tool_and_a_rollout_keeps_its_sandbox(process_server,
                                                                    monkeypatch):
    monkeypatch.setenv("TANGRAM_URL", process_server.url)  # the YAML reads both from the env
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    run(_verl(process_server.url, ROOT / "examples" / "verl_tool.yaml"))


async def _verl_reward_path(url: str) -> None:
    """The stock loop, then verl's reward path: its NaiveRewardManager.run_single (source)
    merges tool_extra_fields into extra_info and calls compute_score, loaded by verl's
    get_custom_reward_fn (source) from the two config lines; the sandbox is then closed."""
    import numpy as np
    from verl.utils.import_utils import load_extern_object

    tools = tool_registry.initialize_tools_from_config(str(ROOT / "examples" / "verl_tool.yaml"))
    tool = tools[0]
    # the shipped reward (pytest -n <cores>) needs pytest in the sandbox: the process
    # backend has the server's python; a plain command keeps this test about the path
    tool.settings = dataclasses.replace(
        tool.settings, reward=RewardConfig('test "$(cat answer.txt)" = 42'))
    compute_score = custom_reward_fn("pkg://tangram_sdk.integrations.verl", "compute_score")
    raw = load_extern_object(module_path="pkg://tangram_sdk.integrations.verl",
                             object_name="compute_score")
    assert inspect.iscoroutinefunction(raw) and inspect.iscoroutinefunction(compute_score)

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    manager = naive_reward_manager(compute_score, Tokenizer())

    # full_determinism: every step names its rollouts det-<priority>; each step's
    # rollout gets its own sandbox, never the previous step's files
    step1, step2 = AgentData("det-0"), AgentData("det-0")
    await verl_call_tool(tool, {"command": "echo 42 > answer.txt"}, step1)
    resp, _, _ = await verl_call_tool(tool, {"command": "cat answer.txt"}, step2)
    assert "No such file" in resp.text
    tid1 = step1.extra_fields["tangram"]["trajectory"]
    tid2 = step2.extra_fields["tangram"]["trajectory"]
    assert tid1 != tid2

    async def score(agent_data: AgentData) -> dict:
        # what the agent loop hands the reward loop for one rollout: its output's
        # extra_fields (agent_data.extra_fields plus turn_scores / tool_rewards)
        extra_fields = {**agent_data.extra_fields, "turn_scores": [], "tool_rewards": []}
        data = OneRowData(
            {"responses": np.array([5, 6, 7, 0]), "attention_mask": np.array([1, 1, 1, 1, 1, 0])},
            {"data_source": "tangram", "reward_model": {"ground_truth": None},
             "extra_info": {"index": 0}, "tool_extra_fields": extra_fields,
             "__num_turns__": 3, "reward_scores": {}})
        out = await manager(data)
        return out["reward_extra_info"] | {"reward_score": out["reward_score"]}

    first = await score(step1)
    assert first == {"score": 1.0, "reward_exit_code": 0, "reward_status": "ok",
                     "reward_output": "", "reward_error": "", "infra_error": False,
                     "reward_score": 1.0}, first
    second = await score(step2)
    assert second["reward_exit_code"] == 1 and second["reward_status"] == "failed", second
    assert second["reward_score"] == 0.0 and second["infra_error"] is False, second
    assert await _gone(url, tid1) and await _gone(url, tid2)  # scored, then closed
    # scoring again (or after the idle TTL closed it) is 0.0 and says why; no tool call: same
    again = await score(step1)
    assert again["reward_status"] == "error" and again["infra_error"] is True, again
    assert "closed before the reward ran" in again["reward_error"], again
    never = await score(AgentData("det-1"))
    assert never["reward_status"] == "no_sandbox" and never["infra_error"] is False, never
    # reward_kwargs (custom_reward_function.reward_kwargs) override the tool's command
    step3 = AgentData("det-2")
    await verl_call_tool(tool, {"command": "echo 7 > answer.txt"}, step3)
    seven = custom_reward_fn("pkg://tangram_sdk.integrations.verl", "compute_score",
                             {"command": 'test "$(cat answer.txt)" = 7'})
    out = await naive_reward_manager(seven, Tokenizer())(OneRowData(
        {"responses": np.array([1]), "attention_mask": np.array([1, 1])},
        {"data_source": "x", "reward_model": {"ground_truth": None}, "extra_info": {},
         "tool_extra_fields": dict(step3.extra_fields)}))
    assert out["reward_score"] == 1.0
    await tool.close_all()


def test_verl_reward_path_scores_in_the_rollouts_sandbox_and_closes_it(process_server,
                                                                      monkeypatch):
    monkeypatch.setenv("TANGRAM_URL", process_server.url)
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    run(_verl_reward_path(process_server.url))


# -- gymnasium -----------------------------------------------------------------------------
def test_gymnasium_check_env_and_an_episode(docker_server):
    """check_env sends random text as commands: the docker backend sandboxes them."""
    process_server = docker_server
    import gymnasium
    from gymnasium.utils.env_checker import check_env

    import tangram_sdk.integrations.gym  # noqa: F401  (registers tangram/Shell-v0)

    kwargs = {"base_url": process_server.url, "token": TOKEN, "task": "gym",
              "reward": {"command": "grep -q hello task.md"}, "max_action_chars": 256}
    env = gymnasium.make("tangram/Shell-v0", **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    ours = [str(w.message) for w in caught if "gymnasium" in str(w.filename)
            and "render" not in str(w.message)]
    assert not ours, ours
    obs, info = env.reset(seed=7, options={"files": {"task.md": "hello world\n"}})
    assert obs == "" and info == {"step": 0}
    obs, reward, terminated, truncated, info = env.step("cat task.md; exit 2")
    assert obs.startswith("hello world\n") and obs.rstrip().endswith("[exit code 2]")
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info == {"step": 1, "exit_code": 2, "status": "ok"}
    assert "No such file" not in obs
    obs, reward, terminated, truncated, info = env.step("submit")
    assert (reward, terminated) == (1.0, True) and info["reward_exit_code"] == 0
    env.close()
    env.close()  # closing twice is allowed

    # without a reward command `submit` ends the episode; nothing named submit runs
    plain = gymnasium.make("tangram/Shell-v0", base_url=process_server.url, token=TOKEN)
    plain.reset()
    obs, reward, terminated, _, info = plain.step("submit")
    assert terminated and reward == 0.0 and "no reward command" in obs
    plain.close()


def _vector_run(envs, n: int) -> list[dict]:
    """Env i submits at step i + 1 (staggered); the others run a command."""
    obs, info = envs.reset(seed=0, options={"files": {"task.md": "hello\n"}})
    assert list(obs) == [""] * n
    steps = []
    for t in range(n):
        actions = tuple("submit" if i == t else f"echo env{i} step{t}; grep -c hello task.md"
                        for i in range(n))
        obs, reward, terminated, truncated, info = envs.step(actions)
        steps.append({"obs": list(obs), "reward": list(reward),
                      "terminated": list(terminated), "info": info})
    return steps


def _check_vector(steps: list[dict], n: int) -> None:
    for t, s in enumerate(steps):
        assert s["terminated"] == [i == t for i in range(n)]
        assert s["reward"][t] == 1.0 and sum(s["reward"]) == 1.0
        info = s["info"]
        # one type per key: exit codes of the envs that ran a command, masked elsewhere
        for i in range(n):
            if i == t:
                assert info["status"][i] == "submitted" and info["reward_exit_code"][i] == 0
                assert not info["_exit_code"][i]
            elif i > t:
                assert info["exit_code"][i] == 0 and info["_exit_code"][i]
                assert s["obs"][i].startswith(f"env{i} step{t}\n1\n")
        assert str(info["exit_code"].dtype).startswith("int")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_gymnasium_vector_envs_with_staggered_submits(process_server, kind):
    import gymnasium

    import tangram_sdk.integrations.gym  # noqa: F401

    def make():
        return gymnasium.make("tangram/Shell-v0", base_url=process_server.url, token=TOKEN,
                              task="gym-vec", reward={"command": "grep -q hello task.md"})

    n = 4
    envs = (gymnasium.vector.SyncVectorEnv([make] * n) if kind == "sync" else
            gymnasium.vector.AsyncVectorEnv([make] * n, shared_memory=False))
    try:
        _check_vector(_vector_run(envs, n), n)
    finally:
        envs.close()


# -- SkyRL-gym -----------------------------------------------------------------------------
def test_skyrl_make_and_an_episode(process_server):
    import skyrl_gym
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    import tangram_sdk.integrations.skyrl  # noqa: F401  (registers tangram-shell)

    env = skyrl_gym.make("tangram-shell",
                         env_config={"base_url": process_server.url, "token": TOKEN,
                                     "task": "skyrl"},
                         extras={"max_turns": 5, "files": {"task.md": "write 42 to answer.txt"},
                                 "reward_command": 'test "$(cat answer.txt)" = 42'})
    assert isinstance(env, BaseTextEnv) and env.max_turns == 5
    prompt = [{"role": "user", "content": "Solve the task in task.md."}]
    assert env.init(prompt) == (prompt, {})
    out = env.step("I think the answer is 42.")  # no tag: a hint, nothing runs
    assert not out["done"] and "<bash>" in out["observations"][0]["content"]
    out = env.step("Reading it: <bash>cat task.md</bash>")
    assert out["observations"][0]["content"].startswith("write 42 to answer.txt")
    assert out["observations"][0]["role"] == "user" and out["reward"] == 0.0
    out = env.step("<bash>echo 42 > answer.txt && pwd</bash>")
    assert out["metadata"]["exit_code"] == 0 and "answer.txt" not in out["observations"][0]["content"]
    out = env.step("Done. <submit/>")
    assert out["done"] and out["reward"] == 1.0 and out["observations"] == []
    tid = env.trajectory
    env.close()
    env.close()
    assert run(_gone(process_server.url, tid))

    # without a reward command: `submit` as a bare word is never run; the tag ends at 0
    env = skyrl_gym.make("tangram-shell", env_config={"base_url": process_server.url,
                                                      "token": TOKEN}, extras={})
    env.init([])
    out = env.step("submit")
    assert not out["done"] and "No command found" in out["observations"][0]["content"]
    out = env.step("<submit/>")
    assert out["done"] and out["reward"] == 0.0
    env.close()


def test_skyrl_many_envs_the_way_its_generator_runs_them(process_server):
    """SkyRL's generator makes one env per sample (skyrl_gym.make with the sample's
    extras) and runs their init / step / close in a thread pool, all samples at once."""
    import concurrent.futures

    import skyrl_gym

    import tangram_sdk.integrations.skyrl  # noqa: F401

    config = {"base_url": process_server.url, "token": TOKEN, "task": "skyrl-many"}

    async def agent_loop(i: int, pool) -> tuple[float, str]:
        loop = asyncio.get_running_loop()
        env = skyrl_gym.make("tangram-shell", env_config=config,
                             extras={"max_turns": 4, "files": {"n.txt": f"{i}\n"},
                                     "reward_command": f'test "$(cat out.txt)" = {i * i}'})
        await loop.run_in_executor(pool, env.init, [{"role": "user", "content": "square n"}])
        # odd samples answer wrong: their reward must be theirs, not a neighbour's
        square = i * i if i % 2 == 0 else i * i + 1
        out = await loop.run_in_executor(pool, env.step,
                                         f"<bash>echo {square} > out.txt; cat n.txt</bash>")
        seen = out["observations"][0]["content"]
        out = await loop.run_in_executor(pool, env.step, "<submit/>")
        tid = env.trajectory
        await loop.run_in_executor(pool, env.close)
        assert await _gone(process_server.url, tid)
        return out["reward"], seen

    async def main() -> list[tuple[float, str]]:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return await asyncio.gather(*(agent_loop(i, pool) for i in range(6)))

    results = run(main())
    assert [r for r, _ in results] == [1.0 if i % 2 == 0 else 0.0 for i in range(6)]
    assert [seen.split("\n")[0] for _, seen in results] == [str(i) for i in range(6)]


# -- the README's Python example, as written ----------------------------------------------
def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert blocks, "README.md has no python example"
    return blocks[0]


@pytest.mark.parametrize("server", ["process_server", "docker_server"])
def test_readme_python_example_runs_against_a_live_server(server, request, tmp_path):
    url = request.getfixturevalue(server).url
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    env = {**os.environ, "TANGRAM_URL": url, "TANGRAM_TOKEN": TOKEN}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.splitlines()[0])
    assert result["status"] == "ok" and result["exit_code"] == 0  # the patched code passes
    assert "return a + b" in out.stdout


# -- the verl tool on the docker backend: a container per rollout ---------------------------
async def _verl_docker(url: str) -> None:
    tool = TangramTool({"type": "native", "base_url": url, "token": TOKEN, "task": "verl-docker",
                        "mem_gb": 0.1})
    async with rollout_scope():
        a = agent("docker-rollout")
        resp, _, _ = await verl_call_tool(tool, {"command": "echo 42 > answer.txt && pwd"}, a)
        assert resp.text == "/work\n[exit code 0]"
        resp, _, _ = await verl_call_tool(tool, {"command": "cat answer.txt"}, a)
        assert resp.text == "42\n[exit code 0]"
        # past the sandbox's memory limit the kernel kills the command; the model is told why
        resp, _, metrics = await verl_call_tool(
            tool, {"command": "python3 -c 'b = bytearray(600 * 2**20); print(len(b))'"}, a)
        assert "out of memory" in resp.text and metrics["exit_code"] in (137, -9), resp.text
        tid = tool.sandbox_of(key("docker-rollout"))
    assert await _gone(url, tid)


def test_verl_tool_on_docker_shares_a_container_and_reports_oom(docker_server):
    run(_verl_docker(docker_server.url))


# -- the shipped reward on the docker backend's sandbox image (pytest + pytest-xdist) -------
PYTEST_IMAGE = "tangram-sandbox-test-pytest:1"


@pytest.fixture(scope="module")
def pytest_image_server(tmp_path_factory):
    """A docker server whose `coding` task (the shipped tool config's) runs in the image
    `tangram image build` makes: wheels from PyPI (or TANGRAM_WHEELS, a directory)."""
    wheels = os.environ.get("TANGRAM_WHEELS")
    args = [sys.executable, str(ROOT / "cli.py"), "image", "build", "--tag", PYTEST_IMAGE]
    out = subprocess.run(args + (["--wheels", wheels] if wheels else []), capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    if out.returncode != 0 and "cannot download" in out.stderr + out.stdout:
        # a required component is missing: CI fails, it does not skip past the test
        pytest.fail("the pytest sandbox image needs wheels of pytest + pytest-xdist: PyPI is "
                    "unreachable and TANGRAM_WHEELS is not set. Download them where PyPI is "
                    "reachable (pip download --only-binary=:all: pytest pytest-xdist -d DIR) "
                    "and set TANGRAM_WHEELS=DIR. pip said: " + out.stderr[-300:],
                    pytrace=False)
    assert out.returncode == 0 and "pytest + pytest-xdist" in out.stdout, out.stdout + out.stderr
    from conftest import start_server

    server = start_server(tmp_path_factory.mktemp("serve-pytest-image"), "docker",
                          extra_args=("--image", f"coding={PYTEST_IMAGE}"))
    yield server
    server.stop()


async def _reward_scores_a_real_fix(url: str) -> None:
    import base64

    from verl.utils.import_utils import load_extern_object

    with contextlib.redirect_stdout(sys.stderr):  # verl's loader prints the schema
        tool = tool_registry.initialize_tools_from_config(
            str(ROOT / "examples" / "verl_tool.yaml"))[0]
    reward = tool.settings.reward
    assert reward is not None and reward.elastic and reward.command == "python3 -m pytest -q tests"
    compute_score = load_extern_object(module_path="pkg://tangram_sdk.integrations.verl",
                                       object_name="compute_score")
    task = ROOT / "examples" / "reward_fix"
    setup = " && ".join(
        f"mkdir -p {Path(rel).parent} && echo {base64.b64encode(p.read_bytes()).decode()} "
        f"| base64 -d > {rel}"
        for p in sorted(task.rglob("*.py")) for rel in [str(p.relative_to(task))])

    async def rollout(request_id: str, fix: bool) -> dict:
        a = AgentData(request_id)
        resp, _, metrics = await verl_call_tool(tool, {"command": setup}, a)
        assert metrics["exit_code"] == 0, resp.text
        if fix:  # the model's fix
            resp, _, _ = await verl_call_tool(tool, {"command": "sed -i 's/a - b/a + b/' calc.py"}, a)
        tid = a.extra_fields["tangram"]["trajectory"]
        extra_info = dict(a.extra_fields)
        out = await compute_score(data_source="reward_fix", solution_str="", ground_truth=None,
                                  extra_info=extra_info)
        assert await _gone(url, tid)
        return out

    unfixed, fixed = await asyncio.gather(rollout("det-0", False), rollout("det-1", True))
    assert unfixed["score"] == 0.0 and unfixed["reward_exit_code"] == 1, unfixed
    assert unfixed["reward_status"] == "failed" and " failed" in unfixed["reward_output"], unfixed
    assert fixed["score"] == 1.0 and fixed["reward_exit_code"] == 0, fixed
    assert fixed["reward_status"] == "ok" and not fixed["reward_error"], fixed
    await tool.close_all()


def test_shipped_reward_scores_a_real_fix_in_the_pytest_image(pytest_image_server, monkeypatch):
    monkeypatch.setenv("TANGRAM_URL", pytest_image_server.url)
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    run(_reward_scores_a_real_fix(pytest_image_server.url))


# -- teachers and reward models from Tangram's GPU pool (the cpu GPU device) ---------------
@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    from conftest import start_server

    server = start_server(tmp_path_factory.mktemp("serve-gpu"), "process", extra_args=(
        "--gpu-cluster", str(ROOT / "executor/backends/gpu/clusters/cpu-tiny.yaml"),
        "--gpu-device", "cpu"))
    yield server
    server.stop()


def test_verl_teachers_and_a_reward_model_served_from_the_gpu_pool(gpu_server):
    """verl's teacher request (its own _get_teacher_sampling_params) through
    TangramTeacherClient: the rows equal what verl's vLLM server makes of the same
    vLLM-shaped answer (its own extract_prompt_logprobs)."""
    from verl_torchfree import compile_function

    from tangram_sdk.integrations.teacher import teacher_clients

    sampling = compile_function("experimental/teacher_loop/teacher_manager.py",
                                "_get_teacher_sampling_params", {"Any": object})
    params = sampling(types.SimpleNamespace(inference=types.SimpleNamespace(temperature=0.7)),
                      types.SimpleNamespace(topk=8, loss_settings=types.SimpleNamespace(
                          use_topk=False)))
    assert params == {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0,
                      "detokenize": False}
    extract = compile_function("workers/rollout/vllm_rollout/utils.py",
                               "extract_prompt_logprobs", {"Optional": object})
    clients = teacher_clients({"math": "teacher0", "code": "teacher1"}, gpu_server.url, TOKEN)
    seqs = {"math": [5, 17, 300, 2, 9], "code": [1, 2, 3, 4, 5, 6, 7]}

    async def ask() -> dict:
        outs = await asyncio.gather(*(clients[k].generate(request_id=k, prompt_ids=seqs[k],
                                                          sampling_params=params)
                                      for k in seqs))
        return dict(zip(seqs, outs, strict=True))

    outs = run(ask())
    for k, seq in seqs.items():
        ids, lps = outs[k].extra_fields["prompt_ids"], outs[k].extra_fields["prompt_logprobs"]
        assert len(ids) == len(lps) == len(seq)  # verl's assert in compute_teacher_logprobs
        # the raw answer, as vLLM objects, through verl's own extraction
        raw = httpx.post(gpu_server.url + "/v1/completions", json={
            "model": clients[k].service, "prompt": seq, **params},
            headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120).json()
        entries = [None] + [{t: types.SimpleNamespace(**v) for t, v in e.items()}
                            for e in raw["choices"][0]["prompt_logprobs"][1:]]
        verl_view: dict = {}
        extract(types.SimpleNamespace(prompt_logprobs=entries), 0, verl_view)
        assert verl_view == {"prompt_ids": ids, "prompt_logprobs": lps}
        assert [i[0] for i in ids[:-1]] == seq[1:] and all(lp[0] <= 0 for lp in lps)
    assert outs["math"].extra_fields != outs["code"].extra_fields

    h = {"Authorization": f"Bearer {TOKEN}"}
    judged = httpx.post(gpu_server.url + "/classify", json={
        "model": "judge", "input": [[3, 4, 5], [6, 7]], "use_activation": False},
        headers=h, timeout=120).json()
    assert len(judged["data"]) == 2 and judged["data"][-1]["probs"][-1] <= 0  # a log-prob
    for body, why in (({"model": "teacher0", "prompt": "text"}, "token ids, not text"),
                      ({"model": "teacher0", "prompt": [1, 2], "max_tokens": 5}, "max_tokens"),
                      ({"model": "teacher0", "prompt": [1, 2], "prompt_logprobs": 5},
                       "top-k is not served"),
                      ({"model": "nope", "prompt": [1, 2]}, "unknown service 'nope'"),
                      ({"model": "teacher0", "prompt": [1, 99999]}, "not an id")):
        r = httpx.post(gpu_server.url + "/v1/completions", json=body, headers=h, timeout=120)
        assert r.status_code == 422 and why in r.text, (body, r.text)
    gpus = httpx.get(gpu_server.url + "/v1/gpus", headers=h, timeout=30).json()
    assert gpus["services"]["teacher0"]["requests"] >= 2
    assert gpus["services"]["teacher1"]["requests"] >= 2 and gpus["services"]["judge"]["requests"]


def test_verl_group_setup_prepares_once_and_forks_each_rollout(process_server):
    """A GRPO group through verl's own _call_tool: the dataset's create_kwargs name the
    group; its sandbox is prepared once (group_setup) and each rollout starts as a copy."""
    async def go() -> None:
        tool = TangramTool({"base_url": process_server.url, "token": TOKEN, "task": "grpo",
                            "group_setup": {"command": "echo prepared >> state.txt"}})
        rollouts = [AgentData(f"grpo-{i}") for i in range(4)]
        for a in rollouts:
            a.tools_kwargs = {tool.name: {"create_kwargs": {"group": "prompt-7"}}}
        outs = await asyncio.gather(*(verl_call_tool(
            tool, {"command": f"cat state.txt && echo {i} > mine.txt"}, a)
            for i, a in enumerate(rollouts)))
        for resp, _, _ in outs:
            assert resp.text.startswith("prepared\n"), resp.text  # one setup, copied
        tids = {a.extra_fields["tangram"]["trajectory"] for a in rollouts}
        assert len(tids) == 4 and list(tool._templates) == ["prompt-7"]
        template = tool._templates["prompt-7"].ready.result()
        assert template not in tids
        resp, _, _ = await verl_call_tool(tool, {"command": "cat mine.txt"}, rollouts[2])
        assert resp.text.startswith("2\n")  # each copy its own files
        await tool.close_all()
        assert await _gone(process_server.url, template)
        with pytest.raises(ValueError, match="group_setup.command"):
            TangramTool({"base_url": "http://x", "token": "t", "group_setup": {}})

    run(go())


def test_skyrl_group_setup_prepares_once_per_group(process_server):
    """Samples of one GRPO group (extras group): one setup, each its own copy; the
    template closes itself once group_size copies were made."""
    import skyrl_gym

    import tangram_sdk.integrations.skyrl  # noqa: F401
    from tangram_sdk.client import TangramSyncClient

    config = {"base_url": process_server.url, "token": TOKEN, "task": "skyrl-grpo",
              "group_setup": {"command": "echo prepared >> state.txt", "group_size": 3}}
    envs = [skyrl_gym.make("tangram-shell", env_config=config,
                           extras={"group": "prompt-3", "max_turns": 5}) for _ in range(3)]
    prompt = [{"role": "user", "content": "go"}]

    def listed(c: TangramSyncClient) -> list[dict]:
        return [t for t in c.trajectories() if t["task"] == "skyrl-grpo"]

    try:
        with TangramSyncClient(process_server.url, TOKEN) as c:
            for i, env in enumerate(envs[:2]):
                env.init(prompt)
                out = env.step(f"<bash>cat state.txt && echo {i} > mine.txt</bash>")
                assert out["observations"][0]["content"].startswith("prepared\n"), out
            assert envs[0].trajectory != envs[1].trajectory
            out = envs[0].step("<bash>cat mine.txt</bash>")
            assert out["observations"][0]["content"].startswith("0\n")
            # one template beside the 2 copies; its actions: its setup, once, and a fork
            # per copy (a fork is an action of its source, issue 45 #7)
            templates = [t for t in listed(c) if t["id"].startswith("group-")]
            assert len(templates) == 1 and templates[0]["actions"] == 1 + 2, listed(c)
            out = envs[1].step("<bash>cat state.txt</bash>")  # (setup appends: once)
            assert out["observations"][0]["content"].count("prepared") == 1, out
            # the group's last copy: the template is no longer needed, and closes
            envs[2].init(prompt)
            assert {t["id"] for t in listed(c)} == {e.trajectory for e in envs}, listed(c)
    finally:
        for env in envs:
            env.close()
    with TangramSyncClient(process_server.url, TOKEN) as c:
        assert listed(c) == []
    with pytest.raises(ValueError, match="group_setup"):
        skyrl_gym.make("tangram-shell", env_config={"base_url": "http://x", "token": "t"},
                       extras={"group": "g"})
