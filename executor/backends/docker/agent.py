"""The agent inside a docker sandbox (stdlib only; run by the host's python3).

It listens on a unix socket in a directory bind-mounted from the host; each
connection carries one JSON request {argv, env, cwd, timeout_s} and gets one
JSON answer {code, output, t_start, t_end, timed_out, oom_kills}. Running
commands this way skips `docker exec` (tens of milliseconds per call in the
engine); the commands still run inside the container's namespaces and cgroup.

The agent is root inside the container (with only the capabilities it needs:
CHOWN, SETUID, SETGID, KILL); every command runs as the unprivileged
``SANDBOX_UID``. So a command can neither signal the agent nor reach its
socket (its directory is 0700 root), and cannot forge another action's result.
The host still enforces every timeout itself: an agent that does not answer
in time gets its container killed.

Cancel and timeout end one action, not the sandbox: ``{"op": "cancel", "mark": M}``
kills the process group of the running command whose request carried
``TANGRAM_ACTION=M`` (a timeout kills its group the same way), and the host then kills
whatever else carries the mark - ``setsid`` children, daemons - from outside
(executor/backends/docker/tree.py: the agent may not read another user's environment).
Other actions' commands, and the files, stay.

Files (``{"op": "put", "parts": [...], "size": N}`` followed by N raw bytes, and
``{"op": "get", "parts": [...], "limit": N}`` answered by a JSON line and the
bytes) are written and read here, inside the container, with executor/files.py's
functions: each path component opened without following a symlink, relative to
its parent's descriptor, so a link the sandbox made cannot lead a write to the
agent's socket or /etc, nor a read out of /work; and by a child process that is
the sandbox user, so it reaches only what the commands can.

Forks (executor/backends/docker/fork.py): ``{"op": "pack"}`` stops every command process
(executor/freeze.py: nothing of the sandbox runs while it is copied) and answers with
``/work`` as a tar stream written by a child that is the sandbox user
(executor/tarcopy.py), in frames (a 4-byte length, the bytes; a 0 length ends them) and
a JSON line (``bytes``, or ``error``); the commands go on after. ``{"op": "unpack",
"size": N}`` followed by N bytes of such a stream extracts it into ``/work``, by a child
that is the sandbox user. So a copy never resolves a path on the host, nor as root.
The stream also holds the other places the sandbox user writes (:func:`copied_places`:
``/tmp``, ``/var/tmp``, ``/dev/shm``, and its ``$HOME`` where it may write there), each
extracted into the same place of the copy.
"""

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

MAX_OUTPUT = 1 << 20
SANDBOX_UID = 65534  # "nobody"
#: the variable of a command's environment that names its action (set by the host)
ACTION_MARK = "TANGRAM_ACTION"
#: running commands by their action's mark (a cancel's target)
RUNNING: dict = {}
RUNNING_LOCK = threading.Lock()
#: variables the host set for the agent itself (its python), never given to commands
AGENT_ONLY = ("PYTHONHOME", "PYTHONNOUSERSITE", "TANGRAM_AGENT_DROP")


def read_tail(fd: int, sink: list, stop: threading.Event) -> None:
    """Read the output pipe until EOF or ``stop``, keeping its last MAX_OUTPUT bytes."""
    buf = bytearray()
    while not stop.is_set():
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        buf += chunk
        if len(buf) > 2 * MAX_OUTPUT:
            del buf[:-MAX_OUTPUT]
    sink.append(bytes(buf[-MAX_OUTPUT:]))


def sandbox_pids() -> list:
    """Every process of the sandbox user (the commands and whatever they started)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == SANDBOX_UID:
                            pids.append(int(name))
                        break
        except (OSError, ValueError):
            pass
    return pids


def descendants(pid: int) -> list:
    """The processes below ``pid`` (by their parent, from /proc/<pid>/stat, which any
    user may read): a child that left the group (``setsid``) and cleared its environment
    is still its parent's."""
    children: dict = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            out.append(child)
            stack.append(child)
    return out


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the command, its process group and every process below it, the tree read
    before each pass (a child killed first would leave its own children to init). What
    left it before (a daemon re-parented away), the host kills by the action's mark."""
    for _ in range(5):
        with RUNNING_LOCK:  # (not once it was reaped: its pid may be another's by then)
            if proc.returncode is not None:  # (a reap between the test and the kill: a
                return  # pid freed for microseconds, not reused in them)
            below = descendants(proc.pid)
            for pid in below:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
        if not below:
            return


