#!/usr/bin/env bash
# Where the 0.5B's cached TTFT goes (issue 10), on one H200: prefix_bench.py (128 requests sharing
# a 2,000-token prefix, 32-token suffixes, 64 new tokens, concurrency 32) with caching on
#   - over 4, 8 and 16 client processes (does the client limit the measured TTFT?),
#   - at concurrency 1 (the floor: HTTP, front end, core, one cached prefill, nothing else running),
#   - with decode rounds of K = 2 (how much of it is waiting for the rounds queued ahead),
# and with caching off over 16 client processes. Writes prefix_ttft-*.json and prefix_ttft.log under $OUT.
# Usage: OUT=dir bash benchmarks/gpu_prefix_ttft.sh   (~5 min)
set -u
. benchmarks/gpu_env.sh
LOG="$OUT/prefix_ttft.log"
Q=qwen2.5-0.5b
python3 benchmarks/random_models.py $Q > "$LOG" 2>&1
run() {  # run NAME ARGS...
  local name=$1; shift
  echo "== $name: $*" | tee -a "$LOG"
  timeout -k 10 100 python3 benchmarks/prefix_bench.py --model $Q --config gpu-h200 --out "$OUT" \
    --name "prefix_ttft-$name" "$@" >> "$LOG" 2>&1 || echo "   exit $?" | tee -a "$LOG"
  grep -E "^prefix caching" "$LOG" | tail -n 1
}
run on-p4 --caching on --client-procs 4
run on-p8 --caching on --client-procs 8
run on-p16 --caching on --client-procs 16
run on-c1 --caching on --client-procs 1 --concurrency 1 --requests 16
run on-k2 --caching on --client-procs 8 --decode-chunk 2
run off-p16 --caching off --client-procs 16
