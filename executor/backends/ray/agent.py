"""The node agent: one Ray actor per node, pinned to it, that runs dispatches on
that node's local backend (process or docker) and reports their outcomes.

An agent holds no scheduling state — the one Tangram core lives in the
`tangram serve` (or `tangram run`) process, and the agent only executes what
it is sent. It reads its own node's inventory (cores it may pin to, grouped by
NUMA domain, memory, GPUs) because only the node itself knows it.

This module does not import Ray: the driver wraps :class:`NodeAgent` with
``ray.remote`` (executor/backends/ray/backend.py), so the class is plain Python here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from executor.backends.docker.limits import SandboxLimits
from executor.backends.docker.pulls import ImageFetching, PullDone, PullFailed
from executor.backends.ray.channel import AgentSide
from executor.backends.ray.guard import fence
from executor.backends.registry import env_backend
from executor.node.local import allowed_cpus, mem_total_gb
from tangram.cluster import CpuNodeSpec, GpuNodeSpec
from tangram.model import Dispatch, Outcome
from tangram.protocol import PullImage, Pulling

#: an outcome's ``extra["reason"]`` when its environment could not be had: its image could
#: not be pulled (or named) on the node, so nothing of its trajectory is open there
IMAGE_FAILED = "image_failed"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What an agent reports about its node: the core's view of it."""

    name: str
    ray_node_id: str
    hostname: str
    #: host CPU ids grouped by NUMA domain: the core's core i is ``cpus[i]``
    cpus: tuple[int, ...]
    numa: int
    mem_gb: float
    gpus: int
    gpu_mem_gb: float
    backend: str
    #: what the agent's guard fences with (executor/backends/ray/guard.py): the mark on its
    #: commands, its sandbox user ids (root only), its process id
    marker: str = ""
    uids: tuple[int, int] | None = None
    pid: int = 0

    @property
    def docker_owner(self) -> str | None:
        return f"tangram-ray-{self.marker}" if self.backend == "docker" else None

    def cpu_spec(self) -> CpuNodeSpec | None:
        return CpuNodeSpec(self.name, len(self.cpus), self.numa, self.mem_gb) if self.cpus else None

    def gpu_spec(self) -> GpuNodeSpec | None:
        """The core's GPU groups are aligned chunks of an 8-GPU node; other counts
        are not offered to it."""
        return GpuNodeSpec(self.name, 8, self.gpu_mem_gb) if self.gpus == 8 else None


