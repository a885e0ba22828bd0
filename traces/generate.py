"""Synthetic workload generators, calibrated from public figures (see traces/README.md).

Every constant below names its source in ``CALIBRATION``, or says it is an
assumption (and whether a reproduce study sweeps it); nothing is tuned to make a
scheduler look good. One row per action, closed loop. Coding and DeepSearch rows
name no command: `tangram run` burns a CPU row's ``t1_s`` with its parallel
fraction (executor/bench/burn.py) and waits an API row's ``t1_s``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from traces.groups import assign_groups
from traces.schema import COLUMNS

#: every number a generator uses, with where it comes from (printed by the report)
CALIBRATION: dict[str, tuple[float | str, str]] = {
    # -- AI coding ------------------------------------------------------------------------
    "shell_mean_s": (0.7, "assumption: agent shell commands (ls, grep, cat, git) take "
                          "well under a second on average; not swept"),
    "shell_sigma": (1.4, "assumption: heavy tail, lognormal sigma with p99 ~ 20 x median; "
                         "not swept"),
    "file_edit_median_s": (0.05, "assumption: an in-place file write, tens of ms; not swept"),
    "test_run_mean_s": (18.0, "assumption: agent-run test commands of tens of seconds; "
                              "swept x0.5-x2 (reproduce: sensitivity test_scale)"),
    "test_timeout_s": (90.0, "assumption: per-command timeout of the agent harness"),
    "suite_timeout_s": (900.0, "assumption: timeout of the hidden test suite"),
    "reward_t1_range_s": ("5-120", "assumption: hidden test suites of 5-120 s on one core "
                                   "(lognormal, median 30 s); swept x0.5-x2 (test_scale)"),
    "xdist_parallel_fraction": ("0.67-0.95", "measured: pytest-xdist gave 1.5x on 2 real "
                                             "cores of this project's machine (Amdahl "
                                             "p=0.67); suites up to p=0.95 assumed"),
    "actions_per_trajectory": (30.0, "assumption: SWE-agent-style rollouts of ~30 tool calls "
                                     "(normal, sd 8, clipped 8-60); not swept"),
    "action_mix": ("55/30/15", "assumption: shell / file edit / agent test run shares of a "
                               "coding trajectory's tool calls; not swept"),
    "think_tokens_median": (250.0, "assumption: agent turn length ~100-1000 tokens (MOPD "
                                   "generations use it x4)"),
    "coding_think_tokens_median": (150.0, "calibrated: the paper's fig. 3(c) says a coding "
                                          "trajectory's actions take 47% of its time on "
                                          "average; 150 tokens at 40 tok/s gives 47% with "
                                          "actions at one core (tests/test_replay.py); "
                                          "swept x0.5-x2 (sensitivity think_scale)"),
    "decode_tok_per_s": (40.0, "assumption: decode speed of a 32B policy model, 30-60 tok/s; "
                               "enters only through think time (swept by think_scale)"),
    "setup_median_s": (40.0, "assumption: preparing a coding sandbox (clone the task's "
                             "repository, install its dependencies) takes tens of seconds to "
                             "minutes (lognormal, sigma 0.7, clipped 5-600 s); drawn once per "
                             "GRPO group (--group-size), not swept"),
    # -- SWE-style (a container image per task) -------------------------------------------
    "swe_images": (500.0, "SWE-bench Verified's 500 task images (epoch.ai/blog/swebench-docker); "
                          "`--images` sets another count (SWE-Gym ~2,400)"),
    "swe_image_skew": (1.0, "assumption: Zipf exponent of how often a task (its image) is "
                            "drawn into a batch (image k of N with weight 1/k); not swept"),
    "swe_image_gb_mean": (9.3, "OpenHands issue #9679: ~1.3 TB of images for ~140 SWE-bench "
                               "Verified instances, 9.3 GB each: what a node pulls and stores "
                               "per task image when images share no layers (as OpenHands' "
                               "per-instance runtime images do); the per-image unique bytes of "
                               "a layer-shared registry are far smaller (epoch.ai: 30 GiB for "
                               "all 500, 60 MB each; 189 GiB before its re-layering)"),
    "swe_image_sigma": (0.5, "assumption: lognormal spread of task image sizes (the epoch.ai "
                             "SWE-bench issue #3 thread's matplotlib images, 6.5-8 GB, lie "
                             "within it); not swept"),
    # -- DeepSearch -----------------------------------------------------------------------
    "deepsearch_short_share": (0.4, "assumption: share of questions answered in 1-3 searches "
                                    "(Search-R1-style); not swept"),
    "search_calls_short": ("1-3", "assumption: Search-R1-style questions, 1-3 search calls"),
    "search_calls_deep_median": (45.0, "assumption: BrowseComp-style deep research, median 45 "
                                       "calls (lognormal sigma 0.35, 4-150)"),
    "deepsearch_think_median_s": (3.0, "assumption: generation between two searches, "
                                       "lognormal sigma 0.5; not swept"),
    "fetch_share": (0.3, "assumption: share of searches followed by a page fetch"),
    "search_latency_p50_s": (0.64, "assumption: search API latency p50 (lognormal)"),
    "search_latency_p95_s": (1.35, "assumption: search API latency p95"),
    "fetch_latency_median_s": (1.2, "assumption: page fetch + parse, ~1-2 s"),
    "search_quota_rps": ("1 / 50", "Brave Search API published limits: 1 request/s (free), "
                                   "50 requests/s (Search plan); 429 with X-RateLimit-Reset "
                                   "(whole seconds), only successful requests counted; "
                                   "reproduce runs both"),
    # -- MOPD and GPU services ------------------------------------------------------------
    "judge_prefill_tok_per_s": (8000.0, "assumption: LLM judge prefill on one H100-class GPU"),
    "judge_decode_tok_per_s": (60.0, "assumption: LLM judge decode on one GPU"),
    "teacher_prefill_tok_per_s": (6000.0, "assumption: teacher log-prob (prefill only) on one "
                                          "GPU"),
    "mopd_response_tokens_median": (4000.0, "reasoning RL responses run to thousands of tokens "
                                            "(DeepSeek-R1 Fig. 3: R1-Zero's mean length grows "
                                            "past 10k; DAPO trains with up to 20,480); median "
                                            "chosen mid-range"),
    "mopd_response_tokens_sigma": (0.7, "spread of response lengths within a batch (long tail "
                                        "dominates the step: paper section 6, MOPD)"),
    "mopd_response_tokens_max": (20480.0, "DAPO's maximum response length (16,384 + 4,096 "
                                          "overlong buffer)"),
    "teacher_zipf_s": (1.0, "assumption: the paper gives no split of calls across teachers "
                            "(its Fig. 3(d) is call counts over the training run, not across "
                            "teachers; Fig. 3(b) says load differs across models, not by how "
                            "much). Zipf exponent 1 over 9 teachers (the classic Zipf law; "
                            "most- / least-called 9x, the hottest teacher ~35% of calls); "
                            "swept 0-2 (reproduce: every GPU headline's range)"),
    "profile_sigma": (0.3, "assumption: profiling error of a declared t1_s and serial "
                           "share (lognormal sigma; 0.3 ~ +-35% at one sd, a profile taken "
                           "on another machine or under other load); swept 0-0.6 "
                           "(reproduce: the headline ranges)"),
    "judge_declared_tokens": ("median", "the judge's output length is not known before it "
                                        "runs: its declared t1_s assumes the Azure conv "
                                        "trace's median generated tokens"),
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


def _think(rng: np.random.Generator, n: int, median_tokens: float | None = None) -> np.ndarray:
    tokens = rng.lognormal(np.log(median_tokens or c("think_tokens_median")), 0.6, n)
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
        think = _think(rng, k, c("coding_think_tokens_median"))
        mem = float(rng.choice([2.0, 4.0, 8.0]))
        kinds = rng.choice(["shell", "file_edit", "test_run"], size=k - 1, p=[0.55, 0.3, 0.15])
        for seq, kind in enumerate(kinds):
            if kind == "shell":
                t1 = min(float(lognormal_mean(rng, c("shell_mean_s"), c("shell_sigma"))), 85.0)
                rows.append(_row(task=task, trajectory=traj, seq=seq, kind="shell",
                                 think_s=think[seq], t1_s=t1, cpu_cores="1", mem_gb=mem,
                                 timeout_s=c("test_timeout_s")))
            elif kind == "file_edit":
                t1 = float(rng.lognormal(np.log(c("file_edit_median_s")), 0.5))
                rows.append(_row(task=task, trajectory=traj, seq=seq, kind="file_edit",
                                 think_s=think[seq], t1_s=t1, cpu_cores="1", mem_gb=mem))
            else:  # an agent-run test: elastic, but not profiled (scheduler sees its minimum)
                t1 = min(float(lognormal_mean(rng, c("test_run_mean_s"), 1.0)), 85.0)
                rows.append(_row(task=task, trajectory=traj, seq=seq, kind="test_run",
                                 think_s=think[seq], t1_s=t1, cpu_cores="1-16", mem_gb=mem,
                                 elastic="cpu", parallel_fraction=float(rng.uniform(0.5, 0.9)),
                                 timeout_s=c("test_timeout_s")))
        # reward: the hidden test suite, profiled in advance (paper section 6 setup)
        t1 = float(np.clip(rng.lognormal(np.log(30.0), 0.8), 5.0, 120.0))
        rows.append(_row(task=task, trajectory=traj, seq=k - 1, kind="reward_test",
                         think_s=think[-1], t1_s=t1, cpu_cores="1-32", mem_gb=mem, elastic="cpu",
                         parallel_fraction=float(rng.uniform(0.67, 0.95)), profiled=True,
                         timeout_s=c("suite_timeout_s")))
    return rows


def swe(n: int, rng: np.random.Generator, images: int | None = None,
        image_gb_mean: float | None = None) -> list[dict]:
    """SWE-style rollouts: the coding workload's actions (its action mix, think times and
    reward suite; the same rows as ``coding`` of the same seed), each trajectory's
    environment started from its task's container image: ``images`` images drawn with Zipf
    popularity (``swe_image_skew``), each of a lognormal size (``swe_image_gb_mean``,
    ``swe_image_sigma``). Images and sizes draw from streams of their own (spawned from
    ``rng``), so the actions do not depend on them."""
    count = int(c("swe_images")) if images is None else int(images)
    if count < 1:
        raise ValueError(f"images: must be >= 1, got {images!r}")
    mean = c("swe_image_gb_mean") if image_gb_mean is None else float(image_gb_mean)
    if not mean > 0:
        raise ValueError(f"image_gb_mean: must be > 0, got {image_gb_mean!r}")
    pick, size = rng.spawn(2)
    rows = coding(n, rng, task="swe")
    weights = 1.0 / np.arange(1, count + 1) ** c("swe_image_skew")
    chosen = pick.choice(count, size=n, p=weights / weights.sum())
    gb = np.round(lognormal_mean(size, mean, c("swe_image_sigma"), count), 3)
    width = len(str(count - 1))
    for row in rows:
        k = chosen[int(row["trajectory"].rsplit("-", 1)[1])]
        row["image"] = f"swe-task-{k:0{width}d}"
        row["image_gb"] = float(gb[k])
    return rows


def _judge_t1(rng: np.random.Generator, dataset: str) -> tuple[float, float]:
    """(true t1, declared t1): the prompt is known when the judge is called, its output
    length only after it ran, so the declared cost assumes the trace's median output."""
    ctx = float(azure_sample(rng, dataset, "context_tokens", 1)[0])
    gen = float(azure_sample(rng, dataset, "generated_tokens", 1)[0])
    median = float(np.interp(0.5, azure()["quantiles"], azure()[dataset]["generated_tokens"]))
    base = 0.05 + ctx / c("judge_prefill_tok_per_s")
    return base + gen / c("judge_decode_tok_per_s"), base + median / c("judge_decode_tok_per_s")


