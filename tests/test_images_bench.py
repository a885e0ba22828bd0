"""`tangram bench images --live` (issue 50 #5): the live images bench beside its
simulation. The CLI run is real (docker, Debian's docker-registry started by the bench,
`tangram serve --backend docker`); the simulation's own checks need neither.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import docker

from analysis.bench.images_replica import STEPS, live_cluster, live_trace, simulated

ROOT = Path(__file__).resolve().parents[1]


def tags_from(registry: str) -> set[str]:
    """Tags of the engine's images pushed to ``registry`` (host:port)."""
    tags = {t for image in docker.from_env().images.list() for t in image.tags}
    return {t for t in tags if t.startswith(registry + "/")}


def test_cli_live_quick_prints_live_and_simulated_latency_side_by_side():
    res = subprocess.run([sys.executable, str(ROOT / "cli.py"), "bench", "images", "--live",
                          "--quick"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    # both halves: the simulated study first (its per-policy summaries), then the live run
    simulated_policies = {r["policy"] for r in rows if "policy" in r and "step" not in r}
    assert {"tangram", "k8s", "tangram-prepulled"} <= simulated_policies, rows
    steps = {r["step"]: r for r in rows if "step" in r}
    assert set(steps) == set(STEPS), rows
    for step, row in steps.items():
        for col in ("live_p50_s", "live_p99_s", "sim_p50_s", "sim_p99_s", "ratio_p50",
                    "ratio_p99"):
            assert isinstance(row[col], float) and math.isfinite(row[col]) and row[col] > 0, (
                step, col, row)
        assert row["live_p50_s"] <= row["live_p99_s"] and row["sim_p50_s"] <= row["sim_p99_s"]
        assert row["ratio_p50"] == round(row["sim_p50_s"] / row["live_p50_s"], 3), row
    measured = [r["measured"] for r in rows if "measured" in r]
    assert len(measured) == 1 and measured[0]["trajectories"] == 8, rows
    # the bench removed what it pushed (its registry's port was its own)
    assert not tags_from(measured[0]["registry"]), tags_from(measured[0]["registry"])


def live_result(mb_per_s: float = 100.0, start_s: float = 0.3, action_s: float = 0.02,
                trajectories: int = 16, images: int = 4) -> dict:
    """What images_live.run returns, as far as the simulation reads it."""
    return {"trajectories": trajectories, "images": images, "image_mb": 50,
            "image_bytes": [50_000_000] * images, "image_pulls": 2,
            "bandwidth": {"mb_per_s_median": mb_per_s},
            "container_start": {"alone_median_s": start_s, "per_s": 2 / start_s},
            "hit": {"action_s": [action_s] * 3, "cached_image": {"median_ms": 20.0}}}


def test_the_simulation_of_a_live_run_is_that_run_on_this_machine():
    live = live_result()
    df = live_trace(live)
    assert len(df) == 16 and df["image"].nunique() == 4 and (df["think_s"] == 0).all()
    assert (df["image_gb"] == 0.05).all() and (df["t1_s"] == 0.02).all()
    spec = live_cluster(live, 0.3)
    assert len(spec.cpu_nodes) == 1
    assert spec.extra["image_pull_mbps"] == 800 and spec.extra["env_start_s"] == 0.3
    sim = simulated(live)
    # cold waits for pulls and container starts, cached for the starts only, warm for neither
    assert sim["cold"]["p50_s"] > sim["cached"]["p50_s"] > sim["warm"]["p50_s"] > 0, sim
    # a slower pull costs the cold step only
    slow = simulated(live_result(mb_per_s=10.0))
    assert slow["cold"]["p99_s"] > sim["cold"]["p99_s"], (slow, sim)
    assert slow["cached"] == sim["cached"] and slow["warm"] == sim["warm"]
