"""Container images as a scheduled resource, simulator and core half (issue 50): the trace
columns and the swe generator, the simulator's caches and pulls, the core's placement and
pulls ahead, the baselines, and the bench's rows."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.bench.images import image_rows, interval
from sim.clock import SimClock
from sim.cluster import load_cluster
from sim.driver import SimConfig, simulate
from sim.images import ImageCaches
from sim.modelled import ModelledBackend
from tangram.cluster import ClusterError, ClusterSpec, CpuNodeSpec
from tangram.core import Tangram
from tangram.model import Action, Demand, Dispatch
from tangram.policies import make_policy
from tangram.protocol import (
    Attach,
    Capabilities,
    Close,
    Finish,
    Open,
    Poll,
    PullImage,
    Submit,
    capabilities_of,
)
from traces.generate import generate
from traces.schema import TraceError, load, trajectories, validate, write

ROOT = Path(__file__).parent.parent


def small_cluster(cache_gb: float | None = 40.0, nodes: int = 2) -> ClusterSpec:
    spec = load_cluster("default")
    return replace(spec, cpu_nodes=tuple(replace(n, image_cache_gb=cache_gb)
                                         for n in spec.cpu_nodes[:nodes]))


# -- traces --------------------------------------------------------------------------------
def test_swe_trace_names_one_image_per_trajectory_and_round_trips(tmp_path):
    df = validate(generate("swe", 40, 3, images=12))
    per = df.groupby("trajectory")["image"].nunique()
    assert (per == 1).all()
    assert df["image"].str.startswith("swe-task-").all()
    assert df["image"].nunique() <= 12 and (df["image_gb"] > 0).all()
    assert (df.groupby("image")["image_gb"].nunique() == 1).all()
    # the actions are the coding workload's of the same seed: images draw apart
    coding = validate(generate("coding", 40, 3))
    for col in ("kind", "t1_s", "think_s", "cpu_cores"):
        assert list(df[col]) == list(coding[col]), col
    back = load(write(df, tmp_path / "swe.parquet"))
    assert list(back["image"]) == list(df["image"])
    specs = list(trajectories(back))
    assert {s.image for s in specs} == set(df["image"])
    assert all(s.image_gb == float(df.loc[df["image"] == s.image, "image_gb"].iloc[0])
               for s in specs)


def test_swe_popularity_is_zipf_skewed():
    df = validate(generate("swe", 600, 0, images=100))
    counts = df.groupby("trajectory")["image"].first().value_counts()
    # image 0 carries ~1/H(100) = 19% of the draws; a uniform draw would give 1%
    assert counts.index[0] == "swe-task-00"
    assert counts.iloc[0] > 60


def test_old_traces_read_as_before():
    df = generate("coding", 3, 0).drop(columns=["image", "image_gb"])
    out = validate(df)
    assert (out["image"] == "").all() and (out["image_gb"] == 0.0).all()
    assert all(s.image == "" and s.image_gb == 0.0 for s in trajectories(out))


def test_bad_image_cells_are_named():
    df = generate("swe", 3, 0, images=4)
    first = df.index[df["trajectory"] == df["trajectory"].iloc[0]]
    df.loc[first[0], "image_gb"] = -2.0
    df.loc[first[1], "image"] = "another"
    other = df.index[df["trajectory"] != df["trajectory"].iloc[0]][0]
    df.loc[other, "image"] = ""
    with pytest.raises(TraceError) as e:
        validate(df)
    text = str(e.value)
    assert f"row {first[0] + 1}, column 'image_gb', value -2.0: negative" in text
    assert "rows name more than one image" in text
    assert f"row {other + 1}, column 'image_gb'" in text and "needs an image" in text
    df = generate("swe", 2, 0, images=1)
    df.loc[0, "image_gb"] = 1.5
    with pytest.raises(TraceError, match="image 'swe-task-0': rows declare more than one"):
        validate(df)


def test_generate_refuses_images_for_other_workloads_and_bad_counts():
    with pytest.raises(ValueError, match="images: only swe"):
        generate("coding", 2, 0, images=5)
    with pytest.raises(ValueError, match="images: must be >= 1"):
        generate("swe", 2, 0, images=0)


def test_cli_generates_swe(tmp_path):
    out = tmp_path / "swe.csv"
    done = subprocess.run([sys.executable, str(ROOT / "cli.py"), "trace", "generate",
                           "--workload", "swe", "--images", "7", "--trajectories", "9",
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    df = load(out)
    assert df["image"].nunique() <= 7 and df["trajectory"].nunique() == 9


# -- the cluster file ----------------------------------------------------------------------
def test_cluster_reads_the_image_cache_and_refuses_bad_values():
    spec = ClusterSpec.from_dict({"cpu_nodes": [{"count": 2, "image_cache_gb": 200}]})
    assert [n.image_cache_gb for n in spec.cpu_nodes] == [200.0, 200.0]
    assert ClusterSpec.from_dict({"cpu_nodes": [{"count": 1}]}).cpu_nodes[0].image_cache_gb \
        is None
    assert ClusterSpec.from_dict(spec.to_yaml()) == spec
    with pytest.raises(ClusterError, match=r"cpu_nodes\[0\].image_cache_gb: expected a "
                                           r"number > 0, got 'big'"):
        ClusterSpec.from_dict({"cpu_nodes": [{"count": 1, "image_cache_gb": "big"}]})


def test_a_trace_with_images_needs_the_pull_figures():
    df = validate(generate("swe", 4, 0, images=2))
    spec = small_cluster()
    spec = replace(spec, extra={k: v for k, v in spec.extra.items() if k != "image_pulls"})
    with pytest.raises(ValueError, match="extra.image_pulls"):
        simulate(df, spec, SimConfig())
    bad = replace(spec, extra={**spec.extra, "image_pulls": 1.5})
    with pytest.raises(ValueError, match=r"extra.image_pulls: must be a whole number > 0, "
                                         r"got 1.5"):
        simulate(df, bad, SimConfig())
    full = small_cluster()
    for overhead in (-0.1, float("inf"), "slow", True):
        bad = replace(full, extra={**full.extra, "image_pull_overhead_s": overhead})
        with pytest.raises(ValueError, match=r"extra.image_pull_overhead_s: must be a finite "
                                             r"number of seconds >= 0, got "):
            simulate(df, bad, SimConfig())


# -- the simulator's caches ----------------------------------------------------------------
def _caches(budget: float | None, pulls: int, sizes: dict[str, float]):
    clock = SimClock()
    # 8000 Mbit/s = 1 GB/s
    return clock, ImageCaches(clock, sizes, {"n": budget}, 8000.0, pulls)


def test_pulls_share_the_bandwidth_and_wait_their_turn():
    ends: dict[str, float] = {}
    clock, caches = _caches(None, 2, {"a": 1.0, "b": 1.0, "c": 1.0})
    for image in "abc":
        caches.acquire("n", image, lambda p, i=image: ends.setdefault(i, clock.now()))
    clock.run()
    # a and b share 1 GB/s (2 s each); c starts when they end
    assert ends == pytest.approx({"a": 2.0, "b": 2.0, "c": 3.0})
    assert caches.counters()["image_pulls"] == 3
    assert caches.counters()["image_held_rate"] == 0.0


def test_a_pulls_own_cost_shares_the_node_as_its_bytes_do():
    ends: dict[str, float] = {}
    clock = SimClock()
    caches = ImageCaches(clock, {"a": 1.0, "b": 1.0, "c": 0.5}, {"n": None}, 8000.0, 2,
                         overhead_s=0.5)
    for image in "ab":
        caches.acquire("n", image, lambda p, i=image: ends.setdefault(i, clock.now()))
    clock.run()
    # each is 1 GB and 0.5 s of its own at 1 GB/s: 1.5 GB-equivalents, two sharing 1 GB/s
    assert ends == pytest.approx({"a": 3.0, "b": 3.0})
    caches.acquire("n", "c", lambda p: ends.setdefault("c", clock.now()))
    clock.run()
    assert ends["c"] == pytest.approx(4.0)  # alone: 0.5 s of its own and 0.5 s of bytes
    # the bytes pulled are the images' own
    assert caches.counters()["image_pulled_gb"] == pytest.approx(2.5)


def test_lru_never_evicts_an_image_in_use_or_wanted():
    clock, caches = _caches(2.0, 1, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0})
    caches.acquire("n", "a", lambda p: None)   # a in use
    caches.prefetch("n", "b")                  # b wanted by a trajectory not started yet
    caches.acquire("n", "c", lambda p: None)
    clock.run()
    caches.release("n", "c")                   # c unused now: the one to go
    caches.acquire("n", "d", lambda p: None)
    clock.run()
    held = set(caches.nodes["n"].held)
    assert {"a", "b", "d"} <= held and "c" not in held
    assert caches.evictions == 1
    # b's trajectory starts: a hit, and b is then in use like any other
    hit = []
    caches.acquire("n", "b", hit.append)
    assert hit == [None] and caches.hits == 1


# -- the core ------------------------------------------------------------------------------
def core_with(policy: str, nodes: int = 3) -> Tangram:
    cluster = ClusterSpec(tuple(CpuNodeSpec(f"n{i}", cores=8, numa=1, mem_gb=64,
                                            image_cache_gb=20.0) for i in range(nodes)))
    core = Tangram(cluster, make_policy(policy))
    core.handle(Attach(Capabilities(pulls=True)), 0.0)
    return core


def shell(tid: str, seq: int = 0) -> Action:
    return Action(f"{tid}#{seq}", "swe", tid, "shell", {"cpu": Demand.fixed(1)}, t1_s=1.0)


def test_the_core_places_by_image_and_pulls_ahead():
    core = core_with("tangram")
    first = core.handle(Open("t1", "swe", 4.0, "img-a", 8.0), 0.0)
    assert len(first) == 1 and isinstance(first[0], PullImage)
    node = first[0].node
    # a second trajectory of the same image goes where it is being pulled: no second pull
    assert core.handle(Open("t2", "swe", 4.0, "img-a", 8.0), 0.1) == []
    # another image goes elsewhere (that node has a pull backlog)
    other = core.handle(Open("t3", "swe", 4.0, "img-b", 8.0), 0.2)
    assert len(other) == 1 and other[0].node != node
    out = core.handle(Submit((shell("t1"), shell("t2"))), 1.0)
    assert {d.lease.node for d in out if isinstance(d, Dispatch)} == {node}
    assert core.snapshot(detail=False).counters["image_prefetches"] == 2


def full_core(cache_gb: float = 20.0) -> Tangram:
    """Two nodes of 8 GB, each held by a trajectory of 8 GB (bound by an action of 1000 s):
    no room for another until one closes."""
    cluster = ClusterSpec(tuple(CpuNodeSpec(f"n{i}", cores=8, numa=1, mem_gb=8,
                                            image_cache_gb=cache_gb) for i in range(2)))
    core = Tangram(cluster, make_policy("tangram"))
    core.handle(Attach(Capabilities(pulls=True)), 0.0)
    for tid in ("f0", "f1"):
        core.handle(Open(tid, "swe", 8.0), 0.0)
    core.handle(Submit((Action("f0#0", "swe", "f0", "shell", {"cpu": Demand.fixed(1)},
                               t1_s=1000.0),
                        Action("f1#0", "swe", "f1", "shell", {"cpu": Demand.fixed(1)},
                               t1_s=1000.0))), 0.0)
    assert {core.node_of("f0"), core.node_of("f1")} == {"n0", "n1"}
    return core


def pulls(effects) -> list[tuple[str, str, str]]:
    return [(e.node, e.image, e.trajectory) for e in effects if isinstance(e, PullImage)]


def test_a_trajectory_no_node_has_room_for_is_pulled_ahead_where_it_will_bind():
    """No node has room for its memory: it is expected on the node the policy picks among
    all (not placed: no sandbox is made there at open), its image pulled there ahead of
    its first action, which binds there once that node has room."""
    core = full_core()
    # 8 GB at the prior 1 Gbit/s: 64 s; the node pulls nothing else, so at once
    assert pulls(core.handle(Open("q0", "swe", 8.0, "img-0", 8.0), 0.0)) == \
        [("n0", "img-0", "q0")]
    assert core.placed_on("q0") is None and core.node_of("q0") is None
    core.handle(Submit((shell("q0"),)), 1.0)
    assert core.why_queued("q0#0").startswith("waiting for a node")
    # f0 (on n0) ends and closes: q0 binds on n0, where its image was pulled ahead
    core.handle(Finish("f0#0"), 100.0)
    out = core.handle(Close("f0"), 100.0)
    assert [d.lease.node for d in out if isinstance(d, Dispatch)] == ["n0"]
    assert core.node_of("q0") == "n0"
    assert core.snapshot(detail=False).counters["image_prefetches"] == 1


def test_a_burst_is_placed_up_to_the_nodes_room_and_the_rest_expected():
    """A burst opens all its trajectories before any binds (memory is reserved at binding):
    the nodes' room counts the trajectories placed there, so the ones past it are expected
    (not placed: on Ray no sandbox is made for them at open) and their pulls wait for the
    node's pulls to end, instead of all being ordered at once."""
    cluster = ClusterSpec(tuple(CpuNodeSpec(f"n{i}", cores=8, numa=1, mem_gb=8,
                                            image_cache_gb=100.0) for i in range(2)))
    core = Tangram(cluster, make_policy("tangram"))
    core.handle(Attach(Capabilities(pulls=True)), 0.0)
    ordered = []
    for i in range(6):
        ordered += pulls(core.handle(Open(f"t{i}", "swe", 4.0, f"img-{i}", 8.0), 0.0))
    assert [core.placed_on(f"t{i}") is not None for i in range(6)] == [True] * 4 + [False] * 2
    assert sorted(t for _, _, t in ordered) == ["t0", "t1", "t2", "t3"]
    later = pulls(core.handle(Poll(), 1000.0))  # (every pull ordered is over by then)
    assert sorted(t for _, _, t in later) == ["t4", "t5"]


