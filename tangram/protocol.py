"""The one door into the core: commands in, effects out, a snapshot for readers.

Everything outside tangram/ (the runtime's drivers, the backends, the status page, the
service, the simulator's sampler, the replay) talks to the core through this module:

* **Commands** (frozen values) go in through :meth:`tangram.core.Tangram.handle`:
  :class:`Attach`, :class:`Open`, :class:`Submit`, :class:`Finish`, :class:`Cancel`,
  :class:`Close`, :class:`Poll`, :class:`NodeJoined`, :class:`NodeLost`,
  :class:`WorkerLost`, :class:`MemoryObserved`.
* **Effects** (frozen values) come out, in the order they must be carried out:
  :class:`~tangram.model.Dispatch` (start an action; a GPU dispatch carries its whole
  residency plan, :class:`~tangram.model.GpuPlan`: what to evict, whether to restore, and
  the batch riding on its lease), :class:`PreRestore` (load a variant ahead of demand),
  :class:`Resized` (a running elastic action's cores grew or shrank),
  :class:`Stop` (ask the backend to stop a running action), :class:`Cancelled` (a
  queued action was dropped; it has no outcome to wait for) and :class:`Reclaim` (an
  idle trajectory gave its node to a waiting one: a backend that ``evicts`` drops what
  holds memory for it).
* **Reads** go through :class:`Snapshot` (``Tangram.snapshot()``), a frozen copy of what
  the core holds, and point queries cheap enough for every request or start
  (``Tangram.trajectory``, ``is_running``, ``node_of``, ``busy_fraction``, ``validate``:
  would this action be refused; ``why_queued``: what a queued action waits for, when
  it waits for a node; ``next_wakeup``, ``lane_wakeup``: when to send :class:`Poll`,
  :class:`Overstay`). These and ``handle``/``snapshot`` are all of Tangram's public
  members.

What a backend can do is read off the methods it implements (:func:`capabilities_of`:
one runtime-checkable protocol per optional method) and the :class:`Traits` it declares;
the :class:`Backend` protocol lists the methods every driver calls.
tests/test_layering.py fails on code outside tangram/ that reaches past this door (an
attribute of the core's internals, a manager or pool import).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import BinaryIO, Protocol, runtime_checkable

from tangram.cluster import CpuNodeSpec, GpuNodeSpec
from tangram.model import Action, Dispatch, GpuPlan, Outcome, Variant


def _empty() -> Mapping:
    return MappingProxyType({})


# -- what a backend can do -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Traits:
    """What a backend does that no method of its own shows: declared, the only part of
    :class:`Capabilities` a backend states (the rest is read off its methods)."""

    #: serves a dispatch's batch (``Dispatch.batch``) as one batch, reporting one Outcome
    #: per action; otherwise the runtime runs the batch's actions one after another
    batches: bool = False
    #: runs GPU actions (a lease with GPUs) on real workers
    gpu: bool = False


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do, as the core and the drivers read it. Never declared by a
    backend: :func:`capabilities_of` reads it off the methods the backend implements
    (one runtime-checkable protocol per optional method below) and its :class:`Traits`,
    so no flag can claim a method that is not there (a wrapper that copied
    ``moves=True`` without ``move`` crashed ``tangram run``)."""

    #: :attr:`Traits.batches`
    batches: bool = False
    #: loads a GPU service variant ahead of demand (:class:`PreRestore`); the core plans
    #: pre-restores only for such a backend, since another would not hold what the core
    #: then believes resident (:class:`PreRestoring`)
    prerestores: bool = False
    #: reports what happens to its nodes: the driver calls ``watch(sink)`` and the
    #: backend sends :class:`NodeJoined`/:class:`NodeLost` (a multi-node backend, e.g.
    #: Ray) or :class:`WorkerLost` (a GPU node's worker died) (:class:`NodeWatching`)
    watches_nodes: bool = False
    #: runs a trajectory's sandbox from a docker image (:class:`ImageOpening`)
    images: bool = False
    #: :attr:`Traits.gpu`
    gpu: bool = False
    #: holds per-trajectory files, the files API (:class:`FileHolding`)
    files: bool = False
    #: frees the memory an idle trajectory holds when the core reclaims it
    #: (:class:`Reclaim`: ``evict``; docker removes its container). The core then
    #: reclaims idle trajectories also when the node is short of memory by observation,
    #: not only when their declared limits pass the cap: only an eviction frees memory
    #: (:class:`Evicting`)
    evicts: bool = False
    #: kills the sandbox using the most memory of a node short of memory by observation
    #: (:class:`Shed`: ``shed``; its actions end ``oom``) (:class:`Shedding`)
    sheds: bool = False
    #: carries out a fork action (kind ``fork``, tangram/fork.py): copies the source
    #: trajectory's sandbox into the trajectories its payload names (:class:`Forking`)
    forks: bool = False
    #: changes a running action's cores and priority when the core moves it off a
    #: light lane (:class:`Moved`: ``move``) (:class:`Moving`)
    moves: bool = False
    #: keeps across a restart only the sandboxes of the trajectories still open, removing
    #: what a crash left of the others (:class:`Retaining`)
    retains: bool = False
    #: changes a running elastic action's cores while it runs (:class:`Resized`:
    #: ``resize``); the core resizes grants only for such a backend, since
    #: another would go on running the action on the cores the core gave to others
    #: (:class:`Resizing`)
    resizes: bool = False
    #: pulls a container image to a node ahead of the trajectories placed there
    #: (:class:`PullImage`: ``pull``); the core orders pulls ahead only for such a backend
    #: (:class:`Pulling`). Left out of the repr, as :class:`Open`'s image is when empty:
    #: an ``Attach`` of a run without images reads as it did before images existed, so the
    #: effect hashes of scripts/effects_hash.py compare across it
    pulls: bool = field(default=False, repr=False)


