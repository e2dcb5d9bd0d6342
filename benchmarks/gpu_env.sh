# Sourced by the GPU scripts: $OUT made, unbuffered Python, and the server's wheels
# (../shared/gpu/fetch-wheels put them in .whl/) installed where the GPU image lacks them.
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
fi
