"""The one object the HTTP handlers call: trajectories, actions, results, metrics.

It owns the live executor and the journal; handlers never read the core's
state themselves. Every refusal is a :class:`Refused` with the HTTP status and
a message naming the field, so the routes stay thin.

Everything a client reaches is its token's (executor/server/tokens.py): a
trajectory is its opener's (a fork's copies the forker's), an action its submitter's, and
any other token's request for one is answered exactly as for an id that does not exist
(404, the same words), so ids say nothing of other tokens' work. The one thing ids share
is their namespace: opening or submitting under an id another token holds is a 409 (use
generated ids, or a prefix per client). The status page and /metrics stay global: they
are the operator's view of the machine.

Results stay in memory only while someone may still be waiting for them
(``result_ttl_s`` after the action ended); after that they are read back from
the journal, so the server's memory does not grow with the number of actions.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from executor.backends.docker.pulls import NodeImageOpening, PullDone, PullFailed
from executor.backends.http.urls import UrlRefused, check_headers, listed, parse_allow_list, parse_target
from executor.commands import CommandError, argv_of
from executor.driver import LiveExecutor
from executor.node.memwatch import MemoryWatch
from executor.server.fork import (
    Forked,
    Forking,
    ForkRefused,
    check_fork,
    close_copies,
    copy_ids,
    open_copies,
    unknown_source,
)
from executor.server.images import image_fetcher, image_metric_lines, image_status_of
from executor.server.journal import RESTARTED, SHUTDOWN, Journal
from executor.server.routes.gpus import metric_lines
from executor.server.schemas import (
    ID_MAX,
    MAX_TIMEOUT_S,
    ActionIn,
    ActionOut,
    TrajectoryIn,
    TrajectoryOut,
)
from executor.server.tokens import DEFAULT
from tangram.fork import fork_action
from tangram.model import Action, Outcome, quota_resource
from tangram.protocol import Effect, Retaining
from tangram.runtime import Record

log = logging.getLogger("tangram.service")

class Refused(Exception):
    """A request the service will not carry out; ``status`` is the HTTP status."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass
class Tracked:
    trajectory: str
    body: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: ActionOut | None = None
    #: a client asked to cancel it: it ends ``cancelled`` whatever its backend reports
    cancelled: bool = False
    #: the name of the token that submitted it (executor/server/tokens.py)
    owner: str = DEFAULT
    #: a fork action's copies: closed again unless it ends ``ok``
    copies: tuple[str, ...] = ()
    #: what a fork action made, once it ended ``ok``
    forked: Forked | None = None


@dataclass
class Opened:
    """What the service knows of an open trajectory (the core knows its node and load)."""

    task: str
    mem_gb: float | None
    image: str | None
    opened_at: float  # monotonic
    last_active: float  # monotonic: its last submit or end
    actions: int = 0
    state_lost: int = 0
    closing: bool = False


@dataclass(frozen=True, slots=True)
class Prepared:
    """A submitted action checked in full, ready to be accepted."""

    trajectory: str
    body: ActionIn
    raw: str
    action: Action
    owner: str


#: how long a cancel (or a close with actions in flight) waits for a running action's
#: backend to stop it; the answer then says what it is
CANCEL_WAIT_S = 30.0
#: how often a cancel asks again while the action has not ended
CANCEL_REPEAT_S = 0.5
#: the error of an action a client cancelled
CANCELLED = "cancelled by the client"


def result_of(rec: Record, out: Outcome) -> ActionOut:
    extra = dict(out.extra or {})
    return ActionOut(
        id=rec.action_id, trajectory=rec.trajectory, status=out.status, exit_code=out.exit_code,
        output=out.output, error=out.error, units=rec.units, lane=rec.lane,
        cores=[int(c) for c in extra.get("cores", [])], gpus=[int(g) for g in extra.get("gpus", [])],
        queue_s=rec.start_s - rec.submit_s, exec_s=rec.end_s - rec.start_s,
        state_lost=bool(extra.get("state_lost")), retries=int(extra.get("retries", 0)),
        argv=list(extra.get("argv", [])), node=rec.node)


def _item(i: int, detail: str) -> str:
    """A refusal of a batch's item ``i``, its field named from the batch's top."""
    field, sep, rest = detail.partition(": ")
    if sep and field.translate({ord(c): None for c in "_.[]'"}).isalnum():
        if field == "trajectory":
            return f"actions[{i}].trajectory: {rest}"
        return f"actions[{i}].action.{field}: {rest}"
    if detail.startswith("unknown trajectory"):
        return f"actions[{i}].trajectory: {detail}"
    return f"actions[{i}]: {detail}"