NONE = Capabilities()


# -- commands (in) -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Attach:
    """A backend with these capabilities carries out the effects from now on."""

    capabilities: Capabilities


@dataclass(frozen=True, slots=True, repr=False)
class Open:
    """Register a trajectory; ``mem_gb`` is held on its node for its whole life (None:
    the memory demand of its first CPU action). ``image``: the container image its
    environment starts from ("" for the node's default, always present), of ``image_gb``
    GB (declared: what its node pulls when it holds none of it); a policy may place the
    trajectory by it (tangram/cpu/images.py) and order its pull ahead (:class:`PullImage`)."""

    trajectory: str
    task: str = "default"
    mem_gb: float | None = None
    image: str = ""
    image_gb: float = 0.0

    def __repr__(self) -> str:
        # without an image, as before images existed (scripts/effects_hash.py hashes commands)
        tail = f", image={self.image!r}, image_gb={self.image_gb!r}" if self.image else ""
        return (f"Open(trajectory={self.trajectory!r}, task={self.task!r}, "
                f"mem_gb={self.mem_gb!r}{tail})")


@dataclass(frozen=True, slots=True)
class Submit:
    """Queue actions, all or nothing, with one scheduling pass per pool touched."""

    actions: tuple[Action, ...]


@dataclass(frozen=True, slots=True)
class Finish:
    """A running action ended (its backend reported ``outcome``)."""

    action_id: str
    outcome: Outcome | None = None


@dataclass(frozen=True, slots=True)
class Cancel:
    """Drop a queued action (effect :class:`Cancelled`) or stop a running one
    (effect :class:`Stop`; its outcome arrives through :class:`Finish` as usual)."""

    action_id: str


@dataclass(frozen=True, slots=True)
class Close:
    """Release a trajectory (refused while it has actions in flight)."""

    trajectory: str


@dataclass(frozen=True, slots=True)
class Poll:
    """Time passed: window quotas regain room, a pool may want a pass."""


@dataclass(frozen=True, slots=True)
class Overstay:
    """Time passed: an action on a CPU node's light lane may have overstayed it (sent at
    ``Tangram.lane_wakeup``; a pass runs on those nodes only, so a lane action that ended
    in time costs nothing)."""


@dataclass(frozen=True, slots=True)
class NodeJoined:
    """A CPU node joined (its capacity becomes schedulable), or a GPU node of the
    cluster came back after it was lost (a :class:`GpuNodeSpec`: its GPUs are free
    again, nothing resident)."""

    spec: CpuNodeSpec | GpuNodeSpec


