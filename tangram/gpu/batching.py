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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


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


@dataclass(frozen=True, slots=True)
class ForwardCost:
    """Measured seconds of one forward pass of a service:
    ``fixed_s + per_member_s * members + per_token_s * tokens`` (tokens of all members)."""

    fixed_s: float
    per_token_s: float
    per_member_s: float

    def seconds(self, tokens: Sequence[int]) -> float:
        return self.fixed_s + self.per_member_s * len(tokens) + self.per_token_s * sum(tokens)


@dataclass(frozen=True, slots=True)
class MeasuredGpu:
    """What a live GPU replay measured on its machine (``tangram run`` writes it into its
    cluster.yaml as ``extra.gpu_measured``), so a simulation of that cluster models the
    services the run served, not the trace's ``t1_s``: each GPU request is ``tokens``
    tokens, a batch is one forward pass (:class:`ForwardCost`), a restore moves the
    variant's bytes at the node's measured bandwidth, and every action pays the workers'
    measured overhead (dispatch, pipe, result hand-back)."""

    tokens: int
    forward: Mapping[str, ForwardCost]
    #: node -> measured host-to-device bandwidth (GB/s) of one restore
    restore_gbps: Mapping[str, float]
    #: the bandwidth the core models restores with (the cluster's ``restore_gbps``)
    modelled_gbps: float
    #: True: the k shards of a DoP-k restore load in parallel (one link per GPU, cuda);
    #: False: one after another (the cpu device)
    parallel_restore: bool = True
    overhead_s: float = 0.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], modelled_gbps: float) -> MeasuredGpu | None:
        """From a cluster's ``extra`` (None: it holds no measurements); ValueError names a
        bad field."""
        raw = extra.get("gpu_measured")
        if raw is None:
            return None
        where = "extra.gpu_measured"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: expected a mapping")

        def num(key: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not math.isfinite(value) or value < 0:
                raise ValueError(f"{where}.{key}: expected a number >= 0, got {value!r}")
            return float(value)

        forward = {}
        for name, f in (raw.get("forward") or {}).items():
            if not isinstance(f, Mapping):
                raise ValueError(f"{where}.forward.{name}: expected "
                                 "{fixed_s, per_token_s, per_member_s}")
            forward[str(name)] = ForwardCost(
                *(num(f"forward.{name}.{k}", f.get(k, 0.0))
                  for k in ("fixed_s", "per_token_s", "per_member_s")))
        gbps = {str(n): num(f"restore_gbps.{n}", v)
                for n, v in (raw.get("restore_gbps") or {}).items()}
        if any(v <= 0 for v in gbps.values()):
            raise ValueError(f"{where}.restore_gbps: every node's bandwidth must be > 0")
        tokens = raw.get("tokens", 0)
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"{where}.tokens: expected an integer >= 1, got {tokens!r}")
        return cls(tokens, forward, gbps, modelled_gbps, bool(raw.get("parallel_restore", True)),
                   num("overhead_s", raw.get("overhead_s", 0.0)))

    def exec_s(self, service: str, members: int) -> float | None:
        """A forward pass of ``members`` requests of ``service`` (None: not measured)."""
        f = self.forward.get(service)
        return None if f is None else f.seconds([self.tokens] * members)

    def restore_s(self, node: str | None, modelled_s: float, gpus: int) -> float:
        """The core's modelled restore (``size / (modelled_gbps * k)``, or what is left of a
        pre-restore) at the node's measured bandwidth instead."""
        gbps = self.restore_gbps.get(node or "")
        if not modelled_s or not gbps:
            return modelled_s
        return modelled_s * self.modelled_gbps / gbps * (1 if self.parallel_restore else gpus)
