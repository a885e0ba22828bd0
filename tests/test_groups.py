"""GRPO groups in traces and in the simulator (issue 36): the group column, the
generator's groups, and a group played separately or forked."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.cluster import load_cluster
from sim.driver import SimConfig, simulate
from tangram.fork import FORK
from traces.generate import generate
from traces.groups import SETUP, plays
from traces.schema import TraceError, trajectories, validate


def test_group_column_is_validated():
    df = generate("coding", 4, 0, group_size=2)
    two = df.copy()
    two.loc[two.index[1], "group"] = "other"  # a trajectory naming two groups
    with pytest.raises(TraceError, match="more than one group"):
        validate(two)
    mixed = df.copy()
    mixed.loc[mixed["trajectory"] == "coding-00001", "task"] = "else"
    with pytest.raises(TraceError, match="more than one task"):
        validate(mixed)
    assert set(validate(generate("coding", 3, 0))["group"]) == {""}  # optional


def test_generator_groups_share_one_setup_and_keep_the_actions():
    plain, grouped = generate("coding", 20, 3), generate("coding", 20, 3, group_size=8)
    keep = [c for c in plain.columns if c not in ("group", "setup_s", "mem_gb")]
    assert plain[keep].equals(grouped[keep])
    per = grouped.groupby("group")["trajectory"].nunique()
    assert list(per) == [8, 8, 4]
    firsts = grouped[grouped["seq"] == 0]
    assert (firsts.groupby("group")["setup_s"].nunique() == 1).all()
    assert (firsts["setup_s"] > 0).all() and (grouped[grouped["seq"] > 0]["setup_s"] == 0).all()
    with pytest.raises(ValueError, match="group_size"):
        generate("mopd", 4, 0, group_size=2)


def test_a_group_prepares_once_when_forked():
    specs = list(trajectories(validate(generate("coding", 8, 1, group_size=4))))
    separate = plays(specs, None)
    assert len(separate) == 8 and all(p.leader.steps[0].action.kind == SETUP and not p.copies
                                      for p in separate)
    forked = plays(specs, 0.25)
    assert len(forked) == 2
    setup_of = {s.id: s.steps[0].truth.setup_s for s in specs}
    for p in forked:
        assert p.leader.steps[0].truth.t1_s == setup_of[p.leader.id] > 0
        kinds = [s.action.kind for s in p.leader.steps[:2]]
        assert kinds == [SETUP, FORK] and len(p.copies) == 3
        fork = p.leader.steps[1]
        assert fork.action.payload["fork_to"] == [c.id for c in p.copies]
        assert fork.truth.t1_s == pytest.approx(0.75)  # per copy
        assert all(c.steps[0].truth.setup_s == 0 and c.steps[0].action.kind != SETUP
                   for c in p.copies)


def test_simulated_fork_pays_one_setup_per_group():
    df = generate("coding", 16, 2, group_size=8)
    cluster = load_cluster("default")
    assert cluster.extra["fork_s"] > 0  # the shipped clusters carry the measured cost
    with pytest.raises(ValueError, match="fork_s"):
        simulate(df, replace(cluster, extra={}), SimConfig(fork=True))
    cluster = replace(cluster, extra={**cluster.extra, "fork_s": 0.3})
    runs = {fork: simulate(df, cluster, SimConfig(fork=fork)) for fork in (False, True)}
    kinds = {fork: [r.kind for r in run.records] for fork, run in runs.items()}
    assert kinds[False].count(SETUP) == 16 and FORK not in kinds[False]
    assert kinds[True].count(SETUP) == 2 and kinds[True].count(FORK) == 2
    # every agent action ran either way, each copy after its group's fork
    assert len(runs[True].records) == len(runs[False].records) - 16 + 2 + 2
    forks = {r.trajectory: r.end_s for r in runs[True].records if r.kind == FORK}
    lead_of = {f"coding-{i:05d}": f"coding-{(i // 8) * 8:05d}" for i in range(16)}
    for r in runs[True].records:
        if r.trajectory != lead_of[r.trajectory]:
            assert r.submit_s >= forks[lead_of[r.trajectory]]
    # same seed, same outputs
    again = simulate(df, cluster, SimConfig(fork=True))
    assert [(r.action_id, r.end_s) for r in again.records] == \
        [(r.action_id, r.end_s) for r in runs[True].records]