def deepsearch(n: int, rng: np.random.Generator, task: str = "deepsearch") -> list[dict]:
    rows: list[dict] = []
    sigma = np.log(c("search_latency_p95_s") / c("search_latency_p50_s")) / 1.645
    for j in range(n):
        traj = f"{task}-{j:05d}"
        if rng.random() < c("deepsearch_short_share"):
            calls = int(rng.integers(1, 4))
        else:
            calls = int(np.clip(rng.lognormal(np.log(c("search_calls_deep_median")), 0.35), 4, 150))
        think = rng.lognormal(np.log(c("deepsearch_think_median_s")), 0.5, calls + 1)
        seq = 0
        for i in range(calls):
            t1 = float(rng.lognormal(np.log(c("search_latency_p50_s")), sigma))
            rows.append(_row(task=task, trajectory=traj, seq=seq, kind="search", think_s=think[i],
                             t1_s=t1, quota_key="search", mem_gb=0.5, timeout_s=30.0))
            seq += 1
            if rng.random() < c("fetch_share"):
                t1 = float(rng.lognormal(np.log(c("fetch_latency_median_s")), 0.6))
                rows.append(_row(task=task, trajectory=traj, seq=seq, kind="fetch_page",
                                 think_s=0.2, t1_s=t1, quota_key="fetch", mem_gb=0.5,
                                 timeout_s=30.0))
                seq += 1
        true_t1, declared = _judge_t1(rng, "conv")
        rows.append(_row(task=task, trajectory=traj, seq=seq, kind="reward_judge",
                         think_s=think[-1], t1_s=true_t1, declared_t1_s=declared, gpus="1,2,4,8",
                         elastic="gpu", parallel_fraction=float(rng.uniform(0.8, 0.95)),
                         profiled=True, service="judge", timeout_s=300.0))
    return rows


