#!/usr/bin/env bash
# Speculative decoding on the GPU, each part one 10-minute device call; logs and JSON under $OUT:
#   bash benchmarks/gpu/speculative.sh draft|adaptive|matrix
# draft: the GPU tests of speculation, and the 8B at batch 1 with an FP8 1B draft as the engine runs it
#   and with its drafts read on the host first (speculative.py --draft-arms), interleaved three times.
# adaptive: batch 1 and 64 with the engine's default speculative_max_batch (--adaptive).
# matrix: the n-gram-forced table of k x alpha x batch (MODELS, QUANT, BATCHES).
set -u
PART=${1:-draft}
. benchmarks/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
quiet() { grep -v -E "Warning|it/s|warn\(" ; }
case "$PART" in
draft)
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_spec_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
  timeout 420 python3 benchmarks/speculative.py --models llama-3.1-8b --batches 1 --k 4 --alphas 0.7 \
    --draft-model llama-3.2-1b --draft-quantization fp8 --draft-only --draft-arms engine host engine host engine host \
    --repeats 2 --out "$OUT/speculative-draft.json" 2>&1 | quiet
  ;;
adaptive)
  timeout 560 python3 benchmarks/speculative.py --models llama-3.1-8b --batches ${BATCHES:-1 64} --k 4 --alphas 0.7 \
    --draft-only --adaptive --repeats 2 --out "$OUT/speculative-adaptive.json" 2>&1 | quiet
  ;;
matrix)
  timeout 560 python3 benchmarks/speculative.py --models ${MODELS:-llama-3.1-8b} --quantization ${QUANT:-none} \
    --batches ${BATCHES:-1 8 64} --k 2 4 6 --alphas 0.5 0.7 0.9 --repeats 1 --out "$OUT/speculative-matrix.json" 2>&1 | quiet
  ;;
*)
  echo "unknown part $PART" >&2; exit 2
  ;;
esac
