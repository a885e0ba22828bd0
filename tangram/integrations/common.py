"""What the adapters share: their configuration, the actions they submit, and
the text a model sees for a result.

The model only ever supplies a command line. Its kind, cores, memory, timeout
and the sandbox image come from the configuration a user wrote, never from the
model's arguments.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tangram.client import TangramSyncClient

#: the keys of an adapter's configuration (unknown keys are refused with this list)
CONFIG_KEYS = ("base_url", "token", "task", "image", "mem_gb", "shell", "kind", "cpu",
               "timeout_s", "reward", "idle_ttl_s", "max_output_chars", "group_setup")
GROUP_SETUP_KEYS = ("command", "timeout_s")
REWARD_KEYS = ("command", "cpu", "elastic", "t1_s", "parallel_fraction", "timeout_s", "shell")


#: the server's bounds (executor/server/schemas.py), checked when the config loads rather than
#: answered as a 422 to every one of the model's calls
MAX_MEM_GB = 4096.0
MAX_TIMEOUT_S = 24 * 3600.0
MAX_CORES = 4096
_CORES = re.compile(r"^\s*(\d{1,6})\s*(?:-\s*(\d{1,6})\s*)?$")


def _num(where: str, value: Any, *, positive: bool = True, most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{where}: must be > 0, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"{where}: at most {most:g}, got {value!r}")
    return float(value)


def _cores(where: str, value: Any) -> str:
    """Feasible core counts as the server takes them: ``2``, ``"1-8"`` or ``"1,2,4"``."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{where}: expected core counts such as 2, '1-8' or '1,2,4', "
                         f"got {value!r}")
    text = str(value)
    parts = text.split(",")
    bounds: list[int] = []
    for part in parts:
        m = _CORES.match(part)
        if not m or (len(parts) > 1 and m.group(2)):
            raise ValueError(f"{where}: expected core counts such as 2, '1-8' or '1,2,4', "
                             f"got {value!r}")
        bounds += [int(m.group(1)), int(m.group(2) or m.group(1))]
    if min(bounds) < 1 or max(bounds) > MAX_CORES or (len(parts) == 1 and bounds[0] > bounds[1]):
        raise ValueError(f"{where}: core counts must be 1 <= min <= max <= {MAX_CORES}, "
                         f"got {value!r}")
    return text


