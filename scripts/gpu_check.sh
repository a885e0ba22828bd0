#!/usr/bin/env bash
# GPU check of the EOE workers on a real NVIDIA GPU (at most 8 minutes).
#
# Needs only: python3 with torch (CUDA), numpy, nvidia-ml-py, pyyaml (transformers brings it)
# and, for step 2, transformers. Nothing is installed; the repository is put on PYTHONPATH.
#
#   1. `python -m executor.gpu.bench --device cuda`: three services of about 1, 3 and 8 GB
#      (Llama-shaped configs, random weights, bfloat16) cycling on GPU 0 through the real path
#      (core -> GpuBackend -> worker process): restore GB/s per size beside a plain pinned
#      host-to-device torch copy of the same bytes (target: restore >= 80% of it), evict
#      latency, request latency at batch 1/8/32, device copies verified against the host
#      stage, NVML readings and discovery.
#   2. The Hugging Face loader: a small random Llama saved with save_pretrained, served by a
#      worker (staged, restored, log-probs) and compared with transformers' own forward.
#
# Prints one JSON object: {"bench": {...}, "hf": {...}} (also written to $OUT/gpu_check.json
# when OUT is set). Exit code: non-zero when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

timeout 360 "$PY" -m executor.gpu.bench --device cuda --sizes-gb 1,3,8 --batches 1,8,32 \
    --tokens 128 --cycles 3 > "$TMP/bench.json"

timeout 100 "$PY" - "$TMP" > "$TMP/hf.json" <<'EOF'
import asyncio, json, sys, time
import torch, transformers
from executor.driver import LiveExecutor
from executor.gpu.backend import GpuBackend
from executor.gpu.model import ModelSource
from executor.gpu.config import checkpoint_bytes
from tangram.cluster import ClusterSpec, GpuNodeSpec, ServiceSpec
from tangram.core import Tangram
from tangram.model import Action, Demand

path = f"{sys.argv[1]}/tiny-llama"
cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688,
                               num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
torch.manual_seed(0)
ref = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
ref.save_pretrained(path)
tokens = [[1, 17, 99, 5, 300, 42, 7, 8]]
with torch.inference_mode():
    logits = ref.to("cuda:0")(torch.tensor(tokens, device="cuda:0")).logits.float()
want = torch.log_softmax(logits, -1)[0, :-1].gather(-1, torch.tensor(tokens[0][1:],
       device="cuda:0")[:, None])[:, 0].tolist()
del ref
size = checkpoint_bytes(path) / 1e9

async def go():
    core = Tangram(ClusterSpec(gpu_nodes=(GpuNodeSpec("g", 1, 10.0),),
                               services=(ServiceSpec("llama", size),)))
    be = GpuBackend(core.gpu, {"llama": ModelSource.hf(path)}, "cuda", {"g": [0]})
    be.start_workers()
    await asyncio.to_thread(be.wait_ready, 90)
    ex = LiveExecutor(core, be)
    ex.open_trajectory("t")
    try:
        outs = []
        for i in range(2):
            _, out = await ex.run(Action(f"h{i}", "hf", "t", "teacher_logprob",
                                         {"gpu": Demand.fixed(1)}, service="llama",
                                         payload={"op": "logprobs", "tokens": tokens}))
            outs.append(out)
        verify = await be.verify("g", ("llama", 1, 0))
    finally:
        ex.close_trajectory("t")
        ex.shutdown()
    got = json.loads(outs[0].output)["logprobs"][0] if outs[0].ok else None
    err = max(abs(a - b) for a, b in zip(got, want)) if got else None
    return {"ok": all(o.ok for o in outs), "errors": [o.error for o in outs if not o.ok],
            "restored_first": outs[0].extra.get("restored"), "hit_second": not outs[1].extra.get("restored"),
            "max_abs_logprob_diff_vs_transformers": err, "verify": verify}

print(json.dumps(asyncio.run(go())))
EOF

"$PY" - "$TMP" <<'EOF'
import json, os, sys
tmp = sys.argv[1]
out = {"bench": json.load(open(f"{tmp}/bench.json")), "hf": json.load(open(f"{tmp}/hf.json"))}
text = json.dumps(out, indent=1)
print(text)
if os.environ.get("OUT"):
    open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w").write(text)
EOF
