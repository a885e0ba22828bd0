"""What the adapters share: their configuration, the actions they submit, and
the text a model sees for a result.

The model only ever supplies a command line. Its kind, cores, memory, timeout
and the sandbox image come from the configuration a user wrote, never from the
model's arguments.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from tangram_sdk.client import TangramError, TangramSyncClient
from tangram_sdk.units import parse_counts

log = logging.getLogger("tangram.integrations.common")  # its name before the SDK left tangram/

#: told the id of every sandbox a synchronous adapter closes (groups.py registers its
#: groups' bookkeeping here: a copy's close may leave its template idle); a list rather
#: than an import of groups.py, which imports this module
CLOSE_LISTENERS: list[Callable[[str], None]] = []
T = TypeVar("T")

#: the keys of an adapter's configuration (unknown keys are refused with this list)
CONFIG_KEYS = ("base_url", "token", "task", "image", "mem_gb", "shell", "kind", "cpu",
               "timeout_s", "reward", "idle_ttl_s", "max_output_chars", "check_server",
               "group_setup")
GROUP_SETUP_KEYS = ("command", "timeout_s", "group_size", "idle_ttl_s")
REWARD_KEYS = ("command", "cpu", "elastic", "t1_s", "parallel_fraction", "timeout_s", "shell",
               "state_lost_score")


#: the server's bounds (executor/server/schemas.py), checked when the config loads rather than
#: answered as a 422 to every one of the model's calls
MAX_MEM_GB = 4096.0
MAX_TIMEOUT_S = 24 * 3600.0


def _num(where: str, value: Any, *, positive: bool = True, most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{where}: must be > 0, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"{where}: at most {most:g}, got {value!r}")
    return float(value)


def _cores(where: str, value: Any) -> str:
    """Feasible core counts as the server takes them: ``2``, ``"1-8"`` or ``"1,2,4"``
    (tangram_sdk.units, the parser the server reads them with)."""
    parse_counts(value, where)
    return str(value)


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

    ``state_lost_score``: the score of a rollout whose sandbox was reset on the way (its
    container evicted or dead: the reward would test an empty sandbox). None (the
    default) fails the scoring, naming the rollout, rather than report a result no test
    produced; a number scores such rollouts with it (``reward_status: "state_lost"``).
    """

    command: str
    cpu: str = "1"
    elastic: bool = False
    t1_s: float | None = None
    parallel_fraction: float | None = None
    timeout_s: float | None = None
    shell: bool = True
    state_lost_score: float | None = None

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
            shell=shell,
            state_lost_score=(_num(f"{where}.state_lost_score", raw["state_lost_score"],
                                   positive=False)
                              if raw.get("state_lost_score") is not None else None))

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
    template sandbox that each rollout of the group starts as a copy of (a fork).

    The adapter closes the template itself (the frameworks never say when a group is
    done): once ``group_size`` copies were made (no copy can be made any more: a copy
    needs nothing of its template once forked), or when no copy was forked (and, for the
    sync envs, none is open) for ``idle_ttl_s``. A group whose template closed and that
    asks again (the same prompt in a later step) is prepared again."""

    command: str
    timeout_s: float = 600.0
    #: the rollouts per group (verl's ``actor_rollout_ref.rollout.n``, SkyRL's
    #: ``generator.n_samples_per_prompt``); None: only the idle TTL closes the template
    group_size: int | None = None
    #: a template no copy was forked from (nor, for sync envs, held open) this long closes
    idle_ttl_s: float = 300.0

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
        size = raw.get("group_size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                 or size < 1):
            raise ValueError(f"{where}.group_size: expected an integer >= 1 (the rollouts "
                             f"per group), got {size!r}")
        return cls(_text(f"{where}.command", raw["command"]),
                   _num(f"{where}.timeout_s", raw.get("timeout_s", 600.0), most=MAX_TIMEOUT_S),
                   size,
                   _num(f"{where}.idle_ttl_s", raw.get("idle_ttl_s", 300.0), most=MAX_TIMEOUT_S))

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
    #: ask the server once, when the adapter is built, whether it answers and takes the
    #: token (a wrong URL or token then fails the framework's loader, not every call)
    check_server: bool = True
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
            check_server=_flag(f"{where}.check_server", raw.get("check_server", True)),
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

    def check(self, where: str = "config") -> None:
        """Fail now, naming ``base_url`` or ``token``, if the server does not answer or
        refuses the token (unless ``check_server: false``)."""
        if self.check_server:
            check_server(self.base_url, self.token, f"{where}.base_url", f"{where}.token")


def fork_copy(client: TangramSyncClient, source: str, who: str) -> str:
    """One copy of ``source``, tried again after a transient failure: the copy's id is
    chosen here, so a try whose answer was lost is found again (409 "already open"),
    never left behind as a second copy."""
    prefix = f"copy-{uuid.uuid4().hex[:16]}"

    def once() -> str:
        try:
            return str(client.fork(source, 1, prefix)["ids"][0])
        except TangramError as e:
            if e.status == 409 and "already open" in str(e.detail):
                return f"{prefix}-0"
            raise

    return call_retrying(once, f"{who}: forking sandbox {source}")


class SetupFailed(TangramError):
    """A GRPO group's ``group_setup`` command did not succeed (its output in the message)."""

    def __init__(self, message: str) -> None:
        super().__init__(500, message)
        self.args = (message,)  # no HTTP status in its text: the server answered fine

    def __str__(self) -> str:
        return str(self.detail)


