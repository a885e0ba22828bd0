"""``tangram bench gpu``: restore bandwidth, evict latency and request latency of the
GPU workers, through the real path (core -> GpuBackend -> worker process).

Services of the given sizes (``init: random``, Llama-shaped) share one GPU whose
memory holds only the largest, so cycling through them restores (and evicts)
on every action. Restore GB/s is set beside a plain copy of the same bytes on the
same machine: a pinned host-to-device ``torch`` copy on cuda, a ``memcpy`` of
host memory on the cpu device.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Annotated, Any

import numpy as np

from analysis.bench import QUIET, BenchError, Opt, Progress
from executor.backends.gpu.backend import GpuBackend
from executor.backends.gpu.config import discover, itemsize_for, readings
from executor.backends.gpu.model import ModelSource, config_for_bytes, random_size_bytes
from executor.driver import LiveExecutor
from tangram.cluster import ClusterSpec, GpuNodeSpec, ServiceSpec
from tangram.core import Tangram
from tangram.model import Action, Demand


def plain_copy_gbps(device: str, nbytes: int, repeats: int = 3) -> float:
    """Best of ``repeats`` plain copies of ``nbytes``: pinned host -> GPU 0 (cuda), or
    host -> host (cpu)."""
    best = float("inf")
    if device == "cuda":
        import torch

        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
        src.normal_()
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst = src.to("cuda:0", non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
            del dst
        del src
        torch.cuda.empty_cache()
    else:
        src = np.ones(nbytes // 4, dtype=np.float32)
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst = src.copy()
            best = min(best, time.perf_counter() - t0)
            del dst
    return nbytes / 1e9 / best


def _stats(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs)
    return {"p50": round(float(np.percentile(a, 50)), 6), "min": round(float(a.min()), 6),
            "max": round(float(a.max()), 6), "n": int(a.size)}


def gpu_bench(device: str, sizes_gb: list[float], batches: list[int], tokens: int = 128,
              cycles: int = 3, layers: int | None = None,
              progress: Progress = QUIET) -> dict[str, Any]:
    itemsize = itemsize_for(device, None)
    layers = layers or (24 if device == "cuda" else 4)
    vocab = 32000 if device == "cuda" else 512
    sources, services, configs = {}, [], {}
    for i, gb in enumerate(sizes_gb):
        name = f"svc{i}-{gb:g}gb"
        config = config_for_bytes(int(gb * 1e9), itemsize, layers, vocab, heads=8)
        configs[name] = config
        sources[name] = ModelSource.random(config, seed=i)
        services.append(ServiceSpec(name, random_size_bytes(config, itemsize) / 1e9))
    biggest = max(s.size_gb for s in services)
    # one GPU that holds the largest service but never it and another: cycling restores
    mem = biggest + min(s.size_gb for s in services) * 0.5
    cluster = ClusterSpec(gpu_nodes=(GpuNodeSpec("bench", 1, mem),), services=tuple(services))
    result: dict[str, Any] = {"device": device, "layers": layers, "tokens": tokens}

    async def go() -> None:
        core = Tangram(cluster)
        backend = GpuBackend(cluster, sources, device, {"bench": [0]})
        progress.phase(f"staging {len(services)} services")
        backend.start_workers()
        t0 = time.perf_counter()
        ready = await asyncio.to_thread(backend.wait_ready)
        result["stage_s"] = round(time.perf_counter() - t0, 3)
        result["ops"] = ready["bench"].get("ops")
        ex = LiveExecutor(core, backend)
        ex.open_trajectory("bench", "bench")
        n = 0
        restores: dict[str, list[tuple[float, int]]] = {s.name: [] for s in services}
        evicts: list[float] = []
        total = cycles * len(services) + 5 * len(batches)  # restores, then requests
        try:
            progress.phase(f"{cycles} restore cycles")
            for _ in range(cycles):
                for s in services:
                    progress(n, total)
                    n += 1
                    _, out = await ex.run(Action(f"r{n}", "bench", "bench", "restore",
                                                 {"gpu": Demand.fixed(1)}, service=s.name,
                                                 payload={"op": "logprobs", "tokens": [[1, 2]]}))
                    if not out.ok:
                        raise RuntimeError(f"bench action failed: {out.error}")
                    if out.extra.get("restored"):
                        restores[s.name].append((out.extra["restore_s"],
                                                 out.extra["restore_bytes"]))
                    if out.extra.get("evicted"):
                        evicts.append(out.extra["evict_s"])
            # the device copies equal their host stage, and the worker holds what the core says
            (node,) = ex.snapshot().gpu_nodes
            resident = frozenset(node.resident)
            if await backend.worker_resident("bench") != resident:
                raise RuntimeError("bench: the worker's resident set differs from the core's")
            result["verify"] = [{"variant": list(v), **(await backend.verify("bench", v))}
                                for v in sorted(resident)]
            small = services[0].name
            rng = np.random.default_rng(0)
            latency = {}
            progress.phase("request batches")
            for b in batches:
                acts, computes = [], []
                for _ in range(5):
                    progress(n, total)
                    n += 1
                    rows = rng.integers(0, vocab, size=(b, tokens)).tolist()
                    t_submit = time.perf_counter()
                    _, out = await ex.run(Action(f"q{n}", "bench", "bench", "teacher_logprob",
                                                 {"gpu": Demand.fixed(1)}, service=small,
                                                 payload={"op": "logprobs", "tokens": rows}))
                    if not out.ok:
                        raise RuntimeError(f"bench request failed: {out.error}")
                    if out.extra.get("restored"):
                        continue  # the first one after the cycle restores: not a request figure
                    acts.append((time.perf_counter() - t_submit) * 1e3)
                    computes.append(out.extra["compute_s"] * 1e3)
                latency[str(b)] = {"act_ms": _stats(acts), "compute_ms": _stats(computes)}
            result["request_latency"] = latency
            progress(n, total)
        finally:
            ex.close_trajectory("bench")
            ex.shutdown()
        rows = []
        for s in services:
            rs = restores[s.name]
            gbps = [b / 1e9 / t for t, b in rs if t > 0]
            rows.append({"service": s.name, "size_gb": round(s.size_gb, 4),
                         "config": configs[s.name], "restores": len(rs),
                         "restore_s": _stats([t for t, _ in rs]) if rs else None,
                         "restore_gbps": _stats(gbps) if gbps else None})
        result["services"] = rows
        result["evict_ms"] = _stats([e * 1e3 for e in evicts]) if evicts else None

    asyncio.run(go())
    plain = {}
    for row in result["services"]:
        nbytes = int(row["size_gb"] * 1e9)
        plain[row["service"]] = round(plain_copy_gbps(device, nbytes), 3)
        if row["restore_gbps"]:
            row["plain_copy_gbps"] = plain[row["service"]]
            row["restore_vs_plain"] = round(row["restore_gbps"]["p50"] / plain[row["service"]], 3)
    result["plain_copy"] = ("pinned host -> cuda:0, torch, best of 3" if device == "cuda"
                            else "host memcpy (numpy), best of 3")
    if device == "cuda":
        try:
            result["nvml"] = readings([0])
            result["discovery"] = discover()[2]
        except RuntimeError as e:
            result["nvml_error"] = str(e)
    return result


def main(argv: list[str] | None = None) -> None:
    """``python -m analysis.bench.gpu``: the bench without the CLI's dependencies (typer,
    fastapi, pandas), for a machine that has only torch, numpy and nvidia-ml-py."""
    import argparse
    import json

    from executor.backends.gpu.arrays import make_ops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--sizes-gb", default=None, help="comma-separated (default 1,3,8 on cuda)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cycles", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        make_ops(args.device)
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    sizes = [float(x) for x in (args.sizes_gb or ("1,3,8" if args.device == "cuda"
                                                  else "0.02,0.05,0.1")).split(",")]
    print(json.dumps(gpu_bench(args.device, sizes, [int(b) for b in args.batches.split(",")],
                               args.tokens, args.cycles)), flush=True)


def command(
    device: Annotated[str, Opt("cuda or cpu.")] = "cpu",
    sizes_gb: Annotated[str | None, Opt(
        "Service sizes (GB), comma-separated. Default: 1,3,8 on cuda; 0.02,0.05,0.1 on "
        "cpu.")] = None,
    batches: Annotated[str, Opt("Request batch sizes.")] = "1,8,32",
    tokens: Annotated[int, Opt("Tokens per sequence of a request.", min=2)] = 128,
    cycles: Annotated[int, Opt("Restore cycles over all services.", min=1)] = 3,
    progress: Progress = QUIET,
) -> Iterator[dict[str, Any]]:
    from executor.backends.gpu.arrays import check_device

    try:
        check_device(device)
    except ValueError as e:
        raise BenchError(str(e)) from None
    try:
        sizes = [float(x) for x in (sizes_gb or ("1,3,8" if device == "cuda" else
                                                 "0.02,0.05,0.1")).split(",")]
        batch = [int(x) for x in batches.split(",")]
    except ValueError:
        raise BenchError("--sizes-gb/--batches: comma-separated numbers") from None
    yield gpu_bench(device, sizes, batch, tokens, cycles, progress=progress)


if __name__ == "__main__":
    main()
