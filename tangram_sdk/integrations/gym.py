"""A gymnasium environment whose actions are shell commands in a Tangram sandbox.

    import gymnasium as gym
    import tangram_sdk.integrations.gym  # registers tangram/Shell-v0

    env = gym.make("tangram/Shell-v0", base_url="http://127.0.0.1:8000", task="coding",
                   reward={"command": "python3 -m pytest -q tests"})
    obs, info = env.reset(seed=0, options={"files": {"task.md": "Fix the bug in add()."}})
    obs, reward, terminated, truncated, info = env.step("cat task.md")
    obs, reward, terminated, truncated, info = env.step("submit")  # runs the reward command
    env.close()

(``gym.make("tangram_sdk.integrations.gym:tangram/Shell-v0", ...)`` imports the module
itself.) Each ``reset`` opens a fresh sandbox (closing the previous one), so an
episode starts from the same state whatever ran before: with the same actions
a seeded episode repeats, which is what gymnasium's ``check_env`` verifies.

Spaces: actions and observations are ``gymnasium.spaces.Text`` over ``CHARSET``
(printable ASCII: letters, digits, punctuation, space, tab, newline, carriage
return, vertical tab, form feed). An action is 1 to ``max_action_chars``
characters; an observation 0 to ``max_obs_chars``. Output outside the charset is
replaced by ``?`` and a longer output keeps its tail (a command's last lines
usually say what happened).

An observation is the command's output followed by one line on how it ended
(``[exit code 0]``, ``[timed out: ...]``, ...). ``info`` is small and
deterministic: ``{"step": int, "status": str, "exit_code": int}``
(after a submission ``"reward_exit_code": int``, ``"reward_status": str`` - ``ok``,
``failed``, ``timeout``, ``oom``, ``error`` when the reward could not run, with
``"reward_error": str``, or ``state_lost``: ``tangram_sdk.integrations.common.STATUSES`` -
and ``"infra_error": bool``, true when the score is an infrastructure failure rather
than the model's outcome (mask the sample); ``"state_lost": True`` after a sandbox
reset, which the observation's first line also says); nothing random such as ids or
timings. Every
key holds one type: a key with no value (no exit code after a timeout or a
submission) is left out, which gymnasium's vector envs turn into
their ``_key`` mask.

Vector envs: ``gymnasium.vector.SyncVectorEnv([make] * 4)`` works as it is;
``AsyncVectorEnv`` needs ``shared_memory=False`` (gymnasium 1.4 cannot place
``Text`` observations in shared memory)::

    envs = gymnasium.vector.AsyncVectorEnv([make] * 4, shared_memory=False)

Run ``check_env`` (and any exploration with random actions) against a server on
the docker backend: the checker sends random printable text as commands, which
the process backend runs as the server's own user.

The action ``submit`` (``submit_action``) ends the episode: it runs the reward
command (``reward.command``; reward 1.0 if it exits 0, else 0.0) and never runs
a program called ``submit``. After a sandbox reset it raises
:class:`~tangram_sdk.integrations.common.SandboxLost` unless ``reward.state_lost_score``
gives the reward of such an episode. Without a reward command, ``submit`` ends the
episode with reward 0.0. After ``max_steps`` steps the episode is truncated.
"""

from __future__ import annotations

import string
from typing import Any

try:
    import gymnasium
    from gymnasium import spaces
except ImportError as e:  # pragma: no cover - exercised by the import test
    raise ImportError("tangram_sdk.integrations.gym needs gymnasium: pip install gymnasium "
                      "(or tangram-sdk[gym])") from e

from tangram_sdk.client import TangramSyncClient
from tangram_sdk.integrations.common import SandboxConfig, SyncTrajectory, judge, render

#: the characters of every action and observation
CHARSET = string.printable
ENV_ID = "tangram/Shell-v0"
_ALLOWED = frozenset(CHARSET)


def to_charset(text: str, max_chars: int) -> str:
    """``text`` within the observation space: foreign characters as ``?``, the tail kept."""
    if len(text) > max_chars:
        marker = "...(truncated)\n"
        text = marker + text[-(max_chars - len(marker)):]
    return "".join(c if c in _ALLOWED else "?" for c in text)


