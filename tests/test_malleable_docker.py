"""Malleable grants on the docker backend (issue 49): a running action's container gets its
new cores (``DockerBackend.resize``: the cgroup's cpuset and CPU quota) while its command
runs, on real containers. What is asserted is what the kernel says of the command's
process (its allowed CPUs, read from the host's /proc), of the container's cgroup, and what
the command itself printed; every wait is a condition with a generous deadline.

A resize may reach the backend before its action holds its sandbox (the core sends
Resized right after the Dispatch, or while the container is still being made): it is the
action's grant from then on, applied when the action holds its sandbox, also when the
sandbox had to be replaced. Where the cgroup files cannot be written (a server not run as
root) the engine's update API applies a resize, on a pool of two threads: an update that
runs late must not undo a later one, nor land on the next action's grant."""

from __future__ import annotations

import asyncio
import os
import uuid
from concurrent.futures import Future
from pathlib import Path

import docker
import pytest
from helpers import procs_with, until

from executor.backends.docker.backend import PERIOD_US, DockerBackend
from executor.driver import LiveExecutor
from executor.node.local import local_cluster
from tangram.core import Tangram
from tangram.model import Action, Demand, Dispatch, Elasticity, Lease
from tangram.policies import make_policy
from tangram.protocol import Resized

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                reason="needs two cores to move a grant between")

#: a command that runs until ``go`` appears in its working directory, then prints the
#: CPUs it may run on (its last argument, ``$0``, names it among the host's processes)
UNTIL_GO = ("until [ -e {go} ]; do sleep 0.05; done; "
            "grep Cpus_allowed_list /proc/self/status")


