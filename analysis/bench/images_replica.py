"""The simulation of a live images run (`tangram bench images --live`): the
same trajectories over the same images of the same sizes, the same actions, on a cluster
file that describes this machine as the live run measured it, and its first-action
latency beside the live one.

What the cluster file takes from the live result (analysis/bench/images_live.py), and
nothing else:

* the node: this machine's allowed cores and memory (``local_cluster``, as `tangram run`
  writes the cluster it ran on);
* ``extra.image_pull_mbps``: the pull bandwidth the run measured through the engine (its
  median MB/s x 8), ``extra.image_pull_overhead_s``: a pull's own cost it measured (a 1
  MB image's pull less its bytes' time), ``extra.image_pulls``: the server's pulls at once;
* ``extra.env_start_s``: what a sandbox's creation takes in a burst (``env_start``): the
  node's cores over the creations a second the docker backend made when the run made as
  many sandboxes as it has trajectories at once; the simulator takes it as every
  environment start (sim/driver.py ``startup_of``), on the first action's core;
* each action's ``t1_s``: an action (``true``) of an open trajectory alone, median.

The three live steps map to: *cold* (no image held: each pulled once, shared by its
trajectories), *cached* (every image held at the start: policy ``tangram-prepulled``)
and *warm* (held, and every environment already started: a warm sandbox per trajectory,
whose start costs only its open: ``env_start_s`` is what an open of a cached image took
alone). The simulator has no warm pool of its own, and what its
model leaves out shows as the ratio (docs/images.md says which).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from executor.node.local import local_cluster
from sim.driver import SimConfig, simulate
from tangram.cluster import ClusterSpec
from traces.schema import validate

#: the live steps, each with the simulated policy and whether its environments start warm
STEPS: dict[str, tuple[str, bool]] = {"cold": ("tangram", False),
                                      "cached": ("tangram-prepulled", False),
                                      "warm": ("tangram-prepulled", True)}


def live_trace(live: dict[str, Any]) -> pd.DataFrame:
    """The live run's trajectories: all opened at once, trajectory i on image i mod N, one
    action each taking what ``true`` took alone."""
    sizes = live["image_bytes"]
    t1 = float(np.median(live["hit"]["action_s"]))
    rows = [{"task": "live", "trajectory": f"live-{i:04d}", "seq": 0, "kind": "shell",
             "think_s": 0.0, "t1_s": t1, "cpu_cores": "1",
             "image": f"live-image-{i % len(sizes)}",
             "image_gb": sizes[i % len(sizes)] / 1e9}
            for i in range(live["trajectories"])]
    return validate(pd.DataFrame(rows))


def env_start(live: dict[str, Any]) -> float:
    """Seconds of one environment start in the simulation of ``live``'s bursts. The
    simulator starts an environment on its first action's core, so a node starts as many
    at once as it has cores; a burst's starts are bounded by the engine's rate of
    creations (dockerd, runc and the storage driver on the same cores: 4 a second here
    whether made 2 or 4 at once), which one creation alone overstates (0.3 s alone, 0.48
    s each of a burst on 2 cores). So each start takes the cores over the burst's rate."""
    cores = local_cluster().cpu_nodes[0].cores
    return cores / float(live["container_start"]["per_s"])


def live_cluster(live: dict[str, Any], env_start_s: float) -> ClusterSpec:
    """This machine as the live run measured it (see the module's text)."""
    spec = local_cluster()
    return replace(spec, extra={**spec.extra,
                                "image_pull_mbps": live["bandwidth"]["mb_per_s_median"] * 8,
                                "image_pull_overhead_s": live["bandwidth"].get("overhead_s",
                                                                               0.0),
                                "image_pulls": live["image_pulls"],
                                "env_start_s": env_start_s})


def simulated(live: dict[str, Any], seed: int = 0) -> dict[str, dict[str, float]]:
    """Per live step: the simulated first-action latency p50/p99 (s), from the trajectory's
    open (its first action's submit: no think time) to its first action's end."""
    df = live_trace(live)
    out = {}
    for step, (policy, warm) in STEPS.items():
        # a warm sandbox is taken at open, but the open is still the server's work: what
        # an open of a cached image took alone (the simulator has no open of its own)
        start = live["hit"]["cached_image"]["median_ms"] / 1000 if warm else env_start(live)
        result = simulate(df, live_cluster(live, start), SimConfig(policy=policy, seed=seed))
        lat = [r.end_s - r.submit_s for r in result.records if r.action_id.endswith("#0")]
        out[step] = {"p50_s": float(np.percentile(lat, 50)),
                     "p99_s": float(np.percentile(lat, 99))}
    return out


def side_by_side(live: dict[str, Any], seed: int = 0) -> list[dict[str, Any]]:
    """A row per step: live and simulated p50/p99 and the ratio sim/live of each."""
    sim = simulated(live, seed)
    rows = []
    for step in STEPS:
        row: dict[str, Any] = {"bench": "images", "live": True, "step": step,
                               "trajectories": live["trajectories"], "images": live["images"],
                               "image_mb": live["image_mb"]}
        for q in ("p50", "p99"):
            got = live[step][f"first_action_{q}_s"]
            row[f"live_{q}_s"] = got
            row[f"sim_{q}_s"] = simmed = round(sim[step][f"{q}_s"], 4)
            # of the figures as printed, so a reader's own division agrees
            row[f"ratio_{q}"] = round(simmed / got, 3) if got else math.nan
        rows.append(row)
    return rows
