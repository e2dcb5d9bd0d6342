#!/usr/bin/env bash
# Decode on the GPU: the kernels' GPU tests, the projection kernels against cuBLAS / W8A8, decode
# latency in bf16 and fp8, and where a step's time goes. Writes logs and JSON under $OUT. Each part fits
# one 10-minute device call:
#   bash benchmarks/gpu/latency.sh tests|kernels|decode|moe|windows|gpt-oss|gpt-oss-sweep|window-kv|curve|targets|accuracy|profile|profile-b64|round-gap|engine-tests|ncu|kconst|suite
# (A/B parts of settled switches and of probes leave once measured: each result JSON in benchmarks/results
# holds its commands, docs/benchmarks.md lists what was measured and removed; to A/B a switch, run
# benchmarks/decode_latency.py --SWITCH on|off interleaved, as its --help lists)
set -u
PART=${1:-tests}
. benchmarks/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt"
quiet() { grep -v -E "Warning|it/s|warn\(" ; }
case "$PART" in
tests)
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
    tests/test_kernels_gpu.py tests/test_fp8.py tests/test_fp8_quant.py tests/test_gpu_engine.py \
    -k "gemv or programmatic or decode_attention or fp8 or quant or graph_path" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  timeout 240 python3 benchmarks/gemv_bench.py --models qwen2.5-0.5b llama-3.1-8b --rows 1 --weights bf16 fp8 \
    --pdl both --out "$OUT/gemv_bench.json" 2>&1 | quiet
  ;;
kernels)
  timeout 560 python3 benchmarks/gemv_bench.py --models qwen2.5-0.5b llama-3.1-8b --rows 1 --weights ${WEIGHTS:-bf16 fp8} \
    --sweep --projections ${PROJ:-gate_up down} --out "$OUT/gemv_sweep.json" 2>&1 | quiet
  ;;
decode)
  for m in qwen2.5-0.5b llama-3.1-8b; do
    timeout 280 python3 benchmarks/decode_latency.py --models $m --batches ${BATCHES:-1 8 64} --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 --quantization none fp8 --out "$OUT/decode_$m.json" 2>&1 | quiet
  done
  ;;
moe)  # mixture-of-experts shapes, random weights made on the GPU (MODELS: qwen3-30b-a3b; mixtral-8x7b needs an H200's
  # memory); PEERS="mixtral-8x7b" then times the gpt-fast-style peer on the same batches
  for m in ${MODELS:-qwen3-30b-a3b}; do
    timeout ${MOE_TIMEOUT:-400} python3 benchmarks/decode_latency.py --models $m --load-format dummy --batches ${BATCHES:-1 64} \
      --chunks 8 --no-eager --skip-transformers --max-num-seqs 64 --gpu-memory-utilization 0.92 \
      --out "$OUT/decode_$m.json" 2>&1 | quiet
  done
  for m in ${PEERS:-}; do  # the gpt-fast-style peer (benchmarks/moe_peer.py) on the same shapes and batches
    timeout ${PEER_TIMEOUT:-240} python3 benchmarks/moe_peer.py --model $m --batches ${BATCHES:-1 64} \
      --out "$OUT/moe_peer_$m.json" 2>&1 | quiet
  done
  ;;
windows)  # issue 61: the sliding-window kernels at real shapes, the new architectures' graph parity, and decode
  # at their shapes (random weights made on the GPU; MODELS: gemma-3-12b phi-4)
  # (-k would filter every file given: the kernels' file alone takes it)
  timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_kernels_gpu.py -k sliding_window \
    > "$OUT/gpu_tests_windows.log" 2>&1
  timeout 160 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_sliding_window.py tests/test_phi3.py \
    tests/test_gemma3.py >> "$OUT/gpu_tests_windows.log" 2>&1
  grep -E "passed|failed|error" "$OUT/gpu_tests_windows.log" | tail -4
  for m in ${MODELS:-gemma-3-12b phi-4}; do
    timeout 200 python3 benchmarks/decode_latency.py --models $m --load-format dummy --batches ${BATCHES:-1 64} \
      --chunks 8 --no-eager --skip-transformers --max-num-seqs 64 --gpu-memory-utilization 0.9 \
      --out "$OUT/decode_$m.json" 2>&1 | quiet
  done
  ;;