def passed(result: Mapping[str, Any]) -> bool:
    """Whether a reward command succeeded (ran to its end with exit code 0)."""
    return result.get("status") == "ok" and result.get("exit_code") == 0


# -- the server: checked at load, retried where a failure is transient --------------------
def check_server(base_url: str, token: str, url_name: str = "config.base_url",
                 token_name: str = "config.token", timeout_s: float = 10.0) -> None:
    """Raise ValueError naming ``url_name`` or ``token_name`` unless a Tangram server
    answers at ``base_url`` and takes the token (one authenticated ``GET /metrics``)."""
    url = base_url.rstrip("/")
    try:
        resp = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"},
                         timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ValueError(f"{url_name}: no Tangram server answers at {url} ({describe(e)}); "
                         "start `tangram serve` there or fix the URL") from None
    if resp.status_code == 401:
        raise ValueError(f"{token_name}: the server at {url} refused it (HTTP 401); use the "
                         "token `tangram serve` was started with (its --token / TANGRAM_TOKEN)")
    if resp.status_code != 200:
        raise ValueError(f"{url_name}: {url} answered HTTP {resp.status_code} to "
                         "GET /metrics; is it a Tangram server?")


#: statuses a later try may not get (a restarting proxy, an overloaded server)
TRANSIENT_STATUSES = (502, 503, 504)
#: the waits between tries of a call that failed transiently (then it fails)
RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)


def transient(e: BaseException) -> bool:
    """Whether trying ``e``'s request again may succeed (the connection, not the request)."""
    return isinstance(e, httpx.TransportError) or (
        isinstance(e, TangramError) and e.status in TRANSIENT_STATUSES)


def describe(e: BaseException) -> str:
    """``e`` as its cause, for a log line or the model's error text."""
    if isinstance(e, TangramError) and e.status == 401:
        return "the server refused the token (HTTP 401): check the config's token / TANGRAM_TOKEN"
    if isinstance(e, httpx.ConnectError):
        return f"cannot connect to the Tangram server: {e or type(e).__name__}"
    if isinstance(e, httpx.TimeoutException):
        return f"the Tangram server did not answer in time ({type(e).__name__})"
    return str(e) or type(e).__name__


