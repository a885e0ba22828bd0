"""The benchmarks: one module per benchmark, each printing its figures as JSON lines.

``BENCHES`` is the table `tangram bench NAME` runs (tangram_cli/bench.py builds one
command per line): the benchmark's function, a generator of rows (each printed as one
JSON line as it comes), whose parameters are the command's options. An option's help
and bounds are an :class:`Opt` in its annotation, so the benchmarks import no CLI
library; a bad value raises :class:`BenchError` (the command says it and exits 2). A
parameter named ``progress`` is not an option: the command passes its :class:`Progress`
there (done / total, the phase now).

Benchmarks run as ``python -m analysis.bench.NAME`` only (not in the table): files (the
file API on both sandbox backends), tmp_cost (a sandbox's private /tmp, against another
source tree), hardening and loop_stall (a server's figures under uploads, event streams
and long commands; they start it with tests/conftest.py's helper), verl_stall (verl's
stock tool loop against a memory-overcommitted batch; needs verl). Not benchmarks, and
not here: ``python -m executor.bench.burn`` (`tangram burn`, the CPU worker the live
replay runs), the regret matrix and the paper's experiments (analysis/regret.py,
analysis/experiments.py: `bench regret` and `bench gpu-target` run them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Opt:
    """A benchmark option's help and bounds (tangram_cli/bench.py makes it a typer
    option); ``flag``: the option's one name for a boolean without a ``--no-`` form."""

    help: str = ""
    min: float | None = None
    max: float | None = None
    flag: str | None = None


class BenchError(ValueError):
    """A bad option value or setting: `tangram bench NAME` says it and exits 2."""


class Progress:
    """What a benchmark says of its progress, given as its ``progress`` parameter (not an
    option: `tangram bench` passes its own, which shows it on stderr: a bar on a terminal,
    a line every ~10 s off one). ``progress(done, total)`` for countable work (then the
    rate and an estimate of the time left are shown), ``progress.phase(name)`` for what
    runs now. This one, the default, shows nothing (``python -m analysis.bench.NAME``,
    a test calling the function)."""

    def __call__(self, done: int, total: int) -> None:
        pass

    def phase(self, name: str) -> None:
        pass


#: the default ``progress`` of a benchmark's function: nothing shown
QUIET = Progress()


#: name -> ("module:function" of analysis/bench/, the first paragraph of its help)
BENCHES: dict[str, tuple[str, str]] = {
    "scheduler": ("scheduler:command",
                  "Scheduling pass latency and dispatch throughput on one core (JSON lines)."),
    "regret": ("regret:command",
               "The regret matrix: per cell (workload x seed x cluster x arrival rate x "
               "profile error) and metric, the default policy's figure over the best "
               "competitor's."),
    "gpu-target": ("gpu_target:command",
                   "The GPU target: burst MOPD on the paper's cluster under tangram, "
                   "tangram-paper, static and serverless, then the verdict."),
    "learning": ("learning:command",
                 "Runs the online speedup model needs to come within 10% of the true curve "
                 "(JSON lines)."),
    "sim-scale": ("sim_scale:command",
                  "What `tangram simulate` costs at fleet scale, whole and per phase, beside "
                  "a bare SimPy model of the same trace and closed loop (JSON lines)."),
    "simulate": ("simulate:command",
                 "Wall time of one paper-scale AI-coding step on the paper's CPU cluster "
                 "(JSON)."),
    "executor": ("executor:command",
                 "Per-action overhead of the live backends: submit->start, end->result "
                 "(JSON lines)."),
    "serve": ("serve:command",
              "Load on a real `tangram serve`: server CPU per action, throughput, "
              "first-action latency, RSS over the run (one JSON line)."),
    "serve-scale": ("serve:scale_command",
                    "One paper-scale RL step through a real `tangram serve` (process "
                    "backend), sampled over time (JSON lines)."),
    "gpu": ("gpu:command",
            "Restore GB/s per service size (beside a plain host-to-device copy), evict "
            "latency, request latency per batch size, NVML readings on cuda (JSON)."),
    "adapters": ("adapters:command",
                 "Per-call overhead of the verl, gymnasium and SkyRL adapters over the plain "
                 "client (JSON)."),
    "live-mix": ("live_mix:command",
                 "A real test suite beside short shell commands through a real `tangram "
                 "serve`, under each policy in turn (JSON lines)."),
    "fork": ("fork:command",
             "A GRPO group on a real `tangram serve`: every rollout preparing its sandbox "
             "against one preparation forked into the others (one JSON line)."),
    "images": ("images:command",
               "SWE-style rollouts with a container image per task, simulated: environment "
               "start p50/p99, step time and cache hit rate per policy, 95% intervals over "
               "seeds; --live: then a live run from a local registry beside its simulation "
               "(JSON lines)."),
    "fork-sim": ("fork_sim:command",
                 "The coding workload in GRPO groups, simulated with and without forking the "
                 "prepared sandbox (JSON lines)."),
}
