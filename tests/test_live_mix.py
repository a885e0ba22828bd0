"""`tangram bench live-mix` (issue 30): its workload is seeded and shaped as documented, and
a bad option is a clear error. The run itself is a benchmark (minutes), not a test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from analysis.bench.live_mix import HEAVY, LIGHT, REWARD_MODULES, check, plan

ROOT = Path(__file__).parent.parent


def test_each_trajectory_has_one_reward_between_short_commands_and_is_seeded():
    a = plan(8, 6, 0, REWARD_MODULES, 1.0)
    assert a == plan(8, 6, 0, REWARD_MODULES, 1.0) and a != plan(8, 6, 1, REWARD_MODULES, 1.0)
    py = sys.executable
    shorts = {c.format(py=py) for c in (*LIGHT, *HEAVY)}
    for steps in a:
        assert len(steps) == 7 and sum(s.reward for s in steps) == 1
        assert not steps[0].reward and not steps[-1].reward  # shorts before and after it
        assert all(s.command in shorts for s in steps if not s.reward)
        assert all(s.think_s >= 0 for s in steps)
    rewards = [s.command for steps in a for s in steps if s.reward]
    assert {r.rsplit(" ", 1)[1] for r in rewards} == set(REWARD_MODULES)


def test_a_bad_option_is_a_clear_error():
    res = subprocess.run([sys.executable, str(ROOT / "cli.py"), "bench", "live-mix",
                          "--policies", "tangram,nope"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert res.returncode != 0 and "unknown policy 'nope'" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    with pytest.raises(ValueError, match="cores: 4096 asked"):
        check(4096)