TEACHERS = [f"teacher{i}" for i in range(9)]
ARRIVALS = ("burst", "spread")


def teacher_weights(rng: np.random.Generator, skew: float | None = None) -> np.ndarray:
    """Call probability of each teacher: Zipf with exponent ``skew`` (None: the
    calibrated default) over a seeded ranking (which teacher is popular is not chosen by
    us: a different seed, a different ranking)."""
    ranks = rng.permutation(len(TEACHERS)) + 1
    w = 1.0 / ranks.astype(float) ** (c("teacher_zipf_s") if skew is None else skew)
    return w / w.sum()


def mopd(n: int, rng: np.random.Generator, task: str = "mopd",
         arrival: str = "burst", teacher_skew: float | None = None) -> list[dict]:
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
    weights = teacher_weights(rng, teacher_skew)
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


def mixed(n: int, rng: np.random.Generator, arrival: str = "burst",
          teacher_skew: float | None = None) -> list[dict]:
    """MOPD + Search sharing one GPU pool (paper's mixed scenario)."""
    half = n // 2
    return deepsearch(half, rng) + mopd(n - half, rng, arrival=arrival,
                                        teacher_skew=teacher_skew)


WORKLOADS: dict[str, Callable[[int, np.random.Generator], list[dict]]] = {
    "coding": coding, "deepsearch": deepsearch, "mopd": mopd, "mixed": mixed, "swe": swe,
}


