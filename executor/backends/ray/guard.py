"""Kills what a dead node agent left running.

    python -m executor.backends.ray.guard MARKER [--docker OWNER] [--uids FIRST-LAST]
                                 [--agent PID] [--raylet PID]

A node agent (executor/backends/ray/agent.py) starts one guard beside it, in its own
session, holding the read end of a pipe whose write end only the agent holds.
When the agent process ends for any reason (``ray.kill``, SIGKILL) the pipe
reaches end-of-file; when the node's raylet dies first (the agent, a Ray worker,
may then live on for minutes) the guard kills the agent itself. Either way it
then kills every process the agent's process backend marked
(``TANGRAM_SANDBOX=MARKER.*``: set after the backend's secret scrub, so always
there), every process of the agent's sandbox user ids (as root: a mark a command
cannot drop, executor/backends/process/uids.py) and, with the docker backend, removes the
containers labelled with the agent's ``OWNER``. It holds the agent's block of user
ids (an inherited ``flock``) until it is done, so no new agent hands them out first.

Standard library only at start-up, so a guard costs ~10 MB and ~30 ms once
per agent, nothing per action.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
from pathlib import Path

from executor.backends.process import marks

#: the variable the process backend marks every command with (executor/backends/process/backend.py MARK)
MARKER_ENV = "TANGRAM_SANDBOX"


def kill_marked(marker: str) -> int:
    """SIGKILL every process an agent's backend marked (markers are unique per agent)."""
    return marks.kill_marked(MARKER_ENV, marker + ".")


def fence(marker: str, uids: tuple[int, int] | None = None, docker_owner: str | None = None,
          wait_s: float = 30.0) -> int:
    """Everything a (dead) agent left on this node: killed - and gone, waiting up to
    ``wait_s`` - and its containers removed."""
    killed = kill_marked(marker)
    if uids is not None:
        from executor.backends.process.uids import kill_uids

        killed += kill_uids(*uids)
    killed += wait_gone(marker, uids, wait_s)
    if docker_owner:
        remove_containers(docker_owner)
    return killed


def wait_gone(marker: str, uids: tuple[int, int] | None, wait_s: float) -> int:
    """Kill until the killed processes have ended (up to ``wait_s``): the cores are offered
    again only after them. Kills again what is still there (a fork that raced the first
    scans)."""
    def find() -> list[int]:
        pids = marks.marked_pids(MARKER_ENV, marker + ".")  # an ending one has no environ
        if uids is not None:
            from executor.backends.process.uids import pids_of_uids

            pids += [p for p in pids_of_uids(*uids) if not zombie(p)]
        return pids

    return marks.kill_until_gone(find, rounds=1, wait_s=wait_s)


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True  # gone


def remove_containers(owner: str) -> None:
    try:
        import docker

        from executor.backends.docker.backend import OWNER

        client = docker.from_env()
        for c in client.containers.list(all=True, sparse=True,
                                        filters={"label": f"{OWNER}={owner}"}):
            try:
                client.api.remove_container(c.id, force=True, v=True)  # and its /work volume
            except docker.errors.APIError:
                pass
    except Exception:  # noqa: BLE001 - best effort: the engine may be gone with the node
        pass


def parse_uids(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    return int(first), int(last or first)


def watch(agent: int | None, raylet: int | None) -> None:
    """Return when stdin reaches end-of-file or the raylet exits (then kill the agent)."""
    fds = [sys.stdin.fileno()]
    raylet_fd = None
    if raylet is not None and hasattr(os, "pidfd_open"):
        try:
            raylet_fd = os.pidfd_open(raylet)
            fds.append(raylet_fd)
        except OSError:  # already gone
            raylet_fd = -1
    while raylet_fd != -1:
        ready, _, _ = select.select(fds, [], [])
        if raylet_fd in ready:
            break
        if not os.read(fds[0], 1 << 16):  # the agent never writes; EOF = it is gone
            return
    if agent is not None:  # its raylet is gone: so must the agent be
        try:
            os.kill(agent, signal.SIGKILL)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ray_guard", description=__doc__.splitlines()[0])
    p.add_argument("marker")
    p.add_argument("--docker", metavar="OWNER")
    p.add_argument("--uids", type=parse_uids, metavar="FIRST-LAST")
    p.add_argument("--agent", type=int, metavar="PID")
    p.add_argument("--raylet", type=int, metavar="PID")
    args = p.parse_args(argv[1:])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only end-of-file ends the watch
    watch(args.agent, args.raylet)
    if args.docker:
        sys.path.insert(0, str(Path(os.path.abspath(__file__)).parents[3]))  # the repository
    fence(args.marker, args.uids, args.docker)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