def test_pulls_ahead_for_waiting_trajectories_are_bounded():
    """Speculative pulls take a node's idle bandwidth only (one at a time, none beside
    another pull there) and never its disk past the budget held by images in use or
    wanted there: the rest are ordered as pulls end and images are freed."""
    core = full_core(cache_gb=20.0)
    assert pulls(core.handle(Open("q0", "swe", 8.0, "img-0", 8.0), 0.0)) == \
        [("n0", "img-0", "q0")]
    assert pulls(core.handle(Open("q1", "swe", 8.0, "img-1", 8.0), 0.0)) == \
        [("n1", "img-1", "q1")]
    # both nodes pull (until 64 s in the core's belief): the next waits for a pull's end
    assert pulls(core.handle(Open("q2", "swe", 8.0, "img-2", 8.0), 1.0)) == []
    assert pulls(core.handle(Poll(), 63.0)) == []
    [(_, image, tid)] = pulls(core.handle(Poll(), 65.0))
    assert (image, tid) == ("img-2", "q2")
    assert [p[1:] for p in pulls(core.handle(Open("q3", "swe", 8.0, "img-3", 8.0), 66.0))] \
        == [("img-3", "q3")]
    # each node now has 16 GB of images wanted by trajectories waiting for it: a fifth
    # would take either past its 20 GB budget. Not ordered, even once every pull is
    # over, until an image is freed
    assert pulls(core.handle(Open("q4", "swe", 8.0, "img-4", 8.0), 67.0)) == []
    assert pulls(core.handle(Poll(), 300.0)) == []
    # q2 closes (its image, on the node q4 is expected on, is wanted no more): ordered
    # with the close's effects
    out = core.handle(Close("q2"), 301.0)
    assert [p[1:] for p in pulls(out)] == [("img-4", "q4")]


