"""Images as a scheduled resource, simulated (the simulation half of `tangram
bench images`): SWE-style rollouts, each trajectory's environment started from its task's
container image, on the paper's CPU nodes with an image cache per node, under tangram
(image-aware placement, pulls ahead) against the Kubernetes pod pulling on demand, the pod
with kube-scheduler's ImageLocality score, and every image pre-pulled everywhere (the
ideal with unbounded disk); and the ablation, tangram placing without regard to images.

Per policy and seed: environment start time (a trajectory's first action, from its submit
until it executes: waiting for a node, for its image and for its container), step time,
mean action completion time, the cache hit rate (the share of environment starts that
needed no pull of their own: sim/images.py ``ImageCaches.counters``) and the stricter share
that found their image already pulled, GB pulled and the fullest cache. Then per policy the mean over seeds
with a 95% interval (Student's t over the seeds' figures).

The pull bandwidth and pulls at once come from the cluster file's ``extra``
(``image_pull_mbps``, ``image_pulls``); the cache size is ``--cache-gb`` per node.

``--live`` runs the live half too, after the simulated one, so one command prints both
(analysis/bench/images_live.py: a registry on
127.0.0.1, ``--live-trajectories`` over ``--live-images`` images of ``--image-mb``,
cold, cached, then warm; needs docker and Debian's docker-registry) and its simulation
(analysis/bench/images_replica.py): a row per step with the first-action latency p50/p99
live and simulated and the ratio sim/live, then a row with the live run's measurements.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Annotated, Any

import numpy as np

from analysis.bench import QUIET, BenchError, Opt, Progress
from sim.cluster import load_cluster
from sim.driver import SimConfig, simulate
from traces.generate import generate
from traces.schema import validate

#: the policies compared, the default first
POLICIES = ("tangram", "k8s", "k8s-image-locality", "tangram-prepulled",
            "tangram-images-on-demand")
#: the figures summarised over seeds
FIGURES = ("env_start_p50_s", "env_start_p99_s", "step_s", "act_mean_s", "cache_hit_rate",
           "held_at_start_rate", "pulled_gb")
#: Student's t, two-sided 95%, by degrees of freedom (1-10; a normal 1.96 past them)
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (Student's t over ``values``)."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return float(x.mean()), math.nan
    t = _T95[len(x) - 2] if len(x) - 2 < len(_T95) else 1.96
    return float(x.mean()), float(t * x.std(ddof=1) / math.sqrt(len(x)))


def run_one(trajectories: int, images: int, cache_gb: float, cluster: str, policy: str,
            seed: int) -> dict[str, Any]:
    """One simulation: its figures as a row."""
    spec = load_cluster(cluster)
    spec = replace(spec, cpu_nodes=tuple(replace(n, image_cache_gb=cache_gb)
                                         for n in spec.cpu_nodes))
    df = validate(generate("swe", trajectories, seed, images=images))
    t0 = time.process_time()
    result = simulate(df, spec, SimConfig(policy=policy, seed=seed))
    cpu_s = time.process_time() - t0
    first: dict[str, float] = {}
    acts = []
    for r in result.records:
        acts.append(r.act_s)
        if r.action_id.endswith("#0"):  # its first action: the one its environment starts for
            first[r.trajectory] = r.start_s - r.submit_s + r.overhead_s
    env = np.fromiter(first.values(), dtype=float)
    c = result.counters
    return {"bench": "images", "policy": policy, "seed": seed, "trajectories": trajectories,
            "images": images, "cache_gb_per_node": cache_gb, "cluster": cluster,
            "cpu_nodes": len(spec.cpu_nodes),
            "image_pull_mbps": spec.extra.get("image_pull_mbps"),
            "image_pulls": spec.extra.get("image_pulls"),
            "env_start_p50_s": float(np.percentile(env, 50)),
            "env_start_p99_s": float(np.percentile(env, 99)),
            "step_s": float(result.steps[0]["step_s"]), "act_mean_s": float(np.mean(acts)),
            "cache_hit_rate": float(c["image_hit_rate"]),
            "held_at_start_rate": float(c["image_held_rate"]),
            "pulled_gb": float(c["image_pulled_gb"]),
            "pulls": int(c["image_pulls"]), "evictions": int(c["image_evictions"]),
            "cache_peak_gb": float(c["image_cache_peak_gb"]), "sim_cpu_s": round(cpu_s, 2)}


def image_rows(trajectories: int = 1024, images: int = 500, cache_gb: float = 200.0,
               cluster: str = "paper", seeds: int = 5, policies: tuple[str, ...] = POLICIES,
               progress: Progress = QUIET) -> Iterator[dict[str, Any]]:
    """A row per (policy, seed), then a summary row per policy: each figure's mean over the
    seeds and its 95% interval's half-width (``<figure>_ci95``)."""
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    total, done = len(policies) * seeds, 0
    for seed in range(seeds):
        for policy in policies:
            progress.phase(f"{policy}, seed {seed}")
            row = run_one(trajectories, images, cache_gb, cluster, policy, seed)
            rows[policy].append(row)
            done += 1
            progress(done, total)
            yield row
    for policy, runs in rows.items():
        summary: dict[str, Any] = {"bench": "images", "summary": True, "policy": policy,
                                   "seeds": list(range(seeds)), "trajectories": trajectories,
                                   "images": images, "cache_gb_per_node": cache_gb,
                                   "cluster": cluster}
        for fig in FIGURES:
            mean, half = interval([r[fig] for r in runs])
            summary[fig] = round(mean, 4)
            summary[f"{fig}_ci95"] = round(half, 4)
        yield summary


