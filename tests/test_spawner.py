"""executor/backends/process/spawner.py on real processes: what the process backend relies on of an
asyncio Process (output, exit code, process group, wait after a timeout), no leaked
descriptors, and asyncio's own path for anything else."""

import asyncio
import os
import subprocess

import pytest

from executor.backends.process import spawner


@pytest.fixture(autouse=True, params=["on the loop", "in threads"])
def where(request, monkeypatch):
    """Every test on both paths: starts on the loop (a quiet machine) and in threads."""
    monkeypatch.setattr(spawner, "_threads_until",
                        float("inf") if request.param == "in threads" else 0.0)
    monkeypatch.setattr(spawner, "SLOW_START_S", float("inf"))  # no switching meanwhile
    return request.param


PIPE = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT,
        "start_new_session": True}


def _pipes() -> set[str]:
    """This process's descriptors open on pipes (what a leak of the spawner's would be)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:"):
            out.add(f"{fd}->{target}")
    return out


async def _read_all(proc) -> bytes:
    out = b""
    while chunk := await proc.stdout.read(1 << 16):
        out += chunk
    return out


def test_output_exit_code_and_group(tmp_path):
    async def go():
        proc = await spawner.create_subprocess_exec(
            "sh", "-c", "pwd; echo err >&2; head -c 300000 /dev/zero; exit 3",
            cwd=tmp_path, env={"PATH": os.environ["PATH"]}, **PIPE)
        assert isinstance(proc, spawner.SpawnedProcess)
        assert os.getpgid(proc.pid) == proc.pid  # its own process group (killed as one)
        out = await _read_all(proc)
        assert await proc.wait() == 3 and proc.returncode == 3
        return out

    out = asyncio.run(go())
    assert out.startswith(f"{tmp_path}\nerr\n".encode()) and out.count(b"\0") == 300000


def test_wait_survives_a_timeout_and_no_descriptor_leaks(tmp_path):
    before = _pipes()

    async def go():
        proc = await spawner.create_subprocess_exec("sleep", "0.3", cwd=tmp_path, **PIPE)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(proc.wait(), 0.01)
        assert proc.returncode is None
        assert await proc.wait() == 0
        assert await proc.stdout.read(10) == b""

    asyncio.run(go())
    assert not _pipes() - before


def test_a_missing_program_raises_and_leaks_nothing(tmp_path):
    before = _pipes()

    async def go():
        with pytest.raises(FileNotFoundError):
            await spawner.create_subprocess_exec("/no/such/program", cwd=tmp_path, **PIPE)

    asyncio.run(go())
    assert not _pipes() - before


def test_other_arguments_take_asyncio_s_path(tmp_path):
    async def go():
        proc = await spawner.create_subprocess_exec(
            "sh", "-c", "echo $X", cwd=tmp_path, env={"X": "y"},
            preexec_fn=lambda: None, **PIPE)
        assert not isinstance(proc, spawner.SpawnedProcess)
        out = await proc.stdout.read()
        await proc.wait()
        return out

    assert asyncio.run(go()) == b"y\n"


def test_cancelled_while_starting_leaves_nothing_running(tmp_path, monkeypatch):
    # only the threaded path can be cancelled mid-start (a start on the loop completes
    # before its caller runs again), so both parametrizations run it in threads
    monkeypatch.setattr(spawner, "_threads_until", float("inf"))
    before = _pipes()

    async def go():
        task = asyncio.create_task(spawner.create_subprocess_exec(
            "sh", "-c", "sleep 0.5; touch survived", cwd=tmp_path, **PIPE))
        await asyncio.sleep(0)  # it is now waiting for the start (in another thread)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(2.0)  # what it started is killed, not left to finish

    asyncio.run(go())
    assert not (tmp_path / "survived").exists()
    assert not _pipes() - before


def test_a_slow_start_moves_starts_to_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(spawner, "_threads_until", 0.0)
    monkeypatch.setattr(spawner, "SLOW_START_S", 0.0)  # every start is "slow"

    async def go():
        proc = await spawner.create_subprocess_exec("true", cwd=tmp_path, **PIPE)
        await proc.wait()

    asyncio.run(go())
    assert spawner._threads_until > 0, "the next starts go to threads for a while"


def test_stdin_is_dev_null_read_only(tmp_path):
    """The shared /dev/null descriptor is the child's stdin: EOF at once, not writable."""
    async def go():
        outs = []
        for _ in range(2):  # (the same descriptor, twice)
            proc = await spawner.create_subprocess_exec(
                "sh", "-c", "cat; readlink /proc/self/fd/0; echo x >&0 || echo refused",
                cwd=tmp_path, **PIPE)
            outs.append((await _read_all(proc)).decode())
            assert await proc.wait() == 0
        return outs

    for out in asyncio.run(go()):
        assert out.splitlines()[0] == "/dev/null" and out.splitlines()[-1] == "refused", out


