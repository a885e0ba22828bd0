"""What a sandbox's private /tmp costs per command on the process backend.

Two source trees - ``--before`` (e.g. ``git archive <commit> | tar -x -C DIR`` of a
commit without the mount namespace) and this one - each serve the same load in turn:
a real ``tangram serve --backend process`` (as root: sandbox users, the namespace per
command), ``--trajectories`` open trajectories, ``--actions`` trivial commands
(``true``) each, ``--concurrency`` at once. Rounds alternate the trees (the machine is
loaded: a drift in load hits both). Per round, from ``/proc/<server>/stat``: the server's
own CPU and its reaped children's (the commands' exec chains) per action, in ms. Prints
one JSON line: each tree's medians over the rounds, and the load average.

    python -m analysis.bench.tmp_cost --before /tmp/before [--rounds 4] [--actions 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from analysis.bench.serving import stop, wait_healthy

HERE = Path(__file__).resolve().parents[2]


def _cpu_ms(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU of ``pid`` so far, in ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    own = (int(fields[11]) + int(fields[12])) * 1000 / tick
    kids = (int(fields[13]) + int(fields[14])) * 1000 / tick
    return own, kids


async def _load(url: str, token: str, trajectories: int, actions: int, conc: int,
                pid: int) -> tuple[float, float]:
    from tangram_sdk.client import TangramClient

    async with TangramClient(url, token, timeout_s=300) as tg:
        ids = [await tg.open_trajectory(task="tmpcost", mem_gb=0.1) for _ in range(trajectories)]
        for t in ids:  # warm: each trajectory's first action (its directories made)
            await tg.run(t, argv=["true"])
        gate = asyncio.Semaphore(conc)

        async def one(t: str) -> None:
            async with gate:
                res = await tg.run(t, argv=["true"])
                assert res["status"] == "ok" and res["exit_code"] == 0, res

        own0, kids0 = _cpu_ms(pid)
        await asyncio.gather(*(one(t) for t in ids for _ in range(actions)))
        own1, kids1 = _cpu_ms(pid)
        for t in ids:
            await tg.close_trajectory(t)
    n = trajectories * actions
    return (own1 - own0) / n, (kids1 - kids0) / n


def one_round(tree: Path, trajectories: int, actions: int, conc: int) -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "bench-" + os.urandom(8).hex()
    with tempfile.TemporaryDirectory(prefix="tmpcost-") as tmp:
        os.chmod(tmp, 0o755)  # the work root must be reachable by the sandbox users
        log = Path(tmp) / "server.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--port", str(port), "--backend",
             "process", "--state-dir", tmp],
            env={**os.environ, "TANGRAM_TOKEN": token, "PYTHONPATH": str(tree)},
            stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=tree)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, log, 120.0)
            return asyncio.run(_load(url, token, trajectories, actions, conc, proc.pid))
        finally:
            stop(proc)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True,
                    help="a source tree without the per-command mount namespace")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--actions", type=int, default=50, help="per trajectory and round")
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("tmp_cost: run as root (the namespace is made only for sandbox users)")
    trees = {"before": a.before.resolve(), "after": HERE}
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in trees}
    for _ in range(a.rounds):
        for name, tree in trees.items():
            got[name].append(one_round(tree, a.trajectories, a.actions, a.concurrency))
    out: dict = {"bench": "tmp_cost", "actions_per_round": a.trajectories * a.actions,
                 "rounds": a.rounds}
    for name, rows in got.items():
        out[name] = {"server_cpu_ms_per_action": round(statistics.median(r[0] for r in rows), 3),
                     "children_cpu_ms_per_action": round(statistics.median(r[1] for r in rows),
                                                         3),
                     "rounds": [[round(x, 3) for x in r] for r in rows]}
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    out["cpus"] = os.cpu_count()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
