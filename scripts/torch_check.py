"""Check the torch paths of the GPU workers where torch and transformers are installed.

CI has neither (numpy only), so this is run by hand, or by scripts/gpu_check.sh on a GPU:

    PYTHONPATH=. python scripts/torch_check.py --device cpu     # torch's CPU build is enough
    PYTHONPATH=. python scripts/torch_check.py --device cuda

1. ``init: random`` on torch computes what the numpy path computes (same weights copied in).
2. The Hugging Face loader: a small random Llama saved with ``save_pretrained`` is staged by a
   worker process, restored as DoP-1 (and DoP-2/4 layer splits where there are GPUs for
   them), and its log-probs are compared with transformers' own forward; the device copies
   are verified against the host stage and the worker's resident set against the core's.

Prints one JSON object; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile

import numpy as np


def tiny_equal(device: str) -> dict:
    import torch

    from executor.gpu.arrays import NumpyOps, TorchOps
    from executor.gpu.model import TinyLM

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


def hf_equal(device: str, tmp: str) -> dict:
    import torch
    import transformers

    from executor.driver import LiveExecutor
    from executor.gpu.backend import GpuBackend
    from executor.gpu.config import checkpoint_bytes
    from executor.gpu.model import ModelSource
    from tangram.cluster import ClusterSpec, GpuNodeSpec, ServiceSpec
    from tangram.core import Tangram
    from tangram.model import Action, Demand

    path = f"{tmp}/tiny-llama"
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688,
                                   num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ref = transformers.LlamaForCausalLM(cfg).to(dtype)
    ref.save_pretrained(path)
    tokens = [[1, 17, 99, 5, 300, 42, 7, 8]]
    dev = "cuda:0" if device == "cuda" else "cpu"
    with torch.inference_mode():
        logits = ref.to(dev)(torch.tensor(tokens, device=dev)).logits.float()
    want = torch.log_softmax(logits, -1)[0, :-1].gather(
        -1, torch.tensor(tokens[0][1:], device=dev)[:, None])[:, 0].tolist()
    del ref
    gpus = torch.cuda.device_count() if device == "cuda" else 8
    node_gpus = max(g for g in (1, 2, 4, 8) if g <= gpus)
    size = checkpoint_bytes(path) / 1e9

    async def go() -> dict:
        core = Tangram(ClusterSpec(gpu_nodes=(GpuNodeSpec("g", node_gpus, 10.0),),
                                   services=(ServiceSpec("llama", size),)))
        be = GpuBackend(core.gpu, {"llama": ModelSource.hf(path)}, device,
                        {"g": list(range(node_gpus))})
        be.start_workers()
        await asyncio.to_thread(be.wait_ready, 120)
        ex = LiveExecutor(core, be)
        ex.open_trajectory("t")
        runs = []
        try:
            for i, k in enumerate([1, 1, 2, 4]):
                if k > node_gpus:
                    continue
                _, out = await ex.run(Action(f"h{i}", "hf", "t", "teacher_logprob",
                                             {"gpu": Demand.fixed(k)}, service="llama",
                                             payload={"op": "logprobs", "tokens": tokens}))
                got = json.loads(out.output)["logprobs"][0] if out.ok else None
                runs.append({"dop": k, "status": out.status, "error": out.error[:300],
                             "restored": out.extra.get("restored"),
                             "max_abs_diff_vs_transformers":
                                 max(abs(x - y) for x, y in zip(got, want, strict=True))
                                 if got else None})
            verify = [await be.verify("g", v) for v in sorted(core.gpu.resident_variants("g"))]
            same = await be.worker_resident("g") == core.gpu.resident_variants("g")
        finally:
            ex.close_trajectory("t")
            ex.shutdown()
        tol = 0.05 if device == "cuda" else 1e-4  # bfloat16 on cuda
        ok = (all(r["status"] == "ok" and r["max_abs_diff_vs_transformers"] <= tol
                  for r in runs) and same and all(v["equal"] for v in verify)
              and runs[0]["restored"] and not runs[1]["restored"])
        return {"ok": bool(ok), "runs": runs, "verify": verify, "resident_equals_core": same}

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = {"device": args.device, "tiny": tiny_equal(args.device),
               "hf": hf_equal(args.device, tmp)}
    print(json.dumps(out, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))
    sys.exit(0 if out["tiny"]["ok"] and out["hf"]["ok"] else 1)


if __name__ == "__main__":
    main()