class TangramEnv(SyncTrajectory, gymnasium.Env):
    """One sandbox per episode; ``step(command)`` runs the command in it."""

    metadata = {"render_modes": []}

    def __init__(self, base_url: str | None = None, token: str | None = None, *,
                 task: str = "default", image: str | None = None, mem_gb: float | None = None,
                 shell: bool = True, timeout_s: float | None = 60.0,
                 reward: dict[str, Any] | None = None, prompt: str = "", max_steps: int = 50,
                 submit_action: str = "submit", max_action_chars: int = 4096,
                 max_obs_chars: int = 8192, render_mode: str | None = None,
                 check_server: bool = True) -> None:
        raw = {"base_url": base_url, "token": token, "task": task, "image": image,
               "mem_gb": mem_gb, "shell": shell, "timeout_s": timeout_s, "reward": reward,
               "max_output_chars": max_obs_chars, "check_server": check_server}
        self.settings = SandboxConfig.from_dict({k: v for k, v in raw.items() if v is not None}
                                                | {"timeout_s": timeout_s})
        if not isinstance(max_obs_chars, int) or max_obs_chars < 256:
            raise ValueError(f"max_obs_chars: expected an integer >= 256, got {max_obs_chars!r}")
        if not isinstance(max_steps, int) or max_steps < 2:
            raise ValueError(f"max_steps: expected an integer >= 2, got {max_steps!r}")
        if render_mode is not None:
            raise ValueError(f"render_mode: this environment renders nothing, got {render_mode!r}")
        self.prompt = to_charset(prompt, max_obs_chars)
        self.max_steps = max_steps
        self.submit_action = submit_action
        self.max_obs_chars = max_obs_chars
        self.render_mode = None
        self.action_space = spaces.Text(max_action_chars, min_length=1, charset=CHARSET)
        self.observation_space = spaces.Text(max_obs_chars, min_length=0, charset=CHARSET)
        self._client: TangramSyncClient | None = None
        self.trajectory: str | None = None
        self._steps = 0
        self.settings.check()  # a wrong URL or token fails gymnasium.make, not every step

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """A fresh sandbox; ``options={"files": {path: text or bytes}}`` are written into
        it before the first step. ``options={"fork_of": <trajectory>}``: the sandbox starts
        as a copy of that open trajectory's files (e.g. another env's ``trajectory``, once
        it prepared: a GRPO group's rollouts prepare once; it must be between steps)."""
        super().reset(seed=seed)
        files = (options or {}).get("files") or {}
        if not isinstance(files, dict):
            raise ValueError(f"options['files']: expected a mapping path -> content, got {files!r}")
        fork_of = (options or {}).get("fork_of")
        if fork_of is not None and not isinstance(fork_of, str):
            raise ValueError(f"options['fork_of']: expected a trajectory id, got {fork_of!r}")
        self._open_trajectory(files, fork_of)
        self._steps = 0
        return self.prompt, {"step": 0}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.trajectory is None:
            raise RuntimeError("step() before reset()")
        if not isinstance(action, str) or not action.strip():
            raise ValueError(f"action: expected a non-empty command string, got {action!r}")
        self._steps += 1
        if action.strip() == self.submit_action:
            if self.settings.reward is None:
                obs = "[submitted; no reward command is configured, so the reward is 0]"
                return obs, 0.0, True, False, {"step": self._steps, "status": "submitted"}
            lost_before = self.lost
            res = self._run(self.settings.reward.action())
            obs = to_charset(render(res, self.max_obs_chars - 200, self.settings.mem_gb),
                             self.max_obs_chars)
            # raises SandboxLost for a reset sandbox unless reward.state_lost_score is set
            scored = judge(res, self.settings.reward, lost_before, f"sandbox {self.trajectory}")
            info = {"step": self._steps, "status": "submitted", "reward_status": scored.status,
                    "infra_error": scored.infra_error}
            if isinstance(res.get("exit_code"), int):
                info["reward_exit_code"] = res["exit_code"]
            if scored.error:
                info["reward_error"] = scored.error
            if self.lost:
                info["state_lost"] = True
            return obs, scored.score, True, False, info
        res = self._run(self.settings.action(action))
        obs = to_charset(render(res, self.max_obs_chars - 200, self.settings.mem_gb),
                         self.max_obs_chars)
        info = {"step": self._steps, "status": str(res["status"])}
        if isinstance(res.get("exit_code"), int):  # none after a timeout: the key is left out
            info["exit_code"] = res["exit_code"]
        if res.get("state_lost"):  # the observation's first line says so too
            info["state_lost"] = True
        return obs, 0.0, False, self._steps >= self.max_steps, info

    def close(self) -> None:
        """Close the sandbox and the connection; calling it again does nothing."""
        self._close_trajectory()
        if self._client is not None:
            self._client.close()
            self._client = None
        super().close()



if ENV_ID not in gymnasium.registry:
    gymnasium.register(ENV_ID, entry_point=f"{__name__}:TangramEnv")
