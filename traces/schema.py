"""The trace format: one row per action, closed loop (schema_version 1).

A trajectory is its rows in ``seq`` order: think (LLM generation) for
``think_s``, submit the action, wait for it, think again, ... Units are in the
column names. Feasible sets are strings: ``"4"`` (fixed), ``"1-32"`` (range),
``"1,2,4,8"`` (discrete), ``""`` (not needed).

Files carry a header with the schema version: Parquet as key-value metadata
``tangram.schema_version``; CSV as a first line ``# tangram-trace
schema_version=1``; JSONL as a first object ``{"tangram_trace": true,
"schema_version": 1}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from tangram.model import Action, Demand, Elasticity, quota_resource
from tangram.units import parse_units

SCHEMA_VERSION = 1
#: the largest ``image_gb`` taken (GB): 10 TB, past any disk a node caches images on. A
#: size in MB or bytes by mistake reads as thousands of GB or more, and a simulation of
#: pulls that long runs (and samples) for simulated months
MAX_IMAGE_GB = 10_000.0

#: column -> (kind, required, default, meaning)
COLUMNS: dict[str, tuple[str, bool, Any, str]] = {
    "task": ("str", True, None, "RL job the trajectory belongs to"),
    "trajectory": ("str", True, None, "rollout id, unique across the trace"),
    "seq": ("int", True, None, "order of the action within its trajectory (0, 1, ...)"),
    "kind": ("str", True, None, "shell, file_edit, test_run, search, fetch_page, reward_judge, ..."),
    "think_s": ("float", True, None, "LLM generation before this action (s)"),
    "t1_s": ("float", True, None, "execution time on one unit of the key resource (s)"),
    "cpu_cores": ("set", False, "", "feasible core counts ('' for none)"),
    "mem_gb": ("float", False, 0.0, "memory of the trajectory's environment (GB)"),
    "gpus": ("set", False, "", "feasible GPU counts, powers of two ('' for none)"),
    "elastic": ("str", False, "", "key elastic resource: '', 'cpu' or 'gpu'"),
    "parallel_fraction": ("float", False, math.nan, "Amdahl parallel fraction of E(m) (NaN: none)"),
    "unit_overhead_s": ("float", False, 0.0, "extra time per unit beyond the first (worker "
                        "start-up: -n 2 can be slower than -n 1) (s)"),
    "profiled": ("bool", False, False, "whether the scheduler is told t1_s and E(m) in advance"),
    "declared_t1_s": ("float", False, math.nan, "profiled rows: the t1_s the profile declares "
                      "(NaN: t1_s itself, an exact profile)"),
    "declared_parallel_fraction": ("float", False, math.nan, "profiled rows: the parallel "
                                   "fraction the profile declares (NaN: parallel_fraction)"),
    "service": ("str", False, "", "GPU service (model) the action calls"),
    "quota_key": ("str", False, "", "API quota the action consumes ('' for none)"),
    "quota_units": ("float", False, 1.0, "units of quota_key per call"),
    "setup_s": ("float", False, 0.0, "fixed setup time paid before the action runs (s)"),
    "timeout_s": ("float", False, 0.0, "kill after this long (0: no timeout) (s)"),
    "command": ("str", False, "", "command line for live replay (tangram run)"),
    "group": ("str", False, "", "GRPO group: rollouts of one prompt, whose sandboxes start "
              "from the same prepared state ('' for none; traces/groups.py)"),
    "image": ("str", False, "", "the container image the trajectory's environment starts "
              "from ('' for the node's default image, always present)"),
    "image_gb": ("float", False, 0.0, "bytes a node pulls and stores for ``image`` when it "
                 "holds none of it (GB; 0 with no image)"),
}


class TraceError(ValueError):
    """A trace is malformed; ``problems`` lists every problem found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:50]
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        super().__init__(f"invalid trace ({len(problems)} problem(s)):\n  " + "\n  ".join(shown) + more)


