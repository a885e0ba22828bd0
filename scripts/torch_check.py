"""Check the torch paths of the GPU workers where torch and transformers are installed.

CI may have neither (numpy only), so this is run by hand, or by scripts/gpu_check.sh on a GPU:

    PYTHONPATH=. python scripts/torch_check.py --device cpu     # torch's CPU build is enough
    PYTHONPATH=. python scripts/torch_check.py --device cuda

1. ``init: random`` on torch computes what the numpy path computes (same weights copied in).
2. The Hugging Face loader, in bfloat16 (what a GPU serves), against an **float32
   reference at long positions**: a small random Llama (its weights rounded to bfloat16,
   so reference and candidate hold the same weights and only the arithmetic differs) is
   saved with ``save_pretrained``, staged by a worker process in bfloat16, restored as
   DoP 1 and as every layer split the machine has GPUs for (DoP 2/4/8; one GPU: DoP 1
   only, and the report says so), and the log-probs of one sequence of ``--long`` tokens
   are compared with transformers' float32 forward, at the first positions and at the
   last ones. Rotary frequencies rounded to bfloat16 shift every angle by up to
   ``position * 2**-9`` radians: invisible at short positions, large at long ones.
3. That this comparison would catch such drift: the same model in process, its rotary
   buffers converted to bfloat16 (what staging every tensor in the model's dtype did),
   must fail it (``rotary_bf16_detected``).

Prints one JSON object; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from typing import Any

import numpy as np

#: tolerance of |log-prob(bfloat16 candidate) - log-prob(float32 reference)|, at the first
#: 64 and the last 256 positions. bfloat16 arithmetic alone (weights identical) stays near
#: 0.01 on this model; a bfloat16 rotary table moves the long positions by 0.1 and more
#: (both figures are printed by every run: diffs and rotary_bf16_detected)
TOLERANCE = 0.04
#: query/key weights scaled up so attention is sharp and depends on position (random
#: weights at init scale attend almost uniformly: any rotary error would go unseen)
QK_SCALE = 4.0


def tiny_equal(device: str) -> dict:
    import torch

    from executor.backends.gpu.arrays import NumpyOps, TorchOps
    from executor.backends.gpu.model import TinyLM

    cfg = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2}
    ref = TinyLM(NumpyOps(), cfg, 0)
    # float32 on both sides: the comparison is of the computation, not of bfloat16 rounding
    ops = TorchOps(device, "float32")
    model = TinyLM(ops, cfg, 0)
    model.host.copy_(torch.from_numpy(ref.host))
    req = {"op": "logprobs", "tokens": [[1, 5, 9, 3, 2], [7, 7, 1]]}
    a = ref.run(ref.place(1, [0]), [0], req, lambda: False)["logprobs"]
    b = model.run(model.place(1, [0]), [0], req, lambda: False)["logprobs"]
    diff = max(abs(x - y) for r1, r2 in zip(a, b, strict=True) for x, y in zip(r1, r2, strict=True))
    return {"ok": diff < 1e-4, "max_abs_diff_numpy_vs_torch": diff}


def llama_checkpoint(tmp: str, long: int) -> str:
    """A small random Llama whose weights are bfloat16 values, saved in float32."""
    import torch
    import transformers

    path = f"{tmp}/tiny-llama"
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688,
                                   num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4, max_position_embeddings=long)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(path)
    return path


def sequence(long: int) -> list[int]:
    return np.random.default_rng(1).integers(0, 1024, size=long).tolist()


def reference(path: str, device: str, tokens: list[int]) -> list[float]:
    """transformers' own forward in float32: log-prob of every token given its prefix."""
    import torch
    import transformers

    dev = "cuda:0" if device == "cuda" else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32).to(dev).eval()
    ids = torch.tensor([tokens], device=dev)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.float()
    out = torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    return out.double().cpu().tolist()


def compare(got: list[float], want: list[float]) -> dict[str, Any]:
    """Largest differences at the first 64 and the last 256 positions, and the verdict."""
    d = np.abs(np.asarray(got) - np.asarray(want))
    short, long = float(d[:64].max()), float(d[-256:].max())
    return {"max_abs_diff_short": round(short, 5), "max_abs_diff_long": round(long, 5),
            "ok": bool(short <= TOLERANCE and long <= TOLERANCE)}


def rotary_drift(path: str, device: str, tokens: list[int], want: list[float]) -> dict:
    """The comparison on the loader's bfloat16 model in process, then with its rotary
    buffers converted to bfloat16: the first must pass it, the second must not."""
    import torch

    from executor.backends.gpu.arrays import make_ops
    from executor.backends.gpu.model import HFModel

    model = HFModel(make_ops(device), path, "bfloat16")
    rotary = {t.name: t.dtype for t in model.layout.tensors if "inv_freq" in t.name}
    placed = model.place(1, [0])
    req = {"op": "logprobs", "tokens": [tokens]}
    staged = compare(model.run(placed, [0], req, lambda: False)["logprobs"][0], want)
    for mod in placed.runner.modules():
        for name, buf in list(mod._buffers.items()):
            if buf is not None and "inv_freq" in name:
                mod._buffers[name] = buf.to(torch.bfloat16)
    drifted = compare(model.run(placed, [0], req, lambda: False)["logprobs"][0], want)
    return {"staged_rotary_dtypes": rotary, "staged": staged, "rotary_bf16": drifted,
            "rotary_bf16_detected": not drifted["ok"],
            "ok": bool(staged["ok"] and not drifted["ok"]
                       and all(d == "float32" for d in rotary.values()) and rotary)}


