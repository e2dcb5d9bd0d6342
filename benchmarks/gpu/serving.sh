#!/usr/bin/env bash
# Issue 9's benchmarks on one H200, per shape: benchmarks/throughput.py (offline, 1,000
# requests, lengths uniform in 100-1,024, all at once), then benchmarks/serving.py (the
# production `server serve --config configs/gpu-h200.toml`, streaming clients in 4
# processes, closed loop at 1/16/64/256/512, the doubling check at 512 with 8 processes,
# Poisson arrivals at 80% of the best rate), with served/offline ratios; JSON, logs and
# PNG plots under $OUT. Needs the server's packages: installed, or as wheels in .whl/.
#
# Usage: OUT=dir bash benchmarks/gpu/serving.sh [all|qwen2.5-0.5b|llama-3.1-8b|qwen3-30b-a3b] [serve flags...]
# (the mixture-of-experts shapes: random weights made on the GPU at each start, --load-format dummy;
# levels 64 and 256, no Poisson run)
#   e.g. OUT=$OUT bash benchmarks/gpu/serving.sh all --api-server-count 4
# Estimated: Qwen2.5-0.5B ~3 min, Llama-3.1-8B ~7.5 min (writing its 16 GB of random
# weights included), so within one 10-minute device call run one shape per call; every
# step has a timeout and the whole stays under BUDGET_S (570 s): with "all", levels that
# would start without time left are skipped (serving.py --time-budget; listed in its JSON).
set -u
. benchmarks/gpu/env.sh
WHICH=${1:-all}
shift || true
case "$WHICH" in
  all) SHAPES="qwen2.5-0.5b llama-3.1-8b" ;;
  *) SHAPES="$WHICH" ;;
esac
BUDGET_S=${BUDGET_S:-570}
. benchmarks/gpu/budget.sh

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, transformers, tokenizers, httpx; print(torch.__version__, transformers.__version__, tokenizers.__version__, httpx.__version__)" >> "$OUT/gpu.txt" 2>&1
nproc >> "$OUT/gpu.txt"
for SHAPE in $SHAPES; do
  MODEL=$SHAPE LEVELS="1 16 64 256 512" DUMMY_ENGINE="" DUMMY_SERVE="" POISSON=0.8
  case "$SHAPE" in
    llama-3.1-8b) SERVE_COUNTS="--min-requests 4 --poisson-requests 500" ;;
    qwen3-30b-a3b|mixtral-8x7b)  # weights too big for the disk: made on the GPU at each start
      SERVE_COUNTS="--min-requests 4" LEVELS="64 256" POISSON=0 DUMMY_ENGINE="--set load_format=dummy"
      DUMMY_SERVE="--load-format dummy"
      MODEL=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from random_models import random_model_config; \
print(random_model_config('$SHAPE'))") ;;
    *) SERVE_COUNTS="--min-requests 16" ;;
  esac
  if [ -z "$DUMMY_SERVE" ]; then
    echo "== $SHAPE: random weights ($(left)s left)"
    timeout -k 10 "$(cap 150)" python3 benchmarks/random_models.py "$SHAPE" 2>&1 | grep -v -i warn | tail -2
  fi
  echo "== $SHAPE: throughput.py ($(left)s left)"
  # shellcheck disable=SC2086
  timeout -k 20 "$(cap 200)" python3 benchmarks/throughput.py --model "$MODEL" --config configs/gpu-h200.toml \
    --num-requests 1000 --min-len 100 --max-len 1024 --timeout 150 --out "$OUT" $DUMMY_ENGINE \
    --name "throughput-$SHAPE.json" > "$OUT/throughput-$SHAPE.log" 2>&1 || STATUS=1
  grep -v -i -E "warn|it/s" "$OUT/throughput-$SHAPE.log" | tail -4
  echo "== $SHAPE: serving.py ($(left)s left)"
  T=$(cap 420)
  # shellcheck disable=SC2086
  timeout -k 90 "$T" python3 benchmarks/serving.py --model "$MODEL" --config configs/gpu-h200.toml \
    --concurrency $LEVELS --num-requests 1000 $SERVE_COUNTS --client-procs 4 --doubling-check \
    --poisson-fraction $POISSON --level-timeout 120 --server-timeout 180 --time-budget $(( T > 60 ? T - 30 : T )) \
    --offline-json "$OUT/throughput-$SHAPE.json" --out "$OUT" --name "serving-$SHAPE" $DUMMY_SERVE "$@" \
    > "$OUT/serving-$SHAPE.log" 2>&1 || STATUS=1
  grep -v -i -E "warn|it/s" "$OUT/serving-$SHAPE.log" | tail -12
done
if compgen -G "$OUT/serving-*.json" > /dev/null; then
  python3 benchmarks/plot_serving.py "$OUT"/serving-*.json -o "$OUT/serving.png" 2>&1 | tail -1
fi
echo "done in $(( $(date +%s) - START ))s, status $STATUS"
exit $STATUS
