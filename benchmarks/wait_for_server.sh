# Sourced by the CPU comparison scripts: wait_for_server URL PID LOG waits up to 600 s for URL to
# answer, and fails with the log's tail if the server process PID exits first.
wait_for_server() {
  local url=$1 pid=$2 log=$3
  for _ in $(seq 600); do
    curl -sf "$url" >/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { tail -20 "$log"; return 1; }
    sleep 1
  done
  echo "$url did not answer within 600 s" >&2
  return 1
}
