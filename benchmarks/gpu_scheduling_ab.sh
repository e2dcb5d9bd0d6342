#!/usr/bin/env bash
# The scheduling policy under load (issue 9, item 4): prefill is interleaved with decode, one
# prefill batch of at most --max-num-batched-tokens between consecutive decode rounds (queued
# behind the round in flight). This runs serving.py at 64 and 256 streams with the preset's
# budget (8,192 tokens) and with 2,048, for both shapes, to show the TTFT / TPOT trade; the
# 0.5B run at 8,192 also repeats C=512 with 4 and 8 client processes (the doubling check).
# Usage: OUT=dir bash benchmarks/gpu_scheduling_ab.sh     (~5 min on an H200)
set -u
. benchmarks/gpu_env.sh
COMMON=(--config configs/gpu-h200.toml --num-requests 1000 --client-procs 4 --poisson-fraction 0
        --level-timeout 150 --server-timeout 180 --out "$OUT")
run() {  # shape, name, serving.py args...
  local shape=$1 name=$2; shift 2
  timeout -k 30 300 python3 benchmarks/serving.py --model "$shape" "${COMMON[@]}" --name "$name" "$@" \
    > "$OUT/$name.log" 2>&1
  grep -E "^C=|server CPU|doubling|skipped" "$OUT/$name.log"
}
for shape in qwen2.5-0.5b llama-3.1-8b; do
  timeout 150 python3 benchmarks/random_models.py "$shape" > /dev/null 2>&1
done
run qwen2.5-0.5b sched-qwen2.5-0.5b-8192 --concurrency 64 256 512 --min-requests 16 --doubling-check
run qwen2.5-0.5b sched-qwen2.5-0.5b-2048 --concurrency 64 256 --min-requests 16 --max-num-batched-tokens 2048
run llama-3.1-8b sched-llama-3.1-8b-2048 --concurrency 64 256 --min-requests 4 --max-num-batched-tokens 2048
