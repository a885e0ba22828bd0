"""Learnt speedup curves keyed by what repeats: per command, with the kind as prior
(tangram.estimates.CommandCurves through DurationModel's public API)."""

from __future__ import annotations

import numpy as np

from tangram.estimates import CommandCurves, DurationModel, command_of
from tangram.model import Action, Demand

CHOICES = (1, 2, 4, 8)
KEY = ("t", "test_run")


def act(i: int, command: str = "") -> Action:
    return Action(f"a{i}", "t", f"j{i}", "test_run", {"cpu": Demand.discrete(CHOICES)},
                  elastic="cpu", payload={"command": command} if command else None)


def curve(t1: float, p: float, o: float = 0.0) -> dict[int, float]:
    return {m: t1 * ((1 - p) + p / m) + o * (m - 1) for m in CHOICES}


def test_suites_of_one_kind_each_get_their_own_size_on_the_kinds_shape():
    sizes = {"small": 4.0, "mid": 20.0, "big": 90.0}
    truth = {c: curve(t, 0.8, 0.3) for c, t in sizes.items()}
    model, rng, i = DurationModel(), np.random.default_rng(0), 0
    for _ in range(6):  # each suite a few times, at varied unit counts
        for c in sizes:
            m = int(rng.choice(CHOICES))
            i += 1
            model.observe(act(i, c), m, truth[c][m], "cpu:n", True)
    for c in sizes:
        table = model.learnt_table(KEY, CHOICES, c)
        assert table is not None
        assert all(abs(table[u] - truth[c][u]) / truth[c][u] < 0.02 for u in CHOICES), c
    # the kind's single curve fits the suites' mean: far from the small suite's own
    kind = model.learnt_table(KEY, CHOICES)
    assert kind is not None and abs(kind[1] - truth["small"][1]) / truth["small"][1] > 1.0
    # a command never seen: the kind's curve (it has no size of its own yet)
    assert model.learnt_table(KEY, CHOICES, "new") == kind


def test_without_a_command_nothing_changes_and_one_unit_count_teaches_no_shape():
    cc = CommandCurves()
    for k in range(5):
        cc.observe("a", 2, 10.0 + k)
    assert cc.fit() is None and cc.table("a", CHOICES) is None  # one unit count: no shape
    assert command_of(act(0)) == "" and command_of(act(0, "pytest x")) == "pytest x"
    a, b = DurationModel(), DurationModel()
    for i, (m, t) in enumerate(((1, 10.0), (2, 6.0), (4, 4.0), (8, 3.5))):
        a.observe(act(i), m, t, "cpu:n", True)
        b.observe(act(i), m, t, "cpu:n", True)
    assert a.learnt_table(KEY, CHOICES) == b.learnt_table(KEY, CHOICES, "")


def test_no_command_run_at_two_unit_counts_teaches_no_shape():
    """Runs at two unit counts, but each command at one: every shape fits them equally
    (each command's size absorbs its runs), so there is no shape; a suite that once ran
    wide is then planned from the kind's curve, not from a flat fit at its minimum."""
    cc = CommandCurves()
    for _ in range(3):
        cc.observe("a", 8, 10.0)
    cc.observe("b", 1, 20.0)
    assert cc.fit() is None and cc.table("a", CHOICES) is None
    cc.observe("a", 1, 40.0)  # the same suite at a second count: now the shape shows
    fit = cc.fit()
    assert fit is not None and fit[0] > 0.5
    model = DurationModel()
    for i, (c, m, t) in enumerate((("a", 8, 10.0), ("a", 8, 10.0), ("a", 8, 10.0),
                                    ("b", 1, 20.0))):
        model.observe(act(i, c), m, t, "cpu:n", True)
    assert model.learnt_table(KEY, CHOICES, "a") == model.learnt_table(KEY, CHOICES)


def test_a_per_unit_start_up_cost_is_learnt_shared_across_suites():
    truth = {c: curve(t, 0.5, 1.0) for c, t in (("a", 5.0), ("b", 50.0))}
    cc = CommandCurves()
    for c in truth:
        for m in CHOICES:
            cc.observe(c, m, truth[c][m])
    p, cost, _ = cc.fit()
    assert abs(p - 0.5) <= 0.011 and abs(cost - 1.0) < 0.05
    table = cc.table("a", CHOICES)
    assert table[8] > table[4]  # wider is slower for the small suite: the DP will see it
