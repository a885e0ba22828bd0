"""The docker backend's fork: the source container's ``/work`` copied into each copy's
container, without a path ever resolved on the host.

``/work`` is a tmpfs (or a tmpfs-backed volume) on an engine that cannot bound a
container's writable layer - this project's (fuse-overlayfs) - so ``docker commit``,
which snapshots the writable layer only, would not see the sandbox's files at all; and
a commit plus a container per copy costs engine calls the copy does not need.

How (executor/backends/docker/agent.py, executor/tarcopy.py): the source's agent stops
the sandbox's processes, packs ``/work`` into a tar stream as the sandbox user, inside
the source's container, and lets them go on; the host spools the stream (a root-only
temporary file: bytes, never paths) and each copy's agent extracts it into its own
``/work`` as its sandbox user. Links stay links and mean in the copy what they meant in
the source; the copy's ``/work`` keeps a fresh sandbox's owner and mode. Before, the host
(root) ran ``cp -a`` through ``/proc/<pid>/root/work``, and an absolute link a process of
the sandbox swapped in was resolved on the host: host files landed in the copy.

What a copy gets (``pip install --user`` and a setup's ``/tmp`` files were
silently lost in every copy): ``/work``, and with an agent also ``/tmp``, ``/var/tmp``,
``/dev/shm`` and the commands' ``$HOME`` (where the sandbox user may write it: the
default image's is ``/tmp``), each into the same place (executor/backends/docker/agent.py
``copied_places``). Anything else the source's commands wrote - a file in a world-writable
directory of the image, a change to one of its files - is in the container's writable
layer, which the engine lists (``docker diff``): a fork whose source changed anything there
is refused (:func:`outside`), its message naming the paths, rather than made without them.

A sandbox without an agent (``agent=False``) is copied by the engine's archive API, the
source paused meanwhile: the engine resolves paths inside the container's root. That API
does not see the tmpfs mounts (``/tmp``, ``/var/tmp``): a fork of such a source whose
``/tmp``, ``/var/tmp`` or ``/dev/shm`` holds anything is refused too.

Each copy's container is taken from the warm pool or created as for a first action, in
its source's image (the copies are opened with it, executor/server/fork.py).
"""

from __future__ import annotations

import json
import socket
import struct
import tarfile
import tempfile
import threading
import time
from typing import IO, Any

import docker.errors

from executor.backends.docker.limits import SANDBOX_WORKDIR
from tangram.fork import copies_of
from tangram.model import Dispatch, Outcome

#: the docker exec path's output files (executor/backends/docker/backend.py EXEC_OUTPUT)
EXEC_OUTPUT = "/tmp/.tangram-output"

#: seconds without a byte from an agent before a fork gives up on it
STALL_S = 120.0
#: the spooled stream stays in memory up to this size, then goes to a temporary file
SPOOL_BYTES = 32 << 20
#: where a fork copies besides /work (with an agent; $HOME is added from the container's
#: environment, as the agent does)
PLACES = ("/tmp", "/var/tmp", "/dev/shm")
#: what the engine itself adds to a container's writable layer (its init, its files)
ENGINE_PATHS = ("/sbin/docker-init", "/.dockerenv", "/etc/hosts", "/etc/hostname",
                "/etc/resolv.conf", "/etc/mtab", "/dev", "/proc", "/sys")
#: paths a refusal names at most
NAMED = 8


class ForkFailed(Exception):
    """A copy could not be made; the message says which step and why."""


