#!/usr/bin/env bash
# Issue 12's benchmark on one H200: benchmarks/structured_bench.py per shape (Qwen2.5-0.5B
# first, then Llama-3.1-8B; random weights with real shapes, bf16, configs/gpu-h200.toml):
# 64 requests with 8 json_schema-constrained vs all unconstrained, all 64 constrained,
# compile cost of a new vs a cached schema, mask fill time for 1/8/64 rows. Writes
# $OUT/structured-SHAPE.json (one per shape) and one log, $OUT/structured.log. Needs
# xgrammar (and apache-tvm-ffi): installed, or as wheels in .whl/ (../shared/gpu/fetch-wheels;
# send them with carry [".whl"]).
#
# Usage: OUT=dir bash benchmarks/gpu/structured.sh [all|qwen2.5-0.5b|llama-3.1-8b] [structured_bench flags...]
# Estimated: Qwen ~1.5 min, Llama-3.1-8B ~3.5 min (writing its 16 GB of random weights
# included). Every step has a timeout and the whole stays under BUDGET_S (540 s): a shape's
# optional parts that would start without time left are skipped (listed in its JSON).
set -u
. benchmarks/gpu/env.sh
WHICH=${1:-all}
shift || true
case "$WHICH" in
  all) SHAPES="qwen2.5-0.5b llama-3.1-8b" ;;
  *) SHAPES="$WHICH" ;;
esac
BUDGET_S=${BUDGET_S:-540}
. benchmarks/gpu/budget.sh
LOG="$OUT/structured.log"
say() { echo "$*" | tee -a "$LOG"; }

: > "$LOG"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "cpus $(nproc)"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -m pip list 2>/dev/null | grep -i -E "^(xgrammar|apache-tvm-ffi|jsonschema) "; } >> "$LOG" 2>&1
if ! python3 -c "import xgrammar" >> "$LOG" 2>&1; then
  say "xgrammar does not import: put its wheels in .whl/ (../shared/gpu/fetch-wheels) and carry .whl"
  tail -5 "$LOG"
  exit 1
fi
for SHAPE in $SHAPES; do
  say "== $SHAPE: random weights ($(left)s left)"
  timeout -k 10 "$(cap 150)" python3 benchmarks/random_models.py "$SHAPE" 2>&1 | grep -v -i warn | tail -2 \
    | tee -a "$LOG"
  T=$(cap 240)
  say "== $SHAPE: structured_bench.py ($(left)s left, this one at most ${T}s)"
  timeout -k 20 "$T" python3 benchmarks/structured_bench.py --model "$SHAPE" --config configs/gpu-h200.toml \
    --time-budget $(( T > 90 ? T - 45 : T / 2 )) --timeout 60 --out "$OUT" --name "structured-$SHAPE.json" "$@" 2>&1 \
    | tee -a "$LOG" | grep -v -i -E "warn|it/s|^wrote " | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || STATUS=1
done
say "done in $(( $(date +%s) - START ))s, status $STATUS"
exit $STATUS
