"""Values of the action model (paper section 4.1).

Every value is a frozen, slotted dataclass validated at construction: a bad
field raises ``ValueError`` naming the field, so a malformed action never
reaches the scheduler.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

#: Resources every cluster knows. API quotas and other counted resources are
#: named ``quota:<key>`` (e.g. ``quota:google``) and configured per cluster.
BASE_RESOURCES = frozenset({"cpu", "mem_gb", "gpu", "gpu_mem_gb", "net_mbps"})
QUOTA_PREFIX = "quota:"


def quota_resource(key: str) -> str:
    """The cost key of the counted resource a user names ``key``: ``google`` ->
    ``quota:google``; ``quota:google`` and the base resources stay as they are. The one
    normalisation every entry point (traces, cluster YAML, CLI, HTTP) uses."""
    if key in BASE_RESOURCES or key.startswith(QUOTA_PREFIX):
        return key
    return QUOTA_PREFIX + key


def counted(resource: str) -> bool:
    """Counted resources (API quotas, bandwidth) are not scheduled: they are checked
    inside a pool's candidate prefix and reserved with the action, all or nothing."""
    return resource.startswith(QUOTA_PREFIX) or resource == "net_mbps"


def check_resource_name(name: str, where: str = "cost") -> None:
    if name in BASE_RESOURCES:
        return
    if name.startswith(QUOTA_PREFIX) and len(name) > len(QUOTA_PREFIX):
        return
    raise ValueError(
        f"{where}: unknown resource {name!r} (expected one of {sorted(BASE_RESOURCES)} "
        f"or '{QUOTA_PREFIX}<key>')"
    )


def slot_init(cls: type) -> type:
    """Give the frozen slots dataclass ``cls`` an ``__init__`` that sets each slot through
    its descriptor. The generated one goes through ``object.__setattr__`` per field (a
    frozen class refuses plain assignment), ~2.4x the cost: the core builds a grant, a
    lease and a dispatch for every action it starts. The same parameters, defaults and
    order; only for a class without ``__post_init__``, default factories or keyword-only
    fields (refused at import)."""
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: has __post_init__")
    params, body, ns = [], [], {}
    for i, f in enumerate(dataclasses.fields(cls)):
        if f.default_factory is not dataclasses.MISSING or not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name}: a plain field is needed")
        ns[f"_set{i}"] = cls.__dict__[f.name].__set__  # the slot's member descriptor
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            ns[f"_d{i}"] = f.default
            params.append(f"{f.name}=_d{i}")
        body.append(f"    _set{i}(self, {f.name})")
    exec(f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body or ["    pass"]), ns)
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init  # type: ignore[misc]
    return cls


def _finite_nonneg(value: float, name: str) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Demand:
    """The feasible amounts of one resource, sorted ascending.

    Build with :meth:`fixed`, :meth:`range` or :meth:`discrete`.
    """

    choices: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.choices:
            raise ValueError("demand.choices: empty feasible set")
        for c in self.choices:
            _finite_nonneg(c, "demand.choices")
        if list(self.choices) != sorted(set(self.choices)):
            raise ValueError(f"demand.choices: must be strictly increasing, got {self.choices}")

    @classmethod
    def fixed(cls, amount: float) -> Demand:
        return cls((amount,))

    @classmethod
    def range(cls, lo: int, hi: int, step: int = 1) -> Demand:
        if lo > hi:
            raise ValueError(f"demand.min: min {lo} > max {hi}")
        if step <= 0:
            raise ValueError(f"demand.step: must be > 0, got {step}")
        vals = list(range(lo, hi + 1, step))
        if vals and vals[-1] != hi:
            vals.append(hi)
        return cls(tuple(vals))

    @classmethod
    def discrete(cls, values: Iterable[float]) -> Demand:
        return cls(tuple(sorted(set(values))))

    @property
    def min(self) -> float:
        return self.choices[0]

    @property
    def max(self) -> float:
        return self.choices[-1]

    @property
    def elastic(self) -> bool:
        return len(self.choices) > 1


