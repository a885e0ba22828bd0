"""The driver-agent connection (executor/backends/ray/channel.py) against someone on the path: a
TCP proxy between a real driver end and a real agent end (127.0.0.1) that can slip
frames into the stream, and a listener that never answers. No Ray is needed."""

from __future__ import annotations

import asyncio
import os

import pytest
from helpers import until

from executor.backends.ray import channel as ray_channel
from executor.backends.ray.channel import DIGEST_BYTES, HEADER, NONCE_BYTES, AgentSide, DriverSide, encode

SECRET = os.urandom(32)


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request):
    """Each test on asyncio's loop (the agents, in Ray) and uvloop's (`serve`, the driver)."""
    if request.param == "uvloop":
        import uvloop  # a dependency of the package

        return uvloop.run
    return asyncio.run


class Proxy:
    """Forwards one connection both ways and keeps what the driver sent."""

    def __init__(self, agent_port: int) -> None:
        self.agent_port = agent_port
        self.from_driver = bytearray()
        self.to_agent: asyncio.StreamWriter | None = None
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _pipe(self, dr: asyncio.StreamReader, dw: asyncio.StreamWriter) -> None:
        ar, aw = await asyncio.open_connection("127.0.0.1", self.agent_port)
        self.to_agent = aw

        async def copy(r: asyncio.StreamReader, w: asyncio.StreamWriter, keep: bool) -> None:
            try:
                while data := await r.read(1 << 16):
                    if keep:
                        self.from_driver += data
                    w.write(data)
            finally:  # (a reset too): the other side sees the hang-up
                w.close()

        await asyncio.gather(copy(dr, aw, True), copy(ar, dw, False), return_exceptions=True)

    def inject(self, data: bytes) -> None:
        assert self.to_agent is not None
        self.to_agent.write(data)


async def _pair() -> tuple[list, asyncio.Queue, DriverSide, Proxy, asyncio.Server]:
    served: list = []
    agent = await asyncio.get_running_loop().create_server(
        lambda: AgentSide(SECRET, lambda _link, m: served.append(m), set()), "127.0.0.1", 0)
    proxy = Proxy(agent.sockets[0].getsockname()[1])
    port = await proxy.start()
    lost: asyncio.Queue[str] = asyncio.Queue()
    link = DriverSide(SECRET, lambda m: None, lost.put_nowait)
    await asyncio.get_running_loop().create_connection(lambda: link, "127.0.0.1", port)
    return served, lost, link, proxy, agent


async def _until(cond, what: str) -> None:
    await until(cond, 300, what)


@pytest.mark.parametrize("forgery", ["forged tag", "replayed"])
def test_a_frame_slipped_into_an_authenticated_connection_is_never_run(forgery: str,
                                                                      run) -> None:
    """After the challenge, every frame carries a tag under the connection's key over its
    number: a frame injected on the path (its tag made up: a peer without the key) or
    a genuine frame sent again is refused, the connection cut, and neither is served."""

    async def go() -> None:
        served, lost, link, proxy, agent = await _pair()
        link.send(("cancel", "genuine"))
        await _until(lambda: served, "the genuine message to be served")
        handshake = NONCE_BYTES + DIGEST_BYTES
        genuine = bytes(proxy.from_driver[handshake:])
        assert genuine and b"genuine" in genuine
        if forgery == "forged tag":  # a frame laid out right, its tag made up
            body = encode(("cancel", "forged"))[HEADER.size:]
            proxy.inject(HEADER.pack(len(body)) + os.urandom(DIGEST_BYTES) + body)
        else:
            proxy.inject(genuine)
        why = await asyncio.wait_for(lost.get(), 30)
        assert "dropped" in why, why
        assert served == [("cancel", "genuine")], served
        link.send(("cancel", "after"))  # a lost link sends nothing and raises nothing
        agent.close()
        assert proxy.server is not None
        proxy.server.close()

    run(go())


def test_the_driver_gives_up_on_a_listener_that_never_answers(monkeypatch, run) -> None:
    """A listener that accepts and then says nothing (a wedged agent, a stranger on the
    port) is hung up on after the challenge's time, reported lost, and never sent the
    dispatches held for it."""
    monkeypatch.setattr(ray_channel, "AUTH_TIMEOUT_S", 0.5)

    async def go() -> None:
        heard = bytearray()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(1 << 16):
                heard.extend(data)
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        lost: asyncio.Queue[str] = asyncio.Queue()
        link = DriverSide(SECRET, lambda m: None, lost.put_nowait)
        link.send(("run", "held for the agent", None))
        await asyncio.get_running_loop().create_connection(
            lambda: link, "127.0.0.1", server.sockets[0].getsockname()[1])
        why = await asyncio.wait_for(lost.get(), 60)
        assert "in time" in why, why
        await _until(lambda: len(heard) >= NONCE_BYTES, "the driver's nonce")
        assert len(heard) == NONCE_BYTES and b"held" not in heard  # its nonce only
        server.close()

    run(go())
