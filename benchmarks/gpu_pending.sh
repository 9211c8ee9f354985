#!/usr/bin/env bash
# Re-measure the GPU figures of benchmarks/RESULTS.md (session 4 ran these), in device-tool
# calls of under 600 s each. Run from the repository root on the device machine:
#
#   bash benchmarks/gpu_pending.sh one   # kind nvidia-h200:    kernels, ops cells, tp=1 model
#   bash benchmarks/gpu_pending.sh two   # kind nvidia-h200-x2: tp=2 model, fully sharded
#
# Every step has its own timeout and writes under $OUT, so a call that runs out of time
# still returns what it finished.
set -uo pipefail
OUT=${OUT:-./out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
step() { local name=$1 limit=$2; shift 2; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1;
  echo "== $name rc=$?"; tail -4 "$OUT/$name.log"; }

case "${1:-}" in
one)
  step kernels_gpu 120 python3 -P -m pytest tests/kernels -m gpu -q -p no:cacheprovider -x
  # ops cells never measured: H = 8192 and T in {16, 1024}
  step ops_cells 200 python3 -P benchmarks/ops.py --tokens 16,1024 --hiddens 4096,8192 \
    --ranks 16,64 --adapters 8,64 --time-budget 170 --compile-budget 15 --out "$OUT"
  # the model after the KV-cache layout change ([B, kv, L, hd]); default backend per batch
  step tp1 240 python3 -P benchmarks/tp.py --tp 1 --batches 1,16,64,256 --reps 3 \
    --prefill 4x512 --out "$OUT/tp1.json"
  ;;
two)
  step tp2 560 python3 -P benchmarks/tp.py --tp 2 --batches 1,16,64,256 --reps 3 \
    --prefill 4x512 --out "$OUT/tp2.json"
  ;;
*)
  echo "usage: $0 one|two" >&2
  exit 2
  ;;
esac
