# Sourced by the GPU scripts that keep within one device call: BUDGET_S seconds (set it first) from now.
#   left: the seconds left; cap N: N, or what is left where that is less (1 at least)
#   step NAME NEED MOST command...: the command under a timeout of MOST seconds (capped by what is left),
#   its output appended to $LOG; skipped, and said so, when fewer than NEED seconds are left. A step
#   skipped or failed sets STATUS=1.
: "${BUDGET_S:?set BUDGET_S before sourcing benchmarks/gpu/budget.sh}"
START=$(date +%s)
STATUS=0
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
cap() { local l; l=$(left); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
step() {
  local name=$1 need=$2 most=$3; shift 3
  if [ "$(left)" -lt "$need" ]; then
    echo "== $name: SKIPPED, $(left)s left (needs ~${need}s)" | tee -a "$LOG"; STATUS=1; return
  fi
  echo "== $name ($(left)s left)" | tee -a "$LOG"
  timeout -k 20 "$(cap "$most")" "$@" >> "$LOG" 2>&1 || { echo "   $name: exit $?" | tee -a "$LOG"; STATUS=1; }
  grep -v -i -E "warn|it/s" "$LOG" | tail -n 4
}