def parse_set(spec: Any, field: str = "units") -> Demand | None:
    """``"4"``, ``"1-32"``, ``"1,2,4,8"`` or ``""`` -> Demand (None for empty): a cell of a
    set column, through tangram.units' bounded parser (whole counts, checked before any
    expansion). No cache here: a reader memoises a column's distinct texts itself
    (:class:`TraceColumns`), so nothing outlives the trace it came from."""
    if spec is None or (isinstance(spec, float) and math.isnan(spec)):
        return None
    if isinstance(spec, np.generic):
        spec = spec.item()
    if isinstance(spec, float) and spec.is_integer():
        spec = int(spec)
    if isinstance(spec, str) and not spec.strip():
        return None
    return parse_units(spec, field)


def format_set(demand: Demand | None) -> str:
    if demand is None:
        return ""
    ch = demand.choices
    if len(ch) > 2 and list(ch) == list(range(int(ch[0]), int(ch[-1]) + 1)):
        return f"{int(ch[0])}-{int(ch[-1])}"
    return ",".join(str(int(c)) if c == int(c) else str(c) for c in ch)


# -- reading / writing ---------------------------------------------------------------------
def _fmt(path: Path) -> str:
    suffix = "".join(path.suffixes[-1:]).lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix == ".csv":
        return "csv"
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    raise TraceError([f"{path}: unknown trace format {suffix!r} (use .parquet, .csv or .jsonl)"])


def read_raw(path: str | Path) -> tuple[pd.DataFrame, int | None]:
    """The rows and the declared schema version, with no validation."""
    path = Path(path)
    if not path.exists():
        raise TraceError([f"{path}: no such file"])
    fmt = _fmt(path)
    try:
        if fmt == "parquet":
            table = pq.read_table(path)
            meta = table.schema.metadata or {}
            raw = meta.get(b"tangram.schema_version")
            return table.to_pandas(), int(raw) if raw is not None else None
        if fmt == "csv":
            with path.open() as f:
                first = f.readline()
            version = None
            skip = 0
            if first.startswith("#"):
                skip = 1
                for token in first[1:].split():
                    if token.startswith("schema_version="):
                        version = int(token.split("=", 1)[1])
            df = pd.read_csv(path, skiprows=skip, dtype=str, keep_default_na=False)
            return df, version
        rows = []
        version = None
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    if not line.endswith("\n"):
                        break  # a torn last line (a recording cut off: torn_tail says so)
                    raise TraceError([f"{path}: line {lineno}: not JSON ({e.msg})"]) from None
                if lineno == 1 and isinstance(obj, dict) and obj.get("tangram_trace"):
                    version = obj.get("schema_version")
                    continue
                rows.append(obj)
        return pd.DataFrame(rows), version
    except TraceError:
        raise
    except Exception as e:  # a corrupt file: say which and why, no traceback
        raise TraceError([f"{path}: cannot read as {fmt}: {e}"]) from None


def torn_tail(path: str | Path) -> str:
    """Why a JSONL trace's last line was skipped ("" when it was not): a line with no end
    that is no JSON object is a row a recording (`--record`) was writing when its run
    died; every line before it is whole (each is written and flushed with its end)."""
    path = Path(path)
    if _fmt(path) != "jsonl" or not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(size - 65536, 0))
        tail = f.read()
    if not tail or tail.endswith(b"\n"):
        return ""
    last = tail.rsplit(b"\n", 1)[-1]
    try:
        json.loads(last)
    except ValueError:
        return (f"{path}: its last line ({len(last)} bytes) has no end and is not JSON: a row "
                "cut off when the run writing it stopped; skipped")
    return ""


