#!/usr/bin/env bash
# Issue 13 on the GPU: the kernels' GPU tests, the projection kernels against cuBLAS / W8A8, and
# decode latency in bf16 and fp8. Writes logs and JSON under $OUT. Each part fits one 10-minute
# device call:  bash benchmarks/gpu_latency.sh tests|kernels|decode|curve|accuracy|profile|profile-b64|skinny-check|gemv-tiles|targets|fp8-b1-sweep|skinny-deep|round-gap|engine-tests|split-in-norm|norm-warps|pdl-early|stream-probe|barrier-probe|ncu|kconst|tma|tma-sweep|tma-silu|suite|step-kernels|row-amax|cuda-probe|attention-amax
# (the A/B parts of settled switches are gone; each result JSON in benchmarks/results holds its commands)
set -u
PART=${1:-tests}
. benchmarks/gpu_env.sh
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
skinny-check)  # the skinny GEMM's and FP8's GPU tests (FP8 accuracy included), then decode at 1 / 8 / 16 / 64
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_skinny_gemm.py tests/test_fp8.py \
    > "$OUT/gpu_tests.log" 2>&1; tail -3 "$OUT/gpu_tests.log"
  timeout 260 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches 1 8 16 64 --chunks 8 --no-eager \
    --skip-transformers --max-num-seqs 64 --load-format dummy --quantization none fp8 --gemv-ab \
    --out "$OUT/decode_8b.json" 2>&1 | grep -E " graphs"
  python3 benchmarks/random_models.py qwen2.5-0.5b > /dev/null 2>&1
  timeout 100 python3 benchmarks/decode_latency.py --models qwen2.5-0.5b --batches 1 8 16 64 --chunks 8 --no-eager \
    --skip-transformers --max-num-seqs 64 --gemv-ab --out "$OUT/decode_qwen.json" 2>&1 | grep -E " graphs"
  ;;
profile-b64)  # where a batch-64 step goes: 0.5B bf16, 8B bf16 and fp8 (random weights made on the GPU)
  timeout 100 python3 benchmarks/profile_decode.py --model qwen2.5-0.5b --batch 64 --out "$OUT/profile_qwen_b64.json" 2>&1 | quiet
  for q in none fp8; do
    timeout 150 python3 benchmarks/profile_decode.py --model llama-3.1-8b --batch 64 --load-format dummy \
      --quantization $q --out "$OUT/profile_llama_b64_$q.json" 2>&1 | quiet
  done
  ;;
gemv-tiles)  # bf16 one-row GEMV tiles the sweep had not tried (2048-wide K for one or two rows;
  # down_proj's 2048-wide tile was measured in decode: decode_latency-h200-batch1-down-tile-fp8-gemv-ab-2026-12-02.json)
  timeout 200 python3 benchmarks/gemv_bench.py --models qwen2.5-0.5b llama-3.1-8b --rows 1 --weights bf16 \
    --projections down gate_up --sweep --out "$OUT/gemv_bench_tiles.json" 2>&1 | grep -E "best" | quiet
  ;;
fp8-b1-sweep)  # batch 1's FP8 qkv / o / down: the GEMV (shipped) against the skinny W8A8 GEMM with swept tiles
  # (split K up to 8), the latter never swept at one row; a win would route that projection at batch 1
  timeout 120 python3 benchmarks/gemv_bench.py --models llama-3.1-8b --rows 1 --weights fp8 --projections qkv o down \
    --out "$OUT/gemv_bench_fp8_b1.json" 2>&1 | grep -E "best" | quiet
  timeout 400 python3 benchmarks/skinny_gemm_bench.py --models llama-3.1-8b --weights fp8 --rows 1 \
    --projections qkv o down --sweep --sweep-rows 1 --out "$OUT/skinny_gemm_bench_fp8_b1.json" 2>&1 | quiet | tail -5
  ;;
