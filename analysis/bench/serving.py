"""The `tangram serve` subprocess a live bench drives: wait until it answers, stop it."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, within_s: float = 120.0) -> None:
    """Return once ``url``/healthz answers 200; RuntimeError with the server's log tail when
    it exits first or ``within_s`` passes."""
    import httpx

    deadline = time.time() + within_s
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM (the server drains and cleans up), then SIGKILL after ``grace_s``."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
