"""GRPO groups in traces: the rollouts of one prompt, and their sandbox's setup.

A trace's ``group`` column names the rollouts of one prompt (8-64 of them in GRPO);
the first row of each of its trajectories carries the sandbox's preparation in
``setup_s`` (clone the repository, install its dependencies). A group is played in one
of two ways, the same trace either way:

* **separate** (what every system does today): each rollout prepares its own sandbox -
  a ``setup`` action (one core, ``setup_s`` long) opens each trajectory;
* **forked** (tangram/fork.py): the group's first trajectory (its leader) runs the
  setup action, then a ``fork`` action that copies its sandbox into the others (one
  core, ``fork_s`` per copy: the backend's measured cost, cluster.yaml's
  ``extra.fork_s``); the other rollouts start once the fork ended, without a setup.

In both, the setup comes before the rollout's first LLM turn (the agent sees a ready
sandbox), so the only difference between the two is what the fork saves or costs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from tangram.fork import MAX_COPIES, fork_action
from tangram.model import Action, Demand
from traces.schema import Step, TrajectorySpec, Truth

#: the kind of a sandbox's setup action
SETUP = "setup"


def assign_groups(df: pd.DataFrame, size: int, setup_s: np.ndarray) -> pd.DataFrame:
    """``df``'s trajectories, in order, in groups of ``size`` (the last may be smaller):
    a ``group`` column, one ``setup_s[k]`` for every trajectory of group ``k`` (on its
    first row), and the memory of the group's first trajectory for all of them (one
    prompt: one repository)."""
    if not 1 <= size <= MAX_COPIES + 1:
        raise ValueError(f"group_size: 1 to {MAX_COPIES + 1}, got {size}")
    out = df.copy()
    order = pd.unique(out["trajectory"])
    index = {t: i // size for i, t in enumerate(order)}
    k = out["trajectory"].map(index)
    out["group"] = out["task"] + "-g" + k.map("{:05d}".format)
    first = out["seq"] == out.groupby("trajectory")["seq"].transform("min")
    out["setup_s"] = np.where(first, np.asarray(setup_s, dtype=float)[k], out["setup_s"])
    lead_mem = out.groupby("group")["mem_gb"].transform("first")
    out["mem_gb"] = lead_mem
    return out


@dataclass(frozen=True, slots=True)
class GroupPlay:
    """How one group is played: ``leader`` first; each of ``copies`` once the leader's
    fork action ended (none: every rollout prepares its own sandbox)."""

    leader: TrajectorySpec
    copies: tuple[TrajectorySpec, ...] = ()


def _without_setup(spec: TrajectorySpec) -> TrajectorySpec:
    first = spec.steps[0]
    if first.truth is None or not first.truth.setup_s:
        return spec
    return replace(spec, steps=(replace(first, truth=replace(first.truth, setup_s=0.0)),
                                *spec.steps[1:]))


def setup_of(spec: TrajectorySpec) -> float:
    """The seconds ``spec``'s sandbox takes to prepare (its first row's ``setup_s``)."""
    first = spec.steps[0] if spec.steps else None
    return first.truth.setup_s if first is not None and first.truth is not None else 0.0


def _setup_step(spec: TrajectorySpec, seconds: float) -> Step:
    action = Action(f"{spec.id}#{SETUP}", spec.task, spec.id, SETUP, {"cpu": Demand.fixed(1)},
                    payload={"timeout_s": 0.0, "command": ""})
    return Step(0.0, action, Truth(seconds))


def prepared(spec: TrajectorySpec) -> TrajectorySpec:
    """``spec`` opened by a setup action of its own (its first row's ``setup_s``)."""
    seconds = setup_of(spec)
    if not seconds:
        return spec
    rest = _without_setup(spec)
    return replace(rest, steps=(_setup_step(spec, seconds), *rest.steps))


def plays(specs: Iterable[TrajectorySpec], fork_s: float | None) -> list[GroupPlay]:
    """The trajectories of a batch as groups to play: with ``fork_s`` (seconds per
    copy) each group prepares once and forks; without, every trajectory prepares its own
    sandbox. Trajectories of no group are played alone, as they are."""
    out: list[GroupPlay] = []
    groups: dict[str, list[TrajectorySpec]] = {}
    for spec in specs:
        if not spec.group:
            out.append(GroupPlay(spec))
        elif spec.group not in groups:
            groups[spec.group] = [spec]
            out.append(GroupPlay(spec))  # its place in the batch: where its first appears
        else:
            groups[spec.group].append(spec)
    result: list[GroupPlay] = []
    for play in out:
        members = groups.get(play.leader.group) if play.leader.group else None
        if members is None:
            result.append(play)
        elif fork_s is None or len(members) == 1:
            result.extend(GroupPlay(prepared(m)) for m in members)
        else:
            result.append(forked(members, fork_s))
    return result


def forked(members: list[TrajectorySpec], fork_s: float) -> GroupPlay:
    """The group's first trajectory prepares and forks into the others."""
    lead, rest = members[0], [_without_setup(m) for m in members[1:]]
    ready = prepared(lead)
    fork = fork_action(f"{lead.id}#fork", lead.task, lead.id, [m.id for m in rest])
    setup = ready.steps[:1] if ready is not lead else ()
    leader = replace(ready, steps=(*setup, Step(0.0, fork, Truth(fork_s * len(rest))),
                                   *ready.steps[len(setup):]))
    return GroupPlay(leader, tuple(rest))
