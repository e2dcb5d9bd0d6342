#!/usr/bin/env bash
# graphserve on CPU against llama.cpp's llama-server, one window, the same client and request set
# (benchmarks/serving.py at 1 / 8 / 16 streams, 128-256-token prompts and outputs, 2 client
# processes, a connection per request: llama-server closes each streamed response's connection),
# the same GGUF file (default: the embedded model's Q4_1 file) and the same threads (2). graphserve
# runs twice: its default for a GGUF file (the file's quantized blocks) and --dtype float32 (the
# weights dequantized); GRAPHSERVE_ARMS="gguf float32" selects.
#
#   bash benchmarks/cpu_vs_llamacpp.sh [SUFFIX] [FILE.gguf]   # writes benchmarks/results/serving-cpu-*-SUFFIX.json
#   CPU_ISA=avx2 bash benchmarks/cpu_vs_llamacpp.sh ...      # both built as an AVX2-only machine builds
#
# llama-server is built once by benchmarks/llama_cpp_build.sh (the llama.cpp source inside the
# llama-cpp-python sdist, Release, the machine's own instruction sets or CPU_ISA's cap).
# It serves with --parallel equal to each level's stream count (one server per level: slots are
# fixed at start) and a context of 1024 tokens per slot. The load average is printed before each run.
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/wait_for_server.sh
SUFFIX=${1:-$(date +%F)}
PY=${PY:-.venv/bin/python}
GGUF=${2:-$("$PY" -c "from graphserve.engine.model_files.default_model import find_gguf; print(find_gguf())")}
THREADS=${THREADS:-2}
if [ -n "${CPU_ISA:-}" ]; then export GRAPHSERVE_CPU_ISA=$CPU_ISA LLAMA_CPP_ISA=$CPU_ISA; fi
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs); cap: ${CPU_ISA:-native}"
OUT=benchmarks/results
SERVER="$(bash benchmarks/llama_cpp_build.sh)/llama-server"

COMMON=(--model default --requests-per-stream 2 --min-requests 3 --min-len 128 --max-len 256
        --client-procs 2 --level-timeout 400 --poisson-fraction 0 --fresh-connections --out "$OUT")

for arm in ${GRAPHSERVE_ARMS-gguf float32}; do
  extra=(); [ "$arm" = float32 ] && extra=(--dtype float32)
  echo "load before graphserve ($arm): $(cat /proc/loadavg)"
  "$PY" benchmarks/serving.py "${COMMON[@]}" --concurrency 1 8 16 --config default --device cpu \
    --name "serving-cpu-graphserve-$arm-$SUFFIX" -- --model "$GGUF" "${extra[@]}"
done

# llama-server: one server per level (its slots are fixed at start), results merged into one JSON
for streams in 1 8 16; do
  "$SERVER" -m "$GGUF" --port 8124 --threads "$THREADS" --threads-batch "$THREADS" --parallel "$streams" \
    --ctx-size $((1024 * streams)) --no-webui >/tmp/llama-server.log 2>&1 &
  LLAMA_PID=$!
  trap 'kill $LLAMA_PID 2>/dev/null || true' EXIT
  wait_for_server http://127.0.0.1:8124/v1/models $LLAMA_PID /tmp/llama-server.log
  echo "load before llama-server ($streams slots): $(cat /proc/loadavg)"
  "$PY" benchmarks/serving.py "${COMMON[@]}" --concurrency "$streams" --url http://127.0.0.1:8124 \
    --name "serving-cpu-llamacpp-$streams-$SUFFIX"
  kill $LLAMA_PID; wait $LLAMA_PID 2>/dev/null || true
done