def test_the_ablation_places_without_images():
    core = core_with("tangram-images-on-demand")
    assert core.handle(Open("t1", "swe", 4.0, "img-a", 8.0), 0.0) == []
    assert core.node_of("t1") is None  # bound at its first action, as any other


def test_the_core_orders_no_pull_for_a_backend_that_cannot():
    cluster = ClusterSpec((CpuNodeSpec("n0", cores=8, numa=1, mem_gb=64),))
    core = Tangram(cluster)
    core.handle(Attach(Capabilities()), 0.0)
    assert core.handle(Open("t1", "swe", 4.0, "img-a", 8.0), 0.0) == []
    with pytest.raises(ValueError, match="image_gb: must be a number >= 0, got -1"):
        core.handle(Open("t2", "swe", 4.0, "img-a", -1), 0.0)


def test_without_images_the_core_keeps_no_book():
    core = core_with("tangram")
    assert core.handle(Open("t1", "swe", 4.0), 0.0) == []
    core.handle(Submit((shell("t1"),)), 0.0)
    assert "image_prefetches" not in core.snapshot(detail=False).counters
    assert repr(Open("t1", "swe", 4.0)) == "Open(trajectory='t1', task='swe', mem_gb=4.0)"


def test_k8s_pods_pull_on_demand_and_image_locality_follows_the_image():
    for policy, together in (("k8s-image-locality", True), ("k8s", False)):
        core = core_with(policy)
        assert core.handle(Open("t1", "swe", 4.0, "img-a", 9.0), 0.0) == []  # no pulls ahead
        a = core.node_of("t1")
        core.handle(Open("t2", "swe", 4.0, "img-a", 9.0), 0.0)
        # kube's least-allocated spreads pods; ImageLocality (9 GB on 1 of 3 nodes: past
        # its 1000 MB cap, a full 100) brings the second to the image
        assert (core.node_of("t2") == a) is together, policy


