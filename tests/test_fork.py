"""Forking a prepared sandbox (issue 36) through a real `tangram serve` (process
backend: real work directories, real processes): copies independent of each other and
of the source, refusals (an action in flight, closed or unknown source), every copy
cleaned up at close, and the copies' memory counted like any trajectory's."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import time

import pytest
from conftest import TOKEN, sandbox_containers, start_server
from helpers import until_true

from tangram.fork import FORK, fork_action
from tangram_sdk.client import TangramError, TangramSyncClient


def test_fork_action_is_a_one_core_action_of_the_source():
    a = fork_action("f1", "t", "src", ["c0", "c1"])
    assert a.kind == FORK and a.trajectory == "src" and a.cost["cpu"].choices == (1,)
    assert a.payload["fork_to"] == ["c0", "c1"]
    for copies, field in (([], "count"), (["src"], "fork_of"), ([f"c{i}" for i in range(65)],
                                                               "count")):
        with pytest.raises(ValueError, match=field):
            fork_action("f2", "t", "src", copies)


def test_copies_are_independent_and_cleaned_up(process_server):
    work = process_server.state_dir / "work"
    with TangramSyncClient(process_server.url, TOKEN, timeout_s=120) as c:
        src = c.open_trajectory("fork-src", task="grpo", mem_gb=0.1)
        setup = c.run(src, command="mkdir -p repo && echo prepared > repo/state.txt "
                      "&& ln -s repo/state.txt link", shell=True, id="setup")
        assert setup["status"] == "ok" and setup["exit_code"] == 0, setup
        done = c.fork(src, 3, prefix="fork-copy")
        assert done["ids"] == ["fork-copy-0", "fork-copy-1", "fork-copy-2"], done
        assert done["method"] in ("reflink", "copy") and done["fork_of"] == src
        assert done["bytes"] >= len("prepared\n")
        ids = done["ids"]
        # every copy starts with the source's files (symlinks as symlinks)
        for t in ids:
            assert c.get_file(t, "repo/state.txt") == b"prepared\n"
            res = c.run(t, command="readlink link", shell=True)
            assert res["output"] == "repo/state.txt\n", res
        # a write in one copy is seen by no other copy and not by the source
        res = c.run(ids[0], command="echo mine > repo/state.txt && touch new.txt", shell=True)
        assert res["exit_code"] == 0, res
        assert c.get_file(ids[0], "repo/state.txt") == b"mine\n"
        for t in [src, *ids[1:]]:
            assert c.get_file(t, "repo/state.txt") == b"prepared\n"
            res = c.run(t, command="test -e new.txt", shell=True)
            assert res["exit_code"] == 1, (t, res)
        # ...and a write in the source afterwards reaches no copy
        c.put_file(src, "after.txt", b"later")
        with pytest.raises(TangramError) as e:
            c.get_file(ids[1], "after.txt")
        assert e.value.status == 404
        # closing a copy removes its directory, not the others' nor the source's
        c.close_trajectory(ids[0])
        assert c.get_file(ids[1], "repo/state.txt") == b"prepared\n"
        for t in [src, *ids[1:]]:
            c.close_trajectory(t)
    deadline = time.time() + 60
    while time.time() < deadline and any((work / t).exists() for t in [src, *ids]):
        time.sleep(0.1)  # removed off the loop, after the close answered
    assert not [t for t in [src, *ids] if (work / t).exists()]


def test_fork_refusals(process_server):
    with TangramSyncClient(process_server.url, TOKEN, timeout_s=120) as c:
        with pytest.raises(TangramError) as e:
            c.fork("never-opened", 2)
        assert e.value.status == 404 and "fork_of" in str(e.value)
        src = c.open_trajectory(task="grpo", mem_gb=0.1)
        # an action in flight: refused (409), not waited for; nothing opened
        busy = c.submit(src, command="sleep 8", id="fork-busy")
        assert busy["status"] in ("queued", "running")
        with pytest.raises(TangramError) as e:
            c.fork(src, 2, prefix="fork-busy-copy")
        assert e.value.status == 409 and "in flight" in str(e.value)
        with pytest.raises(TangramError) as e:
            c.run("fork-busy-copy-0", command="true")
        assert e.value.status == 404
        c.wait("fork-busy", 60)
        # a copy id already open; a count out of range; the source's memory is not given
        c.open_trajectory("fork-taken-0", task="grpo")
        with pytest.raises(TangramError) as e:
            c.fork(src, 1, prefix="fork-taken")
        assert e.value.status == 409
        with pytest.raises(TangramError) as e:
            c.fork(src, 65)
        assert e.value.status == 422
        with pytest.raises(TangramError) as e:
            c.fork(src, 10, prefix="x" * 127)
        assert e.value.status == 422 and "shorter" in str(e.value)
        with pytest.raises(TangramError) as e:
            c._call("POST", "/v1/trajectories", json={"fork_of": src, "mem_gb": 1})
        assert e.value.status == 422 and "mem_gb" in str(e.value)
        # closed: refused like an unknown one
        c.close_trajectory("fork-taken-0")
        c.close_trajectory(src)
        with pytest.raises(TangramError) as e:
            c.fork(src, 1)
        assert e.value.status == 404


def test_copies_declare_the_sources_memory_and_wait_for_a_node(tmp_path):
    """60% of the machine declared by the source: its copy cannot be held beside it
    (--mem-overcommit 1), so the copy's first action waits for a node while the source
    runs, and runs once the source idles (an idle sandbox gives its place)."""
    from executor.node.local import mem_total_gb

    server = start_server(tmp_path, "process", extra_args=("--mem-overcommit", "1"))
    big = round(mem_total_gb() * 0.6, 2)
    try:
        with TangramSyncClient(server.url, TOKEN, timeout_s=120) as c:
            src = c.open_trajectory(task="grpo", mem_gb=big)
            assert c.run(src, command="echo ready > f.txt", shell=True)["exit_code"] == 0
            (copy,) = c.fork(src, 1)["ids"]
            c.submit(src, command="sleep 10", id="mem-busy")
            first = c.submit(copy, command="cat f.txt", id="mem-copy")
            # (the source is busy: it cannot give its place; a copy that declared nothing
            # would have fit beside it and started at once)
            assert first["status"] == "queued" and "waiting for a node" in first["error"], first
            done = c.wait("mem-copy", 120)
            assert done["status"] == "ok" and done["output"] == "ready\n", done
            c.wait("mem-busy", 120)
            c.close_trajectory(copy)
            c.close_trajectory(src)
    finally:
        server.stop()


def test_gymnasium_reset_forks_a_prepared_env(process_server):
    """A GRPO group through gymnasium: one env prepares, the others reset as its copies."""
    import gymnasium

    import tangram_sdk.integrations.gym  # noqa: F401

    def make():
        return gymnasium.make("tangram/Shell-v0", base_url=process_server.url, token=TOKEN,
                              task="gym-fork")

    lead, other = make(), make()
    try:
        lead.reset()
        obs, *_ = lead.step("echo prepared > state.txt && echo done")
        assert "done" in obs
        source = lead.unwrapped.trajectory
        other.reset(options={"fork_of": source})
        assert other.unwrapped.trajectory != source
        obs, *_ = other.step("cat state.txt && echo mine > state.txt")
        assert obs.startswith("prepared")
        obs, *_ = lead.step("cat state.txt")
        assert obs.startswith("prepared")  # the copy's write stayed in the copy
        with pytest.raises(ValueError, match="fork_of"):
            other.reset(options={"fork_of": 7})
    finally:
        lead.close()
        other.close()


def test_concurrent_forks_of_one_source(process_server):
    """A group's rollouts fork one prepared sandbox at once: a fork in flight is no
    action that keeps another fork out (it only reads the source)."""
    import asyncio

    from tangram_sdk.client import TangramClient

    async def go() -> None:
        async with TangramClient(process_server.url, TOKEN, timeout_s=120) as tg:
            src = await tg.open_trajectory(task="grpo", mem_gb=0.1)
            await tg.run(src, command="echo ready > f.txt", shell=True)
            done = await asyncio.gather(*(tg.fork(src, 1) for _ in range(4)))
            ids = [d["ids"][0] for d in done]
            assert len(set(ids)) == 4
            for t in ids:
                assert await tg.get_file(t, "f.txt") == b"ready\n"
                await tg.close_trajectory(t)
            await tg.close_trajectory(src)

    asyncio.run(go())


def test_docker_copies_are_independent_and_removed(docker_server):
    """The docker backend: /work copied between containers; each copy's container goes
    with its close."""
    with TangramSyncClient(docker_server.url, TOKEN, timeout_s=180) as c:
        src = c.open_trajectory("dfork-src", task="grpo", mem_gb=0.25)
        res = c.run(src, command="mkdir -p repo && echo prepared > repo/state.txt", shell=True)
        assert res["exit_code"] == 0, res
        done = c.fork(src, 2, prefix="dfork")
        assert done["method"] == "copy" and done["bytes"] >= len("prepared\n"), done
        a, b = done["ids"]
        res = c.run(a, command="cat repo/state.txt && echo mine > repo/state.txt", shell=True)
        assert res["output"] == "prepared\n", res
        assert c.get_file(b, "repo/state.txt") == b"prepared\n"
        assert c.get_file(src, "repo/state.txt") == b"prepared\n"
        assert c.get_file(a, "repo/state.txt") == b"mine\n"
        res = c.run(b, command="id -u && stat -c %u repo/state.txt", shell=True)
        uid, owner = res["output"].split()
        assert uid == owner, res  # the copy's files are its sandbox user's
        for t in (src, a, b):
            c.close_trajectory(t)
    deadline = time.time() + 120
    left = None
    while time.time() < deadline:
        left = [x for t in ("dfork-src", "dfork-0", "dfork-1") for x in sandbox_containers(t)]
        if not left:
            break
        time.sleep(0.5)
    assert not left


def test_docker_copies_run_in_their_sources_image(docker_server):
    """Issue 47 #1: a copy's container ran the default image with an empty PYTHONPATH.
    A source opened on an image with a module of its own and ``ENV PYTHONPATH``: every
    copy runs in that image, sees its PYTHONPATH and imports its module."""
    import docker

    from executor.backends.docker.backend import build_image

    image = build_image(docker.from_env(), "tangram-test-fork-image:1",
                        files={"/opt/extra/forkmod.py": b"NAME = 'only-in-the-image'\n"},
                        env={"PYTHONPATH": "/opt/extra"})
    probe = ("echo $PYTHONPATH && python3 -c 'import forkmod; print(forkmod.NAME)' "
             "&& cat state.txt")
    with TangramSyncClient(docker_server.url, TOKEN, timeout_s=180) as c:
        src = c.open_trajectory("ifork-src", task="grpo", image=image)
        res = c.run(src, command="echo prepared > state.txt", shell=True)
        assert res["exit_code"] == 0, res
        ids = c.fork(src, 2, prefix="ifork")["ids"]
        for t in [src, *ids]:
            res = c.run(t, command=probe, shell=True)
            assert res["output"].split() == ["/opt/extra", "only-in-the-image", "prepared"], \
                (t, res)
            (box,) = sandbox_containers(t, all=False)
            assert box.attrs["Config"]["Image"] == image, (t, box.attrs["Config"]["Image"])
        for t in [src, *ids]:
            c.close_trajectory(t)


def _fork_or_error(url: str, source: str, prefix: str) -> dict | TangramError:
    with TangramSyncClient(url, TOKEN, timeout_s=120) as c:
        try:
            return c.fork(source, 1, prefix=prefix)
        except TangramError as e:
            return e


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")
def test_a_fork_that_would_fill_the_disk_is_refused(tmp_path):
    """The process backend copies every byte (no reflink on tmpfs): on a 64 MiB work root
    a 20 MiB sandbox forks once, and three more copies - 60 MiB, more than is free - are
    refused before anything is copied, naming the sizes; the server serves on and the
    disk holds only what it held. A copy larger than --sandbox-disk-gb is refused too."""
    state = tmp_path / "small"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(state)], check=True)
    server = None
    try:
        server = start_server(state, "process", extra_args=("--sandbox-disk-gb", "0.03"))
        with TangramSyncClient(server.url, TOKEN, timeout_s=120) as c:
            src = c.open_trajectory("disk-src", mem_gb=0.1)
            res = c.run(src, command="head -c 20M /dev/urandom > blob", shell=True)
            assert res["exit_code"] == 0, res
            one = c.fork(src, 1, prefix="disk-one")
            assert one["method"] == "copy" and one["bytes"] >= 20 << 20, one
            used = shutil.disk_usage(state).used
            with pytest.raises(TangramError) as e:
                c.fork(src, 3, prefix="disk-three")
            assert "3 copies need 60.0 MiB and" in str(e.value) and "MiB free" in str(e.value), \
                e.value
            assert shutil.disk_usage(state).used <= used + (1 << 20)  # nothing copied
            res = c.run(one["ids"][0], command="wc -c < blob", shell=True)
            assert res["output"].strip() == str(20 << 20), res
            open_ = {t["id"] for t in c.trajectories()}
            assert open_ == {src, *one["ids"]}, open_  # the refused copies were closed
            # three forks of one copy at once (a group's rollouts): room for one; each
            # counts what the others will still write, so the others are refused, never
            # left to fill the disk part way ("cp exit 1")
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                tries = list(pool.map(lambda i: _fork_or_error(server.url, src, f"race{i}"),
                                      range(3)))
            made = [t for t in tries if isinstance(t, dict)]
            assert len(made) == 1, tries
            assert all("1 copy needs 20.0 MiB" in str(t) for t in tries if t not in made), tries
            c.close_trajectory(made[0]["ids"][0])
            until_true(lambda: shutil.disk_usage(state).used <= used + (1 << 20), 120,
                       "the closed copy's files to be removed (off the server's loop)")
            # a copy counts against its disk limit (30.7 MiB): a 31 MiB source is refused
            res = c.run(src, command="head -c 11M /dev/urandom > more", shell=True)
            assert res["exit_code"] == 0, res
            with pytest.raises(TangramError) as e:
                c.fork(src, 1, prefix="disk-big")
            assert ("a copy would hold 31.0 MiB in its work directory, more than its disk "
                    "limit (30.7 MiB: --sandbox-disk-gb 0.03)") in str(e.value), e.value
    finally:
        if server is not None:
            server.stop()
        subprocess.run(["umount", "-l", str(state)], check=False)
