"""verl: a tool whose commands run in a Tangram sandbox, and the reward that scores
the rollout in that sandbox and closes it.

Two config lines wire it into verl 0.9 (``examples/verl_tool.yaml`` is a complete
tool config)::

    actor_rollout_ref.rollout.multi_turn.tool_config_path=examples/verl_tool.yaml
    reward.custom_reward_function.path=pkg://tangram_sdk.integrations.verl
    reward.custom_reward_function.name=compute_score

The tool config names the class; verl's own loader
(``verl.tools.tool_registry.initialize_tools_from_config``) constructs it::

    tools:
      - class_name: tangram_sdk.integrations.verl.TangramTool
        config: {type: native, base_url: "http://127.0.0.1:8000", task: coding, mem_gb: 4,
                 reward: {command: "python3 -m pytest -q tests", cpu: "1-8"}}

The token comes from the config or from TANGRAM_TOKEN (the reward workers read
TANGRAM_TOKEN). The tool asks the server once when verl's loader builds it, and verl's
``get_custom_reward_fn`` checks the reward workers' TANGRAM_TOKEN against their server
(TANGRAM_URL, or ``http://127.0.0.1:8000`` when unset) when it loads ``compute_score``:
a wrong URL or token fails there, naming it. A lost sandbox is told
to the model (the first line of the next tool output) and to the reward.

The sandbox belongs to the rollout. verl's ``ToolAgentLoop`` calls
``create -> execute -> release`` for *every* tool call and passes the rollout's
``agent_data``; the tool keys the sandbox on an id it keeps in
``agent_data.extra_fields["tangram"]``, fresh for every rollout (verl reuses
``request_id`` ``det-<priority>`` across steps under ``full_determinism``: a key
on it would hand the next step's rollout the previous one's files). The calls of
one rollout share the sandbox; ``release`` of a per-call instance leaves it open.

verl copies ``agent_data.extra_fields`` into the batch's ``tool_extra_fields``;
its reward managers (``verl.experimental.reward_loop.reward_manager.*``) merge
them into ``extra_info`` and call ``compute_score(data_source, solution_str,
ground_truth, extra_info)``. :func:`compute_score` finds the sandbox there, runs
the tool config's reward command in it (a ``reward_test`` action, elastic where
configured), returns ``{"score", "reward_exit_code", "reward_status", "reward_output",
"reward_error", "infra_error"}`` and closes the sandbox (:func:`score_rollout` says what
each status means: a reward that could not run is ``error``, a sandbox reset during the
rollout is ``state_lost``, a rollout whose group setup failed is ``setup_failed``: each
with ``infra_error: true``, never a test result). A sandbox is otherwise closed when

* its rollout ends inside ``rollout_scope()`` (``examples/verl_agent_loop.py``
  wraps ``ToolAgentLoop.run`` in it), or ``await tool.close_rollout(key)``;
* or it has been idle for ``idle_ttl_s`` (default 600 s), the backstop.

With ``group_setup`` (and the dataset's ``tools_kwargs: {shell: {create_kwargs: {group:
...}}}``) a group's rollouts start as copies of one prepared template sandbox; the tool
closes the template itself once ``group_setup.group_size`` copies were made, or when none
was forked for ``group_setup.idle_ttl_s`` (verl calls neither ``close_all`` nor
``close_group``).

``calc_reward`` is kept for callers that drive it; verl 0.9 never calls it.
A caller that drives the classic lifecycle (``create`` once, several ``execute``,
``release``, without ``agent_data``) gets one sandbox per instance, closed by
``release``.

The module imports without verl: ``TangramTool`` then derives from a stand-in
base with the same methods. When verl's ``verl.tools.base_tool`` is importable, it
is a real subclass of verl's ``BaseTool`` and returns verl's ``ToolResponse``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from tangram_sdk.client import TangramClient, TangramError
from tangram_sdk.integrations.common import (
    Reward,
    RewardConfig,
    SandboxConfig,
    SetupFailed,
    call_retrying_async,
    check_server,
    describe,
    judge,
    passed,
    render,
)

log = logging.getLogger("tangram.integrations.verl")  # its name before the SDK left tangram/

#: the key of ``agent_data.extra_fields`` (and so of verl's ``tool_extra_fields`` and the
#: reward's ``extra_info``) under which a rollout's sandbox is found
EXTRA_KEY = "tangram"

#: the schema used when a tool config gives none: a `shell` tool with one required argument
DEFAULT_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command in this task's sandbox (a Linux container whose "
                       "files persist across calls) and return its output and exit code.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string",
                                       "description": "The command line, run by `sh -c`."}},
            "required": ["command"],
        },
    },
}

try:  # verl's top-level package imports torch; its tool modules themselves do not
    from verl.tools.base_tool import BaseTool as _Base
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

    HAVE_VERL = True
except ImportError:
    HAVE_VERL = False

    @dataclass
    class ToolResponse:  # type: ignore[no-redef]
        """Stand-in for verl's ToolResponse (text only) when verl is not importable."""

        text: str | None = None
        image: list[Any] | None = None
        video: list[Any] | None = None

    class _Base:  # type: ignore[no-redef]
        """Stand-in for verl's BaseTool when verl is not importable."""

        def __init__(self, config: dict, tool_schema: Any) -> None:
            self.config = config
            self.tool_schema = tool_schema
            self.name = tool_schema["function"]["name"]


