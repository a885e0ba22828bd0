"""Container images as a scheduled resource: what the core believes each CPU
node's image cache holds, and where a trajectory that names an image should open.

The core sees only what a deployment knows: each trajectory's declared image and size
(``Open.image``, ``Open.image_gb``), the pulls it ordered (``PullImage``) and the images
of the trajectories it bound, and the pull rates its backend reports on the first action
of a trajectory that waited for one (``Outcome.extra``: ``pulled_gb``, ``pull_s``). Its
belief of a node's cache follows the rule the node's cache keeps (least recently used
first past ``image_cache_gb``, never an image in use or wanted by a trajectory planned
there); a pull it ordered counts as held from then on (a later start there waits at most
for what is left of it).

How a policy uses the book is its ``images`` part (tangram/policies.py):

* :class:`ImageAware` (tangram): a trajectory is placed when it opens, on the node where
  its image costs the fewest pull seconds among nodes whose load stays within 1.5x the
  fair share, and its image is pulled there ahead of its first action (:class:`PullImage`)
  while the model thinks. One that no node has room for yet is expected on the node the
  same rule picks among all nodes (its first action waits in the binding queue, and binds
  there when that node has room first), and its image is pulled there ahead too, but
  only on a node pulling nothing else and within its disk budget
  (``ImageBook.pull_ahead``);
* :class:`PullOnDemand` (the Kubernetes baseline): images play no part in placement; the
  environment's start pulls what its node lacks;
* :class:`ImageLocality`: kube-scheduler's ImageLocality score beside its resource score
  for a pod's node;
* :class:`PrePulled`: every image on every node before the run (the ideal with unbounded
  disk; the simulator asks ``held_at_start``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from tangram.cluster import ClusterSpec, CpuNodeSpec

#: the pull rate the core assumes until it has observed one (GB/s): the cluster file's
#: ``extra.image_pull_mbps`` when it gives one, else 1 Gbit/s (assumption)
PRIOR_PULL_GBPS = 0.125
#: weight of the newest observed pull rate in the core's running estimate
RATE_WEIGHT = 0.2
#: a node's load (trajectories bound or planned there) may reach this multiple of the fair
#: share before a cached image stops drawing more trajectories to it (assumption: past
#: it, its queue would cost more than a pull elsewhere; swept by none yet)
LOAD_SLACK = 1.5
#: a pull ahead for a trajectory still waiting for a node (speculative: it may bind
#: elsewhere) is ordered only while fewer pulls than this are believed to run on its
#: node: 1, only on a node pulling nothing, since pulls at once share the node's
#: bandwidth (sim/images.py, the engine) and one ordered beside a pull for a trajectory
#: placed there would slow that one's first action for a trajectory that waits anyway
AHEAD_SLOTS = 1
#: kube-scheduler ImageLocality's bounds of a container's score (pkg/scheduler/framework/
#: plugins/imagelocality: minThreshold 23 MB, maxContainerThreshold 1000 MB)
_MIN_MB, _MAX_MB = 23.0, 1000.0


class ImageBook:
    """The core's belief of the CPU nodes' image caches, and the trajectories' images."""

    def __init__(self, nodes: Iterable[CpuNodeSpec], prior_gbps: float = PRIOR_PULL_GBPS,
                 side: ImageSide | None = None) -> None:
        self.side: ImageSide = side if side is not None else PullOnDemand()
        #: trajectory -> (image, GB), for those that name one
        self.image_of: dict[str, tuple[str, float]] = {}
        #: trajectory -> the node it was placed on at open, until bound
        self.planned: dict[str, str] = {}
        #: the memory placed trajectories will take where they are placed, until bound:
        #: trajectory -> (GB declared, GB assumed in use at start), and each node's sums
        #: (what a later open's room is checked against beside what is bound there: memory
        #: is reserved at binding, and a burst's opens all come before its bindings)
        self.placed_mem: dict[str, tuple[float, float]] = {}
        self.placed_gb: dict[str, list[float]] = {}
        #: the planned trajectories no node had room for at open (their sandbox is not
        #: made at open: they are expected there, not placed), in open order
        self.expected: dict[str, None] = {}
        #: of ``expected``, those whose pull ahead is not ordered yet (at their open, or
        #: their node was pulling, or its disk budget had no room for it), in open order
        self.deferred: dict[str, None] = {}
        #: before this time no deferred pull ahead can be ordered (a node's pull ends then
        #: at the observed rate; inf: only a freed image can make room: ``_freed``)
        self.retry_at = 0.0
        #: trajectory -> the node it is bound to (for those that name an image)
        self.bound_to: dict[str, str] = {}
        self.held: dict[str, OrderedDict[str, float]] = {}
        self.used_gb: dict[str, float] = {}
        self.budget: dict[str, float | None] = {}
        self.users: dict[str, Counter[str]] = {}
        self.wanted: dict[str, Counter[str]] = {}
        self.load: Counter[str] = Counter()
        #: node -> image -> when the pull the core ordered there should end (at the
        #: observed rate, after the pulls ordered there before it); absent: held
        self.ready_at: dict[str, dict[str, float]] = {}
        #: node -> when the last pull ordered there should end
        self.backlog: dict[str, float] = {}
        for spec in nodes:
            self.add_node(spec)
        self.rate_gbps = prior_gbps
        self.observed = 0
        #: pulls ordered ahead (PullImage effects)
        self.prefetches = 0

    @classmethod
    def of(cls, cluster: ClusterSpec, side: ImageSide) -> ImageBook:
        mbps = cluster.extra.get("image_pull_mbps")
        prior = float(mbps) / 8000.0 if isinstance(mbps, int | float) and mbps > 0 \
            else PRIOR_PULL_GBPS
        return cls(cluster.cpu_nodes, prior, side)

    # -- nodes -------------------------------------------------------------------------
    def add_node(self, spec: CpuNodeSpec) -> None:
        self.held[spec.name] = OrderedDict()
        self.used_gb[spec.name] = 0.0
        self.budget[spec.name] = spec.image_cache_gb
        self.users[spec.name] = Counter()
        self.wanted[spec.name] = Counter()
        self.placed_gb[spec.name] = [0.0, 0.0]
        self.ready_at[spec.name] = {}
        self.backlog[spec.name] = 0.0

    def remove_node(self, node: str) -> None:
        for table in (self.held, self.used_gb, self.budget, self.users, self.wanted,
                      self.ready_at, self.backlog, self.placed_gb):
            table.pop(node, None)  # type: ignore[attr-defined]
        self.planned = {t: n for t, n in self.planned.items() if n != node}
        self.placed_mem = {t: m for t, m in self.placed_mem.items() if t in self.planned}
        self.expected = {t: None for t in self.expected if t in self.planned}
        self.deferred = {t: None for t in self.deferred if t in self.planned}
        self.bound_to = {t: n for t, n in self.bound_to.items() if n != node}
        self.load.pop(node, None)

    # -- trajectories ------------------------------------------------------------------
    def opened(self, trajectory: str, image: str, gb: float) -> None:
        if image:
            self.image_of[trajectory] = (image, gb)

    def plan(self, trajectory: str, node: str, now: float,
             mem: tuple[float, float] = (0.0, 0.0)) -> bool:
        """Place ``trajectory`` on ``node`` ahead of its binding; True when its image must
        be pulled there (the node holds none of it in the core's belief): the pull is
        expected to end after those ordered there before it, at the observed rate.
        ``mem``: the memory it will take there (declared, assumed in use at its start),
        counted against the node's room until it is bound."""
        image, gb = self.image_of[trajectory]
        self.planned[trajectory] = node
        self.placed_mem[trajectory] = mem
        taken = self.placed_gb[node]
        taken[0] += mem[0]
        taken[1] += mem[1]
        self.load[node] += 1
        self.wanted[node][image] += 1
        missing = image not in self.held[node]
        if missing:
            end = max(now, self.backlog[node]) + gb / self.rate_gbps
            self.backlog[node] = end
            self.ready_at[node][image] = end
        self._hold(node, image, gb)
        return missing

    def expect(self, trajectory: str, node: str) -> None:
        """Expect ``trajectory``, which no node has room for now, on ``node`` (its first
        action binds there when that node has room first): its image is wanted there from
        now, and ordered there (pulled, where the node lacks it) once ``pull_ahead`` finds
        room for it."""
        image, _ = self.image_of[trajectory]
        self.planned[trajectory] = node
        self.expected[trajectory] = None
        self.load[node] += 1
        self.wanted[node][image] += 1
        held = self.held[node]
        if image in held:
            held.move_to_end(image)
        self.deferred[trajectory] = None
        self.retry_at = 0.0  # (tried at once: its node may be pulling nothing)

    def pull_ahead(self, now: float) -> list[tuple[str, str, str]]:
        """The pulls ahead to order now for expected trajectories, in open order: (node,
        image, trajectory). One whose image is held there (or ordered there already) is
        ordered at once, at no cost: the node keeps the image and a warm sandbox of it for
        the trajectory (the core believes it wanted there). A pull is bounded, as a
        speculative one must be (the trajectory may bind elsewhere): it is ordered only
        while fewer than ``AHEAD_SLOTS`` pulls are believed to run on its node (so it
        takes no bandwidth from a pull a placed trajectory waits for, and one placed later
        shares the node with one pull ahead at most), and only when its image fits the
        node's disk budget beside every image in use or wanted there (it never evicts
        those, nor keeps the cache over its budget); the rest wait until the node's pulls
        end or images are freed there."""
        if not self.deferred or now < self.retry_at:
            return []
        out: list[tuple[str, str, str]] = []
        retry = float("inf")
        # per node, for this call: the ends of the pulls believed running, and the GB of
        # the images in use or wanted there (what no pull ahead may evict)
        running: dict[str, list[float]] = {}
        kept: dict[str, float] = {}
        for trajectory in list(self.deferred):
            node = self.planned[trajectory]
            image, gb = self.image_of[trajectory]
            held = self.held[node]
            if image in held:  # held there (or ordered, for another): nothing to pull,
                # but the order tells the node to keep it for this one (and a warm sandbox)
                del self.deferred[trajectory]
                out.append((node, image, trajectory))
                continue
            ends = running.get(node)
            if ends is None:
                ends = running[node] = [e for e in self.ready_at[node].values() if e > now]
            if len(ends) >= AHEAD_SLOTS:
                retry = min(retry, min(ends))
                continue
            budget = self.budget[node]
            if budget is not None:
                if node not in kept:
                    users, wanted = self.users[node], self.wanted[node]
                    kept[node] = sum(size for i, size in held.items()
                                     if users[i] > 0 or wanted[i] > 0)
                if kept[node] + gb > budget:
                    continue  # until an image is freed there (_freed)
                kept[node] += gb
            del self.deferred[trajectory]
            end = max(now, self.backlog[node]) + gb / self.rate_gbps
            self.backlog[node] = end
            self.ready_at[node][image] = end
            ends.append(end)
            self._hold(node, image, gb)
            self.prefetches += 1
            out.append((node, image, trajectory))
        self.retry_at = retry
        return out

    def _unplace(self, trajectory: str, node: str | None) -> None:
        """``trajectory`` is no longer placed on ``node`` (bound, or closed): the room it
        was counted as taking there is free."""
        mem = self.placed_mem.pop(trajectory, None)
        taken = self.placed_gb.get(node) if node is not None else None
        if mem is not None and taken is not None:
            taken[0] -= mem[0]
            taken[1] -= mem[1]

    def _freed(self) -> None:
        """An image became unused or unwanted somewhere: a deferred pull ahead may fit."""
        self.retry_at = 0.0

    def bound(self, trajectory: str, node: str) -> None:
        """``trajectory`` was bound to ``node``: its environment holds its image there."""
        got = self.image_of.get(trajectory)
        if got is None or node not in self.held:
            return
        image, gb = got
        planned = self.planned.pop(trajectory, None)
        self._unplace(trajectory, planned)
        self.expected.pop(trajectory, None)
        self.deferred.pop(trajectory, None)
        if planned is not None and planned in self.wanted:
            self.wanted[planned][image] -= 1
            self.load[planned] -= 1
            self._freed()
        self.bound_to[trajectory] = node
        self.load[node] += 1
        self.users[node][image] += 1
        self._hold(node, image, gb)

    def unbound(self, trajectory: str) -> None:
        node = self.bound_to.pop(trajectory, None)
        if node is None or node not in self.users:
            return
        image, _ = self.image_of[trajectory]
        self.users[node][image] -= 1
        self.load[node] -= 1
        self._evict(node)
        self._freed()

    def closed(self, trajectory: str) -> None:
        self.unbound(trajectory)
        planned = self.planned.pop(trajectory, None)
        self._unplace(trajectory, planned)
        self.expected.pop(trajectory, None)
        self.deferred.pop(trajectory, None)
        got = self.image_of.pop(trajectory, None)
        if planned is not None and got is not None and planned in self.wanted:
            self.wanted[planned][got[0]] -= 1
            self.load[planned] -= 1
            self._freed()

    def observe(self, gb: float, seconds: float) -> None:
        """A pull of ``gb`` took ``seconds`` (reported by the backend)."""
        if gb > 0 and seconds > 0:
            rate = gb / seconds
            self.rate_gbps = rate if not self.observed else \
                (1 - RATE_WEIGHT) * self.rate_gbps + RATE_WEIGHT * rate
            self.observed += 1

    # -- what placement asks -----------------------------------------------------------
    def pull_s(self, trajectory: str, node: str, now: float) -> float:
        """Seconds from ``now`` until ``trajectory``'s image would be on ``node``: 0 where
        held (or no image); what is left of its pull where one was ordered there; else
        the pulls ordered there before it, then its own, at the observed rate."""
        got = self.image_of.get(trajectory)
        if got is None:
            return 0.0
        image, gb = got
        if image in self.held[node]:
            return max(self.ready_at[node].get(image, now) - now, 0.0)
        return max(self.backlog[node] - now, 0.0) + gb / self.rate_gbps

    def locality_score(self, trajectory: str, node: str) -> float:
        """kube-scheduler's ImageLocality score of ``node`` for the pod of ``trajectory``,
        0-100: the image's size scaled by the share of nodes holding it, when ``node``
        holds it, clamped to [23 MB, 1000 MB] and normalised."""
        got = self.image_of.get(trajectory)
        if got is None or got[0] not in self.held[node]:
            return 0.0
        image, gb = got
        spread = sum(image in h for h in self.held.values()) / len(self.held)
        mb = min(max(gb * 1000.0 * spread, _MIN_MB), _MAX_MB)
        return 100.0 * (mb - _MIN_MB) / (_MAX_MB - _MIN_MB)

    # -- the cache as the core believes it ---------------------------------------------
    def _hold(self, node: str, image: str, gb: float) -> None:
        held = self.held[node]
        if image in held:
            held.move_to_end(image)
            return
        held[image] = gb
        self.used_gb[node] += gb
        self._evict(node)

    def _evict(self, node: str) -> None:
        budget = self.budget.get(node)
        if budget is None or self.used_gb[node] <= budget:
            return
        users, wanted, held = self.users[node], self.wanted[node], self.held[node]
        for image in list(held):
            if self.used_gb[node] <= budget:
                break
            if users[image] > 0 or wanted[image] > 0:
                continue
            self.used_gb[node] -= held.pop(image)
            self.ready_at[node].pop(image, None)

    def counters(self) -> dict[str, float]:
        return {"image_prefetches": self.prefetches, "image_pull_gbps": self.rate_gbps,
                "image_pulls_observed": self.observed}


