"""Benchmark: images pulled from a registry, live (the live half).

    python -m analysis.bench.images_live                       # 32 trajectories, 8 images
    python -m analysis.bench.images_live --image-mb 64 --bandwidth-mb 512

Starts a real registry on 127.0.0.1 (Debian's docker-registry, tests/registry.py), builds
``--images`` images here (the default image's empty root filesystem plus ``--image-mb``
of random bytes each: a distinct layer that does not compress), pushes them and removes
them from the engine. Then:

* **pull bandwidth**: one image of ``--bandwidth-mb`` pulled ``--repeats`` times through
  the engine (removed between): bytes of its layer / seconds of the pull (download,
  checksum and unpacking on this machine's storage driver: what a node's pull costs);
  and a pull's own cost, whatever its size: an image of 1 MB pulled as often, its median
  seconds less what its bytes take at that bandwidth (``overhead_s``);
* **cold, then warm**: ``tangram serve --backend docker`` opens ``--trajectories``
  trajectories over the images (round robin, all at once: an RL step's rollouts), each
  running one action (``true``); a trajectory's *first-action latency* is from its open
  request to its first action's result. Cold: no image on the node (each pulled once,
  shared by its trajectories, ``--image-pulls`` at once). Cached: the same again under
  new ids at once, every image cached, on a server started anew, so no warm sandbox of
  them exists (after the cold burst the old server's refill would hand the cached step
  sandboxes half made, a different number each run: what that step measured then was
  the refill's progress, not the cache); how many warm sandboxes it found is printed.
  Warm: again, once the warm pool per image is full;
* **a cache hit**: an open of a cached image against an open without an image, each
  ``--repeats`` times, alone (no burst): what the image costs an open once it is here;
  and its actions (``true``) after the first, alone: what an action costs here;
* **a container start**: the docker backend's own creation of a sandbox (its
  ``_create``: create, start, its agent listening), ``--repeats`` times alone, and
  ``--trajectories`` at the backend's ``CREATORS`` at once (creations a second): what
  the simulation of the run (analysis/bench/images_replica.py) takes as the machine's
  environment start.

Prints one JSON object and writes it to ``--out``. Wall times come with the load average
and the CPU seconds (user+sys) of the server and of dockerd (where readable).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import docker
import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the registry the tests run

from registry import Registry, remove_images, unique  # noqa: E402

from analysis.bench.server import start_server  # noqa: E402

TOKEN = "bench-token"
H = {"Authorization": f"Bearer {TOKEN}"}
MB = 1_000_000


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def cpu_s(pid: int) -> float | None:
    """User+sys CPU seconds of process ``pid`` (None where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def dockerd_pid() -> int | None:
    out = subprocess.run(["pidof", "dockerd"], capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.split() else None


def load() -> float:
    return round(os.getloadavg()[0], 2)


def timed_pulls(client: docker.DockerClient, reg: Registry, mb: int,
                repeats: int) -> tuple[int, list[float]]:
    """Pull one image of ``mb`` MB ``repeats`` times (removed between): the bytes of its
    layer and the seconds of each pull."""
    p = reg.build_and_push(unique("bandwidth"), mb * MB, client)
    layer = reg.manifest(p.tag.split("/", 1)[1].rsplit(":", 1)[0], "1")["layers"][0]["size"]
    secs = []
    try:
        for _ in range(repeats):
            t = time.monotonic()
            for event in client.api.pull(p.digest.split("@")[0], tag=p.digest.split("@")[1],
                                         stream=True, decode=True):
                if "error" in event:
                    raise SystemExit(f"bench: pull failed: {event['error']}")
            secs.append(time.monotonic() - t)
            client.api.remove_image(p.digest)
    finally:
        remove_images([p.digest, p.tag], client)
    return layer, secs


def pull_bandwidth(client: docker.DockerClient, reg: Registry, mb: int,
                   repeats: int) -> dict:
    """MB/s of pulls of an ``mb`` MB image, and a pull's own cost (the module's text)."""
    dpid = dockerd_pid()
    d0 = cpu_s(dpid) if dpid else None
    layer, secs = timed_pulls(client, reg, mb, repeats)
    d1 = cpu_s(dpid) if dpid else None
    rates = [round(layer / MB / dt, 1) for dt in secs]
    bw = statistics.median(rates)
    small, small_secs = timed_pulls(client, reg, 1, repeats)
    overhead = max(statistics.median(small_secs) - small / MB / bw, 0.0)
    return {"image_mb": round(layer / MB, 1), "pull_s": [round(s, 3) for s in secs],
            "mb_per_s": rates, "mb_per_s_median": bw,
            "small_pull_s": [round(s, 3) for s in small_secs], "overhead_s": round(overhead, 4),
            "load": load(),
            "dockerd_cpu_s": round(d1 - d0, 2) if d0 is not None and d1 is not None else None}


async def step(url: str, assignment: list[tuple[str, str]]) -> dict:
    """Open every (id, image) at once, one action each; first-action latency per trajectory."""
    async with httpx.AsyncClient(base_url=url, headers=H, timeout=1800) as c:
        async def one(tid: str, image: str) -> tuple[float, dict]:
            t = time.monotonic()
            r = await c.post("/v1/trajectories", json={"id": tid, "image": image})
            if r.status_code != 201:
                raise SystemExit(f"bench: open of {tid} ({image}) failed: {r.text}")
            res = (await c.post(f"/v1/trajectories/{tid}/actions", params={"wait": 600},
                                json={"id": f"{tid}-1", "command": "true"})).json()
            if res.get("status") != "ok":
                raise SystemExit(f"bench: {tid}'s action: {res}")
            return time.monotonic() - t, r.json()["image"]

        t0 = time.monotonic()
        got = await asyncio.gather(*(one(tid, image) for tid, image in assignment))
        wall = time.monotonic() - t0
        for tid, _ in assignment:
            await c.delete(f"/v1/trajectories/{tid}")
        status = (await c.get("/v1/status")).json()["images"]
    lat = [g[0] for g in got]
    pulls = [g[1] for g in got if g[1]["pulled"] and not g[1]["shared"]]
    return {"first_action_p50_s": percentile(lat, 0.5), "first_action_p99_s": percentile(lat, 0.99),
            "first_action_max_s": round(max(lat), 3), "wall_s": round(wall, 3),
            "pulls": len(pulls), "pull_s": [p["pull_s"] for p in pulls],
            "pull_queued_s": [p["queued_s"] for p in pulls],
            "pulled_mb": round(sum(p["bytes"] for p in pulls) / MB, 1),
            "hits": sum(not g[1]["pulled"] for g in got), "load": load(),
            "counters": status["counters"]}


def wait_warm(url: str, want: int, within_s: float = 300.0) -> float | None:
    """Seconds until the warm pools hold ``want`` sandboxes of the images (None: not
    within ``within_s``; the warm step then runs with what there is)."""
    t = time.monotonic()
    while time.monotonic() - t < within_s:
        warm = httpx.get(url + "/v1/status", headers=H, timeout=60).json()["images"]["warm"]
        if sum(n for image, n in warm.items() if "@sha256:" in image) >= want:
            return round(time.monotonic() - t, 2)
        time.sleep(0.5)
    return None


def container_start(repeats: int, burst: int) -> dict:
    """The docker backend's sandbox creation (``DockerBackend._create``, what an open
    without a warm sandbox waits for): seconds of each alone, then ``burst`` made at
    ``CREATORS`` at once (creations a second). Its own backend instance, before the
    server starts, every container removed again."""
    from concurrent.futures import ThreadPoolExecutor

    from executor.backends.docker.backend import CREATORS, DockerBackend

    backend = DockerBackend()
    alone: list[float] = []
    try:
        for i in range(repeats):
            t = time.monotonic()
            box = backend._create(unique(f"start{i}"), backend.image, 0.0)
            alone.append(time.monotonic() - t)
            backend._discard(box)
        with ThreadPoolExecutor(CREATORS) as pool:
            t = time.monotonic()
            boxes = list(pool.map(lambda i: backend._create(unique(f"burst{i}"),
                                                            backend.image, 0.0), range(burst)))
            wall = time.monotonic() - t
            list(pool.map(backend._discard, boxes))
    finally:
        backend.shutdown()
    return {"alone_s": [round(x, 3) for x in alone],
            "alone_median_s": round(statistics.median(alone), 4),
            "burst": burst, "at_once": CREATORS, "burst_s": round(wall, 3),
            "per_s": round(burst / wall, 2), "load": load()}


async def hit_cost(url: str, image: str, repeats: int) -> dict:
    """Open (and close) alone: with a cached image, and with none; seconds of each open,
    and of the cached image's actions (``true``) after its first."""
    out: dict[str, list[float]] = {"cached_image": [], "no_image": [], "action": []}
    async with httpx.AsyncClient(base_url=url, headers=H, timeout=600) as c:
        for i in range(repeats):
            for kind, body in (("cached_image", {"image": image}), ("no_image", {})):
                tid = f"hit-{kind}-{i}"
                t = time.monotonic()
                r = await c.post("/v1/trajectories", json={"id": tid, **body})
                out[kind].append(time.monotonic() - t)
                if r.status_code != 201:
                    raise SystemExit(f"bench: open {tid}: {r.text}")
                # the actions after the first: the first may wait for its container (an
                # open returns before a container not taken warm has started); 5 each, as
                # one `true` takes 7-170 ms here beside other work
                for n in range(1, 7) if kind == "cached_image" else ():
                    t = time.monotonic()
                    res = (await c.post(f"/v1/trajectories/{tid}/actions",
                                        params={"wait": 600},
                                        json={"id": f"{tid}-{n}", "command": "true"})).json()
                    if n > 1:
                        out["action"].append(time.monotonic() - t)
                    if res.get("status") != "ok":
                        raise SystemExit(f"bench: {tid}'s action: {res}")
                await c.delete(f"/v1/trajectories/{tid}")
    return {**{k: {"median_ms": round(1000 * statistics.median(v), 2),
                   "p99_ms": round(1000 * max(v), 2)} for k, v in out.items()},
            "action_s": [round(x, 4) for x in out["action"]]}


def run(images: int = 8, trajectories: int = 32, image_mb: int = 16,
        bandwidth_mb: int = 256, repeats: int = 3, image_pulls: int = 2) -> dict:
    """The whole live bench (see the module's text): its result, nothing left behind."""
    client = docker.from_env()
    scratch = Path(tempfile.mkdtemp(prefix="bench-images-"))
    reg = Registry(scratch / "registry").start()
    digests: list[str] = []
    pushed = []
    proc = None
    try:
        print(f"bench: pulling a {bandwidth_mb} MB image {repeats} times", file=sys.stderr)
        bandwidth = pull_bandwidth(client, reg, bandwidth_mb, repeats)
        print(f"bench: building and pushing {images} images of {image_mb} MB",
              file=sys.stderr)
        pushed = [reg.build_and_push(unique(f"bench{i}"), image_mb * MB, client)
                  for i in range(images)]
        digests = [p.digest for p in pushed]
        print("bench: container starts", file=sys.stderr)
        start = container_start(max(5, repeats), trajectories)
        serve = ["--backend", "docker", "--image-pulls", str(image_pulls)]
        proc, url = start_server(scratch / "state", TOKEN, serve)
        dpid = dockerd_pid()
        before = (cpu_s(proc.pid), cpu_s(dpid) if dpid else None)
        server_cpu = 0.0
        result: dict = {"registry": reg.host, "bandwidth": bandwidth, "images": images,
                        "image_mb": image_mb,
                        "image_bytes": [p.size for p in pushed],
                        "trajectories": trajectories, "image_pulls": image_pulls,
                        "container_start": start}
        for name in ("cold", "cached", "warm"):
            if name == "cached":  # a server started anew (the module's text says why)
                server_cpu += (cpu_s(proc.pid) or 0.0) - (before[0] or 0.0)
                proc.terminate()
                proc.wait(60)
                proc, url = start_server(scratch / "state-cached", TOKEN, serve)
                before = (cpu_s(proc.pid), before[1])
            if name == "warm":  # the warm pool per image is made in the quiet after a burst
                result["warm_pool_fill_s"] = wait_warm(url, min(trajectories, 64))
            print(f"bench: {name} step", file=sys.stderr)
            assignment = [(f"{name}-{i}", digests[i % len(digests)])
                          for i in range(trajectories)]
            warm_before = sum(httpx.get(url + "/v1/status", headers=H, timeout=60).json()[
                "images"]["warm"].get(image, 0) for image in digests)
            result[name] = asyncio.run(step(url, assignment))
            result[name]["warm_sandboxes_at_start"] = warm_before
        result["hit"] = asyncio.run(hit_cost(url, digests[0], max(5, repeats)))
        after = (cpu_s(proc.pid), cpu_s(dpid) if dpid else None)
        result["server_cpu_s"] = round(server_cpu + after[0] - before[0], 2) if None not in (
            after[0], before[0]) else None
        result["dockerd_cpu_s"] = round(after[1] - before[1], 2) if None not in (
            after[1], before[1]) else None
        result["load_end"] = load()
        return result
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        remove_images(digests + [p.tag for p in pushed], client)
        reg.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--trajectories", type=int, default=32)
    ap.add_argument("--image-mb", type=int, default=16, help="random bytes in each image")
    ap.add_argument("--bandwidth-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--image-pulls", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "images_live.json")
    args = ap.parse_args()
    result = run(args.images, args.trajectories, args.image_mb, args.bandwidth_mb,
                 args.repeats, args.image_pulls)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