def worker_path(cluster: Any, source: Any, device: str, physical: dict[str, list[int]],
                dops: list[int], tokens: list[int], judge: Any) -> dict:
    """One service ``llama`` on node ``g`` through the real path (core -> GpuBackend ->
    worker process): a log-prob request at each DoP of ``dops`` (the first two at DoP 1:
    restore, then reuse), each result judged by ``judge(logprobs or None)``; then the
    device copies against their host stage and the worker's resident set against the
    core's (read through the core's door, its snapshot)."""
    from executor.backends.gpu.backend import GpuBackend
    from executor.driver import LiveExecutor
    from tangram.core import Tangram
    from tangram.model import Action, Demand

    async def go() -> dict:
        core = Tangram(cluster)
        be = GpuBackend(cluster, {"llama": source}, device, physical)
        be.start_workers()
        await asyncio.to_thread(be.wait_ready, 300)
        ex = LiveExecutor(core, be)
        ex.open_trajectory("t")
        runs = []
        try:
            for i, k in enumerate(dops):
                _, out = await ex.run(Action(f"h{i}", "hf", "t", "teacher_logprob",
                                             {"gpu": Demand.fixed(k)}, service="llama",
                                             payload={"op": "logprobs", "tokens": [tokens]}))
                got = json.loads(out.output)["logprobs"][0] if out.ok else None
                runs.append({"dop": k, "status": out.status, "error": out.error[:300],
                             "restored": out.extra.get("restored"), **judge(got)})
            (node,) = ex.snapshot().gpu_nodes
            resident = frozenset(node.resident)
            verify = [await be.verify("g", v) for v in sorted(resident)]
            same = await be.worker_resident("g") == resident
        finally:
            ex.close_trajectory("t")
            ex.shutdown()
        ok = (all(r["status"] == "ok" and r["ok"] for r in runs) and same
              and all(v["equal"] for v in verify) and runs[0]["restored"]
              and not runs[1]["restored"])
        return {"ok": bool(ok), "runs": runs, "verify": verify, "resident_equals_core": same}

    return asyncio.run(go())


def wiring() -> dict:
    """The worker path without torch (numpy weights, the cpu device, 8 stand-in GPUs): what
    the GPU check drives, so a broken script or a changed constructor fails here, in CI,
    rather than on the GPU machine. Numerics are not judged (numpy against itself)."""
    from executor.backends.gpu.model import ModelSource, random_size_bytes
    from tangram.cluster import ClusterSpec, GpuNodeSpec, ServiceSpec

    cfg = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2}
    cluster = ClusterSpec(gpu_nodes=(GpuNodeSpec("g", 8, 10.0),),
                          services=(ServiceSpec("llama", random_size_bytes(cfg, 4) / 1e9),))
    out = worker_path(cluster, ModelSource.random(cfg), "cpu", {"g": list(range(8))},
                      [1, 1, 2, 4, 8], [1, 5, 9, 3, 2],
                      lambda got: {"ok": got is not None and len(got) == 4})
    return {**out, "device": "cpu", "dops_tested": [1, 2, 4, 8]}


def hf_equal(device: str, tmp: str, long: int) -> dict:
    """The worker path (core -> GpuBackend -> worker process) in bfloat16 against the
    float32 reference, at DoP 1 (twice: restore, then reuse) and every layer split this
    machine has GPUs for."""
    import torch

    from executor.backends.gpu.config import checkpoint_bytes
    from executor.backends.gpu.model import ModelSource
    from tangram.cluster import ClusterSpec, GpuNodeSpec, ServiceSpec

    path = llama_checkpoint(tmp, long)
    tokens = sequence(long)
    want = reference(path, device, tokens)
    drift = rotary_drift(path, device, tokens, want)
    seen = torch.cuda.device_count() if device == "cuda" else 8
    node_gpus = max(g for g in (1, 2, 4, 8) if g <= max(seen, 1))
    dops = [1, 1] + [k for k in (2, 4, 8) if k <= node_gpus]
    size = checkpoint_bytes(path) / 1e9

    cluster = ClusterSpec(gpu_nodes=(GpuNodeSpec("g", node_gpus, 10.0),),
                          services=(ServiceSpec("llama", size),))
    out = worker_path(cluster, ModelSource.hf(path, "bfloat16"), device,
                      {"g": list(range(node_gpus))}, dops, tokens,
                      lambda got: compare(got, want) if got else {"ok": False})
    out.update({"dtype": "bfloat16", "reference": "float32", "positions": long,
                "tolerance": TOLERANCE})
    where = f"{seen} GPU(s)" if device == "cuda" else "cpu device, 8 stand-in GPUs"
    note = (f"{where}: layer splits DoP {[k for k in dops if k > 1]} tested" if node_gpus > 1
            else f"{where}: DoP 1 only; layer splits (DoP 2/4/8) need more GPUs, not tested")
    return {**out, "ok": bool(out["ok"] and drift["ok"]), "gpus_seen": seen,
            "dops_tested": sorted(set(dops)), "layer_split": note, "rotary_drift": drift}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--wiring", action="store_true",
                    help="only the worker path without torch (numpy weights, cpu device): "
                         "what CI runs so that a broken check cannot land")
    ap.add_argument("--long", type=int, default=4096,
                    help="tokens of the compared sequence (its last positions are the long ones)")
    args = ap.parse_args()
    if args.wiring:
        out = {"wiring": wiring()}
        print(json.dumps(out, default=str))
        sys.exit(0 if out["wiring"]["ok"] else 1)
    with tempfile.TemporaryDirectory() as tmp:
        out = {"device": args.device, "tiny": tiny_equal(args.device),
               "hf": hf_equal(args.device, tmp, args.long)}
    print(json.dumps(out, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))
    sys.exit(0 if out["tiny"]["ok"] and out["hf"]["ok"] else 1)


if __name__ == "__main__":
    main()
