"""The docker backend's fork: the source container's ``/work`` copied into each copy's
container.

``/work`` is a tmpfs (or a tmpfs-backed volume) on an engine that cannot bound a
container's writable layer - this project's (fuse-overlayfs) - so ``docker commit``,
which snapshots the writable layer only, would not see the sandbox's files at all; and
a commit plus a container per copy costs engine calls the copy does not need. The
server (root) copies the files itself, between the two containers' mount namespaces
(``/proc/<pid>/root/work``), with ``cp -a``: owners, modes and links kept; each copy's
container is taken from the warm pool or created as for a first action.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from tangram.fork import copies_of
from tangram.model import Dispatch, Outcome


def _work(backend: Any, cid: str) -> str:
    pid = backend.client.api.inspect_container(cid)["State"]["Pid"]
    if not pid:
        raise RuntimeError(f"container {cid[:12]} is not running")
    return f"/proc/{pid}/root/work"


def fork_containers(backend: Any, d: Dispatch) -> Outcome:
    """Copy the source's /work into each copy's container (blocking: a worker thread)."""
    t0 = time.perf_counter()
    source = d.action.trajectory
    with backend._lock:
        box = backend._boxes.get(source)
        lost = source in backend._lost
    if box is None and lost:
        return Outcome(d.action.id, "failed", None, error=f"fork: the sandbox of {source!r} "
                       "was lost (its container was removed); nothing to copy")
    if os.geteuid() != 0:
        return Outcome(d.action.id, "failed", None, error="fork: the docker backend copies "
                       "between containers as root; this server is not")
    src = _work(backend, box.container_id) if box is not None else None
    copies = copies_of(d.action)
    for copy in copies:
        dst_box, _ = backend._sandbox(copy)
        if src is None:
            continue  # the source never held a file: its copies start empty too
        done = subprocess.run(["cp", "-a", "--", f"{src}/.", f"{_work(backend, dst_box.container_id)}/"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
        if done.returncode != 0:
            return Outcome(d.action.id, "failed", done.returncode,
                           done.stdout.decode(errors="replace")[-4000:],
                           f"fork: copying /work into {copy!r} failed (cp exit {done.returncode})")
    size = 0
    if src is not None:
        for parent, _, files in os.walk(src):
            for name in files:
                try:
                    size += os.lstat(os.path.join(parent, name)).st_size
                except OSError:
                    pass
    return Outcome(d.action.id, "ok", 0, "", "", 0.0,
                   {"method": "copy" if src is not None else "empty", "copies": list(copies),
                    "bytes": size, "fork_s": time.perf_counter() - t0})
