# Sourced by the GPU scripts: $OUT made, unbuffered Python, graphserve installed, and the server's wheels
# (../shared/gpu/fetch-wheels put them in .whl/) installed where the GPU image lacks them.
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  # one wheel a package, the newest: pip refuses two versions of one package, and fetch-wheels may
  # leave an older one beside a newer
  wheels=$(ls .whl/*.whl | sort -V | awk -F/ '{split($NF, part, "-"); newest[part[1]] = $0} END {for (p in newest) print newest[p]}')
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $wheels 2>/tmp/pip.log \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} \
    || { echo "benchmarks/gpu/env.sh: error installing .whl/:" >&2; tail -3 /tmp/pip.log >&2; exit 1; }
fi
# graphserve itself (the GPU image has setuptools but no network: no build isolation), into its own
# target so the tests and benchmarks import graphserve.* as a user's install would
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/graphserve . \
    2>/tmp/pip-graphserve.log && export PYTHONPATH=/tmp/graphserve:${PYTHONPATH:-} \
  || { echo "benchmarks/gpu/env.sh: error installing graphserve:" >&2; tail -3 /tmp/pip-graphserve.log >&2; exit 1; }
