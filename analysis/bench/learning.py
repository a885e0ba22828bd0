"""`tangram bench learning`: how many observed runs the online speedup model
(tangram.estimates) needs to come within 10% of the true curve, per command with the
kind as prior and per kind alone (no clock: a count of runs)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

import numpy as np

from analysis.bench import QUIET, Opt, Progress


def learning_bench(seeds: int = 20, max_runs: int = 300, tol: float = 0.10,
                   commands: int = 8, rerun_sigma: float = 0.1,
                   progress: Progress = QUIET) -> Iterator[dict]:
    """How many observed runs the online speedup model (tangram.estimates) needs to
    come within ``tol`` of the true mean curve at every unit count, and stay there.

    A kind of ``commands`` different commands (test files / suites) whose one-core times
    T1 spread lognormally around 10 s (``t1_sigma``: 0.1, similar suites; 0.5, suites an
    order of magnitude apart), each run one of them at random, rerun noise
    ``rerun_sigma`` (assumption: 0.1), granted 1, 2, 4 or 8 units at random (how
    exploration spreads them). Two learners through DurationModel's public API:

    * per command with the kind as prior (an action naming its ``command``): the
      command's own curve; counted in runs *of that command* from its first, the analog
      of "one command rerun", and in runs of the kind;
    * per kind (no command named): one curve for the kind, judged against the mean
      curve of its commands, counted in runs of the kind (the model before commands).
    """
    from tangram.estimates import DurationModel
    from tangram.model import Action, Demand

    choices = (1, 2, 4, 8)
    cases = [(p, o, sigma) for sigma in (0.1, 0.5)
             for p, o in ((0.5, 0.0), (0.8, 0.0), (0.95, 0.0), (0.8, 0.5), (0.5, 1.0))]

    def action(i: int, command: str) -> Action:
        return Action(f"a{i}", "bench", f"j{i}", "test_run", {"cpu": Demand.discrete(choices)},
                      elastic="cpu", payload={"command": command} if command else None)

    for i, (p, overhead, sigma) in enumerate(cases):
        own_runs: list[float] = []
        kind_runs: list[float] = []
        kind_curve: list[float] = []
        for seed in range(seeds):
            progress(i * seeds + seed, len(cases) * seeds)
            rng = np.random.default_rng(seed)
            t1 = rng.lognormal(np.log(10.0), sigma, commands)
            true = [{m: t * ((1 - p) + p / m) + overhead * (m - 1) for m in choices} for t in t1]
            mean = {m: float(np.mean([c[m] for c in true])) for m in choices}
            by_cmd, by_kind = DurationModel(), DurationModel()
            within = [None] * commands  # (kind run, own run) since when within tol
            seen = [0] * commands
            kind_within = None
            for run in range(1, max_runs + 1):
                k, m = int(rng.integers(commands)), int(rng.choice(choices))
                elapsed = true[k][m] * float(rng.lognormal(-rerun_sigma ** 2 / 2, rerun_sigma))
                seen[k] += 1
                by_cmd.observe(action(run, f"cmd{k}"), m, elapsed, "cpu:n", True)
                by_kind.observe(action(run, ""), m, elapsed, "cpu:n", True)
                for c in range(commands):
                    if not seen[c]:
                        continue
                    table = by_cmd.learnt_table(("bench", "test_run"), choices, f"cmd{c}")
                    ok = table is not None and all(
                        abs(table[u] - true[c][u]) / true[c][u] <= tol for u in choices)
                    within[c] = (within[c] or (run, seen[c])) if ok else None
                curve = by_kind.curve(("bench", "test_run"))
                ok = curve is not None and all(
                    abs((curve.duration(u) or float("inf")) - mean[u]) / mean[u] <= tol
                    for u in choices)
                kind_within = (kind_within or run) if ok else None
            for c in range(commands):
                if seen[c]:
                    own_runs.append(within[c][1] if within[c] else float("inf"))
                    kind_runs.append(within[c][0] if within[c] else float("inf"))
            kind_curve.append(kind_within or float("inf"))
        own, kind, old = (np.asarray(v, dtype=float) for v in (own_runs, kind_runs, kind_curve))

        def pct(a: np.ndarray, q: int) -> float:
            return float(np.percentile(a, q, method="nearest"))

        progress((i + 1) * seeds, len(cases) * seeds)
        yield {"parallel_fraction": p, "unit_overhead_s": overhead, "t1_sigma": sigma,
               "commands": commands, "rerun_sigma": rerun_sigma, "tolerance": tol,
               "seeds": seeds, "max_runs": max_runs,
               "per_command_own_runs_p50": pct(own, 50),
               "per_command_own_runs_p90": pct(own, 90),
               "per_command_kind_runs_p90": pct(kind, 90),
               "per_command_never_within": int(np.isinf(own).sum()),
               "per_kind_runs_p50": pct(old, 50), "per_kind_runs_p90": pct(old, 90),
               "per_kind_never_within": int(np.isinf(old).sum()),
               "slower_at_8_than_at_1": bool(overhead * 7 > 10.0 * p * 7 / 8)}


def command(seeds: Annotated[int, Opt("Repetitions per curve.", min=1)] = 20,
            progress: Progress = QUIET) -> Iterator[dict]:
    """Per command with the kind as prior (counted in that command's runs and in the
    kind's), and per kind alone."""
    yield from learning_bench(seeds, progress=progress)
