"""A CPU node's light lane's own starts (tangram/cpu/pool.py, CpuNodePool): run before the
node's scheduling passes, outside its scheduler's plan. Light actions start on the lane's
shared cores while it has room, then on idle exclusive cores; actions overstaying the lane
leave it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

from tangram.estimates import DurationModel, command_of
from tangram.model import Action, Dispatch, Lease, Pending
from tangram.pool import Books
from tangram.protocol import Effect, Moved

#: a lane action overstays at its start + the lane's hold; a timer set for that instant
#: may fire a rounding error before it (now + (at - now) != at in floating point)
TICK = 1e-9


class LaneHost(Protocol):
    """What the lane's starts use of the node's pool (tangram/cpu/pool.py CpuNodePool):
    its queues, its places on the lane and its idle cores."""

    light: deque[Pending]
    queue: deque[Pending]
    #: the node whose cores the lane shares
    node: str
    lane_slots: int

    def lane_lease(self, p: Pending, now: float) -> Lease | None: ...
    def core_lease(self, p: Pending) -> Lease | None: ...
    def overstayed(self, now: float) -> list[str]: ...
    def book(self) -> list[tuple[str, tuple[int, ...]]]: ...
    def started(self, action_id: str, end_s: float, units: int, now: float) -> None: ...


def lane_pass(pool: LaneHost, now: float, books: Books) -> list[Effect]:
    """What the lane does before the node's pass at ``now``: the moves off it, then the
    light actions it starts."""
    out = move_off_lane(pool, now, books)
    if pool.light:
        out.extend(start_light(pool, now, books))
    return out


def move_off_lane(pool: LaneHost, now: float, books: Books) -> list[Effect]:
    """Actions overstaying the lane leave it (their commands are known long from now
    on), and those moved off it take idle exclusive cores (CpuNodePool)."""
    if pool.lane_slots == 0:
        return []
    moved = {}
    for aid in pool.overstayed(now + TICK):
        books.estimates.durations.lane.overstaying(books.running[aid].action)
        moved[aid] = ()
        books.moved_off_lane()
    moved.update(pool.book())  # (one moved and booked at once: one effect)
    node = pool.node
    return [Moved(aid, node, cores) for aid, cores in moved.items()]


def start_light(pool: LaneHost, now: float, books: Books) -> list[Effect]:
    """Start waiting light actions, in order, on the node's lane while it has room,
    then on idle exclusive cores (see CpuNodePool)."""
    out: list[Effect] = []
    light = pool.light
    # (hoisted: a burst starts hundreds here)
    queued, running, started = books.queued, books.running, pool.started
    estimate, lane_lease, core_lease = books.estimates.estimate, pool.lane_lease, pool.core_lease
    full = False  # the lane is full: it stays full for this pass (nothing ends in it)
    queue = pool.queue
    while light:
        p = light[0]
        lease = None if full else lane_lease(p, now)
        if lease is None:
            full = True
            # an idle exclusive core goes to whichever waited first: a light action
            # does not overtake the queue's head (arrival order within the pool)
            if queue and queue[0].submit_s < p.submit_s:
                break
            lease = core_lease(p)
            if lease is None:
                break
        light.popleft()
        action = p.action
        aid = action.id
        del queued[aid]
        units = lease.units
        expected = estimate(p)
        d = Dispatch(action, lease, p.submit_s, now, expected)
        p.dispatch, p.pool, p.batch_left = d, pool, None
        running[aid] = p
        started(aid, now + expected, units, now)
        out.append(d)
    return out


#: is a queued action light (it may use the lane)? Given the action, its minimum cores and
#: the quotas it holds
LightTest = Callable[[Action, int, Mapping[str, float]], bool]


def light_test(light_s: float, durations: DurationModel) -> LightTest:
    """The light-lane classification of one batch queued on a lane of ``light_s``:
    actions expected to take at most ``light_s`` on one core, holding no quota, by their
    command, declared or observed (tangram/estimates.py LaneModel). A batch looks each
    (task, kind)'s runs up once."""
    lane_model, mean_n = durations.lane, durations.mean_n
    # per (task, kind) of the batch: its runs and their mean
    kinds: dict[tuple[str, str], tuple[int, float]] = {}

    def light(action: Action, key_min: int, quotas: Mapping[str, float]) -> bool:
        if not (key_min == 1 and light_s and not quotas):
            return False
        command = command_of(action)
        if command:  # (its own runs, else its declaration, else its kind's)
            return lane_model.light(action, command, light_s, 0, 0.0)
        k = (action.task, action.kind)  # (by its kind)
        runs = kinds.get(k)
        if runs is None:
            runs = kinds[k] = mean_n(k)
        return lane_model.light(action, "", light_s, *runs)

    return light
