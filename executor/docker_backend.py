"""Docker backend: allocate-on-execution (paper section 5.2).

A container per trajectory, created at its first action with the trajectory's
memory limit, keeps its files between actions. Before each exec the
container's cgroup is updated to exactly the granted cores (``cpuset``) and a
matching CPU quota; after the exec the quota is reclaimed (1% of a core) so an
idle container holds nothing. The container is removed when the trajectory
closes, after an idle TTL if it is abandoned, and on shutdown; every container
carries this executor's label so none can leak past a crash of one action.

No image can be pulled on an offline machine, so the sandbox image is built
locally: ``tangram image build`` imports an empty root filesystem and the
host's system directories are bind-mounted read-only at run time.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import docker
import docker.errors

from executor.commands import CommandError, argv_of, elastic_argv, priority_prefix
from executor.files import MAX_FILE_BYTES, FileError
from executor.local import allowed_cpus
from executor.process import outcome_of
from tangram.model import Dispatch, Outcome

IMAGE = "tangram-sandbox:1"
AGENT = Path(__file__).with_name("sandbox_agent.py")
LABEL = "tangram.executor"
OWNER = "tangram.owner"
HOST_MOUNTS = ("/usr", "/lib", "/lib64", "/bin", "/etc/alternatives")
PERIOD_US = 100_000
IDLE_QUOTA_US = 1_000  # 1% of one core while no action runs
#: where a trajectory's commands run and its files live, inside the container
SANDBOX_WORKDIR = "/work"
#: Go's os.FileMode bits in the engine's archive stat (directory; device, pipe, socket, ...)
GO_MODE_DIR = 1 << 31
GO_MODE_IRREGULAR = (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)


def build_image(client: docker.DockerClient | None = None, tag: str = IMAGE) -> str:
    """Import a minimal root filesystem (directories only) as ``tag``; no registry."""
    client = client or docker.from_env()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, mode in (("tmp", 0o1777), ("work", 0o777), ("proc", 0o555), ("sys", 0o555),
                           ("dev", 0o755), ("etc", 0o755), ("root", 0o700)):
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            info.mode = mode
            tar.addfile(info)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
                           ("etc/group", "root:x:0:\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    resp = client.api.import_image_from_data(buf.getvalue(), repository=tag.split(":")[0],
                                             tag=tag.split(":")[1], changes=["WORKDIR /work"])
    del resp
    return tag


def ensure_image(client: docker.DockerClient, tag: str = IMAGE) -> str:
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        build_image(client, tag)
    return tag


@dataclass(slots=True)
class Sandbox:
    container_id: str
    last_used: float
    #: host path of the in-container agent's socket (None: fall back to docker exec)
    socket: str | None = None
    #: cgroup files written directly when writable (None: the engine's update API)
    cpuset_file: str | None = None
    quota_file: str | None = None
    busy: bool = False
    #: grants so far; a reclaim only applies if no newer grant happened
    grants: int = 0
    #: serialises cgroup updates: a late reclaim must not undo the next action's grant
    lock: threading.Lock = field(default_factory=threading.Lock)


class DockerBackend:
    name = "docker"

    def __init__(self, image: str = IMAGE, cpu_map: list[int] | None = None,
                 idle_ttl_s: float = 600.0, workers: int = 16,
                 client: docker.DockerClient | None = None, owner: str | None = None,
                 agent: bool = True) -> None:
        self.client = client or docker.from_env()
        self.image = ensure_image(self.client, image)
        self.cpu_map = cpu_map or allowed_cpus()
        self.idle_ttl_s = idle_ttl_s
        self.run_id = uuid.uuid4().hex[:12]
        # the agent runs on the host's python3, which the sandbox sees through /usr
        self.agent_python = ("/usr/bin/python3" if agent and os.path.exists("/usr/bin/python3")
                             else None)
        self.agent_root = tempfile.mkdtemp(prefix=f"tangram-agents-{self.run_id}-")
        #: who this executor is across restarts (e.g. its state directory): containers a
        #: crashed predecessor left behind are removed at start
        self.owner = owner or self.run_id
        # sparse: no per-container inspect, which races with containers going away
        for c in self.client.containers.list(all=True, sparse=True,
                                             filters={"label": f"{OWNER}={self.owner}"}):
            self._remove(c.id)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tangram-docker")
        self._lock = threading.Lock()
        self._boxes: dict[str, Sandbox] = {}
        self._mem: dict[str, float] = {}
        self._lost: set[str] = set()  # trajectories whose container died: report at next action
        self._running: dict[str, str] = {}  # action id -> container id
        self._closed = False
        self._reaper = threading.Thread(target=self._reap_loop, daemon=True)
        self._reaper.start()

    # -- Backend protocol ----------------------------------------------------------------
    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        import asyncio

        loop = asyncio.get_running_loop()

        def work() -> None:
            box, grant = None, 0
            try:
                outcome, box = self._run(d)
                grant = box.grants if box is not None else 0
            except Exception as e:  # never leave an action unanswered
                outcome = Outcome(d.action.id, "failed", None, error=f"docker: {e}")
            loop.call_soon_threadsafe(on_done, outcome)
            if box is not None:  # after the answer: reclaiming is off the critical path
                self._reclaim(box, grant)

        self._pool.submit(work)

    def cancel(self, action_id: str) -> None:
        cid = self._running.get(action_id)
        if cid:  # killing the exec'd tree: restart is the only portable way in Docker
            try:
                self.client.api.kill(cid)
            except docker.errors.APIError:
                pass

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None:
        """Remember the memory limit its container gets at its first action."""
        self._mem[trajectory] = mem_gb or 0.0

    def close_trajectory(self, trajectory: str) -> None:
        with self._lock:
            box = self._boxes.pop(trajectory, None)
            self._lost.discard(trajectory)
            self._mem.pop(trajectory, None)
        if box:
            self._remove(box.container_id)

    def shutdown(self) -> None:
        self._closed = True
        with self._lock:
            boxes = list(self._boxes.values())
            self._boxes.clear()
        for box in boxes:
            self._remove(box.container_id)
        self.remove_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.agent_root, ignore_errors=True)

    def remove_all(self) -> int:
        """Remove every container this executor created (by label)."""
        n = 0
        for c in self.client.containers.list(all=True, sparse=True,
                                             filters={"label": f"{LABEL}={self.run_id}"}):
            self._remove(c.id)
            n += 1
        return n

    # -- internals -----------------------------------------------------------------------
    def _create(self, trajectory: str) -> Sandbox:
        mem = self._mem.get(trajectory, 0.0)
        mounts = {p: {"bind": p, "mode": "ro"} for p in HOST_MOUNTS if _exists(p)}
        agent_dir = None
        command = ["sleep", "infinity"]
        if self.agent_python:
            agent_dir = tempfile.mkdtemp(prefix="box-", dir=self.agent_root)
            mounts[agent_dir] = {"bind": "/tangram", "mode": "rw"}
            mounts[str(AGENT.parent)] = {"bind": "/tangram-agent", "mode": "ro"}
            command = [self.agent_python, f"/tangram-agent/{AGENT.name}", "/tangram/agent.sock"]
        c = self.client.containers.create(
            self.image, command, detach=True, init=True, labels={
                LABEL: self.run_id, OWNER: self.owner, "tangram.trajectory": trajectory[:200]},
            volumes=mounts, working_dir="/work", network_mode="none",
            mem_limit=f"{int(mem * 1024)}m" if mem >= 0.01 else None,
            # unthrottled while the agent starts; idle quota once it listens
            cpuset_cpus=",".join(map(str, self.cpu_map)), cpu_period=PERIOD_US,
            cpu_quota=len(self.cpu_map) * PERIOD_US,
            environment={"HOME": "/root", "PATH": "/usr/bin:/bin"})
        try:
            c.start()
        except docker.errors.APIError:
            self._remove(c.id)  # a container that never started must not linger
            raise
        box = Sandbox(c.id, time.monotonic())
        if agent_dir is not None:
            sock = os.path.join(agent_dir, "agent.sock")
            deadline = time.monotonic() + 10
            while not os.path.exists(sock) and time.monotonic() < deadline:
                time.sleep(0.01)
            box.socket = sock if os.path.exists(sock) else None
        box.cpuset_file, box.quota_file = _cgroup_files(self.client, c.id)
        self._set_cpus(box, None, IDLE_QUOTA_US)
        return box

    def _sandbox(self, trajectory: str) -> tuple[Sandbox, bool]:
        """The trajectory's container (created now if it has none); True if state was lost."""
        with self._lock:
            box = self._boxes.get(trajectory)
            lost = trajectory in self._lost
        if box is not None:
            return box, False
        box = self._create(trajectory)
        with self._lock:
            other = self._boxes.get(trajectory)
            if other is None:
                self._boxes[trajectory] = box
                self._lost.discard(trajectory)
        if other is not None:  # created concurrently (a file upload racing the first action)
            self._remove(box.container_id)
            return other, False
        return box, lost

    def _grant(self, box: Sandbox, cores: list[int]) -> float:
        """AOE: the container's cgroup gets exactly ``cores`` right before the exec."""
        t0 = time.time()
        with box.lock:
            box.busy = True
            box.grants += 1
            self._set_cpus(box, cores, len(cores) * PERIOD_US)
        return time.time() - t0

    def _set_cpus(self, box: Sandbox, cores: list[int] | None, quota_us: int) -> None:
        """Write the cgroup files directly (~0.1 ms) where we may; else ask the engine
        (~20 ms). Order matters when growing: cores first, then the quota."""
        if box.cpuset_file and box.quota_file:
            try:
                if cores is not None:
                    with open(box.cpuset_file, "w") as f:
                        f.write(",".join(map(str, cores)))
                with open(box.quota_file, "w") as f:
                    f.write(str(quota_us) if box.quota_file.endswith("cfs_quota_us")
                            else f"{quota_us} {PERIOD_US}")
                return
            except OSError:
                box.cpuset_file = box.quota_file = None  # e.g. the container is gone
        kw = {"cpuset_cpus": ",".join(map(str, cores))} if cores is not None else {}
        self.client.api.update_container(box.container_id, cpu_period=PERIOD_US,
                                         cpu_quota=quota_us, **kw)

    def _run(self, d: Dispatch) -> tuple[Outcome, Sandbox | None]:
        t_start = time.time()
        payload = d.action.payload or {}
        try:
            argv = elastic_argv(argv_of(payload), d.units, d.action.elastic == "cpu")
        except CommandError as e:
            return Outcome(d.action.id, "failed", None, error=str(e)), None
        cores = sorted(self.cpu_map[c] for c in d.lease.cores) or self.cpu_map
        box, lost = self._sandbox(d.action.trajectory)
        try:
            update_s = self._grant(box, cores)
        except docker.errors.APIError:  # it died while idle: a fresh one, state lost
            self._forget(d.action.trajectory, box)
            box, _ = self._sandbox(d.action.trajectory)
            lost = True
            update_s = self._grant(box, cores)
        timeout = float(payload.get("timeout_s") or 0)
        env = {k: str(v) for k, v in (payload.get("env") or {}).items()}
        env["TANGRAM_CORES"] = ",".join(map(str, cores))
        self._running[d.action.id] = box.container_id
        execute = self._agent_exec if box.socket else self._docker_exec
        try:
            code, output, t_exec, t_exited, timed_out = execute(
                box, [*priority_prefix(d.lease.lane), *argv], env, timeout)
        except (docker.errors.APIError, OSError, ValueError) as e:
            if self._alive(box.container_id, settle_s=1.0):
                return Outcome(d.action.id, "failed", None, error=f"exec failed: {e}"), box
            return self._died(d, box, "the trajectory's container died during the action"), None
        finally:
            self._running.pop(d.action.id, None)
        # An agent that answered was alive throughout (a dying one drops the connection);
        # after `docker exec` only the engine can tell, and a signal-killed exec hints at it.
        if not box.socket and not self._alive(
                box.container_id, settle_s=1.0 if code is None or code >= 128 else 0):
            return self._died(d, box, "the trajectory's container died during the action"), None
        extra = {"argv": argv, "cores": cores, "update_s": update_s, "t_spawned": t_exec,
                 "t_exited": t_exited, "state_lost": lost, "container": box.container_id[:12],
                 "via": "agent" if box.socket else "docker exec"}
        return outcome_of(d, code, output or b"", timed_out, timeout, extra,
                          overhead_s=t_exec - t_start), box

    def _agent_exec(self, box: Sandbox, argv: list[str], env: dict[str, str],
                    timeout: float) -> tuple[int | None, bytes, float, float, bool]:
        req = {"argv": argv, "env": env, "cwd": "/work", "timeout_s": timeout or None}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(box.socket)  # type: ignore[arg-type]
            conn.sendall(json.dumps(req).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(1 << 16)
                if not chunk:
                    raise OSError("the sandbox agent closed the connection")
                data += chunk
        ans = json.loads(data)
        return (ans["code"], ans["output"].encode(), ans["t_start"], ans["t_end"],
                ans["timed_out"])

    def _docker_exec(self, box: Sandbox, argv: list[str], env: dict[str, str],
                     timeout: float) -> tuple[int | None, bytes, float, float, bool]:
        full = (["timeout", "-s", "KILL", f"{timeout:g}"] if timeout else []) + argv
        exec_id = self.client.api.exec_create(box.container_id, full, workdir="/work",
                                              environment=env)["Id"]
        t_exec = time.time()
        output = self.client.api.exec_start(exec_id)
        t_exited = time.time()
        code = self.client.api.exec_inspect(exec_id).get("ExitCode")
        timed_out = bool(timeout) and code == 137 and t_exited - t_exec >= timeout * 0.99
        return code, output or b"", t_exec, t_exited, timed_out

    def _forget(self, trajectory: str, box: Sandbox) -> None:
        with self._lock:
            if self._boxes.get(trajectory) is box:
                del self._boxes[trajectory]
            self._lost.add(trajectory)
        self._remove(box.container_id)

    def _died(self, d: Dispatch, box: Sandbox, why: str) -> Outcome:
        self._forget(d.action.trajectory, box)
        return Outcome(d.action.id, "failed", None, error=why + "; it will be recreated, "
                       "without its files, at the trajectory's next action",
                       extra={"state_lost": True})

    def _reclaim(self, box: Sandbox, grant: int) -> None:
        """Take the cores back (1% of one core) unless the next action already has them."""
        with box.lock:
            if box.grants != grant:
                return
            box.busy = False
            box.last_used = time.monotonic()
            try:
                self._set_cpus(box, None, IDLE_QUOTA_US)
            except docker.errors.APIError:
                pass

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

    def _remove(self, cid: str) -> None:
        try:
            self.client.api.remove_container(cid, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError:
            pass

    def _reap_loop(self) -> None:
        """Remove containers of abandoned trajectories after the idle TTL."""
        while not self._closed:
            time.sleep(min(5.0, max(self.idle_ttl_s / 4, 0.2)))
            now = time.monotonic()
            with self._lock:
                stale = [(t, b) for t, b in self._boxes.items()
                         if not b.busy and now - b.last_used > self.idle_ttl_s]
                for t, _ in stale:
                    del self._boxes[t]
            for _, box in stale:
                self._remove(box.container_id)


    # -- files (executor/files_api.py): through the engine's archive API, so a path is
    # resolved inside the container's root filesystem (a symlink cannot reach the host) --
    def put_file(self, trajectory: str, parts: tuple[str, ...], data: bytes) -> None:
        box, _ = self._sandbox(trajectory)  # a file may arrive before the first action
        box.last_used = time.monotonic()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("/".join(parts))
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(data))
        try:
            self.client.api.put_archive(box.container_id, SANDBOX_WORKDIR, buf.getvalue())
        except docker.errors.APIError as e:
            raise FileError(409, f"{'/'.join(parts)}: cannot write it in the sandbox: "
                            f"{e.explanation or e}") from None

    def get_file(self, trajectory: str, parts: tuple[str, ...],
                 limit: int = MAX_FILE_BYTES) -> bytes:
        rel = "/".join(parts)
        with self._lock:
            box = self._boxes.get(trajectory)
        if box is None:  # no container yet (or it was reaped): nothing was written
            raise FileError(404, f"{rel}: no such file")
        box.last_used = time.monotonic()
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


def _exists(path: str) -> bool:
    return os.path.exists(path)
