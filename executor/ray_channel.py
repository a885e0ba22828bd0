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
every dispatch when Ray is used alone). The proof is a mutual challenge-response:
each side sends a fresh nonce and answers the other's with
HMAC-SHA256(secret, role:nonce), so the secret itself never crosses this
connection and the driver, too, reads nothing from a listener that is not its
agent's. A peer that does not answer right within :data:`AUTH_TIMEOUT_S` is cut
off. Nothing is unpickled before that; after it, messages are pickled tuples (what
Ray itself pickles for an actor call), each behind a 4-byte length. The traffic
is not encrypted (neither is Ray's, by default).

Messages, driver to agent: ``("run", dispatch, mem_gb)``, ``("cancel", action_id)``,
``("close", trajectory)``; agent to driver: ``("done", outcome)``. One connection
keeps them in order, so a trajectory's close never overtakes its last action.

Standard library only: the agent side must not import Ray (executor/ray_agent.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import pickle
import struct
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

HEADER = struct.Struct("!I")
NONCE_BYTES = 32
SECRET_BYTES = 32
DIGEST_BYTES = hashlib.sha256().digest_size
AUTH_TIMEOUT_S = 10.0


def encode(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def proof(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    """What ``role`` answers to a peer's ``nonce``: the role in it, so that one side's
    answer is never the other's (a peer cannot reflect a challenge back)."""
    return hmac.new(secret, role + b":" + nonce, hashlib.sha256).digest()


class Framed(asyncio.Protocol):
    """Length-prefixed messages over a transport, after a mutual challenge: each side
    sends a nonce on connecting and answers the other's with :func:`proof`; a side
    reads no message before the other's answer checked out, and hangs up otherwise."""

    role = b""
    peer = b""

    def __init__(self, secret: bytes) -> None:
        self.transport: asyncio.Transport | None = None
        self._secret = secret
        self._nonce = os.urandom(NONCE_BYTES)
        self._peer_nonce: bytes | None = None
        self._buf = bytearray()
        self._ready = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self._nonce)

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # nothing more is read from a refused peer
        buf = self._buf
        buf += data
        if not self._ready:
            if self._peer_nonce is None:
                if len(buf) < NONCE_BYTES:
                    return
                self._peer_nonce = bytes(buf[:NONCE_BYTES])
                del buf[:NONCE_BYTES]
                self.transport.write(proof(self._secret, self.role, self._peer_nonce))
            if len(buf) < DIGEST_BYTES:
                return
            answer = bytes(buf[:DIGEST_BYTES])
            del buf[:DIGEST_BYTES]
            if not hmac.compare_digest(answer, proof(self._secret, self.peer, self._nonce)):
                buf.clear()
                self.transport.abort()  # it does not hold the secret: nothing it sent is read
                return
            self._ready = True
            self.authenticated()
        at = 0
        while len(buf) - at >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, at)
            end = at + HEADER.size + size
            if len(buf) < end:
                break
            message = pickle.loads(memoryview(buf)[at + HEADER.size:end])
            at = end
            try:
                self.received(message)
            except Exception:  # one failed handler must not drop the link (and the node)
                log.exception("ray channel: handling %r", message[0] if message else message)
            if self.transport is None or self.transport.is_closing():
                break
        del buf[:at]

    def authenticated(self) -> None:
        pass

    def received(self, message: Any) -> None:
        raise NotImplementedError

    def send(self, message: tuple) -> None:
        assert self.transport is not None
        self.transport.write(encode(message))


class AgentSide(Framed):
    """The agent's end of one connection: once the peer proved it holds the secret,
    hands its messages to ``serve(self, message)``; while so and open, it is in
    ``links``."""

    role, peer = b"agent", b"driver"

    def __init__(self, secret: bytes, serve: Callable[[AgentSide, Any], None],
                 links: set[AgentSide]) -> None:
        super().__init__(secret)
        self._serve = serve
        self._links = links
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._deadline = asyncio.get_running_loop().call_later(AUTH_TIMEOUT_S, transport.abort)

    def authenticated(self) -> None:
        assert self._deadline is not None
        self._deadline.cancel()
        self._links.add(self)

    def received(self, message: Any) -> None:
        self._serve(self, message)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._links.discard(self)
        self.transport = None


class DriverSide(Framed):
    """The driver's end of one agent's connection: once the agent proved it holds the
    secret, reports each message and, once, the connection's loss. Messages sent
    before are held until then."""

    role, peer = b"driver", b"agent"

    def __init__(self, secret: bytes, on_message: Callable[[Any], None],
                 on_lost: Callable[[str], None]) -> None:
        super().__init__(secret)
        self._on_message = on_message
        self._on_lost = on_lost
        self._pending: list[bytes] = []

    def authenticated(self) -> None:
        assert self.transport is not None
        self.transport.write(b"".join(self._pending))
        self._pending.clear()

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
        why = exc or ("closed by the agent" if self._ready else
                      "the agent did not prove it holds the secret")
        self._on_lost(f"its connection dropped ({why})")