@pytest.mark.parametrize("renice_back", [True, False], ids=["thread nice", "nice exec"])
def test_the_child_is_pinned_and_niced_the_starter_is_not(tmp_path, monkeypatch, renice_back):
    """``cores=`` and ``nice=`` reach the child (the starting thread takes them for the fork,
    or a ``nice -n`` exec where it could not take its own priority back); the thread that
    started it - the event loop's, or a spawner thread - keeps its own."""
    cpus = sorted(os.sched_getaffinity(0))
    if renice_back and not spawner.renice_back():
        pytest.skip("this server may not make a thread less nice again")
    monkeypatch.setattr(spawner, "_renice_back", renice_back)
    base = os.getpriority(os.PRIO_PROCESS, 0)

    async def go():
        mine = (os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, 0))
        proc = await spawner.create_subprocess_exec(
            "sh", "-c", "nice; grep Cpus_allowed_list /proc/self/status",
            cores={cpus[-1]}, nice=5, cwd=tmp_path, **PIPE)
        out = (await _read_all(proc)).decode()
        assert await proc.wait() == 0, out
        assert (os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, 0)) == mine
        return out

    nice, allowed = asyncio.run(go()).splitlines()
    assert int(nice) == min(base + 5, 19)
    assert allowed.split()[-1] == str(cpus[-1])
    for t in spawner._pool._threads if spawner._pool else ():  # the spawner's threads too
        status = open(f"/proc/self/task/{t.native_id}/status").read()
        assert f"Cpus_allowed_list:\t{cpus[-1]}\n" not in status or len(cpus) == 1


def test_an_impossible_placement_is_an_error_and_leaves_nothing(tmp_path):
    """A core this machine does not have: the start fails (nothing started, no
    descriptor left), and the starting thread is as it was."""
    before = _pipes()
    mine = os.sched_getaffinity(0)

    async def go():
        with pytest.raises(OSError):
            await spawner.create_subprocess_exec("true", cores={4096}, cwd=tmp_path, **PIPE)

    asyncio.run(go())
    assert _pipes() == before and os.sched_getaffinity(0) == mine


@pytest.mark.skipif(os.geteuid() != 0 or spawner.as_user(65534) is None,
                    reason="switching user needs root and setpriv")
def test_as_user_leaves_what_popen_user_leaves(tmp_path):
    """The setpriv prefix (a vfork start) drops to the same ids, groups and capabilities
    as Popen(user=, group=, extra_groups=[]) (a full fork of the server)."""
    keys = ("Uid:", "Gid:", "Groups:", "CapInh:", "CapPrm:", "CapEff:", "CapAmb:")

    def creds(text: str) -> list[str]:
        return [line.split(None, 1)[-1].strip() for line in text.splitlines()
                if line.startswith(keys)]

    async def via_spawner() -> str:
        proc = await spawner.create_subprocess_exec(
            *spawner.as_user(65534), "cat", "/proc/self/status", cwd=tmp_path, **PIPE)
        out = await _read_all(proc)
        await proc.wait()
        return out.decode()

    ours = creds(asyncio.run(via_spawner()))
    theirs = creds(subprocess.run(["cat", "/proc/self/status"], user=65534, group=65534,
                                  extra_groups=[], capture_output=True, text=True).stdout)
    assert ours == theirs and ours[0].split() == ["65534"] * 4
