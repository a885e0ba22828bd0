"""Attack (issue 45 #6): a setuid file outlives its uid.

Sandbox C makes its work directory 0777; sandbox A copies a shell into it and sets 4755
(and a second one that C then hides in a 0700 directory of its own); A closes; B opens.
Before the fix B got A's uid at once (the last freed uid was handed out first), the
shells were still there, and C ran one with ``-p`` as A's - now B's - uid and read B's
private file. Now: sandbox commands run with no new privileges (the setuid bit makes no
one its owner, before or after the close), A's uid comes back only after every other id
of the block (FIFO), and what A owned anywhere in the work root is removed at its close,
hidden or not."""

from __future__ import annotations

import os

import httpx
import pytest
from conftest import TOKEN
from helpers import until_true

H = {"Authorization": f"Bearer {TOKEN}"}

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids need a root server")


@pytest.fixture()
def http(process_server):
    with httpx.Client(base_url=process_server.url, headers=H, timeout=120) as c:
        yield c


def _sh(http, tid: str, aid: str, command: str) -> str:
    r = http.post(f"/v1/trajectories/{tid}/actions", params={"wait": 60},
                  json={"id": aid, "shell": True, "command": command})
    assert r.status_code in (200, 202), r.text
    out = r.json()
    if out["status"] in ("queued", "running"):
        out = http.get(f"/v1/actions/{aid}", params={"wait": 60}).json()
    assert out["status"] == "ok", out
    return out["output"]


def _open(http, tid: str) -> None:
    assert http.post("/v1/trajectories", json={"id": tid}).status_code == 201


def test_a_setuid_file_left_in_another_sandbox_never_runs_as_the_next_owner_of_its_uid(
        http, process_server):
    for t in ("u6-c", "u6-a"):
        _open(http, t)
    c_dir = _sh(http, "u6-c", "u6-c1", "chmod 777 . && mkdir priv && chmod 700 priv && pwd"
                ).strip()
    a_uid = int(_sh(http, "u6-a", "u6-a1",
                    f"cp /bin/bash {c_dir}/sh && chmod 4755 {c_dir}/sh && "
                    f"cp /bin/bash {c_dir}/sh2 && chmod 4755 {c_dir}/sh2 && "
                    f"mkdir {c_dir}/adir && touch {c_dir}/adir/f && id -u"))
    c_uid = int(_sh(http, "u6-c", "u6-c2", "mv sh2 priv/ && id -u"))
    assert os.stat(f"{c_dir}/sh").st_mode & 0o4000 and os.stat(f"{c_dir}/sh").st_uid == a_uid

    # while A is open: C's `sh -p` runs as C (no new privileges), not as A
    assert _sh(http, "u6-c", "u6-c0", "grep NoNewPrivs /proc/self/status").split() == [
        "NoNewPrivs:", "1"]
    ran = _sh(http, "u6-c", "u6-c3", "./sh -p -c 'id -u; id -ru'; priv/sh2 -p -c 'id -u'")
    assert ran.split() == [str(c_uid)] * 3, ran

    assert http.delete("/v1/trajectories/u6-a").status_code == 200
    # A's files, wherever they are in C's tree (hidden in C's 0700 directory too), go
    # with A, before its uid can come back
    def a_files_left() -> list[str]:
        left = []
        for here, dirs, files in os.walk(c_dir):
            for name in dirs + files:
                st = os.lstat(os.path.join(here, name))
                if a_uid in (st.st_uid, st.st_gid):
                    left.append(os.path.join(here, name))
        return left

    until_true(lambda: not a_files_left(), 60, f"no file of A's uid {a_uid} in C's tree")

    # B, and the opens after it, get other uids than A's (A's is last in the queue)
    b_uids = {}
    for i in range(8):
        tid = f"u6-b{i}"
        _open(http, tid)
        b_uids[tid] = int(_sh(http, tid, f"{tid}-1",
                              "echo private > secret && chmod 600 secret && id -u"))
    assert a_uid not in b_uids.values(), (a_uid, b_uids)
    b_dir = _sh(http, "u6-b0", "u6-b0-2", "pwd").strip()

    # and C, with whatever is left, reads none of B's files
    got = _sh(http, "u6-c", "u6-c4",
              f"for s in ./sh priv/sh2; do [ -e $s ] && $s -p -c 'cat {b_dir}/secret'; done; "
              f"cat {b_dir}/secret; true")
    assert "private" not in got, got
    left = _sh(http, "u6-c", "u6-c5", "ls -A; ls -A priv")
    assert left.split() == ["priv"], left  # sh, sh2 and adir went with A

    for t in ("u6-c", *b_uids):
        http.delete(f"/v1/trajectories/{t}")


def test_uids_rotate_oldest_freed_first(http):
    """Closing and opening in turn never gets the just-freed uid back: each close sends
    its uid to the back of the queue."""
    seen: list[int] = []
    for i in range(6):
        tid = f"u6-rot{i}"
        _open(http, tid)
        seen.append(int(_sh(http, tid, f"{tid}-1", "id -u")))
        assert http.delete(f"/v1/trajectories/{tid}").status_code == 200
    assert len(set(seen)) == len(seen), seen


def test_a_smaller_uid_count_rotates_the_same_way_within_its_block(tmp_path):
    """``--sandbox-uids N``: the first N ids of the block, handed out oldest freed first
    (the rotation the tests above check on the default 4,096, in N opens)."""
    from executor.backends.process.uids import BLOCK, UidBlock

    block = UidBlock(tmp_path, size=3)
    try:
        got = [block.take() for _ in range(3)]
        assert got == [block.first, block.first + 1, block.first + 2]
        with pytest.raises(OSError, match="all 3 sandbox user ids are taken"):
            block.take()
        block.give(got[1])
        block.give(got[0])
        assert [block.take(), block.take()] == [got[1], got[0]]
    finally:
        os.close(block.fd)
    for bad in (1, BLOCK + 1):
        with pytest.raises(ValueError, match="sandbox uids"):
            UidBlock(tmp_path, size=bad)
