"""Issue 47 #3-#5, through the frameworks' own code against a real `tangram serve`
(verl 0.9.1 torch-free as tests/verl_torchfree.py explains; skyrl-gym 0.4):

* #3 GRPO group templates close themselves, with no close_all / close_group from the
  framework: once ``group_setup.group_size`` copies were made, or by the idle sweep
  (``group_setup.idle_ttl_s``). verl's flow (its loader, ``_call_tool``, then its
  ``NaiveRewardManager.run_single`` and ``get_custom_reward_fn``) and SkyRL's (make /
  init / step / close on a thread pool) at 64 rollouts end with 0 open trajectories of
  their task, asked of the server's list endpoint.
* #4 every ``reward_status`` through verl's reward manager, each with its documented
  score and ``infra_error``; a rollout that deletes its own tests is ``failed``; a
  failed ``group_setup`` is ``setup_failed`` (never ``no_sandbox``).
* #5 the reward workers' token is checked at load when TANGRAM_URL is unset too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import sys

import numpy as np
import pytest
from conftest import ROOT, TOKEN
from helpers import until
from verl_torchfree import (
    AgentData,
    OneRowData,
    custom_reward_fn,
    function_call,
    load_verl_tools,
    naive_reward_manager,
    stock_loop,
)

from tangram_sdk.client import TangramClient

tool_registry = load_verl_tools()  # before tangram_sdk.integrations.verl, so it sees verl

from tangram_sdk.integrations import verl as verl_adapter  # noqa: E402
from tangram_sdk.integrations.common import STATUSES, RewardConfig  # noqa: E402
from tangram_sdk.integrations.verl import TangramTool  # noqa: E402

#: 64 rollouts: 8 GRPO groups of 8
GROUPS, GROUP_SIZE = 8, 8


async def call(tool, command: str, agent_data) -> tuple:
    """verl 0.9.1's own ToolAgentLoop._call_tool (its source)."""
    loop = stock_loop([tool], max_tool_response_length=4096)
    return await loop._call_tool(function_call(tool.name, json.dumps({"command": command})),
                                 agent_data.tools_kwargs, agent_data)


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


async def score(compute_score, agent_data: AgentData) -> dict:
    """verl's NaiveRewardManager.run_single (source) on one rollout: what the agent loop
    hands the reward loop (its extra_fields as tool_extra_fields)."""
    data = OneRowData(
        {"responses": np.array([5, 6, 7]), "attention_mask": np.array([1, 1, 1, 1])},
        {"data_source": "tangram", "reward_model": {"ground_truth": None}, "extra_info": {},
         "tool_extra_fields": {**agent_data.extra_fields, "turn_scores": [],
                               "tool_rewards": []}})
    out = await naive_reward_manager(compute_score, Tokenizer())(data)
    return out["reward_extra_info"] | {"reward_score": out["reward_score"]}


async def open_of(url: str, task: str) -> list[dict]:
    """The server's open trajectories of ``task`` (GET /v1/trajectories)."""
    async with TangramClient(url, TOKEN) as tg:
        return [t for t in await tg.trajectories() if t["task"] == task]


def tool_yaml(tmp_path, url: str, task: str, group_setup: dict, reward: str) -> str:
    """A verl tool config for verl's loader (initialize_tools_from_config). It names the
    tool, and this file the reward (``pkg://``), by their old paths (tangram.integrations,
    the compatibility modules), as existing configs do: verl's own loaders prove that path
    runs unchanged (tests/test_sdk.py checks the modules are the SDK's)."""
    path = tmp_path / f"{task}.yaml"
    path.write_text(json.dumps({"tools": [{
        "class_name": "tangram.integrations.verl.TangramTool",
        "config": {"type": "native", "base_url": url, "token": TOKEN, "task": task,
                   "group_setup": group_setup, "reward": {"command": reward}}}]}))
    return str(path)