#: the rollouts whose sandboxes ``rollout_scope()`` closes when it exits
_SCOPE: contextvars.ContextVar[set[tuple[TangramTool, str]] | None] = \
    contextvars.ContextVar("tangram_rollout_scope", default=None)


@contextlib.asynccontextmanager
async def rollout_scope() -> AsyncIterator[None]:
    """Close, on exit, every sandbox a TangramTool opened for a rollout inside it
    (including in tasks it spawned: they inherit the scope)."""
    opened: set[tuple[TangramTool, str]] = set()
    token = _SCOPE.set(opened)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        for tool, key in list(opened):
            await tool.close_rollout(key)


@dataclass(eq=False)
class _Template:
    """A GRPO group's prepared template sandbox (``group_setup``) in this tool."""

    ready: asyncio.Future[str]
    #: copies forked (or being forked) from it, and those still in flight
    forks: int = 0
    forking: int = 0
    #: when it was last forked from (its idle TTL counts from there)
    last_used: float = 0.0


@dataclass
class _Sandbox:
    trajectory: str
    last_used: float
    busy: int = 0
    #: reset at one of the rollout's calls (its reward then scores state_lost)
    lost: bool = False


class TangramTool(_Base):
    """verl ``BaseTool``: runs the model's ``command`` in the rollout's sandbox."""

    #: a call still queued after this long logs why it waits (the server's reason: no node
    #: has memory for the sandbox, or cores are busy)
    admission_warn_s: float = 10.0

    def __init__(self, config: dict, tool_schema: Any = None) -> None:
        # `type` is verl's own key (native); everything else is ours and validated
        self.settings = SandboxConfig.from_dict(config or {}, "config", ignore=("type",))
        self.settings.check()  # a wrong URL or token fails verl's loader, naming it
        if tool_schema is None:
            tool_schema = (OpenAIFunctionToolSchema.model_validate(DEFAULT_TOOL_SCHEMA)
                           if HAVE_VERL else DEFAULT_TOOL_SCHEMA)
        super().__init__(config, tool_schema)
        self._instances: dict[str, str] = {}  # instance id -> the sandbox key it uses
        self._sandboxes: dict[str, _Sandbox] = {}
        self._opening: dict[str, asyncio.Future[_Sandbox]] = {}
        #: with ``group_setup``: instance/rollout key -> its GRPO group (the dataset's
        #: ``create_kwargs: {group: ...}``), and group -> its prepared template sandbox
        self._group_of: dict[str, str] = {}
        self._templates: dict[str, _Template] = {}
        self._client: TangramClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # cancels sent for abandoned calls

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    # -- verl's BaseTool methods -----------------------------------------------------------
    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Any]:
        """A tool instance; its sandbox opens at the first ``execute`` (when the
        rollout it belongs to is known)."""
        iid = instance_id or uuid.uuid4().hex
        self._instances.setdefault(iid, iid)
        group = (kwargs.get("create_kwargs") or {}).get("group")
        if group is not None and self.settings.group_setup is not None:
            self._group_of[iid] = str(group)
        self._ensure_loop()
        return iid, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[Any, float, dict]:
        """Run ``parameters['command']``; returns (ToolResponse, 0.0, metrics)."""
        command = parameters.get("command") if isinstance(parameters, dict) else None
        if not isinstance(command, str) or not command.strip():
            return (ToolResponse(text='Error: this tool needs a "command" argument holding '
                                      'a shell command line, e.g. {"command": "ls -la"}.'),
                    0.0, {"error": "missing command"})
        key = self._key(instance_id, kwargs.get("agent_data"))
        try:
            result = await self._run(key, self.settings.action(command),
                                     kwargs.get("agent_data"))
        except (TangramError, httpx.HTTPError) as e:  # logged with its cause by _run
            what = ("this task's sandbox could not be prepared" if isinstance(e, SetupFailed)
                    else "the sandbox service failed")
            return (ToolResponse(text=f"Error: {what}: {describe(e)}"), 0.0,
                    {"error": describe(e)})
        # a reset sandbox: the text's first line tells the model (verl keeps the head)
        text = render(result, self.settings.max_output_chars, self.settings.mem_gb)
        metrics = {"status": result["status"], "exit_code": result.get("exit_code"),
                   "units": result.get("units"), "queue_s": result.get("queue_s"),
                   "exec_s": result.get("exec_s"), "state_lost": bool(result.get("state_lost"))}
        return ToolResponse(text=text), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """1.0 if the configured reward command exits 0 in the sandbox, else 0.0
        (0.0 without a reward command). verl 0.9's ToolAgentLoop never calls it."""
        if self.settings.reward is None:
            return 0.0
        key = self._key(instance_id, kwargs.get("agent_data"))
        box = await self._sandbox(key)
        lost_before = box.lost
        result = await self._run(key, self.settings.reward.action())
        return judge(result, self.settings.reward, lost_before, f"rollout {key}").score

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """End the instance; its sandbox closes only if it was the instance's own
        (a rollout's sandbox outlives the per-call instances verl releases)."""
        key = self._instances.pop(instance_id, instance_id)
        self._group_of.pop(instance_id, None)
        if key == instance_id:
            await self.close_rollout(key)
        await self._sweep()

    # -- rollout sandboxes ------------------------------------------------------------------
    async def close_rollout(self, key: str) -> None:
        """Close the sandbox of rollout ``key`` (its request id); no-op if none."""
        self._group_of.pop(key, None)
        box = self._sandboxes.pop(key, None)
        if box is None:
            return
        # closing cancels what the trajectory has in flight (the server does): a call
        # still running ends within its timeout, so let it end first
        deadline = time.monotonic() + (self.settings.timeout_s or 60.0) + 30.0
        while box.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        while True:  # an older server refuses (409) while an action is in flight
            try:
                await self._http().close_trajectory(box.trajectory)
                return
            except TangramError as e:
                if e.status == 409 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    continue
                if e.status != 404:  # 404: the server already forgot it
                    log.warning("closing sandbox %s: %s", box.trajectory, e)
                return
            except httpx.HTTPError as e:
                log.warning("closing sandbox %s: %s", box.trajectory, e)
                return

    async def close_all(self) -> None:
        """Close every sandbox this tool holds (e.g. at the end of training)."""
        for key in list(self._sandboxes):
            await self.close_rollout(key)
        for group in list(self._templates):
            await self.close_group(group)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def sandbox_of(self, key: str) -> str | None:
        """The trajectory id of rollout ``key``'s sandbox, if it has one open."""
        box = self._sandboxes.get(key)
        return box.trajectory if box else None

    def _key(self, instance_id: str, agent_data: Any) -> str:
        key = self._rollout_key(agent_data)
        if key is None:
            key = self._instances.get(instance_id, instance_id)
        if instance_id in self._instances:
            self._instances[instance_id] = key
        group = self._group_of.get(instance_id)
        if group is not None:
            self._group_of.setdefault(key, group)
        scope = _SCOPE.get()
        if scope is not None:
            scope.add((self, key))
        return key

    @staticmethod
    def _rollout_key(agent_data: Any) -> str | None:
        """An id for the rollout ``agent_data`` belongs to, kept in its ``extra_fields``
        (one per AgentData, so never a previous step's even when verl reuses
        ``det-*`` request ids); ``request_id`` for an agent_data without extra_fields."""
        extra = getattr(agent_data, "extra_fields", None)
        if isinstance(extra, dict):
            entry = extra.get(EXTRA_KEY)
            if not isinstance(entry, dict) or "rollout" not in entry:
                rid = getattr(agent_data, "request_id", None)
                entry = {"rollout": f"{rid or 'rollout'}-{uuid.uuid4().hex[:12]}"}
                extra[EXTRA_KEY] = entry
            return str(entry["rollout"])
        request_id = getattr(agent_data, "request_id", None)
        return str(request_id) if request_id is not None else None

    def _publish(self, agent_data: Any, key: str, box: _Sandbox) -> None:
        """What compute_score needs to find and score the rollout's sandbox (no token)."""
        extra = getattr(agent_data, "extra_fields", None)
        if isinstance(extra, dict):
            reward = self.settings.reward
            extra[EXTRA_KEY] = {"rollout": key, "trajectory": box.trajectory,
                                "base_url": self.settings.base_url,
                                "reward": reward.action() if reward is not None else None,
                                "state_lost_score": reward.state_lost_score if reward else None,
                                "state_lost": box.lost}

    def _publish_setup_failed(self, agent_data: Any, key: str, why: str) -> None:
        """The rollout got no sandbox (its group's setup, the open or the fork failed):
        compute_score scores it ``setup_failed`` (infra_error), never ``no_sandbox``."""
        extra = getattr(agent_data, "extra_fields", None)
        if isinstance(extra, dict):
            extra[EXTRA_KEY] = {"rollout": key, "setup_failed": why}

    async def _run(self, key: str, action: dict[str, Any],
                   agent_data: Any = None) -> dict[str, Any]:
        try:
            box = await self._sandbox(key)
        except (TangramError, httpx.HTTPError) as e:
            if key not in self._sandboxes:  # no sandbox for the rollout (yet): say why
                self._publish_setup_failed(agent_data, key, describe(e))
            raise
        self._publish(agent_data, key, box)
        box.busy += 1
        aid = uuid.uuid4().hex  # one id for every try: a repeat is the same action
        try:
            result = await call_retrying_async(
                lambda: self._call(key, box.trajectory, aid, action),
                f"rollout {key}: a call in sandbox {box.trajectory}")
        except asyncio.CancelledError:
            # verl gave up on the call: stop it on the server too (its cores come back)
            task = asyncio.get_running_loop().create_task(self._cancel(aid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise
        finally:
            box.busy -= 1
            box.last_used = time.monotonic()
        if result.get("state_lost"):
            log.warning("rollout %s: its sandbox %s was reset (state_lost): %s", key,
                        box.trajectory, result.get("error") or "its container was evicted or "
                        "died between calls; the model is told, the reward will say so")
            box.lost = True
            self._publish(agent_data, key, box)
        return result

    async def _call(self, key: str, trajectory: str, aid: str,
                    action: dict[str, Any]) -> dict[str, Any]:
        http = self._http()
        call = asyncio.ensure_future(http.run(trajectory, action_id=aid, **action))
        try:
            done, _ = await asyncio.wait({call}, timeout=self.admission_warn_s)
            if not done:  # still waiting: say why in verl's log (a full machine?)
                with contextlib.suppress(TangramError, httpx.HTTPError):
                    state = await http.wait(aid, 0)
                    if state.get("status") == "queued" and state.get("error"):
                        log.warning("rollout %s: its call has waited %g s: %s", key,
                                    self.admission_warn_s, state["error"])
            return await call
        except BaseException:
            call.cancel()
            raise

    async def _cancel(self, aid: str) -> None:
        try:
            await self._http().cancel(aid)
        except (TangramError, httpx.HTTPError) as e:
            log.warning("cancelling abandoned call %s: %s", aid, describe(e))

    async def _sandbox(self, key: str) -> _Sandbox:
        """The rollout's sandbox, opened once even when its calls run in parallel."""
        box = self._sandboxes.get(key)
        if box is not None:
            return box
        pending = self._opening.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[_Sandbox] = asyncio.get_running_loop().create_future()
        self._opening[key] = fut
        try:
            group = self._group_of.get(key)
            if group is not None:  # a copy of the group's prepared sandbox
                tid = await self._fork_copy(group)
            else:
                tid = uuid.uuid4().hex  # chosen here: a try repeated after a lost answer is a no-op
                await call_retrying_async(lambda: self._open(tid),
                                          f"rollout {key}: opening a sandbox")
            box = _Sandbox(tid, time.monotonic())
            self._sandboxes[key] = box
            fut.set_result(box)
            return box
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters get it, nobody is warned about it
            raise
        finally:
            del self._opening[key]

    async def _open(self, tid: str) -> None:
        try:
            await self._http().open_trajectory(tid, **self.settings.open_args())
        except TangramError as e:
            if e.status != 409:  # 409: an earlier try of this same open got through
                raise

    async def _fork_copy(self, group: str) -> str:
        """A new sandbox that starts as a copy of group ``group``'s template (prepared
        first if needed). The template closes once ``group_setup.group_size`` copies were
        made (a copy needs nothing of it once forked), or by the idle sweep once none was
        forked for ``group_setup.idle_ttl_s``: verl never says when a group is done."""
        assert self.settings.group_setup is not None
        while True:
            tpl = self._templates.get(group)
            if tpl is None:
                tpl = self._templates[group] = _Template(
                    asyncio.ensure_future(self._prepare(group)), last_used=time.monotonic())
                # its idle time counts from when it is ready (callbacks run in order: before
                # the waiters below resume, so the sweep never takes it from under them)
                tpl.ready.add_done_callback(
                    lambda _, t=tpl: setattr(t, "last_used", time.monotonic()))
            try:
                template = await asyncio.shield(tpl.ready)
            except BaseException:
                if self._templates.get(group) is tpl and tpl.ready.done():
                    del self._templates[group]  # a failed setup is tried again by the next
                raise
            if self._templates.get(group) is tpl:
                break  # else: closed while this one waited (its last copy made, or idle)
        tpl.forks += 1
        tpl.forking += 1
        copy: str | None = None
        try:
            prefix = f"copy-{uuid.uuid4().hex[:16]}"
            copy = await call_retrying_async(lambda: self._fork_once(template, prefix),
                                             f"group {group!r}: forking sandbox {template}")
            return copy
        finally:
            tpl.forking -= 1
            tpl.last_used = time.monotonic()
            if copy is None:
                tpl.forks -= 1
            size = self.settings.group_setup.group_size
            if size is not None and tpl.forks >= size and not tpl.forking:
                await self._close_template(group, tpl)

    async def _fork_once(self, template: str, prefix: str) -> str:
        """One copy named ``<prefix>-0``: a repeated try whose answer was lost finds it."""
        try:
            return str((await self._http().fork(template, 1, prefix))["ids"][0])
        except TangramError as e:
            if e.status == 409 and "already open" in str(e.detail):
                return f"{prefix}-0"
            raise

    async def _prepare(self, group: str) -> str:
        """Open the group's template and run its setup; closed again if that failed."""
        assert self.settings.group_setup is not None
        http = self._http()
        tid = f"group-{uuid.uuid4().hex[:20]}"  # chosen here: a repeated open is a no-op
        await call_retrying_async(lambda: self._open(tid), f"group {group!r}: opening a sandbox")
        aid = uuid.uuid4().hex  # fresh per template: a repeated id answers the old result
        try:
            result = await call_retrying_async(
                lambda: http.run(tid, action_id=aid, **self.settings.group_setup.action()),  # type: ignore[union-attr]
                f"group {group!r}: its setup in sandbox {tid}")
        except BaseException:
            await self._close_quietly(tid)
            raise
        if not passed(result):
            await self._close_quietly(tid)
            raise SetupFailed(f"group_setup of group {group!r} failed: {render(result, 2000)}")
        return tid

    async def close_group(self, group: str) -> None:
        """Close group ``group``'s template sandbox (its rollouts' copies stay theirs)."""
        tpl = self._templates.get(group)
        if tpl is not None:
            await self._close_template(group, tpl)

    async def _close_template(self, group: str, tpl: _Template) -> None:
        if self._templates.get(group) is tpl:
            del self._templates[group]
        if not tpl.ready.done():  # still preparing: close it once its setup ends
            def later(fut: asyncio.Future[str]) -> None:
                if not fut.cancelled() and fut.exception() is None:
                    task = asyncio.ensure_future(self._close_quietly(fut.result()))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
            tpl.ready.add_done_callback(later)
        elif not tpl.ready.cancelled() and tpl.ready.exception() is None:
            await self._close_quietly(tpl.ready.result())

    async def _close_quietly(self, tid: str) -> None:
        try:
            await self._http().close_trajectory(tid)
        except TangramError as e:
            if e.status != 404:  # 404: already closed
                log.warning("closing group template %s: %s", tid, describe(e))
        except httpx.HTTPError as e:
            log.warning("closing group template %s: %s", tid, describe(e))

    def _http(self) -> TangramClient:
        """A client bound to the running loop (verl may call from several loops)."""
        self._ensure_loop()
        if self._client is None:
            self._client = TangramClient(self.settings.base_url, self.settings.token)
        return self._client

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # an httpx client cannot move between loops
            self._loop, self._client = loop, None
            self._sweeper = loop.create_task(self._sweep_loop())
        return loop

    async def _sweep(self) -> None:
        """Close the rollouts' sandboxes idle past ``idle_ttl_s`` and the group templates
        no copy was forked from for ``group_setup.idle_ttl_s``."""
        now = time.monotonic()
        stale = [k for k, b in self._sandboxes.items()
                 if not b.busy and now - b.last_used > self.settings.idle_ttl_s]
        for key in stale:
            log.info("closing sandbox of rollout %s: idle for over %g s", key,
                     self.settings.idle_ttl_s)
            await self.close_rollout(key)
        setup = self.settings.group_setup
        if setup is None:
            return
        idle = [(g, t) for g, t in self._templates.items()
                if t.ready.done() and not t.forking and now - t.last_used > setup.idle_ttl_s]
        for group, tpl in idle:
            log.info("closing the template of group %r: no copy forked for %g s", group,
                     setup.idle_ttl_s)
            await self._close_template(group, tpl)

    async def _sweep_loop(self) -> None:
        ttl = self.settings.idle_ttl_s
        if self.settings.group_setup is not None:
            ttl = min(ttl, self.settings.group_setup.idle_ttl_s)
        while True:
            await asyncio.sleep(min(max(ttl / 4, 0.05), 30.0))
            await self._sweep()


# -- verl's reward path -------------------------------------------------------------------
def __getattr__(name: str) -> Any:
    """``compute_score``, checked as verl's loader fetches it.

    verl's ``get_custom_reward_fn`` loads ``reward.custom_reward_function.name`` with
    ``getattr`` on this module, in the reward workers, before any rollout is scored: the
    reward workers' TANGRAM_TOKEN and server (TANGRAM_URL, or :data:`DEFAULT_URL` when
    it is unset) are checked there, so a missing or wrong token fails the loader naming
    it rather than every reward batch (whose sandboxes could then not even be closed)."""
    if name == "compute_score":
        check_reward_env()
        return score_rollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the server the reward workers check when TANGRAM_URL is unset: the shipped tool
#: config's default (``${oc.env:TANGRAM_URL,http://127.0.0.1:8000}``)
DEFAULT_URL = "http://127.0.0.1:8000"


def check_reward_env() -> None:
    """Raise ValueError unless TANGRAM_TOKEN is set and a Tangram server answers at
    TANGRAM_URL (unset: :data:`DEFAULT_URL`, the shipped tool config's default) and takes
    the token. Checked whether or not TANGRAM_URL is set: a wrong token would otherwise
    pass here and fail every reward with HTTP 401, leaving each sandbox open."""
    token = os.environ.get("TANGRAM_TOKEN")
    if not token:
        raise ValueError("compute_score: TANGRAM_TOKEN is not set where verl's reward workers "
                         "run; without it no rollout can be scored and no sandbox closed (set "
                         "it in their environment, e.g. Ray's runtime_env env_vars)")
    url = os.environ.get("TANGRAM_URL")
    if url:
        check_server(url, token, "compute_score: TANGRAM_URL", "compute_score: TANGRAM_TOKEN")
        return
    check_server(DEFAULT_URL, token,
                 f"compute_score: TANGRAM_URL is not set, so the default {DEFAULT_URL} was "
                 "checked (set TANGRAM_URL where verl's reward workers run to the tool "
                 "config's base_url)", "compute_score: TANGRAM_TOKEN")


async def score_rollout(data_source: Any = None, solution_str: str | None = None,
                        ground_truth: Any = None, extra_info: dict[str, Any] | None = None,
                        **reward_kwargs: Any) -> dict[str, Any]:
    """verl's ``custom_reward_function`` (configured as ``compute_score``, which checks the
    reward workers' token when verl loads it): score the rollout in its own sandbox, then
    close the sandbox, whatever happens.

    ``extra_info[EXTRA_KEY]`` is what TangramTool put into the rollout's
    ``tool_extra_fields``. The reward command is the tool config's ``reward`` unless
    ``reward_kwargs`` (``custom_reward_function.reward_kwargs``) give one: keys of
    the tool's ``reward`` block (``command``, ``cpu``, ``elastic``, ``state_lost_score``,
    ...). Returns the same keys for every rollout (verl gathers them per key into
    ``reward_extra_info``): ``score``; ``reward_status``, one of
    :data:`~tangram_sdk.integrations.common.STATUSES` (``ok`` 1.0; ``failed``, ``timeout``,
    ``oom``, ``no_sandbox`` 0.0: the model's outcomes; ``error``, ``setup_failed`` 0.0
    and ``state_lost`` (``state_lost_score``; without one this raises
    :class:`~tangram_sdk.integrations.common.SandboxLost`): infrastructure failures);
    ``infra_error`` (true: the score is no outcome of the model, mask the sample);
    ``reward_exit_code`` (-1: none), ``reward_output`` (the output's tail) and
    ``reward_error`` (why it is not a plain test result; "" when it is).
    """
    entry = (extra_info or {}).get(EXTRA_KEY)
    reward_kwargs = {k: v for k, v in reward_kwargs.items()
                     if k not in ("reward_router_address", "reward_model_tokenizer")}
    if isinstance(entry, dict) and entry.get("setup_failed") and not entry.get("trajectory"):
        log.error("rollout %s got no sandbox: %s", entry.get("rollout"), entry["setup_failed"])
        return Reward.of("setup_failed", error=str(entry["setup_failed"])).fields()
    if not isinstance(entry, dict) or not entry.get("trajectory"):
        return Reward.of("no_sandbox", error="the rollout never called the tool").fields()
    base_url = entry.get("base_url") or os.environ.get("TANGRAM_URL")
    if not base_url:
        raise ValueError("compute_score: no Tangram URL (the tool's base_url or TANGRAM_URL)")
    token = os.environ.get("TANGRAM_TOKEN")
    if not token:
        check_reward_env()  # raises, naming TANGRAM_TOKEN
    trajectory = str(entry["trajectory"])
    who = f"rollout {entry.get('rollout', trajectory)}"
    async with TangramClient(base_url, token) as tg:
        try:
            if reward_kwargs:
                reward: RewardConfig | dict[str, Any] = RewardConfig.from_dict(
                    reward_kwargs, "reward_kwargs")
                action = reward.action()  # type: ignore[union-attr]
            elif entry.get("reward"):
                action = dict(entry["reward"])
                reward = {**action, "state_lost_score": entry.get("state_lost_score")}
            else:
                raise ValueError("compute_score: no reward command (give the tool config a "
                                 "`reward` block or custom_reward_function.reward_kwargs.command)")
            aid = uuid.uuid4().hex  # one id for every try: a repeat is the same action
            try:
                result = await call_retrying_async(
                    lambda: tg.run(trajectory, action_id=aid, **action),
                    f"{who}: its reward in sandbox {trajectory}")
            except TangramError as e:
                if e.status != 404:
                    raise
                # closed already (its idle TTL, or scored before): nothing to score
                return Reward.of("error", error="the sandbox was closed before the reward "
                                 "ran (scored before, or idle for the tool's idle_ttl_s)"
                                 ).fields()
            return judge(result, reward, bool(entry.get("state_lost")), who).fields()
        finally:
            with contextlib.suppress(TangramError, httpx.HTTPError):
                await tg.close_trajectory(trajectory)