@dataclass(frozen=True, slots=True)
class Elasticity:
    """E(m): parallel efficiency on ``m`` units, ``0 < E(m) <= 1``.

    Either a table ``{m: E(m)}`` (for a unit count missing from the table the
    nearest smaller entry is used — efficiency does not rise with m) or an
    Amdahl parallel fraction ``p``: speedup(m) = 1 / ((1 - p) + p / m).
    """

    table: tuple[tuple[int, float], ...] = ()
    parallel_fraction: float | None = None

    def __post_init__(self) -> None:
        if bool(self.table) == (self.parallel_fraction is not None):
            raise ValueError("elasticity: give exactly one of table or parallel_fraction")
        if self.parallel_fraction is not None:
            p = self.parallel_fraction
            if not isinstance(p, int | float) or math.isnan(p) or not 0.0 <= p <= 1.0:
                raise ValueError(f"elasticity.parallel_fraction: must be in [0, 1], got {p!r}")
        for m, e in self.table:
            if not isinstance(m, int) or m < 1:
                raise ValueError(f"elasticity.table: unit count must be an int >= 1, got {m!r}")
            if not isinstance(e, int | float) or math.isnan(e) or not 0.0 < e <= 1.0:
                raise ValueError(f"elasticity.table: E({m}) must be in (0, 1], got {e!r}")
        if self.table and [m for m, _ in self.table] != sorted({m for m, _ in self.table}):
            raise ValueError("elasticity.table: unit counts must be strictly increasing")

    @classmethod
    def amdahl(cls, parallel_fraction: float) -> Elasticity:
        return cls(parallel_fraction=parallel_fraction)

    @classmethod
    def from_table(cls, table: Mapping[int, float]) -> Elasticity:
        return cls(table=tuple(sorted((int(m), float(e)) for m, e in table.items())))

    def durations(self, t1_s: float, choices: tuple[int, ...]) -> dict[int, float]:
        """``{m: t1_s / (E(m) * m)}`` for every m of ``choices``: the same arithmetic as
        :meth:`efficiency`, without a call per unit count (an elastic action of 1-32
        cores asks this for each count, and a burst queues thousands)."""
        p = self.parallel_fraction
        if p is None:
            return {m: t1_s / (self.efficiency(m) * m) for m in choices}
        q = 1.0 - p
        return {m: t1_s / (1.0 * m) if m <= 1 else t1_s / (1.0 / (m * (q + p / m)) * m)
                for m in choices}

    def efficiency(self, m: float) -> float:
        if m <= 1:
            return 1.0
        if self.parallel_fraction is not None:
            p = self.parallel_fraction
            return 1.0 / (m * ((1.0 - p) + p / m))
        best = self.table[0][1]
        for units, e in self.table:
            if units > m:
                break
            best = e
        return best


@dataclass(frozen=True, slots=True)
class Action:
    """One atomic call on external resources (a tool call, a test run, a reward request).

    ``cost`` maps resource names to their feasible amounts; ``elastic`` names
    the key elastic resource whose amount changes the duration
    ``dur(m) = t1_s / (E(m) * m)``. ``payload`` is opaque to the core: the
    backends read it (the command to run, the request to send).
    """

    id: str
    task: str
    trajectory: str
    kind: str
    cost: Mapping[str, Demand] = field(default_factory=dict)
    elastic: str | None = None
    t1_s: float | None = None
    elasticity: Elasticity | None = None
    service: str | None = None
    payload: Any = None

    def __post_init__(self) -> None:
        for name in ("id", "task", "trajectory", "kind"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"action.{name}: must be a non-empty string, got {value!r}")
        if not isinstance(self.cost, Mapping):
            raise ValueError("action.cost: must map resource names to Demand")
        for res, demand in self.cost.items():
            check_resource_name(res, "action.cost")
            if not isinstance(demand, Demand):
                raise ValueError(f"action.cost[{res!r}]: must be a Demand, got {demand!r}")
        if self.t1_s is not None:
            _finite_nonneg(self.t1_s, "action.t1_s")
        if self.elastic is not None:
            check_resource_name(self.elastic, "action.elastic")
            if self.elastic not in self.cost:
                raise ValueError(
                    f"action.elastic: key resource {self.elastic!r} has no entry in cost"
                )
            if self.cost[self.elastic].min < 1:
                raise ValueError(f"action.elastic: {self.elastic!r} minimum must be >= 1 unit")
        if self.elasticity is not None and not isinstance(self.elasticity, Elasticity):
            raise ValueError("action.elasticity: must be an Elasticity")
        if "gpu" in self.cost and self.cost["gpu"].max > 0 and not self.service:
            raise ValueError("action.service: a GPU action must name the service it calls")

    def min(self, resource: str) -> float:
        demand = self.cost.get(resource)
        return demand.min if demand is not None else 0

    @property
    def schedulable_elastic(self) -> bool:
        """True when the scheduler may give more than the minimum: the key
        resource has several feasible amounts and both T1 and E(m) are known."""
        return (
            self.elastic is not None
            and self.t1_s is not None
            and self.elasticity is not None
            and self.cost[self.elastic].elastic
        )

    def duration(self, units: float) -> float | None:
        """Modelled execution time on ``units`` of the key resource."""
        if self.t1_s is None:
            return None
        if self.elasticity is None or units <= 1:
            return self.t1_s
        return self.t1_s / (self.elasticity.efficiency(units) * units)