# -- #3 verl: templates close without close_all / close_group ----------------------------
async def _verl_groups(url: str, tmp_path) -> None:
    reward = 'test "$(cat state.txt)" = prepared && test -s mine.txt'
    compute_score = custom_reward_fn("pkg://tangram.integrations.verl", "compute_score")

    async def flow(tool: TangramTool, groups: int, size: int, prefix: str) -> list[dict]:
        """verl's rollouts (each of its group, per the dataset's create_kwargs), then its
        reward manager on each; nothing else."""
        rollouts = []
        for g in range(groups):
            for i in range(size):
                a = AgentData(f"{prefix}-{g}-{i}")
                a.tools_kwargs = {tool.name: {"create_kwargs": {"group": f"prompt-{g}"}}}
                rollouts.append(a)
        outs = await asyncio.gather(*(call(tool, f"cat state.txt && echo {n} > mine.txt", a)
                                      for n, a in enumerate(rollouts)))
        for resp, _, metrics in outs:
            assert metrics.get("exit_code") == 0 and resp.text.startswith("prepared\n"), resp.text
        return list(await asyncio.gather(*(score(compute_score, a) for a in rollouts)))

    # group_size known: each template closes with its group's last copy
    sized = tool_registry.initialize_tools_from_config(tool_yaml(
        tmp_path, url, "grpo-sized", {"command": "echo prepared > state.txt",
                                      "group_size": GROUP_SIZE}, reward))[0]
    scores = await flow(sized, GROUPS, GROUP_SIZE, "sized")
    assert len(scores) == GROUPS * GROUP_SIZE == 64
    assert all(s["reward_status"] == "ok" and s["reward_score"] == 1.0 for s in scores), scores
    left = await open_of(url, "grpo-sized")
    assert left == [], f"{len(left)} trajectories left open: {left[:3]}"

    # group_size unknown: the idle sweep closes each template after its own TTL
    ttl = tool_registry.initialize_tools_from_config(tool_yaml(
        tmp_path, url, "grpo-ttl", {"command": "echo prepared > state.txt",
                                    "idle_ttl_s": 1}, reward))[0]
    scores = await flow(ttl, 2, 4, "ttl")
    assert all(s["reward_status"] == "ok" for s in scores), scores
    seen: list = []

    async def none_open() -> bool:
        seen[:] = await open_of(url, "grpo-ttl")
        return not seen

    await until(none_open, 120, "the idle sweep to close the group templates",
                lambda: seen)
    # a group asked again after its template closed is prepared again (a fresh setup)
    again = await flow(ttl, 1, 2, "ttl-again")
    assert all(s["reward_status"] == "ok" for s in again), again


def test_verl_group_templates_close_without_the_frameworks_help(process_server, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("TANGRAM_URL", process_server.url)
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    asyncio.run(_verl_groups(process_server.url, tmp_path))


# -- #3 SkyRL: group-* templates close with the group --------------------------------------
def test_skyrl_group_templates_close_without_the_frameworks_help(process_server):
    """SkyRL's generator: one env per sample (skyrl_gym.make with its extras), init / step
    / close on a thread pool; 64 samples in 8 groups; then nothing of the task is open."""
    import skyrl_gym

    import tangram_sdk.integrations.skyrl  # noqa: F401

    def episode(config: dict, group: str, i: int) -> float:
        env = skyrl_gym.make("tangram-shell", env_config=config,
                             extras={"group": group, "max_turns": 3})
        try:
            env.init([{"role": "user", "content": "go"}])
            out = env.step(f"<bash>cat state.txt && echo {i} > mine.txt</bash>")
            assert out["observations"][0]["content"].startswith("prepared\n"), out
            out = env.step("<submit/>")
            assert out["done"] and out["metadata"]["infra_error"] is False, out
            return out["reward"]
        finally:
            env.close()

    def run(config: dict, groups: int, size: int) -> list[float]:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(episode, config, f"prompt-{g}", g * size + i)
                       for g in range(groups) for i in range(size)]
            return [f.result() for f in futures]

    base = {"base_url": process_server.url, "token": TOKEN,
            "reward": {"command": 'test "$(cat state.txt)" = prepared && test -s mine.txt'}}
    sized = {**base, "task": "skyrl-sized",
             "group_setup": {"command": "echo prepared > state.txt", "group_size": GROUP_SIZE}}
    assert run(sized, GROUPS, GROUP_SIZE) == [1.0] * 64
    left = asyncio.run(open_of(process_server.url, "skyrl-sized"))
    assert left == [], f"{len(left)} trajectories left open: {left[:3]}"

    ttl = {**base, "task": "skyrl-ttl",
           "group_setup": {"command": "echo prepared > state.txt", "idle_ttl_s": 1}}
    assert run(ttl, 2, 3) == [1.0] * 6
    seen: list = []

    async def none_open() -> bool:
        seen[:] = await open_of(process_server.url, "skyrl-ttl")
        return not seen

    asyncio.run(until(none_open, 120, "the idle sweep to close the group templates",
                lambda: seen))


