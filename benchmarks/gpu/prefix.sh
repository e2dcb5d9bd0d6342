#!/usr/bin/env bash
# Issue 10's benchmarks (prefix caching) on one H200, with and without --no-prefix-caching,
# through the production server (configs/gpu-h200.toml), random weights with real shapes:
#   1. prefix_bench.py, Qwen2.5-0.5B: 128 requests sharing a 2,000-token prefix, 32-token
#      suffixes, 64 new tokens, concurrency 32, clients in 4 processes
#   2. prefix_bench.py, Llama-3.1-8B: the same (its 16 GB of random weights written first)
#   3. multiturn_bench.py, Qwen2.5-0.5B: 32 conversations x 6 turns, each turn the whole
#      history (prompt + the model's output ids via return_token_ids) + 100 new tokens, 128
#      new tokens a turn: hit rate (server metrics and usage.cached_tokens), TTFT per turn
#   4. throughput.py, Qwen2.5-0.5B, 300 requests of 100-1,024 tokens (nothing hits), caching
#      on and off
#   5. decode_latency.py, Qwen2.5-0.5B, batch 1 and 64, K=8, fresh prompts per run (nothing
#      hits), caching on and off
# Writes under $OUT: gpu_prefix.log (the GPU, versions, every step's output) and 6 JSON files:
# prefix_bench-qwen2.5-0.5b.json, prefix_bench-llama-3.1-8b.json, multiturn_bench-qwen2.5-0.5b.json,
# throughput-qwen2.5-0.5b-pc-on.json, throughput-qwen2.5-0.5b-pc-off.json, decode_latency-pc.json.
# A prefix_bench run whose requests do not finish within its --work-timeout writes
# server-stalled-*.log there too: the server's log, with every process's stacks (SIGUSR1).
# Needs the server's packages: installed, or as wheels in .whl/ (benchmarks/gpu/env.sh).
#
# Usage: OUT=dir bash benchmarks/gpu/prefix.sh [all | qwen | llama | rest]
#   qwen / llama: that shape's GPU tests of the prefill graphs, then its prefix_bench with caching
#   on and off, and with caching on: prefills ahead of the queued rounds (--prefill-ahead), and no
#   prefill graphs (--cuda-graph-max-prefill-tokens 0);
#   rest: steps 3-5. all (the default): steps 1-5.
# Estimated ~8 min; every step has a timeout and the whole stays under BUDGET_S (540 s): a
# step that would start with too little time left is skipped and says so in the log.
set -u
. benchmarks/gpu/env.sh
BUDGET_S=${BUDGET_S:-540}
. benchmarks/gpu/budget.sh
LOG="$OUT/gpu_prefix.log"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers, tokenizers, httpx; print(torch.__version__, transformers.__version__, tokenizers.__version__, httpx.__version__)"
  nproc; git rev-parse HEAD; } > "$LOG" 2>&1
Q=qwen2.5-0.5b
L=llama-3.1-8b
H200=(--config gpu-h200)

PART=${1:-all}
shape() {  # shape MODEL SERVER_TIMEOUT: its random weights, (qwen/llama only) tests, prefix_bench
  local m=$1 t=$2
  step "$m: random weights" 20 170 python3 benchmarks/random_models.py $m
  if [ "$PART" != all ]; then
    step "$m: GPU tests of the prefill graphs" 60 240 env GPU_REPORT="$OUT/gpu_report.jsonl" python3 -m pytest -q -m gpu \
      tests/test_kernels_gpu.py tests/test_gpu_engine.py tests/test_prefill_graphs.py \
      -k "tile_map or overtaking or ($m and (prefill_graphs or graph_path))" -p no:cacheprovider
  fi
  step "$m: prefix_bench (shared 2,000-token prefix)" 60 200 \
    python3 benchmarks/prefix_bench.py --model $m "${H200[@]}" --client-procs 4 --server-timeout $t --work-timeout 60 \
      --out "$OUT"
  if [ "$PART" != all ]; then
    step "$m: prefix_bench, caching on, prefills ahead" 40 120 \
      python3 benchmarks/prefix_bench.py --model $m "${H200[@]}" --client-procs 4 --server-timeout 90 --caching on \
        --work-timeout 45 --name "prefix_bench-$m-prefill-ahead" --out "$OUT" --prefill-ahead
    step "$m: prefix_bench, caching on, no prefill graphs" 40 120 \
      python3 benchmarks/prefix_bench.py --model $m "${H200[@]}" --client-procs 4 --server-timeout 90 --caching on \
        --work-timeout 45 --name "prefix_bench-$m-no-prefill-graphs" --out "$OUT" --cuda-graph-max-prefill-tokens 0
  fi
}
case $PART in qwen|all) shape $Q 300;; esac
case $PART in llama|all) shape $L 150;; esac
if [ "$PART" != rest ] && [ "$PART" != all ]; then
  echo "done in $(( $(date +%s) - START ))s, status $STATUS" | tee -a "$LOG"; exit $STATUS
fi
[ "$PART" = rest ] && step "$Q: random weights" 20 60 python3 benchmarks/random_models.py $Q
step "$Q: multiturn_bench (32 x 6 turns)" 60 120 \
  python3 benchmarks/multiturn_bench.py --model $Q "${H200[@]}" --client-procs 4 --out "$OUT"
for PC in on off; do
  FLAG=(); [ $PC = off ] && FLAG=(--no-prefix-caching)
  step "$Q: throughput.py, prefix caching $PC" 40 90 \
    python3 benchmarks/throughput.py --model $Q --config configs/gpu-h200.toml --num-requests 300 \
      --min-len 100 --max-len 1024 --timeout 60 "${FLAG[@]}" --out "$OUT" --name "throughput-$Q-pc-$PC.json"
done
step "$Q: decode_latency.py, prefix caching on and off" 60 150 \
  python3 benchmarks/decode_latency.py --models $Q --batches 1 64 --chunks 8 --new-tokens 128 \
    --max-num-seqs 64 --skip-transformers --prefix-caching both --out "$OUT/decode_latency-pc.json"
echo "done in $(( $(date +%s) - START ))s, status $STATUS" | tee -a "$LOG"
exit $STATUS