def parse_cpus(spec: str) -> set[int]:
    """'0-1,3' -> {0, 1, 3}."""
    out: set[int] = set()
    for part in filter(None, spec.strip().split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def allowed(pid: int) -> set[int] | None:
    """The CPUs process ``pid`` may run on, as the kernel says (None: it ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next(ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list:"))
    return parse_cpus(line.split(":", 1)[1])


def cgroup_of(pid: int) -> tuple[set[int], int]:
    """The cpuset and CPU quota (us per PERIOD_US) of process ``pid``'s cgroup."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    paths = {}
    for ln in lines:
        _, controllers, path = ln.split(":", 2)
        for c in controllers.split(",") if controllers else ["unified"]:
            paths[c] = path
    if "cpuset" in paths:  # cgroup v1
        cpus = Path(f"/sys/fs/cgroup/cpuset{paths['cpuset']}/cpuset.cpus").read_text()
        quota = Path(f"/sys/fs/cgroup/cpu{paths['cpu']}/cpu.cfs_quota_us").read_text()
        return parse_cpus(cpus), int(quota)
    here = Path(f"/sys/fs/cgroup{paths['unified']}")
    return (parse_cpus((here / "cpuset.cpus").read_text()),
            int((here / "cpu.max").read_text().split()[0]))


def dispatch(aid: str, trajectory: str, argv: list[str], cores: tuple[int, ...],
             workers: int = 2) -> Dispatch:
    """A malleable test's start on ``cores`` (indices into the backend's cpu_map)."""
    action = Action(aid, "t", trajectory, "test_run", {"cpu": Demand.range(1, 2)},
                    elastic="cpu", t1_s=30.0, elasticity=Elasticity.amdahl(0.95),
                    payload={"argv": argv, "timeout_s": 600})
    return Dispatch(action, Lease(aid, len(cores), (), "local", cores), 0.0, 0.0, 30.0,
                    workers=workers)


def waiting(aid: str, go: str = "go") -> tuple[list[str], str]:
    """argv of a command that waits for ``go``, and the tag that finds its process."""
    tag = f"malleable-{aid}-{uuid.uuid4().hex}"
    return ["sh", "-c", UNTIL_GO.format(go=go), tag], tag


class Started:
    """An action started on ``backend`` from the loop: its outcome, its process."""

    def __init__(self, backend: DockerBackend, d: Dispatch, tag: str | None) -> None:
        self.outcome: asyncio.Future = asyncio.get_running_loop().create_future()
        self.tag = tag
        backend.start(d, self.outcome.set_result)

    async def pid(self) -> int:
        await until(lambda: procs_with(self.tag), 300, f"the command {self.tag} running",
                    lambda: self.outcome.result() if self.outcome.done() else "not ended")
        return procs_with(self.tag)[0]

    async def done(self):
        return await asyncio.wait_for(self.outcome, 300)


@pytest.fixture
def backend(tmp_path):
    b = DockerBackend(owner=f"malleable-{tmp_path.name}-{uuid.uuid4().hex[:6]}")
    try:
        yield b
    finally:
        b.shutdown()


def cpu(backend: DockerBackend, *indices: int) -> set[int]:
    """The host CPUs of grant ``indices``."""
    return {backend.cpu_map[i] for i in indices}


def test_a_running_command_gets_its_new_cores_when_its_grant_grows_and_shrinks(backend):
    """Started on core 0; grown to 0-1, then shrunk to 1: each time the command's process
    may run on exactly the grant's cores and its container's cgroup has them, with a quota
    of as many cores; at its end it prints the last grant."""

    async def go() -> None:
        backend.open_trajectory("m", 0.25)
        argv, tag = waiting("x")
        run = Started(backend, dispatch("x", "m", argv, (0,)), tag)
        pid = await run.pid()
        assert allowed(pid) == cpu(backend, 0)
        for grant in ((0, 1), (1,)):
            backend.resize(Resized("x", "local", grant))
            want = cpu(backend, *grant)
            await until(lambda want=want: allowed(pid) == want, 120,
                        f"the command on {want}", lambda: allowed(pid))
            assert cgroup_of(pid) == (want, len(grant) * PERIOD_US)
        backend.put_file("m", ("go",), b"")
        out = await run.done()
        assert out.status == "ok", out
        assert parse_cpus(out.output.split(":", 1)[1]) == cpu(backend, 1)
        backend.close_trajectory("m")

    asyncio.run(go())


def test_a_resize_before_the_command_starts_is_its_grant(backend):
    """The core may send Resized right after the Dispatch, before the action holds its
    sandbox: the command starts on the resized cores (and is told them: TANGRAM_CORES)."""

    async def go() -> None:
        backend.open_trajectory("m", 0.25)
        d = dispatch("x", "m", ["sh", "-c", "echo $TANGRAM_CORES; "
                                "grep Cpus_allowed_list /proc/self/status"], (0,))
        backend.resize(Resized("x", "local", (0, 1)))  # (its sandbox not held yet)
        out = await Started(backend, d, None).done()
        assert out.status == "ok", out
        told, status = out.output.splitlines()
        assert parse_cpus(told) == parse_cpus(status.split(":", 1)[1]) == cpu(backend, 0, 1)

    asyncio.run(go())


class ResizedWhileStarting(DockerBackend):
    """Resized arrives once the action's cores were granted and before it holds its
    sandbox (where a start can be overtaken: the thread path's grant, the engine's)."""

    effect: Resized | None = None

    def _grant(self, box, cores, engine=True):
        took = super()._grant(box, cores, engine)
        effect, self.effect = self.effect, None
        if effect is not None:
            self.resize(effect)
        return took


def test_a_resize_while_starting_applies_once_the_action_holds_its_sandbox(tmp_path):
    backend = ResizedWhileStarting(owner=f"malleable-{tmp_path.name}")

    async def go() -> None:
        backend.open_trajectory("m", 0.25)
        argv, tag = waiting("x")
        backend.effect = Resized("x", "local", (0, 1))
        run = Started(backend, dispatch("x", "m", argv, (0,)), tag)
        pid = await run.pid()
        want = cpu(backend, 0, 1)
        await until(lambda: allowed(pid) == want, 120, f"the command on {want}",
                    lambda: allowed(pid))
        assert backend.effect is None  # (the resize did arrive mid-start)
        backend.put_file("m", ("go",), b"")
        out = await run.done()
        assert out.status == "ok" and parse_cpus(out.output.split(":", 1)[1]) == want, out

    try:
        asyncio.run(go())
    finally:
        backend.shutdown()


def test_a_resize_before_the_start_holds_when_the_sandbox_is_replaced(backend):
    """The trajectory's container died while idle; the next action, resized before it
    starts, runs in a fresh container (state lost): on its resized cores, not on the ones
    its dispatch named."""

    async def go() -> None:
        backend.open_trajectory("m", 0.25)
        first = await Started(backend, dispatch("x0", "m", ["true"], (0,), 0), None).done()
        assert first.status == "ok", first
        engine = docker.from_env()
        container = engine.containers.get(first.extra["container"])
        container.kill()
        await until(lambda: engine.containers.get(container.id).status != "running", 120,
                    "the container killed")
        backend.resize(Resized("x1", "local", (0, 1)))
        out = await Started(backend, dispatch(
            "x1", "m", ["grep", "Cpus_allowed_list", "/proc/self/status"], (0,)), None).done()
        assert out.status == "ok" and out.extra["state_lost"], out
        assert parse_cpus(out.output.split(":", 1)[1]) == cpu(backend, 0, 1), out.output

    asyncio.run(go())


# -- through the engine's update API (cgroup files not writable) ----------------------------
class Held:
    """Stands in for the backend's engine-update threads: keeps what is submitted, to run
    in the order a pool of two threads may run it."""

    def __init__(self) -> None:
        self.calls: list = []

    def submit(self, fn, *args):
        self.calls.append((fn, args))
        return Future()

    def shutdown(self, **kw) -> None:
        pass

    async def run(self, order) -> None:
        calls, self.calls = self.calls, []
        for i in order:
            fn, args = calls[i]
            await asyncio.to_thread(fn, *args)


def by_engine(backend: DockerBackend, trajectory: str) -> Held:
    """From now on ``trajectory``'s sandbox is updated through the engine (as where its
    cgroup files are not writable), and the engine updates of resizes wait in the Held
    returned."""
    box = backend._boxes[trajectory]
    box.cpuset_file = box.quota_file = None
    held = backend._killers = Held()
    return held


def test_engine_resizes_run_late_or_out_of_order_leave_the_latest_grant(backend):
    """Shrunk to core 0, then grown to 0-1: the two engine updates run in the opposite
    order (a pool of two threads may): the command ends up on 0-1, its grant now."""

    async def go() -> None:
        backend.open_trajectory("m", 0.25)
        await Started(backend, dispatch("x0", "m", ["true"], (0,), 0), None).done()
        held = by_engine(backend, "m")
        argv, tag = waiting("x")
        run = Started(backend, dispatch("x", "m", argv, (1,)), tag)
        pid = await run.pid()
        await until(lambda: allowed(pid) == cpu(backend, 1), 120, "the command on its grant",
                    lambda: allowed(pid))
        backend.resize(Resized("x", "local", (0,)))
        backend.resize(Resized("x", "local", (0, 1)))
        assert len(held.calls) == 2
        await held.run([1, 0])
        assert allowed(pid) == cpu(backend, 0, 1)
        backend.put_file("m", ("go",), b"")
        out = await run.done()
        assert out.status == "ok" and parse_cpus(out.output.split(":", 1)[1]) == \
            cpu(backend, 0, 1), out

    asyncio.run(go())


def test_an_engine_resize_run_after_its_action_ended_leaves_the_next_grant(backend):
    """A resize's engine update runs only after its action ended and the trajectory's next
    action started on another core: the next action keeps its own grant."""

    async def go() -> None:
        backend.open_trajectory("m", 0.25)
        await Started(backend, dispatch("x0", "m", ["true"], (0,), 0), None).done()
        held = by_engine(backend, "m")
        argv, tag = waiting("x")
        run = Started(backend, dispatch("x", "m", argv, (0,)), tag)
        await run.pid()
        backend.resize(Resized("x", "local", (0, 1)))
        backend.put_file("m", ("go",), b"")
        assert (await run.done()).status == "ok"
        argv, tag = waiting("y", go="go2")
        nxt = Started(backend, dispatch("y", "m", argv, (1,)), tag)
        pid = await nxt.pid()
        await until(lambda: allowed(pid) == cpu(backend, 1), 120, "the next on its grant",
                    lambda: allowed(pid))
        await held.run(range(len(held.calls)))  # x's late update
        assert allowed(pid) == cpu(backend, 1)
        backend.put_file("m", ("go2",), b"")
        out = await nxt.done()
        assert out.status == "ok" and parse_cpus(out.output.split(":", 1)[1]) == \
            cpu(backend, 1), out

    asyncio.run(go())


# -- the whole chain: core, runtime, docker ---------------------------------------------------
def test_a_test_started_on_the_core_left_grows_in_its_container_when_the_other_frees(backend):
    """On this machine's two cores: one trajectory's command holds a core, a profiled test
    starts on the other (the core does not wait for a wider grant) with two workers; once
    the command ends the core resizes the test's grant and the docker backend carries it
    out: the running test sees two CPUs (it waits for that, then says so)."""
    if len(backend.cpu_map) != 2:
        pytest.skip("the scenario fills a node of exactly two cores")

    async def go() -> None:
        ex = LiveExecutor(Tangram(local_cluster(), make_policy("tangram-malleable")), backend)
        ex.open_trajectory("hold", "t", 0.25)
        ex.open_trajectory("grow", "t", 0.25)
        holder = ex.submit(Action("h", "t", "hold", "shell", {"cpu": Demand.fixed(1)},
                                  t1_s=1.0, payload={"command": "until [ -e go ]; do "
                                                     "sleep 0.05; done", "shell": True,
                                                     "timeout_s": 600}))
        tag = f"malleable-grow-{uuid.uuid4().hex}"
        script = ('echo start $(nproc); until [ "$(nproc)" -ge 2 ]; do sleep 0.05; done; '
                  'echo end $(nproc)')
        grower = ex.submit(Action("g", "t", "grow", "test_run", {"cpu": Demand.range(1, 2)},
                                  elastic="cpu", t1_s=30.0, elasticity=Elasticity.amdahl(0.95),
                                  payload={"argv": ["sh", "-c", script, tag],
                                           "timeout_s": 600}))
        await until(lambda: procs_with(tag), 300, "the test running")
        (d,) = [d for d in ex.snapshot().running.values() if d.action.id == "g"]
        assert d.lease.units == 1 and d.workers == 2
        backend.put_file("hold", ("go",), b"")
        (hrec, hout), (grec, gout) = await asyncio.wait_for(asyncio.gather(holder, grower), 300)
        assert hout.status == "ok", hout
        assert gout.status == "ok", gout
        assert gout.output.split() == ["start", "1", "end", "2"], gout.output
        assert grec.resized and grec.units == 1, grec
        assert ex.snapshot(detail=False).counters["grants_resized"] >= 1
        ex.close_trajectory("hold")
        ex.close_trajectory("grow")

    asyncio.run(go())
