"""The request and response bodies of `tangram serve`, validated at the edge.

Everything a client sends is checked here, before it reaches the core or a
backend: unknown fields are refused (a typo such as ``time_out`` must not be
silently ignored), types are strict (``mem_gb: true`` is not 1 GB), numbers are
finite and bounded, and ids have one documented shape so that each maps to
exactly one directory inside the work root. What needs the running server
(the machine's core count, the allow-list of API destinations) is checked by
the service.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator

from tangram.model import BASE_RESOURCES, Action, Demand, Elasticity, quota_resource
from tangram.units import MAX_TEXT, parse_units

#: ids of trajectories and actions: letters, digits and ``-_.:``, 1-128 chars, not only dots
#: (so never ``.`` or ``..``)
ID_PATTERN = r"^[A-Za-z0-9_.:-]*[A-Za-z0-9_:-][A-Za-z0-9_.:-]*$"
ID_MAX = 128
#: the largest request body the server reads (bytes); larger ones get 413
MAX_BODY_BYTES = 1 << 20
#: the longest ``command`` string, and the most bytes in all of ``argv`` together
MAX_COMMAND_CHARS = 64 * 1024
MAX_ARGS = 4096
#: the longest timeout an action may ask for (seconds); also the default
MAX_TIMEOUT_S = 24 * 3600.0
#: the shortest timeout an action may ask for (a GPU endpoint's ``timeout_s`` too)
MIN_TIMEOUT_S = 0.01
MAX_ENV = 256

Id = Annotated[str, StringConstraints(pattern=ID_PATTERN, max_length=ID_MAX)]
EnvKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
QuotaKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,100}$")]
#: docker image references: registry/name:tag@digest characters only
Image = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,254}$")]

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _no_nul(text: str, where: str) -> str:
    if "\x00" in text:
        raise ValueError(f"{where}: NUL bytes cannot be passed to a process")
    return text


class TrajectoryIn(BaseModel):
    model_config = _STRICT

    id: Id | None = Field(None, description=f"Trajectory id (generated when omitted); "
                          f"pattern {ID_PATTERN}.")
    task: Name = Field("default", description="Task name (selects the default image).")
    mem_gb: float | None = Field(None, ge=0, le=4096, description="Memory of its environment (GB).")
    image: Image | None = Field(None, description="Docker image of its sandbox (docker backend; "
                                "default: the task's image from the server config).")
    fork_of: Id | None = Field(None, description="Open ``count`` trajectories whose sandboxes "
                               "start as copies of this open trajectory's files (its task and "
                               "memory; ``id``, when given, names them ``<id>-0``, ``<id>-1``, ...). "
                               "Refused (409) while it has an action in flight.")
    count: int = Field(1, ge=1, le=64, description="Copies to open (with ``fork_of``).")
    action: Id | None = Field(None, description="With ``fork_of``: the id of the fork's action "
                              "(generated when omitted; the answer's ``action``), to look it up "
                              "or cancel it while it runs (GET/DELETE /v1/actions/{action}).")


class RequestSpec(BaseModel):
    """An outbound API call run by the server (the destination must be allow-listed)."""

    method: Annotated[str, StringConstraints(pattern=r"^(GET|POST|PUT|PATCH|DELETE|HEAD)$")] = "GET"
    url: Annotated[str, StringConstraints(pattern=r"^https?://[^\s\x00]{1,2048}$")]
    headers: dict[str, str] | None = None
    params: dict[str, str] | None = None
    json_: Any = Field(None, alias="json")
    body: str | None = Field(None, max_length=MAX_COMMAND_CHARS)

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)


class ActionIn(BaseModel):
    model_config = _STRICT

    id: Id = Field(description="Client-chosen id; resubmitting the same id with the same body "
                   "is a no-op, with a different body a 409.")
    kind: Name = "shell"
    argv: list[str] | None = Field(None, min_length=1, max_length=MAX_ARGS,
                                   description="Command as argv (no shell).")
    command: str | None = Field(None, min_length=1, max_length=MAX_COMMAND_CHARS,
                                description="Command line, split with shlex (no shell).")
    shell: bool = Field(False, description="Run `command` as `sh -c <command>` inside the "
                        "sandbox (the command is one argument, never interpolated).")
    request: RequestSpec | None = Field(
        None, description="An outbound API call instead of a command: {method, url, json, ...}.")
    cpu: str = Field("1", max_length=MAX_TEXT, description="Feasible core counts: '2', '1-8' or "
                     "'1,2,4' (counts above the machine's cores are dropped).")
    elastic: bool = Field(False, description="Cores are the key elastic resource (pytest -n).")
    t1_s: float | None = Field(None, ge=0, le=1e7, description="Profiled duration on one core (s).")
    parallel_fraction: float | None = Field(None, ge=0, le=1, description="Amdahl fraction of E(m).")
    rigid: bool = Field(False, description="An elastic command that reads its core count once "
                        "(e.g. from nproc): its grant is fixed at its start, never resized.")
    quota: dict[QuotaKey, Annotated[float, Field(gt=0, le=1e9)]] = Field(
        default_factory=dict, max_length=16, description="Quota key -> units.")
    timeout_s: float | None = Field(None, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S,
                                    description=f"Kill after this many seconds (at most "
                                    f"{MAX_TIMEOUT_S:g}, also the default).")
    env: dict[EnvKey, str] = Field(default_factory=dict, max_length=MAX_ENV)
    service: Name | None = Field(None, description="GPU service (model) to call: a GPU action.")
    gpus: str = Field("1", max_length=MAX_TEXT,
                      description="GPU action: feasible GPU counts, '1' or '1,2,4,8'.")
    inputs: dict[str, Any] | None = Field(
        None, description="GPU action: {op: 'logprobs' | 'score', tokens: [[ids]], yes_token}.")

    @field_validator("cpu", "gpus")
    @classmethod
    def _units(cls, v: str, info: ValidationInfo) -> str:
        # both checked here, whatever the action's kind: a GPU count set is parsed (bounded)
        # before a handler sees it, and the GPU part then checks its counts are 1, 2, 4, 8
        parse_units(v, info.field_name or "units")
        return v

    @field_validator("quota")
    @classmethod
    def _quota(cls, v: dict[str, float]) -> dict[str, float]:
        for key in v:
            if quota_resource(key) in BASE_RESOURCES:
                raise ValueError(f"{key!r} is a resource, not a quota key")
        return v

    @field_validator("argv")
    @classmethod
    def _argv(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v[0]:
            raise ValueError("the program name is empty")
        if sum(len(a) for a in v) > MAX_COMMAND_CHARS:
            raise ValueError(f"more than {MAX_COMMAND_CHARS} characters in all")
        for a in v:
            _no_nul(a, "argv")
        return v

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | None) -> str | None:
        if v is not None:
            if not v.strip():
                raise ValueError("the command is empty")
            _no_nul(v, "command")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            _no_nul(value, f"env[{key!r}]")
            if len(value) > MAX_COMMAND_CHARS:
                raise ValueError(f"env[{key!r}]: longer than {MAX_COMMAND_CHARS} characters")
        return v

    def check_shape(self) -> None:
        if self.shell and self.command is None:
            raise ValueError("shell: applies to 'command' only; argv never runs in a shell")
        if self.service is not None:
            return  # a GPU action: executor.backends.gpu.actions checks its fields
        given = [n for n in ("argv", "command", "request") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("argv: give exactly one of argv, command or request"
                             + (f" (got {', '.join(given)})" if given else ""))

    def to_action(self, trajectory: str, task: str, argv: list[str] | None,
                  max_cores: int) -> Action:
        """The core's Action: the one builder from a request body (commands, API calls
        and GPU actions alike); ``argv`` is the already split command. ValueError names
        the bad field."""
        cost: dict[str, Demand] = {}
        elastic: str | None = None
        if self.service is not None:  # a GPU action: its GPU counts and inputs
            from executor.backends.gpu.actions import gpu_fields

            cost["gpu"], payload = gpu_fields(self)
            elastic = "gpu" if self.elastic and cost["gpu"].elastic else None
        else:
            if self.request is None:
                demand = parse_units(self.cpu, "cpu")
                fitting = tuple(c for c in demand.choices if c <= max_cores)
                # counts the machine cannot grant are infeasible anyway; the smallest one
                # is kept so that the core's check names the problem when none fits
                cost["cpu"] = Demand(fitting or (demand.min,))
                elastic = "cpu" if self.elastic else None
            request = (self.request.model_dump(by_alias=True, exclude_none=True)
                       if self.request else None)
            # every command has a timeout (the host enforces it); an API call left
            # without one gets the HTTP backend's per-attempt default
            timeout = self.timeout_s or (None if request else MAX_TIMEOUT_S)
            payload = {"argv": argv, "command": self.command, "request": request,
                       "timeout_s": timeout, "env": self.env}
            if self.rigid:  # (read by tangram/cpu/malleable.py: never resized)
                payload["rigid"] = True
        for key, units in self.quota.items():  # checked by _quota: never a base resource
            cost[quota_resource(key)] = Demand.fixed(units)
        elasticity = (Elasticity.amdahl(self.parallel_fraction)
                      if self.parallel_fraction is not None else None)
        return Action(self.id, task, trajectory, self.kind, cost, elastic=elastic,
                      t1_s=self.t1_s, elasticity=elasticity, service=self.service,
                      payload=payload)


class ErrorOut(BaseModel):
    """A refusal other than 422 (401, 403, 404, 409, 413, 503)."""

    detail: str


class ActionOut(BaseModel):
    id: str
    trajectory: str
    status: str = Field(description="queued | running | ok | failed | timeout | oom | cancelled")
    exit_code: int | None = None
    output: str = ""
    error: str = ""
    units: int | None = None
    cores: list[int] = Field(default_factory=list)
    gpus: list[int] = Field(default_factory=list)
    lane: bool = Field(False, description="Ran on the node's light lane (cores shared).")
    queue_s: float | None = None
    exec_s: float | None = None
    state_lost: bool = False
    retries: int = 0
    node: str | None = Field(None, description="The node it ran on (several with --ray).")
    argv: list[str] = Field(default_factory=list, description="What was executed (after -n).")


#: actions in one ``POST /v1/actions:batch`` (a body stays under MAX_BODY_BYTES anyway)
MAX_BATCH = 1024


class BatchItem(BaseModel):
    model_config = _STRICT

    trajectory: Id = Field(description="The trajectory the action runs in.")
    action: ActionIn


class BatchIn(BaseModel):
    """Many actions in one request: all are validated before any is accepted."""

    model_config = _STRICT

    actions: list[BatchItem] = Field(min_length=1, max_length=MAX_BATCH)


class BatchOut(BaseModel):
    actions: list[ActionOut] = Field(description="Each action's state, in the request's order "
                                     "(an id submitted before with the same body: its state).")


class TrajectoryOut(BaseModel):
    id: str
    task: str
    state: str = Field(description="idle | queued (actions wait, none runs) | running | "
                       "closing (its in-flight actions are being cancelled)")
    node: str | None = Field(None, description="The CPU node it is bound to (None: not yet, "
                             "or unbound while idle).")
    in_flight: int = Field(description="Its actions queued or running.")
    idle_s: float = Field(description="Seconds since its last action ended (0 while busy; "
                          "since it opened when it has had none).")
    age_s: float = Field(description="Seconds since it opened.")
    mem_gb: float | None = Field(None, description="Its declared memory (None: its first "
                                 "action's).")
    image: str | None = None
    actions: int = Field(description="Actions submitted to it.")
    state_lost: int = Field(0, description="Its actions that reported its sandbox reset.")
    forks: list[str] = Field(default_factory=list, description="The ids of its fork actions in "
                             "flight (GET/DELETE /v1/actions/{id}).")


class TrajectoriesOut(BaseModel):
    trajectories: list[TrajectoryOut]