#: workloads whose arrivals can be ``burst`` or ``spread``
ARRIVAL_WORKLOADS = ("mopd", "mixed")


def declare(df: pd.DataFrame, rng: np.random.Generator, sigma: float) -> pd.DataFrame:
    """What a profile declares of each profiled row: its t1_s and serial share (1 - p)
    off by a lognormal factor of spread ``sigma`` (median-unbiased), never the truth
    itself; the truth columns are left as they are."""
    prof = df["profiled"].astype(bool).to_numpy()
    n = int(prof.sum())
    if n == 0:
        return df
    t1 = df["declared_t1_s"].to_numpy(dtype=float, copy=True)
    base = np.where(np.isnan(t1), df["t1_s"].to_numpy(dtype=float), t1)
    t1[prof] = base[prof] * rng.lognormal(0.0, sigma, n) if sigma > 0 else base[prof]
    pf = df["parallel_fraction"].to_numpy(dtype=float)
    declared_pf = np.full(len(df), np.nan)
    if sigma > 0:
        serial = (1.0 - pf[prof]) * rng.lognormal(0.0, sigma, n)
        declared_pf[prof] = np.clip(1.0 - serial, 0.0, 0.99)
    df["declared_t1_s"] = t1
    df["declared_parallel_fraction"] = declared_pf
    return df


