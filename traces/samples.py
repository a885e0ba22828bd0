"""The shipped sample traces (``traces/samples/``) and how each is made.

    python -m traces.samples            # regenerate the generated samples, re-declare sympy

Every shipped trace *declares* its profiles: a profiled row carries the t1_s and
parallel fraction a profile would tell the scheduler (``declared_t1_s``,
``declared_parallel_fraction``), off by the generator's default profiling error
(``CALIBRATION["profile_sigma"]``), never the truth itself. A trace without them gives
the scheduler exact profiles (`tangram trace validate` warns about it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from traces.generate import CALIBRATION, declare, generate
from traces.schema import load, validate, write

DIR = Path(__file__).parent / "samples"
SEED = 7


@dataclass(frozen=True)
class Sample:
    """A generated sample: ``generate(workload, trajectories, SEED, arrival)``."""

    name: str
    workload: str
    trajectories: int
    arrival: str | None = None

    @property
    def path(self) -> Path:
        return DIR / f"{self.name}.parquet"

    def make(self) -> pd.DataFrame:
        return validate(generate(self.workload, self.trajectories, SEED, self.arrival))


GENERATED = (Sample("coding", "coding", 256), Sample("deepsearch", "deepsearch", 48),
             Sample("mopd", "mopd", 256, "burst"), Sample("mixed", "mixed", 96))
#: real commands profiled on a machine (traces/profile_suite.py): their t1_s is a
#: measurement, declared here off by the same profiling error as the generated ones
PROFILED = DIR / "sympy.parquet"


def exact_profiles(df: pd.DataFrame) -> int:
    """Profiled rows whose declared t1_s is missing or the truth itself (a profiling error
    of 0): the scheduler would be told the truth."""
    declared = df["declared_t1_s"]
    return int((df["profiled"].astype(bool) & (declared.isna() | (declared == df["t1_s"]))).sum())


def declare_measured(df: pd.DataFrame, seed: int = SEED) -> pd.DataFrame:
    """A measured trace's profiles as a profile declares them: the measurement off by the
    generator's default profiling error (its own stream, like ``generate``)."""
    df = df.copy()
    df["declared_t1_s"] = np.nan  # declare from the measurement, not an earlier draw
    return declare(df, np.random.default_rng([seed, 1]), float(CALIBRATION["profile_sigma"][0]))


def write_keeping_metadata(df: pd.DataFrame, path: Path) -> None:
    """Write a Parquet trace, keeping the old file's ``tangram.*`` metadata (where and
    under what load it was profiled)."""
    old = {k: v for k, v in (pq.read_schema(path).metadata or {}).items()
           if k.startswith(b"tangram.") and k != b"tangram.schema_version"}
    write(df, path)
    table = pq.read_table(path)
    meta = {**(table.schema.metadata or {}), **old}
    pq.write_table(table.replace_schema_metadata(meta), path, compression="zstd")


def main() -> int:
    for s in GENERATED:
        df = s.make()
        write(df, s.path)
        print(f"wrote {s.path} ({len(df)} actions, {s.trajectories} trajectories)")
    df = declare_measured(load(PROFILED))
    write_keeping_metadata(df, PROFILED)
    print(f"declared {PROFILED} ({exact_profiles(df)} exact profiles left)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
