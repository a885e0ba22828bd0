"""`tangram serve --record` / `tangram run --record`: what a live run did, as a trace.

A :class:`Recorder` is the live executor's observer (executor/driver.py ``RunObserver``):
it is told of every trajectory opened, action queued and action ended, and appends one
row per ended action to a JSONL trace in the project's schema (traces/schema.py), a line
at a time and flushed at once: a run that dies leaves every row it finished readable (a
torn last line is skipped by the loader, and `tangram trace validate` says so).

Per action it keeps what a simulation of the same workload needs, and nothing of its
outputs or files: kind, resources requested (``cpu_cores``, ``gpus``, quota) and granted
(``units``), what the client declared (``declared_t1_s``, ``declared_parallel_fraction``),
the duration observed at the granted units, the status, the think time observed between
the trajectory's previous end and this submit, and the trajectory's memory. The command
is a hash (``sha256:...``: the same command, the same hash, so the simulated core learns
per command as the live one did) unless ``--record-commands``.

Elasticity: the row's ``t1_s``, ``parallel_fraction`` and ``unit_overhead_s`` are the
curve the core learnt for the action's (task, kind) and command (tangram/estimates.py
:class:`~tangram.estimates.Speedup`), scaled so that the curve gives exactly the observed
duration at the granted units: a replay at that width takes what the run took, at other
widths what the core's model says. A declared profile is used where the client gave one,
the core's exploration prior where nothing was learnt yet. Rows are written with the
curves known when their action ended; closing the recorder (the run's end) rewrites the
file once, atomically, with the final curves.

Beside the trace, ``<stem>-cluster.yaml``: the cluster the run had, as `tangram simulate
--cluster` reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tangram.cluster import ClusterSpec
from tangram.estimates import DurationModel, Speedup, command_of
from tangram.model import QUOTA_PREFIX, Action, Outcome
from tangram.runtime import Record
from traces.schema import SCHEMA_VERSION, format_set

log = logging.getLogger("tangram.record")

#: the formats a recording is written in: JSONL appends a row as a line (a CSV's header and
#: a Parquet file's footer are not readable until the file is closed)
RECORD_SUFFIXES = (".jsonl", ".ndjson")
#: hex digits of a command's hash (64 bits: no two commands of a run collide)
HASH_DIGITS = 16

#: columns a recording adds to the schema's (the loader reads only the schema's): what the
#: run observed, for `tangram plan` and for comparing a replay with the run
OBSERVED = ("status", "exit_code", "units", "lane", "node", "submit_s", "start_s", "end_s",
            "restore_s", "observed_s", "curve")

Learnt = Callable[[str, str, str], Speedup | None]


class RecordError(ValueError):
    """A recording cannot be made where asked (the message names the path and why)."""


def cluster_path(trace: Path) -> Path:
    """Where the cluster of a recording lies: ``run.jsonl`` -> ``run-cluster.yaml``."""
    return trace.with_name(f"{trace.stem}-cluster.yaml")


def check_record_path(path: Path) -> None:
    """Refuse a path a recording cannot be written to (before a run starts)."""
    if path.suffix.lower() not in RECORD_SUFFIXES:
        raise RecordError(f"--record: {path}: a recording is JSONL, appended a row at a time "
                          f"(readable after a crash): name it *.jsonl (got {path.suffix!r})")
    if path.is_dir():
        raise RecordError(f"--record: {path} is a directory")
    for taken in (path, cluster_path(path)):
        if taken.exists():
            raise RecordError(f"--record: {taken} exists (a recording never overwrites one "
                              "or its cluster file: remove it or name another)")
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists():
        # a file made and removed there: os.access says yes to root wherever a file
        # cannot be made (/proc, a read-only mount), and the run would fail at its start
        try:
            fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=parent)
        except OSError as e:
            raise RecordError(f"--record: cannot write in {parent}: "
                              f"{e.strerror or e}") from None
        os.close(fd)
        Path(probe).unlink(missing_ok=True)


def command_hash(command: str) -> str:
    return "sha256:" + hashlib.sha256(command.encode()).hexdigest()[:HASH_DIGITS]


def elasticity(observed_s: float, units: int, speedup: Speedup) -> tuple[float, float, float]:
    """(t1_s, parallel_fraction, unit_overhead_s): ``speedup``'s shape, its scale chosen so
    that it gives ``observed_s`` on ``units`` units."""
    m = max(units, 1)
    p, c = speedup.parallel_fraction, speedup.unit_overhead_s
    if m == 1:
        return observed_s, p, c
    rest = observed_s - c * (m - 1)
    if rest <= 0:  # the learnt start-up cost outweighs this run: keep its time, no overhead
        rest, c = observed_s, 0.0
    return rest / ((1.0 - p) + p / m), p, c


@dataclass(slots=True)
class _Trajectory:
    task: str
    mem_gb: float
    #: its container image and the image's size (GB; "" and 0: the backend's default)
    image: str = ""
    image_gb: float = 0.0
    #: its name in the trace (the id, or ``<id>~<n>`` for the id's n-th reuse)
    name: str = ""
    seq: int = 0
    #: when its latest action ended (None: none yet; its first think counts from the
    #: recording's start, so that trajectories keep the offsets they opened at)
    last_end: float | None = None


class Recorder:
    """Appends the rows of a live run to ``path`` (JSONL) as its actions end."""

    def __init__(self, path: Path, cluster: ClusterSpec, learnt: Learnt,
                 keep_commands: bool = False, meta: Mapping[str, Any] | None = None) -> None:
        """``learnt(task, kind, command)``: the core's curve (Tangram.learnt_speedup)."""
        check_record_path(path)
        self.path = path
        self.learnt = learnt
        self.keep_commands = keep_commands
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # line-buffered: every row reaches the file when its line ends ("x": never
            # another's; opened first, so that a failure leaves no cluster file of ours)
            self._file = path.open("x", buffering=1)
        except OSError as e:
            raise RecordError(f"--record: cannot create {path}: {e.strerror or e}") from None
        try:
            write_atomic(cluster_path(path), yaml.safe_dump(cluster.to_yaml(), sort_keys=False))
        except OSError as e:
            self._file.close()
            path.unlink(missing_ok=True)
            raise RecordError(f"--record: cannot write {cluster_path(path)}: "
                              f"{e.strerror or e}") from None
        header = {"tangram_trace": True, "schema_version": SCHEMA_VERSION,
                  "recorded": {**(meta or {}), "commands": "kept" if keep_commands else "sha256",
                               "cluster": cluster_path(path).name}}
        self._file.write(json.dumps(header) + "\n")
        self._t0: float | None = None
        self._trajectories: dict[str, _Trajectory] = {}
        #: trajectory id -> times it was closed (an id may be opened again)
        self._lives: dict[str, int] = {}
        #: queued action id -> its trajectory's state (its name, even once it closed)
        self._of: dict[str, _Trajectory] = {}
        #: queued action id -> (seq, think_s, submit time)
        self._queued: dict[str, tuple[int, float, float]] = {}
        #: a command's hash -> the command (elastic rows only: their curves are read again
        #: at close), and the (task, kind) it ran as
        self._commands: dict[tuple[str, str, str], str] = {}
        self.rows = 0
        self._ended = False

    # -- RunObserver -------------------------------------------------------------------
    def opened(self, trajectory: str, task: str, mem_gb: float | None, now: float,
               image: str = "", image_gb: float = 0.0) -> None:
        if self._t0 is None:
            self._t0 = now
        t = self._trajectories.get(trajectory)
        if t is None:
            lives = self._lives.get(trajectory, 0)
            self._trajectories[trajectory] = _Trajectory(
                task, float(mem_gb or 0.0), image, float(image_gb),
                name=f"{trajectory}~{lives}" if lives else trajectory)

    def closed(self, trajectory: str) -> None:
        """Forget its state (only how many times the id was used stays: an id opened again
        is recorded as another trajectory, ``<id>~<n>``)."""
        if self._trajectories.pop(trajectory, None) is not None:
            self._lives[trajectory] = self._lives.get(trajectory, 0) + 1

    def submitted(self, action: Action, now: float) -> None:
        if self._t0 is None:
            self._t0 = now
        t = self._trajectories.get(action.trajectory)
        if t is None:  # (opened before the recorder was: a journal's restored trajectory)
            t = self._trajectories[action.trajectory] = _Trajectory(
                action.task, 0.0, name=action.trajectory)
        since = t.last_end if t.last_end is not None else self._t0
        self._queued[action.id] = (t.seq, max(now - since, 0.0), now)
        self._of[action.id] = t
        t.seq += 1

    def finished(self, action: Action, record: Record, outcome: Outcome) -> None:
        queued = self._queued.pop(action.id, None)
        t = self._of.pop(action.id, None)
        if queued is None or t is None or self._ended:
            return
        t.last_end = record.end_s if record.end_s > 0 else queued[2]
        if record.status == "cancelled" and not record.kind:
            return  # cancelled while queued: it never ran, nothing to replay
        try:
            row = self._row(action, record, queued, t)
            self._file.write(json.dumps(row) + "\n")
            self.rows += 1
        except (OSError, ValueError) as e:  # a full disk must not fail the action
            log.error("--record: cannot write %s: %s", self.path, e)

    def close(self) -> None:
        """Rewrite the rows with the curves learnt by the end of the run (atomically: a
        crash meanwhile leaves the appended file), then close."""
        if self._ended:
            return
        self._ended = True
        self._file.close()
        if not self.rows:
            # nothing ran (a server that never bound its port, a run that failed at its
            # start): a header alone is no trace (`simulate` refuses it), and left there
            # it would refuse the next try at this path
            self.path.unlink(missing_ok=True)
            cluster_path(self.path).unlink(missing_ok=True)
            log.warning("--record: nothing ran; %s not kept", self.path)
            return
        try:
            self._finalise()
        except (OSError, ValueError) as e:
            log.error("--record: %s kept as appended (final curves not applied: %s)",
                      self.path, e)

    # -- rows --------------------------------------------------------------------------
    def _row(self, action: Action, record: Record, queued: tuple[int, float, float],
             t: _Trajectory) -> dict[str, Any]:
        seq, think_s, _ = queued
        t0 = self._t0 or 0.0
        units = max(record.units, 1)
        observed = max(record.end_s - record.start_s - record.restore_s, 0.0)
        command = command_of(action)
        shown = command if self.keep_commands or not command else command_hash(command)
        if command and action.elastic:  # (only their curves are read again at close)
            self._commands[(action.task, action.kind, shown)] = command
        cost = action.cost
        quota = next((k for k in cost if k.startswith(QUOTA_PREFIX)), None)
        el = action.elasticity
        declared_p = el.parallel_fraction if el is not None else None
        payload = action.payload if isinstance(action.payload, dict) else {}
        row: dict[str, Any] = {
            "task": action.task, "trajectory": t.name, "seq": seq,
            "kind": action.kind, "think_s": think_s, "t1_s": observed,
            "cpu_cores": format_set(cost.get("cpu")), "mem_gb": t.mem_gb,
            # (a SWE run replays with its pulls: the size the node stored)
            "image": t.image, "image_gb": t.image_gb,
            "gpus": format_set(cost.get("gpu")), "elastic": action.elastic or "",
            "parallel_fraction": None, "unit_overhead_s": 0.0,
            "profiled": action.t1_s is not None, "declared_t1_s": action.t1_s,
            "declared_parallel_fraction": declared_p, "service": action.service or "",
            "quota_key": quota.removeprefix(QUOTA_PREFIX) if quota else "",
            "quota_units": float(cost[quota].min) if quota else 1.0, "setup_s": 0.0,
            "timeout_s": float(payload.get("timeout_s") or 0.0), "command": shown, "group": "",
            "status": record.status, "exit_code": record.exit_code, "units": record.units,
            "lane": record.lane, "node": record.node, "submit_s": record.submit_s - t0,
            "start_s": record.start_s - t0, "end_s": record.end_s - t0,
            "restore_s": record.restore_s, "observed_s": observed, "curve": "",
        }
        if action.elastic:
            self._shape(row, units, self._speedup(action.task, action.kind, command,
                                                   declared_p))
        return row

    def _speedup(self, task: str, kind: str, command: str,
                 declared_p: float | None) -> Speedup:
        if declared_p is not None:  # the client's profile: the core learns no curve for it
            return Speedup(declared_p, 0.0, "declared")
        learnt = self.learnt(task, kind, command)
        # nothing trusted yet: the prior the core explores with
        return learnt or Speedup(DurationModel.PRIOR_PARALLEL, 0.0, "prior")

    @staticmethod
    def _shape(row: dict[str, Any], units: int, speedup: Speedup) -> None:
        t1, p, c = elasticity(row["observed_s"], units, speedup)
        row.update(t1_s=t1, parallel_fraction=p, unit_overhead_s=c, curve=speedup.source)

    def _finalise(self) -> None:
        """The appended rows again, each elastic one on its final curve (streamed: a
        recording of millions of rows is never held whole)."""
        def lines() -> Iterator[str]:
            with self.path.open() as f:
                for k, line in enumerate(f):
                    if k and line.strip():
                        row = json.loads(line)
                        if row.get("elastic") and row.get("curve") in ("prior", "kind",
                                                                       "command"):
                            command = self._commands.get(
                                (row["task"], row["kind"], row["command"]), "")
                            self._shape(row, max(int(row["units"] or 0), 1),
                                        self._speedup(row["task"], row["kind"], command, None))
                            line = json.dumps(row) + "\n"
                    yield line

        write_atomic(self.path, lines())


def write_atomic(path: Path, text: str | Iterable[str]) -> None:
    """``text`` (or its pieces) as ``path``, whole or not at all (a temporary file renamed
    over it)."""
    # (mkstemp makes it 0600: the file keeps the mode it had - a recording appended as
    # any file is made - and a new one is readable as the files beside it are)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.writelines([text] if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (read by setting it: once per file written, on one thread)."""
    mask = os.umask(0o22)
    os.umask(mask)
    return mask