gpt-oss)  # issue 61: gpt-oss's GPU tests (greedy parity with transformers on tiny bf16 / MXFP4 models through the
  # graphs, the MXFP4 experts' paths at gpt-oss-20b's shapes, the 20b shapes' warm-up grammar row), its MLP a layer by
  # path (benchmarks/moe_kernel_bench.py), then gpt-oss-20b decode, random MXFP4 experts and bf16 weights made on
  # the GPU, prompt 128 + 256 new (the roofline counts the experts' bytes as stored); DECODE_FLAGS: A/B switches of
  # decode_latency.py (e.g. "--gpt-oss-gemv on --gpt-oss-small-path on": the two paths still off until timed)
  timeout ${TESTS_TIMEOUT:-260} python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_gpt_oss.py \
    tests/test_gpt_oss_experts.py > "$OUT/gpu_tests_gpt_oss.log" 2>&1
  tail -3 "$OUT/gpu_tests_gpt_oss.log"
  timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/moe_kernel_bench.py --shapes gpt-oss-20b --tokens ${TOKENS:-1 2 4 8 16 64} \
    --kernels --out "$OUT/moe_kernel_bench_gpt-oss-20b.json" 2>&1 | grep -E "T=|us  " | quiet
  # shellcheck disable=SC2086
  timeout ${DECODE_TIMEOUT:-200} python3 benchmarks/decode_latency.py --models gpt-oss-20b --load-format dummy \
    --batches ${BATCHES:-1 64} --chunks 8 --no-eager --skip-transformers --max-num-seqs 64 \
    --gpu-memory-utilization 0.85 ${DECODE_FLAGS:-} --out "$OUT/decode_gpt-oss-20b.json" 2>&1 | quiet
  ;;
gpt-oss-sweep)  # the tiles of gpt-oss's experts paths (moe_kernel_bench.py --sweep) at SWEEP_TOKENS, in one call of its own
  timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/moe_kernel_bench.py --shapes gpt-oss-20b --tokens ${SWEEP_TOKENS:-1 64} \
    --sweep --sweep-tokens ${SWEEP_TOKENS:-1 64} --out "$OUT/moe_kernel_sweep_gpt-oss-20b.json" 2>&1 | grep -E "T=|best" | quiet
  ;;
window-kv)  # issue 61: gpt-oss-20b (random weights) at a 1k and a 32k context, batch 1: the KV blocks it holds once
  # prefilled (only the windowed layers' last 128 tokens should be, beside the full layers') and its decode tok/s;
  # first the KV cache groups' GPU tests (tiny gpt-oss and Gemma 3 through the graphs, a table per group)
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_kv_groups.py \
    > "$OUT/gpu_tests_kv_groups.log" 2>&1
  tail -3 "$OUT/gpu_tests_kv_groups.log"
  timeout ${WINDOW_KV_TIMEOUT:-500} python3 benchmarks/window_kv.py --model ${MODEL:-gpt-oss-20b} \
    --contexts ${CONTEXTS:-1024 32768} --out "$OUT/window_kv.json" 2>&1 | quiet
  ;;
curve)
  timeout 560 python3 benchmarks/decode_latency.py --models ${MODELS:-qwen2.5-0.5b llama-3.1-8b} \
    --batches 1 2 4 8 16 32 64 128 256 --chunks 8 --no-eager --skip-transformers --max-num-seqs 256 \
    --quantization ${QUANT:-none fp8} --out "$OUT/decode_curve.json" 2>&1 | quiet
  ;;
accuracy)
  timeout 400 python3 benchmarks/fp8_accuracy.py --models qwen2.5-0.5b llama-3.1-8b --out "$OUT/fp8_accuracy.json" 2>&1 | quiet
  ;;
profile)
  timeout 120 python3 benchmarks/profile_decode.py --model qwen2.5-0.5b --batch 1 --out "$OUT/profile_qwen_b1.json" 2>&1 | quiet
  ;;
profile-b64)  # where a batch-64 step goes: 0.5B bf16, 8B bf16 and fp8 (random weights made on the GPU)
  timeout 100 python3 benchmarks/profile_decode.py --model qwen2.5-0.5b --batch 64 --out "$OUT/profile_qwen_b64.json" 2>&1 | quiet
  for q in none fp8; do
    timeout 150 python3 benchmarks/profile_decode.py --model llama-3.1-8b --batch 64 --load-format dummy \
      --quantization $q --out "$OUT/profile_llama_b64_$q.json" 2>&1 | quiet
  done
  ;;
round-gap)  # where decode_latency's step goes past the graph replay: the device's busy and idle time a step
  # (DeviceTimeline), with and without overlapped rounds, bf16 batch 64 on both models
  python3 benchmarks/random_models.py qwen2.5-0.5b > /dev/null 2>&1
  timeout 120 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches 64 --chunks 8 --no-eager \
    --skip-transformers --max-num-seqs 64 --load-format dummy --overlap-ab --out "$OUT/decode_8b_gap.json" 2>&1 | grep -E "B="
  timeout 90 python3 benchmarks/decode_latency.py --models qwen2.5-0.5b --batches 64 --chunks 8 --no-eager \
    --skip-transformers --max-num-seqs 64 --overlap-ab --out "$OUT/decode_qwen_gap.json" 2>&1 | grep -E "B="
  ;;
