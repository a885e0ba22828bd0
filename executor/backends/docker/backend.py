"""Docker backend: allocate-on-execution (paper section 5.2).

A container per trajectory, created at its first action with the trajectory's
memory limit, keeps its files between actions. Before each exec the
container's cgroup is updated to exactly the granted cores (``cpuset``) and a
matching CPU quota; after the exec the quota is reclaimed (1% of a core) so an
idle container holds nothing. The container is removed when the trajectory
closes, after an idle TTL if it is abandoned, and on shutdown; every container
carries this executor's label so none can leak past a crash of one action.
A warm pool (``warm``) keeps containers created ahead of use, so a trajectory's
first action does not wait for a container to start: of the default image, and of
each image the latest burst of openings asked for, as many as it asked.

Images. No image can be pulled on an offline machine, so the default sandbox
image is built locally: ``tangram image build`` imports an empty root
filesystem (labelled ``tangram.rootfs=host``) and the host's system
directories are bind-mounted read-only over it at run time. Any other image a
trajectory names is run unmodified: the host's ``/usr`` is bind-mounted
read-only at ``/tangram-host/usr`` and the agent runs on the host's python
through the host's dynamic loader, so the image needs no python of its own
and its own ``/usr``, ``/bin`` and environment stay what the commands see.

Lock-down (every sandbox): all capabilities dropped but the four the agent
needs, no-new-privileges, a memory limit (the trajectory's ``mem_gb``, else
``default_mem_gb``) without swap, a process limit, no network, and commands
run as an unprivileged user that cannot signal the agent or reach its socket.
The host enforces every timeout itself: an agent that does not answer in time
gets its container killed (the action ends ``timeout``, the trajectory's next
action gets a fresh container and ``state_lost``). An OOM kill is reported as
status ``oom``.

Cancel and timeout end the action, not the sandbox: the command's process group is
killed by the agent and every other process of the action (``setsid`` children,
daemons: they carry its mark) by the host, inside the running container
(executor/backends/docker/tree.py); its files and the other actions stay, and the
outcome - which frees the cores - comes once they are gone. Only where that cannot be
done (the container's processes cannot be listed, or outlive SIGKILL) is the container
killed; then the trajectory's next action, and only that one, says ``state_lost``.

Memory of the machine (``Capabilities.sheds``): each container is bounded by its own
limit, but their limits together may exceed the machine (admission overcommits by
observed use, tangram/cpu/admission.py). When the core finds the machine short (its
``Shed``), the container whose cgroup holds the most loses its commands (killed as the
sandbox user, inside it; its files stay) and its running actions end ``oom``. A server
whose machine is a memory-limited cgroup (a container with ``--memory``) starts its
sandboxes inside that cgroup (``cgroup_parent``, executor/node/cgroups.py), where the
limit it observes bounds them too; with the engine's cgroupfs driver on cgroup v1 only
(systemd's driver names slices, not paths; elsewhere they stay where the engine puts
them, and a warning says so).

Disk (``disk_gb``): the engine's ``--storage-opt size`` works only on overlay2 over
xfs with project quotas (and devicemapper, btrfs, zfs); elsewhere (fuse-overlayfs,
overlay2 on ext4) it is refused. There, the places the sandbox user can write -
``/work``, ``/tmp``, ``/var/tmp`` - are tmpfs mounts: what a command writes never
reaches the host's disk. Being memory, they count against the sandbox's ``mem_gb``
too, so they are bounded below it (``/work``: ``disk_gb`` and at most half of
``mem_gb``; ``/tmp``: a quarter; ``/var/tmp``: 64 MiB), and an image's own files under
``/work`` are hidden by the mount. An action that leaves ``/work`` full ends
``failed`` with an error starting ``disk_full:``.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import shutil
import socket
import tarfile
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import docker
import docker.errors
from docker.models.containers import _create_container_args
from docker.types import DriverConfig, Mount

from executor.backends.docker.cache import PULLS, ImageCache
from executor.backends.docker.fork import fork_containers
from executor.backends.docker.limits import SANDBOX_WORKDIR, SandboxLimits
from executor.backends.docker.pulls import PullDone
from executor.backends.docker.tree import ACTION_MARK, cgroup_pids, end_action
from executor.backends.process.backend import outcome_of
from executor.commands import EXCLUSIVE_NICE, CommandError, argv_of, elastic_argv
from executor.files import MAX_FILE_BYTES, FileError
from executor.node import cgroups
from executor.node.local import allowed_cpus
from executor.node.memwatch import largest_sandbox
from tangram.fork import FORK
from tangram.model import Dispatch, Outcome
from tangram.protocol import PullImage, Resized, Shed

log = logging.getLogger("tangram.docker")
IMAGE = "tangram-sandbox:1"
#: the agent and, mounted with it, the executor folder: the agent imports executor/files.py
AGENT = Path(__file__).with_name("agent.py")
AGENT_ROOT = AGENT.parents[2]
LABEL = "tangram.executor"
OWNER = "tangram.owner"
HOST_ROOTFS = "tangram.rootfs"  # image label: "host" = run on the host's bind-mounted /usr
HOST_MOUNTS = ("/usr", "/lib", "/lib64", "/bin", "/etc/alternatives")
#: where the host's /usr (the agent's python) appears inside any other image
HOST_PREFIX = "/tangram-host"
#: what the agent needs: chown /work, switch to the sandbox user, kill runaway commands
AGENT_CAPS = ["CHOWN", "SETUID", "SETGID", "KILL"]
SANDBOX_USER = "65534:65534"
#: seconds the host waits beyond an action's timeout before it stops trusting the agent
GRACE_S = 5.0
#: the timeout of an action that gives none (the API always gives one)
DEFAULT_TIMEOUT_S = 24 * 3600.0
PERIOD_US = 100_000
IDLE_QUOTA_US = 1_000  # 1% of one core while no action runs
#: containers made at once for opening trajectories (each start costs the engine tens of ms
#: of CPU; more at once only queue in dockerd)
CREATORS = 4
#: warm sandboxes made at once by the refill. Measured on a 2-core machine beside
#: `stress --cpu 2` (16 DockerBackend._create each): 1.9 a second one at a time, 3.2 two at
#: a time, 3.6 four, 3.2 eight, 2.7 sixteen (the engine's start, runc and fuse-overlayfs
#: share the cores; more at once only queue)
WARM_CREATORS = 4
#: while a file operation runs in an idle container: its agent serves the copy at a
#: core's pace (at the idle 1% a put or get took 2.4-3.5 s against 0.05 s on the process
#: backend); a file operation is short and mostly I/O
FILE_QUOTA_US = PERIOD_US
#: the warm pool refills once no sandbox was taken for this long (DockerBackend._refill)
WARM_QUIET_S = 0.5
#: the refill also waits while a trajectory of the latest burst has not started its first
#: action, for at most this long after the burst (one that never acts must not stop it):
#: started with the burst, its creations share the cores with the burst's first actions
#: (verl_stall beside `stress --cpu 2`, a pool of 64 made before step 1, single runs at
#: load 5-11: step 2's first-call p99 2.8 s refilled one at a time, 5.7 s four at a time
#: from the burst on, 4.3 s four at a time after this wait)
WARM_FIRST_S = 10.0
#: the most sandboxes the warm pool keeps when sized from demand (an idle one holds a few
#: MB; its memory limit is not reserved)
WARM_MAX = 64
#: `docker exec` path: where a command's output is written (one file per action)
EXEC_OUTPUT = "/tmp/.tangram-output"
#: the most of a command's output an outcome keeps (its end)
OUTPUT_CAP = 1 << 20
#: each sandbox's disk (see the module's docstring: storage-opt, else tmpfs mounts)
DEFAULT_DISK_GB = SandboxLimits.disk_gb
#: /work with less free than this after an action: the action ends ``disk_full``
DISK_FULL_BYTES = 1 << 20
#: Go's os.FileMode bits in the engine's archive stat (directory; device, pipe, socket, ...)
GO_MODE_DIR = 1 << 31
GO_MODE_IRREGULAR = (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
#: the largest answer taken from an agent (output is capped at 1 MiB, + JSON escapes)
MAX_ANSWER = 16 << 20


class AgentGone(OSError):
    """The agent could not be reached before the request was sent (safe to retry)."""


class AgentSilent(OSError):
    """The agent did not answer within the action's timeout plus GRACE_S."""


def build_image(client: docker.DockerClient | None = None, tag: str = IMAGE,
                files: Mapping[str, bytes] | None = None,
                env: Mapping[str, str] | None = None) -> str:
    """Import a minimal root filesystem (directories only) as ``tag``; no registry.
    ``files`` (path -> bytes, e.g. python packages: executor/backends/docker/image.py) are added
    to it and ``env`` set in the image (commands see it; the run's own env wins)."""
    client = client or docker.from_env()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dirs = {"tmp": 0o1777, "work": 0o777, "proc": 0o555, "sys": 0o555, "dev": 0o755,
                "etc": 0o755, "root": 0o700}
        for path in files or {}:  # every parent directory, readable by the sandbox user
            parts = path.strip("/").split("/")[:-1]
            for i in range(1, len(parts) + 1):
                dirs.setdefault("/".join(parts[:i]), 0o755)
        for name, mode in dirs.items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            info.mode = mode
            tar.addfile(info)
        contents = {"etc/passwd": (b"root:x:0:0:root:/root:/bin/sh\n"
                                   b"nobody:x:65534:65534:nobody:/tmp:/bin/sh\n"),
                    "etc/group": b"root:x:0:\nnogroup:x:65534:\n"}
        contents.update({path.strip("/"): data for path, data in (files or {}).items()})
        for name, data in contents.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    repo, _, version = tag.rpartition(":") if ":" in tag.split("/")[-1] else (tag, "", "latest")
    changes = ["WORKDIR /work", f"LABEL {HOST_ROOTFS}=host"]
    changes += [f"ENV {k}={v}" for k, v in (env or {}).items()]
    client.api.import_image_from_data(buf.getvalue(), repository=repo, tag=version,
                                      changes=changes)
    return tag


def ensure_image(client: docker.DockerClient, tag: str = IMAGE) -> str:
    """``tag`` if it is on this machine; the default image is built when missing."""
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        if tag != IMAGE:
            raise ValueError(f"image: {tag!r} is not on this machine (no registry is used: "
                             "build it or `docker load` it first)") from None
        build_image(client, tag)
    except docker.errors.APIError as e:  # e.g. a malformed reference
        raise ValueError(f"image: {tag!r}: {e.explanation or e}") from None
    return tag


def host_python() -> tuple[str, str, str] | None:
    """(loader, library path, python) of the host's python3 as seen under HOST_PREFIX,
    or None where they do not all live under /usr (then only the default image has
    an agent)."""
    python = os.path.realpath("/usr/bin/python3")
    loader = os.path.realpath("/lib64/ld-linux-x86-64.so.2")
    if not (os.path.exists(python) and os.path.exists(loader)
            and python.startswith("/usr/") and loader.startswith("/usr/")):
        return None
    libs = ":".join(HOST_PREFIX + d for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
                    if os.path.isdir(d))
    return HOST_PREFIX + loader, libs, HOST_PREFIX + python


