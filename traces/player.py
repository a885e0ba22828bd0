"""The closed-loop trajectory player: one for `tangram simulate` and `tangram run`.

Each trajectory of a trace is played the same way whatever runs it: open it, then for
each step think (wait its ``think_s``), submit the step's action, wait for its result,
and finally close it. The player is a generator; the driver supplies a :class:`Door`
whose ``sleep`` and ``run`` give what its clock waits on (SimPy events in sim/driver.py,
awaitables in executor/replay.py) and drives the generator: SimPy runs it as a process,
asyncio through :func:`drive`. The drivers differ only in their clock and backend.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import Any, Protocol

from tangram.cluster import ClusterSpec
from tangram.core import Tangram
from tangram.model import Action
from tangram.policies import Policy
from traces.fit import check_fits
from traces.schema import Step, TrajectorySpec


class Door(Protocol):
    """What a driver gives the player."""

    def open(self, spec: TrajectorySpec) -> None: ...

    def sleep(self, seconds: float) -> Any:
        """Something the driver's clock waits on for ``seconds``."""

    def run(self, action: Action) -> Any:
        """Something the driver's clock waits on until ``action`` ended; its value is
        the action's (Record, Outcome)."""

    def close(self, trajectory: str) -> None: ...


def play(spec: TrajectorySpec, door: Door,
         prepare: Callable[[Step], Action] | None = None,
         ended: Callable[[Action, Any], None] | None = None) -> Generator[Any, Any, None]:
    """Play one trajectory through ``door``; ``prepare`` turns a step into the action to
    submit (default: the step's action), ``ended`` sees each action's result."""
    door.open(spec)
    try:
        for step in spec.steps:
            if step.think_s > 0:
                yield door.sleep(step.think_s)
            action = prepare(step) if prepare is not None else step.action
            result = yield door.run(action)
            if ended is not None:
                ended(action, result)
    finally:
        door.close(spec.id)


async def drive(player: Generator[Any, Any, None]) -> None:
    """Run a player on asyncio: await what it yields, send the result back (an error is
    thrown into it, so that it closes its trajectory before the error goes on)."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            awaitable = player.throw(error) if error is not None else player.send(value)
        except StopIteration:
            return
        try:
            value, error = await awaitable, None
        except BaseException as e:  # noqa: BLE001 - cancellation too: the player closes
            value, error = None, e


def refuse_misfits(cluster: ClusterSpec, policy: Policy, specs: Iterable[TrajectorySpec]
                   ) -> None:
    """Refuse the whole run before it starts if any action can never run on ``cluster``
    under ``policy`` (checked on a core of its own: the check opens trajectories)."""
    check_fits(Tangram(cluster, policy), specs)
