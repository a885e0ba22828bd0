"""The simulator's model of container images on CPU nodes: what each node's
image cache really holds, and its pulls. The core never reads it: it keeps its own belief
(tangram/cpu/images.py) from what it ordered and observed.

* A node's **cache** holds images up to its disk budget (``image_cache_gb`` of the cluster
  file's CPU node; none: no budget). After a pull, least recently used images go until the
  cache is back under budget, but never one in use (an open environment started from it),
  being pulled, or wanted (pulled ahead for a trajectory that has not started yet):
  the kubelet's image garbage collection between its thresholds, which removes only unused
  images. With every image held busy the cache stays over budget (``peak_gb`` shows it)
  rather than fail a start: disk is larger than the threshold that starts collection.
* A node's **pulls**: at most ``pulls`` at once, the rest waiting in order; those running
  share the node's pull bandwidth (``image_pull_mbps``, megabits per second) equally
  (processor sharing: each pull's end is re-timed when one starts or ends). A pull also
  has a cost of its own whatever its size (``image_pull_overhead_s``, optional, 0 when
  absent: the manifest, the layer's registration and the engine's bookkeeping; 0.2-0.4 s
  through the engine here, which a 16 MB image's bytes take only 0.2 s beside): it is
  counted as the bytes the node's bandwidth moves in that time, so it shares the node
  with the other pulls as their bytes do.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tangram.cluster import ClusterSpec
from tangram.runtime import Clock

#: megabits per GB (decimal): image_pull_mbps is a network figure
_MBIT_PER_GB = 8000.0


@dataclass(frozen=True, slots=True)
class Pulled:
    """What a start waited for: the pull that brought its image (None: it was held)."""

    gb: float
    #: seconds the pull took from its start (its observed rate is gb / pull_s)
    pull_s: float
    #: seconds this start waited for it (less than pull_s when it was pulled ahead)
    wait_s: float


@dataclass(slots=True)
class _Pull:
    image: str
    gb: float
    left_gb: float
    started: float | None = None
    waiters: list[Callable[[Pulled | None], None]] = field(default_factory=list)
    waiting_since: list[float] = field(default_factory=list)


class _Node:
    __slots__ = ("budget", "held", "used_gb", "users", "wanted", "running", "queue", "last",
                 "timer", "peak_gb")

    def __init__(self, budget: float | None) -> None:
        self.budget = budget
        #: image -> GB, least recently used first
        self.held: OrderedDict[str, float] = OrderedDict()
        self.used_gb = 0.0
        self.users: Counter[str] = Counter()
        self.wanted: Counter[str] = Counter()
        self.running: dict[str, _Pull] = {}
        self.queue: deque[_Pull] = deque()
        self.last = 0.0
        self.timer: Any = None
        self.peak_gb = 0.0


def pull_settings(cluster: ClusterSpec) -> tuple[float, int, float]:
    """(image_pull_mbps, pulls at once per node, image_pull_overhead_s) of the cluster
    file's ``extra``; a clear error when one is missing (the overhead may be: 0) or not a
    positive number (the overhead: not a finite number >= 0)."""
    out = []
    for key, integer in (("image_pull_mbps", False), ("image_pulls", True)):
        value = cluster.extra.get(key)
        if value is None:
            raise ValueError(f"images: the cluster file has no extra.{key} (the trace names "
                             "container images; see sim/clusters/default.yaml)")
        # (finite: an infinite bandwidth ends every pull at the instant it starts, which
        # processor sharing cannot time; a pull that costs nothing is a size of 0)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0 \
            and math.isfinite(value)
        if not ok or (integer and value != int(value)):
            raise ValueError(f"extra.{key}: must be a {'whole' if integer else 'finite'} "
                             f"number > 0, got {value!r}")
        out.append(int(value) if integer else float(value))
    overhead = cluster.extra.get("image_pull_overhead_s", 0.0)
    if not (isinstance(overhead, int | float) and not isinstance(overhead, bool)
            and math.isfinite(overhead) and overhead >= 0):
        raise ValueError("extra.image_pull_overhead_s: must be a finite number of seconds "
                         f">= 0, got {overhead!r}")
    return out[0], out[1], float(overhead)


class ImageCaches:
    """Every CPU node's image cache and pulls, on a Clock."""

    def __init__(self, clock: Clock, sizes: Mapping[str, float],
                 budgets: Mapping[str, float | None], pull_mbps: float, pulls: int,
                 held: Iterable[str] = (), overhead_s: float = 0.0) -> None:
        """``sizes``: GB of each image; ``budgets``: node -> its cache's GB (None: none);
        ``held``: images every node holds from the start (pre-pulled, never evicted);
        ``overhead_s``: a pull's own cost, whatever its size (the module's text)."""
        for image, gb in sizes.items():
            if not (isinstance(gb, int | float) and math.isfinite(gb) and gb > 0):
                raise ValueError(f"image {image!r}: image_gb must be a finite size > 0 (the GB "
                                 f"a node pulls for it), got {gb!r}: give every row that "
                                 "names an image its size")
        self.clock = clock
        self.sizes = sizes
        self.gbps = pull_mbps / _MBIT_PER_GB
        self.pulls = pulls
        #: a pull's own cost, as the GB the node's bandwidth moves meanwhile
        self.overhead_gb = overhead_s * self.gbps
        self.nodes = {n: _Node(b) for n, b in budgets.items()}
        self.pinned = frozenset(held)
        for node in self.nodes.values():
            for image in self.pinned:
                node.held[image] = sizes[image]
        #: environment starts that found their image held, and those that waited for a pull
        self.hits = 0
        self.misses = 0
        self.pulled_gb = 0.0
        self.pulls_done = 0
        #: pulls started (on demand or ahead)
        self.pulls_started = 0
        self.evictions = 0
        #: trajectory -> (node, image) it was pulled ahead for: wanted there until the
        #: trajectory starts (on that node or, bound elsewhere, on another) or closes
        self.wants: dict[str, tuple[str, str]] = {}

    # -- what the backend asks ---------------------------------------------------------
    def acquire(self, node: str, image: str, then: Callable[[Pulled | None], None],
                trajectory: str = "") -> None:
        """An environment starts on ``node`` from ``image``: ``then(None)`` at once when the
        node holds it, else ``then(Pulled)`` when its pull (started now, or already under
        way) ends. The image is in use from then on until ``release``. ``trajectory``'s
        pull ahead, wherever it was ordered, is wanted no more (without one: a want of
        ``image`` on ``node``)."""
        n = self.nodes[node]
        want = self.wants.pop(trajectory, None) if trajectory else None
        if want is not None:
            # (it may start on another node than the one its image was pulled ahead to:
            # that node's want is its own, not another trajectory's want here; here its
            # image is in use before anything is evicted again)
            w = self.nodes[want[0]]
            if w.wanted[want[1]] > 0:
                w.wanted[want[1]] -= 1
            if w is not n:
                self._evict(w)
        elif n.wanted[image] > 0:
            n.wanted[image] -= 1
        if image in n.held:
            self.hits += 1
            n.held.move_to_end(image)
            n.users[image] += 1
            then(None)
            return
        self.misses += 1

        def done(pulled: Pulled | None) -> None:
            n.users[image] += 1
            then(pulled)

        pull = self._pull(node, image)
        pull.waiters.append(done)
        pull.waiting_since.append(self.clock.now())

    def prefetch(self, node: str, image: str, trajectory: str = "") -> None:
        """Pull ``image`` to ``node`` ahead of a trajectory that will start there (the
        core's PullImage); it is wanted (not evicted) until that start."""
        if node not in self.nodes:
            raise KeyError(f"node: unknown CPU node {node!r}")
        if image not in self.sizes:
            raise KeyError(f"image: unknown image {image!r} (no trajectory of the trace "
                           "names it)")
        n = self.nodes[node]
        if trajectory:
            self.forget(trajectory)  # (a trajectory is pulled ahead for on one node)
            self.wants[trajectory] = (node, image)
        n.wanted[image] += 1
        if image not in n.held:
            self._pull(node, image)

    def forget(self, trajectory: str) -> None:
        """``trajectory``'s pull ahead is wanted no more (it started, or closed unstarted)."""
        want = self.wants.pop(trajectory, None)
        if want is None:
            return
        node, image = want
        n = self.nodes.get(node)
        if n is not None and n.wanted[image] > 0:
            n.wanted[image] -= 1
            self._evict(n)

    def release(self, node: str, image: str) -> None:
        """An environment started from ``image`` on ``node`` ended."""
        n = self.nodes[node]
        if n.users[image] > 0:
            n.users[image] -= 1
        self._evict(n)

    def peak_gb(self) -> float:
        """The most GB any node's cache held at once."""
        return max((n.peak_gb for n in self.nodes.values()), default=0.0)

    # -- pulls -------------------------------------------------------------------------
    def _pull(self, node: str, image: str) -> _Pull:
        n = self.nodes[node]
        pull = n.running.get(image) or next((p for p in n.queue if p.image == image), None)
        if pull is not None:
            return pull
        gb = float(self.sizes[image])
        pull = _Pull(image, gb, gb + self.overhead_gb)
        self.pulls_started += 1
        self._advance(n)
        if len(n.running) < self.pulls:
            pull.started = self.clock.now()
            n.running[image] = pull
        else:
            n.queue.append(pull)
        self._retime(node, n)
        return pull

    def _advance(self, n: _Node) -> None:
        now = self.clock.now()
        if n.running and now > n.last:
            share = (now - n.last) * self.gbps / len(n.running)
            for p in n.running.values():
                p.left_gb -= share
        n.last = now

    def _retime(self, node: str, n: _Node) -> None:
        if n.timer is not None:
            n.timer.cancel()
            n.timer = None
        if n.running:
            left = min(p.left_gb for p in n.running.values())
            delay = max(left, 0.0) * len(n.running) / self.gbps
            n.timer = self.clock.call_later(delay, lambda: self._ended(node))

    def _ended(self, node: str) -> None:
        n = self.nodes[node]
        n.timer = None
        self._advance(n)
        now = self.clock.now()
        done = [p for p in n.running.values() if p.left_gb <= 1e-9]
        if not done and n.running:
            # the timer was set for the pull with the least left: it is over. (Its bytes
            # left can stay above 0 when the clock's float cannot advance by the time they
            # need - a huge image late in a run - and re-arming a timer that does not move
            # the clock would loop for ever)
            done = [min(n.running.values(), key=lambda p: p.left_gb)]
        for p in done:
            del n.running[p.image]
            n.held[p.image] = p.gb
            n.used_gb += p.gb
            n.peak_gb = max(n.peak_gb, n.used_gb)
            self.pulled_gb += p.gb
            self.pulls_done += 1
        while n.queue and len(n.running) < self.pulls:
            nxt = n.queue.popleft()
            nxt.started = now
            n.running[nxt.image] = nxt
        self._retime(node, n)
        for p in done:
            pull_s = now - (p.started if p.started is not None else now)
            for waiter, since in zip(p.waiters, p.waiting_since, strict=True):
                waiter(Pulled(p.gb, pull_s, now - since))
        self._evict(n)

    def _evict(self, n: _Node) -> None:
        """Least recently used first, while over budget: never an image in use, wanted,
        being pulled or pre-pulled."""
        if n.budget is None or n.used_gb <= n.budget + 1e-9:
            return
        for image in list(n.held):
            if n.used_gb <= n.budget + 1e-9:
                break
            if n.users[image] or n.wanted[image] or image in self.pinned:
                continue
            n.used_gb -= n.held.pop(image)
            self.evictions += 1

    def counters(self) -> dict[str, float]:
        """``image_hit_rate``: the share of environment starts that needed no pull of their
        own (1 - pulls started / starts: a start that joins a pull already under way, made
        for another start or ahead by the core, is a hit; the first start of an image on a
        node, pulled ahead or not, is a miss). ``image_held_rate``: the share that found
        their image held, its pull over."""
        starts = self.hits + self.misses
        return {"image_starts": starts, "image_held": self.hits,
                "image_hit_rate": 1.0 - self.pulls_started / starts if starts else 1.0,
                "image_held_rate": self.hits / starts if starts else 1.0,
                "image_pulled_gb": round(self.pulled_gb, 3), "image_pulls": self.pulls_started,
                "image_evictions": self.evictions, "image_cache_peak_gb": round(self.peak_gb(), 3)}
