"""Continuous batching of GPU service requests: how long a batch takes.

A resident model server (SGLang, vLLM) runs the queued requests of its service
together. The curve below is the *one* batching model of the project: the core
uses it to estimate a batch's time, the simulator's modelled backend to execute
it, for every policy alike (Tangram's shared pool, static deployments,
serverless instances), so no comparison gains from batching that another lacks.

The curve (batch of B requests, each alone taking ``s_i`` on the granted GPUs)::

    batch_s = sum(s_i) - (B - 1) * min(fixed_s, min(s_i))

Every forward pass pays a fixed overhead (scheduling, sampling, kernel launches;
the 0.05 s constant of the trace generators' request times) once; past that, a
prefill is compute-bound, so its time grows linearly with the tokens it holds:
batching prefills shares the fixed part and nothing else. Sources: DistServe
(Zhong et al., OSDI'24: once a prefill saturates the GPU - about 512 tokens for a
13B model on an A100 - batching more prefill work raises latency in proportion and
throughput no further); Vidur (Agrawal et al., MLSys'24) models prefill time as
linear in the batch's tokens. A batch holds at most one forward pass of prefill
tokens: SGLang's default ``max_prefill_tokens`` 16,384, i.e. 16,384 / 6,000 tok/s
= 2.73 s of one-GPU prefill work (``budget_s``); a request above it runs alone.

All members of a batch finish when the batch does (one forward pass), so a batch
never helps a request that would otherwise start at once: schedulers batch only
what would wait. Decode-heavy requests (an LLM judge's output) gain more from
batching than this curve gives them (decode is memory-bound); the curve is
conservative for them, and equally so for every policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchModel:
    #: per-forward-pass overhead shared by the batch (s)
    fixed_s: float = 0.05
    #: one-GPU seconds of work one batch may hold (SGLang max_prefill_tokens / prefill rate)
    budget_s: float = 16384 / 6000.0
    #: most requests in one batch (SGLang's running-request cap is far above what the
    #: token budget admits for log-prob requests; this only bounds a pathological queue)
    max_size: int = 64

    def __post_init__(self) -> None:
        if not self.fixed_s >= 0:
            raise ValueError(f"batch fixed_s: must be >= 0, got {self.fixed_s!r}")
        if not self.budget_s > 0:
            raise ValueError(f"batch budget_s: must be > 0, got {self.budget_s!r}")
        if self.max_size < 1:
            raise ValueError(f"batch max_size: must be >= 1, got {self.max_size!r}")

    def batch_s(self, solo: Sequence[float]) -> float:
        """Time of one batch whose members would each take ``solo[i]`` alone."""
        if not solo:
            return 0.0
        shared = min(self.fixed_s, min(solo))
        return sum(solo) - (len(solo) - 1) * shared

    def admits(self, work_s: float, add_s: float, size: int) -> bool:
        """Whether a request of ``add_s`` one-GPU seconds joins a batch already holding
        ``size`` requests of ``work_s`` one-GPU seconds."""
        return size < self.max_size and work_s + add_s <= self.budget_s


#: the batching model every policy uses
DEFAULT_BATCHING = BatchModel()