skinny-deep)  # Llama-3.1-8B's projections at 64 rows through the skinny GEMM with pipelines 4-12 stages deep
  # and 8 warps, bf16 weights and W8A8 (WEIGHTS= one of them; PROJ= the projections, default qkv o)
  for w in ${WEIGHTS:-bf16 fp8}; do
    timeout 280 python3 benchmarks/skinny_gemm_bench.py --models llama-3.1-8b --weights $w --rows 64 \
      --projections ${PROJ:-qkv o} --sweep --sweep-rows 64 --deep --out "$OUT/skinny_deep_$w.json" 2>&1 | quiet | tail -4
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
split-in-norm)  # engine/models/layers.DEFER_SPLIT_REDUCE: the norm after o / down sums their split-K partials.
  # Its kernel tests, the engine-level GPU tests (0.5B graph / eager, FP8 engine and accuracy), then decode
  # interleaved on, off, on, off: 8B bf16 and FP8 at 1 / 8 / 64, and the 0.5B bf16 once each
  timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_skinny_gemm.py \
    -k "split_partials or fp8_model_shapes" > "$OUT/gpu_tests_split.log" 2>&1
  tail -1 "$OUT/gpu_tests_split.log"
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_gpu_engine.py \
    -k "qwen2.5 and (graph_path or compiles_no_kernels or fused_step)" >> "$OUT/gpu_tests_split.log" 2>&1
  tail -1 "$OUT/gpu_tests_split.log"
  timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_fp8.py >> "$OUT/gpu_tests_split.log" 2>&1
  tail -1 "$OUT/gpu_tests_split.log"
  i=0
  for arm in on off on off; do
    i=$((i + 1))
    timeout 80 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches 1 8 64 --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 --load-format dummy --quantization none fp8 --defer-split-reduce $arm \
      --out "$OUT/decode_8b_$arm-$i.json" 2>&1 | grep -E "B="
  done
  for arm in on off; do
    timeout 40 python3 benchmarks/decode_latency.py --models qwen2.5-0.5b --batches 8 64 --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 --defer-split-reduce $arm --out "$OUT/decode_qwen_$arm.json" 2>&1 | grep -E "B="
  done
  ;;
norm-warps)  # kernels/rmsnorm.MAX_WARPS: 16 (shipped), 8 and 4 warps a row for the 8B's 4096-wide norms,
  # interleaved 16, 8, 4, 8, 16: 8B bf16 and FP8 at batch 64 (the 0.5B's 896-wide rows take 4 either way); then
  # where an 8B FP8 batch-1 step goes
  i=0
  for arm in 16 8 4 8 16; do
    i=$((i + 1))
    timeout 65 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches 64 --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 --load-format dummy --quantization none fp8 --norm-max-warps $arm \
      --out "$OUT/decode_8b_norm_warps_$arm-$i.json" 2>&1 | grep -E "B="
  done
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_kernels_gpu.py -k "norm" \
    > "$OUT/gpu_tests_norm.log" 2>&1; tail -1 "$OUT/gpu_tests_norm.log"
  timeout 100 python3 benchmarks/profile_decode.py --model llama-3.1-8b --batch 1 --load-format dummy \
    --quantization fp8 --out "$OUT/profile_llama_fp8_b1.json" 2>&1 | quiet | tail -3
  ;;
pdl-early)  # kernels/_pdl.EARLY_TRIGGER: a PDL kernel lets the next one launch before its own wait. The PDL
  # chain test (bit for bit against no PDL), the GEMV and attention tests and the 0.5B engine's graph tests
  # with it on; then decode interleaved on, off, on, off: 0.5B bf16 at 1 / 64, 8B FP8 at 1 / 64
  timeout 150 python3 - > "$OUT/gpu_tests_pdl_early.log" 2>&1 <<'PY'
import sys
import pytest
import triton.language as tl
import kernels._pdl as pdl
pdl.EARLY_TRIGGER = tl.constexpr(True)  # before any kernel compiles
sys.exit(pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "--tb=short", "tests/test_kernels_gpu.py",
                      "tests/test_gpu_engine.py", "-k", "programmatic or gemv_real or (qwen2.5 and graph_path)"]))
