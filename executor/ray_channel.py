"""The direct connection between the driver and one node agent.

Ray places each agent, watches its node and owns its lifetime
(executor/ray_backend.py), but a Ray actor call per action (remote call, object
ref, awaiting the result) costs milliseconds of CPU on each side. Dispatches,
cancellations and completions therefore travel over one TCP connection per
agent instead, many actions multiplexed on it by action id.

Who may connect: the agent listens on its node's IP only (the address Ray knows
the node by), on a port of the kernel's choosing, and runs nothing for a peer
before it has proven it holds the agent's secret - 32 random bytes the driver
made and handed to the agent through Ray (the same channel that already carries
every dispatch when Ray is used alone). The proof is a challenge-response: the
agent sends a fresh nonce, the peer answers HMAC-SHA256(secret, nonce), so the
secret itself never crosses this connection. A peer that does not answer right
within :data:`AUTH_TIMEOUT_S` is cut off. Nothing a peer sends is unpickled
before that; after it, messages are pickled tuples (what Ray itself pickles for
an actor call), each behind a 4-byte length.

Messages, driver to agent: ``("run", dispatch, mem_gb)``, ``("cancel", action_id)``,
``("close", trajectory)``; agent to driver: ``("done", outcome)``. One connection
keeps them in order, so a trajectory's close never overtakes its last action.

Standard library only: the agent side must not import Ray (executor/ray_agent.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import pickle
import struct
from collections.abc import Callable
from typing import Any

HEADER = struct.Struct("!I")
NONCE_BYTES = 32
SECRET_BYTES = 32
DIGEST_BYTES = hashlib.sha256().digest_size
AUTH_TIMEOUT_S = 10.0


def encode(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


class Framed(asyncio.Protocol):
    """Length-prefixed messages over a transport. The first ``preamble`` bytes
    received are the handshake (handed to :meth:`handshake`), not a message."""

    preamble = 0

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._ready = self.preamble == 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        if not self._ready:
            if len(buf) < self.preamble:
                return
            head = bytes(buf[:self.preamble])
            del buf[:self.preamble]
            if not self.handshake(head):
                return
            self._ready = True
        at = 0
        while len(buf) - at >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, at)
            end = at + HEADER.size + size
            if len(buf) < end:
                break
            message = pickle.loads(memoryview(buf)[at + HEADER.size:end])
            at = end
            self.received(message)
            if self.transport is None or self.transport.is_closing():
                break
        del buf[:at]

    def handshake(self, head: bytes) -> bool:
        """Check the preamble; False (having closed the transport) to stop."""
        return True

    def received(self, message: Any) -> None:
        raise NotImplementedError

    def send(self, message: tuple) -> None:
        assert self.transport is not None
        self.transport.write(encode(message))


class AgentSide(Framed):
    """The agent's end of one connection: authenticates the peer, then hands its
    messages to ``serve(self, message)``; while authenticated and open, it is in
    ``links``."""

    preamble = DIGEST_BYTES

    def __init__(self, secret: bytes, serve: Callable[[AgentSide, Any], None],
                 links: set[AgentSide]) -> None:
        super().__init__()
        self._secret = secret
        self._serve = serve
        self._links = links
        self._nonce = b""
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._nonce = os.urandom(NONCE_BYTES)
        self.transport.write(self._nonce)  # type: ignore[union-attr]
        self._deadline = asyncio.get_running_loop().call_later(AUTH_TIMEOUT_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            super().data_received(data)  # nothing more is read from a refused peer

    def handshake(self, head: bytes) -> bool:
        assert self.transport is not None and self._deadline is not None
        self._deadline.cancel()
        if not hmac.compare_digest(head, proof(self._secret, self._nonce)):
            self.transport.abort()  # not the driver: nothing it sent is read
            self._buf.clear()
            return False
        self._links.add(self)
        return True

    def received(self, message: Any) -> None:
        self._serve(self, message)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._links.discard(self)
        self.transport = None


class DriverSide(Framed):
    """The driver's end of one agent's connection: answers the agent's challenge,
    then reports each message and, once, the connection's loss."""

    preamble = NONCE_BYTES

    def __init__(self, secret: bytes, on_message: Callable[[Any], None],
                 on_lost: Callable[[str], None]) -> None:
        super().__init__()
        self._secret = secret
        self._on_message = on_message
        self._on_lost = on_lost
        self._pending: list[bytes] = []  # sent before the challenge was answered

    def handshake(self, head: bytes) -> bool:
        assert self.transport is not None
        self.transport.write(proof(self._secret, head))
        for data in self._pending:
            self.transport.write(data)
        self._pending.clear()
        return True

    def send(self, message: tuple) -> None:
        data = encode(message)
        if self._ready and self.transport is not None:
            self.transport.write(data)
        else:
            self._pending.append(data)

    def received(self, message: Any) -> None:
        self._on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._on_lost(f"its connection dropped ({exc or 'closed by the agent'})")
