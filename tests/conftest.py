"""Shared fixtures: a real `tangram serve` subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from registry import Registry

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(Path(__file__).parent))

TOKEN = "test-token-123"


#: test modules that start a local Ray cluster (the session's ``ray_cluster``, or a
#: ``--ray local:N`` server): `make test` runs the suite on two xdist workers, and these
#: go to one of them (``--dist loadgroup``), so that two Ray clusters never start at once
RAY_MODULES = {"test_ray", "test_gpu_ray", "test_attack_ray", "test_backends", "test_ray_images"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__ in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray"))


def pytest_configure(config: pytest.Config) -> None:
    """As root, commands run as sandbox users, who must reach the servers' work roots;
    pytest resets its shared ``/tmp/pytest-of-root`` to 0700 at every session start (a
    concurrent session would cut the sandboxes off), so root sessions get a base
    directory of their own (the last 3 are kept, as pytest does, and none younger
    than a day: a concurrent session may still use it)."""
    if os.geteuid() != 0 or config.option.basetemp:
        return
    import shutil
    import tempfile

    top = Path(tempfile.gettempdir()) / "tangram-pytest-of-root"
    top.mkdir(mode=0o711, exist_ok=True)
    top.chmod(0o711)
    old = sorted(top.iterdir(), key=lambda p: p.stat().st_mtime)
    for stale in old[:-3]:
        if time.time() - stale.stat().st_mtime > 86_400:
            shutil.rmtree(stale, ignore_errors=True)
    base = Path(tempfile.mkdtemp(dir=top))
    base.chmod(0o711)
    config.option.basetemp = str(base / "t")


@pytest.fixture(scope="session", autouse=True)
def sandbox_users_reach_python() -> None:
    """As root, commands run under sandbox user ids (executor/backends/process/uids.py), which must
    be able to run this Python: a Python below /root (pyenv) is made reachable by
    allowing others to pass through (o+x, not list) the directories on its way."""
    reachable_by_sandboxes(Path(sys.executable))


@pytest.fixture(scope="session", autouse=True)
def sandbox_image() -> None:
    """The docker backend's default image, built once before any test (what a server
    builds when it is missing): on a fresh machine the first docker server would build it
    inside some test, whose waits then depend on that build (issue 46 #5). Without a
    Docker engine nothing is built here: the docker tests fail on their own (and
    `.ci/run` refuses to start)."""
    import docker
    import docker.errors

    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException:
        return
    from executor.backends.docker.backend import ensure_image

    ensure_image(client)


def reachable_by_sandboxes(path: Path) -> None:
    """Let other users pass through (o+x, not list) the directories above ``path``:
    as root, commands run as sandbox users, and pytest's temporary directories are 0700."""
    if os.geteuid() != 0:
        return
    from executor.backends.process.uids import unreachable

    for d in unreachable(path):
        d.chmod(d.stat().st_mode | 0o001)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory that the test and sandbox commands both see and may write (0777).
    Not under /tmp: a process-backend command has a /tmp of its own (a mount namespace,
    issue 47 #6), so a file it writes under pytest's tmp_path would stay in its private
    /tmp. Under the checkout (which the backend keeps visible), removed after the test."""
    import shutil
    import uuid

    top = ROOT / ".test-shared"
    top.mkdir(mode=0o711, exist_ok=True)
    path = top / uuid.uuid4().hex
    path.mkdir()
    path.chmod(0o777)
    reachable_by_sandboxes(path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    state_dir: Path
    backend: str
    proc: subprocess.Popen
    log: Path

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(state_dir: Path, backend: str = "process", quotas: tuple[str, ...] = (),
                 extra_args: tuple[str, ...] = (), max_fds: int | None = None,
                 cgroup: Path | None = None) -> Server:
    """``cgroup``: a memory cgroup (v1) the server runs in, as in a container with a limit."""
    port = free_port()
    log = state_dir / f"server-{port}.log"
    state_dir.mkdir(parents=True, exist_ok=True)
    reachable_by_sandboxes(state_dir / "work")
    args = [sys.executable, str(ROOT / "cli.py"), "serve", "--port", str(port), "--backend",
            backend, "--state-dir", str(state_dir)]
    for q in quotas:
        args += ["--quota", q]
    args += extra_args
    env = {**os.environ, "TANGRAM_TOKEN": TOKEN}
    def prepare() -> None:
        if max_fds:  # a host's usual 1,024, or lower
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (max_fds, max_fds))
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text("0")

    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, preexec_fn=prepare if max_fds or cgroup else None)
    url = f"http://127.0.0.1:{port}"
    # a hang guard: `serve --ray local:3` starts a cluster (> 180 s seen beside stress --cpu 8)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return Server(url, state_dir, backend, proc, log)
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start: {log.read_text()}")


@pytest.fixture(scope="module")
def process_server(tmp_path_factory) -> Iterator[Server]:
    # the tests' fake API providers listen on loopback ports chosen at run time
    server = start_server(tmp_path_factory.mktemp("serve-process"), "process",
                          quotas=("api=concurrency:2",),
                          extra_args=("--allow-url", "api=http://127.0.0.1:"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def docker_server(tmp_path_factory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("serve-docker"), "docker")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster of 3 nodes (executor/backends/ray/cluster.py), started once
    for the whole session (~8 s on 2 cores) and shared by the Ray tests."""
    from executor.backends.ray.cluster import connect

    conn = connect("local:3")
    yield conn
    conn.close()


def sandbox_containers(trajectory: str, owner: str | None = None, all: bool = True) -> list:
    """The docker containers serving ``trajectory``: created for it (its label) or taken
    from the warm pool (whose label names no trajectory: the mark in its agent directory
    does, executor/backends/docker/backend.py ``MARK``). ``owner``: one server's only."""
    import docker
    import docker.errors

    from executor.backends.docker.backend import MARK

    labels = ["tangram.executor"] + ([f"tangram.owner={owner}"] if owner else [])
    out = []
    client = docker.from_env()
    # sparse, then one inspect each: a full listing fails on a container going away
    for s in client.containers.list(all=all, sparse=True, filters={"label": labels}):
        try:
            c = client.containers.get(s.id)
        except docker.errors.NotFound:
            continue
        if c.labels.get("tangram.trajectory") == trajectory:
            out.append(c)
            continue
        for m in c.attrs.get("Mounts", []):
            if m.get("Destination") == "/tangram":
                try:
                    if (Path(m["Source"]) / MARK).read_text() == trajectory:
                        out.append(c)
                except OSError:
                    pass
    return out


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[Registry]:
    """A real registry (Debian's docker-registry) on 127.0.0.1 for one test module (the
    image tests push to it; tests/registry.py)."""
    reg = Registry(tmp_path_factory.mktemp("registry")).start()
    yield reg
    reg.stop()
