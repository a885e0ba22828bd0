"""The regret matrix's hardest cells at a small size, with a seed of their own: the default
policy within the issue's bounds of the competitor that beat it before (mean ACT and step
time <= 1.03, p99 ACT <= 1.10). Figures are simulated (virtual time): no wall clock."""

from __future__ import annotations

import json
from functools import cache

import pytest

from analysis.regret import (
    ALIASES,
    BOUNDS,
    COMPETITORS,
    SCALES,
    Cell,
    best_baselines,
    cells,
    cluster_of,
    losses_markdown,
    measure,
    row_of,
    summarise,
    trace_of,
)
from sim.driver import SimConfig, simulate
from tangram.policies import REGISTRY

#: a seed no other test or study uses
SEED = 4177


@cache
def _run(cell: Cell, policy: str) -> dict[str, float]:
    sc = SCALES["quick"]
    return measure(simulate(trace_of(cell), cluster_of(cell, sc),
                            SimConfig(policy=policy, seed=cell.seed)))


def _within(ours: dict[str, float], theirs: dict[str, float],
            metrics: tuple[str, ...] = ("act_mean_s", "act_p99_s", "step_time_s")) -> None:
    ratios = {m: ours[m] / theirs[m] for m in metrics}
    over = {m: r for m, r in ratios.items() if r > BOUNDS[m]}
    assert not over, f"regret over the bound: {over} (all: {ratios})"


@pytest.mark.parametrize("cluster,rate,metric", [
    ("paper", 3.0, "act_mean_s"), ("paper", 3.0, "act_p99_s"), ("over", 1.0, "act_mean_s"),
    # (a known loss until runs in flight were read as censored: p99 ACT 1.345x
    # fixed-dop:4's, the tail unprofiled tests of 40-85 s started on 1-2 cores; then
    # 0.947x, 1.011x since the objective weighs squared completion times)
    ("over", 1.0, "act_p99_s")])
def test_high_load_coding_act_within_bounds_of_fixed_dop_4(cluster: str, rate: float,
                                                           metric: str) -> None:
    cell = Cell("coding", SEED, cluster, rate, 0.3, 24, "quick")
    _within(_run(cell, "tangram"), _run(cell, "fixed-dop:4"), (metric,))


@pytest.mark.parametrize("cluster,rate", [
    # (a known loss until the objective weighed squared completion times: step time
    # 1.053x fixed-dop:4's here; 0.910x since)
    ("paper", 3.0),
    ("over", 1.0)])
def test_high_load_coding_step_within_bound_of_fixed_dop_4(cluster: str, rate: float) -> None:
    cell = Cell("coding", SEED, cluster, rate, 0.3, 24, "quick")
    _within(_run(cell, "tangram"), _run(cell, "fixed-dop:4"), ("step_time_s",))


def test_mopd_within_bounds_of_tangram_paper() -> None:
    # a small GPU pool at the generator's rate: before, the paper's rules won here 1.2-1.75x
    # (a new variant on one GPU while seven sat free)
    cell = Cell("mopd", SEED, "over", 1.0, 0.3, 64, "quick")
    _within(_run(cell, "tangram"), _run(cell, "tangram-paper"))


def test_every_competitor_names_a_policy_and_aliases_name_a_run() -> None:
    for workload, comps in COMPETITORS.items():
        labels = {c.label for c in comps} | {"tangram"}
        for c in comps:
            assert c.policy.startswith("fixed-dop:") or c.policy in REGISTRY, c
        for alias, target in ALIASES[workload].items():
            assert target in labels, (workload, alias, target)
        # every policy of `tangram policies` is either run or an alias on every workload
        named = labels | set(ALIASES[workload]) | {c.policy for c in comps}
        missing = [p for p in REGISTRY if p != "fixed-dop:N" and p not in named]
        assert not missing, (workload, missing)


def test_row_and_summary_name_the_winner_and_the_best_single_configuration() -> None:
    cell = Cell("coding", 1, "paper", 1.0, 0.0, 4, "quick")
    runs = {"tangram": {"act_mean_s": 2.0, "act_p99_s": 4.0, "step_time_s": 10.0, "reward_s": 1.0},
            "fixed-dop:4": {"act_mean_s": 1.0, "act_p99_s": 8.0, "step_time_s": 10.0,
                            "reward_s": 2.0},
            "k8s 4c -n 1": {"error": "does not fit"}}
    row = row_of(cell, cluster_of(cell, SCALES["quick"]), runs)
    assert row["regret"] == {"act_mean_s": 2.0, "act_p99_s": 0.5, "step_time_s": 1.0,
                             "reward_s": 0.5}
    assert row["best"]["act_mean_s"] == "fixed-dop:4"
    s = summarise([row])
    assert s["metrics"]["act_mean_s"]["cells_over_1"] == 1
    # k8s could not be deployed: it is not a single configuration that ran everywhere
    assert "k8s 4c -n 1" not in s["metrics"]["act_mean_s"]["single_geomeans"]
    assert s["metrics"]["act_mean_s"]["best_single"] == "fixed-dop:4"
    assert s["metrics"]["act_mean_s"]["best_baseline"]["per_workload"]["coding"] == {
        "config": "fixed-dop:4", "geomean": 0.5}
    json.dumps(s)  # regret.json is JSON
    [line] = [x for x in losses_markdown([row]) if "mean ACT" in x]
    assert "coding, paper cluster, rate x1" in line and "e0/s1 2.000" in line
    assert "fixed-dop:4" in line


@pytest.mark.parametrize("scale", sorted(SCALES))
def test_every_cell_cluster_replays_from_its_cluster_file(scale: str):
    """Issue 46 #7: each cell's cluster, written as `tangram run` writes it, reads back
    unchanged (the paper-ratio cells' nodes had 45 cores over 2 NUMA domains: refused)."""
    import yaml

    from tangram.cluster import ClusterSpec

    sc = SCALES[scale]
    for cell in cells(sc):
        cluster = cluster_of(cell, sc)
        text = yaml.safe_dump(cluster.to_yaml())
        assert ClusterSpec.from_dict(yaml.safe_load(text)) == cluster, cell


def test_a_competitor_whose_actions_failed_is_never_the_best():
    """Issue 46 #6: failed actions end early; a run that failed them is not a win."""
    cell = Cell("deepsearch", 1009, "paper", 1.0, 0.0, 8, "quick")
    fast = {"act_mean_s": 0.5, "act_p99_s": 1.0, "step_time_s": 5.0, "reward_s": 0.5}
    runs = {"tangram": {"act_mean_s": 1.0, "act_p99_s": 2.0, "step_time_s": 10.0,
                        "reward_s": 1.0, "failed": 0},
            "baseline": {**fast, "failed": 12},
            "fixed-dop:4": {"act_mean_s": 1.5, "act_p99_s": 3.0, "step_time_s": 12.0,
                            "reward_s": 1.5, "failed": 0}}
    row = row_of(cell, cluster_of(cell, SCALES["quick"]), runs)
    assert set(row["best"].values()) == {"fixed-dop:4"} and row["regret"]["act_mean_s"] < 1.0
    assert row["runs"]["baseline"]["failed"] == 12
    assert best_baselines([row], "act_mean_s")["per_workload"]["deepsearch"]["config"] == \
        "fixed-dop:4"