@dataclass(slots=True)
class Sandbox:
    container_id: str
    last_used: float
    image: str = IMAGE
    mem_gb: float = 0.0
    #: host path of the in-container agent's socket (None: fall back to docker exec)
    socket: str | None = None
    #: host directory of that socket (removed with the container)
    agent_dir: str | None = None
    #: cgroup files written directly when writable (None: the engine's update API)
    cpuset_file: str | None = None
    quota_file: str | None = None
    #: its memory cgroup's directory, where readable (None: its use is unknown)
    memory_dir: str | None = None
    busy: bool = False
    #: file operations in progress (the idle quota is lifted to FILE_QUOTA_US meanwhile)
    files: int = 0
    #: grants so far; a reclaim only applies if no newer grant happened
    grants: int = 0
    #: serialises cgroup updates: a late reclaim must not undo the next action's grant
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: bytes free on /work after the last action (the agent's statvfs; None: unknown)
    work_free: int | None = None
    #: `docker exec` path: output files of finished actions, removed by the next exec
    spent_outputs: list[str] = field(default_factory=list)


class DockerBackend:
    name = "docker"

    def __init__(self, image: str = IMAGE, cpu_map: list[int] | None = None,
                 idle_ttl_s: float = 600.0, workers: int = 16,
                 client: docker.DockerClient | None = None, owner: str | None = None,
                 agent: bool = True, default_mem_gb: float = SandboxLimits.mem_gb,
                 pids_limit: int = SandboxLimits.pids, warm: int = 0,
                 disk_gb: float = DEFAULT_DISK_GB, removed_file: Path | None = None,
                 image_pulls: int = PULLS, image_cache_gb: float | None = None) -> None:
        self.client = client or docker.from_env()
        self.image = ensure_image(self.client, image)
        #: the images trajectories name: pulled when missing, kept under a disk budget
        #: (executor/backends/docker/cache.py); what the cache pulled is recorded beside
        #: the removed file, so a restart on the same state directory still evicts it
        self.images = ImageCache(
            self.client, image_pulls, image_cache_gb, held=self._held_images,
            keep={self.image}, release=self._release_warm, leaving=self._runs_image,
            state_file=removed_file.with_name(".docker-images.json") if removed_file else None)
        self.cpu_map = cpu_map or allowed_cpus()
        self.idle_ttl_s = idle_ttl_s
        self.default_mem_gb = default_mem_gb
        self.pids_limit = pids_limit
        self.disk_gb = disk_gb
        self._storage_opt = _quota_capable(self.client)
        self.cgroup_parent = _cgroup_parent(self.client)
        self.warm_size = warm
        self.run_id = uuid.uuid4().hex[:12]
        # the agent runs on the host's python3: at /usr in the default image, under
        # HOST_PREFIX in any other
        self.agent = agent and os.path.exists("/usr/bin/python3")
        self.host_python = host_python() if self.agent else None
        #: who this executor is across restarts (e.g. its state directory): what a crashed
        #: predecessor left behind is adopted (a running trajectory's container, its agent
        #: directory) or removed at start
        self.owner = owner or self.run_id
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tangram-docker")
        # removals apart from the actions' threads, so shutdown can wait for them (a removal
        # racing shutdown's own would leave a container "removal in progress")
        self._removers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tangram-rm")
        # containers made for trajectories as they open, apart from the actions' threads:
        # a creation never holds an action's worker (nor, so, its cores)
        self._creators = ThreadPoolExecutor(max_workers=CREATORS,
                                            thread_name_prefix="tangram-create")
        #: trajectory -> its container being made (open_trajectory)
        self._creating: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._boxes: dict[str, Sandbox] = {}
        self._mem: dict[str, float] = {}
        self._images: dict[str, str] = {}  # trajectory -> its image, when not the default
        #: trajectory -> the image it waits for before it opens (want_image)
        self._opening: dict[str, str] = {}
        #: trajectory -> the pull its opening waits for (want_image's future)
        self._waits: dict[str, Future[PullDone]] = {}
        #: trajectory -> (GB its node stored, seconds) of the pull its open waited for,
        #: told the core on its first outcome (``pulled_gb``/``pull_s``: the observed pull
        #: rate the core places by, as the simulator tells it; tangram/cpu/nodes.py ended)
        self._pulled: dict[str, tuple[float, float]] = {}
        self._host_rootfs: dict[str, bool] = {}
        #: the cgroup files' paths with "{id}" for a container's id (see _cgroup_files)
        self._cgroup_template: tuple[str, str] | None = None
        self._lost: set[str] = set()  # trajectories whose container died: report at next action
        self._running: dict[str, str] = {}  # action id -> container id
        #: running action -> its sandbox and the mark its processes carry (a cancel's target)
        self._actions: dict[str, tuple[Sandbox, str]] = {}
        #: running actions a cancel reached: their processes are ended before the outcome
        self._cancelled: set[str] = set()
        #: running actions whose grant was resized (tangram/cpu/malleable.py): the cores
        #: it has now, kept until the action ends (a resize that came before it held its
        #: sandbox is applied then, ``_held``; a sandbox replaced mid-start gets them too),
        #: under ``_resize_lock``
        self._resized: dict[str, list[int]] = {}
        self._resize_lock = threading.Lock()
        self._cancelling: set[str] = set()  # a cancel's kill pass in progress
        #: cancels' kills, apart from the actions' threads (all busy with long commands,
        #: they would wait behind them)
        self._killers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tangram-kill")
        #: fork actions running -> set to stop them between their steps (a cancel)
        self._fork_stops: dict[str, threading.Event] = {}
        #: trajectory -> (when, why) its commands were killed for the machine's memory
        self._shed: dict[str, tuple[float, str]] = {}
        self._tasks: set[asyncio.Task] = set()  # actions running on the event loop
        self._warm: list[Sandbox] = []
        #: the refill's threads (WARM_CREATORS at most) and the sandboxes they are making
        #: (memory limit -> how many); ``_warmed`` is notified as each is done
        self._refillers: set[threading.Thread] = set()
        self._warming: Counter[tuple[str, float]] = Counter()  # (image, memory limit)
        self._warmed = threading.Condition(self._lock)
        self._last_take = float("-inf")  # monotonic time a trajectory last needed a sandbox
        #: trajectories that needed a sandbox in the current burst (needs less than
        #: WARM_QUIET_S apart), and the most in one burst so far: the warm pool's size
        self._burst = 0
        self._burst_peak = 0
        #: the memory limits (GB) the current burst's trajectories asked for: the pool's
        #: sandboxes get the most common one (_warm_mem)
        self._burst_mem: Counter[float] = Counter()
        #: the images the current burst's trajectories asked for (the pool keeps as many
        #: sandboxes of each other image as the latest burst had trajectories of it)
        self._burst_images: Counter[str] = Counter()
        #: the most default-image trajectories one burst had so far (its pool's size)
        self._default_peak = 0
        #: trajectory -> (image, memory limit) of one the core expects to open here, not
        #: opened yet: it waits in the core's queue for this node's memory, and its image
        #: was pulled ahead here (``expect_image``: a node agent's, executor/backends/ray).
        #: A floor of its image's warm target: its first action here takes a warm sandbox
        #: instead of making its container on its core. Until it opens here or is told
        #: closed (it went elsewhere, or closed)
        self._expected: dict[str, tuple[str, float]] = {}
        #: the current burst's trajectories whose first action has not started
        self._unstarted: set[str] = set()
        self._closed = False
        self._leftovers, self._lost_at_start, keep = self._adoptable()
        prefix = f"tangram-agents-{self.owner}-"
        #: where a stop records the trajectories whose containers it removed (a restart
        #: restores them: their next action must say state_lost, not run silently in a
        #: fresh container); None: not recorded (an owner that does not outlive the run)
        self.removed_file = removed_file
        if removed_file is not None:
            try:
                self._lost_at_start |= set(json.loads(removed_file.read_text())) - set(
                    self._leftovers)
                removed_file.unlink()
            except (OSError, ValueError, TypeError):
                pass
        for old in Path(tempfile.gettempdir()).glob(prefix + "*"):
            for box_dir in old.iterdir() if old.is_dir() else ():
                if str(box_dir) not in keep:
                    shutil.rmtree(box_dir, ignore_errors=True)
            if not keep or not any(k.startswith(str(old) + os.sep) for k in keep):
                shutil.rmtree(old, ignore_errors=True)
        self.agent_root = tempfile.mkdtemp(prefix=prefix)
        self._reaper = threading.Thread(target=self._reap_loop, daemon=True)
        self._reaper.start()
        self._refill_soon()

    def retain(self, trajectories: Collection[str]) -> int:
        """At a start, before the journal's open ``trajectories`` are opened again
        (executor/server/service.py): a predecessor's container of any other trajectory
        is removed now, not adopted by a later open of the same id (a kill -9
        mid-fork left copies the journal never heard of; a fork again under their ids got
        their stale files). How many were removed."""
        keep = set(trajectories)
        with self._lock:
            gone = [self._leftovers.pop(t) for t in list(self._leftovers) if t not in keep]
            self._lost_at_start &= keep
        for box in gone:
            self._discard(box)
        return len(gone)

    def _adoptable(self) -> tuple[dict[str, Sandbox], set[str], set[str]]:
        """What a predecessor of the same owner left (a kill -9 leaves its containers
        running): a running trajectory's container with its agent, to be adopted when
        the restored trajectory is opened again (executor/server/service.py); the
        trajectories whose container is not running any more (their next action says
        ``state_lost``); the agent directories to keep. Everything else is removed now
        (warm sandboxes, dead containers)."""
        adopt: dict[str, Sandbox] = {}
        lost: set[str] = set()
        keep: set[str] = set()
        # sparse: no per-container inspect, which races with containers going away
        for c in self.client.containers.list(all=True, sparse=True,
                                             filters={"label": f"{OWNER}={self.owner}"}):
            try:
                info = self.client.api.inspect_container(c.id)
            except docker.errors.APIError:
                continue  # gone meanwhile
            agent_dir = next((m["Source"] for m in info.get("Mounts", [])
                              if m.get("Destination") == "/tangram"), None)
            # a warm sandbox taken by a trajectory has no label naming it: its mark does
            tid = (info["Config"].get("Labels") or {}).get("tangram.trajectory", "") \
                or _marked(agent_dir)
            sock = os.path.join(agent_dir, "agent.sock") if agent_dir else None
            if tid and info["State"].get("Running") and sock and os.path.exists(sock) \
                    and tid not in adopt:
                mem = (info["HostConfig"].get("Memory") or 0) / 2**30
                box = Sandbox(c.id, time.monotonic(), image=info["Config"]["Image"],
                              mem_gb=mem, agent_dir=agent_dir, socket=sock)
                box.cpuset_file, box.quota_file = self._cgroup_files(c.id)
                box.memory_dir = _memory_dir(box.cpuset_file)
                adopt[tid] = box
                keep.add(agent_dir)  # type: ignore[arg-type]
                continue
            if tid:
                lost.add(tid)
            self._remove(c.id)
        return adopt, lost - set(adopt), keep

    # -- Backend protocol ----------------------------------------------------------------
    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            self._unstarted.discard(d.action.trajectory)  # (the refill waits for none)
        if d.action.kind == FORK:  # a copy of the sandbox (executor/backends/docker/fork.py)
            self.fork(d, on_done)
            return
        ready = self._ready(d.action.trajectory)
        if ready is None:  # a container to create or resize, or no agent: engine calls
            self._in_thread(d, on_done, loop)
            return
        # on the event loop: no hop to a worker thread and back, which under a burst of
        # first actions waited for the GIL and the cores behind the HTTP requests
        task = loop.create_task(self._run_on_loop(d, *ready, on_done))
        self._tasks.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._tasks.discard)

    def _in_thread(self, d: Dispatch, on_done: Callable[[Outcome], None],
                   loop: asyncio.AbstractEventLoop) -> None:
        def work() -> None:
            box, grant = None, 0
            try:
                outcome, box = self._run(d)
                grant = box.grants if box is not None else 0
            except Exception as e:  # never leave an action unanswered
                outcome = Outcome(d.action.id, "failed", None,
                                  error=f"docker: {type(e).__name__}: {e}")
            loop.call_soon_threadsafe(on_done, outcome)
            if box is not None:  # after the answer: reclaiming is off the critical path
                self._reclaim(box, grant)

        self._pool.submit(work)

    def fork(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        """Forking (tangram.protocol): copy the source's container into the copies, on a
        worker thread."""
        stop = self._fork_stops[d.action.id] = threading.Event()
        self._pool.submit(self._fork, d, on_done, asyncio.get_running_loop(), stop)

    def _fork(self, d: Dispatch, on_done: Callable[[Outcome], None],
              loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        try:
            outcome = fork_containers(self, d, stop)
        except Exception as e:  # never leave an action unanswered
            outcome = Outcome(d.action.id, "failed", None, error=f"docker fork: "
                              f"{type(e).__name__}: {e}")
        finally:
            self._fork_stops.pop(d.action.id, None)
        loop.call_soon_threadsafe(on_done, outcome)

    def cancel(self, action_id: str) -> None:
        """Stop a running action inside its container (its files and the other actions
        stay): its outcome comes once its processes are gone (_end_tree). Asked again while
        it ends (the service repeats a cancel), another kill pass unless one runs. A fork
        stops before its next step (the step under way, packing or one copy's unpacking,
        runs to its end first)."""
        stop = self._fork_stops.get(action_id)
        if stop is not None:
            stop.set()
            return
        running = self._actions.get(action_id)
        if running is None or action_id in self._cancelling:
            return
        self._cancelled.add(action_id)
        self._cancelling.add(action_id)
        box, mark = running
        try:
            self._killers.submit(self._cancel_now, action_id, box, mark)
        except RuntimeError:  # shutting down: its container goes anyway
            self._cancelling.discard(action_id)

    def _cancel_now(self, action_id: str, box: Sandbox, mark: str) -> None:
        """One kill pass: the command's group by its agent, the rest of its processes by
        their mark from here. Where the container's processes cannot be listed, the old
        way: its container is killed (the action then ends, and its next action says
        ``state_lost``)."""
        try:
            if box.socket:
                self._agent_cancel(box, mark)
            if not end_action(lambda: self._container_pids(box), mark, wait_s=0.0) \
                    and self._container_pids(box) is None:
                self._kill(box)
        finally:
            self._cancelling.discard(action_id)

    def _agent_cancel(self, box: Sandbox, mark: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            try:
                conn.connect(box.socket)  # type: ignore[arg-type]
                conn.sendall(json.dumps({"op": "cancel", "mark": mark}).encode() + b"\n")
                conn.recv(1 << 10)
            except OSError:
                pass  # gone or stuck: the host's kill by mark still runs

    def _container_pids(self, box: Sandbox) -> list[int] | None:
        """The host pids of the container's processes: its cgroup's, else the engine's
        ``top`` (None: neither could tell)."""
        if box.cpuset_file:
            pids = cgroup_pids(os.path.dirname(box.cpuset_file))
            if pids is not None:
                return pids
        try:
            top = self.client.api.top(box.container_id)
            col = top["Titles"].index("PID")
            return [int(row[col]) for row in top.get("Processes") or ()]
        except (docker.errors.APIError, KeyError, ValueError, TypeError):
            return None

    def _end_tree(self, d: Dispatch, box: Sandbox, mark: str, outcome: Outcome) -> Outcome:
        """After a cancelled or timed-out action's command ended: kill what is left of it
        (its ``setsid`` children, its daemons) and wait until it is gone, so its cores are
        freed only then. Where that cannot be done, the container is killed: the outcome
        says so and the trajectory's next action says ``state_lost``."""
        if end_action(lambda: self._container_pids(box), mark):
            return outcome
        self._kill(box)
        self._forget(d.action.trajectory, box)
        return replace(outcome, error=(outcome.error + "; " if outcome.error else "") + (
            "its processes could not be ended inside the sandbox: its container was killed "
            "and is recreated, without its files, at the trajectory's next action"))

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None:
        """Remember the memory limit its container gets at its first action. A trajectory
        a predecessor left open (restored after a restart) gets its container back if it
        still runs; if it died, the next action says ``state_lost``."""
        with self._lock:
            self._mem[trajectory] = mem_gb or 0.0
            self._expected.pop(trajectory, None)  # (here now: counted in its burst)
            box = self._leftovers.pop(trajectory, None)
            if box is not None:
                self._boxes[trajectory] = box
            elif trajectory in self._lost_at_start:
                self._lost_at_start.discard(trajectory)
                self._lost.add(trajectory)
            warm = None
            if (box is None and trajectory not in self._boxes and trajectory not in self._lost
                    and trajectory not in self._creating and not self._closed):
                # a warm sandbox of its limit now, else its container made now, while the
                # first action is on its way and waits for admission and a core: not by that
                # action, holding its core (a lost trajectory's next action makes its own,
                # to say state_lost)
                self._needed(trajectory, self._mem[trajectory])
                warm = self._take_ready_warm(trajectory)
                if warm is None:
                    self._creating[trajectory] = self._creators.submit(self._make_box,
                                                                       trajectory)
        if warm is not None:
            self._mark(warm, trajectory)
            self._refill_soon()
        if box is not None:
            try:
                self._set_cpus(box, None, IDLE_QUOTA_US)
            except (docker.errors.APIError, OSError):
                pass  # gone since: its next action finds out (AgentGone: state_lost)

    def _make_box(self, trajectory: str) -> None:
        """The opening trajectory's container: taken warm or created (open_trajectory)."""
        try:
            with self._lock:
                if trajectory not in self._mem or trajectory in self._boxes or self._closed:
                    return  # closed meanwhile, or its first action made one
                image = self._images.get(trajectory, self.image)
                mem = self._mem[trajectory]
            box = self._take_warm(image, mem) or self._create(trajectory, image, mem)
            with self._lock:
                keep = (trajectory in self._mem and trajectory not in self._boxes
                        and not self._closed)
                if keep:
                    self._boxes[trajectory] = box
            if keep:
                self._mark(box, trajectory)
            else:
                self._discard(box)
        finally:
            with self._lock:
                self._creating.pop(trajectory, None)

    def open_trajectory_image(self, trajectory: str, mem_gb: float | None,
                              image: str) -> float | None:
        """Like open_trajectory, in a container of ``image``, pulled first when it is not on
        this machine (a blocking pull: the server awaits ``want_image`` before, off its event
        loop); PullFailed (or ValueError for a malformed reference) and nothing opened if it
        cannot be had. The image's size in GB (what a node pulls and stores for it: the
        core's ``image_gb``, a recording's), None where the engine does not say."""
        if image != self.image:
            with self._lock:  # held from now (the cache evicts no image a trajectory names)
                self._images[trajectory] = image
                self._opening.pop(trajectory, None)
                wait = self._waits.pop(trajectory, None)
            try:
                self._is_host_rootfs(image)  # it is here (pulled if not), and what it is
            except BaseException:
                with self._lock:
                    self._images.pop(trajectory, None)
                raise
            self.images.touch(image)
        else:
            wait = None
        self.open_trajectory(trajectory, mem_gb)
        try:
            size = self.client.api.inspect_image(image).get("Size")
        except docker.errors.APIError:  # (removed behind our back since: its size unknown)
            return None
        gb = size / 1e9 if isinstance(size, int | float) and size > 0 else None
        done = wait.result() if wait is not None and wait.done() and not wait.cancelled() \
            and wait.exception() is None else None
        if gb is not None and done is not None and done.pulled and done.pull_s > 0:
            # in the size the core books (what the node stores), as its rate is used
            self._pulled[trajectory] = (gb, done.pull_s)
        return gb

    # -- images (executor/backends/docker/cache.py) ----------------------------------------
    def want_image(self, trajectory: str, image: str) -> Future[PullDone]:
        """pulls.ImageFetching: ``image`` for opening ``trajectory``, held from now."""
        if image == self.image:
            done: Future[PullDone] = Future()
            done.set_result(PullDone(image, pulled=False))
            return done
        with self._lock:
            self._opening[trajectory] = image
        try:
            wait = self.images.want(image)
        except BaseException:
            self.unwant_image(trajectory)
            raise
        with self._lock:
            self._waits[trajectory] = wait
        return wait

    def unwant_image(self, trajectory: str) -> None:
        with self._lock:
            self._opening.pop(trajectory, None)
            self._waits.pop(trajectory, None)
        self._make_room_soon()

    def pull_image(self, image: str) -> None:
        """Pull ``image`` in the background unless it is here or being pulled (a pull ahead
        of the trajectories that will want it; as many at once as ``image_pulls`` allows).
        A malformed reference is logged, not raised: no trajectory waits for it."""
        if image == self.image or self._closed:
            return
        try:
            pulling = self.images.pull(image)
        except ValueError as e:
            log.warning("no pull ahead of %r: %s", image, e)
            return
        if pulling is not None:
            # the warm pool keeps sandboxes of images here only: once it is, a trajectory
            # the core expects here (expect_image) gets its warm sandbox
            pulling.add_done_callback(lambda _: self._refill_soon())

    def pull(self, effect: PullImage) -> None:
        """tangram.protocol.Pulling: the core's pull ahead (this backend is one node: the
        effect's node is this machine's). On one machine its trajectory opened here
        first (its container is made at open, whatever the core's queue)."""
        self.pull_image(effect.image)

    def expect_image(self, trajectory: str, image: str, mem_gb: float | None) -> None:
        """pulls.ImageFetching: the core expects ``trajectory`` (not opened here) to open
        here once this node has room for it (a node agent's: executor/backends/ray): a warm
        sandbox of ``image`` is kept of ``mem_gb`` (its limit) for its first action, which
        would otherwise make its container on its core, once the image is here (its pull
        ahead is ``pull``'s). No engine call: a caller on an event loop may call it."""
        if image == self.image:
            return
        with self._lock:
            if trajectory in self._mem or self._closed:
                return  # opened here already: its container is made at its open
            self._expected[trajectory] = (image, mem_gb or self.default_mem_gb)
        self._refill_soon()

    def image_status(self) -> dict[str, Any]:
        """pulls.ImageFetching: pulls, the cache, its counters, the warm pool by image."""
        held = self._held_images()
        out = self.images.status(held)
        with self._lock:
            warm = Counter(b.image for b in self._warm)
        out["warm"] = dict(sorted(warm.items()))
        return out

    def _held_images(self) -> set[str]:
        """The images the cache must not remove: named by an open or opening trajectory or
        one the core expects here (``expect_image``), or run by one of this backend's containers
        (or one the warm pool is making)."""
        with self._lock:
            boxes = [*self._boxes.values(), *self._warm, *self._leftovers.values()]
            return ({*self._images.values(), *self._opening.values()}
                    | {image for image, _ in self._expected.values()}
                    | {b.image for b in boxes}
                    | {image for (image, _), n in self._warming.items() if n > 0})

    def _runs_image(self, image_id: str) -> bool:
        """Whether a container of this backend (any: one being removed too) runs the
        image ``image_id`` (an engine call)."""
        try:
            return bool(self.client.containers.list(all=True, sparse=True, filters={
                "label": f"{OWNER}={self.owner}", "ancestor": image_id}))
        except docker.errors.APIError:
            return False

    def _release_warm(self) -> int:
        """The cache is over its budget: drop the warm sandboxes of pulled images nothing
        else holds (a sandbox is made again in a second, an image pulled again in many), so
        their images can go; how many were dropped."""
        with self._lock:
            held = ({*self._images.values(), *self._opening.values()}
                    | {b.image for b in [*self._boxes.values(), *self._leftovers.values()]})
            spare = [b for b in self._warm if b.image != self.image and b.image not in held]
            for box in spare:
                self._warm.remove(box)
        for box in spare:
            self._discard(box)
        return len(spare)

    def _make_room_soon(self) -> None:
        """Evict what the budget no longer fits, off the caller's thread (engine calls)."""
        if self.images.budget is None:
            return
        try:
            self._removers.submit(self.images.make_room)
        except RuntimeError:  # shut down: nothing to keep in budget any more
            pass

    def close_trajectory(self, trajectory: str) -> None:
        with self._lock:
            self._expected.pop(trajectory, None)
            box = self._boxes.pop(trajectory, None)
            self._lost.discard(trajectory)
            self._mem.pop(trajectory, None)
            image = self._images.pop(trajectory, None)
            self._shed.pop(trajectory, None)
            self._unstarted.discard(trajectory)
            self._pulled.pop(trajectory, None)
        if image is not None:
            self.images.touch(image)  # (its last use: the least recently used go first)
        if box:
            try:  # ~0.1-0.3 s in the engine: off the loop
                self._removers.submit(self._discard, box)
            except RuntimeError:  # the pool is shut down: the server is stopping
                self._discard(box)
        elif image is not None:
            self._make_room_soon()

    def evict(self, trajectory: str) -> bool:
        """Remove an idle trajectory's container to free its memory (the core reclaimed
        it for one waiting to start: tangram.protocol.Reclaim, Capabilities.evicts). Its
        next action gets a fresh container and ``state_lost``. False if it is busy or has
        none."""
        with self._lock:
            box = self._boxes.get(trajectory)
            if box is None or box.busy:
                return False
            del self._boxes[trajectory]
            self._lost.add(trajectory)
        try:
            self._removers.submit(self._discard, box)
        except RuntimeError:  # the pool is shut down: the server is stopping
            self._discard(box)
        return True

    def shed(self, effect: Shed) -> str | None:
        """Capabilities.sheds: the machine is short of memory (the core's Shed): kill the
        commands of the sandbox whose cgroup holds the most (inside it, as the sandbox user:
        the agent and the files stay); its running actions end ``oom``. The trajectory, None
        when no sandbox's use can be read or none holds memory."""
        with self._lock:
            boxes = dict(self._boxes)
        use = {t: cgroups.working_set(Path(b.memory_dir)) or 0
               for t, b in boxes.items() if b.memory_dir is not None}
        shed = largest_sandbox(use, effect)
        if shed is None:
            return None
        worst, why = shed
        self._shed[worst] = (time.time(), why)
        # an engine call (~50 ms): off the event loop this is called on
        try:
            self._removers.submit(self._kill_commands, worst, boxes[worst])
        except RuntimeError:  # the pool is shut down: the server is stopping
            self._kill_commands(worst, boxes[worst])
        return worst

    def _kill_commands(self, trajectory: str, box: Sandbox) -> None:
        """kill(-1) as the sandbox user: every process it may signal in its container (all
        of the commands'; not the agent, root) but the shell that sends it."""
        try:
            eid = self.client.api.exec_create(box.container_id, ["sh", "-c", "kill -9 -1"],
                                              user=SANDBOX_USER)
            self.client.api.exec_start(eid["Id"])
        except docker.errors.APIError as e:  # gone meanwhile: its memory is freed anyway
            log.warning("could not kill the commands of %r's sandbox: %s", trajectory, e)

    def shutdown(self) -> None:
        self._closed = True
        self.images.close()
        with self._lock:
            boxes = list(self._boxes.values()) + self._warm + list(self._leftovers.values())
            removed = sorted(set(self._boxes) | set(self._leftovers) | self._lost_at_start)
            self._boxes.clear()
            self._warm = []
            self._leftovers.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._killers.shutdown(wait=False, cancel_futures=True)
        # a creation in progress sees _closed and discards what it made
        self._creators.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            refillers = list(self._refillers)
        deadline = time.monotonic() + 30
        for refiller in refillers:
            # a sandbox it is creating now is discarded when _create returns: a container
            # the engine makes after remove_all's listing below would outlive the executor
            refiller.join(timeout=max(0.0, deadline - time.monotonic()))
        self._removers.shutdown(wait=True)  # the closed trajectories' removals: seconds
        # in parallel: a server with many sandboxes must still stop within seconds
        with ThreadPoolExecutor(max_workers=16) as removers:
            list(removers.map(self._discard, boxes))
        self.remove_all()
        shutil.rmtree(self.agent_root, ignore_errors=True)
        if removed and self.removed_file is not None:
            try:
                self.removed_file.parent.mkdir(parents=True, exist_ok=True)
                self.removed_file.write_text(json.dumps(removed))
            except OSError as e:
                log.warning("cannot record the sandboxes this stop removed (%s): a restart "
                            "will not tell their trajectories their files are gone", e)

    def remove_all(self) -> int:
        """Remove every container this executor created (by label)."""
        ids = [c.id for c in self.client.containers.list(
            all=True, sparse=True, filters={"label": f"{LABEL}={self.run_id}"})]
        with ThreadPoolExecutor(max_workers=16) as removers:
            list(removers.map(self._remove, ids))
        return len(ids)

    # -- sandboxes -------------------------------------------------------------------------
    def _is_host_rootfs(self, image: str) -> bool:
        """Whether ``image`` is an empty root filesystem run on the host's /usr (ours)."""
        if image not in self._host_rootfs:
            if image == IMAGE:
                ensure_image(self.client, image)
            else:
                self.images.ensure(image)
            labels = self.client.api.inspect_image(image).get("Config", {}).get("Labels") or {}
            self._host_rootfs[image] = image == IMAGE or labels.get(HOST_ROOTFS) == "host"
        return self._host_rootfs[image]

    def _create(self, trajectory: str, image: str, mem_gb: float) -> Sandbox:
        if image != self.image:
            self.images.ensure(image)  # (a dict look-up unless it went behind our back)
        host_rootfs = self._is_host_rootfs(image)
        mem = mem_gb or self.default_mem_gb
        agent_dir = None
        command: list[str] | None = ["sleep", "infinity"] if host_rootfs else None
        env = {"HOME": "/tmp", "PATH": "/usr/bin:/bin"} if host_rootfs else {}
        if host_rootfs:
            mounts = {p: {"bind": p, "mode": "ro"} for p in HOST_MOUNTS if os.path.exists(p)}
        else:  # the image's own /usr stays; the agent's python sits beside it
            mounts = {"/usr": {"bind": HOST_PREFIX + "/usr", "mode": "ro"}}
        if self.agent and (host_rootfs or self.host_python):
            agent_dir = tempfile.mkdtemp(prefix="box-", dir=self.agent_root)
            mounts[agent_dir] = {"bind": "/tangram", "mode": "rw"}
            mounts[str(AGENT_ROOT)] = {"bind": "/tangram-agent", "mode": "ro"}
            script = [f"/tangram-agent/{AGENT.relative_to(AGENT_ROOT)}", "/tangram/agent.sock", "/work"]
            if host_rootfs:
                command = ["/usr/bin/python3", "-S", *script]
            else:
                loader, libs, python = self.host_python  # type: ignore[misc]
                command = [loader, "--library-path", libs, python, "-S", *script]
                env.update({"PYTHONHOME": HOST_PREFIX + "/usr",
                            "TANGRAM_AGENT_DROP": "PYTHONHOME"})
        labels = {LABEL: self.run_id, OWNER: self.owner, "tangram.trajectory": trajectory[:200]}
        disk = self._disk(mem, files_by_archive=agent_dir is None)
        try:
            # the engine's create API directly: ContainerCollection.create would inspect
            # the new container (one more engine call) only to build an object we never use
            cid = self.client.api.create_container(**_create_container_args(dict(
                image=image, command=command, version=self.client.api._version,
                detach=True, init=True, labels=labels, volumes=mounts,
                working_dir="/work", network_mode="none", environment=env,
                mem_limit=f"{int(mem * 1024)}m", memswap_limit=f"{int(mem * 1024)}m",
                pids_limit=self.pids_limit, cap_drop=["ALL"], cap_add=AGENT_CAPS,
                security_opt=["no-new-privileges"],
                # unthrottled while the agent starts; idle quota once it listens
                cpuset_cpus=",".join(map(str, self.cpu_map)), cpu_period=PERIOD_US,
                cpu_quota=len(self.cpu_map) * PERIOD_US, cgroup_parent=self.cgroup_parent,
                **disk)))["Id"]
        except Exception as e:
            if agent_dir:
                shutil.rmtree(agent_dir, ignore_errors=True)
            if isinstance(e, docker.errors.ImageNotFound):  # removed behind the cache's back:
                self.images.forget(image)  # the next sandbox of it pulls it again
            raise
        box = Sandbox(cid, time.monotonic(), image=image, mem_gb=mem, agent_dir=agent_dir)
        try:
            self.client.api.start(cid)
            if agent_dir is not None:
                sock = os.path.join(agent_dir, "agent.sock")
                deadline = time.monotonic() + 10
                pause = 0.005
                # backing off to 20 ms: a start takes hundreds of ms on a loaded machine, and
                # each 5 ms wake-up cost the server CPU (~1 ms per container) and the GIL
                while (not os.path.exists(sock) and time.monotonic() < deadline
                       and not self._closed):
                    time.sleep(pause)
                    pause = min(pause * 1.5, 0.02)
                box.socket = sock if os.path.exists(sock) else None
            box.cpuset_file, box.quota_file = self._cgroup_files(cid)
            box.memory_dir = _memory_dir(box.cpuset_file)
            self._set_cpus(box, None, IDLE_QUOTA_US)
        except Exception:
            self._discard(box)  # a container that never started must not linger
            raise
        return box

    def _cgroup_files(self, cid: str) -> tuple[str | None, str | None]:
        """The container's cgroup files: where the first container's paths name its id, the
        next ones' are the same paths with their own id (no engine call: inspecting each new
        container for its pid cost ~0.5 ms of server CPU); else found through its pid."""
        if self._cgroup_template is not None:
            files = tuple(t.replace("{id}", cid) for t in self._cgroup_template)
            if all(os.access(f, os.W_OK) for f in files):  # the id is in the path: its own
                return files  # type: ignore[return-value]
        cpuset, quota = _cgroup_files(self.client, cid)
        if cpuset and quota and cid in cpuset and cid in quota:
            self._cgroup_template = (cpuset.replace(cid, "{id}"), quota.replace(cid, "{id}"))
        return cpuset, quota

    def _disk(self, mem_gb: float, files_by_archive: bool) -> dict:
        """The container options that bound what its commands write. Without an agent the
        file API goes through the engine's archive API, which does not see a tmpfs mount
        (an upload landed in the layer beneath /work, invisible to the commands): there
        /work is an anonymous volume of the local driver backed by a tmpfs of the same
        size, which the archive API does see, removed with the container."""
        mb = int(self.disk_gb * 1024)
        if self._storage_opt:
            return {"storage_opt": {"size": f"{mb}m"}}
        # tmpfs pages count against the memory limit and cannot be swapped: bounded well
        # below it, so a full disk is ENOSPC for the writer, not an OOM kill of the agent
        work = max(16, min(mb, int(mem_gb * 1024 / 2)))
        tmp = max(16, min(mb, int(mem_gb * 1024 / 4)))
        uid = SANDBOX_USER.split(":")[0]  # /work is the sandbox user's
        tmpfs = {"/tmp": f"size={tmp}m,mode=1777,exec", "/var/tmp": "size=64m,mode=1777"}
        work_opts = f"size={work}m,mode=0700,uid={uid},gid={uid},nosuid,nodev"
        if not files_by_archive:
            return {"tmpfs": {SANDBOX_WORKDIR: work_opts + ",exec", **tmpfs}}
        # no_copy: the image's own /work (its owner and mode) must not be copied into it
        return {"tmpfs": tmpfs, "mounts": [Mount(SANDBOX_WORKDIR, None, type="volume", no_copy=True,
                                                 driver_config=DriverConfig("local", {
                                                     "type": "tmpfs", "device": "tmpfs",
                                                     "o": work_opts}))]}

    def _needed(self, trajectory: str, mem_gb: float) -> None:
        """``trajectory`` needs a sandbox of ``mem_gb`` now (at its opening: taken warm or to
        be created; counted once): counted in its burst. A burst ends once none was needed
        for WARM_QUIET_S and every container it asked for is made: under load the openings
        of one RL step came up to 1.6 s apart while their containers were still being made
        (counted from the gaps alone, a step of 64 was two bursts of 32, and the pool was
        sized for half the next step). Under ``self._lock``."""
        now = time.monotonic()
        if now - self._last_take > WARM_QUIET_S and not self._creating:
            self._burst = 0
            self._burst_mem.clear()
            self._burst_images.clear()
            self._unstarted.clear()
        self._burst += 1
        self._unstarted.add(trajectory)
        self._burst_mem[mem_gb or self.default_mem_gb] += 1
        self._burst_images[self._images.get(trajectory, self.image)] += 1
        self._default_peak = max(self._default_peak, self._burst_images[self.image])
        self._burst_peak = max(self._burst_peak, self._burst)
        self._last_take = now

    @property
    def warm_target(self) -> int:
        """Default-image sandboxes the warm pool keeps: the configured size, or, if more,
        the largest burst of default-image trajectories that needed one so far (an RL
        step's rollouts start together, and the next step starts as many: their containers
        are made in the quiet between steps, not while the rollouts wait), at most
        WARM_MAX. Trajectories of other images have pools of their own (warm_targets)."""
        return max(self.warm_size, min(self._default_peak, WARM_MAX))

    def warm_targets(self) -> dict[str, int]:
        """Sandboxes the warm pool keeps of each image: ``warm_target`` of the default
        image; of each other image, as many as the latest burst had trajectories of it (an
        RL step's group of rollouts of one task shares its image, and the next step's
        groups ask again), the most common first, WARM_MAX of them in all; only of an image
        on the node (a warm sandbox never has its image pulled again), and none while held
        images keep the image cache over its budget (a warm sandbox holds its image against
        eviction: the pool must not be what keeps the disk full). The trajectories the core
        expects here (``expect_image``) are a floor of their image's count: the latest burst on
        this node did not see them. Under ``self._lock``."""
        targets = {self.image: self.warm_target}
        room = 0 if self.images.over_budget else WARM_MAX
        demand = Counter(self._burst_images)
        for image, n in Counter(image for image, _ in self._expected.values()).items():
            demand[image] = max(demand[image], n)
        for image, n in demand.most_common():
            if image == self.image or room <= 0 or not self.images.has(image):
                continue
            targets[image] = min(n, room)
            room -= targets[image]
        return targets

    def _short(self, targets: Mapping[str, int]) -> dict[str, int]:
        """Per image, the sandboxes the pool lacks. Under ``self._lock``."""
        have = Counter(b.image for b in self._warm)
        for (image, _), n in self._warming.items():
            have[image] += n
        return {image: n - have[image] for image, n in targets.items() if n > have[image]}

    def _warm_mem(self) -> float:
        """The memory limit the pool's next sandbox gets: the one most trajectories of the
        latest burst asked for (the smaller on a tie; the default before any burst). An RL
        step's rollouts share one tool config, so they take it with no engine call (on the
        event loop, DockerBackend._ready); a larger limit takes it with one (_take_warm).
        Under ``self._lock``."""
        if not self._burst_mem:
            return self.default_mem_gb
        return min(self._burst_mem.items(), key=lambda kv: (-kv[1], kv[0]))[0]

    def _refill_soon(self) -> None:
        with self._lock:
            if self._closed:
                return
            short = sum(self._short(self.warm_targets()).values())
            more = min(WARM_CREATORS, short) - len(self._refillers)
            # their own threads, not the actions' pool: they wait for quiet (below) and
            # must not hold a worker the burst's actions need
            threads = [threading.Thread(target=self._refill, daemon=True, name="tangram-warm")
                       for _ in range(max(0, more))]
            self._refillers.update(threads)
        for thread in threads:
            thread.start()

    def _refill(self) -> None:
        """Keep ``warm_targets`` sandboxes of each image ready, starting each once no
        trajectory needed a sandbox for WARM_QUIET_S, none opened is still waiting for its
        container and the burst's first actions have started (WARM_FIRST_S): a container
        start costs the engine (dockerd, runc) a few hundred ms of CPU, which the burst
        that emptied the pool needs now; the pool is for the next burst. WARM_CREATORS
        threads make them, one each at a time (one at a time made 1-2 a second on a loaded
        2-core machine, too few for 64 rollouts in the 30 s between two RL steps)."""
        me = threading.current_thread()
        box: Sandbox | None = None
        try:
            while True:
                with self._lock:
                    short = self._short(self.warm_targets())
                    if self._closed or not short:
                        self._refillers.discard(me)  # (with the decision: a take that
                        return  # comes next starts a refill anew)
                    now = time.monotonic()
                    first = self._unstarted and now - self._last_take < WARM_FIRST_S
                    wait = max(self._last_take + WARM_QUIET_S - now,
                               0.1 if self._creating or first else 0.0)
                    if wait <= 0:
                        # the default image first, then the image lacking the most
                        image = max(short, key=lambda i: (i == self.image, short[i]))
                        mem = self._warm_mem()
                        floor = [m for i, m in self._expected.values() if i == image]
                        if floor:  # (none larger than an expected one's limit: it takes it)
                            mem = min(mem, *floor)
                        self._warming[image, mem] += 1
                if wait > 0:
                    time.sleep(min(wait, 0.1))  # short steps: shutdown ends it promptly
                    continue
                try:
                    box = self._create("", image, mem)
                finally:
                    with self._lock:
                        self._warming[image, mem] -= 1
                        if not self._closed and box is not None:
                            self._warm.append(box)
                            box = None
                        self._warmed.notify_all()  # (made, or failed: a waiter's turn)
                with self._lock:
                    if self._closed:
                        break
                    # over the target: a sandbox no trajectory of the latest burst can take
                    # (a larger limit than theirs, or an image none of them asked for)
                    # makes room
                    targets = self.warm_targets()
                    spare = len(self._warm) - sum(targets.values())
                    have = Counter(b.image for b in self._warm)
                    unusable = [b for b in self._warm if b.mem_gb > mem
                                or have[b.image] > targets.get(b.image, 0)][:max(0, spare)]
                    for old in unusable:
                        self._warm.remove(old)
                for old in unusable:
                    self._discard(old)
            if box is not None:
                self._discard(box)
        except Exception:  # noqa: BLE001 - a failed refill is retried at the next take
            pass
        finally:
            with self._lock:
                self._refillers.discard(me)

    def _take_warm(self, image: str, mem_gb: float) -> Sandbox | None:
        """A warm sandbox for a trajectory of ``image`` and ``mem_gb``: one of its limit,
        else the largest below it (raised to it: one engine call); else, while the refill
        is making one that fits, that one when it is ready (it is further along than a
        container made now, which would only share the engine with it); else None."""
        mem = mem_gb or self.default_mem_gb
        with self._lock:
            while True:
                # its tmpfs mounts keep the sizes set for the pool's memory limit: under a
                # smaller limit a full /work would end in an OOM kill instead of ENOSPC
                # (disk_full), so only a trajectory allowed at least as much takes one
                fits = [i for i, b in enumerate(self._warm)
                        if b.image == image and b.mem_gb <= mem]
                i = max(fits, key=lambda i: (self._warm[i].mem_gb, i), default=None)
                if i is not None or self._closed or not any(
                        n > 0 and im == image and m <= mem
                        for (im, m), n in self._warming.items()):
                    break
                self._warmed.wait(1.0)  # (notified as each is done)
            box = self._warm.pop(i) if i is not None else None
            if box is not None:  # idle from now, not from when the pool made it (_reap)
                box.last_used = time.monotonic()
        self._refill_soon()  # (the demand may have grown the pool's size)
        if box is None:
            return None
        if mem != box.mem_gb:  # one engine call (~20 ms), still far cheaper than a container
            try:
                limit = f"{int(mem * 1024)}m"
                self.client.api.update_container(box.container_id, mem_limit=limit,
                                                 memswap_limit=limit)
                box.mem_gb = mem
            except docker.errors.APIError:
                self._removers.submit(self._discard, box)
                return None
        return box

    def _sandbox(self, trajectory: str, now: bool = False) -> tuple[Sandbox, bool]:
        """The trajectory's container (taken warm or created now); True if state was lost.
        ``now`` (an action's: it holds its cores meanwhile): if its creation is still
        queued behind other trajectories', it is made here, at once. Under a burst the
        queue is long (64 openings, CREATORS at a time) and the core's order is not the
        openings': an action waited 10 s for its turn, holding one of the two cores, while
        actions whose containers were ready waited for it."""
        with self._lock:
            making = self._creating.get(trajectory)
            if now and making is not None and making.cancel():
                del self._creating[trajectory]
                making = None
        if making is not None:  # being made since it opened: wait for it (or make one if it failed)
            try:
                making.result()
            except Exception:  # noqa: BLE001 - the creation's error: made again below
                pass
        with self._lock:
            box = self._boxes.get(trajectory)
            lost = trajectory in self._lost
            image = self._images.get(trajectory, self.image)
            mem = self._mem.get(trajectory, 0.0)
        if box is not None:
            return box, False
        box = self._take_warm(image, mem) or self._create(trajectory, image, mem)
        with self._lock:
            other = self._boxes.get(trajectory)
            if other is None:
                self._boxes[trajectory] = box
                self._lost.discard(trajectory)
        if other is not None:  # created concurrently (a file upload racing the first action)
            self._discard(box)
            return other, False
        self._mark(box, trajectory)
        return box, lost

    def _ready(self, trajectory: str) -> tuple[Sandbox, bool] | None:
        """The trajectory's sandbox (and whether state was lost) when its action can run on
        the event loop: one with an agent and writable cgroup files that needs no engine
        call - its own, or a warm one of the pool's memory limit (taken and bound to the
        trajectory here). None: the threaded path (_sandbox) decides."""
        with self._lock:
            box = self._boxes.get(trajectory)
            if box is not None:
                return (box, False) if _ready_box(box) else None
            if trajectory in self._creating:
                return None  # being made: the threaded path waits for it
            box = self._take_ready_warm(trajectory)
            if box is None:
                return None
            self._needed(trajectory, box.mem_gb)  # (not counted at its opening: it had one)
            self._unstarted.discard(trajectory)  # (its action is starting)
            lost = trajectory in self._lost
            self._lost.discard(trajectory)
        self._mark(box, trajectory)
        self._refill_soon()
        return box, lost

    def _mark(self, box: Sandbox, trajectory: str) -> None:
        """``box`` is ``trajectory``'s from now on: marked for a restart to adopt, and
        named for an operator (container_name), the rename off the caller's path."""
        _mark(box, trajectory)
        try:
            self._removers.submit(self._rename, box, trajectory)
        except RuntimeError:  # shut down meanwhile: it is being removed
            pass

    def _rename(self, box: Sandbox, trajectory: str) -> None:
        try:
            self.client.api.rename(box.container_id, container_name(trajectory,
                                                                    box.container_id))
        except docker.errors.APIError as e:  # removed meanwhile: nothing to name
            log.debug("docker: cannot name %s for %s: %s", box.container_id[:12],
                      trajectory, e)

    def _take_ready_warm(self, trajectory: str) -> Sandbox | None:
        """A warm sandbox bound to ``trajectory`` with no engine call (of its memory limit
        and image, its agent listening), or None. Under ``self._lock``."""
        mem = self._mem.get(trajectory, 0.0) or self.default_mem_gb
        image = self._images.get(trajectory, self.image)
        i = next((i for i in range(len(self._warm) - 1, -1, -1)
                  if self._warm[i].image == image and self._warm[i].mem_gb == mem
                  and _ready_box(self._warm[i])), None)
        if i is None:
            return None
        box = self._warm.pop(i)
        box.last_used = time.monotonic()  # idle from now, not from when the pool made it
        self._boxes[trajectory] = box
        return box

    def _grant(self, box: Sandbox, cores: list[int], engine: bool = True) -> float | None:
        """AOE: the container's cgroup gets exactly ``cores`` right before the exec.
        Seconds it took; None if ``engine`` is False and the cgroup files could not be
        written (the engine's update API blocks for ~20 ms: not on the event loop)."""
        t0 = time.time()
        with box.lock:
            box.busy = True
            box.grants += 1
            if not self._set_cpus(box, cores, len(cores) * PERIOD_US, engine):
                return None
        return time.time() - t0

    def _set_cpus(self, box: Sandbox, cores: list[int] | None, quota_us: int,
                  engine: bool = True) -> bool:
        """Write the cgroup files directly (~0.1 ms) where we may; else ask the engine
        (~20 ms), unless ``engine`` is False (then: False). Order matters when growing:
        cores first, then the quota."""
        if box.cpuset_file and box.quota_file:
            try:
                if cores is not None:
                    with open(box.cpuset_file, "w") as f:
                        f.write(",".join(map(str, cores)))
                with open(box.quota_file, "w") as f:
                    f.write(str(quota_us) if box.quota_file.endswith("cfs_quota_us")
                            else f"{quota_us} {PERIOD_US}")
                return True
            except OSError:
                box.cpuset_file = box.quota_file = None  # e.g. the container is gone
        if not engine:
            return False
        kw = {"cpuset_cpus": ",".join(map(str, cores))} if cores is not None else {}
        self.client.api.update_container(box.container_id, cpu_period=PERIOD_US,
                                         cpu_quota=quota_us, **kw)
        return True

    # -- one action ------------------------------------------------------------------------
    def _run(self, d: Dispatch) -> tuple[Outcome, Sandbox | None]:
        t_start = time.time()
        prepared = self._prepare(d)
        if isinstance(prepared, Outcome):
            return prepared, None
        argv, cores, timeout, env = prepared
        aid, mark = d.action.id, env[ACTION_MARK]
        box, lost = self._sandbox(d.action.trajectory, now=True)
        try:
            for attempt in (0, 1):
                try:
                    update_s = self._grant(box, cores)
                except docker.errors.APIError:
                    update_s = 0.0
                self._running[aid] = box.container_id
                self._held(aid, box, mark, cores)
                execute = self._agent_exec if box.socket else self._docker_exec
                try:
                    code, output, t_exec, t_exited, timed_out, ooms = execute(
                        box, argv, env, timeout, 0 if d.lease.lane else EXCLUSIVE_NICE)
                    break
                except AgentGone:
                    # the container died (or was killed) while idle: a fresh one, state lost
                    if attempt:
                        raise
                    self._forget(d.action.trajectory, box)
                    box, _ = self._sandbox(d.action.trajectory)
                    lost = True
                except (AgentSilent, docker.errors.APIError, OSError, ValueError) as e:
                    return self._exec_failed(d, box, timeout, e)
                finally:
                    self._running.pop(aid, None)
            # An agent that answered was alive throughout (a dying one drops the connection);
            # after `docker exec` only the engine can tell, and a signal-killed exec hints at it.
            if not box.socket and not self._alive(
                    box.container_id, settle_s=1.0 if code is None or code >= 128 else 0):
                return self._died(d, box), None
            outcome, kept = self._outcome(d, box, lost, argv, cores, timeout, update_s, t_start,
                                          (code, output, t_exec, t_exited, timed_out, ooms))
            if timed_out or aid in self._cancelled:
                outcome = self._end_tree(d, box, mark, outcome)
            return outcome, kept
        finally:
            self._actions.pop(aid, None)
            self._resized.pop(aid, None)
            self._cancelled.discard(aid)

    async def _run_on_loop(self, d: Dispatch, box: Sandbox, lost: bool,
                           on_done: Callable[[Outcome], None]) -> None:
        """One action in a ready sandbox (see _ready), on the event loop: the cgroup files
        written directly (~0.1 ms), the agent asked over its socket without blocking. What
        needs the engine (a dead agent's replacement, a timeout's kill, a failure's
        diagnosis) goes to the worker threads as before."""
        loop = asyncio.get_running_loop()
        t_start = time.time()
        grant = 0
        outcome: Outcome | None = None
        exec_failed = False
        failed_box: Sandbox | None = None  # after a failed exec: the box, if it is kept
        mine = True  # False once handed to the threaded path (its cancel state goes along)
        try:
            prepared = self._prepare(d)
            if isinstance(prepared, Outcome):
                outcome = prepared
            else:
                argv, cores, timeout, env = prepared
                update_s = self._grant(box, cores, engine=False)
                if update_s is None:  # its cgroup files are gone: the engine's way, in a thread
                    mine = False
                    self._in_thread(d, on_done, loop)
                    return
                grant = box.grants
                aid, mark = d.action.id, env[ACTION_MARK]
                self._running[aid] = box.container_id
                self._held(aid, box, mark, cores)
                try:
                    result = await self._agent_exec_async(
                        box, argv, env, timeout, 0 if d.lease.lane else EXCLUSIVE_NICE)
                except AgentGone:
                    # nothing reached it: the threaded path replaces the container (state lost)
                    self._actions.pop(aid, None)
                    mine = False
                    self._in_thread(d, on_done, loop)
                    return
                except (AgentSilent, OSError, ValueError) as e:
                    exec_failed = True
                    outcome, failed_box = await loop.run_in_executor(
                        self._pool, self._exec_failed, d, box, timeout, e)
                finally:
                    self._running.pop(aid, None)
                if outcome is None:
                    outcome, _ = self._outcome(d, box, lost, argv, cores, timeout, update_s,
                                               t_start, result)
                    if result[4] or aid in self._cancelled:  # timed out, or cancelled
                        outcome = await loop.run_in_executor(
                            self._killers, self._end_tree, d, box, mark, outcome)
                        if self._boxes.get(d.action.trajectory) is not box:  # killed: no
                            exec_failed, failed_box = True, None  # cores to give back there
        except Exception as e:  # never leave an action unanswered
            outcome = Outcome(d.action.id, "failed", None,
                              error=f"docker: {type(e).__name__}: {e}")
        finally:
            if mine:
                self._actions.pop(d.action.id, None)
                self._resized.pop(d.action.id, None)
                self._cancelled.discard(d.action.id)
        on_done(outcome)  # once, whatever happened above
        if not grant or (exec_failed and failed_box is None):  # nothing (left) to reclaim
            return
        if exec_failed or not self._reclaim(box, grant, engine=False):
            try:
                self._removers.submit(self._reclaim, box, grant)
            except RuntimeError:  # shutting down: the container goes anyway
                pass

    def _held(self, aid: str, box: Sandbox, mark: str, granted: list[int]) -> None:
        """``aid`` runs in ``box`` from now (a cancel or a resize finds it here), granted
        ``granted``; a resize that came while it was being started applies now."""
        with self._resize_lock:
            self._actions[aid] = (box, mark)
            cores = self._resized.get(aid)
        if cores is not None and cores != granted:
            self._resize_box(box, aid)

    def resize(self, effect: Resized) -> None:
        """Resizing (tangram.protocol): a running elastic action's grant grew or shrank
        (tangram/cpu/malleable.py): its container's cpuset and CPU quota become the new
        cores while it runs (its workers stay as many as it started: they share them)."""
        cores = sorted(self.cpu_map[c] for c in effect.cores)
        with self._resize_lock:
            self._resized[effect.action_id] = cores
            held = self._actions.get(effect.action_id)
        if held is not None:  # (else not holding its sandbox yet: _held applies it)
            self._resize_box(held[0], effect.action_id)

    def _resize_box(self, box: Sandbox, aid: str) -> None:
        """``aid``'s grant now (``_resized``) on its ``box``: the cgroup files written
        directly (on the loop, ~0.1 ms); where they cannot be, the engine's update in a
        worker thread (~20 ms)."""
        with box.lock:
            cores = self._resized.get(aid)
            if cores is None or self._set_cpus(box, cores, len(cores) * PERIOD_US,
                                               engine=False):
                return
        # (apart from the actions' threads, busy with long commands: as a cancel's kill)
        self._killers.submit(self._resize_by_engine, box, aid)

    def _resize_by_engine(self, box: Sandbox, aid: str) -> None:
        """``aid``'s grant as it is when this runs, while ``aid`` still holds ``box``: two
        threads run these, so an update may run after a later one of the same action, or
        after the action ended and the trajectory's next one was granted its cores."""
        cores: list[int] | None = None
        try:
            with box.lock:
                with self._resize_lock:
                    held = self._actions.get(aid)
                    cores = self._resized.get(aid)
                if held is None or held[0] is not box or cores is None:
                    return
                self._set_cpus(box, cores, len(cores) * PERIOD_US)
        except docker.errors.APIError as e:  # (gone: its action ends as it ends)
            log.warning("resize of %s to cores %s failed: %s", box.container_id[:12], cores, e)

    def _prepare(self, d: Dispatch) -> tuple[list[str], list[int], float, dict[str, str]] | Outcome:
        """(argv, cores, timeout, env) of the action, or its failure (a bad payload)."""
        payload = d.action.payload or {}
        try:
            argv = elastic_argv(argv_of(payload), d.worker_count, d.action.elastic == "cpu")
        except CommandError as e:
            return Outcome(d.action.id, "failed", None, error=str(e))
        with self._resize_lock:  # (resized before it started: its grant now)
            cores = (self._resized.get(d.action.id)
                     or sorted(self.cpu_map[c] for c in d.lease.cores) or self.cpu_map)
        timeout = float(payload.get("timeout_s") or 0) or DEFAULT_TIMEOUT_S
        env = {k: str(v) for k, v in (payload.get("env") or {}).items()}
        env["TANGRAM_CORES"] = ",".join(map(str, cores))
        # the workers to start (``pytest -n $TANGRAM_WORKERS``): a malleable action's is the
        # widest it may grow to, so it uses the cores its grant grows onto
        env["TANGRAM_WORKERS"] = str(d.worker_count)
        # which action a process of the container is (executor/backends/docker/tree.py)
        env[ACTION_MARK] = uuid.uuid4().hex
        return argv, cores, timeout, env

    def _exec_failed(self, d: Dispatch, box: Sandbox, timeout: float,
                     e: Exception) -> tuple[Outcome, Sandbox | None]:
        """The outcome of an exec that raised ``e`` (after the request reached the sandbox)."""
        if isinstance(e, AgentSilent):
            self._kill(box)
            self._forget(d.action.trajectory, box)
            # (not state_lost: this command ran with its files; the next one, in a fresh
            # container, says so - once)
            return Outcome(d.action.id, "timeout", None, error=(
                f"the sandbox did not answer within the {timeout:g} s timeout (+{GRACE_S:g} s):"
                " its container was killed and is recreated, without its files, at the "
                "trajectory's next action")), None
        if self._alive(box.container_id, settle_s=1.0):
            return Outcome(d.action.id, "failed", None, error=f"exec failed: {e}"), box
        return self._died(d, box), None

    def _outcome(self, d: Dispatch, box: Sandbox, lost: bool, argv: list[str], cores: list[int],
                 timeout: float, update_s: float, t_start: float,
                 result: tuple[int | None, bytes, float, float, bool, int]
                 ) -> tuple[Outcome, Sandbox]:
        code, output, t_exec, t_exited, timed_out, ooms = result
        extra = {"argv": argv, "cores": cores, "update_s": update_s, "t_spawned": t_exec,
                 "t_exited": t_exited, "state_lost": lost, "container": box.container_id[:12],
                 "via": "agent" if box.socket else "docker exec"}
        pulled = self._pulled.pop(d.action.trajectory, None)
        if pulled is not None:  # its open waited for this pull: the core learns its rate
            extra.update(pulled_gb=pulled[0], pull_s=pulled[1])
        if box.work_free is not None and box.work_free < DISK_FULL_BYTES:
            return Outcome(d.action.id, "failed", code, (output or b"")[-OUTPUT_CAP:].decode(
                errors="replace"), f"disk_full: {SANDBOX_WORKDIR} is full (the sandbox's "
                f"disk limit: {self.disk_gb:g} GB, and at most half its mem_gb on this engine's "
                "storage driver); remove files, or give the trajectory more mem_gb",
                t_exec - t_start, {**extra, "reason": "disk_full"}), box
        shed = self._shed.get(d.action.trajectory)
        if ooms or (shed is not None and shed[0] >= t_start):
            why = self._oom_message(box) if ooms else shed[1]  # type: ignore[index]
            return Outcome(d.action.id, "oom", code, (output or b"")[-OUTPUT_CAP:].decode(
                errors="replace"), why, t_exec - t_start, extra), box
        return outcome_of(d, code, output or b"", timed_out, timeout, extra,
                          overhead_s=t_exec - t_start), box

    def _oom_message(self, box: Sandbox) -> str:
        return (f"out of memory: the sandbox's {box.mem_gb:g} GB limit was reached and the "
                "kernel killed a process of the command (give the trajectory a larger mem_gb)")

    def _agent_exec(self, box: Sandbox, argv: list[str], env: dict[str, str], timeout: float,
                    nice: int) -> tuple[int | None, bytes, float, float, bool, int]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            # the agent enforces the timeout; the host does not trust it to
            conn.settimeout(timeout + GRACE_S)
            try:
                conn.connect(box.socket)  # type: ignore[arg-type]
            except OSError as e:
                raise AgentGone(f"the sandbox agent is gone: {e}") from None
            conn.sendall(_agent_request(argv, env, timeout, nice))
            answer = _Answer()
            try:
                while not answer.add(conn.recv(1 << 16)):
                    pass
            except TimeoutError:
                raise AgentSilent("no answer") from None
        return _agent_answer(box, answer.data())

    async def _agent_exec_async(self, box: Sandbox, argv: list[str], env: dict[str, str],
                                timeout: float, nice: int
                                ) -> tuple[int | None, bytes, float, float, bool, int]:
        """_agent_exec without blocking the event loop (the same errors)."""
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.setblocking(False)
            try:
                async with asyncio.timeout(timeout + GRACE_S):
                    await loop.sock_connect(conn, box.socket)  # type: ignore[arg-type]
            except OSError as e:  # TimeoutError too: an agent that does not accept
                raise AgentGone(f"the sandbox agent is gone: {e}") from None
            answer = _Answer()
            try:
                # the agent enforces the timeout; the host does not trust it to
                async with asyncio.timeout(timeout + GRACE_S):
                    await loop.sock_sendall(conn, _agent_request(argv, env, timeout, nice))
                    while not answer.add(await loop.sock_recv(conn, 1 << 16)):
                        pass
            except TimeoutError:
                raise AgentSilent("no answer") from None
        return _agent_answer(box, answer.data())

    def _docker_exec(self, box: Sandbox, argv: list[str], env: dict[str, str], timeout: float,
                     nice: int) -> tuple[int | None, bytes, float, float, bool, int]:
        # The engine loses the attach stream of a short exec now and then (moby#27289,
        # docker-py#2042: `cat f` answered exit 0 and no output, ~1 in 200 under
        # `stress --cpu 8`, on 20.10). So the command's output goes to a file in the
        # sandbox's own size-bounded /tmp; its shell then prints the file's end and a
        # sentinel. No sentinel: the stream was lost (or the command was killed), and the
        # file is read again by an exec of its own. (The archive API cannot read it: it
        # does not see tmpfs mounts.) A command that leaves a child behind does not hold
        # the exec open: the child's output is the file, not the stream. The previous
        # actions' files are removed by this one's shell.
        token = uuid.uuid4().hex
        out, sentinel = f"{EXEC_OUTPUT}-{token}", f"\n{token}".encode()
        with box.lock:
            spent, box.spent_outputs = box.spent_outputs, []
        script = ((f"rm -f {' '.join(spent)}; " if spent else "")
                  + f'"$@" >{out} 2>&1; rc=$?; tail -c {OUTPUT_CAP} {out}; '
                  + f"printf '\\n{token}'; exit $rc")
        full = ["timeout", "-s", "KILL", f"{timeout:g}", *(["nice", "-n", str(nice)] if nice else []),
                "sh", "-c", script, "sh", *argv]
        try:
            exec_id = self.client.api.exec_create(box.container_id, full, workdir="/work",
                                                  environment=env, user=SANDBOX_USER)["Id"]
        except docker.errors.APIError as e:
            if not self._alive(box.container_id):
                raise AgentGone(str(e)) from None
            raise
        t_exec = time.time()
        output = self.client.api.exec_start(exec_id) or b""
        t_exited = time.time()
        code = self.client.api.exec_inspect(exec_id).get("ExitCode")
        timed_out = code == 137 and t_exited - t_exec >= timeout * 0.99
        for _ in range(2):
            if output.endswith(sentinel):
                break
            output = self._read_output(box, out, sentinel)
        # whole (sentinel seen), else three lost streams in a row: what the last one had
        output = output[:-len(sentinel)] if output.endswith(sentinel) else output[-OUTPUT_CAP:]
        with box.lock:
            box.spent_outputs.append(out)
        return code, output, t_exec, t_exited, timed_out, 0

    def _read_output(self, box: Sandbox, path: str, sentinel: bytes) -> bytes:
        """The end of an action's output file, by an exec of its own (plus the sentinel)."""
        script = f"tail -c {OUTPUT_CAP} {path} 2>/dev/null; printf '\\n{sentinel[1:].decode()}'"
        exec_id = self.client.api.exec_create(box.container_id, ["sh", "-c", script],
                                              user=SANDBOX_USER)["Id"]
        return self.client.api.exec_start(exec_id) or b""

    # -- failures and cleanup --------------------------------------------------------------
    def _forget(self, trajectory: str, box: Sandbox) -> None:
        with self._lock:
            if self._boxes.get(trajectory) is box:
                del self._boxes[trajectory]
            self._lost.add(trajectory)
        self._discard(box)

    def _died(self, d: Dispatch, box: Sandbox) -> Outcome:
        try:
            oom = bool(self.client.api.inspect_container(box.container_id)["State"]
                       .get("OOMKilled"))
        except docker.errors.APIError:
            oom = False
        self._forget(d.action.trajectory, box)
        # not state_lost: that flag tells a command it runs in a reset sandbox ("reset
        # before this command ran"); this one ran with its files and was cut short, which
        # its error says. The next action, in a fresh container, says state_lost, once.
        tail = ("; it will be recreated, without its files, at the trajectory's next action")
        if oom:
            return Outcome(d.action.id, "oom", None, error=self._oom_message(box) + tail)
        return Outcome(d.action.id, "failed", None,
                       error="the trajectory's container died during the action" + tail)

    def _kill(self, box: Sandbox) -> None:
        try:
            self.client.api.kill(box.container_id)
        except docker.errors.APIError:
            pass

    def _reclaim(self, box: Sandbox, grant: int, engine: bool = True) -> bool:
        """Take the cores back (1% of one core) unless the next action already has them.
        False if ``engine`` is False and only the engine could (see _set_cpus)."""
        with box.lock:
            if box.grants != grant:
                return True
            try:
                if not self._set_cpus(box, None, FILE_QUOTA_US if box.files else IDLE_QUOTA_US,
                                      engine):
                    return False
            except (docker.errors.APIError, OSError):  # requests' errors are OSErrors too:
                pass  # a box left busy would never be evicted nor reaped
            box.busy = False
            box.last_used = time.monotonic()
        return True

    def _alive(self, cid: str, settle_s: float = 0.0) -> bool:
        """Whether the container still runs; a signal-killed exec may be the first sign
        of a dying container, whose state the engine reports a moment later."""
        deadline = time.monotonic() + settle_s
        while True:
            try:
                state = self.client.api.inspect_container(cid)["State"]
            except docker.errors.NotFound:
                return False
            if not state.get("Running") or state.get("Restarting"):
                return False
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.05)

    def _discard(self, box: Sandbox) -> None:
        """Remove ``box``'s container; then, if it ran a pulled image, what the image
        cache's budget no longer fits. Every removal asks, whatever removed it (a closed
        trajectory, a spare or idle warm sandbox, one made for a trajectory that closed
        while it was made): a make_room that ran while the container existed kept its
        image (the engine refuses to remove an image a container uses), and nothing else
        would ask again."""
        self._remove(box.container_id)
        if box.agent_dir:
            shutil.rmtree(box.agent_dir, ignore_errors=True)
        if box.image != self.image:
            self._make_room_soon()

    def _remove(self, cid: str) -> None:
        try:
            # v: with its anonymous /work volume, if it has one (see _disk)
            self.client.api.remove_container(cid, force=True, v=True)
        except docker.errors.APIError:
            pass

    def _reap_loop(self) -> None:
        """Remove containers of abandoned trajectories after the idle TTL."""
        while not self._closed:
            time.sleep(min(5.0, max(self.idle_ttl_s / 4, 0.2)))
            self._reap(time.monotonic())

    def _reap(self, now: float) -> None:
        """One pass of _reap_loop at ``now``."""
        with self._lock:
            stale = [(t, b) for t, b in self._boxes.items()
                     if not b.busy and now - b.last_used > self.idle_ttl_s]
            for t, _ in stale:
                del self._boxes[t]
                self._lost.add(t)  # its next action, if any, must hear its files are gone
            # a predecessor's containers no restored trajectory claimed: abandoned
            unclaimed = [(t, b) for t, b in self._leftovers.items()
                         if now - b.last_used > self.idle_ttl_s]
            for t, _ in unclaimed:
                del self._leftovers[t]
            stale += unclaimed
            # warm sandboxes of an image no burst asked for since: each holds its image
            # against the cache's eviction (the default image's stay: it is never evicted)
            idle_warm = [b for b in self._warm
                         if b.image != self.image and now - b.last_used > self.idle_ttl_s]
            for box in idle_warm:
                self._warm.remove(box)
            stale += [("", b) for b in idle_warm]
        for _, box in stale:
            self._discard(box)


    # -- files (executor/server/routes/files.py) -------------------------------------------------------
    # Through the sandbox's agent, which opens each path component inside the container
    # without following a symlink (executor/backends/docker/agent.py). The engine's archive API
    # follows links the sandbox made (``ln -s /etc x``; ``ln -s /tangram t`` reached the
    # agent's socket): it is used only for a sandbox without an agent, after checking no
    # component is a link (the check and the copy are two engine calls: a command running
    # between them could still swap one in, so such sandboxes should not run untrusted code).
    def put_file(self, trajectory: str, parts: tuple[str, ...], data: bytes | BinaryIO) -> int:
        box, _ = self._sandbox(trajectory)  # a file may arrive before the first action
        box.last_used = time.monotonic()
        src = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
        if box.socket:
            size = _size_of(src)
            ans = self._agent_file(box, {"op": "put", "parts": list(parts), "size": size}, src)
            return int(ans["size"])
        self._no_links(box, parts[:-1])
        return self._archive_put(box, parts, src)

    def get_file(self, trajectory: str, parts: tuple[str, ...],
                 limit: int = MAX_FILE_BYTES) -> bytes:
        rel = "/".join(parts)
        with self._lock:
            box = self._boxes.get(trajectory)
        if box is None:  # no container yet (or it was reaped): nothing was written
            raise FileError(404, f"{rel}: no such file")
        box.last_used = time.monotonic()
        if box.socket:
            return self._agent_file(box, {"op": "get", "parts": list(parts), "limit": limit})
        self._no_links(box, parts[:-1])
        return self._archive_get(box, parts, limit)

    def _agent_file(self, box: Sandbox, req: dict, src: BinaryIO | None = None) -> Any:
        """One file operation by the sandbox's agent, the container's CPU quota lifted
        from the idle 1% to FILE_QUOTA_US meanwhile (an action's grant, if one comes,
        is left as it is; the last file operation or the action's reclaim restores it)."""
        self._file_quota(box, +1)
        try:
            return self._agent_file_io(box, req, src)
        finally:
            self._file_quota(box, -1)

    def _file_quota(self, box: Sandbox, step: int) -> None:
        with box.lock:
            box.files += step
            if box.busy or box.files > 1 or (step < 0 and box.files):
                return  # an action holds its grant, or another file operation the lift
            try:
                self._set_cpus(box, None, FILE_QUOTA_US if box.files else IDLE_QUOTA_US)
            except (docker.errors.APIError, OSError):  # the container is gone: the
                pass  # operation itself says so

    def _agent_file_io(self, box: Sandbox, req: dict, src: BinaryIO | None = None) -> Any:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(60)
            try:
                conn.connect(box.socket)  # type: ignore[arg-type]
            except OSError as e:
                raise FileError(409, f"the sandbox agent is gone: {e}") from None
            try:
                conn.sendall(json.dumps(req).encode() + b"\n")
                while src is not None and (chunk := src.read(1 << 20)):
                    conn.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the agent refused the request before reading its body: its answer says why
            data = b""
            while b"\n" not in data:
                try:
                    chunk = conn.recv(1 << 16)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    raise FileError(409, "the sandbox agent closed the connection")
                data += chunk
            line, _, rest = data.partition(b"\n")
            ans = json.loads(line)
            if "error" in ans:
                raise FileError(int(ans.get("status", 400)), ans["error"])
            if req["op"] == "put":
                return ans
            size, chunks = int(ans["size"]), [rest]
            got = len(rest)
            while got < size:
                chunk = conn.recv(min(1 << 20, size - got))
                if not chunk:
                    raise FileError(409, "the sandbox agent closed the connection")
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks)[:size]

    def _no_links(self, box: Sandbox, dirs: tuple[str, ...]) -> None:
        for i in range(1, len(dirs) + 1):
            rel = "/".join(dirs[:i])
            try:
                stream, st = self.client.api.get_archive(box.container_id,
                                                         f"{SANDBOX_WORKDIR}/{rel}")
                stream.close()  # only the stat header is wanted
            except docker.errors.NotFound:
                return  # made by the copy: not a link
            except docker.errors.APIError as e:
                raise FileError(400, f"{rel}: {e.explanation or e}") from None
            if st.get("linkTarget") or not int(st.get("mode", 0)) & GO_MODE_DIR:
                raise FileError(400, f"{rel}: is a symlink or not a directory (files stay "
                                "inside the sandbox)")

    def _archive_put(self, box: Sandbox, parts: tuple[str, ...], src: BinaryIO) -> int:
        with tempfile.TemporaryFile() as buf:  # the tar on disk, not in memory
            size = _size_of(src)
            with tarfile.open(fileobj=buf, mode="w") as tar:
                info = tarfile.TarInfo("/".join(parts))
                info.size, info.mode, info.mtime = size, 0o644, int(time.time())
                info.uid = info.gid = int(SANDBOX_USER.split(":")[0])  # the commands' own
                tar.addfile(info, src)
            buf.seek(0)
            try:
                self.client.api.put_archive(box.container_id, SANDBOX_WORKDIR, buf)
            except docker.errors.APIError as e:
                raise FileError(409, f"{'/'.join(parts)}: cannot write it in the sandbox: "
                                f"{e.explanation or e}") from None
        return size

    def _archive_get(self, box: Sandbox, parts: tuple[str, ...], limit: int) -> bytes:
        rel = "/".join(parts)
        try:
            chunks, st = self.client.api.get_archive(box.container_id, f"{SANDBOX_WORKDIR}/{rel}")
        except docker.errors.NotFound:
            raise FileError(404, f"{rel}: no such file") from None
        except docker.errors.APIError as e:
            raise FileError(400, f"{rel}: {e.explanation or e}") from None
        mode = int(st.get("mode", 0))
        if st.get("linkTarget"):
            raise FileError(400, f"{rel}: is a symlink (read what it points to by its own path)")
        if mode & GO_MODE_DIR:
            raise FileError(409, f"{rel}: is a directory")
        if mode & GO_MODE_IRREGULAR:
            raise FileError(400, f"{rel}: is not a regular file")
        if int(st.get("size", 0)) > limit:
            raise FileError(413, f"{rel}: {st['size']} bytes, over the {limit}-byte limit")
        with tarfile.open(fileobj=io.BytesIO(b"".join(chunks)), mode="r") as tar:
            member = tar.next()
            f = tar.extractfile(member) if member is not None else None
            if f is None:
                raise FileError(400, f"{rel}: is not a regular file")
            return f.read(limit + 1)[:limit]


class _Answer:
    """An agent's answer as it arrives (one JSON line, bounded), for both ways of reading it."""

    __slots__ = ("chunks", "size")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> bool:
        """Keep ``chunk``; True once the answer is whole (its newline) or the agent closed."""
        if not chunk:
            return True
        self.chunks.append(chunk)
        self.size += len(chunk)
        if chunk.endswith(b"\n"):
            return True
        if self.size > MAX_ANSWER:
            raise OSError("the sandbox agent's answer is too large")
        return False

    def data(self) -> bytes:
        return b"".join(self.chunks)


def _agent_request(argv: list[str], env: dict[str, str], timeout: float, nice: int) -> bytes:
    # the agent sets the niceness itself: the image may have no `nice` binary
    req = {"argv": argv, "env": env, "cwd": "/work", "timeout_s": timeout, "nice": nice}
    return json.dumps(req).encode() + b"\n"


def _agent_answer(box: Sandbox, data: bytes) -> tuple[int | None, bytes, float, float, bool, int]:
    """(code, output, t_start, t_end, timed_out, oom kills) of the agent's answer line."""
    if not data.endswith(b"\n"):
        raise OSError("the sandbox agent closed the connection")
    ans = json.loads(data)
    box.work_free = ans.get("work_free")
    return (ans["code"], ans["output"].encode(), ans["t_start"], ans["t_end"],
            ans["timed_out"], int(ans.get("oom_kills", 0)))


def _size_of(f: BinaryIO) -> int:
    """Bytes left in a seekable file object."""
    here = f.tell()
    end = f.seek(0, io.SEEK_END)
    f.seek(here)
    return end - here


#: in a sandbox's agent directory (host side): the trajectory it serves, so a restarted
#: server can adopt it (a warm sandbox's label names no trajectory: labels are fixed at
#: creation)
MARK = "trajectory"


def _ready_box(box: Sandbox) -> bool:
    """Whether an action can run in ``box`` with no engine call (its agent, its cgroup
    files writable)."""
    return bool(box.socket and box.cpuset_file and box.quota_file)


def _mark(box: Sandbox, trajectory: str) -> None:
    if box.agent_dir:
        try:
            Path(box.agent_dir, MARK).write_text(trajectory)
        except OSError:
            pass  # then a restart takes it for a warm one and removes it


def container_name(trajectory: str, container_id: str) -> str:
    """The name a trajectory's container carries once bound to it (warm or made for it):
    ``tangram-<trajectory>-<6 hex of its id>``, the trajectory's characters that a docker
    name cannot hold as ``_``. ``docker ps --filter name=tangram-<trajectory>-`` finds it;
    its ``tangram.trajectory`` label cannot (a warm container's is empty: labels are fixed
    when a container is made)."""
    return f"tangram-{_UNNAMEABLE.sub('_', trajectory)[:120]}-{container_id[:6]}"


_UNNAMEABLE = re.compile(r"[^a-zA-Z0-9_.-]")


def _marked(agent_dir: str | None) -> str:
    try:
        return Path(agent_dir, MARK).read_text() if agent_dir else ""
    except OSError:
        return ""


def _quota_capable(client: docker.DockerClient) -> bool:
    """Whether the engine can bound a container's writable layer (``--storage-opt size``):
    overlay2 over xfs (mounted with pquota, which only a create can tell), devicemapper,
    btrfs, zfs."""
    try:
        info = client.info()
    except docker.errors.APIError:
        return False
    driver = info.get("Driver", "")
    status = dict(info.get("DriverStatus") or [])
    if driver == "overlay2":
        return status.get("Backing Filesystem", "") == "xfs"
    return driver in ("devicemapper", "btrfs", "zfs")


def _cgroup_files(client: docker.DockerClient, cid: str) -> tuple[str | None, str | None]:
    """The container's cpuset and CPU-quota files, if this process may write them."""
    try:
        pid = client.api.inspect_container(cid)["State"]["Pid"]
        with open(f"/proc/{pid}/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f if line.strip()]
    except (OSError, KeyError, docker.errors.APIError):
        return None, None
    paths = {}
    for _, controllers, path in lines:
        for ctl in controllers.split(",") if controllers else ["unified"]:
            paths[ctl] = path
    if "cpuset" in paths and "cpu" in paths:  # cgroup v1
        cpuset = f"/sys/fs/cgroup/cpuset{paths['cpuset']}/cpuset.cpus"
        quota = f"/sys/fs/cgroup/cpu{paths['cpu']}/cpu.cfs_quota_us"
    elif "unified" in paths:  # cgroup v2
        cpuset = f"/sys/fs/cgroup{paths['unified']}/cpuset.cpus"
        quota = f"/sys/fs/cgroup{paths['unified']}/cpu.max"
    else:
        return None, None
    if all(os.access(p, os.W_OK) for p in (cpuset, quota)):
        return cpuset, quota
    return None, None


def _memory_dir(cpuset_file: str | None) -> str | None:
    """A container's memory cgroup directory from its cpuset file's path: under cgroup v1
    the engine's cgroupfs driver names the same path in every hierarchy; under v2 it is
    the same directory. None where it is not readable."""
    if cpuset_file is None:
        return None
    here = os.path.dirname(cpuset_file)
    v1 = "/sys/fs/cgroup/cpuset/"
    path = "/sys/fs/cgroup/memory/" + here[len(v1):] if here.startswith(v1) else here
    return path if os.path.exists(os.path.join(path, "memory.usage_in_bytes")) else None


def _cgroup_parent(client: docker.DockerClient) -> str | None:
    """The cgroup the sandboxes are started in (see the module's doc): the server's own
    memory cgroup when it is limited and the engine takes a path there (cgroupfs driver,
    cgroup v1); None (the engine's default) otherwise."""
    parent = cgroups.sandboxes_parent()
    if parent is None:
        return None
    try:
        info = client.info()
    except docker.errors.APIError:
        info = {}
    if info.get("CgroupDriver") == "cgroupfs" and str(info.get("CgroupVersion", "1")) == "1":
        return parent
    log.warning("this server's machine is a memory-limited cgroup (%s), but the docker "
                "engine (%s driver, cgroup v%s) cannot start sandboxes inside it: their "
                "memory is not bounded by it, nor seen in the free memory observed",
                parent, info.get("CgroupDriver", "?"), info.get("CgroupVersion", "?"))
    return None
