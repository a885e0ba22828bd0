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
#   2. scripts/torch_check.py: the torch TinyLM against numpy on the same weights, and the
#      Hugging Face loader (a small random Llama saved with save_pretrained, staged, restored,
#      log-probs) against transformers' own forward.
#
# Prints one JSON object: {"bench": {...}, "torch": {...}} (also written to $OUT/gpu_check.json
# when OUT is set). Exit code: non-zero when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}                      # DEVICE=cpu SIZES=0.02,0.05,0.1: a dry run, no GPU
SIZES=${SIZES:-1,3,8}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
rc=0
echo '{"error": "bench did not finish"}' > "$TMP/bench.json"
echo '{"error": "torch check did not finish"}' > "$TMP/hf.json"

timeout 360 "$PY" -m executor.gpu.bench --device "$DEVICE" --sizes-gb "$SIZES" \
    --batches 1,8,32 --tokens 128 --cycles 3 > "$TMP/bench.out" && cp "$TMP/bench.out" "$TMP/bench.json" || rc=1

# the torch paths: init: random on torch == numpy; the Hugging Face loader == transformers
hf=0
timeout 100 "$PY" scripts/torch_check.py --device "$DEVICE" > "$TMP/hf.out" || hf=$?
if [ -s "$TMP/hf.out" ]; then cp "$TMP/hf.out" "$TMP/hf.json"; fi
if [ "$hf" != 0 ]; then rc=1; fi

"$PY" - "$TMP" <<'EOF'
import json, os, sys
tmp = sys.argv[1]
out = {"bench": json.load(open(f"{tmp}/bench.json")), "torch": json.load(open(f"{tmp}/hf.json"))}
text = json.dumps(out, indent=1)
print(text)
if os.environ.get("OUT"):
    open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w").write(text)
EOF
exit $rc