def test_the_modelled_backend_pulls():
    assert capabilities_of(ModelledBackend(SimClock(), np.random.default_rng(0))).pulls


# -- simulated runs ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swe_runs():
    df = validate(generate("swe", 48, 1, images=16))
    cluster = small_cluster(40.0)
    return {p: simulate(df, cluster, SimConfig(policy=p, seed=1))
            for p in ("tangram", "k8s", "k8s-image-locality", "tangram-prepulled")}


def test_every_policy_completes_and_counts_its_pulls(swe_runs):
    for policy, run in swe_runs.items():
        c = run.counters
        assert c["image_starts"] == 48, policy
        assert len(run.records) == sum(1 for _ in run.records)
        assert all(r.status in ("ok", "timeout") for r in run.records), policy
    ideal = swe_runs["tangram-prepulled"].counters
    assert ideal["image_pulled_gb"] == 0 and ideal["image_hit_rate"] == 1.0
    # pulled once per node it lands on at most: never more pulls than starts
    for run in swe_runs.values():
        assert run.counters["image_pulls"] <= run.counters["image_starts"]


def test_first_actions_wait_for_their_pull(swe_runs):
    def first_wait(run):
        return np.mean([r.start_s - r.submit_s + r.overhead_s for r in run.records
                        if r.action_id.endswith("#0")])
    assert first_wait(swe_runs["tangram-prepulled"]) < 5.0
    assert first_wait(swe_runs["k8s"]) > first_wait(swe_runs["tangram-prepulled"]) + 10.0