# -- #4 every reward_status through verl's reward manager ----------------------------------
def _cgroups() -> bool:
    if os.geteuid() != 0:
        return False
    from executor.node.cgroups import own_memory_cgroup

    own = own_memory_cgroup()
    return own is not None and os.access(own, os.W_OK)


async def _statuses(url: str) -> None:
    compute_score = custom_reward_fn("pkg://tangram.integrations.verl", "compute_score")
    tool = TangramTool({"type": "native", "base_url": url, "token": TOKEN, "task": "status"})
    pytest_cmd = f"{sys.executable} -m pytest -q -p no:cacheprovider tests"
    write_tests = ("mkdir -p tests && printf 'def test_one():\\n    assert open(\"answer.txt\")"
                   ".read().strip() == \"42\"\\n' > tests/test_a.py")
    # rollout -> (its commands, its reward command, reward_status, score, infra_error)
    cases = {
        "ok": ([write_tests, "echo 42 > answer.txt"], pytest_cmd, "ok", 1.0, False),
        "failed": ([write_tests, "echo 7 > answer.txt"], pytest_cmd, "failed", 0.0, False),
        # the model deleted (or emptied) its own tests: its failure, not the reward's
        "deleted": ([write_tests, "rm -rf tests"], pytest_cmd, "failed", 0.0, False),
        "emptied": ([write_tests, ": > tests/test_a.py"], pytest_cmd, "failed", 0.0, False),
        "error": (["true"], "no-such-program-xyz -q tests", "error", 0.0, True),
        "timeout": (["true"], "sleep 60", "timeout", 0.0, False),
    }
    rollouts: dict[str, AgentData] = {}
    for name, (commands, reward, *_) in cases.items():
        rollouts[name] = a = AgentData(f"status-{name}")
        timeout = 1.0 if name == "timeout" else None
        tool.settings = dataclasses.replace(tool.settings,
                                            reward=RewardConfig(reward, timeout_s=timeout))
        for command in commands:
            resp, _, metrics = await call(tool, command, a)
            assert metrics.get("exit_code") == 0, (name, resp.text)
    if _cgroups():  # past the sandbox's own mem_gb: the model's code
        small = TangramTool({"type": "native", "base_url": url, "token": TOKEN,
                             "task": "status", "mem_gb": 0.25,
                             "reward": {"command": "python3 -c 'b = bytearray(900 * 2**20)'"}})
        rollouts["oom"] = AgentData("status-oom")
        await call(small, "true", rollouts["oom"])
        cases["oom"] = ([], "", "oom", 0.0, False)
    # a group whose setup fails: infrastructure (the rollout never had a sandbox)
    broken = TangramTool({"type": "native", "base_url": url, "token": TOKEN, "task": "status",
                          "group_setup": {"command": "echo no-such-repo >&2; exit 3"},
                          "reward": {"command": "true"}})
    rollouts["setup_failed"] = a = AgentData("status-setup")
    a.tools_kwargs = {broken.name: {"create_kwargs": {"group": "prompt-0"}}}
    resp, _, metrics = await call(broken, "ls", a)
    assert resp.text.startswith("Error: this task's sandbox could not be prepared: "
                                "group_setup of group 'prompt-0' failed"), resp.text
    cases["setup_failed"] = ([], "", "setup_failed", 0.0, True)
    # a rollout that never called the tool: the model's outcome
    rollouts["no_sandbox"] = AgentData("status-none")
    cases["no_sandbox"] = ([], "", "no_sandbox", 0.0, False)

    outs = dict(zip(rollouts, await asyncio.gather(
        *(score(compute_score, a) for a in rollouts.values())), strict=True))
    for name, (_, _, status, value, infra) in cases.items():
        out = outs[name]
        assert (out["reward_status"], out["reward_score"], out["infra_error"]) == \
            (status, value, infra), (name, out)
        # the documented table says the same
        assert STATUSES[status].infra is infra and STATUSES[status].score == value, status
        assert set(out) == {"score", "reward_exit_code", "reward_status", "reward_output",
                            "reward_error", "infra_error", "reward_score"}, out
    assert "file or directory not found" in outs["deleted"]["reward_output"], outs["deleted"]
    assert outs["deleted"]["reward_exit_code"] == 4 and outs["emptied"]["reward_exit_code"] == 5
    assert outs["error"]["reward_exit_code"] == 127 and "not found" in outs["error"]["reward_error"]
    assert outs["setup_failed"]["reward_error"].startswith("group_setup of group 'prompt-0' "
                                                       "failed"), outs["setup_failed"]
    assert "no-such-repo" in outs["setup_failed"]["reward_error"], outs["setup_failed"]
    # scored, then closed; the failed setup's template was closed too
    assert await open_of(url, "status") == []
    await tool.close_all()


