"""Attack (issue 21 #2): a node agent that dies - SIGKILL, its guard killed first, its
raylet killed - leaves no command running (checked in /proc), the cores it offered are
not offered again before its orphans are dead, ``state_lost`` is told once, and the
agents hold their cores as Ray CPUs, so a second server cannot be handed them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest
from helpers import procs_with, until
from test_ray import shell

from executor.backends.ray.backend import RayBackend
from executor.driver import LiveExecutor
from tangram.core import Tangram


def guard_of(marker: str) -> list[int]:
    return [p for p in procs_with(marker) if p in procs_with("executor.backends.ray.guard")]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("guard", ["alive", "killed first"])
def test_a_killed_agent_leaves_no_orphan(ray_cluster, guard):
    """SIGKILL a node's agent mid-action: its command (and a child that left the group)
    must die; with its guard killed first, the next agent on the node fences them
    before the node is offered again."""
    tag = {"alive": "91.25", "killed first": "92.25"}[guard]

    async def go() -> None:
        backend = RayBackend(ray_cluster, poll_s=0.2)
        ex = LiveExecutor(Tangram(backend.cluster()), backend)
        try:
            ex.open_trajectory("victim", "t", 0.25)
            running = ex.submit(shell("long", "victim", f"sh -c 'setsid sleep {tag}1 & "
                                      f"exec sleep {tag}2'", kind="long"))
            await until(lambda: procs_with(f"{tag}1") and procs_with(f"{tag}2"), 120, "commands")
            node = ex.core.node_of("victim")
            info = backend.agents[node].info
            if guard == "killed first":
                (gpid,) = guard_of(info.marker)
                os.kill(gpid, signal.SIGKILL)
            os.kill(info.pid, signal.SIGKILL)
            rec, out = await asyncio.wait_for(running, 120)
            assert (out.status, out.extra.get("reason")) == ("failed", "node_lost"), out
            assert out.extra["state_lost"]
            # the node (alive) gets a new agent: not before the orphans are dead
            await until(lambda: node in backend.agents and
                        backend.agents[node].info.marker != info.marker, 300, "a new agent")
            assert procs_with(f"{tag}1") == [] and procs_with(f"{tag}2") == [], "orphans"
            assert not alive(info.pid)
            # told once: its failure said so; the next action does not say it again
            rec, out = await ex.run(shell("next", "victim", "true"))
            assert out.status == "ok" and not out.extra.get("state_lost"), out
        finally:
            with contextlib.suppress(ValueError):
                ex.close_trajectory("victim")
            ex.shutdown()

    asyncio.run(go())


def test_a_killed_raylet_takes_its_agent_and_commands_along(ray_cluster):
    """Kill a node's raylet: the agent (a Ray worker that may outlive it for minutes)
    and every command it ran must be gone - checked in /proc."""

    async def go() -> None:
        extra = ray_cluster.add_local_node([0], 1.0)
        backend = RayBackend(ray_cluster, poll_s=0.2)
        ex = LiveExecutor(Tangram(backend.cluster()), backend)
        trajs = [f"r{i}" for i in range(len(backend.agents))]
        try:
            (name,) = [n for n, a in backend.agents.items()
                       if a.info.ray_node_id == extra.node_id]
            info = backend.agents[name].info
            runs = []
            for i, t in enumerate(trajs):  # one long command per node (one core each)
                ex.open_trajectory(t, "t", 0.25)
                runs.append(ex.submit(shell(f"{t}-long", t, f"sleep 93.{i}5", kind="long")))
            await until(lambda: name in {ex.core.node_of(t) for t in trajs}, 120, "binding")
            (victim,) = [t for t in trajs if ex.core.node_of(t) == name]
            tag = f"93.{trajs.index(victim)}5"
            await until(lambda: procs_with(tag), 120, "the command")
            os.kill(extra.all_processes["raylet"][0].process.pid, signal.SIGKILL)
            rec, out = await asyncio.wait_for(runs[trajs.index(victim)], 120)
            assert (out.status, out.extra.get("reason")) == ("failed", "node_lost"), out
            await until(lambda: not alive(info.pid) and not procs_with(tag), 120,
                        "the agent and its command to die")
        finally:
            ex.shutdown()
            with contextlib.suppress(Exception):
                ray_cluster.cluster.remove_node(extra, allow_graceful=False)

    asyncio.run(go())


def test_a_second_server_is_not_handed_the_same_cores(ray_cluster):
    """The agents hold their cores as Ray CPUs: a second backend on the same cluster
    finds no node to start an agent on (before: two servers granted the same cores)."""
    import ray

    first = RayBackend(ray_cluster, poll_s=0.2)
    try:
        cpus = sum(len(a.info.cpus) for a in first.agents.values())
        assert ray.available_resources().get("CPU", 0) <= \
            ray.cluster_resources().get("CPU", 0) - cpus + 1e-6
        with pytest.raises(RuntimeError, match="no Ray node could start"):
            RayBackend(ray_cluster, poll_s=0.2, start_timeout_s=5)
    finally:
        first.shutdown()


def test_an_agent_listener_runs_nothing_for_a_peer_without_its_secret(ray_cluster):
    """Dispatches travel over each agent's own TCP listener (executor/backends/ray/channel.py): a
    peer that does not hold the agent's secret - a wrong answer to its challenge, or a
    dispatch sent without answering - is cut off and nothing it sent runs; the listener
    is on the node's address only; the driver's own connection is not disturbed."""
    import os
    import socket

    from executor.backends.ray.channel import DIGEST_BYTES, NONCE_BYTES, encode, proof
    from tangram.model import Dispatch, Lease

    async def forge(host: str, port: int, answer: bytes, node: str, cpu: int) -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        nonce = await reader.readexactly(NONCE_BYTES)
        action = shell("forged", "forged", "sleep 94.25")
        run = encode(("run", Dispatch(action, Lease("forged", 1, node=node, cores=(cpu,)),
                                      0.0, 0.0, None), None))
        writer.write(answer + run)
        await writer.drain()
        try:  # what comes back before the agent hangs up: no message, at most its proof
            rest = await asyncio.wait_for(reader.read(), 30)
        except ConnectionResetError:
            rest = b""
        writer.close()
        assert len(nonce + rest) <= NONCE_BYTES + DIGEST_BYTES, rest
        return rest

    async def go() -> None:
        backend = RayBackend(ray_cluster, poll_s=0.2)
        ex = LiveExecutor(Tangram(backend.cluster()), backend)
        try:
            ex.open_trajectory("ok", "t", 0.25)
            rec, out = await ex.run(shell("ok-0", "ok", "true"))
            assert out.status == "ok", out
            agent = backend.agents[rec.node]
            cpu = agent.info.cpus[0]
            assert agent.host != "0.0.0.0"
            mine = os.urandom(NONCE_BYTES)
            for answer in (mine + proof(b"x" * 32, b"driver", mine), b""):
                await forge(agent.host, agent.port, answer, rec.node, cpu)
            if agent.host != "127.0.0.1":  # bound to the node's address, not every one
                with pytest.raises(OSError):
                    socket.create_connection(("127.0.0.1", agent.port), timeout=5).close()
            # the agent still serves the driver, and it never ran the forged command
            rec2, out = await ex.run(shell("ok-1", "ok", "true"))
            assert (rec2.node, out.status) == (rec.node, "ok"), out
            assert procs_with("94.25") == []
            assert rec.node in backend.agents
        finally:
            with contextlib.suppress(ValueError):
                ex.close_trajectory("ok")
            ex.shutdown()

    asyncio.run(go())


def test_the_driver_reads_nothing_from_a_listener_without_the_secret():
    """The challenge is mutual: a listener posing as an agent (it got the port, not the
    secret) is hung up on, and the outcome it sends is never taken as one."""
    import os

    from executor.backends.ray.channel import DIGEST_BYTES, NONCE_BYTES, DriverSide, encode, proof
    from tangram.model import Outcome

    async def go() -> None:
        got: list = []
        heard: list[bytes] = []
        lost: asyncio.Queue[str] = asyncio.Queue()

        async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            mine = os.urandom(NONCE_BYTES)
            writer.write(mine)
            theirs = await reader.readexactly(NONCE_BYTES)
            writer.write(proof(b"y" * 32, b"agent", theirs) +
                         encode(("done", Outcome("forged", "ok"))))
            await writer.drain()
            heard.append(await reader.read())

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        link = DriverSide(os.urandom(32), got.append, lost.put_nowait)
        link.send(("run", "not for an impostor", None))
        await asyncio.get_running_loop().create_connection(lambda: link, "127.0.0.1", port)
        why = await asyncio.wait_for(lost.get(), 30)
        assert got == [] and "secret" in why, why
        await until(lambda: heard, 30, "the impostor to be hung up on")
        assert len(heard[0]) == DIGEST_BYTES, heard  # its answer only: not the dispatch
        server.close()

    asyncio.run(go())