def fork_containers(backend: Any, d: Dispatch, stop: threading.Event | None = None
                    ) -> Outcome:
    """Copy the source's /work into each copy's container (blocking: a worker thread).
    ``stop``: set by a cancel; checked before each step (the pack, each copy's unpack),
    which is not cut short - the agent resumes the source's processes at the pack's end -
    so a cancel waits for the step under way and the service closes the copies."""
    t0 = time.perf_counter()
    stop = stop or threading.Event()

    def stopped() -> Outcome:
        return Outcome(d.action.id, "cancelled", None, error="fork cancelled")

    source = d.action.trajectory
    with backend._lock:
        box = backend._boxes.get(source)
        lost = source in backend._lost
    if box is None and lost:
        return Outcome(d.action.id, "failed", None, error=f"fork: the sandbox of {source!r} "
                       "was lost (its container was removed); nothing to copy")
    copies = copies_of(d.action)
    targets = []
    for copy in copies:  # (a container each: made, or taken from the warm pool)
        if stop.is_set():
            return stopped()
        targets.append(backend._sandbox(copy)[0])
    if stop.is_set():
        return stopped()
    if box is None:  # the source never held a file: its copies start empty too
        return Outcome(d.action.id, "ok", 0, "", "", 0.0,
                       {"method": "empty", "copies": list(copies), "bytes": 0,
                        "fork_s": time.perf_counter() - t0})
    try:
        left = outside(backend, box)
    except ForkFailed as e:
        return Outcome(d.action.id, "failed", None, error=f"fork: {e}")
    if left:
        shown = ", ".join(left[:NAMED]) + (f" and {len(left) - NAMED} more"
                                           if len(left) > NAMED else "")
        copied = "/work, /tmp, /var/tmp, /dev/shm and $HOME" if box.socket else "/work"
        return Outcome(d.action.id, "failed", None, error=(
            f"fork: refused: the sandbox of {source!r} changed files outside what a copy "
            f"gets ({copied}): {shown}; a copy would silently lack them. Write them under "
            "/work (or $HOME, e.g. `pip install --user`) in setup, or run the setup in "
            "each copy"))
    with tempfile.SpooledTemporaryFile(SPOOL_BYTES) as spool:
        try:
            size = _pack(backend, box, spool)
            for copy, target in zip(copies, targets, strict=True):
                if stop.is_set():
                    return stopped()
                spool.seek(0)
                if box.socket and not target.socket:  # (its /tmp entries would land in /work)
                    raise ForkFailed(f"into {copy!r}: its container has no agent to put "
                                     "/tmp, /var/tmp, /dev/shm and $HOME back in place")
                try:
                    _unpack(backend, target, spool)
                except ForkFailed as e:
                    raise ForkFailed(f"into {copy!r}: {e}") from None
        except ForkFailed as e:
            return Outcome(d.action.id, "failed", None, error=f"fork: copying /work {e}")
    return Outcome(d.action.id, "ok", 0, "", "", 0.0,
                   {"method": "copy", "copies": list(copies), "bytes": size,
                    "fork_s": time.perf_counter() - t0})


def outside(backend: Any, box: Any) -> list[str]:
    """What the source's commands changed that a copy would not get: the writable layer's
    changes (``docker diff``: deleted, or added or changed with no other change below it)
    outside /work, the copied places and $HOME, less what the engine made for the
    container's mounts and itself; without an agent, also what /tmp, /var/tmp and
    /dev/shm hold (tmpfs mounts: in no diff, and not copied)."""
    api = backend.client.api
    try:
        info = api.inspect_container(box.container_id)
        changes = api.diff(box.container_id) or []
    except docker.errors.APIError as e:
        raise ForkFailed(f"the source's changes cannot be listed: {e.explanation or e}") \
            from None
    env = dict(v.partition("=")[::2] for v in (info.get("Config") or {}).get("Env") or [])
    kept = [SANDBOX_WORKDIR, *PLACES, env.get("HOME") or "/tmp"] if box.socket \
        else [SANDBOX_WORKDIR]
    mounts = [m.get("Destination", "") for m in info.get("Mounts") or []]
    mounts += list((info.get("HostConfig") or {}).get("Tmpfs") or {})
    paths = [c.get("Path", "") for c in changes]
    out = []
    for c in changes:
        path, kind = c.get("Path", ""), c.get("Kind")
        if not path or _within(path, kept) or _within(path, ENGINE_PATHS):
            continue
        if kind == 1 and any(_within(m, [path]) for m in mounts):
            continue  # a mount point (or a parent of one) the engine made
        if kind != 2 and any(p != path and _within(p, [path]) for p in paths):
            continue  # a directory with a change below it (that one is judged itself)
        out.append(path)
    if not box.socket:
        out += _tmpfs_files(backend, box)
    return sorted(out)


def _within(path: str, tops: Any) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in tops if t)