# -- the policy part ---------------------------------------------------------------------
class ImageSide(Protocol):
    """How a policy places trajectories that name an image (tangram/policies.py)."""

    name: ClassVar[str]

    def place(self, book: ImageBook, trajectory: str, nodes: Iterable[str],
              now: float) -> str | None:
        """Where ``trajectory`` opens (among ``nodes``, those with room for it), decided
        when it opens at ``now``; None: at its binding, as any other."""
        ...

    def score(self, book: ImageBook, trajectory: str, node: str) -> float:
        """What a node holding images adds to a pod's node score (0-100)."""
        ...

    def held_at_start(self, images: Mapping[str, float]) -> frozenset[str]:
        """The images every node holds before the run (what a simulator starts with)."""
        ...


@dataclass(frozen=True)
class PullOnDemand:
    """Images play no part in placement: an environment's start pulls what its node lacks
    (a Kubernetes pod with ``imagePullPolicy: IfNotPresent``)."""

    name: ClassVar[str] = "pull-on-demand"

    def place(self, book: ImageBook, trajectory: str, nodes: Iterable[str],
              now: float) -> str | None:
        return None

    def score(self, book: ImageBook, trajectory: str, node: str) -> float:
        return 0.0

    def held_at_start(self, images: Mapping[str, float]) -> frozenset[str]:
        return frozenset()


