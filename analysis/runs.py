"""Runs as Python values: the analysis API that notebooks, `tangram plot`, `tangram compare`
and the reproduce report share.

A *run directory* is what `tangram simulate` and `tangram run` write (see
analysis/outputs.py for the files). :func:`load_run` reads one into a :class:`Run`;
:func:`simulate` runs a simulation in memory and returns the same value, so a notebook
can sweep policies without writing directories. :func:`compare` puts runs side by side
as one DataFrame (one row per run), :func:`per_kind` and :func:`breakdown` give the
long frames the standard figures draw (analysis/figures.py).

    from analysis.runs import load_run, compare
    runs = [load_run("runs/t"), load_run("runs/k")]
    compare(runs)                     # one row per run: ACT, queue, execution, makespan ...
    runs[0].actions.groupby("kind")["act_s"].mean()
"""

from __future__ import annotations

import gc
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from analysis.outputs import ActionsWriter, Analysed, analyse, read_actions, summary_frame, write_run
from analysis.phases import Phases
from traces.schema import ValidTrace

#: (metric, column of actions.parquet, statistic): what `compare` measures of each run
STATS: tuple[tuple[str, str, str], ...] = tuple(
    (f"{col.removesuffix('_s')}_{stat}_s", col, stat)
    for col in ("act_s", "queue_s", "exec_s") for stat in ("mean", "p50", "p99"))


@dataclass(frozen=True)
class Run:
    """One run, simulated or live: its summary, one row per action, allocation over time."""

    #: label in tables and legends (the directory name, or the policy for in-memory runs)
    name: str
    #: summary.json: headline metrics, per-kind and per-category breakdowns, ``timing``
    summary: dict[str, Any]
    #: actions.parquet: one row per action (submit_s, start_s, end_s, queue_s, exec_s, act_s,
    #: units, node, cores, gpus, restore_s, status, ...)
    actions: pd.DataFrame
    #: utilisation.parquet: ``t_s`` and the units allocated per resource (None: not sampled)
    utilisation: pd.DataFrame | None
    #: config.json: the resolved trace, cluster and policy of the run
    config: dict[str, Any] = field(default_factory=dict)
    #: timing.parquet: the scheduler's decision time per action (wall clock)
    timing: pd.DataFrame | None = None
    #: where it was read from (None: in memory)
    path: Path | None = None

    @property
    def policy(self) -> str:
        return str(self.summary.get("policy", ""))

    def __repr__(self) -> str:  # a notebook cell showing a run should not print its frames
        where = f", path={str(self.path)!r}" if self.path else ""
        return f"Run({self.name!r}, policy={self.policy!r}, actions={len(self.actions)}{where})"

    def capacity(self, resource: str) -> float | None:
        """Units of ``resource`` the run's cluster had (None when it had none)."""
        cap = self.summary.get("utilisation", {}).get(resource, {}).get("capacity")
        return float(cap) if cap else None

    def write(self, out: str | Path, perfetto: bool = False) -> Path:
        """Write this run as a run directory (the files `tangram simulate` writes; trace.json
        with ``perfetto``)."""
        return write_run(out, Analysed(self.summary, self.actions, self.utilisation,
                                       self.timing if self.timing is not None else pd.DataFrame()),
                         self.config, perfetto=perfetto)


def settle() -> None:
    """What a long run does once its inputs are read, before it starts: freeze what exists
    out of the cyclic GC's scans (tens of milliseconds a full collection otherwise), and
    let Arrow (pandas' strings, the streamed actions.parquet) allocate from the system
    allocator, which hands freed memory back: with Arrow's default pool (mimalloc) a
    240,893-action simulation peaked at 1,198 MB, with the system's at 1,000 MB."""
    gc.collect()
    gc.freeze()
    pa.set_memory_pool(pa.system_memory_pool())


class RunError(ValueError):
    """A directory that is not a readable run directory (the message names the file)."""


