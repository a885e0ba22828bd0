"""Policies are values both drivers accept by name, with the same parameters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import EventLoop, cluster, counts, gpu_call, open_trajectory, shell, test_run

import cli
from tangram.core import Tangram
from tangram.cpu.pods import PodPool
from tangram.gpu.static import ServicePool
from tangram.policies import REGISTRY, K8sPolicy, Pods, make_policy
from tangram_cli.options import POLICY_OPTIONS

ROOT = Path(__file__).parent.parent


def _options(command: str) -> set[str]:
    return {p.name for p in cli.load_command(command).params}


def test_simulate_run_and_serve_accept_the_same_policy_options():
    sets = {c: _options(c) & set(POLICY_OPTIONS) for c in ("simulate", "run", "serve")}
    assert sets["simulate"] == sets["run"] == sets["serve"] == set(POLICY_OPTIONS)


@pytest.mark.parametrize("name", [n if n != "fixed-dop:N" else "fixed-dop:4" for n in REGISTRY])
def test_every_listed_policy_builds_and_runs(name):
    spec = cluster(cores=8, gpu_nodes=1, services=[("rm", 40)],
                   quotas=[("quota:api", "concurrency", 1)])
    core = Tangram(spec, make_policy(name, {"pod_cores": 2, "gpu_dop": 2}))
    loop = EventLoop(core)
    for j in range(3):
        open_trajectory(core, f"j{j}", mem_gb=1)
        loop.submit(shell(f"j{j}", 1.0))
        loop.submit(test_run(f"j{j}", 4.0, 1, 4))
        loop.submit(gpu_call(f"j{j}", "rm", 2.0))
        loop.submit(shell(f"j{j}", 0.5, cores=0, **{"quota:api": 1}))
    loop.run()
    assert len(loop.records) == 12 and not counts(core).queued and not counts(core).running_count
    for j in range(3):  # pods are held until the trajectory closes, then freed
        loop.runtime.close_trajectory(f"j{j}")
    assert counts(core).usage["cpu"] == 0


def test_policy_parameters_are_typed_fields_and_reach_the_pools():
    p = make_policy("k8s", {"pod_cores": 8, "depth": 3, "gpu_dop": 4})
    assert isinstance(p, K8sPolicy) and p.cpu == Pods(8) and p.depth == 3
    # (the pools the policy builds: what a core built with it runs)
    pool = p.build(cluster(cores=16)).pools["cpu:n0"]
    # the paper's tests run single-process in their pod; pod_dop widens them
    assert isinstance(pool, PodPool) and pool.scheduler.units == 1
    wide = make_policy("k8s", {"pod_cores": 8, "pod_dop": 8}).build(cluster(cores=16))
    assert wide.pools["cpu:n0"].scheduler.units == 8
    static = make_policy("static", {"gpu_dop": 4}).build(
        cluster(cores=0, nodes=0, gpu_nodes=1, services=[("rm", 40), ("b", 40)]))
    svc = [p for p in static.pools.values() if isinstance(p, ServicePool)]
    assert {p.name for p in svc} == {"gpu:rm", "gpu:b"} and all(p.dop == 4 for p in svc)
    assert make_policy("fixed-dop:3").label == "fixed-dop:3"


@pytest.mark.parametrize("bad, match", [
    (("nope", {}), "unknown policy"),
    (("fixed-dop:x", {}), "needs an integer"),
    (("k8s", {"pod_cores": 0}), "pod_cores"),
    (("tangram", {"ordering": "random"}), "ordering"),
    (("tangram", {"colour": 1}), "unknown 'colour'"),
])
def test_bad_policies_are_refused_with_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        make_policy(*bad)


def test_cli_refuses_a_bad_policy_without_traceback():
    r = subprocess.run([sys.executable, str(ROOT / "cli.py"), "simulate", "--policy", "k9s", "-q"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "unknown policy 'k9s'" in r.stderr
    assert "Traceback" not in r.stderr
