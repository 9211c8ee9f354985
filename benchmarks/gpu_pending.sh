#!/usr/bin/env bash
# Re-measure the GPU figures of benchmarks/RESULTS.md (session 4 ran these), in device-tool
# calls of under 600 s each. Run from the repository root on the device machine:
#
#   bash benchmarks/gpu_pending.sh one   # kind nvidia-h200:    kernel tests, ops grid (trace timer)
#   bash benchmarks/gpu_pending.sh tp1   # kind nvidia-h200:    tp=1 model
#   bash benchmarks/gpu_pending.sh two   # kind nvidia-h200-x2: tp=2 model, fully sharded
#
# Every step has its own timeout and writes under $OUT, so a call that runs out of time
# still returns what it finished.
set -uo pipefail
OUT=${OUT:-./out}
mkdir -p "$OUT" "$OUT/decode" "$OUT/prefill"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
step() { local name=$1 limit=$2; shift 2; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1;
  echo "== $name rc=$?"; tail -4 "$OUT/$name.log"; }

case "${1:-}" in
one)  # kind nvidia-h200: kernel GPU tests, then the ops grid with the trace timer
  # (GPU busy time per call) and every cell's accuracy vs the jnp oracle
  JAX_DEFAULT_MATMUL_PRECISION=highest step kernels_gpu 150 \
    python3 -P -m pytest tests/kernels -m gpu -q -p no:cacheprovider
  step ops_decode 200 python3 -P benchmarks/ops.py --timer trace --tokens 1,16,64,256 \
    --hiddens 4096,8192 --ranks 16,64,128 --adapters 1,8,64 --time-budget 170 \
    --compile-budget 15 --out "$OUT/decode"
  step ops_prefill 200 python3 -P benchmarks/ops.py --timer trace --tokens 1024,4096,16384 \
    --hiddens 4096,8192 --ranks 16,64,128 --adapters 8,64 --impls ours,gather,onehot \
    --time-budget 170 --compile-budget 15 --out "$OUT/prefill"
  ;;
tp1)  # kind nvidia-h200: the model at tp = 1
  step tp1 240 python3 -P benchmarks/tp.py --tp 1 --batches 1,16,64,256 --reps 3 \
    --prefill 4x512 --out "$OUT/tp1.json"
  ;;
two)  # kind nvidia-h200-x2: the model at tp = 2 (base, LoRA, fully sharded)
  step tp2 560 python3 -P benchmarks/tp.py --tp 2 --batches 1,16,64,256 --reps 3 \
    --prefill 4x512 --out "$OUT/tp2.json"
  ;;
*)
  echo "usage: $0 one|tp1|two" >&2
  exit 2
  ;;
esac