def cancel(mark: str) -> bool:
    """Kill the running command of the action marked ``mark``; False if none runs."""
    with RUNNING_LOCK:
        proc = RUNNING.get(mark)
    if proc is None:
        return False
    kill_group(proc)
    return True


def oom_kills() -> int:
    """The container's OOM-kill count (cgroup v2 memory.events or v1 memory.oom_control)."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            continue
    return -1


def demote(pid: int) -> None:
    """First in line for the OOM killer: a command, never the agent."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def exited(proc: subprocess.Popen, timeout: "float | None") -> bool:
    """Wait for the command's exit, at most ``timeout`` seconds; False if it is still running.
    A pidfd becomes readable the moment the process exits: Popen.wait(timeout) polls with
    sleeps doubling from 1 ms to 50 ms, which delayed each result by up to its own run time
    (a command done in 4 ms was seen at 7 ms, one of 1 s up to 50 ms late)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # python < 3.9 or kernel < 5.3: the polling wait
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        ready = poll.poll(None if timeout is None else timeout * 1e3)
    finally:
        os.close(fd)
    if not ready:
        return False
    proc.wait()  # it has exited: reaps it at once
    return True


def run(req: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in AGENT_ONLY}
    env.update(req.get("env") or {})
    env.setdefault("HOME", "/tmp")
    timeout = req.get("timeout_s") or None
    t_start = time.time()
    ooms = oom_kills()
    if req.get("nice"):
        # an exclusive-core action yields to the light lane's: niceness is per thread on
        # Linux, this thread serves this request only, and the child inherits it (raising
        # another user's niceness afterwards would need CAP_SYS_NICE)
        os.nice(int(req["nice"]))
    root = os.getuid() == 0
    user = {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []} if root else {}
    try:
        proc = subprocess.Popen(req["argv"], cwd=req.get("cwd", "/work"), env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, **user)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return {"code": 127, "output": f"cannot start {req['argv'][0]!r}: {e}\n",
                "t_start": t_start, "t_end": time.time(), "timed_out": False, "oom_kills": 0}
    demote(proc.pid)
    mark = env.get(ACTION_MARK)
    if mark:
        with RUNNING_LOCK:
            RUNNING[mark] = proc
    try:
        return finish(req, proc, timeout, t_start, ooms)
    finally:
        if mark:
            with RUNNING_LOCK:
                RUNNING.pop(mark, None)


def finish(req: dict, proc: subprocess.Popen, timeout: "float | None", t_start: float,
           ooms: int) -> dict:
    """Wait for the command (killed at ``timeout``) and read its output: the answer."""
    sink: list = []
    stop = threading.Event()
    reader = threading.Thread(target=read_tail, args=(proc.stdout.fileno(), sink, stop),
                              daemon=True)
    reader.start()
    timed_out = not exited(proc, timeout)
    if timed_out:
        kill_group(proc)  # the whole group; what left it (setsid), the host kills by mark
        proc.wait()
    reader.join(0.5)
    if reader.is_alive():  # a background child still holds the output pipe: stop reading
        stop.set()
        reader.join(1.0)
    proc.stdout.close()
    t_end = time.time()
    after = oom_kills()
    try:  # the host tells a full disk from it
        st = os.statvfs(req.get("cwd", "/work"))
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    return {"code": proc.returncode, "work_free": free,
            "output": (sink[0] if sink else b"").decode(errors="replace"),
            "t_start": t_start, "t_end": t_end, "timed_out": timed_out,
            "oom_kills": max(after - ooms, 0) if ooms >= 0 else 0}


class Body:
    """The ``size`` raw bytes that follow a request line on ``conn``, as a file object."""

    def __init__(self, conn: socket.socket, head: bytes, size: int) -> None:
        self.conn, self.head, self.left = conn, head[:size], size - len(head[:size])

    def read(self, n: int) -> bytes:
        if self.head:
            out, self.head = self.head[:n], self.head[n:]
            return out
        if self.left <= 0:
            return b""
        chunk = self.conn.recv(min(n, self.left, 1 << 20))
        if not chunk:
            raise OSError("the upload was cut short")
        self.left -= len(chunk)
        return chunk


def executor_module(name: str):
    """executor/<name>.py (stdlib only), imported once by the agent (executor/ is mounted
    whole; it sits two levels up from this file). Imported in each file operation's child
    it was compiled and run again every time (the sandbox user cannot write its bytecode):
    ~25 ms of a 30 ms operation."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if here not in sys.path:
        sys.path.insert(0, here)
    import importlib

    return importlib.import_module(name)