def load_run(run_dir: str | Path, name: str | None = None) -> Run:
    """Read a run directory written by `tangram simulate` or `tangram run`."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise RunError(f"{run_dir}: no summary.json (not a tangram run directory)")
    try:
        summary = json.loads(summary_path.read_text())
    except json.JSONDecodeError as e:
        raise RunError(f"{summary_path}: not valid JSON: {e}") from None

    def frame(file: str) -> pd.DataFrame | None:
        path = run_dir / file
        if not path.exists():
            return None
        try:
            return pd.read_parquet(path)
        except (OSError, ValueError) as e:
            raise RunError(f"{path}: cannot read: {e}") from None

    actions = frame("actions.parquet")
    if actions is None:
        raise RunError(f"{run_dir}: no actions.parquet (not a tangram run directory)")
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return Run(name or run_dir.resolve().name, summary, actions, frame("utilisation.parquet"),
               config, frame("timing.parquet"), run_dir)


def from_analysed(run: Analysed, config: Mapping[str, Any], name: str | None = None) -> Run:
    """The Run of a finished, analysed run (nothing written)."""
    return Run(name or str(run.summary.get("policy", "run")), run.summary, run.actions,
               run.utilisation, dict(config), run.timing)


def simulate(trace: pd.DataFrame | ValidTrace | str | Path, cluster: Any = None, policy: str = "tangram", *,
             name: str | None = None, seed: int = 0, steps: int = 1, train_s: float = 0.0,
             asynchronous: bool = False, out: str | Path | None = None,
             progress: Callable[[int, int], None] | None = None, source: str | None = None,
             extra_config: Mapping[str, Any] | None = None, perfetto: bool = False,
             fork: bool = False, **options: Any) -> Run:
    """Simulate ``trace`` on ``cluster`` under ``policy`` and return the Run. ``trace``: a
    frame or a trace file (checked here), or a :class:`~traces.schema.ValidTrace` (checked
    already); ``cluster``: a ClusterSpec, a built-in name or a YAML path (None: default);
    ``options``: policy parameters (depth, lookahead, ordering, pod_cores, gpu_dop).
    With ``out``, the run directory is written too (:func:`simulate_into`, what `tangram
    simulate` does), with trace.json when ``perfetto``; ``extra_config`` goes into
    config.json. ``fork``: the trace's GRPO groups prepare once and fork (sim/driver.py
    ``SimConfig.fork``). Raises ValueError on bad input."""
    if out is None:  # the records still go to a file as the run goes: memory stays flat
        with tempfile.TemporaryDirectory(prefix="tangram-sim-") as tmp:
            analysed, config = _streamed(Path(tmp), trace, cluster, policy, seed=seed,
                                         steps=steps, train_s=train_s,
                                         asynchronous=asynchronous, progress=progress,
                                         source=source, extra_config=extra_config, fork=fork,
                                         **options)
            analysed = replace(analysed, actions=read_actions(Path(tmp) / "actions.parquet"))
        return from_analysed(analysed, config, name)
    analysed, config = _into(Path(out), trace, cluster, policy, seed=seed, steps=steps,
                             train_s=train_s, asynchronous=asynchronous, progress=progress,
                             source=source, extra_config=extra_config, perfetto=perfetto,
                             fork=fork, **options)
    # (the whole frame, read once the directory is written: never held with the
    # simulation's state)
    analysed = replace(analysed, actions=read_actions(Path(out) / "actions.parquet"))
    return replace(from_analysed(analysed, config, name), path=Path(out))


def simulate_into(out: str | Path, trace: pd.DataFrame | ValidTrace | str | Path,
                  cluster: Any = None, policy: str = "tangram", *, seed: int = 0,
                  steps: int = 1, train_s: float = 0.0, asynchronous: bool = False,
                  progress: Callable[[int, int], None] | None = None,
                  source: str | None = None, extra_config: Mapping[str, Any] | None = None,
                  perfetto: bool = False, fork: bool = False, phases: Phases | None = None,
                  **options: Any) -> dict[str, Any]:
    """What `tangram simulate` does: simulate (as :func:`simulate`) and write the run
    directory ``out``; returns its summary. Nothing is read back: the actions stay in
    actions.parquet, where they were streamed as the run went (the command prints only
    the summary). ``phases``: laps
    of the CPU time (``run``, ``write``, ``summary``), written into summary.json's
    ``timing.cpu_s``. A failed simulation leaves no directory it created behind."""
    analysed, _ = _into(Path(out), trace, cluster, policy, seed=seed, steps=steps,
                        train_s=train_s, asynchronous=asynchronous, progress=progress,
                        source=source, extra_config=extra_config, perfetto=perfetto,
                        fork=fork, phases=phases, **options)
    return analysed.summary if phases is None else {
        **analysed.summary, "timing": {**analysed.summary["timing"], "cpu_s": phases.seconds}}


def _into(out: Path, trace: pd.DataFrame | ValidTrace | str | Path, cluster: Any,
          policy: str, *, perfetto: bool, phases: Phases | None = None,
          **kw: Any) -> tuple[Analysed, dict[str, Any]]:
    """:func:`simulate_into`'s run directory; the analysis (its ``actions``: the summary's
    columns) and config.json's content."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        analysed, config = _streamed(out, trace, cluster, policy, phases=phases, **kw)
    except BaseException:
        if created:
            out.rmdir()
        raise
    if perfetto:  # (one slice per action: the whole frame, only when asked)
        full = replace(analysed, actions=read_actions(out / "actions.parquet"))
        write_run(out, full, config, perfetto=True, actions=False, phases=phases)
    else:
        write_run(out, analysed, config, actions=False, phases=phases)
    return analysed, config


