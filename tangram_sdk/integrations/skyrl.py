"""A SkyRL-gym text environment whose tool is a shell in a Tangram sandbox.

    import skyrl_gym
    import tangram_sdk.integrations.skyrl  # registers "tangram-shell"

    env = skyrl_gym.make("tangram-shell",
                         env_config={"base_url": "http://127.0.0.1:8000", "task": "coding",
                                     "reward": {"command": "python3 -m pytest -q tests"}},
                         extras={"max_turns": 8, "files": {"task.md": "Fix add()."}})
    prompt, meta = env.init([{"role": "user", "content": "..."}])
    out = env.step("Let me look. <bash>cat task.md</bash>")   # BaseTextEnvStepOutput
    out = env.step("Fixed. <submit/>")                        # done, reward from the command
    env.close()

``env_config`` holds the keys of ``tangram_sdk.integrations.common.SandboxConfig``
(``base_url``, ``token``, ``task``, ``image``, ``mem_gb``, ``shell``, ``timeout_s``,
``reward``, ...) plus ``max_turns``. ``extras`` (per sample, as SkyRL passes them)
may hold ``max_turns``, ``files`` (path -> content, written before the first
turn), ``reward_command`` (this sample's reward command, overriding the
config's) and ``group`` (its GRPO group: with ``group_setup: {command: ...}`` in
``env_config`` the group's sandbox is prepared once and each sample's starts as a
copy of it: ``tangram_sdk.integrations.groups.SyncGroups``, which closes the group's
template once ``group_setup.group_size`` copies were made, or once none was forked or
open for ``group_setup.idle_ttl_s``).

Like SkyRL's own environments, the command is parsed out of the model's text
with a tag: the first ``<bash>...</bash>`` is run; ``<submit/>`` (or
``<submit>...</submit>``) ends the episode. Text with neither gets a hint and runs
nothing. The episode also ends after ``max_turns`` turns. When it ends the
reward command (if any) runs in the sandbox: reward 1.0 if it exits 0, else 0.0;
without one the reward is 0.0. The last step's ``metadata`` says what the score is:
``reward_status`` (``tangram_sdk.integrations.common.STATUSES``) and ``infra_error`` (true:
an infrastructure failure, not the model's outcome: mask the sample). A sample whose
group setup (or sandbox) failed is not raised from ``init``: its first step ends the
episode as ``setup_failed``. Nothing the model writes is ever run as a program unless
it is inside ``<bash>``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

try:
    import skyrl_gym
    from skyrl_gym.envs.base_text_env import (
        BaseTextEnv,
        BaseTextEnvStepOutput,
        ConversationType,
    )
except ImportError as e:  # pragma: no cover - exercised by the import test
    raise ImportError("tangram_sdk.integrations.skyrl needs skyrl-gym: pip install skyrl-gym "
                      "(or tangram-sdk[skyrl])") from e

import httpx

from tangram_sdk.client import TangramError, TangramSyncClient
from tangram_sdk.integrations.common import (
    Reward,
    RewardConfig,
    SandboxConfig,
    SyncTrajectory,
    describe,
    judge,
    render,
)
from tangram_sdk.integrations.groups import SYNC_GROUPS

log = logging.getLogger("tangram.integrations.skyrl")  # its name before the SDK left tangram/
ENV_ID = "tangram-shell"
COMMAND = re.compile(r"<bash>(.*?)</bash>", re.DOTALL)
SUBMIT = re.compile(r"<submit\s*/>|<submit>.*?</submit>", re.DOTALL)
HINT = ("No command found. Put one shell command in <bash>...</bash>, "
        "or write <submit/> when you are done.")


def _plain(config: Any) -> dict[str, Any]:
    """A plain dict of SkyRL's env config (a dict, an OmegaConf DictConfig or None)."""
    if config is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return dict(OmegaConf.to_container(config, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - omegaconf comes with skyrl-gym
        pass
    if not isinstance(config, Mapping):
        raise ValueError(f"env_config: expected a mapping, got {config!r}")
    return dict(config)


class TangramTextEnv(SyncTrajectory, BaseTextEnv):
    """SkyRL ``BaseTextEnv``: one sandbox per episode, opened by ``init``."""

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        cfg = _plain(env_config)
        extras = dict(extras or {})
        max_turns = extras.get("max_turns", cfg.pop("max_turns", 10))
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns: expected an integer >= 1, got {max_turns!r}")
        self.max_turns = max_turns
        if extras.get("reward_command") is not None:
            cfg["reward"] = {**(cfg.get("reward") or {}), "command": extras["reward_command"]}
        self.settings = SandboxConfig.from_dict(cfg, "env_config")
        self.reward: RewardConfig | None = self.settings.reward
        files = extras.get("files") or {}
        if not isinstance(files, Mapping):
            raise ValueError(f"extras['files']: expected a mapping path -> content, got {files!r}")
        self.files = dict(files)
        group = extras.get("group")
        if group is not None and self.settings.group_setup is None:
            raise ValueError("extras['group']: needs a group_setup block in env_config "
                             "(the command that prepares the group's sandbox)")
        #: this sample's GRPO group: its sandbox starts as a copy of the group's prepared one
        self.group = str(group) if group is not None else None
        self.trajectory: str | None = None
        self._client: TangramSyncClient | None = None
        self.chat_history: ConversationType = []
        #: why this sample got no sandbox at init ("": it has one)
        self.setup_error = ""
        self.settings.check("env_config")  # a wrong URL or token fails make, not every step

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """Open the sandbox (a copy of its group's, with ``group``) and write the sample's
        files; the prompt is unchanged. A failed group setup or open is not raised: the
        episode's first step ends it, scored ``setup_failed`` (an infrastructure failure
        the trainer can mask, not the model's outcome)."""
        self.turns = 0
        self.chat_history = list(prompt)
        self.setup_error = ""
        try:
            if self.group is not None:
                self._close_trajectory()
                self.trajectory = SYNC_GROUPS.fork(self._http(), self.settings, self.group)
                self.lost = False
                for path, content in self.files.items():
                    self._http().put_file(self.trajectory, str(path), content)
            else:
                self._open_trajectory(self.files)
        except (TangramError, httpx.HTTPError) as e:
            self.setup_error = describe(e)
            log.error("SkyRL sample (group %r): no sandbox: %s", self.group, self.setup_error)
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.setup_error:
            self.chat_history.append({"role": "assistant", "content": action})
            scored = Reward.of("setup_failed", error=self.setup_error)
            metadata = {"turn": getattr(self, "turns", 0) + 1, **_extra(scored)}
            return BaseTextEnvStepOutput(observations=[], reward=scored.score, done=True,
                                         metadata=metadata)
        if self.trajectory is None:
            raise RuntimeError("step() before init()")
        self.turns += 1
        self.chat_history.append({"role": "assistant", "content": action})
        match = COMMAND.search(action)
        metadata: dict[str, Any] = {"turn": self.turns}
        observation = None
        if match and match.group(1).strip():
            res = self._run(self.settings.action(match.group(1).strip()))
            observation = render(res, self.settings.max_output_chars, self.settings.mem_gb)
            metadata.update(command=match.group(1).strip(), exit_code=res.get("exit_code"),
                            status=res["status"], state_lost=bool(res.get("state_lost")))
        elif not SUBMIT.search(action):
            observation = HINT
        done = bool(SUBMIT.search(action)) or self.turns >= self.max_turns
        if done:
            reward = self._score(metadata)
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True,
                                         metadata=metadata)
        new_obs = {"role": "user", "content": observation or ""}
        self.chat_history.append(new_obs)
        return BaseTextEnvStepOutput(observations=[new_obs], reward=0.0, done=False,
                                     metadata=metadata)

    def close(self) -> None:
        """Close the sandbox and the connection; calling it again does nothing."""
        self._close_trajectory()
        if self._client is not None:
            self._client.close()
            self._client = None

    def _score(self, metadata: dict[str, Any]) -> float:
        if self.reward is None or self.trajectory is None:
            metadata["reward"] = "no reward command configured"
            return 0.0
        lost_before = self.lost
        res = self._run(self.reward.action())
        # raises SandboxLost for a reset sandbox unless reward.state_lost_score is set
        scored = judge(res, self.reward, lost_before, f"sandbox {self.trajectory}")
        metadata.update(_extra(scored), state_lost=self.lost)
        return scored.score


def _extra(scored: Reward) -> dict[str, Any]:
    """A reward's fields for SkyRL's metadata (its score is the step's reward)."""
    return {k: v for k, v in scored.fields().items() if k != "score"}



if ENV_ID not in skyrl_gym.registry:
    skyrl_gym.register(id=ENV_ID, entry_point=f"{__name__}:TangramTextEnv")
