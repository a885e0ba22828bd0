"""What the server sees of image pulls (standard library only: no Docker SDK).

A trajectory that names an image not on its node waits for a pull from the registry in
the image's reference (executor/backends/docker/cache.py). The server awaits that pull
off its event loop before it opens the trajectory (executor/server/service.py), so a
pull that fails refuses the open with :class:`PullFailed` and nothing is made; the
open's answer says what the pull cost (:meth:`PullDone.answer`).
"""

from __future__ import annotations

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

    def __init__(self, image: str, reason: str) -> None:
        self.image = image
        self.registry = registry_of(image)
        self.reason = reason.strip() or "no reason given"
        super().__init__(f"image: {image!r} could not be pulled from registry "
                         f"{self.registry!r}: {self.reason}")


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

    def image_status(self) -> dict[str, Any]:
        """Pulls in progress, the cache and its counters (the status page, /metrics)."""
        ...
