"""The Ray backend: one Tangram core for a whole Ray cluster, per-node agents.

The core (one scheduler, all the cluster's nodes as CPU node pools) stays in
this process. Each Ray node runs a :class:`~executor.backends.ray.agent.NodeAgent` actor
pinned to it (``NodeAffinitySchedulingStrategy``, not soft: an agent never
runs anywhere else). A dispatch goes to the agent of ``dispatch.lease.node``
over a direct connection (executor/backends/ray/channel.py: the agent listens on its
node's IP, for this process only, which holds its secret); its outcome comes
back on the same connection and enters the asyncio loop the way local backends'
completions do. A Ray call per action costs ~2 ms of CPU; the connection, a
fraction of that. Ray still places the agents, tells their secrets, watches the
nodes and ends the agents. API calls (no node) are sent from this process by the
HTTP backend, as without Ray.

Membership: the inventory (cores, NUMA, memory, GPUs, read by each agent on
its node) becomes the cluster spec; a monitor polls Ray's node table and
reports a joining node (``joined``) and a leaving one (``lost``) to the
executor, which adds or removes its capacity in the core. A node is lost when
Ray declares it dead, when its agent's connection drops (the fastest sign) or
when Ray reports the agent dead (one open call per agent, ``until_closed``):
its in-flight actions then end ``failed`` (``extra.reason == "node_lost"``),
each exactly once and never retried (actors run with ``max_restarts=0``,
``max_task_retries=0``), and the trajectories whose environment lived there
are told ``state_lost`` at their next action, which binds them elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from executor.backends.docker.limits import SandboxLimits
from executor.backends.docker.pulls import PullDone, PullFailed, merge_node_images
from executor.backends.http.backend import HttpBackend
from executor.backends.ray.agent import IMAGE_FAILED, NodeAgent, NodeInfo
from executor.backends.ray.channel import SECRET_BYTES, DriverSide
from executor.backends.ray.cluster import CPUS_LABEL, MEM_LABEL, RayConnection, parse_cpus, require_ray
from executor.backends.router import route
from tangram.cluster import ClusterSpec, CpuNodeSpec, QuotaSpec
from tangram.model import Dispatch, Outcome
from tangram.protocol import NodeJoined, NodeLost, PullImage, Sink

log = logging.getLogger("tangram.ray")

NODE_LOST = "node_lost"


#: seconds before a node whose agent did not start in time is tried again
RETRY_S = 30.0
#: seconds the driver waits for an agent's listener to accept it (an unreachable node
#: would otherwise hold its dispatches for the kernel's SYN retries, ~2 minutes)
CONNECT_TIMEOUT_S = 30.0
#: seconds between two reads of the nodes' image status (a Ray call per node, ~2 ms of CPU
#: each: the status page and /metrics show it this much behind at most)
IMAGE_STATUS_S = 2.0


def _hang_up_if_dead(link: DriverSide, loop: asyncio.AbstractEventLoop | None) -> None:
    """A link made on a loop that has since ended (the backend used again from another
    ``asyncio.run``): nothing can answer on it any more, so the agent is told to drop it
    (a shut-down socket; a closed loop cannot close its transport)."""
    if loop is None or not loop.is_closed() or link.transport is None:
        return  # a loop still running keeps its link: its actions answer on it
    sock = link.transport.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    link.transport = None


@dataclass
class Agent:
    """The driver's handle on one node agent."""

    info: NodeInfo
    handle: Any  # ray.actor.ActorHandle
    host: str  # where its listener is (its node's IP) ...
    port: int
    secret: bytes = field(repr=False)  # ... and what proves this process may use it
    trajectories: set[str] = field(default_factory=set)  # environments that live there
    #: the connection to it, made on the loop that first needs it
    link: DriverSide | None = None
    loop: asyncio.AbstractEventLoop | None = None


@dataclass
class InFlight:
    dispatch: Dispatch
    on_done: Callable[[Outcome], None]
    agent: Agent
    state_lost: bool


def node_name(hostname: str, ray_node_id: str) -> str:
    """Unique and readable: a node that rejoins gets a new Ray node id, so a new name."""
    return f"{hostname.split('.')[0]}-{ray_node_id[:8]}"


