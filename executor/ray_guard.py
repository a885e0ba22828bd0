"""Kills what a dead node agent left running: ``python ray_guard.py MARKER [OWNER]``.

A node agent (executor/ray_agent.py) starts one guard beside it, in its own
session, holding the read end of a pipe whose write end only the agent holds.
When the agent process ends for any reason (``ray.kill``, its raylet dying,
SIGKILL) the pipe reaches end-of-file and the guard kills every process whose
environment carries ``TANGRAM_AGENT=MARKER`` (all the agent's commands and
their children: the variable is inherited) and, with the docker backend,
removes the containers labelled with the agent's ``OWNER``. Without it, the
commands of an agent whose node was declared lost would run on as orphans.

Standard library only at start-up, so a guard costs ~10 MB and ~30 ms once
per agent, nothing per action.
"""

from __future__ import annotations

import os
import signal
import sys

from executor import marks

MARKER_ENV = "TANGRAM_AGENT"


def kill_marked(marker: str) -> int:
    """SIGKILL every process carrying the agent's marker (markers are unique per agent)."""
    return marks.kill_marked(MARKER_ENV, marker)


def remove_containers(owner: str) -> None:
    try:
        import docker

        from executor.docker_backend import OWNER

        client = docker.from_env()
        for c in client.containers.list(all=True, sparse=True,
                                        filters={"label": f"{OWNER}={owner}"}):
            try:
                client.api.remove_container(c.id, force=True)
            except docker.errors.APIError:
                pass
    except Exception:  # noqa: BLE001 - best effort: the engine may be gone with the node
        pass


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: ray_guard.py MARKER [DOCKER_OWNER]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only end-of-file ends the watch
    while sys.stdin.buffer.read(1 << 16):  # the agent never writes; EOF = it is gone
        pass
    kill_marked(argv[1])
    if len(argv) > 2:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        remove_containers(argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
