"""Issue 46: no exception can hang a command, and a capability is a method.

* Every effect kind (start, stop, move, reclaim, shed, pre-restore) is carried out by a
  backend method that raises: the affected action ends ``failed`` with the error, the
  driver is told (``on_error``), nothing waits for it; without a driver's sink (a
  simulation) the error is raised. Live, on the real process backend, the first failure
  stops a `tangram run` replay (RunFailed: the CLI's exit 1) and leaves a server's
  other actions running.
* Capabilities come from the methods: every backend and wrapper the CLI assembles has a
  flag exactly when it has the method, and a wrapper has exactly its inner backend's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from conftest import reachable_by_sandboxes
from helpers import cluster, gpu_call, shell

from executor.backends.http.backend import HttpBackend
from executor.backends.process.backend import ProcessBackend
from executor.backends.registry import make_backend
from executor.backends.router import RouterBackend
from executor.driver import LiveExecutor
from executor.replay import OutputLog, RunFailed, until_failure
from sim.clock import SimClock
from sim.modelled import ModelledBackend
from tangram.cluster import ClusterSpec, GpuNodeSpec, ServiceSpec
from tangram.core import Tangram
from tangram.cpu.admission import LIVE
from tangram.model import Action, Demand
from tangram.policies import make_policy
from tangram.protocol import METHOD_CAPABILITIES, MemoryObserved, capabilities_of
from tangram.runtime import EffectFailed, Runtime


class Broken(Exception):
    """What the injected backend methods raise."""


def modelled(clock: SimClock, broken: str) -> ModelledBackend:
    """The simulator's backend (batches, pre-restores) with the method ``broken``
    raising, and an ``evict``/``shed`` of its own (raising when named)."""

    class Failing(ModelledBackend):
        def evict(self, trajectory: str) -> bool:
            raise Broken("evict")

        def shed(self, effect) -> str | None:
            raise Broken("shed")

    backend = Failing(clock, np.random.default_rng(0))
    if broken in ("start", "cancel", "prerestore"):
        def fail(*args, **kwargs):
            raise Broken(broken)
        setattr(backend, broken, fail)
    return backend


def test_a_failed_start_ends_the_action_failed_and_tells_the_driver():
    clock, seen, results = SimClock(), [], []
    core = Tangram(cluster(cores=2))
    rt = Runtime(core, clock, modelled(clock, "start"), on_error=seen.append)
    rt.open_trajectory("a")
    rt.submit(shell("a", t1=1.0, aid="x"), lambda rec, out: results.append(out))
    clock.run()
    assert [o.status for o in results] == ["failed"] and "Broken: start" in results[0].error
    assert seen == [EffectFailed("Dispatch", "x", results[0].error)]
    assert core.snapshot(detail=False).usage["cpu"] == 0.0  # its cores came back


def test_without_a_driver_sink_a_failed_effect_raises():
    """A simulation has no one to tell: a backend failure there is a bug, raised."""
    clock = SimClock()
    rt = Runtime(Tangram(cluster(cores=2)), clock, modelled(clock, "start"))
    rt.open_trajectory("a")
    with pytest.raises(Broken):
        rt.submit(shell("a", t1=1.0, aid="x"))


def test_a_failed_stop_still_ends_the_action_failed():
    """The backend could not stop it: it runs to its end, and ends failed with the error."""
    clock, seen, results = SimClock(), [], []
    rt = Runtime(Tangram(cluster(cores=2)), clock, modelled(clock, "cancel"),
                 on_error=seen.append)
    rt.open_trajectory("a")
    rt.submit(shell("a", t1=5.0, aid="x"), lambda rec, out: results.append(out))
    clock.call_later(1.0, lambda: rt.cancel("x"))
    clock.run()
    assert [(f.effect, f.action_id) for f in seen] == [("Stop", "x")]
    assert [o.status for o in results] == ["failed"] and "Broken: cancel" in results[0].error


@pytest.mark.parametrize("evicts", [True, False])
def test_a_failed_reclaim_or_shed_is_reported(evicts):
    """A node short of memory by observation: the core reclaims an idle trajectory (an
    evicting backend) or sheds the largest sandbox; the method raises: reported, and the
    runtime goes on (the trajectories' next actions run)."""
    clock, seen, results = SimClock(), [], []
    backend = modelled(clock, "")
    if not evicts:  # the same backend without evict: the core sheds instead
        backend = NoEvict(backend)
    core = Tangram(cluster(cores=4, mem_gb=16.0), admission=LIVE)
    rt = Runtime(core, clock, backend, on_error=seen.append)
    assert rt.capabilities.evicts == evicts and rt.capabilities.sheds
    rt.apply(MemoryObserved("n0", 15.0))
    for t in "abc":
        rt.open_trajectory(t, mem_gb=4.0)
    for t in "ac":
        rt.submit(shell(t, t1=1.0, aid=f"{t}1"))
        clock.run()
    rt.apply(MemoryObserved("n0", 1.0))  # short by observation
    rt.submit(shell("b", t1=1.0, aid="b1"), lambda rec, out: results.append(out))
    clock.call_later(3.0, lambda: rt.apply(MemoryObserved("n0", 1.0, idle_after_s=1.0)))
    clock.call_later(4.0, lambda: rt.apply(MemoryObserved("n0", 8.0)))
    clock.run()
    kinds = {(f.effect, f.action_id) for f in seen}
    assert kinds == ({("Shed", ""), ("Reclaim", "")} if evicts else {("Shed", "")})
    assert all("Broken" in f.error for f in seen)
    assert [o.status for o in results] == ["ok"]  # b ran once memory showed free


class NoEvict:
    """``inner`` without evict (forwarding what else it has)."""

    name = "no-evict"

    def __init__(self, inner) -> None:
        self.inner = inner
        self.traits = inner.traits

    def start(self, d, on_done) -> None:
        self.inner.start(d, on_done)

    def cancel(self, action_id: str) -> None:
        self.inner.cancel(action_id)

    def shed(self, effect):
        return self.inner.shed(effect)


def test_a_failed_prerestore_is_reported_and_the_request_still_runs():
    """The static policy deploys its replicas ahead of demand: the load raises, it is
    reported, and the request that comes is served (its own dispatch restores)."""
    clock, seen, results = SimClock(), [], []
    core = Tangram(ClusterSpec(gpu_nodes=(GpuNodeSpec("g0", 8, 80.0),),
                               services=(ServiceSpec("a", 60.0), ServiceSpec("b", 60.0)),
                               restore_gbps=25.0), make_policy("static"))
    rt = Runtime(core, clock, modelled(clock, "prerestore"), on_error=seen.append)
    rt.open_trajectory("j0")
    rt.submit(gpu_call("j0", "a", t1=0.5, choices=(1,), aid="r0"),
              lambda rec, out: results.append(out))
    clock.run()
    assert seen and {(f.effect, f.action_id) for f in seen} == {("PreRestore", "")}
    assert [o.status for o in results] == ["ok"]


# -- live, on the real process backend ----------------------------------------------------
class MoveFails(ProcessBackend):
    def move(self, effect) -> None:
        raise Broken("move")


def light(traj: str, aid: str, argv: list[str]) -> Action:
    """Declared light (t1 0): it takes the lane; one that runs long overstays it."""
    return Action(aid, "t", traj, "shell", {"cpu": Demand.fixed(1)}, t1_s=0.0,
                  payload={"argv": argv})


def test_live_a_failed_move_fails_its_action_and_stops_a_run(tmp_path: Path):
    """The lane change's crash (issue 46 #1), as a failing move on the real process
    backend: the light command that overstays the lane ends failed with the error (not
    left running, not reported twice), a sibling action ends ok, and a replay's wait
    stops with RunFailed (`tangram run` exits 1) instead of hanging."""

    async def main() -> tuple[list, list, str]:
        core = Tangram(cluster(cores=2), make_policy("tangram", {"lane_hold_s": 0.3}))
        reachable_by_sandboxes(tmp_path)
        ex = LiveExecutor(core, OutputLog(MoveFails(tmp_path)))
        for t in "ab":
            ex.open_trajectory(t)
        slow = ex.submit(light("a", "slow", ["sleep", "30"]))
        other = ex.submit(Action("ok", "t", "b", "shell", {"cpu": Demand.fixed(1)}, t1_s=1.0,
                                 payload={"argv": ["sleep", "1"]}))
        with pytest.raises(RunFailed) as info:
            await asyncio.wait_for(until_failure(ex, asyncio.gather(
                asyncio.shield(slow), asyncio.shield(other))), 120)
        rec, out = await asyncio.wait_for(slow, 120)  # stopped: its outcome came
        ex2 = await asyncio.wait_for(other, 120)
        ex.shutdown()
        return [out], [ex2[1]], str(info.value)

    (slow,), (other,), message = asyncio.run(main())
    assert slow.status == "failed" and "Moved: Broken: move" in slow.error
    assert other.status == "ok"
    assert "Moved of action 'slow' failed" in message


# -- capabilities are methods --------------------------------------------------------------
def assembled(tmp_path: Path) -> list[object]:
    """Every backend and wrapper `tangram run` / `serve` put together on this machine
    (no GPU, no Ray: those are covered by their own tests' classes below)."""
    from executor.backends.docker.backend import DockerBackend
    from executor.backends.gpu.backend import GpuBackend
    from executor.backends.ray.backend import RayBackend

    process = make_backend("process", tmp_path / "p")
    return [process, OutputLog(process), process.env, HttpBackend(),
            RouterBackend(ProcessBackend(tmp_path / "q")),
            DockerBackend.__new__(DockerBackend),  # (its methods, without an engine)
            GpuBackend.__new__(GpuBackend), RayBackend.__new__(RayBackend),
            ModelledBackend(SimClock(), np.random.default_rng(0))]


def test_every_capability_flag_is_a_method(tmp_path: Path):
    reachable_by_sandboxes(tmp_path)
    for backend in assembled(tmp_path):
        can = capabilities_of(backend)
        for flag, proto in METHOD_CAPABILITIES.items():
            methods = [m for m in vars(proto) if not m.startswith("_")]
            has = all(callable(getattr(backend, m, None)) for m in methods)
            assert getattr(can, flag) == has, (type(backend).__name__, flag)


def test_wrappers_forward_exactly_what_their_inner_backend_implements(tmp_path: Path):
    reachable_by_sandboxes(tmp_path)
    process = ProcessBackend(tmp_path / "p")
    inner = capabilities_of(process)
    assert inner.moves and inner.sheds and inner.forks and inner.files and not inner.evicts
    router = RouterBackend(process)
    assert capabilities_of(router) == inner
    log = capabilities_of(OutputLog(router))  # a replay: no images, files or forks
    assert log.moves and log.sheds and not (log.files or log.forks or log.images)
    bare = capabilities_of(OutputLog(NoEvict(ModelledBackend(SimClock(),
                                                             np.random.default_rng(0)))))
    assert bare.sheds and not (bare.moves or bare.evicts or bare.prerestores)
    with pytest.raises(AttributeError):
        OutputLog(process).evict  # noqa: B018 - the process backend evicts nothing