def write(df: pd.DataFrame, path: str | Path) -> Path:
    """Write rows with the schema header, format from the extension."""
    path = Path(path)
    fmt = _fmt(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df = df[list(COLUMNS)]
    if fmt == "parquet":
        table = pa.Table.from_pandas(df, preserve_index=False)
        meta = dict(table.schema.metadata or {})
        meta[b"tangram.schema_version"] = str(SCHEMA_VERSION).encode()
        pq.write_table(table.replace_schema_metadata(meta), path, compression="zstd")
    elif fmt == "csv":
        with path.open("w") as f:
            f.write(f"# tangram-trace schema_version={SCHEMA_VERSION}\n")
            df.to_csv(f, index=False)
    else:
        with path.open("w") as f:
            f.write(json.dumps({"tangram_trace": True, "schema_version": SCHEMA_VERSION}) + "\n")
            for rec in df.to_dict(orient="records"):
                f.write(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v)
                                    for k, v in rec.items()}) + "\n")
    return path


def _show(value: Any) -> str:
    """A cell as the user wrote it (numpy scalars as plain numbers)."""
    if isinstance(value, np.generic):
        value = value.item()
    return repr(value)


# -- validation ----------------------------------------------------------------------------
def _coerce(df: pd.DataFrame, problems: list[str]) -> pd.DataFrame:
    out = pd.DataFrame(index=df.index)
    for col, (kind, required, default, _) in COLUMNS.items():
        if col not in df.columns:
            if required:
                problems.append(f"column {col!r}: missing (required)")
                continue
            out[col] = default
            continue
        series = df[col]
        if kind in ("float", "int"):
            blank = series.isna() | series.astype(str).str.strip().isin(["", "None", "nan", "NaN"])
            num = pd.to_numeric(series.where(~blank, np.nan), errors="coerce")
            bad = num.isna() & ~blank
            for row in series.index[bad][:20]:
                problems.append(f"row {row + 1}, column {col!r}, value {_show(series[row])}: "
                                f"not a number")
            if required or kind == "int":
                for row in series.index[blank][:20]:
                    problems.append(f"row {row + 1}, column {col!r}: empty")
            else:
                num = num.where(~blank, default)
            if kind == "int":
                frac = num.notna() & (num != num.round())
                for row in series.index[frac][:20]:
                    problems.append(f"row {row + 1}, column {col!r}, value {_show(series[row])}: "
                                    "not an integer")
            out[col] = num
        elif kind == "bool":
            text = series.fillna("").astype(str).str.strip().str.lower()
            ok = text.isin(["true", "false", "1", "0", "", "1.0", "0.0"])
            for row in series.index[~ok][:20]:
                problems.append(f"row {row + 1}, column {col!r}, value {_show(series[row])}: "
                                "not a boolean")
            out[col] = text.isin(["true", "1", "1.0"])
        else:
            out[col] = series.fillna("").astype(str).str.strip()
            if col in ("cpu_cores", "gpus"):
                out[col] = out[col].str.replace(r"\.0\b", "", regex=True)
    return out


