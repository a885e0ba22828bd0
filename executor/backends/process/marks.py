"""Processes marked by an environment variable, found and killed through /proc.

A command that leaves its process group (``setsid``, a daemon) escapes a group kill;
its environment still carries the mark the backend set, so scanning /proc finds it.
Same user only (other users' ``environ`` is unreadable), and a process that clears its
environment escapes this too.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable


def pids_where(test: Callable[[str], bool]) -> list[int]:
    """One pass over /proc: the processes (but this one) whose pid ``test`` accepts."""
    me = os.getpid()
    return [int(e.name) for e in os.scandir("/proc")
            if e.name.isdigit() and int(e.name) != me and test(e.name)]


def marked_pids(var: str, value_prefix: str) -> list[int]:
    """Processes whose environment carries ``var=<value_prefix>...``."""
    needles = (f"{var}={value_prefix}".encode(),)
    return pids_where(lambda pid: carries(pid, needles))


def carries(pid: str, needles: tuple[bytes, ...]) -> bool:
    """Whether process ``pid``'s environment has an entry starting with one of ``needles``."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:  # gone, or not ours
        return False
    return any(item.startswith(needles) for item in env.split(b"\0"))


def kill_marked(var: str, value_prefix: str) -> int:
    """SIGKILL every marked process; repeat while a fork races the scan."""
    return kill_until_gone(lambda: marked_pids(var, value_prefix), rounds=5)


def kill_until_gone(find: Callable[[], list[int]], rounds: int, wait_s: float = 0.0) -> int:
    """SIGKILL what ``find`` lists, scan after scan (a fork can race each scan): ``rounds``
    scans, and with ``wait_s`` on until nothing is listed or ``wait_s`` has passed, 20 ms
    apart (a killed process ends only when it is next scheduled: on a loaded machine that
    takes a while). The number of signals delivered."""
    deadline = time.monotonic() + wait_s
    killed = 0
    for n in itertools.count():
        if n >= rounds and time.monotonic() > deadline:
            break
        pids = find()
        if not pids:
            break
        for pid in set(pids):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        if wait_s:
            time.sleep(0.02)
    return killed
