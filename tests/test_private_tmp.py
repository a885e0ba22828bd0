"""Issue 47 #6: a sandbox's own /tmp, /var/tmp and /dev/shm (process backend:
executor/backends/process/scratch.py), kept across its actions, copied by a fork, removed at
close, out of every other sandbox's reach; on docker, a fork copies what setup wrote to
/tmp and $HOME (executor/backends/docker/fork.py). Through a real `tangram serve`."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
from conftest import TOKEN
from helpers import until_true

from executor.backends.process.backend import dir_name
from executor.backends.process.scratch import AREA
from tangram_sdk.client import TangramClient, TangramSyncClient

#: each of the three places, written at one fixed path by every sandbox
WRITE = ("for d in /tmp /var/tmp /dev/shm; do echo \"$ME\" > $d/{name} || exit 1; done; "
         "cat /tmp/{name}")
READ = "cat /tmp/{name} /var/tmp/{name} /dev/shm/{name}"


def test_sandboxes_writing_one_fixed_tmp_path_each_get_their_own(process_server):
    """8 setups write one fixed path in /tmp, /var/tmp and /dev/shm at once: all succeed
    (before: 7 of 8 "Permission denied", the first writer's file being another user's),
    each reads its own back in a later action, and the host's /tmp never saw the file."""
    name = f"fixed-{uuid.uuid4().hex[:8]}"

    async def go() -> None:
        async with TangramClient(process_server.url, TOKEN, timeout_s=180) as tg:
            ids = [await tg.open_trajectory(task="tmp", mem_gb=0.1) for _ in range(8)]
            first = await asyncio.gather(*(
                tg.run(t, command=WRITE.format(name=name), shell=True, env={"ME": t})
                for t in ids))
            for t, res in zip(ids, first, strict=True):
                assert res["exit_code"] == 0 and res["output"] == f"{t}\n", (t, res)
            again = await asyncio.gather(*(tg.run(t, command=READ.format(name=name),
                                                  shell=True) for t in ids))
            for t, res in zip(ids, again, strict=True):
                assert res["output"] == f"{t}\n" * 3, (t, res)
            for t in ids:
                await tg.close_trajectory(t)

    asyncio.run(go())
    for place in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.exists(f"{place}/{name}"), f"{place}/{name} reached the host"


def test_tmp_is_kept_copied_by_a_fork_out_of_reach_and_removed(process_server):
    work = process_server.state_dir / "work"
    with TangramSyncClient(process_server.url, TOKEN, timeout_s=180) as c:
        src = c.open_trajectory(task="tmp", mem_gb=0.1)
        other = c.open_trajectory(task="tmp", mem_gb=0.1)
        res = c.run(src, command="echo setup > /tmp/x && mkdir -p /tmp/d && echo deep > "
                    "/tmp/d/y && echo shm > /dev/shm/z && stat -c %a /tmp", shell=True)
        assert res["exit_code"] == 0 and res["output"] == "1777\n", res
        # the next action of the trajectory sees what the first wrote
        res = c.run(src, command="cat /tmp/x /tmp/d/y /dev/shm/z", shell=True)
        assert res["output"] == "setup\ndeep\nshm\n", res
        # another sandbox sees none of it, and cannot reach its directories on the host
        mine = work / AREA / dir_name(src)
        assert (mine / "tmp" / "x").read_text() == "setup\n"
        res = c.run(other, command=f"cat /tmp/x; ls '{mine}/tmp'; cat '{mine}/tmp/x'",
                    shell=True)
        assert "setup" not in res["output"] and res["output"].count("Permission denied") == 2, \
            res
        # a fork's copies start with the source's /tmp; each copy's writes stay its own
        ids = c.fork(src, 2)["ids"]
        for t in ids:
            res = c.run(t, command="cat /tmp/x /tmp/d/y /dev/shm/z && stat -c '%a %u' "
                        "/tmp/x && echo mine > /tmp/x", shell=True)
            owner = c.run(t, command="id -u", shell=True)["output"].strip()
            assert res["output"] == f"setup\ndeep\nshm\n644 {owner}\n", (t, res)
        assert c.run(src, command="cat /tmp/x", shell=True)["output"] == "setup\n"
        for t in [*ids, src, other]:
            c.close_trajectory(t)
    # removed at close (off the loop, once its processes are gone)
    left = until_true(lambda: not [p for p in (work / AREA).iterdir()], 120,
                      f"every sandbox's /tmp under {work / AREA} removed")
    assert left


