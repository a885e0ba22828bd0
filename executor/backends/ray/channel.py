"""The direct connection between the driver and one node agent.

Ray places each agent, watches its node and owns its lifetime
(executor/backends/ray/backend.py), but a Ray actor call per action (remote call, object
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
off - on either side: the driver, too, gives up on a listener that does not answer
in time, rather than holding its dispatches for ever. Nothing is unpickled before
that; after it, messages are pickled tuples (what Ray itself pickles for an actor
call), each behind a 4-byte length and an HMAC-SHA256 tag under a key of this
connection (made from the secret and both nonces) over the sender's role, the
message's number in its direction and its bytes: a frame slipped into the stream
by someone on the path, replayed or reordered, is refused and the connection cut
before it is unpickled (pickle runs code). The traffic is not encrypted (neither is
Ray's, by default).

Messages, driver to agent: ``("run", dispatch, mem_gb)``, ``("cancel", action_id)``,
``("close", trajectory)``; agent to driver: ``("done", outcome)``. One connection
keeps them in order, so a trajectory's close never overtakes its last action.

Standard library only: the agent side must not import Ray (executor/backends/ray/agent.py).
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
from typing import Any, cast

log = logging.getLogger(__name__)

HEADER = struct.Struct("!I")
NONCE_BYTES = 32
SECRET_BYTES = 32
DIGEST_BYTES = hashlib.sha256().digest_size
SEQ = struct.Struct("!Q")
AUTH_TIMEOUT_S = 10.0


def encode(message: tuple) -> bytes:
    """A message's frame without its tag (what a peer without the key could send)."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def tag(key: bytes, role: bytes, seq: int, body: bytes | memoryview) -> bytes:
    """The tag of the ``seq``-th message ``role`` sends on a connection keyed ``key``."""
    mac = hmac.new(key, role + SEQ.pack(seq), hashlib.sha256)
    mac.update(body)
    return mac.digest()


def session_key(secret: bytes, driver_nonce: bytes, agent_nonce: bytes) -> bytes:
    """One connection's key: a frame of another connection never checks out on this one."""
    return hmac.new(secret, b"session:" + driver_nonce + agent_nonce, hashlib.sha256).digest()


def proof(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    """What ``role`` answers to a peer's ``nonce``: the role in it, so that one side's
    answer is never the other's (a peer cannot reflect a challenge back)."""
    return hmac.new(secret, role + b":" + nonce, hashlib.sha256).digest()


class Framed(asyncio.Protocol):
    """Length-prefixed, tagged messages over a transport, after a mutual challenge: each
    side sends a nonce on connecting and answers the other's with :func:`proof`; a side
    reads no message before the other's answer checked out, and hangs up otherwise, or
    when no answer came within :data:`AUTH_TIMEOUT_S`. Messages sent before are held
    until then."""

    role = b""
    peer = b""

    def __init__(self, secret: bytes) -> None:
        self.transport: asyncio.Transport | None = None
        self._secret = secret
        self._nonce = os.urandom(NONCE_BYTES)
        self._peer_nonce: bytes | None = None
        self._key = b""
        self._sent = self._read = 0  # messages numbered in each direction
        self._buf = bytearray()
        self._ready = False
        self._pending: list[bytes] = []
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports have the calls, not the asyncio class: the server runs on it)
        self.transport = cast(asyncio.Transport, transport)
        self._deadline = asyncio.get_running_loop().call_later(AUTH_TIMEOUT_S, transport.abort)
        transport.write(self._nonce)

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # nothing more is read from a refused peer
        buf = self._buf
        buf += data
        if not self._ready and not self._handshake(buf):
            return
        at = 0
        frame = HEADER.size + DIGEST_BYTES
        while len(buf) - at >= frame:
            (size,) = HEADER.unpack_from(buf, at)
            end = at + frame + size
            if len(buf) < end:
                break
            body = memoryview(buf)[at + frame:end]
            if not hmac.compare_digest(bytes(buf[at + HEADER.size:at + frame]),
                                       tag(self._key, self.peer, self._read, body)):
                body.release()
                self._refuse(buf)  # not from the peer that proved itself: never unpickled
                return
            self._read += 1
            message = pickle.loads(body)
            body.release()
            at = end
            try:
                self.received(message)
            except Exception:  # one failed handler must not drop the link (and the node)
                log.exception("ray channel: handling %r", message[0] if message else message)
            if self.transport is None or self.transport.is_closing():
                break
        del buf[:at]

    def _handshake(self, buf: bytearray) -> bool:
        """Go on with the challenge as its bytes come; True once the peer proved itself."""
        assert self.transport is not None
        if self._peer_nonce is None:
            if len(buf) < NONCE_BYTES:
                return False
            self._peer_nonce = bytes(buf[:NONCE_BYTES])
            del buf[:NONCE_BYTES]
            self.transport.write(proof(self._secret, self.role, self._peer_nonce))
        if len(buf) < DIGEST_BYTES:
            return False
        answer = bytes(buf[:DIGEST_BYTES])
        del buf[:DIGEST_BYTES]
        if not hmac.compare_digest(answer, proof(self._secret, self.peer, self._nonce)):
            self._refuse(buf)  # it does not hold the secret: nothing it sent is read
            return False
        self._ready = True
        if self._deadline is not None:
            self._deadline.cancel()
        nonces = ((self._nonce, self._peer_nonce) if self.role == b"driver"
                  else (self._peer_nonce, self._nonce))
        self._key = session_key(self._secret, *nonces)
        for body in self._pending:
            self._write(body)
        self._pending.clear()
        self.authenticated()
        return True

    def _refuse(self, buf: bytearray) -> None:
        assert self.transport is not None
        buf.clear()
        self.transport.abort()

    def authenticated(self) -> None:
        pass

    def received(self, message: Any) -> None:
        raise NotImplementedError

    def send(self, message: tuple) -> None:
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if self._ready:
            self._write(body)
        else:
            self._pending.append(body)

    def _write(self, body: bytes) -> None:
        if self.transport is None:
            return  # lost: its loss was (or is being) reported
        self.transport.write(HEADER.pack(len(body)) + tag(self._key, self.role, self._sent, body)
                             + body)
        self._sent += 1

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self.transport = None


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

    def authenticated(self) -> None:
        self._links.add(self)

    def received(self, message: Any) -> None:
        self._serve(self, message)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._links.discard(self)


class DriverSide(Framed):
    """The driver's end of one agent's connection: once the agent proved it holds the
    secret, reports each message and, once, the connection's loss."""

    role, peer = b"driver", b"agent"

    def __init__(self, secret: bytes, on_message: Callable[[Any], None],
                 on_lost: Callable[[str], None]) -> None:
        super().__init__(secret)
        self._on_message = on_message
        self._on_lost = on_lost

    def received(self, message: Any) -> None:
        self._on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        why = exc or ("closed by the agent" if self._ready else
                      "the agent did not prove it holds the secret in time")
        self._on_lost(f"its connection dropped ({why})")