def test_every_reward_status_through_verls_reward_manager(process_server, monkeypatch):
    monkeypatch.setenv("TANGRAM_URL", process_server.url)
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    asyncio.run(_statuses(process_server.url))


def test_skyrl_failed_group_setup_is_setup_failed_not_a_crash(process_server):
    """SkyRL's init does not raise for a failed group setup (the generator's batch would
    fail): the sample's first step ends it, setup_failed, infra_error; nothing left open."""
    import skyrl_gym

    import tangram_sdk.integrations.skyrl  # noqa: F401

    config = {"base_url": process_server.url, "token": TOKEN, "task": "skyrl-broken",
              "group_setup": {"command": "echo no-such-repo >&2; exit 3"},
              "reward": {"command": "true"}}
    env = skyrl_gym.make("tangram-shell", env_config=config, extras={"group": "g"})
    prompt = [{"role": "user", "content": "go"}]
    assert env.init(prompt) == (prompt, {})
    out = env.step("<bash>ls</bash>")
    meta = out["metadata"]
    assert out["done"] and out["reward"] == 0.0 and out["observations"] == [], out
    assert meta["reward_status"] == "setup_failed" and meta["infra_error"] is True, meta
    assert "no-such-repo" in meta["reward_error"], meta
    env.close()
    assert asyncio.run(open_of(process_server.url, "skyrl-broken")) == []


# -- #5 the reward workers' token, checked at load with TANGRAM_URL unset -------------------
def test_reward_worker_token_is_checked_at_load_without_tangram_url(process_server,
                                                                    monkeypatch):
    # the shipped tool config's default URL is the one checked when TANGRAM_URL is unset
    shipped = (ROOT / "examples" / "verl_tool.yaml").read_text()
    assert f"${{oc.env:TANGRAM_URL,{verl_adapter.DEFAULT_URL}}}" in shipped
    monkeypatch.delenv("TANGRAM_URL", raising=False)
    # a server there (this one stands in for 127.0.0.1:8000, which other runs may hold)
    monkeypatch.setattr(verl_adapter, "DEFAULT_URL", process_server.url)
    monkeypatch.setenv("TANGRAM_TOKEN", "wrong-token")
    with pytest.raises(ValueError, match="compute_score: TANGRAM_TOKEN: the server .* refused"):
        custom_reward_fn("pkg://tangram.integrations.verl", "compute_score")
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    assert custom_reward_fn("pkg://tangram.integrations.verl", "compute_score")
    # nothing there: the loader says which URL it checked and how to name the right one
    monkeypatch.setattr(verl_adapter, "DEFAULT_URL", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match=r"TANGRAM_URL is not set, so the default "
                                         r"http://127.0\.0\.1:9 was checked.*no Tangram server"):
        custom_reward_fn("pkg://tangram.integrations.verl", "compute_score")


