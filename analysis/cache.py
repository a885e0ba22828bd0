"""On-disk caches of `tangram reproduce`, keyed by the hash of their inputs.

A generated trace is keyed by the generator's arguments and the code that generates it;
a simulation's result by its job and all the code a simulation runs (the core, the
simulator, the traces, the experiment harness). Change any of that code and every key
changes: a cache never serves a result the present code would not produce. This is what
makes a long run resumable (each point is written as it finishes) and a repeated run
cheap (each trace is generated and validated once).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections import OrderedDict
from dataclasses import asdict, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
#: what a simulation's result depends on (a trace's: only ``traces/``)
SIM_CODE = ("tangram", "sim", "traces", "analysis/experiments.py", "analysis/outputs.py")
TRACE_CODE = ("traces",)
CODE_SUFFIXES = (".py", ".yaml", ".json")


@lru_cache(maxsize=4)
def code_hash(parts: tuple[str, ...]) -> str:
    """The hash of every source file under ``parts`` (paths relative to the repository)."""
    h = hashlib.sha256()
    for part in parts:
        path = ROOT / part
        files = sorted(p for p in path.rglob("*") if p.suffix in CODE_SUFFIXES) \
            if path.is_dir() else [path]
        for f in files:
            if "__pycache__" in f.parts:
                continue
            h.update(str(f.relative_to(ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def key(inputs: Any, code: tuple[str, ...]) -> str:
    """The hash of ``inputs`` (a dataclass or JSON-able value) and of ``code``."""
    data = asdict(inputs) if is_dataclass(inputs) else inputs
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(f"{code_hash(code)}:{text}".encode()).hexdigest()[:24]


def _atomic_write(path: Path, write) -> None:
    """Write through a temporary name: a killed run leaves no half-written entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    tmp.replace(path)


#: the last traces this process used (a job's baselines share its trace)
_MEMO: OrderedDict[str, pd.DataFrame] = OrderedDict()
MEMO_SIZE = 8


def trace(inputs: dict[str, Any], make, cache: Path | None) -> pd.DataFrame:
    """The validated trace ``make()`` returns for ``inputs``: from this process's memo, the
    disk cache under ``cache``, or made (and validated) once and stored. A copy: callers
    may scale columns."""
    k = key(inputs, TRACE_CODE)
    path = cache / "traces" / f"{k}.pkl" if cache is not None else None
    df = _MEMO.get(k)
    if df is None:
        df = pd.read_pickle(path) if path is not None and path.exists() else make()
        _MEMO[k] = df
        while len(_MEMO) > MEMO_SIZE:
            _MEMO.popitem(last=False)
    _MEMO.move_to_end(k)
    if path is not None and not path.exists():  # made here, or by an earlier run's memo
        _atomic_write(path, df.to_pickle)
    return df.copy()


def result_path(cache: Path | None, job: Any) -> Path | None:
    return cache / "runs" / f"{key(job, SIM_CODE)}.pkl" if cache is not None else None


def load_result(cache: Path | None, job: Any) -> dict[str, Any] | None:
    """A job's stored result row (pickled: exactly the row a fresh run returns)."""
    path = result_path(cache, job)
    if path is None or not path.exists():
        return None
    return pickle.loads(path.read_bytes())


def store_result(cache: Path | None, job: Any, row: dict[str, Any]) -> None:
    path = result_path(cache, job)
    if path is not None:
        data = pickle.dumps(row)
        _atomic_write(path, lambda p: p.write_bytes(data))
