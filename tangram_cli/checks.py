"""What `tangram run` and `tangram serve` check before they start, and what `run` says
after it ended, so that a run cannot fail every action and still look fine.

As root, the process backend runs each trajectory's commands under a user id of its
own (executor/backends/process/uids.py). Those users must reach the Python that runs
Tangram's helpers (``python -m executor.bench.burn``: every replayed action) and the
package itself. A venv below ``/root`` (mode 0700) is the usual trap: the interpreter
its symlink points at is reachable, the venv (``sys.prefix``, its site-packages) and
the package are not, and every action fails with ``No module named 'executor'``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import executor

#: an unprivileged user id that is not the server's: what a sandbox user may do, it may
NOBODY = 65534
#: what a sandbox user must be able to run: the replay's helper (every replayed action)
PROBE = "import executor.bench.burn"


def blocked_dirs(path: Path) -> list[Path]:
    """The directories on the way to ``path`` - as written (a venv's ``bin/python``
    symlink) and resolved - that other users cannot pass through (no ``o+x``)."""
    out: list[Path] = []
    for p in (Path(os.path.abspath(path)), Path(os.path.realpath(path))):
        for d in reversed(p.parents):
            try:
                ok = bool(os.stat(d).st_mode & 0o001)
            except FileNotFoundError:  # made later, by the server (0711)
                continue
            except OSError:
                ok = False
            if not ok and d not in out:
                out.append(d)
    return out


def sandbox_reach_problem(python: str = sys.executable, uid: int = NOBODY) -> str | None:
    """Why the sandbox users of a root process backend cannot run ``python`` with the
    Tangram package (a message naming the directories and the fix), or None (also when
    not root: commands then run as this user). Tries it for real, as user ``uid``."""
    if os.geteuid() != 0:
        return None
    needed = [Path(python), Path(sys.prefix), Path(executor.__file__).parent]
    try:
        probe = subprocess.run([python, "-c", PROBE], cwd="/", user=uid, group=uid,
                               extra_groups=[], env={"PATH": os.environ.get("PATH", "")},
                               capture_output=True, text=True, timeout=120)
        failed = probe.returncode != 0
        said = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
    except (OSError, subprocess.SubprocessError) as e:
        failed, said = True, str(e)
    blocked = [d for p in needed for d in blocked_dirs(p)]
    blocked = list(dict.fromkeys(blocked))  # each once, in order
    if not failed:
        return None
    where = ", ".join(map(str, blocked)) or "(no directory on the way lacks o+x: check the " \
                                            "files' read permissions)"
    return (f"the process backend runs commands as sandbox users (this is root), and they "
            f"cannot run {python} with Tangram ({said}); directories they cannot pass "
            f"through: {where}. Fix: `chmod o+x` those directories (others may pass "
            "through, not list them), or install Tangram where other users can enter "
            "(e.g. python3 -m venv /opt/tangram && /opt/tangram/bin/pip install tangram-rl)")


def all_failed(out: Path) -> str | None:
    """When every action of a live run in ``out`` failed: a message naming the
    commonest error (its count, and an action's output's last line), else None."""
    path = out / "outputs.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or any(r.get("status") == "ok" for r in rows):
        return None
    causes: Counter[str] = Counter()
    for r in rows:
        tail = [line for line in str(r.get("output_tail") or "").splitlines() if line.strip()]
        causes[" | ".join(x for x in (r.get("error") or r.get("status"),
                                      tail[-1][:200] if tail else "") if x)] += 1
    cause, n = causes.most_common(1)[0]
    return (f"every action failed ({len(rows)}/{len(rows)}); the commonest error "
            f"({n} actions): {cause} (each action's output tail: {path})")


#: the program of the shipped reward (examples/verl_tool.yaml): what `serve` checks by default
REWARD_COMMAND = "python3 -m pytest"


def reward_probe(command: str) -> str | None:
    """A shell script that exits non-zero, saying what is missing, when ``command``'s
    program (and, for ``PROG -m MODULE``, the module) is not there; None when
    ``command`` does not split."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return None
    if not argv:
        return None
    prog = shlex.quote(argv[0])
    script = (f"command -v {prog} >/dev/null 2>&1 || "
              f"{{ echo {shlex.quote(f'program {argv[0]!r} not found on PATH')}; exit 127; }}")
    if len(argv) >= 3 and argv[1] == "-m":
        find = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
        script += (f"; {prog} -c {shlex.quote(find)} {shlex.quote(argv[2])} || "
                   f"{{ echo {shlex.quote(f'{argv[0]} has no module {argv[2]!r}')}; exit 1; }}")
    return script