# -- the documented group configs, as written (docs/integrations.md) ----------------------
INTEGRATIONS_DOC = ROOT / "docs" / "integrations.md"


def _doc_blocks(lang: str, marker: str) -> str:
    """The one ``lang`` code block of docs/integrations.md (moved there from the README,
    issue 48 #4) that contains ``marker``, dedented."""
    import re
    import textwrap

    text = INTEGRATIONS_DOC.read_text()
    blocks = [textwrap.dedent(b) for b in re.findall(rf"^ *```{lang}\n(.*?)^ *```", text,
                                                      re.DOTALL | re.MULTILINE)
              if marker in b]
    assert len(blocks) == 1, f"{INTEGRATIONS_DOC.name}: {len(blocks)} {lang} blocks with {marker!r}"
    return blocks[0]


SETUP = "git clone -q /data/repos/calc . && pip install -q --user -e ."


def test_readme_group_configs_load_and_fork(process_server, tmp_path, monkeypatch):
    """The documented verl tool config (through verl's loader), SkyRL env config (through
    skyrl_gym.make) and gymnasium fork_of example (docs/integrations.md) run against a
    live server; only the setup command (a repository this machine has not) and the URL
    are swapped."""
    import skyrl_gym
    from omegaconf import OmegaConf

    import tangram_sdk.integrations.skyrl  # noqa: F401

    monkeypatch.setenv("TANGRAM_URL", process_server.url)
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    verl_yaml = _doc_blocks("yaml", "tangram_sdk.integrations.verl.TangramTool")
    assert SETUP in verl_yaml
    path = tmp_path / "tool.yaml"
    path.write_text(verl_yaml.replace(SETUP, "echo prepared > state.txt"))
    tool = tool_registry.initialize_tools_from_config(str(path))[0]
    assert tool.settings.group_setup.group_size == 8 and tool.settings.reward.state_lost_score == 0.0

    async def verl_group() -> None:
        a = AgentData("readme-0")
        a.tools_kwargs = {"shell": {"create_kwargs": {"group": "prompt-17"}}}
        resp, _, _ = await call(tool, "cat state.txt", a)
        assert resp.text.startswith("prepared\n"), resp.text
        await tool.close_all()

    asyncio.run(verl_group())

    sky = OmegaConf.create(_doc_blocks("yaml", "env_class: tangram-shell").replace(
        SETUP, "echo prepared > state.txt").replace("http://127.0.0.1:8000", process_server.url))
    env_config = sky.environment.skyrl_gym[sky.environment.env_class]
    env = skyrl_gym.make("tangram-shell", env_config=env_config,
                         extras={"group": "prompt-17", "max_turns": 4})
    env.init([{"role": "user", "content": "go"}])
    assert env.step("<bash>cat state.txt</bash>")["observations"][0]["content"].startswith(
        "prepared\n")
    env.close()
    tangram_sdk.integrations.skyrl.SYNC_GROUPS.close_all()

    script = tmp_path / "gym_fork.py"
    script.write_text(_doc_blocks("python", '"fork_of"').replace(
        SETUP, "echo prepared > state.txt").replace("http://127.0.0.1:8000", process_server.url)
        + "\nfor env in group:\n    print(env.step('cat state.txt')[0].splitlines()[0])\n"
        "    env.close()\n")
    import subprocess

    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TANGRAM_TOKEN": TOKEN})
    assert out.returncode == 0 and out.stdout.split() == ["prepared"] * 8, \
        out.stdout + out.stderr
    assert asyncio.run(open_of(process_server.url, "coding")) == []


# -- issue 47 #1 through the frameworks: docker copies run in their source's image --------
PROBE = ('python3 -c "import imgmod; print(imgmod.NAME)" && echo "$PYTHONPATH" '
         '&& cat state.txt')


def _task_image() -> str:
    """An image with a module and an ``ENV PYTHONPATH`` of its own (the default image
    has neither): a copy run in the default image cannot import it."""
    import docker

    from executor.backends.docker.backend import build_image

    return build_image(docker.from_env(), "tangram-test-group-image:1",
                       files={"/opt/imgmod/imgmod.py": b"NAME = 'only-in-the-image'\n"},
                       env={"PYTHONPATH": "/opt/imgmod"})