def test_a_restored_trajectory_keeps_its_tmp_under_its_new_id(tmp_path):
    """A server killed and restarted on the same state directory restores its open
    trajectories: their own /tmp comes back with them, given to the id they have now."""
    import signal

    from conftest import start_server

    state = tmp_path / "state"
    server = start_server(state)
    try:
        with TangramSyncClient(server.url, TOKEN, timeout_s=180) as c:
            t = c.open_trajectory("kept-tmp", task="tmp", mem_gb=0.1)
            assert c.run(t, command="echo kept > /tmp/x", shell=True)["exit_code"] == 0
        server.stop(signal.SIGKILL)
        server = start_server(state)
        with TangramSyncClient(server.url, TOKEN, timeout_s=180) as c:
            res = c.run(t, command="cat /tmp/x && echo more >> /tmp/x && stat -c %u /tmp/x "
                        "&& id -u", shell=True)
            assert res["exit_code"] == 0, res
            kept, owner, uid = res["output"].split()
            assert kept == "kept" and owner == uid, res
            c.close_trajectory(t)
    finally:
        server.stop()


#: a `pip install --user`-like setup: a module in the user site-packages under $HOME
#: (the default image's $HOME is /tmp), and files in /tmp, /var/tmp, /dev/shm
USER_SITE_SETUP = ("site=$(python3 -m site --user-site) && mkdir -p \"$site\" && "
                   "echo \"NAME = 'tiny'\" > \"$site/tinylib.py\" && echo t0 > /tmp/t0 && "
                   "echo v > /var/tmp/v && echo s > /dev/shm/s && echo $HOME")
USER_SITE_PROBE = ("python3 -c 'import tinylib; print(tinylib.NAME)' && "
                   "cat /tmp/t0 /var/tmp/v /dev/shm/s")


def test_docker_fork_copies_tmp_and_home(docker_server):
    """Before: `No module named 'tinylib'` in every copy (only /work was copied)."""
    with TangramSyncClient(docker_server.url, TOKEN, timeout_s=180) as c:
        src = c.open_trajectory(task="tmp", mem_gb=0.25)
        res = c.run(src, command=USER_SITE_SETUP, shell=True)
        assert res["exit_code"] == 0, res
        assert c.run(src, command=USER_SITE_PROBE, shell=True)["output"] == "tiny\nt0\nv\ns\n"
        ids = c.fork(src, 2)["ids"]
        for t in ids:
            res = c.run(t, command=USER_SITE_PROBE + " && echo mine > /tmp/t0", shell=True)
            assert res["exit_code"] == 0 and res["output"] == "tiny\nt0\nv\ns\n", (t, res)
            res = c.run(t, command="stat -c %u /tmp/t0 && id -u", shell=True)
            owner, uid = res["output"].split()
            assert owner == uid, res  # the copy's files are its sandbox user's
        assert c.run(src, command="cat /tmp/t0", shell=True)["output"] == "t0\n"
        for t in [*ids, src]:
            c.close_trajectory(t)


def test_docker_fork_refuses_a_source_that_wrote_outside_what_is_copied(docker_server):
    """A setup that wrote into a world-writable directory of the image (the container's
    writable layer, which no copy gets): the fork is refused with the path named, never
    made without it."""
    import io
    import tarfile

    import docker

    from executor.backends.docker.backend import HOST_ROOTFS
    from tangram_sdk.client import TangramError

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, mode in (("tmp", 0o1777), ("work", 0o777), ("proc", 0o555), ("sys", 0o555),
                           ("dev", 0o755), ("etc", 0o755), ("root", 0o700), ("opt", 0o755),
                           ("opt/cache", 0o777)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        passwd = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/tmp:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size, info.mode = len(passwd), 0o644
        tar.addfile(info, io.BytesIO(passwd))
    image = "tangram-test-writable-layer:1"
    docker.from_env().api.import_image_from_data(
        buf.getvalue(), repository=image.split(":")[0], tag="1",
        changes=["WORKDIR /work", f"LABEL {HOST_ROOTFS}=host"])
    with TangramSyncClient(docker_server.url, TOKEN, timeout_s=180) as c:
        src = c.open_trajectory(task="tmp", image=image, mem_gb=0.25)
        res = c.run(src, command="echo x > /tmp/fine && mkdir /opt/cache/built && "
                    "echo y > /opt/cache/built/lib.so", shell=True)
        assert res["exit_code"] == 0, res
        with pytest.raises(TangramError) as e:
            c.fork(src, 2)
        assert "refused" in str(e.value) and "/opt/cache/built" in str(e.value), e.value
        # what only /tmp holds forks as before
        clean = c.open_trajectory(task="tmp", image=image, mem_gb=0.25)
        assert c.run(clean, command="echo x > /tmp/fine", shell=True)["exit_code"] == 0
        (copy,) = c.fork(clean, 1)["ids"]
        assert c.run(copy, command="cat /tmp/fine", shell=True)["output"] == "x\n"
        for t in (src, clean, copy):
            c.close_trajectory(t)
