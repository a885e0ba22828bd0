"""Issue 30, the core's placement and light-lane rules (the simulator and the live server
run the same core; the live test is tests/test_live_lane.py):

* placing a trajectory never waits for a free core: its first action is bound to a node
  by memory and queues there like any other (a light one takes the lane at once);
* the lane learns per command, not per (task, kind);
* an action overstaying the lane is moved off it: its place goes to the next light
  action at once, and it is accounted on an exclusive core (now, or the first to free).
"""

from __future__ import annotations

from helpers import cluster, counts, finish, open_trajectory, shell, submit

from tangram.core import Tangram
from tangram.estimates import Estimates
from tangram.model import Action, Demand, Dispatch, Outcome
from tangram.policies import Policy, make_policy
from tangram.protocol import Finish, Moved, Overstay, Submit

#: the parameters of the policy a core built without one runs (Tangram(cluster))
DEFAULT = Policy()


def cmd(traj: str, command: str, aid: str, kind: str = "shell", t1: float | None = None,
        cores: int = 1) -> Action:
    return Action(aid, "t", traj, kind, {"cpu": Demand.fixed(cores)}, t1_s=t1,
                  payload={"command": command})


def dispatches(effects) -> dict[str, Dispatch]:
    return {e.action.id: e for e in effects if isinstance(e, Dispatch)}


def busy_core(cores: int = 2) -> Tangram:
    """A node of ``cores`` cores, every one held by trajectory ``busy``'s test run."""
    core = Tangram(cluster(cores=cores, mem_gb=16.0))
    open_trajectory(core, "busy", mem_gb=1.0)
    got = dispatches(core.handle(Submit((cmd("busy", "pytest", "run", cores=cores),)), 0.0))
    assert got["run"].units == cores
    return core


def test_a_first_action_is_placed_while_every_core_is_held():
    """The first action of a trajectory is bound at once though no core is free; a light
    one starts on the lane with no wait, a heavy one queues on its node (not for binding)."""
    core = busy_core()
    open_trajectory(core, "a", mem_gb=1.0)
    open_trajectory(core, "b", mem_gb=1.0)
    got = dispatches(core.handle(Submit((cmd("a", "ls", "ls", t1=0.01),)), 1.0))
    assert got["ls"].lease.lane and got["ls"].start_s == got["ls"].submit_s == 1.0
    assert core.handle(Submit((cmd("b", "make", "make"),)), 1.0) == []
    assert core.node_of("a") == core.node_of("b") == "n0"
    assert core.snapshot(detail=False).unbound == 0 and core.why_queued("make") == ""
    got = dispatches(core.handle(Finish("run", Outcome("run", "ok", 0)), 30.0))
    assert set(got) == {"make"}


def test_binding_prefers_a_node_where_the_first_action_starts_now():
    """Among nodes with room for its memory, one with a free core first (then memory
    balance); with every core held, the least memory-loaded node."""
    core = Tangram(cluster(cores=1, nodes=2, mem_gb=16.0))
    open_trajectory(core, "x", mem_gb=1.0)
    core.handle(Submit((cmd("x", "pytest", "x1"),)), 0.0)
    for t in "abc":
        open_trajectory(core, t, mem_gb=2.0)
    core.handle(Submit((cmd("a", "make", "a1"),)), 0.0)  # n1 has the free core
    assert core.node_of("x") == "n0" and core.node_of("a") == "n1"
    core.handle(Submit((cmd("b", "make", "b1"),)), 0.0)  # none free: n0 holds less memory
    core.handle(Submit((cmd("c", "make", "c1"),)), 0.0)  # none free: n1 holds less now
    assert core.node_of("b") == "n0" and core.node_of("c") == "n1"


def test_the_lane_learns_per_command_not_per_kind():
    """``ls`` and ``python -c 'import sympy'`` are both ``shell``: once each ran, the
    first is light and the second not, whatever the kind's mean; a command never seen
    goes by the kind's share of light runs."""
    est = Estimates()
    core = Tangram(cluster(cores=2, mem_gb=16.0), estimates=est)
    open_trajectory(core, "a", mem_gb=1.0)
    now = 0.0
    for i, (command, took) in enumerate([("ls", 0.01), ("python -c 'import sympy'", 3.0),
                                         ("ls", 0.02)]):
        d = dispatches(core.handle(Submit((cmd("a", command, f"w{i}"),)), now))[f"w{i}"]
        now += took
        core.handle(Finish(d.action.id, Outcome(d.action.id, "ok", 0)), now)
    assert est.durations.mean(("t", "shell")) > DEFAULT.cpu.light_s
    open_trajectory(core, "busy", mem_gb=1.0)
    core.handle(Submit((cmd("busy", "pytest", "run", cores=2),)), now)  # every core held
    got = dispatches(core.handle(Submit((cmd("a", "ls", "ls"),)), now))
    assert got["ls"].lease.lane
    open_trajectory(core, "b", mem_gb=1.0)
    assert core.handle(Submit((cmd("b", "python -c 'import sympy'", "imp"),)), now) == []
    core.handle(Finish("ls", Outcome("ls", "ok", 0)), now + 0.01)
    open_trajectory(core, "c", mem_gb=1.0)  # never seen: 3 of the kind's 4 runs were light
    assert dispatches(core.handle(Submit((cmd("c", "cat x", "cat"),)), now))["cat"].lease.lane