@dataclass(frozen=True, slots=True)
class NodeLost:
    """A CPU node left: its trajectories are re-bound elsewhere; its running actions
    are finished by the backend (failed), once each. A GPU node left: its GPUs leave the
    pool and the core forgets what was resident there, until it joins again."""

    node: str


@dataclass(frozen=True, slots=True)
class WorkerLost:
    """A GPU node's worker died and lost its device copies: the core forgets what it
    held resident there (its running actions are finished by the backend, failed)."""

    node: str


@dataclass(frozen=True, slots=True)
class MemoryObserved:
    """``node``'s free memory was observed (e.g. ``MemAvailable``): from now on the node
    admits trajectories by it, under the core's memory admission rule
    (:class:`tangram.cpu.admission.MemoryAdmission`, given at construction). While
    trajectories wait for a node, idle ones (nothing in flight for ``idle_after_s``)
    give their place, least recently used first (effects :class:`Reclaim`), and a
    scheduling pass follows (its :class:`~tangram.model.Dispatch` effects)."""

    node: str
    free_gb: float
    idle_after_s: float = 2.0


Command = (Attach | Open | Submit | Finish | Cancel | Close | Poll | Overstay | NodeJoined
           | NodeLost | WorkerLost | MemoryObserved)
#: where a backend sends the commands it originates (nodes joining or leaving, workers lost)
Sink = Callable[[Command], None]


# -- effects (out) -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PreRestore:
    """Load ``plan.variant`` onto its node ahead of demand, evicting ``plan.evict`` first.
    The load takes ``restore_s`` from ``at_s``; the chunk stays free meanwhile."""

    plan: GpuPlan
    at_s: float
    restore_s: float


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop the running action ``action_id`` (a cancel); its outcome comes as usual."""

    action_id: str


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The queued action ``action_id`` was dropped: it never started."""

    action_id: str


@dataclass(frozen=True, slots=True)
class Reclaim:
    """The idle trajectory ``trajectory`` was unbound from its node for a waiting one
    (its declared memory no longer counts there; its next action binds it again like a
    first action). A backend with ``Capabilities.evicts`` drops what holds memory for
    it (``evict``: docker removes the container, so its next action reports
    ``state_lost``); another keeps it (the process backend: its files stay on disk)."""

    trajectory: str


@dataclass(frozen=True, slots=True)
class Shed:
    """``node`` is short of memory by observation: ``free_gb`` free, under the ``keep_gb``
    its admission keeps free, and nothing reclaimed frees memory. A backend with
    ``Capabilities.sheds`` kills the sandbox that uses the most memory there (its actions
    end ``oom``), before the kernel's OOM killer picks by size alone."""

    node: str
    free_gb: float
    keep_gb: float


@dataclass(frozen=True, slots=True)
class Moved:
    """The running light-lane action ``action_id`` overstayed the lane's bound: it left
    the lane (its slot went to the next light action) and is accounted on its node's
    exclusive cores from now on. ``cores``: the core it now holds, to run on at the
    exclusive actions' priority; () while none is free: it runs on at the lowest priority
    (yielding to every exclusive action) until a later ``Moved`` gives it one. Carried out
    by a backend with ``Capabilities.moves``; the core's accounting holds either way."""

    action_id: str
    node: str
    cores: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Resized:
    """The running elastic action ``action_id`` holds ``cores`` of ``node`` from now on
    (a malleable grant grows onto cores that freed up, or shrinks to admit an
    arrival; tangram/cpu/malleable.py). Its worker count (``Dispatch.workers``) stays what
    it was started with: its processes are re-pinned onto the new cores. Sent only to a
    backend with ``Capabilities.resizes``."""

    action_id: str
    node: str
    cores: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PullImage:
    """Pull the container image ``image`` to CPU node ``node`` ahead of the trajectories
    the core placed there (what pre-restore is to a GPU service, one level
    down). Sent only to a backend with ``Capabilities.pulls``; a trajectory that starts
    there before it ends waits for what is left of it. ``trajectory``: the one it is
    pulled ahead for (its image is wanted on ``node`` until that trajectory starts,
    wherever it starts, or closes)."""

    node: str
    image: str
    trajectory: str = ""


