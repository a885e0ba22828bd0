"""The paper's own experimental setups: pods from trajectory open to close, tests
single-process in their pod, the control plane's pod creation rate, static GPU
replicas, provider 429s that fail calls."""

import numpy as np
import pandas as pd
from helpers import EventLoop, cluster, counts, cpu_node, queued_ids, shell, test_run

from sim.driver import SimConfig, simulate
from sim.modelled import POD_START, ControlPlane
from tangram.cluster import ClusterSpec, QuotaSpec
from tangram.core import Tangram
from tangram.policies import make_policy
from traces.schema import COLUMNS, validate


def waiting_for_a_node(core: Tangram) -> list[str]:
    """The open trajectories not bound to a node, in open order (a pod policy: their pods
    wait for room)."""
    return [t for t, view in core.snapshot().trajectories.items() if view.node is None]


def test_k8s_pods_start_at_open_in_open_order_and_hold_until_close():
    core = Tangram(cluster(cores=8), make_policy("k8s", {"pod_cores": 4}))
    loop = EventLoop(core)
    for t in ("a", "b", "c", "d"):
        loop.runtime.open_trajectory(t, "t", 1.0)
    # two pods fit: a and b hold their cores before submitting anything
    assert core.node_of("a") and core.node_of("b")
    assert waiting_for_a_node(core) == ["c", "d"] and counts(core).usage["cpu"] == 8
    assert not cpu_node(core, "n0").free
    # d submits first, but its pod waits behind c's (open order)
    loop.submit(shell("d", t1=1.0, aid="d0"))
    loop.submit(shell("a", t1=1.0, aid="a0"))
    assert core.is_running("a0") and "d0" in queued_ids(core)
    loop.runtime.close_trajectory("c")  # closed while waiting: leaves the queue
    assert waiting_for_a_node(core) == ["d"]
    loop.run()
    loop.runtime.close_trajectory("a")
    assert core.node_of("d") and not waiting_for_a_node(core)
    loop.run()
    assert {r.action_id for r in loop.records} == {"a0", "d0"}


def test_tests_run_single_process_in_their_pod():
    core = Tangram(cluster(cores=8), make_policy("k8s", {"pod_cores": 4}))
    loop = EventLoop(core)
    loop.runtime.open_trajectory("a", "t", 1.0)
    loop.submit(test_run("a", t1=8.0, lo=1, hi=8, p=1.0, aid="t0"))
    loop.run()
    rec = loop.records[0]
    assert rec.units == 1 and len(rec.cores.split(",")) == 4  # the pod's cores, one process
    assert rec.end_s - rec.start_s == 8.0


def test_control_plane_admits_pods_at_its_rate_after_a_burst():
    plane = ControlPlane(POD_START.rate_per_s, POD_START.burst)
    times = [plane.admit(0.0) for _ in range(300)]
    assert times[:100] == [0.0] * 100  # the burst
    assert np.allclose(np.diff(times[100:]), 1 / POD_START.rate_per_s)
    assert abs(times[-1] - (300 - 100) / 50.0) < 1e-9


def _api_trace(calls: int, trajectories: int) -> pd.DataFrame:
    base = {k: v[2] for k, v in COLUMNS.items()}
    rows = [{**base, "task": "ds", "trajectory": f"q{j}", "seq": i, "kind": "search",
             "think_s": 0.0, "t1_s": 0.5, "quota_key": "search"}
            for j in range(trajectories) for i in range(calls)]
    return validate(pd.DataFrame(rows))


def test_provider_429s_fail_calls_that_tangram_would_have_queued():
    spec = ClusterSpec(quotas=(QuotaSpec("quota:search", "window", 2, 1.0),))
    df = _api_trace(3, 40)
    base = simulate(df, spec, SimConfig(policy="per-trajectory-api"))
    ours = simulate(df, spec, SimConfig(policy="tangram"))
    failed = [r for r in base.records if r.status == "failed"]
    assert failed and all(r.exit_code == 429 for r in failed)
    assert base.counters["api_failed"] == len(failed) and base.counters["api_429s"] > len(failed)
    assert all(r.status == "ok" for r in ours.records)  # held until the quota had room