def _text(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _flag(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class RewardConfig:
    """The command whose exit code scores a trajectory (0 -> reward 1.0, else 0.0).

    ``elastic: true`` makes cores its key elastic resource: granted k >= 2 cores, a
    ``pytest`` / ``python -m pytest`` command runs as ``pytest -n k`` (pytest-xdist must
    be in the sandbox). The rewrite applies to argv only, so it needs ``shell: false``.
    """

    command: str
    cpu: str = "1"
    elastic: bool = False
    t1_s: float | None = None
    parallel_fraction: float | None = None
    timeout_s: float | None = None
    shell: bool = True

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "reward") -> RewardConfig:
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: expected a mapping with a 'command', got {raw!r}")
        unknown = sorted(set(raw) - set(REWARD_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {list(REWARD_KEYS)}")
        if "command" not in raw:
            raise ValueError(f"{where}.command: missing (the command whose exit code is the reward)")
        pf = raw.get("parallel_fraction")
        if pf is not None and not 0 <= _num(f"{where}.parallel_fraction", pf, positive=False) <= 1:
            raise ValueError(f"{where}.parallel_fraction: must be within [0, 1], got {pf!r}")
        elastic = _flag(f"{where}.elastic", raw.get("elastic", False))
        shell = _flag(f"{where}.shell", raw.get("shell", not elastic))
        if elastic and shell:
            raise ValueError(f"{where}.elastic: the pytest -n rewrite applies to an argv "
                             "command; set shell: false (or elastic: false)")
        return cls(
            command=_text(f"{where}.command", raw["command"]),
            cpu=_cores(f"{where}.cpu", raw.get("cpu", "1")),
            elastic=elastic,
            t1_s=_num(f"{where}.t1_s", raw["t1_s"]) if raw.get("t1_s") is not None else None,
            parallel_fraction=float(pf) if pf is not None else None,
            timeout_s=(_num(f"{where}.timeout_s", raw["timeout_s"], most=MAX_TIMEOUT_S)
                       if raw.get("timeout_s") is not None else None),
            shell=shell)

    def action(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": "reward_test", "command": self.command, "shell": self.shell,
                                "cpu": self.cpu, "elastic": self.elastic}
        for key in ("t1_s", "parallel_fraction", "timeout_s"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        return body


@dataclass(frozen=True, slots=True)
class GroupSetup:
    """A GRPO group's sandbox preparation (clone, install), run once per group: in a
    template sandbox that each rollout of the group starts as a copy of (a fork)."""

    command: str
    timeout_s: float = 600.0

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str) -> GroupSetup:
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: expected a mapping with a command, got {raw!r}")
        unknown = sorted(set(raw) - set(GROUP_SETUP_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {list(GROUP_SETUP_KEYS)}")
        if not raw.get("command"):
            raise ValueError(f"{where}.command: missing (the shell command that prepares a "
                             "group's sandbox)")
        return cls(_text(f"{where}.command", raw["command"]),
                   _num(f"{where}.timeout_s", raw.get("timeout_s", 600.0), most=MAX_TIMEOUT_S))

    def action(self) -> dict[str, Any]:
        return {"kind": "setup", "command": self.command, "shell": True,
                "timeout_s": self.timeout_s}


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """Where the sandbox lives and how the model's commands run in it."""

    base_url: str
    token: str = field(repr=False)
    task: str = "default"
    image: str | None = None
    mem_gb: float | None = None
    shell: bool = True
    kind: str = "shell"
    cpu: str = "1"
    timeout_s: float | None = 60.0
    reward: RewardConfig | None = None
    #: an abandoned sandbox (a rollout that never said it ended) is closed after this long
    idle_ttl_s: float = 600.0
    #: the model sees at most this many characters of a command's output (the tail)
    max_output_chars: int = 8192
    #: prepare once per GRPO group and fork (None: every rollout starts empty)
    group_setup: GroupSetup | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "config",
                  ignore: tuple[str, ...] = ()) -> SandboxConfig:
        """Validate a user's mapping; ``base_url`` and ``token`` fall back to the
        TANGRAM_URL and TANGRAM_TOKEN environment variables."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {raw!r}")
        unknown = sorted(set(raw) - set(CONFIG_KEYS) - set(ignore))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {list(CONFIG_KEYS)}")
        base_url = raw.get("base_url") or os.environ.get("TANGRAM_URL")
        token = raw.get("token") or os.environ.get("TANGRAM_TOKEN")
        if not base_url:
            raise ValueError(f"{where}.base_url: missing (or set TANGRAM_URL), e.g. "
                             "http://127.0.0.1:8000")
        if not token:
            raise ValueError(f"{where}.token: missing (or set TANGRAM_TOKEN)")
        reward = raw.get("reward")
        mem = raw.get("mem_gb")
        timeout = raw.get("timeout_s", 60.0)
        max_out = raw.get("max_output_chars", 8192)
        if isinstance(max_out, bool) or not isinstance(max_out, int) or max_out < 64:
            raise ValueError(f"{where}.max_output_chars: expected an integer >= 64, got {max_out!r}")
        return cls(
            base_url=_text(f"{where}.base_url", base_url), token=_text(f"{where}.token", token),
            task=_text(f"{where}.task", raw.get("task", "default")),
            image=_text(f"{where}.image", raw["image"]) if raw.get("image") is not None else None,
            mem_gb=_num(f"{where}.mem_gb", mem, most=MAX_MEM_GB) if mem is not None else None,
            shell=_flag(f"{where}.shell", raw.get("shell", True)),
            kind=_text(f"{where}.kind", raw.get("kind", "shell")),
            cpu=_cores(f"{where}.cpu", raw.get("cpu", "1")),
            timeout_s=(_num(f"{where}.timeout_s", timeout, most=MAX_TIMEOUT_S)
                       if timeout is not None else None),
            reward=RewardConfig.from_dict(reward, f"{where}.reward") if reward is not None else None,
            idle_ttl_s=_num(f"{where}.idle_ttl_s", raw.get("idle_ttl_s", 600.0)),
            max_output_chars=max_out,
            group_setup=(GroupSetup.from_dict(raw["group_setup"], f"{where}.group_setup")
                         if raw.get("group_setup") is not None else None))

    def action(self, command: str) -> dict[str, Any]:
        """The action that runs one of the model's commands."""
        body: dict[str, Any] = {"kind": self.kind, "command": command, "shell": self.shell,
                                "cpu": self.cpu}
        if self.timeout_s is not None:
            body["timeout_s"] = self.timeout_s
        return body

    def open_args(self) -> dict[str, Any]:
        return {"task": self.task, "mem_gb": self.mem_gb, "image": self.image}


def group_template(client: TangramSyncClient, settings: SandboxConfig, group: str) -> str:
    """The prepared template sandbox of GRPO group ``group`` (``settings.group_setup``),
    shared by every env of the group, in this process or another: its trajectory id and
    its setup action's id are derived from the group, the task and the command, so the
    first env to ask opens it and runs the setup, and the others (the open refused as
    already done, the setup's submit answered as a repeat) wait for the same setup. No
    env runs in it: each forks it. It stays open for the group's later rollouts; close
    it (``close_trajectory``) when the group is done."""
    import hashlib

    from tangram.client import TangramError

    assert settings.group_setup is not None
    digest = hashlib.sha256("\0".join((settings.base_url, settings.task, group,
                                       settings.group_setup.command)).encode()).hexdigest()
    tid = f"group-{digest[:24]}"
    try:
        client.open_trajectory(tid, **settings.open_args())
    except TangramError as e:
        if e.status != 409:  # 409: another env of the group opened it
            raise
    result = client.run(tid, action_id=f"{tid}-setup", **settings.group_setup.action())
    if not passed(result):
        raise TangramError(500, f"group_setup of group {group!r} failed: {render(result, 2000)}")
    return tid


def passed(result: Mapping[str, Any]) -> bool:
    """Whether a reward command succeeded (ran to its end with exit code 0)."""
    return result.get("status") == "ok" and result.get("exit_code") == 0


def render(result: Mapping[str, Any], max_chars: int = 8192, mem_gb: float | None = None) -> str:
    """What the model sees: the output's tail, then one line on how the command ended."""
    output = str(result.get("output") or "")
    if len(output) > max_chars:
        output = "...(truncated)\n" + output[-max_chars:]
    status, code = result.get("status"), result.get("exit_code")
    if status == "timeout":
        note = f"[timed out: {result.get('error') or 'killed'}]"
    elif status == "ok" and code in (137, -9):
        limit = f" of {mem_gb:g} GB" if mem_gb else ""
        note = f"[exit code {code}: killed (SIGKILL), most likely out of memory{limit}]"
    elif status == "ok":
        note = f"[exit code {code}]"
    else:
        note = f"[{status}: {result.get('error') or 'no detail'}]"
    if output and not output.endswith("\n"):
        output += "\n"
    return output + note


class SyncTrajectory:
    """The blocking client and the one trajectory of a sync environment (gymnasium,
    SkyRL-gym): created on first use, closed with the environment."""

    settings: SandboxConfig
    trajectory: str | None
    _client: TangramSyncClient | None

    def _http(self) -> TangramSyncClient:
        if self._client is None:
            self._client = TangramSyncClient(self.settings.base_url, self.settings.token)
        return self._client

    def _close_trajectory(self) -> None:
        if self.trajectory is not None:
            tid, self.trajectory = self.trajectory, None
            self._http().close_trajectory(tid)