def generate(workload: str, trajectories: int, seed: int = 0,
             arrival: str | None = None, teacher_skew: float | None = None,
             profile_sigma: float | None = None,
             group_size: int | None = None, images: int | None = None) -> pd.DataFrame:
    """``arrival`` (mopd, mixed): ``burst`` (default) or ``spread``. ``teacher_skew``
    (mopd, mixed): the Zipf exponent of calls across teachers (None: calibrated default).
    ``profile_sigma``: the profiling error of profiled rows' declared t1_s and parallel
    fraction (None: calibrated default; 0: profiles are exact). A row's truth does not
    depend on ``profile_sigma`` (the error draws from a stream of its own).
    ``group_size`` (coding): GRPO groups of that many rollouts of one prompt, each group's
    sandbox setup (``setup_s``) drawn once, from a stream of its own (the actions are
    those of the ungrouped trace): traces/groups.py. ``images`` (swe): how many task images
    the trajectories are drawn over (None: calibrated default, 500)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload: unknown {workload!r} (choose from {sorted(WORKLOADS)})")
    if trajectories < 1:
        raise ValueError(f"trajectories: must be >= 1, got {trajectories}")
    if arrival is not None and workload not in ARRIVAL_WORKLOADS:
        raise ValueError(f"arrival: only {' and '.join(ARRIVAL_WORKLOADS)} have an arrival "
                         f"pattern, not {workload!r}")
    if arrival is not None and arrival not in ARRIVALS:
        raise ValueError(f"arrival: unknown {arrival!r} (choose from {', '.join(ARRIVALS)})")
    if teacher_skew is not None and workload not in ARRIVAL_WORKLOADS:
        raise ValueError(f"teacher_skew: only {' and '.join(ARRIVAL_WORKLOADS)} call "
                         f"teachers, not {workload!r}")
    if teacher_skew is not None and not teacher_skew >= 0:
        raise ValueError(f"teacher_skew: must be >= 0, got {teacher_skew!r}")
    if group_size is not None and workload != "coding":
        raise ValueError(f"group_size: only coding rollouts prepare a sandbox to fork, "
                         f"not {workload!r}")
    if images is not None and workload != "swe":
        raise ValueError(f"images: only swe rollouts start from task images, not {workload!r}")
    sigma = c("profile_sigma") if profile_sigma is None else float(profile_sigma)
    if not sigma >= 0:
        raise ValueError(f"profile_sigma: must be >= 0, got {profile_sigma!r}")
    rng = np.random.default_rng(seed)
    make = WORKLOADS[workload]
    kw: dict = {}
    if arrival:
        kw["arrival"] = arrival
    if teacher_skew is not None:
        kw["teacher_skew"] = teacher_skew
    if images is not None:
        kw["images"] = images
    rows = make(trajectories, rng, **kw)
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    for col in ("think_s", "t1_s"):
        df[col] = df[col].astype(float).round(4)
    # the profiling error draws from its own stream: the same seed gives the same truth
    # whatever sigma, so a sweep over sigma changes only what the scheduler is told
    df = declare(df, np.random.default_rng([seed, 1]), sigma)
    if group_size is not None:
        df = assign_groups(df, group_size, _setup_draws(np.random.default_rng([seed, 2]),
                                                        -(-trajectories // group_size)))
    return df


def _setup_draws(rng: np.random.Generator, groups: int) -> np.ndarray:
    """One sandbox setup time per group (s)."""
    return np.clip(rng.lognormal(np.log(c("setup_median_s")), 0.7, groups), 5.0, 600.0).round(2)
