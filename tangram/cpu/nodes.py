"""The CPU nodes as the core sees them (tangram/sides.py): memory admission set on the
manager, the nodes' light lanes (their next overstay, those due, the count of actions moved
off them), a node joining (its pool, as the policy's CPU part builds it) or leaving (its
trajectories re-bound: tangram/cpu/binding.py), the submit-time check against what the
nodes can ever hold, the point queries (a trajectory's node, a node's busy cores) and what
the snapshot shows (counters, node views, figures)."""

from __future__ import annotations

from collections.abc import Iterable

from tangram.cluster import CpuNodeSpec, GpuNodeSpec
from tangram.cpu.admission import MemoryAdmission
from tangram.cpu.binding import Binding
from tangram.cpu.images import ImageBook
from tangram.cpu.manager import CpuManager
from tangram.cpu.views import busy_fraction, cpu_views
from tangram.model import Action
from tangram.parts import CpuSide
from tangram.pool import LightLane, PoolPoints, Resizable, light_lane
from tangram.protocol import Capabilities, Effect, Outcome, PullImage
from tangram.sides import Check, Figures
from tangram.trajectory import TrajectoryState


class CpuNodes:
    """The CPU side of a core: its manager, the cluster's CPU nodes as they join and leave,
    every pool (the core's own dict: a joining node's pool is added to it) and the binding
    of trajectories to nodes (tangram/sides.py: ``Membership``, ``Checking``, ``Hosting``,
    ``Learning``, ``Locating``, ``Overstaying``, ``Attaching``, ``Owing``, ``Reporting``)."""

    def __init__(self, cpu: CpuManager, nodes: tuple[CpuNodeSpec, ...], side: CpuSide,
                 pools: dict[str, PoolPoints], binding: Binding,
                 admission: MemoryAdmission, images: ImageBook) -> None:
        self._cpu = cpu
        #: the cluster's CPU nodes now (validation and capacity hold to these)
        self.nodes = nodes
        self._side = side
        self._pools = pools
        self._binding = binding
        cpu.admission = admission
        #: the nodes' light lanes (asked for their next overstay after every event)
        self._lanes = self._lanes_of()
        #: light-lane actions that overstayed and were moved off it
        self.lane_moves = 0
        #: the backend re-pins a running action (Capabilities.resizes, from Attach)
        self._resizes = False
        #: the nodes' images as the core believes them (tangram/cpu/images.py), given to
        #: the CPU manager when the first trajectory naming an image opens
        self._images = images
        #: the backend pulls images ahead (Capabilities.pulls, from Attach)
        self._pulls = False

    def _lanes_of(self) -> tuple[LightLane, ...]:
        return tuple(lane for pool in self._pools.values()
                     if (lane := light_lane(pool)) is not None and lane.lane_slots)

    def moved_off_lane(self) -> None:
        self.lane_moves += 1

    def lane_wakeup(self) -> float | None:
        """When the next action on a light lane overstays it, unless it ends first."""
        return min((at for lane in self._lanes if (at := lane.lane_wakeup()) is not None),
                   default=None)

    def overstayed(self, now: float) -> list[PoolPoints]:
        """The pools whose lane has an action overstaying it by ``now``."""
        return [pool for pool in self._pools.values()
                if (lane := light_lane(pool)) is not None and lane.due(now)]

    def node_of(self, trajectory: str) -> str | None:
        return self._cpu.node_of(trajectory)

    def placed_on(self, trajectory: str) -> str | None:
        """The node ``trajectory`` is bound to, else the one its image placed it on at open
        (None: neither yet)."""
        bound = self._cpu.node_of(trajectory)
        if bound is not None or self._cpu.images is None or trajectory in self._images.expected:
            return bound  # (one only expected there has no room there yet: not placed)
        return self._images.planned.get(trajectory)

    def busy_fraction(self, node: str) -> float:
        return busy_fraction(self._cpu, node)

    # -- membership --------------------------------------------------------------------
    def joined(self, spec: CpuNodeSpec | GpuNodeSpec) -> Iterable[PoolPoints] | None:
        """A CPU node joined: its capacity and pool are added; a pass follows (trajectories
        waiting to be bound may fit on it)."""
        pool = self._side.grow(self._cpu, spec)  # type: ignore[arg-type]  # the pool build would have made for it
        if isinstance(pool, Resizable):
            pool.grows = self._resizes
        self._pools[pool.name] = pool
        self._lanes = self._lanes_of()
        self._nodes_changed((*self.nodes, spec))  # type: ignore[arg-type]
        return ()

    def lost(self, node: str) -> Iterable[PoolPoints] | None:
        """A CPU node left (its machine or its agent died). Idempotent.

        Its capacity goes; trajectories bound there are unbound (their state is gone)
        and their queued actions go back to the binding queue in submit order, so
        they are re-bound elsewhere. Actions *running* there stay running until the
        executor reports each one (failed): it reports them, exactly once, through
        ``Finish``, which then releases nothing."""
        pool = self._pools.get(f"cpu:{node}")
        if pool is None or node not in self._cpu.nodes:
            return None
        self._binding.node_lost(node, pool)
        self._nodes_changed(tuple(n for n in self.nodes if n.name != node))
        return ()

    def worker_lost(self, node: str) -> None:
        return None

    def _nodes_changed(self, nodes: tuple[CpuNodeSpec, ...]) -> None:
        self.nodes = nodes
        self._binding.nodes_changed(nodes)

    def attached(self, capabilities: Capabilities) -> None:
        self._binding.evicts = capabilities.evicts
        # grants resize (tangram/cpu/malleable.py) only where the backend re-pins a
        # running action's processes: elsewhere it would run on cores given to others
        self._resizes = capabilities.resizes
        self._pulls = capabilities.pulls
        for pool in self._pools.values():
            if isinstance(pool, Resizable):
                pool.grows = capabilities.resizes

    def checker(self) -> Check:
        """Takes every action it is asked about: refused when no node can ever hold it."""
        limits = self._binding.limits

        def check(action: Action, state: TrajectoryState) -> bool:
            limits.check(action, state.mem_gb)
            return True

        return check

    # -- what the snapshot shows -------------------------------------------------------
    def counters(self) -> dict[str, float]:
        out = {"trajectories_reclaimed": self._binding.reclaimed,
               "lane_moves": self.lane_moves,
               "grants_resized": sum(p.resized for p in self._pools.values()
                                     if isinstance(p, Resizable))}
        if self._cpu.images is not None:  # (a trajectory named an image)
            out.update(self._images.counters())
        return out

    # -- trajectories (tangram/sides.py Hosting) ----------------------------------------
    def check_open(self, mem_gb: float | None) -> None:
        self._binding.limits.check_open(mem_gb)

    def opened(self, trajectory: str, mem_gb: float | None, image: str, image_gb: float,
               now: float) -> list[Effect]:
        """Its image booked (and pulled ahead: ``open_image``), its environment started
        where the policy starts it at open (tangram/cpu/binding.py)."""
        if not self.nodes:
            return []
        out = self.open_image(trajectory, mem_gb or 0.0, image, float(image_gb),
                              now) if image else []
        self._binding.opened(trajectory)
        return out

    def closed(self, trajectory: str) -> bool:
        """Its image and its node's memory freed: True when a trajectory waits for a node
        (a pass is due)."""
        if self._cpu.images is not None:
            self._images.closed(trajectory)
        return self._binding.closed(trajectory)

    # -- images (tangram/cpu/images.py) ----------------------------------------------------
    def open_image(self, trajectory: str, mem_gb: float, image: str, image_gb: float,
                   now: float) -> list[Effect]:
        """Book ``trajectory``'s image; where the policy places it at open, plan it there
        and order the pull its node lacks (only from a backend that pulls ahead). Where the
        policy would place it but no node has room for its memory now, it is expected on
        the node the policy picks among those that could ever hold it: its first action
        waits in the binding queue, and the pull its image needs there is ordered ahead,
        within that node's pull slots and disk budget (``owed``), rather than paid by that
        action on its core once bound."""
        book, cpu = self._images, self._cpu
        cpu.images = book
        book.opened(trajectory, image, image_gb)
        # room beside what is bound there and what is placed there still unbound: memory
        # is reserved at binding, and a burst opens all its trajectories before any binds
        # (without it a burst was placed, and its pulls ordered, far past the nodes' room)
        admission = cpu.admission
        room = []
        for name, host in cpu.nodes.items():
            taken, since = book.placed_gb[name]
            if admission.refusal(name, host.spec.mem_gb, host.mem_reserved + taken, mem_gb,
                                 host.mem_observed_free, host.mem_since + since) is None:
                room.append(name)
        node = book.side.place(book, trajectory, room, now)
        if node is None:
            if not room:
                could = [name for name, host in cpu.nodes.items()
                         if host.spec.mem_gb >= mem_gb]
                node = book.side.place(book, trajectory, could, now)
                if node is not None:
                    book.expect(trajectory, node)
            return []
        if not book.plan(trajectory, node, now, (mem_gb, min(mem_gb, admission.start_gb))) \
                or not self._pulls:
            return []
        book.prefetches += 1
        return [PullImage(node, image, trajectory)]

    def owed(self, out: list[Effect], now: float) -> None:
        """(tangram/sides.py Owing) The pulls ahead for expected trajectories that their
        nodes have room for now (``ImageBook.pull_ahead``), after every command: a slot
        frees as time passes, disk as images are freed."""
        book = self._images
        if book.deferred and now >= book.retry_at and self._pulls:
            out += [PullImage(node, image, trajectory)
                    for node, image, trajectory in book.pull_ahead(now)]

    #: (tangram/sides.py Learning) what a backend reports of an image's pull
    learns_from = frozenset({"pull_s"})

    def ended(self, outcome: Outcome) -> None:
        """An action's outcome: where its environment's start waited for an image, what
        the pull took (the observed pull rate)."""
        if self._cpu.images is not None and "pull_s" in outcome.extra:
            self._images.observe(float(outcome.extra.get("pulled_gb", 0.0)),
                                 float(outcome.extra["pull_s"]))

    def views(self) -> dict[str, object]:
        return {"cpu_nodes": cpu_views(self._cpu, self._pools.values())}

    def usage(self) -> Figures:
        return Figures({"cpu": 0.0, "cpu_lane": 0.0},
                       {"mem_gb": sum(n.mem_reserved for n in self._cpu.nodes.values())})

    def capacity(self) -> Figures:
        return Figures({"cpu": float(sum(n.cores for n in self.nodes))},
                       {"mem_gb": float(sum(n.mem_gb for n in self.nodes)),
                        "cpu_lane": float(sum(lane.lane_slots for p in self._pools.values()
                                                  if (lane := light_lane(p)) is not None))})