def files_module():
    """executor/files.py (see executor_module)."""
    return executor_module("files")


def copied_places(workdir: str) -> tuple:
    """Where else than ``workdir`` a fork copies (in a child that is the sandbox user):
    the places any user may write, and the commands' ``$HOME`` (run's default) where the
    sandbox user may write it (``pip install --user``); none inside another."""
    home = os.environ.get("HOME") or "/tmp"
    candidates = ["/tmp", "/var/tmp", "/dev/shm"]
    if home != "/" and os.access(home, os.W_OK):
        candidates.append(home)
    return executor_module("tarcopy").places_beside(workdir, candidates)


def drop_to_sandbox_user() -> None:
    """In a child: become the sandbox user (no groups), when the agent is root."""
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(SANDBOX_UID)
        os.setuid(SANDBOX_UID)


class Freezes:
    """The commands stopped while ``/work`` is packed, once for all packs in flight (a
    group's copies are made at once): stopped by the first, continued by the last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.packs = 0
        self.frozen = None

    def enter(self) -> None:
        with self.lock:
            if not self.packs:
                self.frozen = executor_module("freeze").freeze(sandbox_pids)
            self.packs += 1

    def leave(self) -> None:
        with self.lock:
            self.packs -= 1
            if not self.packs and self.frozen is not None:
                self.frozen.thaw()
                self.frozen = None


FREEZES = Freezes()


def pack_op(conn: socket.socket, workdir: str) -> None:
    """``/work`` as a framed tar stream (see the module's docstring), the commands stopped
    meanwhile; the tar is written by a child that is the sandbox user."""
    tarcopy = executor_module("tarcopy")
    try:
        FREEZES.enter()
    except OSError as e:
        conn.sendall(struct.pack(">I", 0) + json.dumps({"error": str(e)}).encode() + b"\n")
        return
    try:
        data_r, data_w = os.pipe()
        note_r, note_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the sandbox user, writing the tar into the pipe
            code = 1
            try:
                os.close(data_r)
                os.close(note_r)
                drop_to_sandbox_user()
                os.chdir(workdir)
                with os.fdopen(data_w, "wb") as out:
                    size = tarcopy.pack(out, places=copied_places(workdir))
                os.write(note_w, json.dumps({"bytes": size}).encode())
                code = 0
            except BaseException as e:  # noqa: BLE001 - said to the host, whatever it is
                os.write(note_w, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            finally:
                os._exit(code)
        os.close(data_w)
        os.close(note_w)
        try:
            with os.fdopen(data_r, "rb") as data:
                while chunk := data.read(1 << 20):
                    conn.sendall(struct.pack(">I", len(chunk)) + chunk)
        finally:
            os.waitpid(pid, 0)
            with os.fdopen(note_r, "rb") as note:
                said = note.read() or b'{"error": "the packer ended without a word"}'
        conn.sendall(struct.pack(">I", 0) + said + b"\n")
    finally:
        FREEZES.leave()


def unpack_op(conn: socket.socket, req: dict, rest: bytes, workdir: str) -> None:
    """Extract the tar stream that follows into ``/work``, in a child that is the
    sandbox user; answers ``{}`` or ``{"error": ...}``."""
    tarcopy = executor_module("tarcopy")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            drop_to_sandbox_user()
            try:
                tarcopy.unpack(Body(conn, rest, int(req["size"])), workdir,
                               copied_places(workdir))
                answer = {}
            except (OSError, ValueError, EOFError) as e:  # tarfile's errors are both
                answer = {"error": f"{type(e).__name__}: {e}"}
            conn.sendall(json.dumps(answer).encode() + b"\n")
            code = 0
        finally:
            os._exit(code)
    os.waitpid(pid, 0)


def as_sandbox_user(conn: socket.socket, req: dict, rest: bytes, workdir: str) -> None:
    """Run :func:`file_op` in a child that is the sandbox user: it can reach exactly what
    the commands can (the agent has no CAP_DAC_OVERRIDE anyway), and what it makes is
    theirs."""
    files_module()  # before the fork: the child inherits it
    pid = os.fork()
    if pid == 0:  # the child: syscalls only until it exits
        code = 1
        try:
            drop_to_sandbox_user()
            file_op(conn, req, rest, workdir)
            code = 0
        finally:
            os._exit(code)
    os.waitpid(pid, 0)


def file_op(conn: socket.socket, req: dict, rest: bytes, workdir: str) -> None:
    files = files_module()
    owner = None  # run as the sandbox user: what it writes is its own
    parts = tuple(str(p) for p in req["parts"])
    try:
        files.clean_path("/".join(parts))  # the host checked; so does the agent
        if req["op"] == "put":
            size = files.write_file(Path(workdir), parts, Body(conn, rest, int(req["size"])),
                                    owner=owner)
            conn.sendall(json.dumps({"size": size}).encode() + b"\n")
        else:
            data = files.read_file(Path(workdir), parts, int(req["limit"]), owner=owner)
            conn.sendall(json.dumps({"size": len(data)}).encode() + b"\n" + data)
    except files.FileError as e:
        conn.sendall(json.dumps({"status": e.status, "error": str(e)}).encode() + b"\n")
    except OSError as e:
        conn.sendall(json.dumps({"status": 409, "error": f"{'/'.join(parts)}: {e.strerror or e}"}
                                ).encode() + b"\n")


def handle(conn: socket.socket, workdir: str = "/work") -> None:
    with conn:
        data = b""
        while b"\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        line, _, rest = data.partition(b"\n")
        req = json.loads(line)
        if req.get("op") == "cancel":
            conn.sendall(json.dumps({"running": cancel(str(req.get("mark")))}).encode() + b"\n")
            return
        if req.get("op") in ("put", "get"):
            as_sandbox_user(conn, req, rest, workdir)
            return
        if req.get("op") == "pack":
            pack_op(conn, workdir)
            return
        if req.get("op") == "unpack":
            unpack_op(conn, req, rest, workdir)
            return
        answer = run(req)
        conn.sendall(json.dumps(answer).encode() + b"\n")


def prepare(workdir: str) -> None:
    """The working directory belongs to the sandbox user (the image may lack it)."""
    os.makedirs(workdir, exist_ok=True)
    if os.getuid() == 0:
        try:
            os.chown(workdir, SANDBOX_UID, SANDBOX_UID)
        except OSError:
            pass


def main(path: str, workdir: str = "/work") -> None:
    for name in (os.environ.get("TANGRAM_AGENT_DROP") or "").split(","):
        os.environ.pop(name, None)  # the agent's own python settings: not for commands
    prepare(workdir)
    if os.path.exists(path):
        os.unlink(path)
    os.chmod(os.path.dirname(path), 0o700)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.chmod(path + ".tmp", 0o600)
    server.listen(64)
    os.rename(path + ".tmp", path)  # appears only once it accepts connections
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        conn, _ = server.accept()
        threading.Thread(target=handle, args=(conn, workdir), daemon=True).start()


if __name__ == "__main__":
    main(*sys.argv[1:])