def validate(df: pd.DataFrame, version: int | None = SCHEMA_VERSION) -> pd.DataFrame:
    """Typed, checked rows sorted by trajectory and seq; TraceError lists every problem."""
    problems: list[str] = []
    if version is not None and version != SCHEMA_VERSION:
        problems.append(f"schema_version: {version} is not supported (expected {SCHEMA_VERSION})")
    if df.empty:
        raise TraceError(problems + ["trace: has no rows"])
    df = df.reset_index(drop=True)
    out = _coerce(df, problems)
    if any(p.startswith("column") for p in problems):
        raise TraceError(problems)

    def bad(mask: pd.Series, col: str, why: str) -> None:
        for row in out.index[mask.fillna(False).astype(bool)][:20]:
            problems.append(f"row {row + 1}, column {col!r}, value {_show(df[col][row])}: {why}")

    for col in ("task", "trajectory", "kind"):
        bad(out[col] == "", col, "empty")
    for col in ("think_s", "t1_s", "mem_gb", "setup_s", "timeout_s", "quota_units",
                "unit_overhead_s", "image_gb"):
        bad(out[col] < 0, col, "negative")
    # an infinite time or amount is never meant (0 is "none" where a column has one): an
    # infinite think ended its trajectory in a "deadlock" error, an infinite t1_s ran until
    # the action's timeout
    for col in ("think_s", "t1_s", "mem_gb", "setup_s", "timeout_s", "quota_units",
                "unit_overhead_s"):
        bad(np.isinf(out[col]), col, "not finite")
    bad(out["seq"] < 0, "seq", "negative")
    pf = out["parallel_fraction"]
    bad(pf.notna() & ((pf < 0) | (pf > 1)), "parallel_fraction", "must be in [0, 1]")
    bad(~out["elastic"].isin(["", "cpu", "gpu"]), "elastic", "must be '', 'cpu' or 'gpu'")
    for col in ("cpu_cores", "gpus"):
        # each distinct text is parsed once (a trace repeats a handful over millions of rows)
        for spec in out[col].unique():
            try:
                d = parse_set(spec, col)
            except ValueError as e:
                bad(out[col] == spec, col, str(e).removeprefix(f"{col}: "))
                continue
            if d is not None and col == "gpus" and any(c not in (1, 2, 4, 8) for c in d.choices):
                bad(out[col] == spec, col, "GPU counts must be 1, 2, 4 or 8")
    bad((out["elastic"] == "cpu") & (out["cpu_cores"] == ""), "elastic",
        "elastic on cpu but cpu_cores is empty")
    bad((out["elastic"] == "gpu") & (out["gpus"] == ""), "elastic",
        "elastic on gpu but gpus is empty")
    bad((out["gpus"] != "") & (out["service"] == ""), "service", "a GPU action must name a service")
    bad((out["elastic"] != "") & out["parallel_fraction"].isna(), "parallel_fraction",
        "an elastic action needs its parallel fraction")
    dup = out.duplicated(["trajectory", "seq"], keep="first")
    bad(dup, "seq", "duplicated within its trajectory")
    tasks = out.groupby("trajectory")["task"].nunique()
    for traj in tasks.index[tasks > 1][:20]:
        problems.append(f"trajectory {traj!r}: rows name more than one task")
    groups = out.groupby("trajectory")["group"].nunique()
    for traj in groups.index[groups > 1][:20]:
        problems.append(f"trajectory {traj!r}: rows name more than one group")
    bad(~np.isfinite(out["image_gb"]), "image_gb", "not a finite size (GB)")
    bad(np.isfinite(out["image_gb"]) & (out["image_gb"] > MAX_IMAGE_GB), "image_gb",
        f"more than {MAX_IMAGE_GB:,.0f} GB (sizes are GB, not MB or bytes)")
    bad((out["image"] == "") & (out["image_gb"] > 0), "image_gb",
        "a size needs an image (the image column is empty)")
    if (out["image"] != "").any():  # (a trace without images pays none of this)
        images = out.groupby("trajectory")["image"].nunique()
        for traj in images.index[images > 1][:20]:
            problems.append(f"trajectory {traj!r}: rows name more than one image")
        named = out[out["image"] != ""]
        sizes = named.groupby("image")["image_gb"].nunique()
        for image in sizes.index[sizes > 1][:20]:
            problems.append(f"image {image!r}: rows declare more than one image_gb")
    grouped = out[out["group"] != ""]
    group_tasks = grouped.groupby("group")["task"].nunique()
    for g in group_tasks.index[group_tasks > 1][:20]:
        problems.append(f"group {g!r}: its trajectories name more than one task")
    if problems:
        raise TraceError(problems)
    out["seq"] = out["seq"].astype(int)
    return out.sort_values(["trajectory", "seq"], kind="stable").reset_index(drop=True)


@dataclass(frozen=True)
class ValidTrace:
    """Rows that :func:`validate` returned, or that a transform keeping them valid made of
    them (traces/select.py's: whole trajectories, non-negative scales): what a simulation
    takes without checking them again (a check is seconds at a million rows)."""

    rows: pd.DataFrame