def _streamed(folder: Path, trace: pd.DataFrame | ValidTrace | str | Path, cluster: Any,
              policy: str, *, seed: int, steps: int, train_s: float, asynchronous: bool,
              progress: Callable[[int, int], None] | None, source: str | None,
              extra_config: Mapping[str, Any] | None, fork: bool,
              phases: Phases | None = None, **options: Any) -> tuple[Analysed, dict[str, Any]]:
    """Simulate with the records streamed to ``folder``/actions.parquet in row groups (no
    file is left if the simulation fails), and analyse the run from the file's columns
    (:func:`summary_frame`: the analysis's ``actions`` hold only those); and config.json's
    content."""
    from sim.cluster import load_cluster
    from sim.driver import SimConfig
    from sim.driver import simulate as run_sim
    from tangram.cluster import ClusterSpec
    from tangram.policies import make_policy
    from traces.schema import load, validate

    if isinstance(trace, str | Path):
        source = source or str(trace)
        trace = load(trace)
    elif isinstance(trace, ValidTrace):
        trace = trace.rows
    else:
        trace = validate(trace)
    spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
    chosen = make_policy(policy, options)
    cfg = SimConfig(policy=policy, seed=seed, steps=steps, train_s=train_s,
                    asynchronous=asynchronous, options=dict(options), fork=fork)
    config = {"trace": source or "<in memory>", "cluster": spec.to_yaml(),
              "policy": chosen.params(), **(extra_config or {}),
              "sim": {"seed": seed, "steps": steps, "train_s": train_s,
                      "asynchronous": asynchronous, **({"fork": True} if fork else {})}}
    writer = ActionsWriter(folder / "actions.parquet")
    try:
        result = run_sim(trace, spec, cfg, progress=progress, records=writer)
    except BaseException:
        writer.abort()
        raise
    if phases is not None:
        phases.lap("run")
    path = writer.close()
    if phases is not None:
        phases.lap("write")
    analysed = analyse(result, actions=summary_frame(path))
    if phases is not None:
        phases.lap("summary")
    return analysed, config


def _utilisation_columns(run: Run) -> dict[str, float]:
    out = {}
    for res, u in run.summary.get("utilisation", {}).items():
        for k in ("allocated", "busy"):
            if k in u:
                out[f"{res}_{k}"] = float(u[k])
    return out


def metrics(actions: pd.DataFrame) -> dict[str, float]:
    """The compared figures of one run's actions: ACT, queueing and execution (mean, p50,
    p99), makespan (from the first submission, or t=0, to the last end, as summary.json),
    mean units granted, and the number of actions."""
    out: dict[str, float] = {}
    for name, col, stat in STATS:
        s = actions[col] if len(actions) else pd.Series(dtype=float)
        out[name] = float("nan") if s.empty else float(
            s.mean() if stat == "mean" else s.quantile(0.5 if stat == "p50" else 0.99))
    n = len(actions)
    out["makespan_s"] = float(actions["end_s"].max() - min(actions["submit_s"].min(), 0.0)) \
        if n else float("nan")
    out["units_mean"] = float(actions["units"].mean()) if n else float("nan")
    out["actions"] = float(n)
    return out


def same_units(a: pd.DataFrame, b: pd.DataFrame) -> float:
    """Share of the actions both runs executed (matched by action id) that were granted
    the same number of units: did a simulation make the live run's decisions?"""
    joined = a[["action_id", "units"]].merge(b[["action_id", "units"]], on="action_id")
    return float((joined["units_x"] == joined["units_y"]).mean()) if len(joined) else float("nan")


def compare(runs: Sequence[Run], reference: int | str = 0) -> pd.DataFrame:
    """Runs side by side, one row per run (index: run name): policy, :func:`metrics` of its
    actions (the same code for simulated and live runs), ``failed`` (summary.json),
    ``same_units`` against the ``reference`` run (a position or a name), and the share of
    each resource allocated / busy (``cpu_allocated``, ``gpu_busy``, ...). These are the
    numbers `tangram compare` prints; :func:`change` turns them into per cent differences."""
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"runs: names must be unique to compare them, got {names}")
    if not runs:
        raise ValueError("runs: nothing to compare")
    ref = runs[reference] if isinstance(reference, int) else runs[names.index(reference)]
    rows = []
    for run in runs:
        row: dict[str, Any] = {"run": run.name, "policy": run.policy, **metrics(run.actions),
                               "failed": run.summary.get("failed"),
                               "same_units": same_units(ref.actions, run.actions)}
        row.update(_utilisation_columns(run))
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


def change(table: pd.DataFrame, baseline: str | int = 0) -> pd.DataFrame:
    """Per cent difference of every measured column of a :func:`compare` table against the
    ``baseline`` row (a run name, or a position); counts and shares (``actions``,
    ``failed``, ``same_units``) are left out: read them as they are."""
    ref = table.iloc[baseline] if isinstance(baseline, int) else table.loc[baseline]
    numeric = table.select_dtypes("number").drop(
        columns=["actions", "failed", "same_units"], errors="ignore")
    ref = ref[numeric.columns].astype(float)
    return (numeric.astype(float) - ref) / ref.where(ref != 0) * 100


def per_kind(runs: Sequence[Run]) -> pd.DataFrame:
    """Long frame: one row per (run, action kind) with count and mean ACT / queue / execution."""
    rows = []
    for run in runs:
        for kind, g in run.actions.groupby("kind"):
            rows.append({"run": run.name, "policy": run.policy, "kind": kind,
                         "count": len(g), "act_mean_s": g["act_s"].mean(),
                         "queue_mean_s": g["queue_s"].mean(), "exec_mean_s": g["exec_s"].mean(),
                         "units_mean": g["units"].mean()})
    return pd.DataFrame(rows, columns=["run", "policy", "kind", "count", "act_mean_s",
                                       "queue_mean_s", "exec_mean_s", "units_mean"])


def breakdown(runs: Sequence[Run], by: str | None = None) -> pd.DataFrame:
    """Where an action's time goes: mean seconds queued, restoring (GPU), executing,
    per run (and per ``by`` column, e.g. ``"kind"`` or ``"category"``)."""
    rows = []
    for run in runs:
        df = run.actions
        groups = df.groupby(by) if by else [(None, df)]
        for key, g in groups:
            row = {"run": run.name, "policy": run.policy,
                   "queue_s": g["queue_s"].mean(), "restore_s": g["restore_s"].mean(),
                   "execute_s": (g["exec_s"] - g["restore_s"]).mean()}
            if by:
                row[by] = key
            rows.append(row)
    return pd.DataFrame(rows)


def allocation(run: Run, resource: str = "cpu") -> pd.DataFrame:
    """``t_s`` and the share of ``resource`` allocated (0..1) over time (empty when the run
    did not sample it or has none of it)."""
    cap = run.capacity(resource)
    u = run.utilisation
    if u is None or not cap or resource not in u:
        return pd.DataFrame({"t_s": [], "allocated": []})
    return pd.DataFrame({"t_s": u["t_s"], "allocated": u[resource] / cap})


def with_trace(actions: pd.DataFrame, trace: pd.DataFrame,
               columns: Sequence[str] = ("service", "t1_s", "parallel_fraction", "think_s")
               ) -> pd.DataFrame:
    """``actions`` with the trace's ``columns`` beside each row (matched by action id,
    ``<trajectory>#<seq>``; a column the actions already have gets the suffix ``_trace``)."""
    ids = trace["trajectory"].astype(str) + "#" + trace["seq"].astype(int).astype(str)
    extra = trace[list(columns)].set_axis(ids.to_numpy()).rename(
        columns={c: f"{c}_trace" for c in columns if c in actions})
    return actions.join(extra, on="action_id")