def command(
    trajectories: Annotated[int, Opt("SWE-style trajectories per run.", min=1)] = 1024,
    images: Annotated[int, Opt("Task images they draw from (Zipf popularity).", min=1)] = 500,
    cache_gb: Annotated[float, Opt("Image cache per CPU node (GB).", min=1)] = 200.0,
    cluster: Annotated[str, Opt("Cluster YAML or built-in name.")] = "paper",
    seeds: Annotated[int, Opt("Seeds (trace and simulation), 0..N-1.", min=1)] = 5,
    quick: Annotated[bool, Opt("CI size: 128 trajectories over 64 images, 2 seeds (with "
                               "--live: 8 trajectories over 2 images of 4 MB).",
                               flag="--quick")] = False,
    live: Annotated[bool, Opt("Also run the live bench (docker, a local registry) and its "
                              "simulation, side by side, after the simulated study.",
                              flag="--live")] = False,
    live_trajectories: Annotated[int, Opt("--live: trajectories opened at once.",
                                          min=1)] = 32,
    live_images: Annotated[int, Opt("--live: images they use (round robin).", min=1)] = 8,
    image_mb: Annotated[int, Opt("--live: random MB in each image.", min=1)] = 16,
    progress: Progress = QUIET,
) -> Iterator[dict[str, Any]]:
    """Environment start p50/p99, step time, mean ACT, cache hit rate and GB pulled per
    policy and seed (tangram, k8s pulling on demand, k8s with ImageLocality, every image
    pre-pulled), then each policy's means with 95% intervals over the seeds. With --live,
    then the live run's first-action latency beside its simulation's."""
    if quick:
        trajectories, images, seeds = 128, 64, 2
    try:
        yield from image_rows(trajectories, images, cache_gb, cluster, seeds,
                              progress=progress)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if live:
        yield from live_rows(live_trajectories, live_images, image_mb, quick, progress)


def live_rows(trajectories: int, images: int, image_mb: int, quick: bool,
              progress: Progress = QUIET) -> Iterator[dict[str, Any]]:
    """The live bench and its simulation (imported here: the live half needs docker)."""
    from analysis.bench import images_live, images_replica

    if quick:
        trajectories, images, image_mb = 8, 2, 4
    progress.phase(f"live: {trajectories} trajectories over {images} images of {image_mb} MB")
    try:
        result = images_live.run(images, trajectories, image_mb,
                                 bandwidth_mb=16 if quick else 256, repeats=1 if quick else 3)
    except RuntimeError as e:  # no docker-registry here (tests/registry.py says so)
        raise BenchError(f"--live: {e}") from None
    progress.phase("simulating the same run")
    yield from images_replica.side_by_side(result)
    yield {"bench": "images", "live": True, "measured": result}