@slot_init
@dataclass(frozen=True, slots=True)
class Lease:
    """What one dispatched action holds. Parts are the managers' own leases."""

    action_id: str
    units: int
    parts: tuple[Any, ...] = ()
    node: str | None = None
    cores: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    restore_s: float = 0.0
    #: on the node's light lane: ``cores`` are shared, not exclusive (``units`` is 0);
    #: backends run it at normal priority and exclusive-core actions at nice 10
    lane: bool = False


@slot_init
@dataclass(frozen=True, slots=True)
class BatchMember:
    """A queued action that rides along in another action's dispatch (a batch)."""

    action: Action
    submit_s: float


#: a service variant resident on a GPU node: (service, DoP, first GPU)
Variant = tuple[str, int, int]


@slot_init
@dataclass(frozen=True, slots=True)
class GpuPlan:
    """What the core decided for a GPU dispatch on its node, for the backend to carry out
    in order: evict ``evict`` (least recently used first), load the action's variant
    when ``restore`` (else it is resident already), then serve the request.

    ``resident`` is the node's resident set the core holds right after this decision and
    ``version`` numbers the node's residency changes (a later decision has a higher one):
    once every dispatch up to the highest version has been carried out, the worker must
    hold exactly that set (executor/backends/gpu/backend.py checks it)."""

    node: str
    variant: Variant
    evict: tuple[Variant, ...] = ()
    restore: bool = False
    resident: frozenset[Variant] = frozenset()
    version: int = 0

    def riding(self) -> GpuPlan:
        """The plan of an action riding on an already started lease: nothing to load."""
        return GpuPlan(self.node, self.variant, (), False, self.resident, self.version)


@slot_init
@dataclass(frozen=True, slots=True)
class Dispatch:
    """The scheduler's decision: start ``action`` now on ``lease``.

    ``batch`` (GPU services, continuous batching): further queued actions of the same
    service that the same lease serves, as one batch. A backend that can serve a batch
    (``Capabilities.batches``) reports one Outcome per action of :attr:`actions`; for
    any other backend the runtime runs them one after another on the lease. Either way
    every action gets its own Record, and the lease is released after the last one.
    """

    action: Action
    lease: Lease
    submit_s: float
    start_s: float
    #: scheduler's estimate of the execution time (None when unknown); of the whole
    #: batch when ``batch`` is not empty
    expected_s: float | None
    #: scheduling decision time attributed to this dispatch (seconds of CPU)
    decision_s: float = 0.0
    batch: tuple[BatchMember, ...] = ()
    #: GPU actions of the evict-on-execution manager: the residency plan (None otherwise)
    gpu: GpuPlan | None = None
    #: workers the command starts (``TANGRAM_WORKERS``, e.g. ``pytest -n``): a malleable
    #: elastic action's is the widest grant it may grow to (tangram/cpu/malleable.py), its
    #: cores change under it (:class:`tangram.protocol.Resized`); 0: its units
    workers: int = 0

    @property
    def worker_count(self) -> int:
        """Workers its command runs: ``workers``, else its units (at least 1)."""
        return self.workers or max(self.lease.units, 1)

    @property
    def units(self) -> int:
        return self.lease.units

    @property
    def actions(self) -> tuple[Action, ...]:
        """Every action this dispatch serves (the lead first)."""
        return (self.action, *(m.action for m in self.batch))