PY
  tail -1 "$OUT/gpu_tests_pdl_early.log"
  python3 benchmarks/random_models.py qwen2.5-0.5b > /dev/null 2>&1
  i=0
  for arm in on off on off; do
    i=$((i + 1))
    timeout 40 python3 benchmarks/decode_latency.py --models qwen2.5-0.5b --batches 1 64 --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 --pdl-early-trigger $arm --out "$OUT/decode_qwen_early_$arm-$i.json" 2>&1 | grep -E "B="
  done
  i=0
  for arm in on off on off; do
    i=$((i + 1))
    timeout 60 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches 1 64 --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 --load-format dummy --quantization fp8 --pdl-early-trigger $arm \
      --out "$OUT/decode_8b_early_$arm-$i.json" 2>&1 | grep -E "B="
  done
  ;;
barrier-probe)  # what a PDL kernel boundary costs against a grid barrier in one persistent kernel, with no weights,
  # then the 0.5B MLP at one row as two PDL GEMVs against one persistent kernel (benchmarks/barrier_probe.py): the
  # premise of a persistent decoder
  timeout 150 python3 benchmarks/barrier_probe.py --programs 132 264 528 --out "$OUT/barrier_probe.json" 2>&1 | quiet
  ;;
stream-probe)  # why one-row FP8 projections stream at ~3.6 TB/s where bf16 ones reach ~4.3: each projection's
  # weights read with the GEMV's tile walk and no math, beside the GEMV, bf16 and FP8 (benchmarks/stream_probe.py)
  timeout 400 python3 benchmarks/stream_probe.py --models llama-3.1-8b qwen2.5-0.5b --out "$OUT/stream_probe.json" 2>&1 | quiet
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
tma)  # kernels/skinny_gemm.W8A8_TMA_MIN_ROWS: the W8A8 skinny GEMM's K tiles loaded by the copy engine from that many
  # rows. Decode first, 8B FP8 at ${BATCHES:-8 64}, interleaved ${ARMS:-1 0 1 0}; then the skinny GEMM's GPU tests
  # (model shapes, graph replay) both ways
  i=0
  for arm in ${ARMS:-1 0 1 0}; do
    i=$((i + 1))
    timeout 90 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches ${BATCHES:-8 64} --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 --load-format dummy --quantization fp8 --skinny-w8a8-tma-min-rows $arm \
      --out "$OUT/decode_8b_tma_$arm-$i.json" 2>&1 | grep -E "B="
  done
  [ "${TESTS:-1}" = 1 ] && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_skinny_gemm.py \
    -k "fp8_model_shapes or graph_capture" > "$OUT/gpu_tests_tma.log" 2>&1; tail -3 "$OUT/gpu_tests_tma.log" 2>/dev/null
  ;;
tma-sweep)  # the TMA W8A8 skinny GEMM's tiles at 64 rows (qkv, o, down; its default tiles are the pointer kernel's)
  timeout ${SWEEP_TIMEOUT:-280} python3 benchmarks/skinny_gemm_bench.py --models llama-3.1-8b --weights fp8 --rows 64 \
    --projections ${PROJ:-qkv o down} --sweep --sweep-rows 64 --w8a8-tma on --out "$OUT/skinny_tma_sweep.json" 2>&1 \
    | quiet | grep -E "rows= *64"
  ;;
tma-silu)  # kernels/skinny_gemm.W8A8_TMA_SILU_MIN_ROWS: gate_up (SiLU-and-mul) through the copy engine too. Decode, 8B
  # FP8 at 1 / 64 interleaved ${ARMS:-1 0 1 0}
  i=0
  for arm in ${ARMS:-1 0 1 0}; do
    i=$((i + 1))
    timeout 90 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches ${BATCHES:-1 64} --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 --load-format dummy --quantization fp8 --skinny-w8a8-tma-silu-min-rows $arm \
      --out "$OUT/decode_8b_tma_silu_$arm-$i.json" 2>&1 | grep -E "B="
  done
  ;;
