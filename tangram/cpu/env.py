"""When a trajectory's environment (container, pod) starts, a part of a policy
(tangram/policies.py): at its first action (:class:`AtFirstAction`) or when it opens
(:class:`AtOpen`). The binding (tangram/cpu/binding.py) asks it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class AtFirstAction:
    """A trajectory's environment (container) starts with its first action, on the node
    that action binds it to."""

    name: ClassVar[str] = "first_action"
    #: an idle trajectory may give its node to one waiting for memory (Tangram's
    #: MemoryObserved): its next action binds it again, like a first action
    reclaimable: ClassVar[bool] = True

    def opened(self, trajectory: str, request: Callable[[str], None]) -> None:
        """At open: nothing is started (its first action binds it)."""
        return None


@dataclass(frozen=True)
class AtOpen:
    """The RL framework requests the environment (a pod) when the trajectory opens: it is
    bound to a node in open order and holds its memory (and pod cores) until it closes."""

    name: ClassVar[str] = "open"
    #: the pod holds its place (memory, cores) until the trajectory closes
    reclaimable: ClassVar[bool] = False

    def opened(self, trajectory: str, request: Callable[[str], None]) -> None:
        request(trajectory)