def test_static_replicas_as_the_paper_deployed_them():
    from sim.cluster import load_cluster

    paper = load_cluster("paper")
    built = make_policy("static", {"gpu_dop": 4, "replicas": 1}).build(paper)
    pools = {n: p for n, p in built.pools.items() if n.startswith("gpu:teacher")}
    assert len(pools) == 9 and all(len(p.replicas) == 1 and p.dop == 4 for p in pools.values())


def test_gpu_counts_in_one_gpu_steps_use_partial_nodes():
    from analysis.experiments import gpu_nodes_for
    from tangram.cluster import GpuNodeSpec, ServiceSpec
    from tangram.gpu.manager import GpuManager

    nodes = gpu_nodes_for(29, GpuNodeSpec("g", 8, 80.0))
    assert [n.gpus for n in nodes] == [8, 8, 8, 4, 1] and len({n.name for n in nodes}) == 5
    gpu = GpuManager(nodes[3:], [], 20.0)
    assert gpu.free_gpus() == 5
    gpu = GpuManager(nodes[3:4], [ServiceSpec("m", 10.0)], 20.0)
    a = gpu.reserve("a", "m", 2)
    b = gpu.reserve("b", "m", 2)
    assert a and b and gpu.reserve("c", "m", 1) is None  # a 4-GPU node holds 4, no more
    gpu.release(a)
    gpu.release(b)
    assert gpu.free_gpus() == 4 and gpu.reserve("d", "m", 4) is not None


def test_provider_calls_retried_until_they_succeed_do_the_same_work():
    spec = ClusterSpec(quotas=(QuotaSpec("quota:search", "window", 2, 1.0),))
    df = _api_trace(3, 40)
    base = simulate(df, spec, SimConfig(policy="per-trajectory-api", api_attempts=None))
    assert base.counters["api_429s"] > 0 and base.counters["api_failed"] == 0
    assert all(r.status == "ok" for r in base.records) and len(base.records) == 120


def test_static_split_gives_the_hot_teacher_more_replicas():
    from dataclasses import replace

    from sim.cluster import load_cluster

    paper = load_cluster("paper")  # the teachers alone (simulate keeps the services used)
    paper = replace(paper, services=tuple(s for s in paper.services if s.name != "judge"))
    split = (("teacher0", 4), *((f"teacher{i}", 1) for i in range(1, 9)))
    built = make_policy("static", {"gpu_dop": 2, "split": split}).build(paper)
    reps = {n: len(p.replicas) for n, p in built.pools.items() if n.startswith("gpu:teacher")}
    assert reps["gpu:teacher0"] == 4 and all(v == 1 for k, v in reps.items() if k != "gpu:teacher0")
    import pytest

    with pytest.raises(ValueError, match="split"):
        make_policy("static", {"split": (("teacher0", 0),)})


def test_profiles_are_estimates_and_the_truth_does_not_move_with_them():
    from traces.generate import generate, teacher_weights
    from traces.schema import trajectories

    exact, noisy = (validate(generate("coding", 30, 4, profile_sigma=s)) for s in (0.0, 0.5))
    assert exact["t1_s"].equals(noisy["t1_s"])  # the same work
    steps = [(a, b) for ta, tb in zip(trajectories(exact), trajectories(noisy), strict=True)
             for a, b in zip(ta.steps, tb.steps, strict=True) if a.action.t1_s is not None]
    assert steps and all(a.action.t1_s == a.truth.t1_s for a, _ in steps)
    off = [abs(b.action.t1_s / b.truth.t1_s - 1) for _, b in steps]
    assert max(off) > 0.1  # declared differs from the truth
    assert any(a.action.elasticity != b.action.elasticity for a, b in steps)
    # the judge's output length is unknown before it runs: declared != true even at sigma 0
    judge = [s for t in trajectories(validate(generate("deepsearch", 10, 0, profile_sigma=0.0)))
             for s in t.steps if s.action.kind == "reward_judge"]
    assert any(s.action.t1_s != s.truth.t1_s for s in judge)
    # teacher skew: 0 is uniform, larger is more skewed
    flat = teacher_weights(np.random.default_rng(0), 0.0)
    assert np.allclose(flat, 1 / 9)
    assert teacher_weights(np.random.default_rng(0), 2.0).max() > \
        teacher_weights(np.random.default_rng(0), 1.0).max()
