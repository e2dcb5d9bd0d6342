#!/usr/bin/env bash
# Decode before and after a change, in one device call: the tree in $BEFORE (a plain copy of the
# earlier commit, e.g. `git archive COMMIT | tar -x -C before/`, carried with the call) and this
# tree, each installed into its own target and timed by its own benchmarks/decode_latency.py, in the
# order before, after, before, after per model (graph rows, K = 8, batches 1 and 64, prompt 128 +
# 256 new tokens, random weights made on the GPU). Writes $OUT/decode_{before,after}_{1,2}_MODEL.json and prints the tok/s table.
#   BEFORE=before MODELS="qwen2.5-0.5b llama-3.1-8b" OUT=dir bash benchmarks/gpu/ab_decode.sh
set -u
. benchmarks/gpu/env.sh
BEFORE=${BEFORE:?a folder holding the earlier tree}
OUT=$(realpath "$OUT")
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/graphserve-before \
  "$(realpath "$BEFORE")" 2>/tmp/pip-before.log || { tail -3 /tmp/pip-before.log; exit 1; }
AFTER_PATH=$PYTHONPATH
BEFORE_PATH=/tmp/graphserve-before:${PYTHONPATH#/tmp/graphserve:}
for model in ${MODELS:-qwen2.5-0.5b llama-3.1-8b}; do
  for round in 1 2; do
    for side in before after; do
      if [ $side = before ]; then dir=$BEFORE path=$BEFORE_PATH; else dir=. path=$AFTER_PATH; fi
      (cd "$dir" && PYTHONPATH=$path timeout ${AB_TIMEOUT:-200} python3 benchmarks/decode_latency.py --models "$model" \
        --batches 1 64 --chunks 8 --no-eager --skip-transformers --max-num-seqs 64 \
        --load-format dummy --out "$OUT/decode_${side}_${round}_$model.json" 2>&1 | grep -v -E "Warning|it/s|warn\(" | tail -4)
    done
  done
done
python3 - "$OUT" <<'EOF'
import glob, json, sys
rows = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/decode_*_*_*.json")):
    side, rnd, model = path.rsplit("/", 1)[1][len("decode_"):-len(".json")].split("_", 2)
    for r in json.load(open(path)).get("rows", []):
        if r["engine"] == "graphs":
            rows.setdefault((model, r["batch"]), {}).setdefault(side, []).append(round(r["tokens_per_s"], 1))
print("model, batch: before tok/s | after tok/s | after / before (means of the two rounds)")
for (model, batch), sides in sorted(rows.items()):
    b, a = (sum(v) / len(v) if v else float("nan") for v in (sides.get("before", []), sides.get("after", [])))
    print(f"{model:14s} {batch:3d}: {sides.get('before')} | {sides.get('after')} | {a / b:.4f}")
EOF
