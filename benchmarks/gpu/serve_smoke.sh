#!/usr/bin/env bash
# The HTTP server on the GPU: start `graphserve serve` (CUDA graphs by default) on a
# random-weight Qwen2.5-0.5B-shaped model, stream one completion with curl, run the
# serving benchmark (benchmarks/serving.py at small scale: 1 and 64 streams; the full
# sweep is benchmarks/gpu/serving.sh), and keep the CUDA-graph metrics. Needs the server's
# packages: installed (make install), or as wheels in .whl/ for a machine without them
# (../shared/gpu/fetch-wheels).
# Usage: OUT=dir bash benchmarks/gpu/serve_smoke.sh
set -u
. benchmarks/gpu/env.sh
MODEL=$(python3 -c "import sys; sys.path[:0] = ['benchmarks']; from random_models import random_model; print(random_model('qwen2.5-0.5b'))" 2>/dev/null | tail -1)
python3 -m graphserve serve --config configs/gpu-h200.toml --model "$MODEL" --port 8000 --max-model-len 1024 > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 120); do curl -sf localhost:8000/health > /dev/null && break; sleep 1; done
curl -sN localhost:8000/v1/completions -H 'Content-Type: application/json' \
  -d '{"prompt":"Hello","max_tokens":24,"stream":true}' > "$OUT/curl_stream.txt"
head -c 600 "$OUT/curl_stream.txt"; echo
python3 benchmarks/serving.py --url http://127.0.0.1:8000 --model qwen2.5-0.5b --concurrency 1 64 --num-requests 128 \
  --min-requests 8 --min-len 128 --max-len 256 --client-procs 2 --poisson-fraction 0 --level-timeout 120 \
  --out "$OUT" --name serving_smoke 2>&1 | tail -6
curl -s localhost:8000/metrics | grep -E "^graphserve_(cuda_graph|eager|decode_rounds)" > "$OUT/metrics.txt"
cat "$OUT/metrics.txt"
kill -TERM $SERVER; wait $SERVER; echo "server exit code $?"
tail -5 "$OUT/server.log"
