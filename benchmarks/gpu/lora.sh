#!/usr/bin/env bash
# LoRA adapters on the GPU (issue 58), one 10-minute device call a part; logs and JSON under $OUT:
#   bash benchmarks/gpu/lora.sh            # kernels: tests and the engine's decode tok/s
#   bash benchmarks/gpu/lora.sh served     # through the server: 8 adapters x 8 streams against the base model
# The gpu-marked LoRA tests (the kernels at Llama-3.1-8B's shapes, rank 16 on all seven projections, against
# their reference; a tiny model's greedy tokens through the CUDA graphs equal peft's), then benchmarks/lora.py
# at the 8B shape: batch 1 with one adapter, batch 64 with 8 and with 64 adapters, each against the base
# engine's tok/s (targets: >= 0.85, 0.85, 0.75).
# The parity test needs peft, accelerate and psutil beside the server's wheels (else it skips): here, first
#   ../shared/gpu/fetch-wheels && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl peft accelerate psutil
# then the call with .whl carried.
set -u
. benchmarks/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
quiet() { grep -v -E "Warning|it/s|warn\(" ; }
if [ "${1:-kernels}" = served ]; then  # Llama-3.1-8B's shape (random weights written once), rank 16 on all seven
  # projections, 64 streams over 8 adapters in turn, against a server without adapters (target >= 0.8x tok/s)
  timeout 560 python3 benchmarks/lora.py --served --model llama-3.1-8b --adapters 8 --streams 64 \
    --served-requests ${REQUESTS:-128} --run-timeout 240 --out "$OUT/lora-served.json" 2>&1 | quiet \
    | grep -E "C=64|x the base|ready|Error|error" | tee "$OUT/lora-served.log"
  exit
fi
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_lora_kernels.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
timeout 330 python3 benchmarks/lora.py --model llama-3.1-8b --scenarios ${SCENARIOS:-1x1 64x8 64x64} \
  --rank ${RANK:-16} --new-tokens ${NEW_TOKENS:-128} --out "$OUT/lora.json" 2>&1 | quiet | tee "$OUT/lora.log"
