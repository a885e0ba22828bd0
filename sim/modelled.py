"""The modelled backend: "executes" a dispatch by waiting its modelled duration.

It runs on any Clock (sim/clock.py: the simulator, experiments, benchmarks and
tests). The duration comes
from the action's ground truth (:class:`traces.schema.Truth`, keyed by action
id) — never from what the scheduler was told — on the units it was granted,
plus modelled overheads: environment start at a trajectory's first CPU action
(a container under Tangram, a pod under k8s), GPU restore, setup, and for
provider-admitted API calls the provider's 429s with exponential backoff.

A batch dispatch (``Dispatch.batch``, continuous batching on a GPU service) runs as
one batch: its time is :class:`tangram.gpu.batching.BatchModel` over each member's true
time alone on the granted GPUs, and every member ends when the batch does.

With a live run's measurements (:class:`tangram.gpu.batching.MeasuredGpu`, from the
cluster.yaml ``tangram run`` wrote), a GPU action takes what the run's workers took:
one forward pass of its batch's requests at the measured cost, the restore at the
node's measured bandwidth, and the workers' measured overhead — not the trace's truth.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.images import ImageCaches, Pulled
from tangram.api.backoff import Backoff
from tangram.gpu.batching import DEFAULT_BATCHING, BatchModel, MeasuredGpu
from tangram.model import Dispatch, Outcome, counted
from tangram.policies import ProviderLimit
from tangram.protocol import PreRestore, PullImage, Resized, Traits
from tangram.runtime import Clock
from traces.schema import Truth


@dataclass(frozen=True, slots=True)
class StartupModel:
    """Environment start: lognormal(median, sigma) once its creation is admitted.

    ``rate_per_s`` / ``burst``: a control plane admits at most this many creations
    per second (a token bucket, FIFO); None: unlimited."""

    name: str
    median_s: float
    sigma: float
    rate_per_s: float | None = None
    burst: int = 1

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.lognormal(math.log(self.median_s), self.sigma)) if self.median_s else 0.0


#: docker create + start of a local image, no pull: ~0.5 s (assumption; Tangram's
#: containers are started by the node's own engine, no cluster-wide control plane)
CONTAINER_START = StartupModel("container", 0.5, 0.3)
#: Kubernetes pod start without image pull: ~2 s typical, p99 5 s (the Kubernetes
#: scalability SLO: pod startup latency p99 <= 5 s for stateless pods without image
#: pulls); pods are bound by kube-scheduler at most 50 per second with bursts of 100
#: (kube-scheduler --kube-api-qps 50 / --kube-api-burst 100 defaults; older releases
#: named it --bind-pods-qps=50, "bindings per second the scheduler is allowed to
#: continuously make")
POD_START = StartupModel("pod", 2.0, math.log(5.0 / 2.0) / 2.326, rate_per_s=50.0, burst=100)


class ControlPlane:
    """FIFO token bucket: when each creation request is admitted."""

    def __init__(self, rate_per_s: float | None, burst: int) -> None:
        self.rate = rate_per_s
        self.burst = float(max(burst, 1))
        self.tokens = self.burst
        self.last = 0.0
        self.next_free = 0.0

    def admit(self, now: float) -> float:
        if self.rate is None:
            return now
        at = max(now, self.next_free)
        self.tokens = min(self.burst, self.tokens + (at - self.last) * self.rate)
        self.last = at
        if self.tokens < 1.0:
            at += (1.0 - self.tokens) / self.rate
            self.tokens = 1.0
            self.last = at
        self.tokens -= 1.0
        self.next_free = at
        return at
#: no environment start (core-level experiments and tests)
NO_START = StartupModel("none", 0.0, 0.0)


#: the round trip of a 429 answer itself, before the backoff starts
RTT_429_S = 0.05
#: attempts before a provider-admitted call gives up and fails (as executor/backends/http/backend.py)
MAX_ATTEMPTS = 6


#: CFS weights (kernel/sched/core.c, sched_prio_to_weight): nice 0 = 1024, nice 10 = 110.
#: Actions on exclusive cores run at nice 10, light-lane actions at nice 0, so a light
#: action sharing a core with a busy one gets 1024 / 1134 of it. Measured on this kind of
#: machine (2026-11, `ls`, `cat`, a 60 ms python spin sharing a core with a nice-10 busy
#: loop): 0.9x, 1.04x, 1.24x of their idle times.
LANE_SLOWDOWN_FULL = 1134 / 1024


#: what one resize of a running grant costs the action in the model (s, a pause of its
#: progress; assumption: re-pinning is milliseconds, the cost is the caches its workers
#: lose). The core does not read it: it learns what resizes cost from the runs that end
#: (tangram/cpu/malleable.py ResizeCost), from a prior of half this
RESIZE_S = 0.1


class _EnvImage:
    """A trajectory's environment's image on ``node``: asked for at ``since``, held from
    ``at`` (None while its pull runs; ``waiters`` then wait for it)."""

    __slots__ = ("node", "since", "at", "pulled", "waiters")

    def __init__(self, node: str, since: float) -> None:
        self.node, self.since = node, since
        self.at: float | None = None
        self.pulled: Pulled | None = None
        self.waiters: list[Callable[[], None]] = []


class _Executing:
    """A malleable action executing in the model: its work left, as a fraction
    of its time at ``cores``, as of ``since`` (in the future while it still starts or
    pauses for a resize), and the timer of its end."""

    __slots__ = ("d", "truth", "cores", "left", "since", "until", "timer", "finish")

    def __init__(self, d: Dispatch, truth: Truth, since: float, until: float | None) -> None:
        self.d, self.truth, self.cores = d, truth, d.units
        self.left, self.since, self.until = 1.0, since, until
        self.timer: Any = None
        self.finish: Callable[[str], None] = lambda status: None


def truth_of(d: Dispatch) -> Truth:
    """Actions without recorded truth (hand-built ones) run as declared."""
    e = d.action.elasticity
    return Truth(d.action.t1_s or 0.0, e.parallel_fraction if e is not None else None)


def _declared_duration(d: Dispatch, truth: Truth, units: int) -> float:
    e = d.action.elasticity
    if truth.parallel_fraction is None and e is not None and units > 1:
        return truth.t1_s / (e.efficiency(units) * units)  # a declared table (tests)
    return truth.duration(units)


class ModelledBackend:
    """Models the execution of a dispatched action on a Clock."""

    #: a batch dispatch runs as one batch (one Outcome per member); a pre-restore is
    #: modelled by the GPU manager's own accounting (what is left of it is paid by the
    #: action that lands on it)
    traits = Traits(batches=True)

    def __init__(self, clock: Clock, rng: np.random.Generator,
                 truth: Mapping[str, Truth] | None = None, startup: StartupModel = NO_START,
                 provider: ProviderLimit | None = None, backoff: Backoff = Backoff(),
                 busy: Callable[[str], float] | None = None,
                 batching: BatchModel = DEFAULT_BATCHING, aoe_s: float = 0.0,
                 measured: MeasuredGpu | None = None,
                 max_attempts: int | None = MAX_ATTEMPTS,
                 images: ImageCaches | None = None,
                 image_of: Mapping[str, str] | None = None) -> None:
        """``busy(node)``: fraction of the node's cores held exclusively (for the light
        lane's time-sharing slowdown; None: no slowdown). ``batching``: the curve a batch
        dispatch runs by. ``measured``: a live GPU run's costs (GPU actions take those).
        ``images``: the nodes' image caches (sim/images.py), ``image_of``: trajectory ->
        the image its environment starts from (an environment's start on a node that
        lacks it waits for its pull)."""
        self.batching = batching
        self.measured = measured
        self.clock = clock
        self.busy = busy
        self.rng = rng
        self.truth = truth if truth is not None else {}
        self.startup = startup
        self.provider = provider
        self.backoff = backoff
        #: allocate-on-execution cost every CPU action pays (a live-measured figure:
        #: cgroup update + exec + result hand-back), 0 unless an experiment applies one
        self.aoe_s = aoe_s
        #: a provider-admitted call's attempts before it fails (None: retried until it
        #: succeeds, so a baseline does all the work Tangram does: equal-work comparisons)
        self.max_attempts = max_attempts
        self._started_envs: set[str] = set()
        #: trajectory -> when its environment, created at open, is ready (None: its pod
        #: waited for a node and starts only once bound: modelled at its first action)
        self._ready: dict[str, float | None] = {}
        self._plane = ControlPlane(startup.rate_per_s, startup.burst)
        self._cancelled: set[str] = set()
        #: malleable actions executing (Dispatch.workers set), by id: a resize re-times them
        self._executing: dict[str, _Executing] = {}
        self.retries = 0
        #: provider answers: 429s sent, and calls that gave up after MAX_ATTEMPTS
        self.rejections = 0
        self.gave_up = 0
        self.images = images
        self.image_of: Mapping[str, str] = image_of or {}
        #: trajectory -> its environment's image: the node it is held on, when the pull it
        #: waited for ended (None: not yet) and what that pull was
        self._env_images: dict[str, _EnvImage] = {}
        #: the start-time sample of a pod opened with an image (it starts once pulled)
        self._sample: dict[str, float] = {}
        #: a first action's outcome extra: what its environment's image cost
        self._env_extra: dict[str, dict[str, float]] = {}

    def open_env(self, trajectory: str, node: str | None) -> None:
        """The trajectory's environment is requested at open (the policy's ``env`` part is
        ``AtOpen``) on ``node`` (None: no node had room): created when the control plane
        admits it, ready a start time later (after its image's pull, when its node lacks it)."""
        if node is not None:
            admitted = self._plane.admit(self.clock.now())
            sample = self.startup.sample(self.rng)
            self._ready[trajectory] = admitted + sample
            if self.images is not None and trajectory in self.image_of:
                self._sample[trajectory] = sample
                self._acquire(trajectory, node)
        else:
            self._ready[trajectory] = None

    def pull(self, effect: PullImage) -> None:
        """The core pulls an image ahead of the trajectories it placed on the node."""
        if self.images is None:
            raise ValueError("pull: the simulation models no images (the trace names none)")
        self.images.prefetch(effect.node, effect.image, effect.trajectory)

    def closed(self, trajectory: str) -> None:
        """The trajectory closed: its environment no longer holds its image."""
        env = self._env_images.pop(trajectory, None)
        if env is not None and self.images is not None:
            self.images.release(env.node, self.image_of[trajectory])
        if self.images is not None:
            self.images.forget(trajectory)  # (pulled ahead for, it never started)
        self._sample.pop(trajectory, None)

    def _acquire(self, trajectory: str, node: str) -> _EnvImage:
        """Its environment's image on ``node``: held now, or once its pull ends."""
        assert self.images is not None
        env = _EnvImage(node, self.clock.now())
        self._env_images[trajectory] = env

        def ready(pulled: Pulled | None) -> None:
            env.at, env.pulled = self.clock.now(), pulled
            waiters, env.waiters = env.waiters, []
            for fn in waiters:
                fn()

        self.images.acquire(node, self.image_of[trajectory], ready, trajectory)
        return env

    def cancel(self, action_id: str) -> None:
        self._cancelled.add(action_id)

    def resize(self, effect: Resized) -> None:
        """The action runs on ``effect.cores`` from now: its progress so far kept, paused
        for RESIZE_S, its end re-timed exactly at its true speed on the new width."""
        x = self._executing.get(effect.action_id)
        if x is None:  # ended meanwhile
            return
        now = self.clock.now()
        if now > x.since:
            x.left -= (now - x.since) / self.true_duration(x.d, x.truth, x.cores)
            x.since = now
        x.left = max(x.left, 0.0)
        x.since += RESIZE_S
        x.cores = len(effect.cores)
        self._time_end(x)

    def _time_end(self, x: _Executing) -> None:
        """(Re)set the timer of ``x``'s end (at its timeout, if that comes first)."""
        if x.timer is not None:
            x.timer.cancel()
        end = x.since + x.left * self.true_duration(x.d, x.truth, x.cores)
        status = "ok"
        if x.until is not None and end > x.until:
            end, status = x.until, "timeout"
        x.timer = self.clock.call_later(end - self.clock.now(), lambda: x.finish(status))

    def prerestore(self, effect: PreRestore) -> None:
        """Nothing to do: the core's accounting (the variant ready at ``at_s +
        restore_s``) is the model; an action landing earlier pays what is left."""
        return None

    def true_duration(self, d: Dispatch, truth: Truth, cores: int | None = None) -> float:
        """Its true execution time on ``cores`` (None: its grant's) with its workers
        (``Dispatch.workers``): W workers on c cores go as min(c, W) would, and each
        worker's start-up (``unit_overhead_s``) is paid however few cores they share."""
        if d.lease.lane:  # time-shares a core with the node's exclusive actions
            b = self.busy(d.lease.node) if self.busy and d.lease.node else 0.0
            return truth.t1_s * (1.0 + b * (LANE_SLOWDOWN_FULL - 1.0))
        if not d.action.elastic:
            return _declared_duration(d, truth, 1)
        cores = d.units if cores is None else cores
        workers = d.workers or cores
        used = min(cores, workers)
        return _declared_duration(d, truth, used) + truth.unit_overhead_s * (workers - used)

    def true_duration_of(self, d: Dispatch, action_index: int) -> float:
        """True time of one action of ``d`` alone on ``d``'s units."""
        a = d.actions[action_index]
        single = d if action_index == 0 else Dispatch(a, d.lease, d.submit_s, d.start_s, None)
        return self.true_duration(single, self.truth.get(a.id) or truth_of(single))

    def _measured(self, d: Dispatch) -> tuple[float, float] | None:
        """(overhead, execution) seconds of a GPU dispatch as the live run measured them;
        None: no measurement of its service."""
        m = self.measured
        if m is None or not d.action.service:
            return None
        exec_s = m.exec_s(d.action.service, len(d.actions))
        if exec_s is None:
            return None
        return m.restore_s(d.lease.node, d.lease.restore_s, d.units) + m.overhead_s, exec_s

    def _start_batch(self, d: Dispatch, on_done: Callable[[Outcome], None],
                     measured: tuple[float, float] | None) -> None:
        if measured is not None:
            overhead, exec_s = measured
        else:
            truths = [self.truth.get(a.id) for a in d.actions]
            overhead = d.lease.restore_s + max((t.setup_s for t in truths if t), default=0.0)
            exec_s = self.batching.batch_s([self.true_duration_of(d, i)
                                            for i in range(len(d.actions))])

        def done() -> None:
            for a in d.actions:
                if a.id in self._cancelled:
                    self._cancelled.discard(a.id)
                    on_done(Outcome(a.id, "cancelled", None, overhead_s=overhead))
                else:
                    on_done(Outcome(a.id, "ok", 0, overhead_s=overhead,
                                    extra={"batch": len(d.actions)}))

        self.clock.call_later(overhead + exec_s, done)

    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        measured = self._measured(d)
        if d.batch or measured is not None:
            self._start_batch(d, on_done, measured)  # a measured GPU action: a batch of one
            return
        truth = self.truth.get(d.action.id) or truth_of(d)
        overhead = d.lease.restore_s + truth.setup_s
        if d.action.min("cpu") > 0:
            overhead += self.aoe_s
        if d.action.min("cpu") > 0 and d.action.trajectory not in self._started_envs:
            t = d.action.trajectory
            env = None
            if self.images is not None and t in self.image_of and d.lease.node is not None:
                env = self._env_images.get(t) or self._acquire(t, d.lease.node)
                if env.at is None:  # its image is being pulled: the start waits for it
                    env.waiters.append(lambda: self.start(d, on_done))
                    return
            self._started_envs.add(t)
            now = self.clock.now()
            ready = self._ready.pop(t, None)
            if ready is None:  # started now (first action, or a pod bound only now)
                ready = self._plane.admit(now) + self.startup.sample(self.rng)
            elif env is not None and t in self._sample:  # a pod: it starts once pulled
                ready = max(ready, env.at + self._sample.pop(t))
            overhead += max(ready - now, 0.0)
            if env is not None:  # what it waited for its image since its dispatch is
                # reported in its overhead (its timer runs from now)
                extra = {"image_wait_s": max(now - d.start_s, 0.0)}
                if env.pulled is not None:
                    extra.update(pulled_gb=env.pulled.gb, pull_s=env.pulled.pull_s)
                self._env_extra[d.action.id] = extra
        quotas = {k: v.min for k, v in d.action.cost.items() if counted(k) and v.min > 0}
        if self.provider is not None and quotas:
            self._attempt(d, truth, on_done, quotas, overhead, 0)
            return
        self._run(d, truth, on_done, overhead, 0)

    def _run(self, d: Dispatch, truth: Truth, on_done: Callable[[Outcome], None],
             overhead: float, retries: int, release: Callable[[], None] | None = None) -> None:
        timeout = float((d.action.payload or {}).get("timeout_s") or 0.0)

        def done(status: str) -> None:
            self._executing.pop(d.action.id, None)
            if release:
                release()
            if d.action.id in self._cancelled:
                self._cancelled.discard(d.action.id)
                on_done(Outcome(d.action.id, "cancelled", None, overhead_s=overhead))
                return
            extra: dict[str, float] = {"retries": retries}
            waited = 0.0
            if self._env_extra and d.action.id in self._env_extra:
                extra.update(self._env_extra.pop(d.action.id))
                waited = extra["image_wait_s"]
            on_done(Outcome(d.action.id, status, 0 if status == "ok" else None,
                            overhead_s=overhead + waited, extra=extra))

        if d.workers:  # malleable: its end moves when its grant is resized
            begin = self.clock.now() + overhead
            x = _Executing(d, truth, begin, begin + timeout if timeout else None)
            x.finish = done
            self._executing[d.action.id] = x
            self._time_end(x)
            return
        exec_s = self.true_duration(d, truth)
        status = "ok"
        if timeout and exec_s > timeout:
            exec_s, status = timeout, "timeout"
        self.clock.call_later(overhead + exec_s, lambda: done(status))

    def _attempt(self, d: Dispatch, truth: Truth, on_done: Callable[[Outcome], None],
                 quotas: dict[str, float], overhead: float, attempt: int) -> None:
        """Provider-admitted API call: the provider enforces its quota with 429s.

        A 429 tells the caller when the quota resets (Brave's ``X-RateLimit-Reset``, whole
        seconds; a 429 itself is not counted against the quota); the caller waits the
        longer of that and its own backoff, and gives up after MAX_ATTEMPTS: the call
        fails, and the trajectory goes on without its answer."""
        assert self.provider is not None
        now = self.clock.now()
        lease = self.provider.reserve(f"{d.action.id}/{attempt}", quotas, now)
        if lease is not None:
            provider = self.provider
            self._run(d, truth, on_done, overhead, attempt, release=lambda: provider.release(lease))
            return
        self.rejections += 1
        if self.max_attempts is not None and attempt + 1 >= self.max_attempts:
            self.gave_up += 1
            self.clock.call_later(RTT_429_S, lambda: on_done(Outcome(
                d.action.id, "failed", 429, error=f"HTTP 429 after {self.max_attempts} attempts",
                overhead_s=overhead, extra={"retries": attempt})))
            return
        self.retries += 1
        expiry = self.provider.next_expiry(now)
        reset = math.ceil(expiry - now) if expiry is not None else 0.0
        delay = max(float(reset), self.backoff.delay(attempt, float(self.rng.random())))
        self.clock.call_later(RTT_429_S + delay,
                              lambda: self._attempt(d, truth, on_done, quotas, overhead,
                                                    attempt + 1))
