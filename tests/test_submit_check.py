"""An HTTP submit is checked once, by the core: the service hands the action to the core
and maps its refusal to the HTTP error (KeyError: 404, ValueError: 422); only a refused
batch is checked again, item by item, to name the refused item."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import cluster

from executor.driver import LiveExecutor
from executor.server.journal import Journal
from executor.server.schemas import ActionIn, TrajectoryIn
from executor.server.service import Refused, Service
from executor.server.tokens import DEFAULT
from tangram.core import Tangram
from tangram.model import Dispatch, Outcome


class Idle:
    """A backend whose actions run until the test ends (what it starts is all we look at)."""

    name = "idle"

    def __init__(self) -> None:
        self.started: list[str] = []

    def start(self, dispatch: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        self.started.append(dispatch.action.id)

    def cancel(self, action_id: str) -> None:
        pass

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None:
        pass

    def close_trajectory(self, trajectory: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _checks(tmp_path: Path):
    """A service over a 4-core core, and the count of the separate checks it asks for."""
    backend = Idle()
    executor = LiveExecutor(Tangram(cluster(cores=4)), backend)  # type: ignore[arg-type]
    checks = []
    validate = executor.validate

    def counted(action) -> None:
        checks.append(action.id)
        validate(action)

    executor.validate = counted  # type: ignore[method-assign]
    service = Service(executor, Journal(tmp_path / "journal.db"))
    return service, backend, checks


def test_a_submit_is_checked_once_by_the_core(tmp_path):
    async def go() -> None:
        service, backend, checks = _checks(tmp_path)
        tid = service.open_trajectory(TrajectoryIn(task="t"), owner=DEFAULT)["id"]
        view, created = await service.submit(tid, ActionIn(id="ok", command="true"), DEFAULT)
        assert created and backend.started == ["ok"] and checks == []
        with pytest.raises(Refused) as refused:  # the core's refusal, as before: 422
            await service.submit(tid, ActionIn(id="big", command="true", cpu="64"), DEFAULT)
        assert refused.value.status == 422 and "can never fit" in refused.value.detail
        assert checks == [] and service.view("big") is None  # nothing recorded
        out = await service.submit_batch([(tid, ActionIn(id="b1", command="true")),
                                          (tid, ActionIn(id="b2", command="true"))],
                                         owner=DEFAULT)
        assert [created for _, created in out] == [True, True] and checks == []
        with pytest.raises(Refused) as refused:  # all or nothing; the item is named
            await service.submit_batch([(tid, ActionIn(id="b3", command="true")),
                                        (tid, ActionIn(id="b4", command="true", cpu="64"))],
                                       owner=DEFAULT)
        assert refused.value.status == 422
        assert refused.value.detail.startswith("actions[1].action.cost['cpu']: ")
        assert checks == ["b3", "b4"]  # (only a refused batch: to name its item)
        assert service.view("b3") is None and "b3" not in backend.started

    asyncio.run(go())
