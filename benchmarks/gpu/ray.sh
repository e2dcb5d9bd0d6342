#!/usr/bin/env bash
# Issue 57 on one GPU: Ray Serve's overhead. Qwen2.5-0.5B (random weights, real shapes), configs/gpu-h200.toml,
# benchmarks/serving.py at 64 streams (256 requests of 100-1,024 prompt and output tokens, 4 client processes)
# against `graphserve serve --ray --replicas 1` (a one-node Ray started on the machine, its proxy, the ingress,
# one replica) and then against `graphserve serve` directly, the same engine flags: output tok/s (target
# >= 0.9x direct) and TTFT p50 (target within 1.2x). Writes $OUT/ray_serving-overhead-gpu.json and the log
# $OUT/gpu_ray.log (with the Ray server's log, ray_serving-overhead-ray.log).
#
# Ray's wheel (about 79 MB) is larger than one device call may carry (64 MiB), so it travels in parts and is
# joined here. On a machine with internet, from the repository root:
#   ../shared/gpu/fetch-wheels "ray[serve]==2.60.0"        # the server's wheels and Ray Serve's, Python 3.12
#   rm -f .whl/numpy-*.whl                                  # the GPU image has numpy (torch's): keep it
#   mkdir -p .whl-ray && mv .whl/ray-2.60.0-*.whl .whl-ray/   # .whl-ray/ is git-ignored, as .whl/ is
#   (cd .whl-ray && sha256sum ray-2.60.0-*.whl > SHA256SUMS && split -b 28M ray-2.60.0-*.whl ray.part- \
#     && rm ray-2.60.0-*.whl)                               # ray.part-aa, -ab (28 MiB), -ac (~20 MiB)
# then three calls on the same warm machine (ignored files stay there between calls):
#   carry [".whl", ".whl-ray/SHA256SUMS"]                       command: ls .whl | wc -l      (~51 MB)
#   carry [".whl-ray/ray.part-aa", ".whl-ray/ray.part-ab"]      command: ls -l .whl-ray       (56 MiB)
#   carry [".whl-ray/ray.part-ac"]                              command: OUT=$OUT bash benchmarks/gpu/ray.sh
# Estimated ~7 min; every step has a timeout and the whole stays under BUDGET_S (560 s).
set -u
BUDGET_S=${BUDGET_S:-560}
. benchmarks/gpu/budget.sh  # from here: the wheel's assembly and env.sh's install count against it
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_ray.log"
# the Ray wheel from its parts, into .whl/ where env.sh installs the wheels from
if compgen -G ".whl-ray/ray.part-*" > /dev/null; then
  name=$(awk '{print $2}' .whl-ray/SHA256SUMS)
  cat .whl-ray/ray.part-* > ".whl-ray/$name"
  (cd .whl-ray && sha256sum -c SHA256SUMS) > "$LOG" 2>&1 || { echo "the Ray wheel's parts do not add up" | tee -a "$LOG"; exit 1; }
  mkdir -p .whl && mv ".whl-ray/$name" .whl/
fi
. benchmarks/gpu/env.sh
export RAY_USAGE_STATS_ENABLED=0  # no network on the machine
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, ray; print(torch.__version__, ray.__version__)"
  nproc; git rev-parse HEAD; } >> "$LOG" 2>&1
step "qwen2.5-0.5b: random weights" 20 170 python3 benchmarks/random_models.py qwen2.5-0.5b
step "Ray Serve (1 replica) vs graphserve serve, 64 streams" 200 480 \
  python3 benchmarks/ray_serving.py overhead --model qwen2.5-0.5b --config gpu-h200 --streams 64 --rounds 1 \
    --overhead-requests 256 --min-len 100 --max-len 1024 --client-procs 4 --server-timeout 300 --run-timeout 200 \
    --out "$OUT" --log-dir "$OUT" --name ray_serving-overhead-gpu
echo "done in $(( $(date +%s) - START ))s, status $STATUS" | tee -a "$LOG"
exit $STATUS