def numa_order(cpus: list[int], sysfs: Path = Path("/sys/devices/system/node")
               ) -> tuple[list[int], int]:
    """``cpus`` grouped by NUMA domain, and the domain count. The core splits a
    node into equal domains, so unequal groups count as one domain."""
    from executor.backends.ray.cluster import parse_cpus

    groups: list[list[int]] = []
    mine = set(cpus)
    for node_dir in sorted(sysfs.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            members = [c for c in parse_cpus((node_dir / "cpulist").read_text()) if c in mine]
        except (OSError, ValueError):
            return sorted(cpus), 1
        if members:
            groups.append(members)
    if len(groups) < 2 or sum(map(len, groups)) != len(cpus) or \
            len({len(g) for g in groups}) != 1:
        return sorted(cpus), 1
    return [c for g in groups for c in g], len(groups)


def gpu_memory_gb() -> float:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            return pynvml.nvmlDeviceGetMemoryInfo(handle).total / 1024**3
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML: the spec's default
        return GpuNodeSpec("x").gpu_mem_gb


def raylet_pid() -> int | None:
    """The raylet this worker belongs to (its parent), if it is one."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/comm") as f:
            return ppid if "raylet" in f.read() else None
    except OSError:
        return None


def start_guard(marker: str, docker_owner: str | None, uids: tuple[int, int] | None,
                keep_fds: tuple[int, ...] = ()) -> IO[bytes]:
    """Start the guard (executor/backends/ray/guard.py) and return the pipe it watches.

    It must outlive this process, which is what it cleans up after, and Ray kills
    a dead worker's *child* processes: ``setsid -f`` makes the guard a grandchild
    in its own session, re-parented away from this worker. ``keep_fds`` (the lock of
    the sandbox user ids) stay held by the guard until it has fenced."""
    argv = [sys.executable, "-m", "executor.backends.ray.guard", marker, "--agent", str(os.getpid())]
    raylet = raylet_pid()
    if raylet is not None:
        argv += ["--raylet", str(raylet)]
    if docker_owner:
        argv += ["--docker", docker_owner]
    if uids is not None:
        argv += ["--uids", f"{uids[0]}-{uids[1]}"]
    setsid = shutil.which("setsid")
    proc = subprocess.Popen([setsid, "-f", *argv] if setsid else argv, stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, pass_fds=keep_fds)
    if setsid:
        proc.wait(10)  # setsid itself exits at once; its child holds the read end
    assert proc.stdin is not None
    return proc.stdin


class NodeAgent:
    """Runs dispatches on this node. Ray calls set it up (``listen``) and stop it
    (``shutdown``); dispatches, cancellations and outcomes travel over the driver's
    direct connection (executor/backends/ray/channel.py), served on the actor's event loop,
    so many actions run at once and a cancel is not queued behind them."""

    def __init__(self, name: str, ray_node_id: str, backend: str, root: str | None,
                 cpus: list[int] | None, mem_gb: float | None, gpus: int,
                 fenced: tuple[NodeInfo, ...] = (),
                 sandboxes: SandboxLimits = SandboxLimits()) -> None:
        # Before anything is offered: what earlier (dead) agents on this node left
        # running is killed, so their orphans never share the cores offered again.
        for old in fenced:
            fence(old.marker, old.uids, old.docker_owner)
        # Ray starts workers at a raised niceness; the backends nice exclusive-core actions
        # relative to their own (+10) and run lane actions as is, so start from 0 when
        # allowed (root or RLIMIT_NICE), else the two stay 10 apart from the worker's.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        allowed = allowed_cpus()
        # a label may name CPUs this node lacks (or its workers may not use): drop them
        ordered, numa = numa_order(allowed if cpus is None else [c for c in cpus if c in allowed])
        self.name = name
        self.marker = f"{name}-{uuid.uuid4().hex[:8]}"
        owner = f"tangram-ray-{self.marker}"
        # the node's own temporary directory: the driver's paths mean nothing here
        self.root = Path(root or tempfile.gettempdir()) / "tangram-ray" / self.marker
        uids: tuple[int, int] | None = None
        keep: tuple[int, ...] = ()
        self.backend = env_backend(backend, self.root, cpu_map=ordered, run_mark=self.marker,
                                   owner=owner, sandboxes=sandboxes)
        if backend == "process":
            uids = self.backend.uid_range
            lock = self.backend.uid_lock
            keep = () if lock is None else (lock,)
        self._guard = start_guard(self.marker, owner if backend == "docker" else None, uids,
                                  keep)
        self.info_ = NodeInfo(name, ray_node_id, socket.gethostname(), tuple(ordered), numa,
                              mem_gb if mem_gb is not None else mem_total_gb(), gpus,
                              gpu_memory_gb() if gpus else 0.0, backend, self.marker, uids,
                              os.getpid())
        self._opened: set[str] = set()
        #: trajectories whose sandbox of an image is being opened (set when it ends: their
        #: other actions wait for it), and those of them the driver closed meanwhile
        #: (closed as soon as their open ends)
        self._opening: dict[str, asyncio.Event] = {}
        self._dropped: set[str] = set()
        self._server: asyncio.Server | None = None
        self._links: set[AgentSide] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closed: asyncio.Event | None = None

    def info(self) -> NodeInfo:
        return self.info_

    async def listen(self, host: str, secret: bytes) -> tuple[NodeInfo, int]:
        """Open this agent's listener (executor/backends/ray/channel.py) on ``host`` (its node's
        IP, as Ray knows it), for peers holding ``secret``; its inventory and port."""
        if self._server is None:
            loop = asyncio.get_running_loop()
            self._closed = asyncio.Event()
            self._server = await loop.create_server(
                lambda: AgentSide(secret, self._serve, self._links), host, 0)
        return self.info_, self._server.sockets[0].getsockname()[1]

    async def until_closed(self) -> None:
        """Returns at shutdown: the driver keeps one such call open per agent, so
        Ray reports the agent's death to it too (the connection is the faster sign)."""
        assert self._closed is not None
        await self._closed.wait()

    def _serve(self, link: AgentSide, message: tuple) -> None:
        """A message from the driver (on the loop, in the order sent)."""
        kind = message[0]
        if kind == "run":
            task = asyncio.get_running_loop().create_task(self._reply(link, *message[1:]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif kind == "cancel":
            self.backend.cancel(message[1])
        elif kind == "close":
            self._close(message[1])
        elif kind == "pull":
            self._pull_ahead(*message[1:])

    async def _reply(self, link: AgentSide, d: Dispatch, mem_gb: float | None,
                     image: str | None = None) -> None:
        try:
            outcome = await self.run(d, mem_gb, image)
        except Exception as e:  # noqa: BLE001 - e.g. the workdir cannot be made: answer it
            outcome = Outcome(d.action.id, "failed", None, error=f"agent: {type(e).__name__}: {e}",
                              extra={"node": self.name})
        if link.transport is None:
            return  # the driver is gone (it declares this node lost and kills us)
        try:
            link.send(("done", outcome))
        except Exception as e:  # noqa: BLE001 - e.g. an output that cannot be pickled
            link.send(("done", Outcome(d.action.id, "failed", None,
                                       error=f"agent: cannot send the outcome: {e}",
                                       extra=dict(outcome.extra))))

    async def run(self, d: Dispatch, mem_gb: float | None, image: str | None = None) -> Outcome:
        """Run one dispatch to its end; its environment is created at its first action
        here (of ``image``, pulled first if this node lacks it), unless its open made it."""
        extra = {"node": self.name, "ray_node_id": self.info_.ray_node_id,
                 "hostname": self.info_.hostname}
        if d.lease.gpus:
            return Outcome(d.action.id, "failed", None, extra=extra,
                           error="the Ray agents run CPU actions only: GPU actions need the GPU "
                                 "worker backend, which they do not wrap yet")
        trajectory = d.action.trajectory
        try:
            await self._ensure_open(trajectory, mem_gb, image)
        except (PullFailed, ValueError) as e:  # (its next action here tries again)
            return Outcome(d.action.id, "failed", None, error=str(e),
                           extra={**extra, "reason": IMAGE_FAILED})
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Outcome] = loop.create_future()

        def on_done(outcome: Outcome) -> None:  # process: loop thread; docker: a worker
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(outcome))

        try:
            self.backend.start(d, on_done)
        except Exception as e:  # noqa: BLE001 - never leave an action unanswered
            return Outcome(d.action.id, "failed", None, error=f"{self.info_.backend}: {e}",
                           extra=extra)
        outcome = await done
        return replace(outcome, extra={**outcome.extra, **extra})

    async def _ensure_open(self, trajectory: str, mem_gb: float | None,
                           image: str | None) -> None:
        """``trajectory``'s environment here, made now at its first action (of ``image``,
        pulled first if need be). An action sent while another of it pulls waits for that
        one's open: it must not make a sandbox of the default image meanwhile."""
        opening = self._opening.get(trajectory)
        if opening is not None:
            await opening.wait()
        if trajectory in self._opened:
            return
        if opening is not None:  # that open failed: it is not open here
            raise ValueError(f"image: the sandbox's image could not be had on node {self.name} "
                             "(see its first action)")
        if image is None:
            self.backend.open_trajectory(trajectory, mem_gb)
            self._opened.add(trajectory)
        else:
            await self._open_image_here(trajectory, mem_gb, image)

    # -- images (the docker backend's pulls and cache: executor/backends/docker/cache.py) --
    async def open_image(self, trajectory: str, mem_gb: float | None,
                         image: str) -> tuple[bool, Any]:
        """Open ``trajectory``'s sandbox of ``image`` here, pulled first if this node lacks
        it (the driver's open, where the core placed it): (True, (its size in GB, how it
        came)), or (False, the PullFailed, ValueError or OSError) with nothing left here.
        Errors are answered, not raised, so the driver gets them as they are, not wrapped
        by Ray."""
        try:
            return True, await self._open_image_here(trajectory, mem_gb, image)
        except (PullFailed, ValueError) as e:
            return False, e
        except Exception as e:  # noqa: BLE001 - e.g. the engine: said as this node's
            return False, OSError(f"node {self.name}: {type(e).__name__}: {e}")

    async def _open_image_here(self, trajectory: str, mem_gb: float | None,
                               image: str) -> tuple[float | None, PullDone]:
        backend = self.backend
        if not isinstance(backend, ImageFetching):
            raise ValueError(f"image: node {self.name} runs the {self.info_.backend} backend, "
                             "which runs no images")
        self._opening[trajectory] = opened = asyncio.Event()
        try:
            try:  # the pull waits off the loop: other actions go on meanwhile
                done = await asyncio.wrap_future(backend.want_image(trajectory, image))
                size = await asyncio.to_thread(backend.open_trajectory_image, trajectory,
                                               mem_gb, image)
            except BaseException as e:
                backend.unwant_image(trajectory)
                if isinstance(e, PullFailed):
                    raise PullFailed(e.image, e.reason, self.name) from None
                raise
            self._opened.add(trajectory)
        finally:
            del self._opening[trajectory]
            opened.set()
        if trajectory in self._dropped:  # closed by the driver while it opened
            self._dropped.discard(trajectory)
            self._close(trajectory)
        return size, done

    def _pull_ahead(self, image: str, trajectory: str = "", mem_gb: float | None = None) -> None:
        """The core's pull ahead of the trajectories it placed or expects here
        (idempotent); ``trajectory``, ``mem_gb``: the one it expects here, not opened here
        yet (its memory limit: the docker backend keeps a warm sandbox of its image for it,
        until it opens here or is closed here)."""
        if trajectory and isinstance(self.backend, ImageFetching):
            # on the loop, in the order of the driver's messages: a close sent after it
            # finds it
            self.backend.expect_image(trajectory, image, mem_gb)
        if isinstance(self.backend, Pulling):  # (it asks the engine: off the loop)
            asyncio.get_running_loop().run_in_executor(None, self.backend.pull,
                                                       PullImage(self.name, image))

    async def pull_image(self, image: str, trajectory: str = "",
                         mem_gb: float | None = None) -> None:
        self._pull_ahead(image, trajectory, mem_gb)

    async def image_status(self) -> dict[str, Any] | None:
        """This node's pulls, image cache and counters (None: it runs no images)."""
        if not isinstance(self.backend, ImageFetching):
            return None
        return await asyncio.to_thread(self.backend.image_status)

    async def cancel(self, action_id: str) -> None:
        self.backend.cancel(action_id)

    async def close_trajectory(self, trajectory: str) -> None:
        self._close(trajectory)

    def _close(self, trajectory: str) -> None:
        if trajectory in self._opening:
            self._dropped.add(trajectory)
        if trajectory in self._opened:
            self._opened.discard(trajectory)
            self.backend.close_trajectory(trajectory)
        elif isinstance(self.backend, ImageFetching):  # only expected here (_pull_ahead):
            self.backend.close_trajectory(trajectory)  # its warm sandbox is wanted no more

    async def shutdown(self) -> None:
        """Stop what runs, remove environments, and let the guard go."""
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            if link.transport is not None:
                link.transport.close()
        for trajectory in list(self._opened):
            self._close(trajectory)
        self.backend.shutdown()
        self._guard.close()  # the guard finds nothing left and exits
        shutil.rmtree(self.root, ignore_errors=True)
        if self._closed is not None:
            self._closed.set()