def load(path: str | Path) -> pd.DataFrame:
    df, version = read_raw(path)
    try:
        return validate(df, version)
    except TraceError as e:
        raise TraceError([f"{path}: {p}" for p in e.problems]) from None


# -- to actions ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Truth:
    """What an action really costs: drives the simulator's modelled execution only
    (keyed by action id), never a scheduling decision."""

    t1_s: float
    parallel_fraction: float | None = None
    setup_s: float = 0.0
    #: extra seconds per unit beyond the first (worker start-up): dur(m) grows with m
    #: once this outweighs the parallel gain, which Amdahl alone cannot express
    unit_overhead_s: float = 0.0

    def duration(self, units: int) -> float:
        """True execution time on ``units`` of the key resource."""
        if units <= 1:
            return self.t1_s
        p = self.parallel_fraction or 0.0
        return self.t1_s * ((1.0 - p) + p / units) + self.unit_overhead_s * (units - 1)


@dataclass(frozen=True, slots=True)
class Step:
    """One action of a trajectory as a driver replays it."""

    think_s: float
    action: Action
    truth: Truth | None = None


class Steps(Sequence[Step]):
    """A trajectory's steps, each built from the trace's columns when it is asked for and
    held by whoever asked (the player, while its action runs): a trace of 65,536
    trajectories is about 2 M actions, and its Action, cost, payload and Truth objects held
    all at once took ~1 KB each (~2 GB), while a simulation needs about one per running
    trajectory. Indexing and slicing behave as a tuple's; each access builds anew."""

    __slots__ = ("_columns", "_start", "_stop", "_prefix")

    def __init__(self, columns: TraceColumns, start: int, stop: int, prefix: str) -> None:
        self._columns, self._start, self._stop, self._prefix = columns, start, stop, prefix

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> Step: ...

    @overload
    def __getitem__(self, index: slice) -> Steps: ...

    def __getitem__(self, index: int | slice) -> Step | Steps:
        rows = range(self._start, self._stop)[index]
        if isinstance(rows, range):
            if rows.step != 1:
                raise ValueError("Steps: a slice of steps is contiguous (step 1)")
            return Steps(self._columns, rows.start, max(rows.start, rows.stop), self._prefix)
        return self._columns.step(rows, self._prefix)

    def __iter__(self) -> Iterator[Step]:
        step, prefix = self._columns.step, self._prefix
        for row in range(self._start, self._stop):
            yield step(row, prefix)

    def __repr__(self) -> str:
        return f"Steps({len(self)} rows from {self._start}, prefix={self._prefix!r})"


def _shared(column: pd.Series) -> np.ndarray:
    """A text column as an array of one string object per distinct value: ``to_numpy`` of an
    Arrow-backed column makes a string object per row (~270 bytes a row over a trace's
    text columns; a handful of distinct values repeated over millions of rows)."""
    codes, uniques = pd.factorize(column, use_na_sentinel=False)
    return np.asarray(uniques, dtype=object)[codes]


def _parsed(column: pd.Series, name: str) -> np.ndarray:
    """A set column as an array of one Demand (or None) per row, each distinct text parsed once."""
    codes, uniques = pd.factorize(column, use_na_sentinel=False)
    parsed = np.empty(len(uniques), dtype=object)
    for k, text in enumerate(uniques):
        parsed[k] = parse_set(text, name)
    return parsed[codes]


