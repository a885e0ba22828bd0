"""The one object the HTTP handlers call: trajectories, actions, results, metrics.

It owns the live executor and the journal; handlers never read the core's
state themselves. Every refusal is a :class:`Refused` with the HTTP status and
a message naming the field, so the routes stay thin.

Results stay in memory only while someone may still be waiting for them
(``result_ttl_s`` after the action ended); after that they are read back from
the journal, so the server's memory does not grow with the number of actions.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from executor.backends.http.urls import UrlRefused, check_headers, listed, parse_allow_list, parse_target
from executor.commands import CommandError, argv_of
from executor.driver import LiveExecutor
from executor.fork import Forking, ForkRefused, copy_ids, fork
from executor.memwatch import MemoryWatch
from executor.server.journal import RESTARTED, SHUTDOWN, Journal
from executor.server.routes.gpus import metric_lines
from executor.server.schemas import ID_MAX, MAX_TIMEOUT_S, ActionIn, ActionOut, TrajectoryIn
from tangram.model import Outcome, quota_resource
from tangram.runtime import Record


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


def result_of(rec: Record, out: Outcome) -> ActionOut:
    extra = dict(out.extra or {})
    return ActionOut(
        id=rec.action_id, trajectory=rec.trajectory, status=out.status, exit_code=out.exit_code,
        output=out.output, error=out.error, units=rec.units, lane=rec.lane,
        cores=[int(c) for c in extra.get("cores", [])], gpus=[int(g) for g in extra.get("gpus", [])],
        queue_s=rec.start_s - rec.submit_s, exec_s=rec.end_s - rec.start_s,
        state_lost=bool(extra.get("state_lost")), retries=int(extra.get("retries", 0)),
        argv=list(extra.get("argv", [])), node=rec.node)


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
        self.counts: dict[str, int] = {}
        self.act_sum = 0.0
        self.started = time.time()
        self.recovered = journal.recover()
        self.closing = asyncio.Event()
        self.max_cores = int(executor.snapshot(detail=False).capacity.get("cpu", 1))
        #: forks in flight per source (tangram/fork.py: they do not keep others from forking)
        self.forking = Forking()

    # -- trajectories ------------------------------------------------------------------
    def open_trajectory(self, body: TrajectoryIn) -> dict[str, str]:
        self._not_closing()
        tid = body.id or secrets.token_hex(8)
        if self.executor.has_trajectory(tid):
            raise Refused(409, f"id: trajectory {tid!r} is already open")
        try:
            self.executor.open_trajectory(tid, body.task, body.mem_gb,
                                          body.image or self.task_images.get(body.task))
        except ValueError as e:
            raise Refused(422, str(e)) from None
        except OSError as e:  # e.g. the work directory cannot be made
            raise Refused(503, f"cannot open trajectory {tid!r}: {e}") from None
        return {"id": tid, "task": body.task}

    async def fork_trajectories(self, body: TrajectoryIn) -> dict[str, Any]:
        """``body.count`` copies of ``body.fork_of`` (executor/fork.py)."""
        self._not_closing()
        assert body.fork_of is not None
        if body.mem_gb is not None or body.image is not None:
            raise Refused(422, "fork_of: a copy takes its source's mem_gb and image; "
                          "leave mem_gb and image out")
        ids = copy_ids(body.fork_of, body.count, body.id)
        if max(map(len, ids)) > ID_MAX:
            raise Refused(422, f"id: the copies' ids ({ids[-1]!r}) would pass {ID_MAX} "
                          "characters; use a shorter id")
        try:
            done = await fork(self.executor, body.fork_of, ids, self.closing, self.forking)
        except ForkRefused as e:
            raise Refused(e.status, e.detail) from None
        return {"ids": list(done.ids), "fork_of": done.source, "action": done.action,
                "method": done.method, "bytes": done.bytes, "queue_s": done.queue_s,
                "fork_s": done.fork_s}

    def close_trajectory(self, tid: str) -> dict[str, str]:
        if not self.executor.has_trajectory(tid):
            raise Refused(404, f"unknown trajectory {tid!r}")
        try:
            self.executor.close_trajectory(tid)
        except ValueError as e:
            raise Refused(409, str(e)) from None
        return {"id": tid, "status": "closed"}

    # -- actions -------------------------------------------------------------------------
    async def submit(self, tid: str, body: ActionIn) -> tuple[ActionOut, bool]:
        """Queue an action; (its state, True) or, for a repeat, (its state, False)."""
        self._not_closing()
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
            return repeat, False
        state = self.executor.trajectory(tid)
        if state is None:
            raise Refused(404, f"unknown trajectory {tid!r}")
        public_only = self._check_destination(body) if body.request is not None else False
        action = body.to_action(tid, state.task, argv, self.max_cores)
        if public_only:
            action.payload["public_only"] = True  # type: ignore[index]
        try:
            self.executor.validate(action)
        except KeyError as e:
            raise Refused(404, str(e.args[0])) from None
        except ValueError as e:
            raise Refused(422, str(e)) from None
        self.tracked[body.id] = Tracked(tid, raw)
        self.journal.submitted(body.id, tid, raw)
        self.executor.submit(action, lambda rec, out, aid=body.id: self._finish(aid, rec, out))
        return self.view(body.id), True  # type: ignore[return-value]

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

    def _finish(self, aid: str, rec: Record, out: Outcome) -> None:
        res = result_of(rec, out)
        t = self.tracked.get(aid)
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

    async def wait(self, aid: str, wait_s: float) -> ActionOut:
        """The action's state, after waiting up to ``wait_s`` for its end (or shutdown)."""
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

    async def events(self, aid: str) -> AsyncIterator[bytes]:
        """Server-sent events: the current state, then the result when it ends."""
        if self.view(aid) is None:
            raise Refused(404, f"unknown action {aid!r}")

        async def stream() -> AsyncIterator[bytes]:
            last = None
            while True:
                view = await self.wait(aid, 0.5 if last is not None else 0)
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
                "uptime_s": time.time() - self.started, "recovered_as_failed": self.recovered}

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
        lines += metric_lines(self.executor.backend)
        return "\n".join(lines) + "\n"
