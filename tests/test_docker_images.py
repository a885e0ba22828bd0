"""Bring-your-own image: a trajectory names a docker image (or its task has one in
the server config) and the sandbox agent runs inside it without modifying it.

The image here is built offline from the host's dash and libc only - no python,
no coreutils - so a working agent proves it runs on the host's python mounted
read-only at /tangram-host, not on anything the image provides."""

from __future__ import annotations

import io
import os
import tarfile

import docker
import httpx
import pytest
from conftest import TOKEN, start_server

H = {"Authorization": f"Bearer {TOKEN}"}
FOREIGN = "tangram-test-foreign:1"


def build_foreign_image() -> str:
    """A tiny image: /bin/sh (dash), its libc and loader, a marker file; nothing else."""
    buf = io.BytesIO()
    files = {"bin/sh": "/usr/bin/dash",
             "lib/x86_64-linux-gnu/libc.so.6": "/lib/x86_64-linux-gnu/libc.so.6",
             "lib64/ld-linux-x86-64.so.2": "/lib64/ld-linux-x86-64.so.2"}
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "lib", "lib/x86_64-linux-gnu", "lib64", "etc", "tmp", "proc", "sys",
                  "dev"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        for name, src in files.items():
            with open(os.path.realpath(src), "rb") as f:
                data = f.read()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
        marker = b"made-by-the-test\n"
        info = tarfile.TarInfo("etc/marker")
        info.size = len(marker)
        tar.addfile(info, io.BytesIO(marker))
    docker.from_env().api.import_image_from_data(
        buf.getvalue(), repository=FOREIGN.split(":")[0], tag=FOREIGN.split(":")[1],
        changes=["ENV IMAGE_VAR=from-the-image"])
    return FOREIGN


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    image = build_foreign_image()
    before = docker.from_env().images.get(image).id
    s = start_server(tmp_path_factory.mktemp("serve-images"), "docker",
                     extra_args=("--image", f"special={image}"))
    yield s
    s.stop()
    assert docker.from_env().images.get(image).id == before  # the image was not modified


SCRIPT = ("read m < /etc/marker; echo $m; echo $IMAGE_VAR; "
          "[ -e /usr/bin/python3 ] && echo has-python || echo no-python; "
          "echo $PYTHONHOME; echo pwd=$(pwd)")


@pytest.mark.parametrize("how", ["named", "task-default"])
def test_commands_run_in_an_image_without_python(server, how):
    body = {"id": f"byo-{how}", "image": FOREIGN} if how == "named" else \
        {"id": f"byo-{how}", "task": "special"}
    with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
        assert c.post("/v1/trajectories", json=body).status_code == 201
        c.post(f"/v1/trajectories/{body['id']}/actions",
               json={"id": f"{how}-1", "argv": ["/bin/sh", "-c", SCRIPT]})
        res = c.get(f"/v1/actions/{how}-1", params={"wait": 60}).json()
        assert res["status"] == "ok", res
        lines = res["output"].splitlines()
        assert lines[:3] == ["made-by-the-test", "from-the-image", "no-python"], lines
        assert lines[3] == "" and lines[4] == "pwd=/work"  # the agent's python is not theirs
        c.delete(f"/v1/trajectories/{body['id']}")


def test_an_unknown_image_is_refused_at_open(server):
    with httpx.Client(base_url=server.url, headers=H, timeout=60) as c:
        r = c.post("/v1/trajectories", json={"id": "nope", "image": "no-such-image:404"})
        # not on the node: pulled from its registry (Docker Hub), which this machine
        # cannot reach or which has no such image (tests/test_images_live.py: a real one)
        assert r.status_code == 502 and "could not be pulled from registry 'docker.io'" \
            in r.text, r.text
        # and the id is still free
        assert c.post("/v1/trajectories", json={"id": "nope"}).status_code == 201