class Service:
    """The state behind the API: executor, trajectories, tracked actions, journal."""

    def __init__(self, executor: LiveExecutor, journal: Journal,
                 allow_urls: Mapping[str, tuple[str, ...]] | None = None,
                 result_ttl_s: float = 60.0,
                 task_images: Mapping[str, str] | None = None,
                 memory_node: str | None = None) -> None:
        """``memory_node``: the CPU node this machine is, whose free memory is observed
        for the core's memory admission (None: none observed; e.g. a Ray cluster's nodes
        keep reserving every declared limit in full)."""
        self.executor = executor
        self.memwatch: MemoryWatch | None = None
        if memory_node is not None:
            self.memwatch = MemoryWatch(executor, memory_node)
            self.memwatch.start()
        #: task -> docker image of its sandboxes, unless the trajectory names one
        self.task_images = dict(task_images or {})
        self.journal = journal
        #: quota key -> URL prefixes its `request` actions may reach ('*': any public host)
        self.allow_urls = {quota_resource(k): v
                           for k, v in parse_allow_list(allow_urls or {}).items()}
        self.result_ttl_s = result_ttl_s
        self.tracked: dict[str, Tracked] = {}
        #: open trajectories, in the order they opened (GET /v1/trajectories)
        self.opened: dict[str, Opened] = {}
        self.counts: dict[str, int] = {}
        self.act_sum = 0.0
        self.started = time.time()
        self.recovered = journal.recover()
        #: trajectory -> the name of the token it belongs to (every open one, and the copies
        #: a fork is filling)
        self.owners: dict[str, str] = {}
        #: source -> its fork actions in flight (listed with it)
        self.forks: dict[str, set[str]] = {}
        self.restored = self._restore()
        self._restore_owners()
        self.closing = asyncio.Event()
        self.max_cores = int(executor.snapshot(detail=False).capacity.get("cpu", 1))
        #: forks in flight per source (tangram/fork.py: they do not keep others from forking)
        self.forking = Forking()
        #: trajectories whose open waits for their image's pull (their ids are taken)
        self.pulling: set[str] = set()

    # -- trajectories ------------------------------------------------------------------
    async def open_pulling(self, body: TrajectoryIn, *, owner: str) -> dict[str, Any]:
        """Open it once its image is on the node: a docker image that is not is pulled
        first (executor/backends/docker/cache.py), awaited here off the event loop; the
        answer's ``image`` says what that cost. A pull that fails refuses the open (502,
        naming the image, its registry and why) and nothing is opened."""
        image = body.image or self.task_images.get(body.task)
        if image is not None and isinstance(self.executor.backend, NodeImageOpening) \
                and self.executor.backend.runs_images():
            return await self.open_on_node(body, image, owner=owner)
        fetcher = image_fetcher(self.executor.backend)
        if image is None or fetcher is None:
            return self.open_trajectory(body, owner=owner)
        tid = self._check_open(body)
        body = body.model_copy(update={"id": tid})
        self.pulling.add(tid)
        opened = False
        try:
            try:
                want = asyncio.wrap_future(fetcher.want_image(tid, image))
            except ValueError as e:  # a malformed reference
                raise Refused(422, str(e)) from None
            await self._unless_closing(want)
            try:
                done: PullDone = want.result()
            except PullFailed as e:
                raise Refused(502, str(e)) from None
            except ValueError as e:
                raise Refused(422, str(e)) from None
            self.pulling.discard(tid)  # (open_trajectory checks the id is free)
            answer: dict[str, Any] = dict(self.open_trajectory(body, owner=owner))
            opened = True
        finally:
            self.pulling.discard(tid)
            if not opened:
                fetcher.unwant_image(tid)
        answer["image"] = done.answer()
        return answer

    async def open_on_node(self, body: TrajectoryIn, image: str, *,
                           owner: str) -> dict[str, Any]:
        """Open it on a multi-node backend (Ray): the core places it, that node pulls its
        image and opens its sandbox (LiveExecutor.open_trajectory_placed), awaited here;
        the answer's ``image`` says on which node and what the pull cost. A pull that fails
        refuses the open (502, naming the image, its registry, the node and why), nothing
        opened anywhere."""
        tid = self._check_open(body)
        self.pulling.add(tid)
        try:
            opening = asyncio.ensure_future(self.executor.open_trajectory_placed(
                tid, body.task, body.mem_gb, image))
            await self._unless_closing(opening)  # (a cancelled opening closes what it opened)
            try:
                node, done = opening.result()
            except PullFailed as e:
                raise Refused(502, str(e)) from None
            except ValueError as e:
                raise Refused(422, str(e)) from None
            except OSError as e:  # e.g. the node's work directory cannot be made
                raise Refused(503, f"cannot open trajectory {tid!r}: {e}") from None
        finally:
            self.pulling.discard(tid)
        self._record_open(tid, body, image, owner)
        answer: dict[str, Any] = {"id": tid, "task": body.task}
        answer["image"] = {**(done.answer() if done is not None else {"image": image}),
                           "node": node}
        return answer

    async def _unless_closing(self, job: asyncio.Future) -> None:
        """Wait for ``job`` (an open's pull or placement) unless the server starts shutting
        down first: then ``job`` is cancelled and the open refused (503)."""
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            await asyncio.wait((job, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
        if not job.done():
            job.cancel()
            raise Refused(503, "the server is shutting down")

    def _check_open(self, body: TrajectoryIn) -> str:
        """The id ``body`` opens (generated when it names none), once it may be opened."""
        self._not_closing()
        if body.action is not None:
            raise Refused(422, "action: names a fork's action; give it with fork_of")
        tid = body.id or secrets.token_hex(8)
        if self.executor.has_trajectory(tid) or tid in self.pulling:
            raise Refused(409, f"id: trajectory {tid!r} is already open")
        return tid

    def open_trajectory(self, body: TrajectoryIn, *, owner: str) -> dict[str, str]:
        """Open it, ``owner``'s (the name of the request's token)."""
        tid = self._check_open(body)
        try:
            self.executor.open_trajectory(tid, body.task, body.mem_gb,
                                          body.image or self.task_images.get(body.task))
        except ValueError as e:
            raise Refused(422, str(e)) from None
        except PullFailed as e:  # (pulled here only where the image went meanwhile)
            raise Refused(502, str(e)) from None
        except OSError as e:  # e.g. the work directory cannot be made
            raise Refused(503, f"cannot open trajectory {tid!r}: {e}") from None
        self._record_open(tid, body, body.image or self.task_images.get(body.task), owner)
        return {"id": tid, "task": body.task}

    def _record_open(self, tid: str, body: TrajectoryIn, image: str | None, owner: str) -> None:
        """An open trajectory, ``owner``'s: journalled, listed."""
        self.journal.opened(tid, body.task, body.mem_gb, image)
        self.journal.owned(tid, owner)
        self.owners[tid] = owner
        now = time.monotonic()
        self.opened[tid] = Opened(body.task, body.mem_gb, image, now, now)

    def owns(self, tid: str, owner: str) -> bool:
        """Whether open trajectory ``tid`` is ``owner``'s (False for one not open)."""
        return self.owners.get(tid) == owner

    def _mine(self, tid: str, owner: str) -> None:
        """404, as for an unknown id, unless ``tid`` is ``owner``'s."""
        if self.owners.get(tid) != owner:
            raise Refused(404, f"unknown trajectory {tid!r}")

    def _restore_owners(self) -> None:
        """The owners of the trajectories restored from the journal (``default`` for one a
        journal from before ownership names no owner of)."""
        for tid in self.opened:
            self.owners[tid] = self.journal.owner(tid)

    async def fork_trajectories(self, body: TrajectoryIn, *, owner: str) -> dict[str, Any]:
        """``body.count`` copies of ``body.fork_of`` (executor/server/fork.py), ``owner``'s.

        The fork is an action of the source like any: tracked and journalled
        under its id (``body.action``, else generated; the answer's ``action``), looked up
        and cancelled by it while it runs; closing the source cancels it as it cancels the
        source's other actions (rather than waiting: a close means the source's sandbox is
        no longer wanted, and a fork of a large tree runs for tens of seconds). Unless it
        ends ``ok`` its copies are closed again before anyone hears of its end."""
        self._not_closing()
        assert body.fork_of is not None
        source = body.fork_of
        if body.mem_gb is not None or body.image is not None:
            raise Refused(422, "fork_of: a copy takes its source's mem_gb and image; "
                          "leave mem_gb and image out")
        ids = copy_ids(source, body.count, body.id)
        if max(map(len, ids)) > ID_MAX:
            raise Refused(422, f"id: the copies' ids ({ids[-1]!r}) would pass {ID_MAX} "
                          "characters; use a shorter id")
        if not self.owns(source, owner):
            raise Refused(404, unknown_source(source))
        aid = body.action or f"fork-{secrets.token_hex(8)}"
        if aid in self.tracked or self.journal.action_owner(aid) is not None:
            raise Refused(409, f"action: an action {aid!r} was submitted before; name the "
                          "fork's action anew")
        opened = self.opened.get(source)
        image = opened.image if opened is not None else None
        try:
            view = check_fork(self.executor, source, ids, self.forking)
            open_copies(self.executor, view, ids, image)
        except ForkRefused as e:
            raise Refused(e.status, e.detail) from None
        except ValueError as e:
            raise Refused(422, str(e)) from None
        except OSError as e:
            raise Refused(503, f"cannot open the copies of {source!r}: {e}") from None
        for c in ids:  # the forker's from now: nobody else's request reaches them
            self.owners[c] = owner
        t = Tracked(source, json.dumps({"fork_of": source, "ids": ids}), owner=owner,
                    copies=tuple(ids))
        try:
            self._submit_fork(fork_action(aid, view.task, source, ids), t)
        except BaseException:
            self._drop_copies(t)
            raise
        closing = asyncio.ensure_future(self.closing.wait())
        ended = asyncio.ensure_future(t.done.wait())
        try:
            await asyncio.wait((ended, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            closing.cancel()
        res = t.result
        if res is None or res.error == SHUTDOWN:  # the server stops: the copies with it
            try:
                self._drop_copies(t)
            except Exception as e:  # noqa: BLE001 - the backend may have stopped already
                log.warning("the copies of %r not closed at shutdown: %s", source, e)
            raise Refused(503, "the server is shutting down")
        if res.status == "cancelled":
            raise Refused(409, f"fork of {source!r} cancelled (its action {aid!r} was "
                          "cancelled, or its source closed); its copies are closed")
        if res.status != "ok":
            raise Refused(500, f"fork of {source!r} {res.status}: {res.error}")
        # the copies are open trajectories like any: listed, journalled (a restart reopens
        # them), with their source's task, memory and image
        done = t.forked
        assert done is not None
        # (all in one transaction, and only now that every copy is complete: a crash
        # before leaves none journalled, and a restart removes them all)
        if opened is not None:
            now = time.monotonic()
            self.journal.opened_all([(tid, opened.task, opened.mem_gb, opened.image)
                                     for tid in ids], owner)
            for tid in ids:
                self.opened[tid] = Opened(opened.task, opened.mem_gb, opened.image, now, now)
        return done.answer()

    def _submit_fork(self, action: Action, t: Tracked) -> None:
        """Queue fork ``action`` with its tracking ``t`` (Refused if the core refuses it)."""
        aid, source = action.id, action.trajectory

        def queued() -> None:
            self.tracked[aid] = t
            self.forks.setdefault(source, set()).add(aid)
            # counted in here and out in _fork_ended, where the core counts the action in
            # and out of its trajectory's in_flight: check_fork subtracts one from the
            # other, so they must move together (counted out by the request's future, a
            # turn of the loop after the core, a second fork of the same source in between
            # was refused with "-1 action(s) in flight")
            self.forking.add(source)
            opened = self.opened.get(source)
            if opened is not None:
                opened.actions += 1
                opened.last_active = time.monotonic()
            self.journal.submitted(aid, source, t.body, t.owner)

        try:
            self.executor.submit_many([action], self._finish, queued)
        except KeyError as e:
            raise Refused(404, str(e.args[0])) from None
        except ValueError as e:
            raise Refused(422, str(e)) from None

    def _drop_copies(self, t: Tracked) -> None:
        """Close a fork's copies (it did not end ``ok``): nothing half-made stays open."""
        close_copies(self.executor, t.copies)
        for c in t.copies:
            if c not in self.opened:  # (opened: a copy the fork already handed over)
                self.owners.pop(c, None)

    def _restore(self) -> int:
        """Open again the trajectories the journal says a previous run left open (a crash
        or a stop): their clients' next submits find them. The process backend keeps their
        work directories; what else their sandboxes held (processes, files elsewhere) is
        gone. One that cannot be opened again is forgotten (its next submit gets 404)."""
        restored = 0
        left_open = self.journal.open_trajectories()
        if isinstance(self.executor.backend, Retaining):  # what else a crash left: removed
            self.executor.backend.retain([row[0] for row in left_open])
        for tid, task, mem_gb, image in left_open:
            try:
                self.executor.open_trajectory(tid, task, mem_gb, image)
                restored += 1
            except (ValueError, OSError, PullFailed) as e:
                log.warning("trajectory %r left open by the previous run not restored: %s",
                            tid, e)
                self.journal.closed(tid)
                continue
            now = time.monotonic()
            self.opened[tid] = Opened(task, mem_gb, image, now, now)
        return restored

    async def close_trajectory(self, tid: str, *, owner: str) -> dict[str, str | int]:
        """Close it; its actions still queued or running are cancelled first (their
        results say ``cancelled``; a fork of it among them)."""
        self._mine(tid, owner)
        if not self.executor.has_trajectory(tid):
            raise Refused(404, f"unknown trajectory {tid!r}")
        opened = self.opened.get(tid)
        if opened is not None:
            opened.closing = True  # no new action while its last ones are cancelled
        core = self.executor.trajectory(tid)
        # (a scan of every tracked action only when it has some in flight: most closes don't)
        in_flight = [aid for aid, t in self.tracked.items()
                     if t.trajectory == tid and t.result is None] if core and core.in_flight else []
        try:
            await asyncio.gather(*(self._cancel(aid, self.tracked[aid]) for aid in in_flight))
            if not self.executor.has_trajectory(tid):  # closed by a concurrent request
                return {"id": tid, "status": "closed", "cancelled": len(in_flight)}
            self.executor.close_trajectory(tid)
        except ValueError as e:  # an action its backend did not stop within CANCEL_WAIT_S
            if opened is not None:
                opened.closing = False
            raise Refused(409, str(e)) from None
        self.opened.pop(tid, None)
        self.owners.pop(tid, None)
        self.journal.closed(tid)
        return {"id": tid, "status": "closed", "cancelled": len(in_flight)}

    def trajectories(self, *, owner: str) -> list[TrajectoryOut]:
        """Every open trajectory of ``owner`` with its state, node, idle time and memory."""
        running = self._running_trajectories()
        return [view for tid in list(self.opened) if self.owners.get(tid) == owner
                if (view := self.trajectory_view(tid, running)) is not None]

    def _running_trajectories(self) -> set[str]:
        """The trajectories with an action running (one pass over the tracked actions)."""
        return {t.trajectory for aid, t in self.tracked.items()
                if t.result is None and self.executor.is_running(aid)}

    def trajectory_view(self, tid: str, running: set[str] | None = None) -> TrajectoryOut | None:
        """One open trajectory (None if it is not open); ``running``: the trajectories with
        an action running, when the caller has them."""
        opened = self.opened.get(tid)
        core = self.executor.trajectory(tid)
        if opened is None or core is None:
            return None
        now = time.monotonic()
        busy = core.in_flight and tid in (self._running_trajectories() if running is None
                                          else running)
        state = ("closing" if opened.closing else "running" if busy
                 else "queued" if core.in_flight else "idle")
        return TrajectoryOut(
            id=tid, task=opened.task, state=state, node=core.node, in_flight=core.in_flight,
            idle_s=0.0 if core.in_flight else now - opened.last_active,
            age_s=now - opened.opened_at, mem_gb=opened.mem_gb, image=opened.image,
            actions=opened.actions, state_lost=opened.state_lost,
            forks=sorted(self.forks.get(tid, ())))

    # -- cancel ----------------------------------------------------------------------------
    async def cancel(self, aid: str, *, owner: str) -> ActionOut:
        """Cancel a queued or running action and answer its state once it ended (a
        queued one at once; a running one when its backend stopped it, which gives its
        cores back). An action that already ended is answered as it ended."""
        self._my_action(aid, owner)
        t = self.tracked.get(aid)
        if t is None:
            view = self.journal.get(aid)
            if view is None:
                raise Refused(404, f"unknown action {aid!r}")
            return view
        if t.result is None:
            await self._cancel(aid, t)
        view = self.view(aid)
        assert view is not None
        return view

    def _my_action(self, aid: str, owner: str) -> None:
        """404, as for an unknown id, unless action ``aid`` is ``owner``'s."""
        t = self.tracked.get(aid)
        mine = t.owner if t is not None else self.journal.action_owner(aid)
        if mine != owner:
            raise Refused(404, f"unknown action {aid!r}")

    async def _cancel(self, aid: str, t: Tracked) -> None:
        """Cancel ``aid`` and wait (up to CANCEL_WAIT_S) for its end. The stop is asked
        again every CANCEL_REPEAT_S: an action the core dispatched may not have reached its
        backend yet (the process backend itself remembers a cancel that arrives while it
        starts the process; the others are asked again until the action ends)."""
        t.cancelled = True
        deadline = time.monotonic() + CANCEL_WAIT_S
        while t.result is None and time.monotonic() < deadline:
            self.executor.cancel(aid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(t.done.wait(), CANCEL_REPEAT_S)

    # -- actions -------------------------------------------------------------------------
    async def submit(self, tid: str, body: ActionIn, owner: str) -> tuple[ActionOut, bool]:
        """Queue an action; (its state, True) or, for a repeat, (its state, False).
        ``owner``: the name of the request's token (``tid`` must be its)."""
        self._not_closing()
        ready = await self._prepare(tid, body, owner)
        if isinstance(ready, ActionOut):
            return ready, False
        self._accept([ready])
        return self.view(body.id), True  # type: ignore[return-value]

    async def submit_batch(self, items: list[tuple[str, ActionIn]], *, owner: str
                           ) -> list[tuple[ActionOut, bool]]:
        """Queue many actions, all or nothing: every one is checked before any is accepted
        (a refusal names the item: ``actions[3].cpu: ...``); repeats answer their state.
        The new ones go to the core in one submission, which is their core check."""
        self._not_closing()
        seen: set[str] = set()
        for i, (_, body) in enumerate(items):
            if body.id in seen:
                raise Refused(422, f"actions[{i}].action.id: {body.id!r} is given twice in "
                              "this batch")
            seen.add(body.id)
        ready: list[Prepared | ActionOut] = []
        for i, (tid, body) in enumerate(items):
            try:
                ready.append(await self._prepare(tid, body, owner))
            except Refused as e:
                raise Refused(e.status, _item(i, e.detail)) from None
        # the checks above awaited: a trajectory may have closed meanwhile
        for i, r in enumerate(ready):
            if isinstance(r, Prepared) and not self._accepting(r.trajectory):
                raise Refused(404, f"actions[{i}].trajectory: {r.trajectory!r} closed")
        fresh = [r for r in ready if isinstance(r, Prepared)]
        try:
            self._accept(fresh)
        except Refused as e:  # the core refused the first refused one: name its item
            at = self._refused_at(fresh)
            if at is None:  # refused for the batch as a whole: its own message
                raise
            raise Refused(e.status, _item(ready.index(fresh[at]), e.detail)) from None
        return [(r, False) if isinstance(r, ActionOut)
                else (self.view(r.body.id), True)  # type: ignore[misc]
                for r in ready]

    def _accepting(self, tid: str) -> bool:
        opened = self.opened.get(tid)
        return self.executor.has_trajectory(tid) and not (opened and opened.closing)

    async def _prepare(self, tid: str, body: ActionIn, owner: str) -> Prepared | ActionOut:
        """``body`` checked in full (a Refused names the field), or its stored state
        when it was submitted before with this same body."""
        self._mine(tid, owner)  # first: nothing of another's trajectory is told
        try:
            body.check_shape()
        except ValueError as e:
            raise Refused(422, str(e)) from None
        argv = body.argv
        if body.command is not None and body.shell:
            argv = ["sh", "-c", body.command]  # one argument: never split, never interpolated
        elif body.command is not None:
            # shlex is slow on long inputs: never on the event loop
            try:
                argv = await asyncio.to_thread(argv_of, {"command": body.command})
            except CommandError as e:
                raise Refused(422, str(e)) from None
            if not argv:
                raise Refused(422, "command: nothing to run after splitting")
        raw = body.model_dump_json()
        repeat = self._repeat(tid, body.id, raw)
        if repeat is not None:
            return repeat
        state = self.executor.trajectory(tid)
        if state is None:
            raise Refused(404, f"unknown trajectory {tid!r}")
        opened = self.opened.get(tid)
        if opened is not None and opened.closing:
            raise Refused(409, f"trajectory: {tid!r} is closing")
        public_only = self._check_destination(body) if body.request is not None else False
        action = body.to_action(tid, state.task, argv, self.max_cores)
        if public_only:
            action.payload["public_only"] = True  # type: ignore[index]
        return Prepared(tid, body, raw, action, owner)  # (the core checks it: _accept)

    def _accept(self, ready: list[Prepared]) -> None:
        """Submit ``ready`` to the core, all or nothing: the core's check is the one the
        action gets (a refusal raises Refused: 404 for an unknown trajectory, else 422,
        nothing queued). They are recorded once queued, before any can end."""
        if not ready:
            return

        def queued() -> None:
            for p in ready:
                self._record(p)

        try:
            self.executor.submit_many([p.action for p in ready], self._finish, queued)
        except KeyError as e:
            raise Refused(404, str(e.args[0])) from None
        except ValueError as e:
            raise Refused(422, str(e)) from None

    def _refused_at(self, ready: list[Prepared]) -> int | None:
        """The index in ``ready`` of the action the core refused a batch for: the first
        the core refuses alone (a batch is refused for its first refused action); None
        when it refuses none alone. Only a refused batch is checked again, to name its
        item."""
        for i, p in enumerate(ready):
            try:
                self.executor.validate(p.action)
            except (KeyError, ValueError):
                return i
        return None

    def _record(self, p: Prepared) -> None:
        aid = p.body.id
        self.tracked[aid] = Tracked(p.trajectory, p.raw, owner=p.owner)
        opened = self.opened.get(p.trajectory)
        if opened is not None:
            opened.actions += 1
            opened.last_active = time.monotonic()
        self.journal.submitted(aid, p.trajectory, p.raw, p.owner)

    def _repeat(self, tid: str, aid: str, raw: str) -> ActionOut | None:
        """The stored state when ``aid`` was submitted before with this same body."""
        t = self.tracked.get(aid)
        prior = (t.trajectory, t.body) if t is not None else self.journal.body(aid)
        if prior is None:
            return None
        if prior[0] != tid:
            raise Refused(409, f"id: action {aid!r} belongs to another trajectory")
        if prior[1] != raw:
            raise Refused(409, f"id: action {aid!r} was submitted before with a different body")
        view = self.view(aid)
        if t is None and view is not None and view.error in (RESTARTED, SHUTDOWN):
            return None  # never ran: running it now is what the client asks for
        return view

    def _check_destination(self, body: ActionIn) -> bool:
        """Refuse a URL no quota key of the action allows; True if only '*' allows it
        (the backend then refuses non-public addresses when it resolves the name).
        URLs are compared parsed and normalised (executor/backends/http/urls.py), never as strings."""
        assert body.request is not None
        url = body.request.url
        keys = [quota_resource(k) for k in body.quota]
        prefixes = [p for k in keys for p in self.allow_urls.get(k, ())]
        try:
            check_headers(body.request.headers)
            target = parse_target(url)
        except UrlRefused as e:
            raise Refused(403, str(e)) from None
        if listed(target, prefixes):
            return False
        host = target.host
        if "*" in prefixes:
            try:
                literal = not ipaddress.ip_address(host.strip("[]")).is_global
            except ValueError:
                literal = host in ("localhost",) or host.endswith(".localhost")
            if literal:
                raise Refused(403, f"request.url: {host!r} is a loopback or private address "
                              "(list it explicitly with --allow-url to reach it)")
            return True
        raise Refused(403, f"request.url: {url[:200]!r} is not allowed for quota "
                      f"{', '.join(sorted(body.quota)) or '(none)'} (the server's --allow-url "
                      "lists the destinations of each quota key)")

    def _finish(self, rec: Record, out: Outcome) -> None:
        aid = rec.action_id
        res = result_of(rec, out)
        t = self.tracked.get(aid)
        if t is not None and t.cancelled:
            # stopped or dropped at a client's request (a queued action's record names no
            # trajectory: it never started)
            res = res.model_copy(update={"trajectory": t.trajectory, "status": "cancelled",
                                         "error": CANCELLED})
        if t is not None and t.copies:
            self._fork_ended(aid, t, rec, out, res)
            return
        self._ended(aid, t, rec, res)

    def _fork_ended(self, aid: str, t: Tracked, rec: Record, out: Outcome,
                    res: ActionOut) -> None:
        """A fork action's end: what it made, or (unless ``ok``) its copies closed first -
        on the loop's next turn, outside the core's callback - and only then the end told
        (a cancel's answer, the fork's own)."""
        self.forking.done(t.trajectory)
        found = self.forks.get(t.trajectory)
        if found is not None:
            found.discard(aid)
            if not found:
                del self.forks[t.trajectory]
        if res.status == "ok":
            extra = dict(out.extra or {})
            t.forked = Forked(t.trajectory, t.copies, aid, str(extra.get("method", "")),
                              int(extra.get("bytes", 0)), rec.start_s - rec.submit_s,
                              rec.end_s - rec.start_s)
            self._ended(aid, t, rec, res)
            return

        def drop() -> None:
            self._drop_copies(t)
            self._ended(aid, t, rec, res)

        self.executor.loop.call_soon(drop)

    def _ended(self, aid: str, t: Tracked | None, rec: Record, res: ActionOut) -> None:
        opened = self.opened.get(res.trajectory)
        if opened is not None:
            opened.last_active = time.monotonic()
            opened.state_lost += res.state_lost
        if t is not None:
            t.result = res
            t.done.set()
            # the journal keeps it; memory only while a waiter may still ask
            self.executor.loop.call_later(self.result_ttl_s, self._forget, aid, t)
        self.journal.finished(res)
        self.counts[res.status] = self.counts.get(res.status, 0) + 1
        self.act_sum += rec.end_s - rec.submit_s

    def _forget(self, aid: str, t: Tracked) -> None:
        if self.tracked.get(aid) is t:
            del self.tracked[aid]

    def view(self, aid: str) -> ActionOut | None:
        t = self.tracked.get(aid)
        if t is None:
            return self.journal.get(aid)
        if t.result is not None:
            return t.result
        if self.executor.is_running(aid):
            return ActionOut(id=aid, trajectory=t.trajectory, status="running")
        # why it waits, when it is for a node (memory) rather than cores: a client can
        # tell a full machine from a busy one
        return ActionOut(id=aid, trajectory=t.trajectory, status="queued",
                         error=self.executor.why_queued(aid))

    async def wait(self, aid: str, wait_s: float, owner: str) -> ActionOut:
        """The action's state, after waiting up to ``wait_s`` for its end (or shutdown);
        ``owner``: the name of the request's token (the action must be its)."""
        self._my_action(aid, owner)
        t = self.tracked.get(aid)
        if t is not None and wait_s > 0 and t.result is None and not self.closing.is_set():
            ended = asyncio.ensure_future(t.done.wait())
            closing = asyncio.ensure_future(self.closing.wait())
            try:
                await asyncio.wait((ended, closing), timeout=min(wait_s, MAX_TIMEOUT_S),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                ended.cancel()
                closing.cancel()
        view = self.view(aid)
        if view is None:
            raise Refused(404, f"unknown action {aid!r}")
        if self.closing.is_set() and view.status in ("queued", "running"):
            # stopping: it will not finish here (shutdown() journals it so); a waiter told
            # "running" would wait for a result that never comes
            view = view.model_copy(update={"status": "failed", "error": SHUTDOWN})
        return view

    async def events(self, aid: str, *, owner: str) -> AsyncIterator[bytes]:
        """Server-sent events: the current state, then the result when it ends."""
        self._my_action(aid, owner)
        if self.view(aid) is None:
            raise Refused(404, f"unknown action {aid!r}")

        async def stream() -> AsyncIterator[bytes]:
            last = None
            while True:
                view = await self.wait(aid, 0.5 if last is not None else 0, owner)
                if view.status != last:
                    last = view.status
                    yield f"event: status\ndata: {view.model_dump_json()}\n\n".encode()
                if view.status not in ("queued", "running") or self.closing.is_set():
                    return

        return stream()

    # -- lifecycle and observability ---------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Wake every long-poll and refuse new work (SIGTERM)."""
        self.closing.set()

    def shutdown(self) -> None:
        """Record every unfinished action as failed, then stop the backend."""
        self.closing.set()
        if self.memwatch is not None:
            self.memwatch.stop()
        for aid, t in list(self.tracked.items()):
            if t.result is None:
                t.result = ActionOut(id=aid, trajectory=t.trajectory, status="failed",
                                     error=SHUTDOWN)
                t.done.set()
        self.journal.fail_unfinished(SHUTDOWN)
        self.executor.shutdown()

    def _not_closing(self) -> None:
        if self.closing.is_set():
            raise Refused(503, "the server is shutting down")

    def health(self) -> dict[str, object]:
        return {"status": "closing" if self.closing.is_set() else "ok",
                "uptime_s": time.time() - self.started, "recovered_as_failed": self.recovered,
                "trajectories_restored": self.restored}

    def metrics(self) -> str:
        snap = self.executor.snapshot(detail=False)
        use, cap = snap.usage, snap.capacity
        lines = ["# HELP tangram_actions_total Finished actions by status.",
                 "# TYPE tangram_actions_total counter"]
        for st, n in sorted(self.counts.items()):
            lines.append(f'tangram_actions_total{{status="{st}"}} {n}')
        done = sum(self.counts.values())
        lines += ["# HELP tangram_act_seconds Action completion time (queue + execution).",
                  "# TYPE tangram_act_seconds summary",
                  f"tangram_act_seconds_sum {self.act_sum:.6f}",
                  f"tangram_act_seconds_count {done}",
                  "# HELP tangram_queued_actions Actions waiting for resources.",
                  "# TYPE tangram_queued_actions gauge",
                  f"tangram_queued_actions {snap.queued}",
                  "# HELP tangram_actions_waiting_for_node First actions waiting for a node to "
                  "admit their sandbox (memory; also counted in tangram_queued_actions).",
                  "# TYPE tangram_actions_waiting_for_node gauge",
                  f"tangram_actions_waiting_for_node {snap.waiting_for_node}",
                  "# HELP tangram_running_actions Actions executing.",
                  "# TYPE tangram_running_actions gauge",
                  f"tangram_running_actions {snap.running_count}",
                  "# HELP tangram_open_trajectories Open trajectories.",
                  "# TYPE tangram_open_trajectories gauge",
                  f"tangram_open_trajectories {snap.open_trajectories}",
                  "# HELP tangram_tracked_results Results held in memory (the rest: journal).",
                  "# TYPE tangram_tracked_results gauge",
                  f"tangram_tracked_results {len(self.tracked)}",
                  "# HELP tangram_resource_in_use Units of each resource in use.",
                  "# TYPE tangram_resource_in_use gauge"]
        for res, v in sorted(use.items()):
            lines.append(f'tangram_resource_in_use{{resource="{res}"}} {v}')
        lines += ["# HELP tangram_resource_capacity Units of each resource.",
                  "# TYPE tangram_resource_capacity gauge"]
        for res, v in sorted(cap.items()):
            lines.append(f'tangram_resource_capacity{{resource="{res}"}} {v}')
        lines += effect_lines(self.executor.runtime.carried, snap.counters)
        lines += metric_lines(self.executor.backend)
        images = image_status_of(self.executor.backend)
        if images is not None:
            lines += image_metric_lines(images)
        return "\n".join(lines) + "\n"


def effect_lines(carried: Mapping[type, int], counters: Mapping[str, float]) -> list[str]:
    """Prometheus lines: the core's effects carried out, by kind (every kind, 0 included:
    which of them a live server has seen, e.g. a lane move or a shed), and the core's own
    counters (tangram/machine.py ``snapshot``: scheduling passes, lane moves, reclaims, GPU
    restores), one metric each so that a counter the core adds shows up here too."""
    lines = ["# HELP tangram_effects_total Effects of the core carried out on the backend, "
             "by kind (tangram/protocol.py).",
             "# TYPE tangram_effects_total counter"]
    lines += [f'tangram_effects_total{{effect="{kind.__name__}"}} {carried.get(kind, 0)}'
              for kind in get_args(Effect)]
    for name, value in sorted(counters.items()):
        lines += [f"# HELP tangram_core_{name} The core's counter {name}.",
                  f"# TYPE tangram_core_{name} counter", f"tangram_core_{name} {value:.6g}"]
    return lines