engine-tests)  # in one short call: the 0.5B engine's graph / eager, compile-free serving and
  # step-bookkeeping tests, the FP8 suite (projections at 1 / 7 / 64 rows, an FP8 engine through the graphs,
  # argmax agreement), then 8B bf16 batch 8 against its batch 1
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_gpu_engine.py \
    -k "qwen2.5 and (graph_path or compiles_no_kernels or fused_step)" > "$OUT/gpu_tests_engine.log" 2>&1
  tail -2 "$OUT/gpu_tests_engine.log"
  timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_fp8.py > "$OUT/gpu_tests_fp8.log" 2>&1
  tail -2 "$OUT/gpu_tests_fp8.log"
  timeout 70 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches 8 --chunks 8 --no-eager \
    --skip-transformers --max-num-seqs 64 --load-format dummy --out "$OUT/decode_8b_b8.json" 2>&1 | grep -E "B="
  ;;
ncu)  # hardware counters of the decode step's kernels one at a time at real shapes (benchmarks/ncu_kernels.py):
  # speed of light, occupancy, warp stall reasons; one CSV row per kernel and metric
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
  # shellcheck disable=SC2086
  timeout ${NCU_TIMEOUT:-240} "$NCU" --profile-from-start off --clock-control none $sections \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" --csv --page details \
    --log-file "$OUT/ncu.csv" python3 benchmarks/ncu_kernels.py ${TARGETS:+--targets $TARGETS} > "$OUT/ncu_targets.txt" 2>&1
  echo "ncu rc $?"; grep -v '^"' "$OUT/ncu.csv" | head -5; tail -3 "$OUT/ncu_targets.txt"
  ;;
kconst)  # kernels/gemv.K_CONSTEXPR_MAX_K: the one-row GEMV compiled for its K where K <= ${MAXK:-4096}. Decode first,
  # batch 1 interleaved on, off, on, off (0.5B bf16; 8B bf16 and FP8), then per projection
  python3 benchmarks/random_models.py qwen2.5-0.5b > /dev/null 2>&1
  for model in qwen2.5-0.5b llama-3.1-8b; do
    i=0
    for arm in ${MAXK:-4096} 0 ${MAXK:-4096} 0; do
      i=$((i + 1))
      quant=$([ $model = qwen2.5-0.5b ] && echo none || echo "none fp8")
      load=$([ $model = qwen2.5-0.5b ] && echo safetensors || echo dummy)
      # shellcheck disable=SC2086
      timeout 100 python3 benchmarks/decode_latency.py --models $model --batches 1 --chunks 8 --no-eager \
        --skip-transformers --max-num-seqs 64 --load-format $load --quantization $quant --gemv-k-constexpr-max-k $arm \
        --out "$OUT/decode_${model%%-*}_kconst_$arm-$i.json" 2>&1 | grep -E "B="
    done
  done
  timeout 150 python3 benchmarks/gemv_bench.py --models qwen2.5-0.5b llama-3.1-8b --rows 1 --weights bf16 fp8 \
    --k-constexpr-max-k 0 ${MAXK:-4096} --out "$OUT/gemv_kconst.json" 2>&1 | grep "M=1"
  ;;
suite)  # every GPU test (-m gpu) in one process; the structured-output and tool-call files need jsonschema, which the
  # device lacks (they hold no GPU tests)
  timeout ${SUITE_TIMEOUT:-440} python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short --continue-on-collection-errors \
    tests/ > "$OUT/gpu_tests_full.log" 2>&1; tail -6 "$OUT/gpu_tests_full.log"
  ;;
targets)  # issue 13's target table in one call: graph vs eager on the GPU (the shipped kernels), both models at
  # 1 / 8 / 64, bf16 and FP8, then where a batch-64 step goes
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_gpu_engine.py \
    tests/test_kernels_gpu.py -k "graph_path or programmatic or gemv_real" > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  python3 benchmarks/random_models.py qwen2.5-0.5b > /dev/null 2>&1
  timeout 90 python3 benchmarks/decode_latency.py --models qwen2.5-0.5b --batches 1 8 64 --chunks 8 --no-eager \
    --skip-transformers --max-num-seqs 64 --quantization none fp8 --out "$OUT/decode_qwen.json" 2>&1 | grep -E " graphs"
  timeout 150 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches 1 8 64 --chunks 8 --no-eager \
    --skip-transformers --max-num-seqs 64 --load-format dummy --quantization none fp8 --out "$OUT/decode_8b.json" \
    2>&1 | grep -E " graphs"
  timeout 100 python3 benchmarks/profile_decode.py --model qwen2.5-0.5b --batch 64 --out "$OUT/profile_qwen_b64.json" 2>&1 | quiet
  timeout 150 python3 benchmarks/profile_decode.py --model llama-3.1-8b --batch 64 --load-format dummy \
    --quantization fp8 --out "$OUT/profile_llama_b64_fp8.json" 2>&1 | quiet
  ;;
esac
# the device returns at most 8 files from $OUT: past 5 JSON files, they come back as one tar
if [ "$(ls "$OUT"/*.json 2>/dev/null | wc -l)" -gt 5 ]; then
  (cd "$OUT" && tar czf results.tgz ./*.json && rm -f ./*.json)
fi