class TraceColumns:
    """A validated trace's columns as arrays (no objects per row beyond the frame's own
    cells): what :class:`Steps` builds a step from."""

    __slots__ = ("cols", "sets")

    def __init__(self, df: pd.DataFrame) -> None:
        self.cols = {c: _shared(df[c]) if kind in ("str", "set") else df[c].to_numpy()
                     for c, (kind, *_) in COLUMNS.items()}
        #: the set columns parsed, one Demand per distinct text shared by its rows: parsed
        #: once here rather than per step, and dropped with the trace (no global cache)
        self.sets = {c: _parsed(df[c], c) for c, (kind, *_) in COLUMNS.items() if kind == "set"}

    def __len__(self) -> int:
        return len(self.cols["trajectory"])

    def step(self, i: int, prefix: str = "") -> Step:
        """Row ``i`` as the step a driver replays.

        No oracle: the scheduler is told ``t1_s`` and E(m) only for profiled rows (paper:
        only reward computations are profiled; a user declares them); for the rest it
        knows the feasible unit counts and what it observes. The true values travel
        beside the action as its :class:`Truth`, which only the simulated backend reads;
        the payload carries what a live backend needs."""
        cols = self.cols
        cost: dict[str, Demand] = {}
        cpu = self.sets["cpu_cores"][i]
        gpu = self.sets["gpus"][i]
        if gpu is not None:
            cost["gpu"] = gpu
        elif cpu is not None:
            cost["cpu"] = cpu
        if cols["quota_key"][i]:
            key = quota_resource(cols["quota_key"][i])
            cost[key] = Demand.fixed(float(cols["quota_units"][i]))
        elastic = cols["elastic"][i] or None
        pf = float(cols["parallel_fraction"][i])
        true_e = Elasticity.amdahl(pf) if not math.isnan(pf) else None
        profiled = bool(cols["profiled"][i])
        # what the profile declared (it may be off: traces.generate.declare); the
        # truth below drives only the modelled execution
        d_t1 = float(cols["declared_t1_s"][i])
        d_pf = float(cols["declared_parallel_fraction"][i])
        declared_e = Elasticity.amdahl(d_pf) if not math.isnan(d_pf) else true_e
        payload = {"timeout_s": float(cols["timeout_s"][i]), "command": cols["command"][i]}
        truth = Truth(float(cols["t1_s"][i]), None if math.isnan(pf) else pf,
                      float(cols["setup_s"][i]), float(cols["unit_overhead_s"][i]))
        traj = cols["trajectory"][i]
        aid = f"{prefix}{traj}#{int(cols['seq'][i])}"
        return Step(float(cols["think_s"][i]), Action(
            aid, str(cols["task"][i]), f"{prefix}{traj}", str(cols["kind"][i]), cost,
            elastic=elastic,
            t1_s=(float(cols["t1_s"][i]) if math.isnan(d_t1) else d_t1) if profiled else None,
            elasticity=declared_e if profiled else None,
            service=cols["service"][i] or None, payload=payload), truth)


@dataclass(frozen=True, slots=True)
class TrajectorySpec:
    id: str
    task: str
    mem_gb: float
    #: a tuple, or :class:`Steps` (a trace's rows, built when asked for)
    steps: Sequence[Step]
    #: its GRPO group ('' for none): traces/groups.py
    group: str = ""
    #: the image its environment starts from ('' for the default) and its size (GB)
    image: str = ""
    image_gb: float = 0.0


def trajectories(df: pd.DataFrame, prefix: str = "") -> Iterator[TrajectorySpec]:
    """Validated rows as trajectories whose steps (:class:`Steps`) build the actions the
    core schedules when a driver reaches them (:meth:`TraceColumns.step`)."""
    columns = TraceColumns(df)
    cols = columns.cols
    n = len(columns)
    start = 0
    while start < n:
        traj = cols["trajectory"][start]
        end = start
        while end < n and cols["trajectory"][end] == traj:
            end += 1
        mem = float(np.max(cols["mem_gb"][start:end])) if end > start else 0.0
        group = str(cols["group"][start])
        yield TrajectorySpec(f"{prefix}{traj}", str(cols["task"][start]), mem,
                             Steps(columns, start, end, prefix),
                             f"{prefix}{group}" if group else "", str(cols["image"][start]),
                             float(cols["image_gb"][start]))
        start = end