def cluster_of(infos: list[NodeInfo], quotas: tuple[QuotaSpec, ...] = ()) -> ClusterSpec:
    """The core's cluster spec from the agents' inventory."""
    cpu = tuple(s for s in (i.cpu_spec() for i in infos) if s is not None)
    gpu = tuple(s for s in (i.gpu_spec() for i in infos) if s is not None)
    return ClusterSpec(cpu_nodes=cpu, gpu_nodes=gpu, quotas=quotas)


class RayBackend:
    """A LiveBackend over the nodes of a Ray cluster."""

    name = "ray"

    def __init__(self, conn: RayConnection, env_backend: str = "process",
                 poll_s: float = 0.5, start_timeout_s: float = 120.0,
                 owns_connection: bool = False,
                 sandboxes: SandboxLimits = SandboxLimits()) -> None:
        self.ray = require_ray()
        if env_backend not in ("process", "docker"):
            raise ValueError(f"backend: unknown backend {env_backend!r} (process or docker)")
        self.conn = conn
        self.env_backend = env_backend
        self.sandboxes = sandboxes
        self.poll_s = poll_s
        self.owns_connection = owns_connection
        self.http = HttpBackend()
        self.agents: dict[str, Agent] = {}
        self._inflight: dict[str, InFlight] = {}
        self._mem: dict[str, float | None] = {}
        self._home: dict[str, str] = {}  # trajectory -> node its environment lives on
        #: trajectory -> the node the core expects it on while it waits for a node (its
        #: image pulled ahead there, PullImage): that node's agent keeps a warm sandbox for
        #: it until it starts there, or is told it closed or started elsewhere
        self._expected_on: dict[str, str] = {}
        #: trajectory -> the image it names (its sandbox's, on whichever node it opens)
        self._image: dict[str, str] = {}
        #: image -> its size in GB as a node reported it (what the core places the next by)
        self._image_gb: dict[str, float] = {}
        #: node -> its image status (pulls, cache, counters) as its agent last told it:
        #: read by the monitor every IMAGE_STATUS_S, so a status read never waits on nodes
        self._node_images: dict[str, dict[str, Any]] = {}
        self._images_read_at = 0.0
        self._state_lost: set[str] = set()  # trajectories to tell at their next action
        self._refused: set[str] = set()  # Ray node ids whose agent could not start
        #: Ray node ids whose agent did not start in time -> when to try again (monotonic)
        self._retry_at: dict[str, float] = {}
        self._joining: set[str] = set()  # Ray node ids whose agent is starting
        #: Ray node id -> its lost agents: the next agent there fences them first
        self._fence: dict[str, list[NodeInfo]] = {}
        self._on_lost: Callable[[str], None] | None = None
        self._on_joined: Callable[[CpuNodeSpec], None] | None = None
        self._monitor: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._remote = self.ray.remote(NodeAgent)
        # the initial inventory, before the core is built from it
        pending = [(n, self._spawn(n)) for n in self._alive_nodes().values()]
        for node, spawned in pending:
            if spawned is None:
                continue
            handle, name, host, secret, listening = spawned
            try:
                info, port = self.ray.get(listening, timeout=start_timeout_s)
            except Exception as e:  # noqa: BLE001 - one bad node must not stop the rest
                self._refuse(node["NodeID"], handle, e)
                continue
            self.agents[name] = Agent(info, handle, host, port, secret)
        if not self.agents:
            raise RuntimeError("no Ray node could start a Tangram agent (is tangram-rl "
                               "installed on the nodes?)")

    # -- inventory ---------------------------------------------------------------------
    def cluster(self, quotas: tuple[QuotaSpec, ...] = ()) -> ClusterSpec:
        return cluster_of([a.info for a in self.agents.values()], quotas)

    def _alive_nodes(self) -> dict[str, dict]:
        return {n["NodeID"]: n for n in self.ray.nodes() if n.get("Alive")}

    def _spawn(self, node: dict) -> tuple[Any, str, str, bytes, Any] | None:
        """Start the agent of ``node`` and ask it to listen: its handle, name, listening
        address and secret, and the ref of its (info, port) (None: its labels are
        malformed, it is skipped)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nid = node["NodeID"]
        labels = node.get("Labels") or {}
        cpus_label = labels.get(CPUS_LABEL)
        try:
            cpus = None if cpus_label is None else ([] if cpus_label == "none"
                                                     else parse_cpus(cpus_label))
            mem = float(labels[MEM_LABEL]) if MEM_LABEL in labels else None
            if mem is not None and not mem > 0:
                raise ValueError(f"{MEM_LABEL}: must be > 0, got {labels[MEM_LABEL]!r}")
        except ValueError as e:
            self._refuse(nid, None, e)
            return None
        resources = node.get("Resources") or {}
        gpus = int(resources.get("GPU", 0))
        # The agent holds, as Ray CPUs, the cores it grants: a second Tangram server or
        # the trainer's own Ray tasks are then never placed on the same cores.
        ray_cpus = float(resources.get("CPU", 0))
        reserve = min(ray_cpus, len(cpus)) if cpus is not None else ray_cpus
        name = node_name(node.get("NodeManagerHostname") or "node", nid)
        handle = self._remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
            num_cpus=reserve, max_restarts=0, max_task_retries=0, max_concurrency=10_000,
            name=None, lifetime=None,
        ).remote(name, nid, self.env_backend, None, cpus, mem, gpus,
                 tuple(self._fence.get(nid, ())), self.sandboxes)
        # its listener is on the node's own address, and only for whoever holds this
        # secret (this process: Ray hands it over with the call)
        host = node.get("NodeManagerAddress") or "127.0.0.1"
        secret = secrets.token_bytes(SECRET_BYTES)
        return handle, name, host, secret, handle.listen.remote(host, secret)

    def _refuse(self, nid: str, handle: Any, error: BaseException) -> None:
        """Leave a node out, saying why, in the log: until restart for a bad node; for
        an agent that did not start in time, for RETRY_S (a loaded node can be slow to
        start one, e.g. right after its last agent died: refusing it for good lost the
        node for the server's lifetime)."""
        why = (str(error).splitlines() or [type(error).__name__])[0]
        if isinstance(error, TimeoutError) or type(error).__name__ == "GetTimeoutError":
            why = ("it did not start in time: are its CPUs reserved by another Tangram "
                   f"server or by Ray tasks? ({why}); trying again in {RETRY_S:g} s")
            self._retry_at[nid] = time.monotonic() + RETRY_S
        else:
            self._refused.add(nid)
        log.warning("no Tangram agent on Ray node %s: %s", nid[:8], why)
        if handle is None:
            return
        try:
            self.ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001
            pass

    # -- membership --------------------------------------------------------------------
    def watch(self, sink: Sink) -> None:
        """Send NodeLost / NodeJoined to ``sink`` (Capabilities.watches_nodes)."""
        self.watch_nodes(lambda node: sink(NodeLost(node)), lambda spec: sink(NodeJoined(spec)))

    def watch_nodes(self, lost: Callable[[str], None],
                    joined: Callable[[CpuNodeSpec], None]) -> None:
        """Report nodes leaving (name) and joining (spec); polls on the running loop."""
        self._on_lost, self._on_joined = lost, joined
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())
        for agent in list(self.agents.values()):  # a dead agent is then seen at once
            self._connect(agent)

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.poll_s)
            try:
                alive = await asyncio.to_thread(self._alive_nodes)
            except Exception as e:  # noqa: BLE001 - the GCS may be briefly unreachable
                log.warning("cannot read Ray's node table: %s", e)
                continue
            for agent in list(self.agents.values()):
                if agent.info.ray_node_id not in alive:
                    self._node_failed(agent, "Ray declared its node dead")
            if self.runs_images() and time.monotonic() >= self._images_read_at:
                self._images_read_at = time.monotonic() + IMAGE_STATUS_S
                await self._read_node_images()
            known = {a.info.ray_node_id for a in self.agents.values()}
            for nid, node in alive.items():
                if (nid not in known and nid not in self._refused and nid not in self._joining
                        and not self._closed and self._retry_at.get(nid, 0.0) <= time.monotonic()):
                    # apart from this loop: a join may wait up to 120 s for its agent, and
                    # the loop must go on seeing other nodes die meanwhile
                    self._joining.add(nid)
                    task = asyncio.get_running_loop().create_task(self._join(node))
                    self._tasks.add(task)
                    task.add_done_callback(lambda t, nid=nid: (self._tasks.discard(t),
                                                               self._joining.discard(nid)))

    async def _join(self, node: dict) -> None:
        spawned = self._spawn(node)
        if spawned is None:
            return
        handle, name, host, secret, listening = spawned
        try:
            info, port = await asyncio.wait_for(listening, 120)
        except Exception as e:  # noqa: BLE001
            self._refuse(node["NodeID"], handle, e)
            return
        if self._closed:
            self.ray.kill(handle, no_restart=True)
            return
        self._fence.pop(node["NodeID"], None)  # the new agent fenced them
        agent = self.agents[name] = Agent(info, handle, host, port, secret)
        self._connect(agent)
        log.info("node %s joined (%d cores)", name, len(info.cpus))
        spec = info.cpu_spec()
        if spec is not None and self._on_joined is not None:
            self._on_joined(spec)

    def _node_failed(self, agent: Agent, why: str) -> None:
        """Declare ``agent``'s node lost (idempotent): the core drops its capacity
        first (so nothing new is dispatched there), then its in-flight actions end."""
        name = agent.info.name
        if self.agents.get(name) is not agent:
            return
        del self.agents[name]
        log.warning("node %s lost: %s", name, why)
        try:  # an agent that lost only its connection must not keep running
            self.ray.kill(agent.handle, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
        if agent.link is not None and agent.link.transport is not None:
            agent.link.transport.abort()
        # a later agent on the same node (the node itself may be alive) kills what
        # this one left running before its cores are offered again
        self._fence.setdefault(agent.info.ray_node_id, []).append(agent.info)
        told = {f.dispatch.action.trajectory for f in self._inflight.values() if f.agent is agent}
        for trajectory in agent.trajectories:
            self._home.pop(trajectory, None)
            if trajectory not in told:  # told by its failed action: once, not again
                self._state_lost.add(trajectory)
        if self._on_lost is not None and agent.info.cpu_spec() is not None:
            self._on_lost(name)
        for aid, f in list(self._inflight.items()):
            if f.agent is agent:
                del self._inflight[aid]
                self._state_lost.discard(f.dispatch.action.trajectory)
                f.on_done(Outcome(aid, "failed", None, error=f"{NODE_LOST}: node {name} left "
                                  f"the Ray cluster during the action ({why}); not retried",
                                  extra={"reason": NODE_LOST, "node": name, "state_lost": True}))

    # -- Backend protocol --------------------------------------------------------------
    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        node = d.lease.node
        if node is None or route(d, has_gpu=False) == "http":
            self.http.start(d, on_done)  # API calls leave from here, as without Ray
            return
        agent = self.agents.get(node)
        if agent is None:  # only if the core dispatched before hearing of the loss
            on_done(Outcome(d.action.id, "failed", None, error=f"{NODE_LOST}: node {node} is "
                            "not in the Ray cluster", extra={"reason": NODE_LOST, "node": node}))
            return
        trajectory = d.action.trajectory
        first = trajectory not in agent.trajectories
        if first:
            self._leave_home(trajectory, node)
            self._unexpect(trajectory, node)
            agent.trajectories.add(trajectory)
            self._home[trajectory] = node
        slim = replace(d, lease=replace(d.lease, parts=()))  # managers' leases stay here
        aid = d.action.id
        self._inflight[aid] = InFlight(d, on_done, agent, trajectory in self._state_lost)
        try:
            # a first action opens its environment there (of its image: pulled if need be)
            self._connect(agent).send(("run", slim, self._mem.get(trajectory) if first else None,
                                       self._image.get(trajectory) if first else None))
        except Exception as e:  # noqa: BLE001 - e.g. a payload that cannot be pickled
            self._finish(Outcome(aid, "failed", None, error=f"ray agent: cannot send: {e}"))

    def _connect(self, agent: Agent) -> DriverSide:
        """``agent``'s connection on the running loop (made at its first use there)."""
        loop = asyncio.get_running_loop()
        if agent.link is not None:
            if agent.loop is loop:
                return agent.link
            _hang_up_if_dead(agent.link, agent.loop)

        def lost(why: str) -> None:
            if agent.link is link and not self._closed:
                self._node_failed(agent, why)

        link = DriverSide(agent.secret, lambda m: self._finish(m[1]), lost)
        agent.link, agent.loop = link, loop
        task = loop.create_task(self._hold(agent, link))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return link

    async def _hold(self, agent: Agent, link: DriverSide) -> None:
        """Connect ``link``, then wait on Ray's word on the agent: an agent that dies
        is reported by both (its connection drops first), a node by both and the monitor."""
        from ray.exceptions import RayActorError

        try:
            await asyncio.wait_for(asyncio.get_running_loop().create_connection(
                lambda: link, agent.host, agent.port), CONNECT_TIMEOUT_S)
        except OSError as e:  # (a timeout is one)
            if agent.link is link and not self._closed:
                self._node_failed(agent, f"cannot connect to its agent at {agent.host}:"
                                         f"{agent.port} ({e})")
            return
        try:
            await agent.handle.until_closed.remote()
        except RayActorError as e:
            if agent.link is link and not self._closed:
                self._node_failed(agent, f"its agent died: {str(e).splitlines()[0]}")
        except Exception as e:  # noqa: BLE001 - a Ray error other than the agent's death
            log.warning("watching agent %s: %s", agent.info.name, str(e).splitlines()[0])

    def _send(self, agent: Agent, message: tuple) -> None:
        """A message the agent needs no answer to; by Ray when there is no loop to use."""
        try:
            self._connect(agent).send(message)
        except RuntimeError:  # no running loop (e.g. closing after it ended)
            kind, *args = message
            by_ray = {"cancel": agent.handle.cancel, "close": agent.handle.close_trajectory,
                      "pull": agent.handle.pull_image}
            by_ray[kind].remote(*args)

    def _leave_home(self, trajectory: str, node: str) -> None:
        """``trajectory`` starts on ``node``: the sandbox its open made on another node (the
        core placed it there, then bound it elsewhere, e.g. for memory) is closed there."""
        home = self._home.get(trajectory)
        agent = self.agents.get(home) if home is not None and home != node else None
        if agent is not None:
            agent.trajectories.discard(trajectory)
            self._send(agent, ("close", trajectory))

    def _finish(self, outcome: Outcome) -> None:
        """An action's outcome from its agent."""
        f = self._inflight.pop(outcome.action_id, None)
        if f is None:  # already ended as node_lost
            return
        if outcome.extra.get("reason") == IMAGE_FAILED:
            # nothing of it is open there: its next action opens it (pulls) again, rather
            # than run in the default image
            f.agent.trajectories.discard(f.dispatch.action.trajectory)
        if f.state_lost:
            self._state_lost.discard(f.dispatch.action.trajectory)
            outcome = replace(outcome, extra={**outcome.extra, "state_lost": True})
        f.on_done(outcome)

    def cancel(self, action_id: str) -> None:
        f = self._inflight.get(action_id)
        if f is None:
            self.http.cancel(action_id)
        else:
            self._send(f.agent, ("cancel", action_id))

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None:
        # its node is chosen at its first CPU action; the environment is made there
        self._mem[trajectory] = mem_gb

    # -- images (executor/backends/docker/pulls.py NodeImageOpening) --------------------
    def runs_images(self) -> bool:
        return self.env_backend == "docker"

    def open_trajectory_image(self, trajectory: str, mem_gb: float | None,
                              image: str) -> float | None:
        """tangram.protocol.ImageOpening, before the core places it: remembered (its
        sandbox is of ``image`` on whichever node it opens), the image's size as a node last
        reported it (None: never seen), refused where the nodes run no images."""
        if not self.runs_images():
            raise ValueError(f"image: the Ray nodes run the {self.env_backend} backend, which "
                             "runs no images (use --backend docker)")
        self._mem[trajectory] = mem_gb
        self._image[trajectory] = image
        return self._image_gb.get(image)

    async def open_image_on(self, trajectory: str, mem_gb: float | None, image: str,
                            node: str) -> tuple[float | None, PullDone]:
        """Open ``trajectory``'s sandbox of ``image`` on ``node`` (where the core placed
        it), its agent pulling the image first when the node lacks it (joining the pull the
        core ordered ahead, if any). PullFailed naming the node, or ValueError; the caller
        closes it then (close_trajectory: the agent has left nothing)."""
        from ray.exceptions import RayActorError

        agent = self.agents.get(node)
        if agent is None:
            raise PullFailed(image, "the node left the Ray cluster", node)
        agent.trajectories.add(trajectory)  # (a close from now on reaches it)
        self._home[trajectory] = node
        try:
            ok, got = await agent.handle.open_image.remote(trajectory, mem_gb, image)
        except RayActorError as e:
            raise PullFailed(image, f"its agent died ({str(e).splitlines()[0]})", node) from None
        if not ok:
            raise got
        size, done = got
        if size:
            self._image_gb[image] = size
        return size, done

    async def _read_node_images(self) -> None:
        """Every node's image status, from its agent (one that does not answer within the
        poll keeps its last; a lost node's is dropped)."""
        async def read(agent: Agent) -> None:
            with contextlib.suppress(Exception):  # (slow, or its agent died: seen elsewhere)
                status = await asyncio.wait_for(agent.handle.image_status.remote(),
                                                max(self.poll_s, 1.0))
                if status is not None and self.agents.get(agent.info.name) is agent:
                    self._node_images[agent.info.name] = status

        await asyncio.gather(*(read(a) for a in list(self.agents.values())))
        for name in set(self._node_images) - set(self.agents):
            del self._node_images[name]

    def image_status(self) -> dict[str, Any]:
        """NodeImageOpening: every node's pulls, cache and counters, summed (each node's
        under ``nodes``), as the monitor last read them."""
        return merge_node_images(self._node_images)

    def pull(self, effect: PullImage) -> None:
        """tangram.protocol.Pulling: the core's pull ahead, by the agent of its node. For a
        trajectory the core expects there (it waits for a node: placed nowhere yet), that
        agent also keeps a warm sandbox of its image for it (its memory limit's)."""
        agent = self.agents.get(effect.node)
        if agent is None or not self.runs_images():
            return
        t = effect.trajectory
        if t and t in self._image and t not in self._home:
            self._unexpect(t, effect.node)
            self._expected_on[t] = effect.node
            self._send(agent, ("pull", effect.image, t, self._mem.get(t)))
        else:
            self._send(agent, ("pull", effect.image))

    def _unexpect(self, trajectory: str, node: str | None) -> None:
        """``trajectory`` starts on ``node`` (None: it closed): the agent it was expected
        on elsewhere drops the warm sandbox it kept for it."""
        was = self._expected_on.pop(trajectory, None)
        agent = self.agents.get(was) if was is not None and was != node else None
        if agent is not None:
            self._send(agent, ("close", trajectory))

    def close_trajectory(self, trajectory: str) -> None:
        self._unexpect(trajectory, None)
        self._mem.pop(trajectory, None)
        self._image.pop(trajectory, None)
        self._state_lost.discard(trajectory)
        node = self._home.pop(trajectory, None)
        agent = self.agents.get(node) if node else None
        if agent is not None:
            agent.trajectories.discard(trajectory)
            self._send(agent, ("close", trajectory))

    def shutdown(self) -> None:
        """Stop every agent (their commands and environments) and, when this backend
        owns it, the Ray connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            self._monitor.cancel()
        for task in list(self._tasks):
            task.cancel()
        agents = list(self.agents.values())
        self.agents.clear()
        try:
            self.ray.get([a.handle.shutdown.remote() for a in agents], timeout=30)
        except Exception as e:  # noqa: BLE001 - a dead agent's guard has cleaned up
            log.warning("agent shutdown: %s", str(e).splitlines()[0])
        for a in agents:
            try:
                self.ray.kill(a.handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
            if a.link is not None and a.link.transport is not None:
                with contextlib.suppress(Exception):  # its loop may have ended
                    a.link.transport.close()
        self.http.shutdown()
        if self.owns_connection:
            self.conn.close()