@dataclass(frozen=True, slots=True)
class Outcome:
    """How an action ended, as reported by a backend."""

    action_id: str
    status: str = "ok"  # ok | failed | timeout | oom | cancelled
    exit_code: int | None = 0
    output: str = ""
    error: str = ""
    #: overheads the backend paid before the command started (container update, restore)
    overhead_s: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in ("ok", "failed", "timeout", "oom", "cancelled"):
            raise ValueError(f"outcome.status: unknown status {self.status!r}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"


#: the quotas and durations of a Pending that has none: one shared, read-only mapping (a
#: burst queues thousands; nothing writes to a Pending's tables)
NONE: Mapping[Any, float] = MappingProxyType({})


class Pending:
    """A queued action with what the scheduler reads of it on every pass.

    Identity equality (one object per queued action). ``durations``, the modelled
    duration per feasible unit count of an elastic action, may be given as its
    declared profile instead (``profile``: E(m) and T1): the table is then computed on
    first read, from values that never change, so it is the same table, paid only for
    the actions a pass looks at (a burst queues thousands at once, up to 32 counts each).

    No ``__getattr__``: a class with one has every attribute read unspecialised by
    CPython 3.11 (~2.5x a plain slot read; a Pending is read ~20-35 times over its life),
    so the lazy table is a property over ``_durations`` (None until first read).

    Once it starts, the core sets ``STARTED`` on it (its dispatch, pool and batch) and
    keeps it as the running action: not a second object per dispatch (building one
    through a class call is ~2,400 machine instructions, and one more the cyclic GC
    tracks). They are unset while it is queued.
    """

    __slots__ = ("action", "submit_s", "key_min", "quotas", "elastic", "light", "choices",
                 "_durations", "_profile", "dispatch", "pool", "batch_left")
    #: the slots set when it starts (Tangram._running)
    STARTED = ("dispatch", "pool", "batch_left")

    action: Action
    submit_s: float
    key_min: int  # minimum units of the pool's key resource
    quotas: Mapping[str, float]
    elastic: bool  # schedulable elastic on this pool's key resource
    #: expected to be short enough for the pool's light lane (tangram/cpu/pool.py CpuNodePool)
    light: bool
    choices: tuple[int, ...]
    dispatch: Dispatch
    #: the pool it runs in (a tangram/pool.py PoolPoints: typed Any here, below it)
    pool: Any
    #: a batch (Dispatch.batch): ids of its actions still running, shared by all of them;
    #: the lease is released when the last one finishes (None: not a batch)
    batch_left: set[str] | None

    def __init__(self, action: Action, submit_s: float, key_min: int,
                 quotas: Mapping[str, float] = NONE, elastic: bool = False,
                 light: bool = False, choices: tuple[int, ...] = (),
                 durations: Mapping[int, float] = NONE,
                 profile: tuple[Elasticity, float] | None = None) -> None:
        self.action = action
        self.submit_s = submit_s
        self.key_min = key_min
        self.quotas = quotas
        self.elastic = elastic
        self.light = light
        self.choices = choices
        self._durations = durations if profile is None else None
        self._profile = profile

    @property
    def durations(self) -> Mapping[int, float]:
        """Modelled duration per feasible unit count (elastic actions only)."""
        table = self._durations
        if table is None:  # the lazy table, on its first read
            e, t1 = self._profile  # type: ignore[misc]
            table = self._durations = e.durations(t1, self.choices)
        return table

    def __repr__(self) -> str:
        return (f"Pending({self.action.id!r}, submit_s={self.submit_s}, "
                f"key_min={self.key_min}, elastic={self.elastic}, light={self.light})")