def test_an_action_overstaying_the_lane_is_moved_off_it():
    """A declared-light command that runs long holds the lane's only place for at most
    ``lane_hold_s``: then it leaves the lane (the next light action starts at once), waits
    for a core at the lowest priority, and holds the first core to free (before the
    queue). Its command is not light from then on."""
    core = busy_core()
    hold = DEFAULT.cpu.lane_hold_s
    open_trajectory(core, "liar", mem_gb=1.0)
    open_trajectory(core, "a", mem_gb=1.0)
    open_trajectory(core, "b", mem_gb=1.0)
    got = dispatches(core.handle(Submit((cmd("liar", "sleep 60", "slow", t1=0.0),)), 0.0))
    assert got["slow"].lease.lane
    core.handle(Submit((cmd("b", "make", "make"),)), 0.1)  # queued for a core
    assert core.handle(Submit((cmd("a", "ls", "ls", t1=0.01),)), 0.2) == []  # lane full
    assert core.lane_wakeup() == hold
    out = core.handle(Overstay(), hold)
    assert out[0] == Moved("slow", "n0", ())  # off the lane, no core free: lowest priority
    assert dispatches(out)["ls"].lease.lane and dispatches(out)["ls"].start_s == hold
    assert counts(core).usage["cpu_lane"] == 1.0  # ls alone on the lane
    core.handle(Finish("ls", Outcome("ls", "ok", 0)), hold + 0.01)
    # the test run ends: the moved action takes the core it frees before the queue does
    out = core.handle(Finish("run", Outcome("run", "ok", 0)), 5.0)
    assert out[0] == Moved("slow", "n0", (0,))
    assert set(dispatches(out)) == {"make"} and counts(core).usage["cpu"] == 2.0
    open_trajectory(core, "c", mem_gb=1.0)  # the same command again: not light any more
    assert core.handle(Submit((cmd("c", "sleep 60", "again", t1=0.0),)), 5.0) == []
    out = core.handle(Finish("slow", Outcome("slow", "ok", 0)), 60.0)
    assert set(dispatches(out)) == {"again"} and not dispatches(out)["again"].lease.lane


def test_a_moved_action_takes_an_idle_core_at_once():
    core = Tangram(cluster(cores=2, mem_gb=16.0))
    open_trajectory(core, "liar", mem_gb=1.0)
    got = dispatches(core.handle(Submit((cmd("liar", "sleep 60", "slow", t1=0.0),)), 0.0))
    assert got["slow"].lease.lane
    hold = DEFAULT.cpu.lane_hold_s
    assert core.handle(Overstay(), hold) == [Moved("slow", "n0", (0,))]
    assert counts(core).usage | {"mem_gb": 0} == {"cpu": 1.0, "cpu_lane": 0.0, "gpu": 0.0,
                                              "mem_gb": 0}
    core.handle(Finish("slow", Outcome("slow", "ok", 0)), 60.0)
    assert counts(core).usage["cpu"] == 0.0


def test_lane_hold_is_a_policy_parameter():
    core = Tangram(cluster(cores=2), make_policy("tangram", {"lane_hold_s": 0.5}))
    open_trajectory(core, "a", mem_gb=1.0)
    core.handle(Submit((cmd("a", "sleep 9", "s", t1=0.0),)), 0.0)
    assert core.lane_wakeup() == 0.5
    assert make_policy("fixed-dop:1").cpu.lane_hold_s == 1.0
    import pytest

    with pytest.raises(ValueError, match="lane_hold_s"):
        make_policy("tangram", {"lane_hold_s": 0.0})


def test_an_action_naming_no_command_goes_by_its_kind():
    """Trace rows name no command: their kind is all there is (issue 21's rule)."""
    est = Estimates()
    core = Tangram(cluster(cores=2, mem_gb=16.0), estimates=est)
    open_trajectory(core, "a", mem_gb=1.0)
    now = 0.0
    for i in range(2):
        [d] = submit(core, shell("a", aid=f"k{i}"), now)
        assert not d.lease.lane  # undeclared, kind never seen: not light
        now += 0.02
        finish(core, d.action.id, now)
    [d] = submit(core, shell("a", aid="k2"), now)
    assert d.lease.lane


def test_light_actions_do_not_overtake_the_queue_for_an_idle_core():
    """Arrival order within a pool (issue 34 #3): the lane full, an idle exclusive core
    goes to the queue's head when it arrived before the waiting light actions; light
    actions that arrived earlier still take it first. Before, every idle core went to
    the light queue first, so in a burst of 1,024 x 5 ``true`` (a light lane of one
    slot on two cores) ~20 actions waited in the queue the whole burst (first-action
    p99 30.9 s against p50 5.6 s)."""
    core = Tangram(cluster(cores=2, mem_gb=16.0))
    for t in "abcdef":
        open_trajectory(core, t, mem_gb=1.0)
    got = dispatches(core.handle(Submit((cmd("a", "ls", "l0", t1=0.01),)), 0.0))
    assert got["l0"].lease.lane  # the lane's only slot
    got = dispatches(core.handle(Submit((cmd("b", "make", "m0"), cmd("f", "make", "m1"))),
                                 0.1))
    assert set(got) == {"m0", "m1"}  # both cores
    assert core.handle(Submit((cmd("c", "make", "m2"),)), 0.2) == []  # queued: no core
    assert core.handle(Submit((cmd("d", "ls", "l1", t1=0.01),)), 0.3) == []  # lane full
    # (all before lane_hold_s: l0 holds the lane throughout)
    assert DEFAULT.cpu.lane_hold_s > 0.7
    out = dispatches(core.handle(Finish("m0", Outcome("m0", "ok", 0)), 0.5))
    assert set(out) == {"m2"}  # the queue's head waited longer than the light action
    core.handle(Submit((cmd("e", "make", "m3"),)), 0.6)  # queued after l1
    out = dispatches(core.handle(Finish("m1", Outcome("m1", "ok", 0)), 0.7))
    assert set(out) == {"l1"} and not out["l1"].lease.lane  # l1 waited longer than m3