def _tmpfs_files(backend: Any, box: Any) -> list[str]:
    """What /tmp, /var/tmp and /dev/shm of an agentless sandbox hold (but the docker exec
    path's own output files), by a shell inside it."""
    script = ('for d in ' + " ".join(PLACES) + '; do for f in "$d"/* "$d"/.[!.]* "$d"/..?*; '
              'do if [ -e "$f" ] || [ -L "$f" ]; then echo "$f"; fi; done; done')
    try:
        res = backend.client.api.exec_create(box.container_id, ["sh", "-c", script],
                                             user="0")
        out = backend.client.api.exec_start(res["Id"]).decode(errors="replace")
        code = backend.client.api.exec_inspect(res["Id"]).get("ExitCode")
    except docker.errors.APIError as e:
        raise ForkFailed(f"the source's /tmp cannot be listed: {e.explanation or e}") \
            from None
    if code != 0:
        raise ForkFailed(f"the source's /tmp cannot be listed (exit {code}): {out[-300:]}")
    return [f for f in out.splitlines() if f and not f.startswith(EXEC_OUTPUT)]


def _pack(backend: Any, box: Any, spool: IO[bytes]) -> int:
    """The source's /work as a tar stream into ``spool``; the bytes of its files."""
    if not box.socket:
        return _archive_get(backend, box, spool)
    backend._file_quota(box, +1)  # a core while it packs, not the idle 1%
    try:
        with _connect(box) as conn:
            conn.sendall(b'{"op": "pack"}\n')
            reader = conn.makefile("rb")
            while True:
                head = reader.read(4)
                if len(head) < 4:
                    raise ForkFailed("out of the source: its agent closed the connection")
                (n,) = struct.unpack(">I", head)
                if not n:
                    break
                chunk = reader.read(n)
                if len(chunk) < n:
                    raise ForkFailed("out of the source: its agent closed the connection")
                spool.write(chunk)
            said = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError) as e:
        raise ForkFailed(f"out of the source: {e}") from None
    finally:
        backend._file_quota(box, -1)
    if "error" in said or "bytes" not in said:
        raise ForkFailed(f"out of the source: {said.get('error', said)}")
    return int(said["bytes"])


def _unpack(backend: Any, box: Any, spool: IO[bytes]) -> None:
    """Extract the spooled stream into ``box``'s /work (as its sandbox user)."""
    if not box.socket:
        _archive_put(backend, box, spool)
        return
    size = spool.seek(0, 2)
    spool.seek(0)
    backend._file_quota(box, +1)
    try:
        with _connect(box) as conn:
            conn.sendall(json.dumps({"op": "unpack", "size": size}).encode() + b"\n")
            try:
                while chunk := spool.read(1 << 20):
                    conn.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass  # it stopped reading: its answer says why
            said = json.loads(conn.makefile("rb").readline() or b'{"error": "no answer"}')
    except (OSError, ValueError) as e:
        raise ForkFailed(str(e)) from None
    finally:
        backend._file_quota(box, -1)
    if "error" in said:
        raise ForkFailed(said["error"])


def _connect(box: Any) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(STALL_S)
    try:
        conn.connect(box.socket)
    except OSError as e:
        conn.close()
        raise ForkFailed(f"the sandbox agent is gone: {e}") from None
    return conn


# -- sandboxes without an agent: the engine's archive API ------------------------------------
def _archive_get(backend: Any, box: Any, spool: IO[bytes]) -> int:
    """The source's /work through the engine (paused meanwhile: a snapshot), its entries
    renamed from ``work/...`` to ``...`` (the directory itself left out)."""

    api = backend.client.api
    size = 0
    try:
        api.pause(box.container_id)
        try:
            stream, _ = api.get_archive(box.container_id, SANDBOX_WORKDIR)
            with tempfile.TemporaryFile() as raw:
                for chunk in stream:
                    raw.write(chunk)
                raw.seek(0)
                with tarfile.open(fileobj=raw, mode="r|") as src, \
                        tarfile.open(fileobj=spool, mode="w|", format=tarfile.PAX_FORMAT) as out:
                    for m in src:
                        _, _, rel = m.name.partition("/")
                        if not rel:
                            continue  # /work itself: the copy keeps its own
                        m.name = rel
                        if m.islnk():
                            m.linkname = m.linkname.partition("/")[2]
                        out.addfile(m, src.extractfile(m) if m.isreg() else None)
                        size += m.size if m.isreg() else 0
        finally:
            api.unpause(box.container_id)
    except docker.errors.APIError as e:
        raise ForkFailed(f"out of the source: {e.explanation or e}") from None
    return size


def _archive_put(backend: Any, box: Any, spool: IO[bytes]) -> None:

    try:
        backend.client.api.put_archive(box.container_id, SANDBOX_WORKDIR, spool)
    except docker.errors.APIError as e:
        raise ForkFailed(str(e.explanation or e)) from None
