# The RLS decision path, A/B (issue 47): sourced by bench/run, `ONLY=path bench/run`.
#
# tollgate's CPU per decision is the CPU time of all its threads (/proc/<pid>/task/*/schedstat,
# finer than ticks) over a measurement, divided by the decisions it answered in the same window
# (its own tollgate_request_duration_seconds count, so the load generators' warm-ups count on both
# sides). Each binary of PATH_BINARIES (default: target/ab/tollgate-before, a build of the commit
# before the change, if it is there, then this build) is measured in turn, PATH_ROUNDS times
# alternately, so that drift of this shared machine hits each alike; the report gives the median of
# the rounds. The reference is raw pipelined EVALSHA of a plain token-bucket script
# (bench/plain_bucket.lua) on one key, on the same Redis in the same run.
PATH_ROUNDS=${PATH_ROUNDS:-3}
PATH_ROWS=()

decisions() { curl -sf "http://127.0.0.1:$TG_HTTP/metrics" | awk '$1=="tollgate_request_duration_seconds_count" {print $2}' | head -1; }
# path_one NAME WORKLOAD...: runs WORKLOAD (an h2 or loadgen command) against the running tollgate;
# prints "rps=R cpu_us=C p99_us=P"
path_one() {
  local cpu0 n0 out
  cpu0=$(tollgate_cpu_ns); n0=$(decisions)
  out=$("$@")
  local cpu1 n1; cpu1=$(tollgate_cpu_ns); n1=$(decisions)
  echo "rps=$(field rps <<<"$out") p99_us=$(field p99_us <<<"$out") cpu_us=$(python3 -c "print(f'{($cpu1 - $cpu0) / 1e3 / max(1, $n1 - $n0):.1f}')")"
}
# path_round BINARY LABEL: every path row for one binary; results in PATH_<label>_<row>_{rps,cpu}
path_round() {
  local TOLLGATE=$1 label=$2 out
  R flushall >/dev/null
  start_tollgate --redis-url "redis://127.0.0.1:$REDIS_PORT"
  out=$(path_one h2 "$OUT/hot.bin"); path_keep "$label" redis_hot "$out"
  out=$(path_one loadgen "${WL_A[@]}"); path_keep "$label" redis_zipf "$out"
  start_tollgate
  out=$(path_one h2 "$OUT/hot.bin"); path_keep "$label" mem_hot "$out"
  out=$(path_one loadgen "${WL_A[@]}"); path_keep "$label" mem_zipf "$out"
  stop_tollgate
}
# path_keep LABEL ROW OUTPUT: appends a round's rps and CPU to the lists PATH_<label>_<row>_*
path_keep() {
  local var="PATH_${1//-/_}_$2"
  local rps="${var}_rps" cpu="${var}_cpu"
  printf -v "$rps" '%s' "$(eval echo "\${$rps:-}") $(field rps <<<"$3")"
  printf -v "$cpu" '%s' "$(eval echo "\${$cpu:-}") $(field cpu_us <<<"$3")"
  printf '%-10s %-12s %s\n' "$1" "$2" "$3" >&2
}
median() { python3 -c "import statistics, sys; v = [float(x) for x in sys.argv[1:]]; print(f'{statistics.median(v):.1f}' if v else '')" $1; }
path_label() { basename "$1" | sed 's/^tollgate-\{0,1\}//; s/^$/this build/'; }

