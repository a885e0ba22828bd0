"""Connection limits uvicorn does not have: a deadline for a request's headers, and a
cap on open connections.

uvicorn times out an idle keep-alive connection, but not one whose request headers
never finish: 1,010 connections that send half a request line held the server's file
descriptors until every action failed "Too many open files". So each connection here
must complete a request's headers within ``header_timeout_s`` of opening (and of its
previous response, after the keep-alive time), or it is closed; and past
``max_connections`` open ones, the oldest connection that has not finished a
request's headers is closed to make room (a client that sends its request at once
is never the one dropped), or, when there is none, the new one.

It wraps uvicorn's HTTP protocol class (``config.http_protocol_class``) and uses its
``cycle`` (the request in progress, set once its headers are parsed), ``connections``
(the server's open ones) and ``transport``.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

#: seconds a client has to send a request's headers
HEADER_TIMEOUT_S = 10.0


def fd_budget(reserve: int = 256) -> int:
    """Raise this process's open-file limit to its hard limit; the connections that
    leaves room for once ``reserve`` descriptors are kept for the server's own work."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return max(16, min(soft - reserve, soft // 2, 10_000))


def guarded(base: type, header_timeout_s: float = HEADER_TIMEOUT_S,
            max_connections: int | None = None) -> type:
    """``base`` (uvicorn's H11Protocol or HttpToolsProtocol) with the two limits."""
    limit = max_connections if max_connections is not None else fd_budget()

    class Guarded(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._opened_at = self.loop.time()
            self._arm(header_timeout_s)
            if len(self.connections) > limit:
                # (an upgraded connection's protocol is not a Guarded one: never idle here)
                idle = [c for c in self.connections if c is not self
                        and isinstance(c, Guarded) and c.cycle is None]
                victim = min(idle, key=lambda c: c._opened_at) if idle else self
                victim._drop()

        def _drop(self) -> None:
            self.transport.abort()  # no reply: writing one could block on a slow reader
            self.connections.discard(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # the next request's headers: after the keep-alive time uvicorn allows
            self._arm(self.timeout_keep_alive + header_timeout_s)

        def _arm(self, delay: float) -> None:
            seen = self.cycle
            loop: asyncio.AbstractEventLoop = self.loop

            def check() -> None:
                if self.cycle is seen and not self.transport.is_closing():
                    self._drop()  # no request headers since: a slow client

            loop.call_later(delay, check)

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded
