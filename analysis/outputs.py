"""Run outputs shared by `tangram simulate` and `tangram run`.

* ``summary.json``: headline metrics (ACT, queueing, execution, step time,
  utilisation per resource, per-kind and per-category breakdowns)
* ``actions.parquet``: one row per action (clock times only: two simulations with
  the same seed write identical files)
* ``timing.parquet``: per action, the scheduler's decision time (a simulation's by its
  thread's CPU clock, a live run's by wall clock; the ``timing`` block of summary.json sums
  it up — everything else is deterministic)
* ``trace.json`` (with ``--perfetto``): Chrome trace format (open in Perfetto /
  chrome://tracing)
* ``utilisation.parquet``: allocated units per resource over time
* ``config.json``: the resolved configuration of the run
* ``cluster.yaml``: the cluster it ran on, in the shape ``--cluster`` reads
* ``outputs.jsonl`` (live runs): each action's exit code and output tail
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from analysis.phases import Phases
from tangram.runtime import Record, RunResult

REWARD_KINDS = ("reward", "teacher")
SEARCH_KINDS = ("search", "fetch_page")


def category(kind: str) -> str:
    """Coarse time-breakdown bucket of an action kind (paper Fig. 7)."""
    if kind.startswith(REWARD_KINDS):
        return "reward"
    if kind in SEARCH_KINDS:
        return "search"
    return "env"


#: the columns of a Record, in order
RECORD_FIELDS = tuple(Record.__dataclass_fields__)


def records_frame(records: Iterable[Record]) -> pd.DataFrame:
    """actions.parquet's frame: the records' fields, then queue, execution, ACT, category."""
    # column by column: a Record's fields are plain values, so dataclasses.asdict's
    # recursive deep copy per row (a sixth of a large simulation's CPU) buys nothing
    rows = list(records)
    columns = zip(*map(attrgetter(*RECORD_FIELDS), rows), strict=True) if rows \
        else ([] for _ in RECORD_FIELDS)
    df = pd.DataFrame(dict(zip(RECORD_FIELDS, map(list, columns), strict=True)))
    df["queue_s"] = df["start_s"] - df["submit_s"]
    df["exec_s"] = df["end_s"] - df["start_s"]
    df["act_s"] = df["end_s"] - df["submit_s"]
    df["category"] = df["kind"].map(category)
    return df


#: actions.parquet's columns and Arrow types (records_frame's frame as pandas writes it): a
#: file written row group by row group needs its types before its first row
#: (``exit_code``: integers, null where an action had no process exit)
ACTIONS_SCHEMA = pa.schema([
    ("action_id", pa.large_string()), ("task", pa.large_string()),
    ("trajectory", pa.large_string()), ("kind", pa.large_string()),
    ("submit_s", pa.float64()), ("start_s", pa.float64()), ("end_s", pa.float64()),
    ("units", pa.int64()), ("node", pa.large_string()), ("cores", pa.large_string()),
    ("gpus", pa.large_string()), ("restore_s", pa.float64()), ("overhead_s", pa.float64()),
    ("status", pa.large_string()), ("exit_code", pa.int64()), ("expected_s", pa.float64()),
    ("lane", pa.bool_()), ("batch_of", pa.large_string()), ("resized", pa.large_string()),
    ("queue_s", pa.float64()),
    ("exec_s", pa.float64()), ("act_s", pa.float64()), ("category", pa.large_string())])

#: records per row group of a streamed actions.parquet: what a run holds in memory at most
ROW_GROUP = 65_536


class ActionsWriter:
    """``actions.parquet`` written while a run goes: a record sink (tangram/runtime.py
    ``RecordSink``) that keeps records only until a row group is full, so that a simulation's
    memory does not grow with its actions. Each row group is :func:`records_frame` of its
    records: the file holds what writing the whole frame at the end would."""

    def __init__(self, path: str | Path, rows: int = ROW_GROUP) -> None:
        if rows < 1:
            raise ValueError(f"rows: a row group holds at least 1 record, got {rows}")
        self.path = Path(path)
        self.rows = rows
        self._buffer: list[Record] = []
        self._written = 0
        #: opened with the first row group's schema, whose pandas metadata (column dtypes)
        #: is what writing the whole frame would record
        self._writer: pq.ParquetWriter | None = None

    def append(self, record: Record) -> None:
        self._buffer.append(record)
        if len(self._buffer) >= self.rows:
            self._flush()

    def __len__(self) -> int:
        return self._written + len(self._buffer)

    def _flush(self) -> None:
        if not self._buffer:
            return
        table = pa.Table.from_pandas(records_frame(self._buffer), schema=ACTIONS_SCHEMA,
                                     preserve_index=False)
        self._open(table.schema).write_table(table)
        self._written += len(self._buffer)
        self._buffer = []

    def _open(self, schema: pa.Schema) -> pq.ParquetWriter:
        if self._writer is None:  # as DataFrame.to_parquet writes (snappy)
            self._writer = pq.ParquetWriter(self.path, schema, compression="snappy")
        return self._writer

    def close(self) -> Path:
        """Write what is buffered and the file's footer; the file is complete."""
        self._flush()
        self._open(ACTIONS_SCHEMA).close()
        return self.path

    def abort(self) -> None:
        """Close without the buffered records and remove the file (a run that failed)."""
        self._buffer = []
        if self._writer is not None:
            self._writer.close()
        self.path.unlink(missing_ok=True)


def _leases(df: pd.DataFrame) -> pd.DataFrame:
    """One row per lease, in the order of each lease's first record: a batch's records (same
    ``batch_of``) become one row with its units, its span and its restore (paid once), and
    ``first``: the position of its first record. Grouped by that position rather than by
    the lease's name (the action id of an action run alone): grouping 2 M action-id strings
    took more memory than the rest of a large run's summary."""
    if df.empty:
        return pd.DataFrame(columns=["first", "units", "start_s", "end_s", "restore_s", "gpu",
                                     "cpu", "ok", "actions"])
    codes, _ = pd.factorize(df["batch_of"])  # (-1: none, as an empty one)
    batch = (codes >= 0) & (df["batch_of"] != "").to_numpy()
    rows = np.arange(len(df))
    first_of_code = np.full(codes.max() + 1 if len(codes) else 0, len(df), dtype=np.int64)
    np.minimum.at(first_of_code, codes[batch], rows[batch])
    first = np.where(batch, first_of_code[codes], rows)
    used = pd.DataFrame({"first": first, "units": df["units"].to_numpy(),
                         "start_s": df["start_s"].to_numpy(), "end_s": df["end_s"].to_numpy(),
                         "restore_s": df["restore_s"].to_numpy(),
                         "gpu": (df["gpus"] != "").to_numpy(), "cpu": (df["cores"] != "").to_numpy(),
                         "ok": (df["status"] == "ok").to_numpy()})
    if not batch.any():  # every record its own lease: the rows as they are (what the
        # grouping below gives, without its cost: most of a small run's summary)
        used["first"] = used["first"].astype(np.int64)
        used["actions"] = np.ones(len(used), dtype=np.int64)
        return used
    g = used.groupby("first", sort=False)
    return g.agg(units=("units", "first"), start_s=("start_s", "min"), end_s=("end_s", "max"),
                 restore_s=("restore_s", "first"), gpu=("gpu", "first"), cpu=("cpu", "first"),
                 ok=("ok", "all"), actions=("units", "size")).reset_index()


def dispatches_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per lease: a batch's records (same ``batch_of``) become one row with its
    units, its span and its restore (paid once); ``lease``: the batch's id, or the action's
    of an action run alone."""
    columns = ["lease", "units", "start_s", "end_s", "restore_s", "gpu", "cpu", "ok", "actions"]
    out = _leases(df)
    if out.empty:
        return pd.DataFrame(columns=columns)
    first = out["first"].to_numpy()
    batch_of = df["batch_of"].to_numpy()[first]
    out["lease"] = np.where(batch_of != "", batch_of, df["action_id"].to_numpy()[first])
    return out[columns]


def gpu_summary(df: pd.DataFrame, gpu_capacity: float, makespan: float,
                restore_s_total: float | None, restores: int | None,
                leases: pd.DataFrame | None = None) -> dict[str, Any]:
    """``restores`` (count, pre-restores included), ``restore_overhead`` (restore seconds /
    execution seconds without restores, both on the GPUs) and ``gpu_busy`` (fraction of
    GPU-seconds executing, restores excluded). Counted per lease: a batch restores once.
    ``leases``: ``df``'s, when the caller has them (:func:`analyse`)."""
    d = _leases(df) if leases is None else leases
    d = d[d["gpu"]] if len(d) else d
    exec_s = float((d["end_s"] - d["start_s"] - d["restore_s"]).clip(lower=0).sum()) if len(d) else 0.0
    if restore_s_total is None:  # no manager counts (e.g. a live run): the leases' restores
        restore_s_total = float(d["restore_s"].sum()) if len(d) else 0.0
    if restores is None:
        restores = int((d["restore_s"] > 0).sum()) if len(d) else 0
    busy = float((d["units"] * (d["end_s"] - d["start_s"] - d["restore_s"]).clip(lower=0))
                 .sum()) if len(d) else 0.0
    return {
        "restores": int(restores),
        "restore_overhead": restore_s_total / exec_s if exec_s else 0.0,
        "restore_s": restore_s_total,
        "gpu_busy": busy / (gpu_capacity * makespan) if gpu_capacity and makespan else 0.0,
        "gpu_batches": int(len(d)),
        "gpu_batch_mean": float(d["actions"].mean()) if len(d) else 0.0,
    }


def _stats(s: pd.Series) -> dict[str, float]:
    if s.empty:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    return {"mean": float(s.mean()), "p50": float(s.quantile(0.5)), "p99": float(s.quantile(0.99))}


def failed_mask(df: pd.DataFrame) -> pd.Series:
    """Actions that did not succeed: a status other than ok, or a non-zero exit."""
    code = pd.to_numeric(df["exit_code"], errors="coerce")
    return (df["status"] != "ok") | (code.notna() & (code != 0))


def exit_codes(df: pd.DataFrame) -> dict[str, int]:
    """How many actions ended with each exit code ("none": no process exit, e.g. a
    timeout or an action that never started)."""
    if not len(df):
        return {}
    code = pd.to_numeric(df["exit_code"], errors="coerce")
    counts = code.value_counts(dropna=False)  # per distinct code, not a call per action
    keys = ["none" if pd.isna(c) else str(int(c)) for c in counts.index]
    return dict(sorted(zip(keys, map(int, counts.to_numpy()), strict=True)))


def summarise(df: pd.DataFrame, *, policy: str, capacity: Mapping[str, float],
              utilisation: pd.DataFrame | None, steps: list[dict[str, float]],
              extra: Mapping[str, Any] | None = None,
              leases: pd.DataFrame | None = None) -> dict[str, Any]:
    """``leases``: ``df``'s, when the caller has them (:func:`analyse`)."""
    act, queue, exe = _stats(df["act_s"]), _stats(df["queue_s"]), _stats(df["exec_s"])
    makespan = float(df["end_s"].max() - min(df["submit_s"].min(), 0.0)) if len(df) else 0.0
    out: dict[str, Any] = {
        "policy": policy,
        "actions": int(len(df)),
        "trajectories": int(df["trajectory"].nunique()) if len(df) else 0,
        "act_mean_s": act["mean"], "act_p50_s": act["p50"], "act_p99_s": act["p99"],
        "queue_mean_s": queue["mean"], "queue_p99_s": queue["p99"],
        "exec_mean_s": exe["mean"],
        "restore_mean_s": float(df["restore_s"].mean()) if len(df) else 0.0,
        "overhead_mean_s": float(df["overhead_s"].mean()) if len(df) else 0.0,
        "failed": int(failed_mask(df).sum()) if len(df) else 0,
        "exit_codes": exit_codes(df),
        "timeouts": int((df["status"] == "timeout").sum()) if len(df) else 0,
        "makespan_s": makespan,
        "step_time_s": float(np.mean([s["step_s"] for s in steps])) if steps else makespan,
        "rollout_s": float(np.mean([s["rollout_s"] for s in steps])) if steps else makespan,
        "steps": steps,
    }
    util: dict[str, dict[str, float]] = {}
    if leases is None:
        leases = _leases(df)
    busy_units = (leases["units"] * (leases["end_s"] - leases["start_s"] - leases["restore_s"])
                  ).where(leases["ok"], 0)
    for res, cap in capacity.items():
        if not cap or math.isinf(cap):
            continue
        entry: dict[str, float] = {"capacity": float(cap)}
        if utilisation is not None and res in utilisation and len(utilisation) > 1:
            t = utilisation["t_s"].to_numpy()
            u = utilisation[res].to_numpy()
            span = t[-1] - t[0]
            entry["allocated"] = float(np.sum(u[:-1] * np.diff(t)) / (cap * span)) if span else 0.0
        if res in ("cpu", "gpu") and makespan:
            entry["busy"] = float(busy_units[leases[res].astype(bool)].sum() / (cap * makespan))
        util[res] = entry
    out["utilisation"] = util
    out["per_kind"] = {
        kind: {"count": int(len(g)), "act_mean_s": float(g["act_s"].mean()),
               "queue_mean_s": float(g["queue_s"].mean()), "exec_mean_s": float(g["exec_s"].mean()),
               "units_mean": float(g["units"].mean())}
        for kind, g in df.groupby("kind", observed=True)
    }
    out["per_category"] = {
        cat: {"count": int(len(g)), "act_mean_s": float(g["act_s"].mean()),
              "act_sum_s": float(g["act_s"].sum()),
              "per_trajectory_s": float(
                  g.groupby("trajectory", observed=True)["act_s"].sum().mean())}
        for cat, g in df.groupby("category", observed=True)
    }
    if extra:
        out.update(extra)
    return out


#: the columns of actions.parquet that :func:`summarise` and :func:`gpu_summary` read
SUMMARY_COLUMNS = ("trajectory", "kind", "category", "status", "exit_code", "submit_s",
                   "start_s", "end_s", "units", "restore_s", "overhead_s", "queue_s", "exec_s",
                   "act_s", "batch_of", "gpus", "cores")


def summary_frame(path: str | Path) -> pd.DataFrame:
    """What the summary reads of an actions.parquet: its columns but the action ids, the
    strings as categoricals (sorted, so that grouping by them orders as by the strings).
    A fraction of the whole frame's memory: 2 M action ids as Python strings, and a
    light-lane record's 256 core ids repeated per row, are most of that."""
    text = [c for c in SUMMARY_COLUMNS if pa.types.is_large_string(ACTIONS_SCHEMA.field(c).type)]
    table = pq.read_table(path, columns=list(SUMMARY_COLUMNS), read_dictionary=text)
    df = table.to_pandas()
    del table
    for c in text:
        df[c] = df[c].cat.reorder_categories(sorted(df[c].cat.categories))
    return df


def read_actions(path: str | Path) -> pd.DataFrame:
    """actions.parquet as ``pd.read_parquet`` reads it, converted a row group at a time: the
    whole file as an Arrow table beside its frame was a large run's peak (a light-lane
    record's 256 core ids are a kilobyte of text per row there, one shared string here)."""
    file = pq.ParquetFile(path)
    if file.num_row_groups <= 1:
        return pd.read_parquet(path)
    parts = [file.read_row_group(i).to_pandas() for i in range(file.num_row_groups)]
    return pd.concat(parts, ignore_index=True)


@dataclass(slots=True)
class Analysed:
    """A run turned into frames: what write_run writes and notebooks read."""

    summary: dict[str, Any]
    actions: pd.DataFrame
    utilisation: pd.DataFrame | None
    timing: pd.DataFrame


def analyse(result: RunResult, extra: Mapping[str, Any] | None = None,
            actions: pd.DataFrame | None = None) -> Analysed:
    """Summary and frames of a finished run; wall-clock figures only in ``timing``.
    ``actions``: the run's actions frame when its records were streamed to a file
    (:class:`ActionsWriter`; :func:`summary_frame` reads what the summary needs), else
    None: the frame of ``result.records``."""
    if actions is None and result.streamed:
        raise ValueError(f"analyse: the run's {result.streamed} records were streamed to a "
                         "file, not kept: pass the frame read from it as ``actions``")
    frame = records_frame(result.records) if actions is None else actions
    util = pd.DataFrame(result.utilisation) if result.utilisation is not None else None
    leases = _leases(frame)  # (once: both summaries count per lease)
    summary = summarise(frame, policy=result.policy, capacity=result.capacity,
                        utilisation=util, steps=result.steps,
                        extra={**result.counters, **(extra or {})}, leases=leases)
    gpu = result.snapshot.counters if result.snapshot is not None else None
    summary.update(gpu_summary(frame, result.capacity.get("gpu", 0.0), summary["makespan_s"],
                               gpu["gpu_restore_s_total"] if gpu else None,
                               gpu["gpu_restores"] if gpu else None, leases=leases))
    t = result.timing
    decisions = pd.DataFrame({"action_id": list(t.decision_s),
                              "decision_us": [v * 1e6 for v in t.decision_s.values()]})
    summary["timing"] = {
        "wall_s": result.wall_s,
        "core_s": t.core_s,
        "decision_mean_us": float(decisions["decision_us"].mean()) if len(decisions) else 0.0,
        "dispatching_call_mean_us": t.dispatching_s / t.dispatching_calls * 1e6
        if t.dispatching_calls else 0.0,
    }
    return Analysed(summary, frame, util, decisions)


def chrome_trace(df: pd.DataFrame) -> dict[str, Any]:
    """Execution slices: one process per node (or 'api'), one thread per first unit."""
    events: list[dict[str, Any]] = []
    lanes: dict[str, list[float]] = {}
    for r in df.sort_values("start_s").itertuples(index=False):
        pid = r.node or "api"
        if r.cores:
            tid = f"core {str(r.cores).split(',')[0]}"
        elif r.gpus:
            tid = f"gpu {str(r.gpus).split(',')[0]}"
        else:  # first free lane
            ends = lanes.setdefault(pid, [])
            lane = next((i for i, e in enumerate(ends) if e <= r.start_s), len(ends))
            if lane == len(ends):
                ends.append(r.end_s)
            else:
                ends[lane] = r.end_s
            tid = f"lane {lane}"
        events.append({
            "name": r.kind, "cat": r.category, "ph": "X", "pid": pid, "tid": tid,
            "ts": round(r.start_s * 1e6, 1), "dur": round(max(r.end_s - r.start_s, 0) * 1e6, 1),
            "args": {"action": r.action_id, "trajectory": r.trajectory, "units": int(r.units),
                     "queue_s": round(r.queue_s, 6), "restore_s": round(r.restore_s, 6),
                     "status": r.status},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_run(out: str | Path, run: Analysed, config: Mapping[str, Any],
              perfetto: bool = False, actions: bool = True, phases: Phases | None = None) -> Path:
    """The run directory; ``trace.json`` (Chrome/Perfetto, one slice per action: large and
    a sixth of a big simulation's CPU) only with ``perfetto``; ``actions=False``: leave
    ``actions.parquet`` as it is (streamed there while the run went). summary.json is
    written last (a directory that has one is whole); with ``phases``, the CPU seconds of
    each phase of the command go into its ``timing.cpu_s``, this writing's as ``write``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    if isinstance(config.get("cluster"), Mapping):
        # `tangram simulate --cluster RUN/cluster.yaml` runs on exactly this cluster
        (out / "cluster.yaml").write_text(
            "# the cluster this run used (tangram simulate --cluster accepts it as is)\n"
            + yaml.safe_dump(json.loads(json.dumps(config["cluster"], default=str)),
                             sort_keys=False))
    if actions:
        run.actions.to_parquet(out / "actions.parquet", index=False)
    run.timing.to_parquet(out / "timing.parquet", index=False)
    if run.utilisation is not None:
        run.utilisation.to_parquet(out / "utilisation.parquet", index=False)
    if perfetto:
        with (out / "trace.json").open("w") as f:
            json.dump(chrome_trace(run.actions), f, separators=(",", ":"))
    summary = run.summary
    if phases is not None:
        phases.lap("write")
        summary = {**summary, "timing": {**summary.get("timing", {}),
                                         "cpu_s": dict(phases.seconds)}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    return out