path_rows() {
  echo "== the RLS decision path: raw pipelined EVALSHA, then each binary, $PATH_ROUNDS rounds" >&2
  rb PLAIN_P16 "raw EVALSHA of a plain token bucket, one key, 50 clients, pipeline 16" 16 'rl:{hot}:plain' \
    "$PLAIN_SHA" 1000000000 1000000000 1
  rb RAW_HOT_P16 "raw EVALSHA, one key, 50 clients, pipeline 16" 16 'rl:{hot}:default'
  if [ -z "${PATH_BINARIES:-}" ]; then
    PATH_BINARIES=$TOLLGATE
    [ -x "$ROOT/target/ab/tollgate-before" ] && PATH_BINARIES="$ROOT/target/ab/tollgate-before $TOLLGATE"
  fi
  for _ in $(seq "$PATH_ROUNDS"); do
    for binary in $PATH_BINARIES; do path_round "$binary" "$(path_label "$binary" | tr -c 'A-Za-z0-9\n' _)"; done
  done
  # Latency at half of the last binary's Zipf peak, open loop, the load generator on a core of its
  # own, tollgate and Redis on the other.
  local peak half last
  last=${PATH_BINARIES##* }
  peak=$(median "$(eval echo "\${PATH_$(path_label "$last" | tr -c 'A-Za-z0-9\n' _)_redis_zipf_rps}")")
  half=$(python3 -c "print(int(float('$peak') / 2))")
  R flushall >/dev/null
  TOLLGATE=$last TG_WRAP="taskset -c 0" start_tollgate --redis-url "redis://127.0.0.1:$REDIS_PORT"
  taskset -a -p -c 0 "$REDIS_PID" >/dev/null
  PATH_OPEN=$(path_one taskset -c 1 "$LOADGEN" run --addr "127.0.0.1:$TG_GRPC" --domain bench \
    --duration "$DURATION" --warmup "$WARMUP" "${WL_A[@]}" --rate "$half")
  taskset -a -p -c "0-$(($(nproc) - 1))" "$REDIS_PID" >/dev/null
  PATH_OPEN_RATE=$half
  echo "open loop at $half/s: $PATH_OPEN" >&2
  # Through one real Envoy (bench/run's envoy_row): tollgate's CPU per request against what the
  # ratelimit filter costs Envoy itself (its CPU per request with the filter less without).
  PATH_ENVOY=()
  for binary in $PATH_BINARIES; do
    TOLLGATE=$binary start_tollgate --redis-url "redis://127.0.0.1:$REDIS_PORT"
    envoy_row none "Envoy, no rate limiting"
    local none=$ENVOY_OWN_CPU_none
    envoy_row rls "Envoy + ratelimit filter, $(path_label "$binary")"
    PATH_ENVOY+=("| $(path_label "$binary") | $ENVOY_RPS_rls | $ENVOY_CPU_rls | $ENVOY_OWN_CPU_rls | $none | $(ratio "$ENVOY_CPU_rls" "$(python3 -c "print($ENVOY_OWN_CPU_rls - $none)")") |")
    stop_envoys
  done
  stop_tollgate
}

path_report() {
  echo "| RLS decision path, median of $PATH_ROUNDS rounds | Redis, hot tenant (h2load): decisions/s | tollgate CPU µs/decision | Redis, 100k Zipf tenants: decisions/s | tollgate CPU µs/decision | embedded, hot: decisions/s | CPU µs | embedded, Zipf: decisions/s | CPU µs | hot / pipelined EVALSHA of a plain bucket |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for binary in $PATH_BINARIES; do
    local l; l=$(path_label "$binary" | tr -c 'A-Za-z0-9\n' _)
    local cells=() hot
    for row in redis_hot redis_zipf mem_hot mem_zipf; do
      cells+=("$(median "$(eval echo "\${PATH_${l}_${row}_rps}")")" "$(median "$(eval echo "\${PATH_${l}_${row}_cpu}")")")
    done
    hot=$(ratio "${cells[0]}" "$PLAIN_P16")
    echo "| $(path_label "$binary") | ${cells[0]} | ${cells[1]} | ${cells[2]} | ${cells[3]} | ${cells[4]} | ${cells[5]} | ${cells[6]} | ${cells[7]} | $hot |"
  done
  echo
  echo "Raw EVALSHA on one key, pipeline 16, 50 clients (redis-benchmark): a plain token bucket (bench/plain_bucket.lua) $PLAIN_P16/s at $PLAIN_P16_CPU µs of Redis CPU each; tollgate's bucket script, one decision per call, $RAW_HOT_P16/s at $RAW_HOT_P16_CPU µs."
  echo
  echo "| through one Envoy (RLS filter), tollgate + Redis | requests/s | tollgate CPU ms / 1000 req | front Envoy CPU ms / 1000 req, with the filter | without | tollgate / the filter's own cost |"
  echo "|---|---:|---:|---:|---:|---:|"
  printf '%s\n' "${PATH_ENVOY[@]}"
  echo
  echo "Open loop at $PATH_OPEN_RATE/s (half of $(path_label "${PATH_BINARIES##* }")'s Zipf peak), load generator pinned to one core, tollgate and Redis to the other: p99 $(field p99_us <<<"$PATH_OPEN") µs, $(field cpu_us <<<"$PATH_OPEN") µs of tollgate CPU per decision."
}

# path_flames: a flame graph of each binary of PATH_BINARIES deciding for one hot tenant on Redis
# (h2load), from `perf record` call stacks (DWARF unwinding: the release build keeps no frame
# pointers), rendered by inferno into target/bench/flame-<label>.svg. Needs perf.
path_flames() {
  flame_tool
  [ -n "${PATH_BINARIES:-}" ] || PATH_BINARIES="$ROOT/target/ab/tollgate-before $TOLLGATE"
  for binary in $PATH_BINARIES; do
    local label; label=$(path_label "$binary" | tr -c 'A-Za-z0-9\n' -)
    R flushall >/dev/null
    TOLLGATE=$binary start_tollgate --redis-url "redis://127.0.0.1:$REDIS_PORT"
    h2 "$OUT/hot.bin" >/dev/null # warm
    perf record -F 499 --call-graph dwarf,32768 -p "$TG_PID" -o "$OUT/perf-$label.data" -- sleep "$DURATION" \
      >/dev/null 2>&1 &
    local perf=$!
    h2 "$OUT/hot.bin" >/dev/null
    wait "$perf" || true
    perf script -i "$OUT/perf-$label.data" 2>/dev/null | "$INFERNO_COLLAPSE" --all >"$OUT/flame-$label.folded"
    "$INFERNO_FLAMEGRAPH" --title "tollgate ($label): one hot tenant on Redis, h2load" --width 1200 --minwidth 0.5 \
      <"$OUT/flame-$label.folded" >"$OUT/flame-$label.svg"
    echo "flame graph: $OUT/flame-$label.svg" >&2
    python3 bench/flame_table.py "$OUT/flame-$label.folded" >"$OUT/flame-$label.md"
    stop_tollgate
  done
}
