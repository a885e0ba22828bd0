"""The agent inside a docker sandbox (stdlib only; run by the host's python3).

It listens on a unix socket in a directory bind-mounted from the host; each
connection carries one JSON request {argv, env, cwd, timeout_s} and gets one
JSON answer {code, output, t_start, t_end, timed_out}. Running commands this
way skips `docker exec` (tens of milliseconds per call in the engine); the
commands still run inside the container's namespaces and cgroup.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

MAX_OUTPUT = 1 << 20


def handle(conn: socket.socket) -> None:
    with conn:
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        req = json.loads(data)
        env = {**os.environ, **req.get("env", {})}
        timeout = req.get("timeout_s") or None
        t_start = time.time()
        try:
            proc = subprocess.Popen(req["argv"], cwd=req.get("cwd", "/work"), env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            answer = {"code": 127, "output": f"cannot start {req['argv'][0]!r}: {e}\n",
                      "t_start": t_start, "t_end": time.time(), "timed_out": False}
            conn.sendall(json.dumps(answer).encode() + b"\n")
            return
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group, children too
            except ProcessLookupError:
                pass
            out, _ = proc.communicate()
        answer = {"code": proc.returncode, "output": out[-MAX_OUTPUT:].decode(errors="replace"),
                  "t_start": t_start, "t_end": time.time(), "timed_out": timed_out}
        conn.sendall(json.dumps(answer).encode() + b"\n")


def main(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.chmod(path + ".tmp", 0o600)
    os.rename(path + ".tmp", path)  # appears only once it accepts connections
    server.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        conn, _ = server.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1])
