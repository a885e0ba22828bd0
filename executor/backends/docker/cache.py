"""A node's images: pulled from the registry in their reference, kept under a disk budget.

Pulls. An image a trajectory names that is not on the node is pulled from the registry its
reference names (``host:port/name:tag``, or pinned: ``host:port/name@sha256:...``), at most
``pulls`` at once (``--image-pulls``; more wait for a slot: each pull already streams its
layers in parallel, and many at once only share the registry's and the disk's bandwidth).
Every want of an image being pulled joins that pull. A failed pull leaves nothing behind:
the engine registers an image only once all its layers are in.

The cache (``--image-cache-gb``). Images this cache pulled are kept while their sizes (the
engine's ``Size`` of each image, a layer shared by two images counted in both: the budget
errs on the safe side) fit the budget; past it the least recently used are removed, but
never one that is held: named by an open or opening trajectory (which includes those
queued for admission), run by a container of this backend (a trajectory's, a warm one's,
one adopted after a restart), being pulled, or the backend's default image. An image the
cache did not pull (built or loaded on the node, or there before the server started) is
never removed, and neither is one in use by a container the backend does not know of (the
engine refuses to remove it). Held images may keep the cache over its budget; the status
says so (``over_budget``).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests
from docker.utils import parse_repository_tag

from executor.backends.docker.pulls import PullDone, PullFailed, registry_of

log = logging.getLogger("tangram.docker.images")
#: pulls at once per node when not told (--image-pulls)
PULLS = 2
#: the longest lists the status carries
MAX_LISTED = 50


@dataclass(slots=True)
class _Pull:
    """A pull queued or running, and the opens waiting for it."""

    image: str
    queued_at: float
    future: Future = field(default_factory=Future)
    started_at: float | None = None
    #: layer id -> [bytes downloaded, bytes in all] (the engine's progress events)
    layers: dict[str, list[int]] = field(default_factory=dict)
    waiters: int = 0

    def downloaded(self) -> tuple[int, int]:
        return (sum(c for c, _ in self.layers.values()),
                sum(t for _, t in self.layers.values()))


@dataclass(slots=True)
class _Entry:
    """An image this cache pulled."""

    image_id: str
    size: int
    last_used: float


@dataclass(slots=True)
class Counters:
    hits: int = 0
    misses: int = 0
    pulls: int = 0
    pull_failures: int = 0
    #: wants that joined a pull already queued or running
    shared: int = 0
    pulled_bytes: int = 0
    pull_seconds: float = 0.0
    evictions: int = 0
    evicted_bytes: int = 0


class ImageCache:
    """Pulls and the disk budget of one node's images (see the module's docstring).
    ``held``: the images the backend holds now (its trajectories', its containers');
    ``release``: drop what holds images only to have them at hand (how many were dropped);
    ``keep``: images never removed (the default image); ``state_file``: where the images
    this cache pulled are recorded, so a restart still knows them as its own;
    ``leaving``: whether a container of the backend's own, on its way out, runs an image
    (by id): asked of each image before it is removed."""

    def __init__(self, client: docker.DockerClient, pulls: int = PULLS,
                 budget_gb: float | None = None,
                 held: Callable[[], Collection[str]] = frozenset,
                 keep: Collection[str] = (), state_file: Path | None = None,
                 release: Callable[[], int] = lambda: 0,
                 leaving: Callable[[str], bool] = lambda image_id: False) -> None:
        if pulls < 1:
            raise ValueError(f"image_pulls: at least 1 pull at once, got {pulls}")
        if budget_gb is not None and budget_gb <= 0:
            raise ValueError(f"image_cache_gb: a positive budget, got {budget_gb}")
        self.client = client
        self.pulls = pulls
        self.budget = None if budget_gb is None else int(budget_gb * 1e9)
        self._held = held
        self._release = release
        self._leaving = leaving
        self.keep = frozenset(keep)
        self.state_file = state_file
        self._lock = threading.Lock()
        # daemon threads, not a ThreadPoolExecutor: the interpreter's exit joins an
        # executor's threads, and a stopping server must not wait for a long pull to end
        self._queue: queue.SimpleQueue[_Pull | None] = queue.SimpleQueue()
        self._pulls: dict[str, _Pull] = {}
        self._entries: dict[str, _Entry] = {}
        #: images seen on the node (reference -> image id): no engine call on their next want
        self._known: dict[str, str] = {}
        self.counters = Counters()
        #: whether held images kept the cache over its budget at its last make_room (read
        #: without the lock: the warm pool makes no sandbox of a pulled image meanwhile)
        self.over_budget = False
        self._closed = False
        self._load()
        self._workers = [threading.Thread(target=self._work, daemon=True,
                                          name=f"tangram-pull-{i}") for i in range(pulls)]
        for worker in self._workers:
            worker.start()

    # -- wants ---------------------------------------------------------------------------
    def want(self, image: str) -> Future[PullDone]:
        """``image`` on the node: a done future for a hit, else its pull's (shared by every
        want of it while it runs). Counts a hit or a miss."""
        with self._lock:
            pull = self._pulls.get(image)
            if pull is not None:
                self.counters.misses += 1
                self.counters.shared += 1
                pull.waiters += 1
                return self._waiter(pull, shared=True)
            if image in self._known or image in self._entries:
                return self._hit(image)
        present = self._present(image)  # an engine call: outside the lock
        with self._lock:
            if present:
                return self._hit(image)
            pull = self._pulls.get(image)
            if pull is not None:  # started meanwhile
                self.counters.misses += 1
                self.counters.shared += 1
                pull.waiters += 1
                return self._waiter(pull, shared=True)
            self.counters.misses += 1
            return self._waiter(self._start(image, waiters=1), shared=False)

    def pull(self, image: str) -> Future[PullDone] | None:
        """Start pulling ``image`` in the background unless it is here or being pulled (a
        pull ahead of the trajectories that will want it; bounded by the same slots). The
        future of its pull (the one started, or under way), None when it is here."""
        with self._lock:
            pull = self._pulls.get(image)
            if pull is not None:
                return pull.future
            if image in self._known or image in self._entries:
                return None
        if self._present(image):
            return None
        with self._lock:
            pull = self._pulls.get(image)
            if pull is None and not self._closed:
                pull = self._start(image, waiters=0)
            return pull.future if pull is not None else None

    def has(self, image: str) -> bool:
        """Whether ``image`` is known to be on the node (no engine call, and no lock: the
        backend asks under its own, which a removal must not hold up)."""
        return image in self._known or image in self._entries

    def ensure(self, image: str) -> None:
        """``image`` on the node, pulled now (blocking) if it is not; PullFailed if that
        fails. No hit is counted for an image already known here (its open's want was)."""
        with self._lock:
            known = image in self._known or image in self._entries
        if not known:
            self.want(image).result()

    def touch(self, image: str) -> None:
        """``image`` was used now (its least-recent-use order)."""
        with self._lock:
            entry = self._entries.get(image)
            if entry is not None:
                entry.last_used = time.monotonic()

    def forget(self, image: str) -> None:
        """``image`` is not on the node after all (removed behind the cache's back): its
        next want pulls it."""
        with self._lock:
            self._known.pop(image, None)
            self._entries.pop(image, None)

    def close(self) -> None:
        """Stop: queued pulls fail, a running one ends with the engine's pull."""
        with self._lock:
            self._closed = True
            queued = [p for p in self._pulls.values() if p.started_at is None]
        for p in queued:
            if not p.future.done():
                p.future.set_exception(PullFailed(p.image, "the server is stopping"))
        for _ in self._workers:
            self._queue.put(None)

    # -- pulls ---------------------------------------------------------------------------
    def _hit(self, image: str) -> Future[PullDone]:
        """Under the lock."""
        self.counters.hits += 1
        entry = self._entries.get(image)
        if entry is not None:
            entry.last_used = time.monotonic()
        done: Future[PullDone] = Future()
        done.set_result(PullDone(image, pulled=False))
        return done

    @staticmethod
    def _waiter(pull: _Pull, shared: bool) -> Future[PullDone]:
        """A future of ``pull``'s end of one want's own: cancelling it (an open whose
        client went away) leaves the pull and its other waiters alone."""
        mine: Future[PullDone] = Future()

        def chain(f: Future) -> None:
            if not mine.set_running_or_notify_cancel():
                return  # cancelled by its waiter
            if f.exception() is not None:
                mine.set_exception(f.exception())
            else:
                mine.set_result(replace(f.result(), shared=shared))

        pull.future.add_done_callback(chain)
        return mine

    def _start(self, image: str, waiters: int) -> _Pull:
        """Under the lock."""
        pull = _Pull(image, time.monotonic(), waiters=waiters)
        self._pulls[image] = pull
        if self._closed:
            self._pulls.pop(image)
            pull.future.set_exception(PullFailed(image, "the server is stopping"))
            return pull
        self._queue.put(pull)
        return pull

    def _work(self) -> None:
        """One pull slot: the queued pulls, one at a time, in the order they came."""
        while (pull := self._queue.get()) is not None:
            if self._closed:
                continue  # (close failed it)
            self._run(pull)

    def _present(self, image: str) -> bool:
        try:
            info = self.client.api.inspect_image(image)
        except docker.errors.ImageNotFound:
            return False
        except docker.errors.APIError as e:  # e.g. a malformed reference
            raise ValueError(f"image: {image!r}: {e.explanation or e}") from None
        with self._lock:
            self._known[image] = info["Id"]
        return True

    def _run(self, pull: _Pull) -> None:
        pull.started_at = time.monotonic()
        try:
            done = self._pull(pull)
        except BaseException as e:  # noqa: BLE001 - every waiter hears of it
            with self._lock:
                self._pulls.pop(pull.image, None)
                self.counters.pull_failures += 1
            reason = e if isinstance(e, PullFailed) else PullFailed(
                pull.image, f"{type(e).__name__}: {e}")
            log.warning("%s", reason)
            if not pull.future.done():  # (close may have failed it: a stop came first)
                pull.future.set_exception(reason)
            return
        with self._lock:
            self._pulls.pop(pull.image, None)
        if not pull.future.done():
            pull.future.set_result(done)
        self.make_room()

    def _pull(self, pull: _Pull) -> PullDone:
        image = pull.image
        repo, tag = parse_repository_tag(image)
        try:
            for event in self.client.api.pull(repo, tag=tag or "latest", stream=True,
                                              decode=True):
                if "error" in event:
                    raise PullFailed(image, str(event.get("error")))
                self._progress(pull, event)
            info = self.client.api.inspect_image(image)
        except docker.errors.APIError as e:
            raise PullFailed(image, str(e.explanation or e)) from None
        except (requests.exceptions.RequestException, OSError) as e:
            raise PullFailed(image, f"the engine's pull broke off: {e}") from None
        now = time.monotonic()
        got, _ = pull.downloaded()
        with self._lock:
            self._known[image] = info["Id"]
            self._entries[image] = _Entry(info["Id"], int(info.get("Size") or 0), now)
            self.counters.pulls += 1
            self.counters.pulled_bytes += got
            self.counters.pull_seconds += now - (pull.started_at or now)
        self._save()
        return PullDone(image, pulled=True, bytes=got,
                        queued_s=(pull.started_at or now) - pull.queued_at,
                        pull_s=now - (pull.started_at or now))

    @staticmethod
    def _progress(pull: _Pull, event: dict[str, Any]) -> None:
        """One event of the engine's pull stream: per layer, bytes downloaded of its size."""
        layer, status = event.get("id"), event.get("status", "")
        if not layer or status.startswith(("Pulling from", "Digest", "Status")):
            return
        detail = event.get("progressDetail") or {}
        if status == "Downloading" and detail.get("total"):
            pull.layers[layer] = [int(detail.get("current") or 0), int(detail["total"])]
        elif status in ("Download complete", "Verifying Checksum", "Pull complete") \
                and layer in pull.layers:
            pull.layers[layer][0] = pull.layers[layer][1]

    # -- the budget ----------------------------------------------------------------------
    def used_bytes(self) -> int:
        with self._lock:
            return self._used()

    def _used(self) -> int:
        """Under the lock: the bytes of the images this cache pulled (each image once)."""
        return sum({e.image_id: e.size for e in self._entries.values()}.values())

    def make_room(self) -> int:
        """Remove the least recently used images this cache pulled until the rest fit the
        budget, never a held one; how many were removed. Still over it, the backend drops
        its spare holders (``release``: warm sandboxes, cheap to make again unlike a pull)
        and the images they held go too, least recently used first."""
        removed = self._evict()
        if self.over_budget and self._release() > 0:
            removed += self._evict()
        return removed

    def _evict(self) -> int:
        """One pass of make_room. Removals run under the lock: a want of an image being
        removed waits, then finds it gone and pulls it again."""
        if self.budget is None:
            return 0
        removed = 0
        with self._lock:
            # under the lock: a want of an image (and the backend's record of who wants it,
            # made before) either came before and is seen here, or waits for the removal
            # (the backend never asks this cache for its lock while it holds its own)
            held = set(self._held()) | set(self.keep) | set(self._pulls)
            used = self._used()
            order = sorted((e.last_used, ref) for ref, e in self._entries.items()
                           if ref not in held)
            for _, ref in order:
                if used <= self.budget:
                    break
                entry = self._entries[ref]
                if self._leaving(entry.image_id):
                    # a closed trajectory's container, being removed: the make_room that
                    # follows its removal evicts this image; passing over it now would
                    # evict a more recently used one in its place. (Asked before the
                    # removal, not once the engine refuses it: by then the container may
                    # be gone, and the pass would go on to the newer one all the same)
                    break
                try:
                    self.client.api.remove_image(ref)
                except docker.errors.NotFound:
                    pass
                except docker.errors.APIError as e:
                    # a container the backend does not know of runs it: never removed
                    log.info("image %s not evicted: %s", ref, e.explanation or e)
                    continue
                del self._entries[ref]
                self._known.pop(ref, None)
                if not any(e.image_id == entry.image_id for e in self._entries.values()):
                    used -= entry.size
                    self.counters.evicted_bytes += entry.size
                self.counters.evictions += 1
                removed += 1
            self.over_budget = used > self.budget
        if removed:
            self._save()
        return removed

    # -- what it shows -------------------------------------------------------------------
    def status(self, held: Collection[str] = ()) -> dict[str, Any]:
        """Pulls, cached images and counters (JSON-ready)."""
        now = time.monotonic()
        held = set(held)
        with self._lock:
            pulls = [{"image": p.image, "registry": registry_of(p.image),
                      "state": "queued" if p.started_at is None else "pulling",
                      "waiting": p.waiters,
                      "downloaded_bytes": p.downloaded()[0], "total_bytes": p.downloaded()[1],
                      "layers": len(p.layers),
                      "seconds": round(now - (p.started_at or p.queued_at), 3)}
                     for p in list(self._pulls.values())[:MAX_LISTED]]
            cached = sorted(self._entries.items(), key=lambda kv: -kv[1].last_used)
            images = [{"image": ref, "bytes": e.size, "idle_s": round(now - e.last_used, 3),
                       "held": ref in held} for ref, e in cached[:MAX_LISTED]]
            used = self._used()
            counters = asdict(self.counters)
        return {"pulls_at_once": self.pulls,
                "budget_bytes": self.budget, "used_bytes": used,
                "over_budget": self.budget is not None and used > self.budget,
                "pulling": pulls, "cached": images, "cached_count": len(cached),
                "counters": counters}

    # -- across restarts -----------------------------------------------------------------
    def _load(self) -> None:
        """The images a predecessor's cache pulled that are still on the node."""
        if self.state_file is None:
            return
        try:
            refs = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return
        now = time.monotonic()
        for ref in refs if isinstance(refs, list) else ():
            try:
                info = self.client.api.inspect_image(str(ref))
            except docker.errors.APIError:
                continue
            self._entries[str(ref)] = _Entry(info["Id"], int(info.get("Size") or 0), now)
            self._known[str(ref)] = info["Id"]

    def _save(self) -> None:
        if self.state_file is None:
            return
        with self._lock:
            refs = sorted(self._entries)
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(refs))
            tmp.replace(self.state_file)
        except OSError as e:
            log.warning("cannot record the images the cache pulled (%s): a restart will "
                        "keep them for good", e)