def test_the_core_learns_the_pull_rate_it_observes(swe_runs):
    # its prior is the cluster file's 1000 Mbit/s (0.125 GB/s); two pulls at once share it
    counters = swe_runs["tangram"].snapshot.counters
    assert counters["image_prefetches"] > 0
    assert 0.05 < counters["image_pull_gbps"] < 0.12


def test_tangram_pulls_fewer_bytes_than_the_pod_baseline(swe_runs):
    assert swe_runs["tangram"].counters["image_pulled_gb"] < \
        swe_runs["k8s"].counters["image_pulled_gb"]


def test_a_waiting_trajectorys_first_action_does_not_pay_its_pull():
    """Two nodes with memory for one trajectory each: a and b are placed at open (their
    images pulled ahead), c waits for a node. Its image is pulled ahead on the node it is
    expected on once that node pulls nothing else (not beside a's pull, which would slow
    a's first action), and when a closes there c's first action finds it held: it waits
    only for its container. The ablation, which pulls nothing ahead, pays c's pull on its
    first action; a's and b's are as slow in both."""
    def rows(tid: str, thinks: list[float]) -> list[dict]:
        return [dict(task="swe", trajectory=tid, seq=i, kind="shell", think_s=think,
                     t1_s=1.0, cpu_cores="1", mem_gb=8.0, image=f"img-{tid}", image_gb=4.0)
                for i, think in enumerate(thinks)]

    df = validate(pd.DataFrame(rows("a", [0, 10]) + rows("b", [0, 100]) + rows("c", [0])))
    cluster = ClusterSpec(tuple(CpuNodeSpec(f"n{i}", cores=4, numa=1, mem_gb=8.0,
                                            image_cache_gb=40.0) for i in range(2)),
                          extra={"image_pull_mbps": 8000, "image_pulls": 2})  # 1 GB/s
    first, counters = {}, {}
    for policy in ("tangram", "tangram-images-on-demand"):
        run = simulate(df, cluster, SimConfig(policy=policy, seed=0))
        # (its start, and its overhead: what it waited for its image and container)
        first[policy] = {r.trajectory: (r.start_s, r.overhead_s) for r in run.records
                         if r.action_id.endswith("#0")}
        counters[policy] = run.counters
        assert first[policy]["c"][0] > 10.0, policy  # it waited for a's node
    ahead, on_demand = first["tangram"], first["tangram-images-on-demand"]
    # c: its pull (4 GB at 1 GB/s) on its first action without the pull ahead, none with it
    assert on_demand["c"][1] > 4.0 > 1.0 > ahead["c"][1]
    assert counters["tangram"]["image_held"] == 1 and counters["tangram"]["image_pulls"] == 3
    for tid in ("a", "b"):  # pulled at open either way, alone on their nodes: 4 s
        assert ahead[tid][1] == pytest.approx(on_demand[tid][1], abs=0.1), tid


def test_a_trace_without_images_simulates_as_before():
    df = validate(generate("coding", 16, 2))
    a = simulate(df, small_cluster(), SimConfig(seed=2))
    b = simulate(df, load_cluster("default"), SimConfig(seed=2))
    assert [(r.action_id, r.start_s, r.end_s) for r in a.records] == \
        [(r.action_id, r.start_s, r.end_s) for r in b.records]
    assert not any(k.startswith("image") for k in a.counters)


# -- the bench -----------------------------------------------------------------------------
def test_bench_rows_and_intervals():
    rows = list(image_rows(16, 6, 40.0, "default", 2, policies=("tangram", "k8s")))
    runs = [r for r in rows if not r.get("summary")]
    summaries = [r for r in rows if r.get("summary")]
    assert len(runs) == 4 and [s["policy"] for s in summaries] == ["tangram", "k8s"]
    for s in summaries:
        mine = [r["env_start_p99_s"] for r in runs if r["policy"] == s["policy"]]
        assert s["env_start_p99_s"] == pytest.approx(np.mean(mine), abs=1e-3)
        assert s["env_start_p99_s_ci95"] >= 0
    mean, half = interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / np.sqrt(3))
    assert pd.isna(interval([1.0])[1])
