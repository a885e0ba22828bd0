#!/usr/bin/env bash
# GPU check of the EOE workers on a real NVIDIA GPU (at most 8 minutes).
# DEVICE=cpu is its dry run: every step runs, those that need torch or a GPU fail and say why
# (tests/test_gpu_worker.py runs it in CI: the wiring and bench steps must pass there).
#
# Needs only: python3 with torch (CUDA), numpy, nvidia-ml-py, pyyaml (transformers brings it)
# and, for step 2, transformers. Nothing is installed; the repository is put on PYTHONPATH.
#
#   1. `python -m analysis.bench.gpu --device cuda`: three services of about 1, 3 and 8 GB
#      (Llama-shaped configs, random weights, bfloat16) cycling on GPU 0 through the real path
#      (core -> GpuBackend -> worker process): restore GB/s per size beside a plain pinned
#      host-to-device torch copy of the same bytes (target: restore >= 80% of it), evict
#      latency, request latency at batch 1/8/32, device copies verified against the host
#      stage, NVML readings and discovery.
#   2. scripts/torch_check.py: the torch TinyLM against numpy on the same weights; the Hugging
#      Face loader in bfloat16 against a float32 reference at long positions, on DoP 1 and
#      every layer split the machine has GPUs for; and that a bfloat16 rotary table is caught.
#   3. the test suite's `device` tests (`pytest -m device`: the torch / Hugging Face paths that
#      CI deselects because it has no torch), on this machine.
#
# Prints ONE JSON object (scripts/gpu_verdict.py): "ok", per-target verdicts ("targets":
# restore_vs_pinned_copy, numerics, nvml, layer_split: pass true/false/null and the figure),
# each step's status with the reason of a failure ("steps"), and the steps' own output.
# Also written to $OUT/gpu_check.json when OUT is set. Exit status non-zero unless ok.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}                      # DEVICE=cpu SIZES=0.02,0.05,0.1: a dry run, no GPU
SIZES=${SIZES:-1,3,8}
LONG=${LONG:-4096}                          # tokens of torch_check's long sequence
WIRING_LIMIT=${WIRING_LIMIT:-60}
BENCH_LIMIT=${BENCH_LIMIT:-360}
TORCH_LIMIT=${TORCH_LIMIT:-100}
DEVICE_TESTS_LIMIT=${DEVICE_TESTS_LIMIT:-240}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

run_step() {  # name limit command...: stdout, stderr, exit status and limit into $TMP
    local name=$1 limit=$2
    shift 2
    echo "$limit" > "$TMP/$name.limit"
    timeout "$limit" "$@" > "$TMP/$name.out" 2> "$TMP/$name.err"
    echo $? > "$TMP/$name.rc"
}

# 0. the worker path without torch (numpy weights, cpu device): the same code the torch step
#    drives, run first so that a broken script fails fast (and in CI, which has no torch)
run_step wiring "$WIRING_LIMIT" "$PY" scripts/torch_check.py --wiring
run_step bench "$BENCH_LIMIT" "$PY" -m analysis.bench.gpu --device "$DEVICE" --sizes-gb "$SIZES" \
    --batches 1,8,32 --tokens 128 --cycles 3
run_step torch "$TORCH_LIMIT" "$PY" scripts/torch_check.py --device "$DEVICE" --long "$LONG"
# pytest's report goes to stderr (a failure's reason is its last line); stdout: one JSON line
run_step device_tests "$DEVICE_TESTS_LIMIT" bash -c \
    '"$0" -m pytest -q -p no:cacheprovider -m device tests 1>&2 && echo "{\"pytest\": \"passed\"}"' "$PY"

"$PY" scripts/gpu_verdict.py "$TMP" "$DEVICE" > "$TMP/verdict.json"
rc=$?
cat "$TMP/verdict.json"
if [ -n "${OUT:-}" ]; then cp "$TMP/verdict.json" "$OUT/gpu_check.json"; fi
exit $rc
