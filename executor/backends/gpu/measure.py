"""What a live GPU replay measures on its machine, for the simulator to model the same
services (``extra.gpu_measured`` of the run's cluster.yaml, read back by
:class:`tangram.gpu.batching.MeasuredGpu`).

Before the first action (the workers idle), every service is probed on a temporary copy
(residency untouched): one restore per node (host-to-device bandwidth of that node) and,
on the first node, forward passes of ``(members, tokens)`` shapes, fitted by least
squares to ``fixed_s + per_member_s * members + per_token_s * tokens``. After the run,
a node's restore bandwidth is that of the run's own restores there (bytes / seconds;
the probe's where the node restored nothing: a probe's repeated copies can run faster
than the run's, which land on fresh pages amid other work), and the workers' overhead
per action is what an action took beyond its restore and its forward pass (dispatch,
pipe, thread start, result hand-back), the median over the run.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from executor.backends.gpu.backend import GpuBackend
from tangram.cluster import ClusterSpec, GpuNodeSpec


def shapes_for(tokens: int) -> list[tuple[int, int]]:
    """Shapes that separate the three costs: one member of 1/2, 1 and 2x ``tokens``, and
    2, 4 and 8 members of ``tokens`` each."""
    half = max(tokens // 2, 2)
    return [(1, half), (1, tokens), (1, 2 * tokens), (2, tokens), (4, tokens), (8, tokens)]


def fit_forward(points: Sequence[Sequence[float]]) -> dict[str, float]:
    """``[members, tokens per member, seconds]`` points -> the three costs (least squares,
    each clipped at 0: a cost too small to see is 0, not negative)."""
    a = np.array([[1.0, m, m * t] for m, t, _ in points])
    y = np.array([s for _, _, s in points])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    fixed, member, token = (max(float(c), 0.0) for c in coef)
    return {"fixed_s": fixed, "per_member_s": member, "per_token_s": token}


def probe_dop(size_gb: float, node: GpuNodeSpec) -> int | None:
    """The fewest GPUs of ``node`` a service of ``size_gb`` fits on (None: none)."""
    return next((k for k in (1, 2, 4, 8) if k <= node.gpus and size_gb / k <= node.gpu_mem_gb),
                None)


def measure(backend: GpuBackend, tokens: int, cluster: ClusterSpec,
            repeats: int = 3) -> dict[str, Any]:
    """Probe every service on every node (workers started and staged, nothing running
    yet): a service on the fewest GPUs it fits on. A probe that fails (out of memory) is
    reported, not fatal: the simulator then models that service from the trace."""
    restore: dict[str, float] = {}
    forward: dict[str, dict[str, float]] = {}
    points: dict[str, list] = {}
    errors: dict[str, str] = {}
    sizes = {s.name: s.size_gb for s in cluster.services}
    for i, node in enumerate(sorted(cluster.gpu_nodes, key=lambda n: n.name)):
        moved, seconds = 0, 0.0
        for s in sorted(backend.sources):
            k = probe_dop(sizes.get(s, 0.0), node)
            if k is None:
                continue
            shapes = shapes_for(tokens) if i == 0 else []
            try:
                reply = backend.probe(node.name, s, k, shapes, repeats)
            except RuntimeError as e:
                errors[f"{node.name}/{s}"] = str(e)
                continue
            moved += int(reply["bytes"])
            # the bandwidth of one GPU's link: k shards load in parallel on cuda
            seconds += float(reply["restore_s"]) * (k if backend.device == "cuda" else 1)
            if shapes:
                points[s] = reply["forwards"]
                forward[s] = fit_forward(reply["forwards"])
        if seconds > 0:
            restore[node.name] = moved / 1e9 / seconds
    return {"device": backend.device, "tokens": tokens, "restore_gbps": restore,
            "forward": forward, "parallel_restore": backend.device == "cuda",
            "probe_points": points, "probe_errors": errors, "repeats": repeats,
            "loadavg": os.getloadavg()[0]}


def overhead_s(spans: Mapping[str, float], measured: Mapping[str, Mapping[str, Any]]
               ) -> float | None:
    """Mean seconds a GPU action took beyond its restore and its forward pass:
    ``spans`` (action id -> end - start of its record) against what its worker measured.

    The mean, not the median: the simulator adds this to every action, and what it is to
    predict is the mean ACT; the overhead's distribution is right-skewed (a loaded
    machine's scheduling delays), so the median under-predicts the mean (measured on the
    MOPD sample: simulated mean ACT 0.54-0.74 of live with the median)."""
    extra = [spans[a] - float(m.get("restore_s", 0.0)) - float(m.get("compute_s", 0.0))
             for a, m in measured.items() if a in spans and m.get("node")]
    return max(statistics.fmean(extra), 0.0) if extra else None


def after_run(costs: Mapping[str, Any], spans: Mapping[str, float],
              measured: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``costs`` (from :func:`measure`) with what the run itself measured: each node's
    restore bandwidth over its restores, and the workers' overhead per action."""
    moved: dict[str, list[float]] = {}  # node -> [bytes, seconds, restores]
    for aid, m in measured.items():
        if m.get("batch_of", aid) != aid:
            continue  # a batch restores once: its lead reports it
        if m.get("restored") and m.get("restore_bytes") and m.get("restore_s"):
            acc = moved.setdefault(str(m.get("node")), [0.0, 0.0, 0])
            acc[0] += float(m["restore_bytes"])
            acc[1] += float(m["restore_s"])
            acc[2] += 1
    probe = dict(costs.get("restore_gbps", {}))
    return {**costs,
            "restore_gbps": {**probe, **{n: b / 1e9 / s for n, (b, s, _) in moved.items()}},
            "probe_restore_gbps": probe,
            "restores_measured": {n: int(c) for n, (_, _, c) in moved.items()},
            "overhead_s": overhead_s(spans, measured) or 0.0}