Effect = (Dispatch | PreRestore | Stop | Cancelled | Reclaim | Shed | Moved | Resized
          | PullImage)


# -- the snapshot (reads) -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TrajectoryView:
    task: str
    #: the CPU node it is bound to (None: not yet)
    node: str | None
    in_flight: int
    #: its declared memory (None: its first CPU action's); a fork's copies declare it too
    mem_gb: float | None = None


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued action as a queue shows it."""

    action: Action
    submit_s: float
    units_min: int


@dataclass(frozen=True, slots=True)
class QueueView:
    #: the pool ("binding": trajectories waiting for a node; "<pool> light": a CPU
    #: node's light lane)
    pool: str
    #: the pool's key resource ("cpu", "gpu", "binding", "light lane", "api")
    resource: str
    waiting: tuple[Waiting, ...]


@dataclass(frozen=True, slots=True)
class CpuNodeView:
    name: str
    cores: int
    numa: int
    domain_size: int
    mem_gb: float
    mem_reserved_gb: float
    #: cores nobody holds
    free: frozenset[int]
    #: core -> the trajectory whose pod holds it between actions (pod policies)
    pods: Mapping[int, str]
    #: light actions its lane runs at a time (0: no lane)
    lane_slots: int


@dataclass(frozen=True, slots=True)
class GpuNodeView:
    name: str
    gpus: int
    gpu_mem_gb: float
    #: free aligned chunks (start, size)
    free: tuple[tuple[int, int], ...]
    #: resident variants, least recently used first
    resident: tuple[Variant, ...]
    #: GB of resident weights per GPU, as the core accounts them
    mem_used: tuple[float, ...]
    #: the node left (NodeLost) and has not joined again: its GPUs are in no free chunk
    down: bool = False


@dataclass(frozen=True, slots=True)
class QuotaView:
    key: str
    mode: str
    limit: float
    window_s: float | None
    used: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A frozen copy of what the core holds (``Tangram.snapshot``). The counts, usage,
    capacity and counters are always filled; the per-node, per-queue and per-action
    views only with ``detail`` (the simulator's sampler reads the cheap part)."""

    policy: str
    queued: int
    running_count: int
    open_trajectories: int
    #: environments and first actions waiting for a node (binding, open order)
    unbound: int
    usage: Mapping[str, float]
    capacity: Mapping[str, float]
    #: deterministic counts: gpu_restores, gpu_restore_hits, gpu_restore_s_total,
    #: scheduler_passes, trajectories_reclaimed, lane_moves
    counters: Mapping[str, float]
    #: first actions waiting for a node to admit their trajectory (the binding queue:
    #: memory, or cores for the first action; also counted in ``queued``)
    waiting_for_node: int = 0
    detail: bool = False
    trajectories: Mapping[str, TrajectoryView] = field(default_factory=_empty)
    #: running action id -> its dispatch (the members of a batch share the lead's)
    running: Mapping[str, Dispatch] = field(default_factory=_empty)
    queues: tuple[QueueView, ...] = ()
    cpu_nodes: tuple[CpuNodeView, ...] = ()
    gpu_nodes: tuple[GpuNodeView, ...] = ()
    quotas: tuple[QuotaView, ...] = ()
    #: service -> GB of its weights
    service_gb: Mapping[str, float] = field(default_factory=_empty)


# -- what a driver calls on a backend -----------------------------------------------------
class Backend(Protocol):
    """Runs dispatched actions and reports exactly one Outcome per action.

    Every driver calls ``start`` and ``cancel``; the rest only on a backend that
    implements them (the protocols below, read with ``isinstance`` by
    :func:`capabilities_of`). A live backend (executor/driver.py ``LiveBackend``) adds
    the trajectory's environment (``open_trajectory``, ``close_trajectory``) and
    ``shutdown``.
    """

    traits: Traits

    def start(self, dispatch: Dispatch, on_done: Callable[[Outcome], None]) -> None: ...

    def cancel(self, action_id: str) -> None: ...


