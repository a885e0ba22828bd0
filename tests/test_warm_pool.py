"""The docker backend's warm pool: sandboxes created ahead of use, handed to a
trajectory's first action (with its own memory limit) and refilled."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import docker

from executor.backends.docker.backend import CREATORS, WARM_QUIET_S, DockerBackend
from executor.driver import LiveExecutor
from executor.node.local import local_cluster
from tangram.core import Tangram
from tangram.model import Action, Demand


def _containers(owner: str, trajectory: str | None = None) -> list:
    labels = [f"tangram.owner={owner}"]
    if trajectory is not None:
        labels.append(f"tangram.trajectory={trajectory}")
    return docker.from_env().containers.list(all=True, sparse=True, filters={"label": labels})


def _until(cond, within_s: float = 120.0) -> bool:
    deadline = time.time() + within_s
    while not cond() and time.time() < deadline:
        time.sleep(0.1)
    return cond()


def test_warm_sandboxes_are_used_resized_and_refilled(tmp_path):
    owner = f"warm-{tmp_path.name}"
    backend = DockerBackend(owner=owner, warm=2)
    try:
        assert _until(lambda: len(_containers(owner, "")) == 2)
        # started, agents listening (made at once, both may still be starting)
        assert _until(lambda: len(backend._warm) == 2)
        warm_ids = {c.id for c in _containers(owner, "")}

        async def go() -> str:
            ex = LiveExecutor(Tangram(local_cluster()), backend)
            ex.open_trajectory("a", "t", 3.0)  # above the pool's 2 GB: taken, resized
            t0 = time.perf_counter()
            _, out = await ex.run(Action("a1", "t", "a", "shell", {"cpu": Demand.fixed(1)},
                                         payload={"command": "cat /sys/fs/cgroup/memory/"
                                                  "memory.limit_in_bytes"}))
            assert out.status == "ok", out
            assert int(out.output) == 3 * 2**30  # the trajectory's limit, not the pool's
            assert out.extra["container"] in {i[:12] for i in warm_ids}  # taken warm
            return f"{(time.perf_counter() - t0) * 1e3:.0f} ms"

        asyncio.run(go())
        # the pool refills to its size; the used sandbox is the trajectory's now
        assert _until(lambda: len(_containers(owner)) == 3)
    finally:
        backend.shutdown()
    assert _containers(owner) == []


def test_warm_sandbox_of_the_pools_size_runs_on_the_loop_and_a_dead_one_is_replaced(tmp_path):
    """A trajectory of the pool's memory limit takes a warm sandbox with no engine call
    (the action runs on the event loop, DockerBackend._ready); one whose warm sandbox died
    before its first action still gets its action run, in a fresh container."""
    owner = f"warm-loop-{tmp_path.name}"
    backend = DockerBackend(owner=owner, warm=2)
    try:
        assert _until(lambda: len(_containers(owner, "")) == 2)
        assert _until(lambda: len(backend._warm) == 2)  # started, agents listening
        warm_ids = {b.container_id[:12] for b in backend._warm}
        threads = [-1]  # the backend's worker threads after the first action

        async def go() -> tuple:
            ex = LiveExecutor(Tangram(local_cluster()), backend)
            ex.open_trajectory("a", "t")  # the pool's limit: nothing to resize
            _, a = await ex.run(Action("a1", "t", "a", "shell", {"cpu": Demand.fixed(1)},
                                       payload={"argv": ["sh", "-c", "echo $TANGRAM_CORES"]}))
            threads[0] = len(backend._pool._threads)
            # the other warm sandbox dies while idle in the pool
            docker.from_env().api.kill(backend._warm[-1].container_id)
            ex.open_trajectory("b", "t")
            _, b = await ex.run(Action("b1", "t", "b", "shell", {"cpu": Demand.fixed(1)},
                                       payload={"argv": ["echo", "b"]}))
            return a, b

        a, b = asyncio.run(go())
        assert a.status == "ok" and a.output.strip() == ",".join(map(str, a.extra["cores"]))
        assert a.extra["container"] in warm_ids and not a.extra["state_lost"]
        # no worker thread was needed for it (the loop path); the dead one's took one
        assert threads[0] == 0
        assert b.status == "ok" and b.output.strip() == "b", b
        assert b.extra["container"] not in warm_ids
        assert len(backend._pool._threads) > 0
    finally:
        backend.shutdown()
    assert _containers(owner) == []



def test_the_pool_gets_the_bursts_memory_limit_and_is_taken_as_a_trajectory_opens(tmp_path):
    """Sized from demand (no pool configured): after a burst of trajectories of 1.5 GB
    (not the default 2), the pool is made of 1.5 GB sandboxes, so the next such trajectory
    is bound to one as it opens, with no engine call, and its first action runs on the
    event loop (an RL step's rollouts share one tool config: one mem_gb)."""
    owner = f"warm-mem-{tmp_path.name}"
    backend = DockerBackend(owner=owner)
    try:
        for t in ("a", "b"):  # a burst of two: their containers made by the creators
            backend.open_trajectory(t, 1.5)
        with backend._lock:
            making = list(backend._creating.values())
        for f in making:
            f.result()
        # the refill's threads, started as the burst's containers were made, end once
        # the pool holds the burst's size
        with backend._lock:
            refillers = list(backend._refillers)
        for r in refillers:
            r.join()
        assert sorted(b.mem_gb for b in backend._warm) == [1.5, 1.5]
        warm_ids = {b.container_id[:12] for b in backend._warm}

        async def go() -> tuple:
            ex = LiveExecutor(Tangram(local_cluster()), backend)
            ex.open_trajectory("c", "t", 1.5)
            bound = backend._boxes["c"].container_id[:12]  # bound as it opened
            _, out = await ex.run(Action("c1", "t", "c", "shell", {"cpu": Demand.fixed(1)},
                                         payload={"command": "cat /sys/fs/cgroup/memory/"
                                                  "memory.limit_in_bytes"}))
            return bound, out

        threads = len(backend._pool._threads)
        bound, out = asyncio.run(go())
        assert out.status == "ok", out
        assert bound in warm_ids and out.extra["container"] == bound
        assert int(out.output) == 1536 * 2**20
        assert len(backend._pool._threads) == threads  # no worker thread: on the loop
    finally:
        backend.shutdown()
    assert _containers(owner) == []


def test_an_action_makes_its_container_when_its_opening_is_still_queued(tmp_path):
    """Under a burst the creators' queue is long (CREATORS at a time) and the core starts
    first actions in its own order, not the openings': an action - holding its cores -
    whose trajectory's container is still queued makes it at once, not after the
    containers queued before it (DockerBackend._sandbox)."""
    owner = f"queued-{tmp_path.name}"
    backend = DockerBackend(owner=owner)
    gate = threading.Event()
    for _ in range(CREATORS):  # every creator busy until the gate opens
        backend._creators.submit(gate.wait)
    try:
        async def go():
            ex = LiveExecutor(Tangram(local_cluster()), backend)
            ex.open_trajectory("q", "t")
            assert not backend._creating["q"].running()  # queued behind the busy ones
            # (a hang guard: without the take-over it waits for the gate, never opened)
            _, out = await asyncio.wait_for(ex.run(Action(
                "q1", "t", "q", "shell", {"cpu": Demand.fixed(1)},
                payload={"argv": ["echo", "made"]})), 120)
            return out

        out = asyncio.run(go())
        assert out.status == "ok" and out.output.strip() == "made", out
        assert not gate.is_set() and "q" not in backend._creating
        assert [c.id[:12] for c in _containers(owner, "q")] == [out.extra["container"]]
    finally:
        gate.set()
        backend.shutdown()
    assert _containers(owner) == []


def test_a_burst_lasts_while_its_containers_are_being_made(tmp_path):
    """The warm pool's size is the largest burst; openings of one RL step came up to
    1.6 s apart under load while their containers were still being made: they count as
    one burst until every container it asked for is made and none was needed for
    WARM_QUIET_S (counted from the gaps alone, 64 rollouts were two bursts of 32)."""
    backend = DockerBackend(owner=f"burst-{tmp_path.name}")
    try:
        with backend._lock:
            backend._creating["x"] = Future()  # a container of the burst still being made
            backend._needed("a", 2.0)
            backend._last_take -= 10 * WARM_QUIET_S  # the next opening comes much later
            backend._needed("b", 4.0)
            assert (backend._burst, backend._burst_peak) == (2, 2)
            assert backend._warm_mem() == 2.0  # a tie: the smaller limit
            del backend._creating["x"]  # all made: the next opening after a gap is a new one
            backend._last_take -= 10 * WARM_QUIET_S
            backend._needed("c", 4.0)
            assert (backend._burst, backend._burst_peak) == (1, 2)
            assert backend._warm_mem() == 4.0
    finally:
        backend.shutdown()


def test_a_sandbox_taken_from_the_pool_is_idle_from_its_taking(tmp_path):
    """A pool sandbox that waited longer than the idle TTL (an RL step minutes after the
    pool was made) is not reaped as its trajectory opens: reaped, its first action would
    say state_lost in a fresh container."""
    owner = f"warm-ttl-{tmp_path.name}"
    backend = DockerBackend(owner=owner, warm=1, idle_ttl_s=600)
    try:
        assert _until(lambda: len(backend._warm) == 1)
        box = backend._warm[0]
        box.last_used -= 3600  # made an hour ago
        backend.open_trajectory("late", None)  # the pool's limit: bound as it opens
        assert backend._boxes["late"] is box
        backend._reap(time.monotonic())  # one pass of the idle reaper
        assert backend._boxes.get("late") is box and "late" not in backend._lost
    finally:
        backend.shutdown()
    assert _containers(owner) == []
