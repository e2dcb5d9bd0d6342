#!/usr/bin/env bash
# The first burst after ready (issue: ready means fast): for each shape, the server is started and one
# level of 64 streams runs right after /health says ready, then the same level again with other prompts
# (serving.py --cold-start); with the warm-up burst (the default) and without it (--no-warm-up).
# Usage: [ARM_TIMEOUT=S] bash benchmarks/gpu/cold_start.sh [MODEL ...]   (default: qwen2.5-0.5b llama-3.1-8b)
set -u
. benchmarks/gpu/env.sh
models=${*:-qwen2.5-0.5b llama-3.1-8b}
for model in $models; do
  for arm in warm-up no-warm-up; do
    timeout "${ARM_TIMEOUT:-300}" python3 benchmarks/serving.py --model "$model" --cold-start --concurrency 64 --client-procs 8 \
      --out "$OUT" --name "cold_start-$model-$arm" -- "--$arm" 2>&1 | grep -E "ready|cold start|C= *64|failed"
  done
done