@runtime_checkable
class PreRestoring(Protocol):
    """Loads a GPU variant ahead of demand (:class:`PreRestore`)."""

    def prerestore(self, effect: PreRestore) -> None: ...


@runtime_checkable
class Evicting(Protocol):
    """Frees what holds memory for an idle trajectory the core reclaimed
    (:class:`Reclaim`); False when it is busy after all (then its memory shows in the next
    observation)."""

    def evict(self, trajectory: str) -> bool: ...


@runtime_checkable
class Shedding(Protocol):
    """Kills what the sandbox using the most memory on ``effect.node`` runs
    (:class:`Shed`); the trajectory shed, or None."""

    def shed(self, effect: Shed) -> str | None: ...


@runtime_checkable
class Moving(Protocol):
    """Runs the light-lane action the core moved off the lane (:class:`Moved`) on its new
    cores and priority."""

    def move(self, effect: Moved) -> None: ...


@runtime_checkable
class Resizing(Protocol):
    """Runs a running elastic action on the cores the core resized its grant to
    (:class:`Resized`) from now on: every process of it re-pinned, its cgroup's cpuset
    and quota (where it has one) changed while it runs."""

    def resize(self, effect: Resized) -> None: ...


@runtime_checkable
class Pulling(Protocol):
    """Pulls a container image to a CPU node ahead of demand (:class:`PullImage`); a pull
    that fails is the start's to report (its trajectory's first action pulls again)."""

    def pull(self, effect: PullImage) -> None: ...


@runtime_checkable
class NodeWatching(Protocol):
    """Sends NodeJoined, NodeLost or WorkerLost to ``sink`` (on the driver's loop) from
    now on."""

    def watch(self, sink: Sink) -> None: ...


@runtime_checkable
class Forking(Protocol):
    """Carries out a fork dispatch (kind ``fork``, tangram/fork.py): copies the source's
    sandbox into the copies its payload names, one Outcome for the whole fork."""

    def fork(self, dispatch: Dispatch, on_done: Callable[[Outcome], None]) -> None: ...


@runtime_checkable
class Retaining(Protocol):
    """Told, at a start, which trajectories the journal says are open (before they are
    opened again): what a previous run left of any other (a kill -9 mid-open, mid-fork or
    mid-close) is removed, so no later trajectory sees it. How many were removed."""

    def retain(self, trajectories: Collection[str]) -> int: ...


@runtime_checkable
class ImageOpening(Protocol):
    """Opens a trajectory's sandbox from a docker image."""

    def open_trajectory_image(self, trajectory: str, mem_gb: float | None,
                              image: str) -> float | None:
        """Open it in a sandbox of ``image``; the image's size in GB (None: not known)."""
        ...


@runtime_checkable
class FileHolding(Protocol):
    """Holds per-trajectory files (the files API)."""

    def put_file(self, trajectory: str, parts: tuple[str, ...],
                 data: bytes | BinaryIO) -> int: ...

    def get_file(self, trajectory: str, parts: tuple[str, ...], limit: int) -> bytes: ...


#: each method-backed capability and the protocol whose methods it means
METHOD_CAPABILITIES: Mapping[str, type] = MappingProxyType({
    "prerestores": PreRestoring, "watches_nodes": NodeWatching, "images": ImageOpening,
    "files": FileHolding, "evicts": Evicting, "sheds": Shedding, "forks": Forking,
    "moves": Moving, "retains": Retaining, "resizes": Resizing, "pulls": Pulling,
})


@runtime_checkable
class _Declaring(Protocol):
    """A backend that declares :class:`Traits` (most declare none)."""

    traits: Traits


def traits_of(backend: object) -> Traits:
    """The :class:`Traits` ``backend`` declares (none: ``Traits()``)."""
    return backend.traits if isinstance(backend, _Declaring) else Traits()


def capabilities_of(backend: object) -> Capabilities:
    """What ``backend`` can do: its methods (``isinstance`` of each protocol of
    :data:`METHOD_CAPABILITIES`) and its declared :class:`Traits` (none if it declares
    none)."""
    traits = traits_of(backend)
    return Capabilities(batches=traits.batches, gpu=traits.gpu, **{
        name: isinstance(backend, proto) for name, proto in METHOD_CAPABILITIES.items()})