@dataclass(frozen=True)
class ImageLocality(PullOnDemand):
    """kube-scheduler's ImageLocality plugin: a pod's node score adds 0-100 by the bytes
    of its image the node already holds, scaled by how many nodes hold it."""

    name: ClassVar[str] = "image-locality"

    def score(self, book: ImageBook, trajectory: str, node: str) -> float:
        return book.locality_score(trajectory, node)


@dataclass(frozen=True)
class PrePulled(PullOnDemand):
    """Every image on every node before the run, never removed: the ideal with unbounded
    disk (a bound no deployment with thousands of task images reaches)."""

    name: ClassVar[str] = "pre-pulled"

    def held_at_start(self, images: Mapping[str, float]) -> frozenset[str]:
        return frozenset(images)


@dataclass(frozen=True)
class ImageAware(PullOnDemand):
    """Tangram's placement: a trajectory that names an image is placed when it opens, on
    the node where its image would be soonest (``ImageBook.pull_s``: 0 where held, what is
    left of a pull ordered there, else the node's pull backlog and its own bytes at the
    observed rate) among the nodes whose load (trajectories bound or placed there) stays
    within ``LOAD_SLACK`` x the fair share, the least loaded of equals; its image is
    pulled there ahead of its first action (PullImage), while its model generates."""

    name: ClassVar[str] = "image-aware"

    def place(self, book: ImageBook, trajectory: str, nodes: Iterable[str],
              now: float) -> str | None:
        if trajectory not in book.image_of:
            return None
        nodes = [n for n in nodes if n in book.held]
        if not nodes:
            return None
        load = book.load
        fair = (sum(load[n] for n in nodes) + 1) / len(nodes)
        cap = LOAD_SLACK * fair + 1
        within = [n for n in nodes if load[n] < cap] or nodes
        return min(within, key=lambda n: (book.pull_s(trajectory, n, now), load[n]))