step-kernels)  # the A/B that shipped the greedy argmax's row merged by its last chunk in one PDL kernel (kernels/sampling.
  # FUSED_MERGE, CHUNK 1024) and the embedding lookup as a PDL kernel (engine/models/layers.PDL_EMBEDDING). Decode first,
  # Qwen2.5-0.5B bf16 at 1 / 8, interleaved off / greedy / both, twice; then 8B FP8 at 1 off / both; then their GPU tests
  python3 benchmarks/random_models.py qwen2.5-0.5b > /dev/null 2>&1
  i=0
  for arm in off greedy both off greedy both; do
    i=$((i + 1))
    flags="--greedy-fused-merge off --greedy-chunk 4096 --pdl-embedding off"  # the arms named explicitly: both ship
    [ $arm != off ] && flags="--greedy-fused-merge on --greedy-chunk 1024 --pdl-embedding off"
    [ $arm = both ] && flags="--greedy-fused-merge on --greedy-chunk 1024 --pdl-embedding on"
    # shellcheck disable=SC2086
    timeout 60 python3 benchmarks/decode_latency.py --models qwen2.5-0.5b --batches 1 8 --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 $flags --out "$OUT/decode_qwen_step_kernels_$arm-$i.json" 2>&1 | grep -E "B="
  done
  for arm in off both; do
    flags="--greedy-fused-merge off --greedy-chunk 4096 --pdl-embedding off"
    [ $arm = both ] && flags="--greedy-fused-merge on --greedy-chunk 1024 --pdl-embedding on"
    # shellcheck disable=SC2086
    timeout 60 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches 1 --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 --load-format dummy --quantization fp8 $flags \
      --out "$OUT/decode_8b_step_kernels_$arm.json" 2>&1 | grep -E "B="
  done
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_kernels_gpu.py tests/test_gpu_engine.py \
    -k "greedy or embedding" > "$OUT/gpu_tests_step_kernels.log" 2>&1; tail -3 "$OUT/gpu_tests_step_kernels.log"
  ;;
row-amax)  # the A/B that shipped engine/models/layers.FP8_ROW_AMAX: an FP8 gate_up hands down_proj's row quantization each
  # row's amax in parts (kernels/skinny_gemm.py row_amax). Decode first, 8B FP8 at ${BATCHES:-8 64} interleaved
  # ${ARMS:-on off on off}; then its GPU tests (the skinny GEMM's and the quantization's)
  i=0
  for arm in ${ARMS:-on off on off}; do
    i=$((i + 1))
    timeout 90 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches ${BATCHES:-8 64} --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 --load-format dummy --quantization fp8 --fp8-row-amax $arm \
      --out "$OUT/decode_8b_row_amax_$arm-$i.json" 2>&1 | grep -E "B="
  done
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_skinny_gemm.py tests/test_fp8_quant.py \
    -k "row_amax or model_shapes" > "$OUT/gpu_tests_row_amax.log" 2>&1; tail -3 "$OUT/gpu_tests_row_amax.log"
  ;;
attention-amax)  # engine/models/layers.FP8_ATTENTION_AMAX: decode attention hands an FP8 o_proj each KV head group's
  # amax (kernels/decode_attention.py row_amax). Its GPU tests, then 8B FP8 at ${BATCHES:-64} interleaved ${ARMS:-on off on off}
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_kernels_gpu.py tests/test_fp8.py \
    -k "row_amax or amax_changes_no_token" > "$OUT/gpu_tests_attention_amax.log" 2>&1; tail -3 "$OUT/gpu_tests_attention_amax.log"
  i=0
  for arm in ${ARMS:-on off on off}; do
    i=$((i + 1))
    timeout 90 python3 benchmarks/decode_latency.py --models llama-3.1-8b --batches ${BATCHES:-64} --chunks 8 --no-eager \
      --skip-transformers --max-num-seqs 64 --load-format dummy --quantization fp8 --fp8-attention-amax $arm \
      --out "$OUT/decode_8b_attention_amax_$arm-$i.json" 2>&1 | grep -E "B=" | sed "s/^/$arm /"
  done
  ;;
cuda-probe)  # benchmarks/cuda_gemv_probe.py: Llama-3.1-8B's FP8 projections at 1 and 8 rows through a hand-written CUDA
  # W8A8 kernel (benchmarks/cuda/fp8_mma_gemv.cu, tensor cores from registers) against the shipped Triton GEMV
  timeout 400 python3 benchmarks/cuda_gemv_probe.py --rows ${ROWS:-1 8} --out "$OUT/cuda_gemv_probe.json" 2>&1 | quiet
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
