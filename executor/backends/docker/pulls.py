"""What the server sees of image pulls (standard library only: no Docker SDK).

A trajectory that names an image not on its node waits for a pull from the registry in
the image's reference (executor/backends/docker/cache.py). The server awaits that pull
off its event loop before it opens the trajectory (executor/server/service.py), so a
pull that fails refuses the open with :class:`PullFailed` and nothing is made; the
open's answer says what the pull cost (:meth:`PullDone.answer`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

#: the registry of a reference that names none (Docker's own rule)
DEFAULT_REGISTRY = "docker.io"


def registry_of(image: str) -> str:
    """The registry host of ``image``'s reference: its first path part when that looks like
    a host (has a dot or a port, or is localhost), else Docker Hub."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return DEFAULT_REGISTRY


class PullFailed(RuntimeError):
    """An image could not be pulled: the message names the image, its registry and why."""

    def __init__(self, image: str, reason: str, node: str | None = None) -> None:
        self.image = image
        self.registry = registry_of(image)
        self.reason = reason.strip() or "no reason given"
        #: the node that tried (a multi-node backend's; None: this machine)
        self.node = node
        where = f" to node {node!r}" if node else ""
        super().__init__(f"image: {image!r} could not be pulled from registry "
                         f"{self.registry!r}{where}: {self.reason}")

    def __reduce__(self) -> tuple:  # (an agent's failure crosses to the server pickled)
        return (PullFailed, (self.image, self.reason, self.node))


@dataclass(frozen=True)
class PullDone:
    """How an image came to be on the node for one open."""

    image: str
    #: False: it was on the node already (a cache hit)
    pulled: bool
    #: True: the open joined a pull another open (or a pull-ahead) had started
    shared: bool = False
    #: bytes the pull downloaded (compressed layers; layers already on the node: none)
    bytes: int = 0
    #: seconds the pull waited for a free slot (--image-pulls), then ran
    queued_s: float = 0.0
    pull_s: float = 0.0

    def answer(self) -> dict[str, Any]:
        """What the open's answer says of its image."""
        out: dict[str, Any] = {"image": self.image, "pulled": self.pulled}
        if self.pulled:
            out.update(shared=self.shared, bytes=self.bytes, queued_s=round(self.queued_s, 3),
                       pull_s=round(self.pull_s, 3))
        return out


@runtime_checkable
class ImageFetching(Protocol):
    """A backend that pulls the images trajectories name (the docker backend)."""

    def want_image(self, trajectory: str, image: str) -> Future[PullDone]:
        """``image`` for ``trajectory``, which is opening: done at once when it is on the
        node, else when its pull ends (PullFailed if it fails). Held against eviction
        until the trajectory is opened and closed, or ``unwant_image``."""
        ...

    def unwant_image(self, trajectory: str) -> None:
        """``trajectory`` will not open after all (its pull failed, or its open did)."""
        ...

    def expect_image(self, trajectory: str, image: str, mem_gb: float | None) -> None:
        """The core expects ``trajectory``, not opened here, to open here (of ``image``,
        ``mem_gb``) once the node has room for it: a warm sandbox is kept for it (once its
        image, pulled ahead, is here) until it opens here or is closed here."""
        ...

    def image_status(self) -> dict[str, Any]:
        """Pulls in progress, the cache and its counters (the status page, /metrics)."""
        ...


@runtime_checkable
class NodeImageOpening(Protocol):
    """A multi-node backend whose nodes pull their own images (Ray): a trajectory naming an
    image is opened in the core first, which places it; then its image is had and its
    sandbox opened on that node, awaited (the driver's ``open_trajectory_placed``)."""

    def runs_images(self) -> bool:
        """Whether its nodes run images at all (the docker backend) or not (processes)."""
        ...

    async def open_image_on(self, trajectory: str, mem_gb: float | None, image: str,
                            node: str) -> tuple[float | None, PullDone]:
        """Open ``trajectory``'s sandbox of ``image`` on ``node``, pulled there first when
        it lacks it: its size in GB (None: not known) and how it came to be there.
        PullFailed (naming the node) or ValueError, with nothing left there, if not."""
        ...

    def image_status(self) -> dict[str, Any]:
        """Every node's pulls, cache and counters, summed, each node's under ``nodes``."""
        ...


def merge_node_images(nodes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The image status of several nodes (each a docker backend's ``image_status``) as one
    of the same shape: counters, bytes and counts summed, pulls and cached images listed
    with their ``node``; each node's own under ``nodes``."""
    counters: Counter[str] = Counter()
    warm: Counter[str] = Counter()
    for status in nodes.values():
        counters.update(status.get("counters", {}))
        warm.update(status.get("warm", {}))
    budgets = [status.get("budget_bytes") for status in nodes.values()]
    return {
        "pulls_at_once": max((status.get("pulls_at_once", 0) for status in nodes.values()),
                             default=0),
        "budget_bytes": None if not budgets or None in budgets else sum(budgets),
        "used_bytes": sum(status.get("used_bytes", 0) for status in nodes.values()),
        "over_budget": any(status.get("over_budget") for status in nodes.values()),
        "pulling": [{**p, "node": node} for node, status in nodes.items()
                    for p in status.get("pulling", [])],
        "cached": [{**c, "node": node} for node, status in nodes.items()
                   for c in status.get("cached", [])],
        "cached_count": sum(status.get("cached_count", 0) for status in nodes.values()),
        "counters": dict(counters), "warm": dict(sorted(warm.items())),
        "nodes": {node: dict(status) for node, status in sorted(nodes.items())},
    }
