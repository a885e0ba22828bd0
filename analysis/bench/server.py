"""A `tangram serve` subprocess for the benchmarks that drive a live server (adapters,
verl_stall): started on a free loopback port, waited for on its health check."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
#: how long a start may take: a hang guard (a loaded 2-core machine takes 10-15 s)
START_S = 180.0


def start_server(state: Path, token: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """``tangram serve --state-dir state *extra`` with ``token``, its output in
    ``state/server.log``; (the process, its URL) once ``/healthz`` answers. SystemExit with
    the log's tail when it exits or does not answer within START_S."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state.mkdir(parents=True, exist_ok=True)
    log = state / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "serve", "--port",
                                 str(port), "--state-dir", str(state), *extra],
                                env={**os.environ, "TANGRAM_TOKEN": token}, stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    said = log.read_text()[-2000:]
    if proc.poll() is None:
        proc.kill()
        raise SystemExit(f"bench: the server did not answer within {START_S:g} s: {said}")
    raise SystemExit(f"bench: the server exited with code {proc.returncode}: {said}")
