"""GRPO group templates for the sync environments (SkyRL-gym): prepared once per group,
forked for each sample, closed by the adapter itself (the framework never says when a
group is done)."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import httpx

from tangram_sdk.client import TangramError, TangramSyncClient
from tangram_sdk.integrations.common import (
    CLOSE_LISTENERS,
    GroupSetup,
    SandboxConfig,
    SetupFailed,
    call_retrying,
    describe,
    fork_copy,
    passed,
    render,
)

log = logging.getLogger("tangram.integrations.groups")  # its name before the SDK left tangram/


class SyncGroups:
    """The prepared template sandboxes of GRPO groups for the sync envs of this process
    (SkyRL's generator runs every env of a batch in one process, on a thread pool).

    The first env of a group opens the template and runs ``group_setup``; the others wait
    for it and fork it. The registry closes a template once ``group_size`` copies were
    forked, or when no copy was forked and none is open for ``group_setup.idle_ttl_s``
    (a sweeper thread), and at exit. Each template gets a fresh trajectory id and setup
    action id: a group prepared again after its template closed runs its setup again
    (the server answers a repeated action id with the old result, without running it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, ...], _SyncGroup] = {}
        self._copies: dict[str, _SyncGroup] = {}  # open copy -> its group's template
        self._sweeper: threading.Thread | None = None
        self._atexit = False

    def fork(self, client: TangramSyncClient, settings: SandboxConfig, group: str) -> str:
        """A new sandbox that starts as a copy of group ``group``'s prepared template
        (prepared first if needed); raises TangramError (or httpx's) when the setup or the
        fork failed."""
        setup = settings.group_setup
        assert setup is not None
        key = (settings.base_url, settings.task, settings.image or "", group, setup.command)
        while True:
            with self._lock:
                entry = self._groups.get(key)
                if entry is None:
                    entry = self._groups[key] = _SyncGroup(key, setup, settings.base_url,
                                                           settings.token)
            with entry.preparing:  # one env prepares; the group's others wait here
                if entry.template is None and not entry.closed:
                    try:
                        entry.template = _prepare_sync(client, settings, group)
                    except BaseException:
                        with self._lock:
                            entry.closed = True
                            if self._groups.get(key) is entry:
                                del self._groups[key]  # the next env of the group tries again
                        raise
            with self._lock:
                if entry.closed or entry.template is None:
                    continue  # closed meanwhile (its last copy made, or idle): prepare anew
                entry.forks += 1
                entry.forking += 1
                template = entry.template
            copy: str | None = None
            try:
                copy = fork_copy(client, template, f"group {group!r}")
            finally:
                with self._lock:
                    entry.forking -= 1
                    if copy is None:
                        entry.forks -= 1
                    else:
                        entry.copies.add(copy)
                        self._copies[copy] = entry
                    entry.last_used = time.monotonic()
                    done = self._retire_if_done(entry)
                self._ensure_sweeper()
            if done:
                _close_quietly(client, template)
            return copy

    def copy_closed(self, copy: str) -> None:
        """A copy closed: its template's idle time starts when none is left open."""
        with self._lock:
            entry = self._copies.pop(copy, None)
            if entry is None:
                return
            entry.copies.discard(copy)
            entry.last_used = time.monotonic()

    def _retire_if_done(self, entry: _SyncGroup) -> bool:
        """(Under the lock.) Whether ``entry`` just retired: ``group_size`` copies made."""
        size = entry.setup.group_size
        if entry.closed or size is None or entry.forks < size or entry.forking:
            return False
        entry.closed = True
        if self._groups.get(entry.key) is entry:
            del self._groups[entry.key]
        return True

    def _ensure_sweeper(self) -> None:
        with self._lock:
            if not self._atexit:
                atexit.register(self.close_all)
                self._atexit = True
            if self._sweeper is not None and self._sweeper.is_alive():
                return
            self._sweeper = threading.Thread(target=self._sweep_loop, daemon=True,
                                             name="tangram-group-sweeper")
            self._sweeper.start()

    def _sweep_loop(self) -> None:
        while True:
            with self._lock:
                if not self._groups:
                    self._sweeper = None
                    return
                ttl = min(e.setup.idle_ttl_s for e in self._groups.values())
            time.sleep(min(max(ttl / 4, 0.05), 30.0))
            self.sweep()

    def sweep(self) -> None:
        """Close the templates idle past their TTL (no fork in flight, no copy open)."""
        now = time.monotonic()
        stale: list[_SyncGroup] = []
        with self._lock:
            for key, entry in list(self._groups.items()):
                if (entry.template is not None and not entry.forking and not entry.copies
                        and now - entry.last_used > entry.setup.idle_ttl_s):
                    entry.closed = True
                    del self._groups[key]
                    stale.append(entry)
        for entry in stale:
            log.info("closing group template %s: no copy forked or open for %g s",
                     entry.template, entry.setup.idle_ttl_s)
            with TangramSyncClient(entry.base_url, entry.token) as client:
                _close_quietly(client, str(entry.template))

    def close_all(self) -> None:
        """Close every template this process holds (at exit; or when training ends)."""
        with self._lock:
            entries = [e for e in self._groups.values() if e.template and not e.closed]
            for e in entries:
                e.closed = True
            self._groups.clear()
        for entry in entries:
            with TangramSyncClient(entry.base_url, entry.token) as client:
                _close_quietly(client, str(entry.template))


@dataclass(eq=False)
class _SyncGroup:
    key: tuple[str, ...]
    setup: GroupSetup
    #: where and with which token the template was opened (the sweeper closes it from its
    #: own thread, on its own connection)
    base_url: str
    token: str = field(repr=False)
    template: str | None = None
    forks: int = 0
    forking: int = 0
    closed: bool = False
    copies: set[str] = field(default_factory=set)
    last_used: float = field(default_factory=time.monotonic)
    preparing: threading.Lock = field(default_factory=threading.Lock)


def _prepare_sync(client: TangramSyncClient, settings: SandboxConfig, group: str) -> str:
    """Open a template sandbox for ``group`` and run its setup (closed again on failure)."""
    assert settings.group_setup is not None
    tid = f"group-{uuid.uuid4().hex[:20]}"
    call_retrying(lambda: _open_once(client, tid, settings), f"opening group {group!r}'s sandbox")
    aid = uuid.uuid4().hex
    try:
        result = call_retrying(lambda: client.run(tid, action_id=aid,
                                                  **settings.group_setup.action()),  # type: ignore[union-attr]
                               f"group {group!r}: its setup in sandbox {tid}")
    except BaseException:
        _close_quietly(client, tid)
        raise
    if not passed(result):
        _close_quietly(client, tid)
        raise SetupFailed(f"group_setup of group {group!r} failed: {render(result, 2000)}")
    return tid


def _open_once(client: TangramSyncClient, tid: str, settings: SandboxConfig) -> None:
    try:
        client.open_trajectory(tid, **settings.open_args())
    except TangramError as e:
        if e.status != 409:  # 409: an earlier try of this same open got through
            raise


def _close_quietly(client: TangramSyncClient, tid: str) -> None:
    try:
        client.close_trajectory(tid)
    except TangramError as e:
        if e.status != 404:  # 404: already closed
            log.warning("closing group template %s: %s", tid, describe(e))
    except httpx.HTTPError as e:
        log.warning("closing group template %s: %s", tid, describe(e))


#: the sync envs' group templates (one registry per process)
SYNC_GROUPS = SyncGroups()
CLOSE_LISTENERS.append(SYNC_GROUPS.copy_closed)
