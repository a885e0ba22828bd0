"""A real image registry on 127.0.0.1 for the image tests and the images benchmark: Debian's
``docker-registry`` (the distribution project's Go server; `make registry` installs it),
started on a free port with its own storage directory, and images built here (no base
image can be pulled on this machine) and pushed to it.

The engine pulls from a plain-HTTP registry on 127.0.0.0/8 without configuration."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
import httpx

BINARY = "docker-registry"
#: how long the registry may take to answer its first request
START_S = 60.0


def binary() -> str:
    """The registry's binary: a missing one fails the tests that need it (never skips)."""
    path = shutil.which(BINARY) or ("/usr/bin/docker-registry"
                                    if os.path.exists("/usr/bin/docker-registry") else None)
    if path is None:
        raise RuntimeError(f"{BINARY} is not installed: the image tests run a real registry "
                           "(Debian package docker-registry; `make registry` installs it)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Pushed:
    """An image pushed to the registry (and removed from the engine)."""

    tag: str  # host:port/name:tag
    digest: str  # host:port/name@sha256:...
    size: int  # bytes of its files (what a pull downloads, give or take the tar headers)


class Registry:
    """``docker-registry serve`` on 127.0.0.1:<free port>, storing under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.storage = root / "storage"
        self.storage.mkdir(parents=True, exist_ok=True)
        self.config = root / "config.yml"
        # no blob descriptor cache: a test that deletes a blob finds it gone at once
        self.config.write_text(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n")
        self.proc: subprocess.Popen | None = None

    def start(self) -> Registry:
        log = open(self.root / "registry.log", "ab")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen([binary(), "serve", str(self.config)], stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + START_S
        seen = "nothing"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the registry exited ({self.proc.returncode}): "
                                   + (self.root / "registry.log").read_text()[-2000:])
            try:
                r = httpx.get(f"http://{self.host}/v2/", timeout=5)
                if r.status_code == 200:
                    return self
                seen = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                seen = str(e)
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the registry on {self.host} did not answer within {START_S} s "
                           f"(last: {seen})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def blob_file(self, digest: str) -> Path:
        """Where the registry keeps blob ``sha256:...``."""
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def manifest(self, name: str, reference: str) -> dict:
        r = httpx.get(f"http://{self.host}/v2/{name}/manifests/{reference}", headers={
            "Accept": "application/vnd.docker.distribution.manifest.v2+json"}, timeout=30)
        r.raise_for_status()
        return r.json()

    def build_and_push(self, name: str, size: int, client: docker.DockerClient | None = None,
                       remove: bool = True) -> Pushed:
        """An image ``<host>/<name>:1``: the default image's empty root filesystem (run on
        the host's /usr) plus ``size`` random bytes in /data/blob (distinct per call: its
        one layer is its own), pushed; removed from the engine unless ``remove`` is False."""
        from executor.backends.docker.backend import build_image

        client = client or docker.from_env()
        tag = f"{self.host}/{name}:1"
        build_image(client, tag, files={"/data/blob": os.urandom(size)})
        digest = None
        for event in client.api.push(f"{self.host}/{name}", tag="1", stream=True,
                                     decode=True):
            if "error" in event:
                raise RuntimeError(f"push of {tag}: {event['error']}")
            digest = (event.get("aux") or {}).get("Digest") or digest
        if digest is None:
            raise RuntimeError(f"push of {tag}: the engine reported no digest")
        if remove:
            client.api.remove_image(tag)
        return Pushed(tag, f"{self.host}/{name}@{digest}", size)


def unique(prefix: str) -> str:
    """A repository name no other test (or run) uses."""
    return f"tangram-test/{prefix}-{uuid.uuid4().hex[:8]}"


def remove_images(refs: list[str], client: docker.DockerClient | None = None) -> None:
    """Remove the engine's images ``refs`` (the ones a test pulled), ignoring absent ones."""
    client = client or docker.from_env()
    for ref in refs:
        try:
            client.api.remove_image(ref, force=True)
        except docker.errors.NotFound:
            pass
