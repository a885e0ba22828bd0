"""Synthetic workload generators, calibrated from public figures (see traces/README.md).

Every constant below names its source in ``CALIBRATION``; nothing is tuned to
make a scheduler look good. One row per action, closed loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from traces.schema import COLUMNS

#: every number a generator uses, with where it comes from (printed by the report)
CALIBRATION: dict[str, tuple[float | str, str]] = {
    "shell_mean_s": (0.7, "Codex CLI exec_command mean duration ~0.7 s (tool-call telemetry)"),
    "shell_sigma": (1.4, "heavy tail: lognormal sigma chosen so p99 ~ 20 x median"),
    "file_edit_median_s": (0.05, "in-place file write, tens of ms"),
    "test_run_mean_s": (18.0, "long-running test processes ~18 s mean (agent tool telemetry)"),
    "test_timeout_s": (90.0, "SWE-bench harness: 90 s per test instance"),
    "suite_timeout_s": (900.0, "SWE-bench harness: 900 s per full evaluation suite"),
    "reward_t1_range_s": ("5-120", "reward test suites 5-120 s on one core (issue spec)"),
    "xdist_parallel_fraction": ("0.67-0.95", "pytest-xdist: 1.5x on 2 real cores measured here "
                                             "(Amdahl p=0.67); suites up to p=0.95"),
    "actions_per_trajectory": (30.0, "SWE-agent style rollouts, ~30 tool calls"),
    "think_tokens_median": (250.0, "agent turn length ~100-1000 tokens"),
    "decode_tok_per_s": (40.0, "decode speed of a 32B policy model, 30-60 tok/s"),
    "search_calls_short": ("1-3", "Search-R1: 1-3 search calls per question"),
    "search_calls_deep_median": (45.0, "deep research (BrowseComp-style): 35-65 calls, tail past 100"),
    "search_latency_p50_s": (0.64, "search API latency p50 ~0.64 s"),
    "search_latency_p95_s": (1.35, "search API latency p95 ~1.35 s"),
    "fetch_latency_median_s": (1.2, "page fetch + parse, ~1-2 s"),
    "judge_prefill_tok_per_s": (8000.0, "LLM judge prefill on one H100-class GPU"),
    "judge_decode_tok_per_s": (60.0, "LLM judge decode on one GPU"),
    "teacher_prefill_tok_per_s": (6000.0, "teacher log-prob (prefill only) on one GPU"),
    "mopd_response_tokens_median": (4000.0, "reasoning RL responses run to thousands of tokens "
                                            "(DeepSeek-R1 Fig. 3: R1-Zero's mean length grows "
                                            "past 10k; DAPO trains with up to 20,480); median "
                                            "chosen mid-range"),
    "mopd_response_tokens_sigma": (0.7, "spread of response lengths within a batch (long tail "
                                        "dominates the step: paper section 6, MOPD)"),
    "mopd_response_tokens_max": (20480.0, "DAPO's maximum response length (16,384 + 4,096 "
                                          "overlong buffer)"),
    "teacher_zipf_s": (2.0, "calls per teacher skewed by orders of magnitude (paper Fig. 3(d)); "
                            "Zipf exponent 2 over 9 teachers: most- / least-called ~ 81x; "
                            "power-law model popularity as in AlpaServe (OSDI'23)"),
    "llm_requests": ("azure", "prompt / output sizes and arrivals: Azure LLM inference trace 2023 "
                              "(CC BY 4.0)"),
}


def c(name: str) -> float:
    return float(CALIBRATION[name][0])


@lru_cache(maxsize=1)
def azure() -> dict:
    return json.loads((Path(__file__).parent / "data" / "azure_llm_2023.json").read_text())


def azure_sample(rng: np.random.Generator, dataset: str, field: str, n: int) -> np.ndarray:
    """Inverse-CDF sample from the shipped Azure quantile table."""
    table = azure()
    return np.interp(rng.random(n), table["quantiles"], table[dataset][field])


def lognormal_mean(rng: np.random.Generator, mean: float, sigma: float, n: int | None = None):
    mu = np.log(mean) - sigma**2 / 2
    return rng.lognormal(mu, sigma, n)


def _think(rng: np.random.Generator, n: int) -> np.ndarray:
    tokens = rng.lognormal(np.log(c("think_tokens_median")), 0.6, n)
    return tokens / c("decode_tok_per_s")


def _row(**kw) -> dict:
    row = {k: v[2] for k, v in COLUMNS.items()}
    row.update(kw)
    return row


def coding(n: int, rng: np.random.Generator, task: str = "coding") -> list[dict]:
    rows: list[dict] = []
    for j in range(n):
        traj = f"{task}-{j:05d}"
        k = int(np.clip(rng.normal(c("actions_per_trajectory"), 8), 8, 60))
        think = _think(rng, k)
        mem = float(rng.choice([2.0, 4.0, 8.0]))
        kinds = rng.choice(["shell", "file_edit", "test_run"], size=k - 1, p=[0.55, 0.3, 0.15])
        for seq, kind in enumerate(kinds):
            if kind == "shell":
                t1 = min(float(lognormal_mean(rng, c("shell_mean_s"), c("shell_sigma"))), 85.0)
                rows.append(_row(task=task, trajectory=traj, seq=seq, kind="shell",
                                 think_s=think[seq], t1_s=t1, cpu_cores="1", mem_gb=mem,
                                 timeout_s=c("test_timeout_s"), command=f"sleep {t1:.3f}"))
            elif kind == "file_edit":
                t1 = float(rng.lognormal(np.log(c("file_edit_median_s")), 0.5))
                rows.append(_row(task=task, trajectory=traj, seq=seq, kind="file_edit",
                                 think_s=think[seq], t1_s=t1, cpu_cores="1", mem_gb=mem,
                                 command=f"sh -c 'echo edit-{seq} >> notes.txt'"))
            else:  # an agent-run test: elastic, but not profiled (scheduler sees its minimum)
                t1 = min(float(lognormal_mean(rng, c("test_run_mean_s"), 1.0)), 85.0)
                rows.append(_row(task=task, trajectory=traj, seq=seq, kind="test_run",
                                 think_s=think[seq], t1_s=t1, cpu_cores="1-16", mem_gb=mem,
                                 elastic="cpu", parallel_fraction=float(rng.uniform(0.5, 0.9)),
                                 timeout_s=c("test_timeout_s"), command="pytest -q tests"))
        # reward: the hidden test suite, profiled in advance (paper section 6 setup)
        t1 = float(np.clip(rng.lognormal(np.log(30.0), 0.8), 5.0, 120.0))
        rows.append(_row(task=task, trajectory=traj, seq=k - 1, kind="reward_test",
                         think_s=think[-1], t1_s=t1, cpu_cores="1-32", mem_gb=mem, elastic="cpu",
                         parallel_fraction=float(rng.uniform(0.67, 0.95)), profiled=True,
                         timeout_s=c("suite_timeout_s"), command="pytest -q reward_tests"))
    return rows


def _judge_t1(rng: np.random.Generator, dataset: str) -> float:
    ctx = float(azure_sample(rng, dataset, "context_tokens", 1)[0])
    gen = float(azure_sample(rng, dataset, "generated_tokens", 1)[0])
    return 0.05 + ctx / c("judge_prefill_tok_per_s") + gen / c("judge_decode_tok_per_s")


def deepsearch(n: int, rng: np.random.Generator, task: str = "deepsearch") -> list[dict]:
    rows: list[dict] = []
    sigma = np.log(c("search_latency_p95_s") / c("search_latency_p50_s")) / 1.645
    for j in range(n):
        traj = f"{task}-{j:05d}"
        if rng.random() < 0.4:
            calls = int(rng.integers(1, 4))
        else:
            calls = int(np.clip(rng.lognormal(np.log(c("search_calls_deep_median")), 0.35), 4, 150))
        think = rng.lognormal(np.log(3.0), 0.5, calls + 1)
        seq = 0
        for i in range(calls):
            t1 = float(rng.lognormal(np.log(c("search_latency_p50_s")), sigma))
            rows.append(_row(task=task, trajectory=traj, seq=seq, kind="search", think_s=think[i],
                             t1_s=t1, quota_key="search", mem_gb=0.5, timeout_s=30.0,
                             command=f"sleep {t1:.3f}"))
            seq += 1
            if rng.random() < 0.3:
                t1 = float(rng.lognormal(np.log(c("fetch_latency_median_s")), 0.6))
                rows.append(_row(task=task, trajectory=traj, seq=seq, kind="fetch_page",
                                 think_s=0.2, t1_s=t1, quota_key="fetch", mem_gb=0.5,
                                 timeout_s=30.0, command=f"sleep {t1:.3f}"))
                seq += 1
        rows.append(_row(task=task, trajectory=traj, seq=seq, kind="reward_judge",
                         think_s=think[-1], t1_s=_judge_t1(rng, "conv"), gpus="1,2,4,8",
                         elastic="gpu", parallel_fraction=float(rng.uniform(0.8, 0.95)),
                         profiled=True, service="judge", timeout_s=300.0))
    return rows


TEACHERS = [f"teacher{i}" for i in range(9)]
ARRIVALS = ("burst", "spread")


def teacher_weights(rng: np.random.Generator) -> np.ndarray:
    """Call probability of each teacher: Zipf over a seeded ranking (which teacher is
    popular is not chosen by us: a different seed, a different ranking)."""
    ranks = rng.permutation(len(TEACHERS)) + 1
    w = 1.0 / ranks.astype(float) ** c("teacher_zipf_s")
    return w / w.sum()


def mopd(n: int, rng: np.random.Generator, task: str = "mopd",
         arrival: str = "burst") -> list[dict]:
    """Multi-teacher on-policy distillation: generation, then a teacher log-prob request.

    ``burst`` (synchronous rollout, the paper's setting): every trajectory of the batch
    starts at t=0 and sends its request when its own generation ends, so arrivals follow
    the distribution of response lengths. ``spread``: trajectories start at offsets drawn
    from the Azure code trace's inter-arrival gaps (requests spread over ~20 min).
    The teacher scores the whole trajectory (prompt + response), so a request costs more
    the longer the trajectory; demand is skewed across teachers (Zipf).
    """
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival: unknown {arrival!r} (choose from {', '.join(ARRIVALS)})")
    rows: list[dict] = []
    weights = teacher_weights(rng)
    teachers = rng.choice(len(TEACHERS), size=n, p=weights)
    prompt = azure_sample(rng, "code", "context_tokens", n)
    response = np.minimum(rng.lognormal(np.log(c("mopd_response_tokens_median")),
                                        c("mopd_response_tokens_sigma"), n),
                          c("mopd_response_tokens_max"))
    gen = response / c("decode_tok_per_s")
    if arrival == "spread":
        start = np.cumsum(azure_sample(rng, "code", "interarrival_s", n))
    else:
        start = np.zeros(n)
    pf = rng.uniform(0.8, 0.95, n)
    for j in range(n):
        traj = f"{task}-{j:05d}"
        teacher = TEACHERS[int(teachers[j])]
        t1 = 0.05 + (prompt[j] + response[j]) / c("teacher_prefill_tok_per_s")
        rows.append(_row(task=f"{task}-{teacher}", trajectory=traj, seq=0, kind="teacher_logprob",
                         think_s=float(start[j] + gen[j]), t1_s=float(t1), gpus="1,2,4,8",
                         elastic="gpu", parallel_fraction=float(pf[j]),
                         profiled=True, service=teacher, timeout_s=300.0))
    return rows


def mixed(n: int, rng: np.random.Generator, arrival: str = "burst") -> list[dict]:
    """MOPD + Search sharing one GPU pool (paper's mixed scenario)."""
    half = n // 2
    return deepsearch(half, rng) + mopd(n - half, rng, arrival=arrival)


WORKLOADS: dict[str, Callable[[int, np.random.Generator], list[dict]]] = {
    "coding": coding, "deepsearch": deepsearch, "mopd": mopd, "mixed": mixed,
}


#: workloads whose arrivals can be ``burst`` or ``spread``
ARRIVAL_WORKLOADS = ("mopd", "mixed")


def generate(workload: str, trajectories: int, seed: int = 0,
             arrival: str | None = None) -> pd.DataFrame:
    """``arrival`` (mopd, mixed): ``burst`` (default) or ``spread``."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload: unknown {workload!r} (choose from {sorted(WORKLOADS)})")
    if trajectories < 1:
        raise ValueError(f"trajectories: must be >= 1, got {trajectories}")
    if arrival is not None and workload not in ARRIVAL_WORKLOADS:
        raise ValueError(f"arrival: only {' and '.join(ARRIVAL_WORKLOADS)} have an arrival "
                         f"pattern, not {workload!r}")
    if arrival is not None and arrival not in ARRIVALS:
        raise ValueError(f"arrival: unknown {arrival!r} (choose from {', '.join(ARRIVALS)})")
    rng = np.random.default_rng(seed)
    make = WORKLOADS[workload]
    rows = make(trajectories, rng, arrival=arrival) if arrival else make(trajectories, rng)
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    for col in ("think_s", "t1_s"):
        df[col] = df[col].astype(float).round(4)
    return df