def call_retrying(call: Callable[[], T], what: str) -> T:
    """``call()``, tried again after a transient failure (logged with its cause); the
    last failure, or any other, is logged and raised. ``call`` must be idempotent (an
    action submitted under one id is)."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            return call()
        except (TangramError, httpx.HTTPError) as e:
            if delay is None or not transient(e):
                log.error("%s failed: %s", what, describe(e))
                raise
            log.warning("%s: %s; trying again in %g s", what, describe(e), delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


async def call_retrying_async(call: Callable[[], Awaitable[T]], what: str) -> T:
    """:func:`call_retrying` for a coroutine (``call()`` makes a fresh one per try)."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            return await call()
        except (TangramError, httpx.HTTPError) as e:
            if delay is None or not transient(e):
                log.error("%s failed: %s", what, describe(e))
                raise
            log.warning("%s: %s; trying again in %g s", what, describe(e), delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


# -- rewards: a test result, or why there is none -----------------------------------------
class SandboxLost(RuntimeError):
    """A rollout's sandbox was reset on the way and no ``state_lost_score`` is configured."""


@dataclass(frozen=True, slots=True)
class Status:
    """One ``reward_status``: its default score, and whether it is an infrastructure
    failure (``infra_error``: the sample says nothing about the model; mask it)."""

    score: float | None
    infra: bool
    meaning: str


#: every ``reward_status`` an adapter returns (docs/integrations.md's table is this one)
STATUSES: dict[str, Status] = {
    "ok": Status(1.0, False, "the reward command ran and exited 0: the model's tests passed"),
    "failed": Status(0.0, False, "the reward command ran and exited non-zero: the model's "
                     "tests failed (also when the rollout deleted or emptied them)"),
    "timeout": Status(0.0, False, "the reward command ran past its timeout_s: the model's "
                      "code hung or was too slow (the timeout counts running time only, "
                      "on cores of its own, never time queued)"),
    "oom": Status(0.0, False, "the reward command ran past the sandbox's mem_gb: the "
                  "model's code used too much memory (infra_error only when the machine "
                  "itself ran short and shed the sandbox)"),
    "no_sandbox": Status(0.0, False, "the rollout never called the tool: nothing to test"),
    "error": Status(0.0, True, "the reward could not run: a missing program or module, a "
                    "collection error, pytest's usage or internal error, the action failed "
                    "or was cancelled on the server, or the sandbox was already closed"),
    "state_lost": Status(None, True, "the sandbox was reset during the rollout (its container "
                         "evicted or dead): reward.state_lost_score, else SandboxLost is raised"),
    "setup_failed": Status(0.0, True, "the rollout got no sandbox: its group's group_setup "
                           "failed, or opening or forking its sandbox failed"),
}

#: characters of a reward command's output kept with its score (its tail)
REWARD_OUTPUT_CHARS = 2000
#: output lines that say the reward command could not run, whatever its exit code
_COULD_NOT_RUN = re.compile(r"No module named [^\n]*|ModuleNotFoundError[^\n]*|"
                            r"[^\n]*error(?:s)? during collection[^\n]*|ERROR collecting[^\n]*")
#: pytest's own exit codes that mean its tests never ran (3 internal error, 4 usage
#: error; 2 with a collection error is caught by its output)
_PYTEST_NOT_RUN = {3: "pytest's internal error", 4: "pytest's usage error"}
#: pytest's words when the tests the command names are gone or empty: the rollout
#: deleted them (exit 4 "file or directory not found", exit 5 "no tests ran"), which is
#: the model's failure, not the reward's
_TESTS_GONE = re.compile(r"file or directory not found|no tests ran|collected 0 items")
#: the words of an ``oom`` that the machine caused (executor/node/memwatch.py: it was
#: short of memory and shed the largest sandbox), not the sandbox's own limit
_MACHINE_SHORT = "machine was short of memory"


def could_not_run(exit_code: int | None, output: str, command: str) -> str:
    """Why the reward command could not run ("" when it ran and its exit code is a test
    result): a missing program or module, a collection error, pytest that could not run
    (tests the rollout deleted are a result: the model's failure)."""
    if exit_code in (None, 0):
        return ""
    if exit_code == 127:
        return "its program was not found in the sandbox (exit code 127)"
    if exit_code == 126:
        return "its program is not executable in the sandbox (exit code 126)"
    m = _COULD_NOT_RUN.search(output)
    if m:
        return f"it could not run: {m.group(0).strip()[:200]} (exit code {exit_code})"
    if "pytest" in command and exit_code in (4, 5) and _TESTS_GONE.search(output):
        return ""
    if "pytest" in command and exit_code in _PYTEST_NOT_RUN:
        return f"{_PYTEST_NOT_RUN[exit_code]} (exit code {exit_code})"
    if "pytest" in command and exit_code == 5:
        return "pytest collected no tests (exit code 5)"
    return ""


@dataclass(frozen=True, slots=True)
class Reward:
    """A scored rollout: ``status`` is a key of :data:`STATUSES`; ``infra_error`` says the
    score is no outcome of the model (mask the sample); ``error`` says why it is not a
    plain test result ("" when it is)."""

    score: float
    status: str
    exit_code: int
    output: str
    error: str
    infra_error: bool = False

    @classmethod
    def of(cls, status: str, exit_code: int = -1, output: str = "", error: str = "",
           score: float | None = None, infra: bool | None = None) -> Reward:
        """A reward of ``status`` with its default score and infra flag (unless given)."""
        known = STATUSES[status]
        value = known.score if score is None else score
        assert value is not None, f"{status} has no default score"
        return cls(float(value), status, exit_code, output, error,
                   known.infra if infra is None else infra)

    def fields(self) -> dict[str, Any]:
        """As verl's reward extra info: the same keys, each of one type, for every rollout."""
        return {"score": self.score, "reward_exit_code": self.exit_code,
                "reward_status": self.status, "reward_output": self.output,
                "reward_error": self.error, "infra_error": self.infra_error}


def judge(result: Mapping[str, Any], reward: RewardConfig | Mapping[str, Any],
          lost_before: bool = False, who: str = "rollout") -> Reward:
    """The reward of a rollout from its reward action's ``result``. ``lost_before``: the
    rollout's sandbox was reset at an earlier call. Raises SandboxLost for a reset
    sandbox when no ``state_lost_score`` is configured. Logs every score that is not a
    test result."""
    cfg = reward if isinstance(reward, Mapping) else {
        "command": reward.command, "state_lost_score": reward.state_lost_score}
    output = str(result.get("output") or "")[-REWARD_OUTPUT_CHARS:]
    code = result.get("exit_code")
    exit_code = int(code) if isinstance(code, int) else -1
    if lost_before or result.get("state_lost"):
        why = ("its sandbox was reset during the rollout (its container was evicted or died; "
               "its files are gone), so the reward command would test an empty sandbox")
        if cfg.get("state_lost_score") is None:
            raise SandboxLost(f"{who}: {why}; set reward.state_lost_score (e.g. 0.0) to score "
                              "such rollouts instead of failing")
        log.warning("%s: %s: scored %g (reward.state_lost_score)", who, why,
                    cfg["state_lost_score"])
        return Reward.of("state_lost", exit_code, output, why,
                         score=float(cfg["state_lost_score"]))
    status = str(result.get("status"))
    if status in ("timeout", "oom"):  # the model's code ran past its time or memory
        error = str(result.get("error") or "")
        infra = status == "oom" and _MACHINE_SHORT in error
        log.warning("%s: the reward command ended %s%s: %s", who, status,
                    " (the machine's shortage: infra_error)" if infra else "", error)
        return Reward.of(status, exit_code, output, error, infra=infra)
    if status != "ok":  # failed or cancelled on the server: no test result
        error = f"the reward action ended {status}: {result.get('error') or 'no detail'}"
        log.warning("%s: %s", who, error)
        return Reward.of("error", exit_code, output, error)
    why = could_not_run(code if isinstance(code, int) else None, output,
                        str(cfg.get("command") or ""))
    if why:
        log.error("%s: the reward command %r %s; output tail: %s", who, cfg.get("command"),
                  why, output[-500:])
        return Reward.of("error", exit_code, output, why)
    return Reward.of("ok" if exit_code == 0 else "failed", exit_code, output)


#: the first line of what the model sees after its sandbox was reset
STATE_LOST_NOTE = ("[the sandbox was reset before this command ran: the files and processes "
                   "of earlier commands are gone]")


def render(result: Mapping[str, Any], max_chars: int = 8192, mem_gb: float | None = None) -> str:
    """What the model sees: a line first if its sandbox was reset, the output's tail,
    then one line on how the command ended."""
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
    first = STATE_LOST_NOTE + "\n" if result.get("state_lost") else ""
    return first + output + note


class SyncTrajectory:
    """The blocking client and the one trajectory of a sync environment (gymnasium,
    SkyRL-gym): created on first use, closed with the environment."""

    settings: SandboxConfig
    trajectory: str | None
    _client: TangramSyncClient | None
    #: whether the episode's sandbox was reset at one of its calls (its reward then
    #: scores state_lost, never an empty sandbox)
    lost: bool = False

    def _http(self) -> TangramSyncClient:
        if self._client is None:
            self._client = TangramSyncClient(self.settings.base_url, self.settings.token)
        return self._client

    def _open_trajectory(self, files: Mapping[str, Any], fork_of: str | None = None) -> None:
        """A fresh sandbox holding ``files`` (path -> content): an empty one, or with
        ``fork_of`` a copy of that open trajectory's files (a GRPO group's prepared one)."""
        self._close_trajectory()
        client = self._http()
        if fork_of is not None:
            self.trajectory = fork_copy(client, fork_of, "reset")
        else:
            self.trajectory = call_retrying(
                lambda: client.open_trajectory(None, **self.settings.open_args()),
                "opening a sandbox")
        self.lost = False
        for path, content in files.items():
            client.put_file(self.trajectory, str(path), content)

    def _run(self, action: Mapping[str, Any]) -> dict[str, Any]:
        """Run ``action`` in the episode's sandbox (tried again, under the same id, after a
        transient failure); notes a reset sandbox."""
        assert self.trajectory is not None
        client, tid, aid = self._http(), self.trajectory, uuid.uuid4().hex
        res = call_retrying(lambda: client.run(tid, action_id=aid, **action),
                            f"sandbox {tid}: an action")
        if res.get("state_lost"):
            log.warning("sandbox %s was reset (state_lost): %s", tid, res.get("error") or
                        "its container was evicted or died between actions")
            self.lost = True
        return res

    def _close_trajectory(self) -> None:
        if self.trajectory is not None:
            tid, self.trajectory = self.trajectory, None
            try:
                self._http().close_trajectory(tid)
            except TangramError as e:
                if e.status != 404:  # 404: the server already forgot it
                    raise
            finally:  # a group's copy: its template may now be idle
                for closed in CLOSE_LISTENERS:
                    closed(tid)