def reward_image_problem(command: str, image: str) -> str | None:
    """Why ``command``'s program cannot run in docker ``image`` as the docker backend
    runs it (the default image on the host's ``/usr`` with the image's environment; a
    task's image on its own), or None. The image is built first when it is the default
    one and missing (the backend would build it at its start anyway)."""
    script = reward_probe(command)
    if script is None:
        return f"--reward-command: cannot split {command!r}"
    import docker

    from executor.backends.docker.backend import (
        HOST_MOUNTS,
        HOST_ROOTFS,
        IMAGE,
        SANDBOX_USER,
        ensure_image,
    )

    try:
        client = docker.from_env()
        try:
            ensure_image(client, image)
            labels = client.api.inspect_image(image).get("Config", {}).get("Labels") or {}
            host = image == IMAGE or labels.get(HOST_ROOTFS) == "host"
            mounts = {p: {"bind": p, "mode": "ro"} for p in HOST_MOUNTS if os.path.exists(p)}
            # as the backend runs commands: the sandbox user, no capabilities
            box = client.containers.create(
                image, ["/bin/sh", "-c", script], network_mode="none", user=SANDBOX_USER,
                cap_drop=["ALL"], volumes=mounts if host else {},
                environment={"HOME": "/tmp", "PATH": "/usr/bin:/bin"} if host else {})
            try:  # (removed whatever happens once it exists: a start that fails too)
                box.start()
                code = box.wait(timeout=120).get("StatusCode")
                said = box.logs().decode(errors="replace").strip().splitlines()
            finally:
                box.remove(force=True)
        finally:
            client.close()
    except (docker.errors.DockerException, ValueError, OSError) as e:
        return f"the reward command {command!r} could not be checked in {image!r}: {e}"
    if code == 0:
        return None
    return (f"the reward command {command!r} cannot run in the docker image {image!r}: "
            f"{said[-1] if said else f'exit code {code}'}; every rollout's reward on it "
            "would be reward_status 'error'. Build an image that has it (`tangram image "
            "build` adds pytest and pytest-xdist to the default one), or name your "
            "reward's program with --reward-command ('' skips this check)")


def reward_command_problem(command: str, uid: int = NOBODY) -> str | None:
    """Why ``command``'s program cannot run in the process backend's default sandbox
    (this machine, with the backend's environment; as a sandbox user when root), or None.
    The docker backend's default image runs the host's programs the same way."""
    script = reward_probe(command)
    if script is None:
        return f"--reward-command: cannot split {command!r}"
    from executor.backends.process.backend import scrubbed_env

    user = {"user": uid, "group": uid, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        res = subprocess.run(["sh", "-c", script], cwd="/", env=scrubbed_env(os.environ),
                             capture_output=True, text=True, timeout=120, **user)
    except (OSError, subprocess.SubprocessError) as e:
        return f"the reward command {command!r} could not be checked: {e}"
    if res.returncode == 0:
        return None
    said = (res.stdout + res.stderr).strip().splitlines() or [f"exit code {res.returncode}"]
    return (f"the reward command {command!r} cannot run in the default sandbox: {said[-1]}; "
            "every rollout's reward would be reward_status 'error'. Install it where the "
            "sandboxes run (process backend: on this machine's PATH; docker: the image, "
            "`tangram image build`), or name your reward's program with --reward-command "
            "('' skips this check)")