def _in_image(image: str, ids: list[str]) -> None:
    """Every one of ``ids`` has its container on ``image`` (as an operator sees it)."""
    from conftest import sandbox_containers

    for t in ids:
        (box,) = sandbox_containers(t, all=False)
        assert box.attrs["Config"]["Image"] == image, (t, box.attrs["Config"]["Image"])


def test_docker_groups_run_in_the_tasks_image_through_verl_gym_and_skyrl(docker_server,
                                                                         tmp_path,
                                                                         monkeypatch):
    """verl's group_setup (its loader, _call_tool, its reward manager), gymnasium's
    ``reset(options={"fork_of": ...})`` and SkyRL's groups, on the docker backend with a
    task image: every copy runs in that image with its PYTHONPATH and imports its module,
    in the rollout and in the reward."""
    import gymnasium
    import skyrl_gym

    import tangram_sdk.integrations.gym  # noqa: F401
    import tangram_sdk.integrations.skyrl  # noqa: F401

    image = _task_image()
    url = docker_server.url
    monkeypatch.setenv("TANGRAM_URL", url)
    monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
    expect = ["only-in-the-image", "/opt/imgmod", "prepared"]
    reward = 'python3 -c "import imgmod" && test "$(cat state.txt)" = prepared'
    setup = {"command": "echo prepared > state.txt", "group_size": 4}

    async def verl_flow() -> list[dict]:
        path = tmp_path / "img.yaml"
        path.write_text(json.dumps({"tools": [{
            "class_name": "tangram.integrations.verl.TangramTool",
            "config": {"type": "native", "base_url": url, "token": TOKEN,
                       "task": "verl-img", "image": image, "group_setup": setup,
                       "reward": {"command": reward}}}]}))
        tool = tool_registry.initialize_tools_from_config(str(path))[0]
        rollouts = []
        for g in range(2):
            for i in range(4):
                a = AgentData(f"img-{g}-{i}")
                a.tools_kwargs = {tool.name: {"create_kwargs": {"group": f"img-{g}"}}}
                rollouts.append(a)
        outs = await asyncio.gather(*(call(tool, PROBE, a) for a in rollouts))
        for resp, _, _metrics in outs:
            assert resp.text.split()[:3] == expect, resp.text
        opened = [t["id"] for t in await open_of(url, "verl-img")]
        _in_image(image, opened)
        compute_score = custom_reward_fn("pkg://tangram.integrations.verl", "compute_score")
        return list(await asyncio.gather(*(score(compute_score, a) for a in rollouts)))

    scores = asyncio.run(verl_flow())
    assert [(s["reward_status"], s["reward_score"]) for s in scores] == [("ok", 1.0)] * 8, \
        scores

    def make():
        return gymnasium.make("tangram/Shell-v0", base_url=url, token=TOKEN,
                              task="gym-img", image=image)

    lead, other = make(), make()
    try:
        lead.reset()
        obs, *_ = lead.step("echo prepared > state.txt && echo done")
        assert "done" in obs, obs
        other.reset(options={"fork_of": lead.unwrapped.trajectory})
        obs, *_ = other.step(PROBE)
        assert obs.split()[:3] == expect, obs
        _in_image(image, [other.unwrapped.trajectory])
    finally:
        lead.close()
        other.close()

    def episode(i: int) -> float:
        env = skyrl_gym.make("tangram-shell", env_config={
            "base_url": url, "token": TOKEN, "task": "skyrl-img", "image": image,
            "group_setup": setup, "reward": {"command": reward}},
            extras={"group": "img-0", "max_turns": 3})
        try:
            env.init([{"role": "user", "content": "go"}])
            out = env.step(f"<bash>{PROBE}</bash>")
            assert out["observations"][0]["content"].split()[:3] == expect, out
            out = env.step("<submit/>")
            assert out["done"] and out["metadata"]["infra_error"] is False, out
            return out["reward"]
        finally:
            env.close()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(episode, range(4))) == [1.0] * 4
    for task in ("verl-img", "skyrl-img"):
        assert asyncio.run(open_of(url, task)) == [], task
