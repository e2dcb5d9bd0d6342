#!/usr/bin/env bash
# Everything that needs the GPU: GPU tests, then the benchmarks. Writes logs and JSON under $OUT
# (or ./gpu-out). Usage: bash benchmarks/gpu/suite.sh [tests|bench|all]   (each part fits one
# 10-minute device call; "all" runs both)
set -u
PART=${1:-all}
. benchmarks/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$OUT/gpu.txt"
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  export GPU_REPORT="$OUT/gpu_report.jsonl"
  timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_kernels_gpu.py tests/test_gpu_engine.py tests/test_overlap.py --junitxml="$OUT/gpu_tests.xml" 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -25
  timeout 90 python3 benchmarks/profile_decode.py --model qwen2.5-0.5b --batch 1 --out "$OUT/profile_qwen_b1.json" 2>&1 \
    | grep -v -E "Warning|it/s"
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  timeout 560 python3 benchmarks/decode_latency.py --overlap-ab --out "$OUT/decode_latency.json" 2>&1 \
    | tee "$OUT/decode_latency.log" | grep -v -E "Warning|it/s"
fi
