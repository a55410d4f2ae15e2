#!/usr/bin/env bash
# Many streams at once (docs/benchmarks/serve.md): 128 streams, 128 requests, against ours with
# at most 64 and at most 128 requests running (`--max-num-seqs`) and against vLLM's CPU build
# (its default: 128 on CPU), two cells each: shared-prefix (a 1,000-word system prompt, 32
# greedy tokens) and short (distinct ~80-token prompts, 64 greedy tokens). Two rounds, the
# servers in the order ours-64, ours-128, vLLM, then vLLM, ours-128, ours-64, one server at a
# time, each started fresh; a round's cells have the same seeds on every server.
#
#   scripts/serve_many_streams.sh VLLM_VENV HF_FOLDER TAG THREADS SEED1 SEED2
#
# As `scripts/serve_alternated.sh`: writes docs/results/serve/{ours64,ours128,vllm}_Ncore_TAG_rR_CELL_c128.json
# and the printed output to docs/results/serve/streams_TAG_Ncore.txt. Ports 8000 and 8100 must
# be free.
set -uo pipefail
venv=$1 weights=$2 tag=$3 threads=$4 seed1=$5 seed2=$6
out=docs/results/serve
log=$out/streams_${tag}_${threads}core.txt
cd "$(dirname "$0")/.."

# shellcheck source=serve_servers.sh
source scripts/serve_servers.sh
cells() {  # label url round seed
  local seed=$4
  for cell in "shared-prefix 32 1000 shared-prefix" "distinct 64 30 short"; do
    read -r workload tokens words cell_name <<<"$cell"
    echo "== $1 round $3 $cell_name c128 seed $seed load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
    .venv/bin/cachesvc bench serve --url "$2" --workload "$workload" --concurrency 128 \
      --num-requests 128 --max-tokens "$tokens" --system-words "$words" --seed "$seed" \
      --label "$1" --json "$out/${1}_${threads}core_${tag}_r$3_${cell_name}_c128.json"
    seed=$((seed + 1))
  done
}
vllm() {  # round seed
  start_vllm && cells vllm http://127.0.0.1:8100 "$1" "$2" 2>&1 | tee -a "$log"
  stop "$server_pid"
}
ours() {  # max_num_seqs round seed
  start_ours --max-num-seqs "$1" && cells "ours$1" http://127.0.0.1:8000 "$2" "$3" 2>&1 | tee -a "$log"
  stop "$server_pid"
}

: >"$log"
ours 64 1 "$seed1"
ours 128 1 "$seed1"
vllm 1 "$seed1"
vllm 2 "$seed2"
ours 128 2 "$seed2"
ours 64 2 "$seed2"
rm -f "$out/.vllm_server.log" "$out/.ours_server.log"
echo "streams done $(date +%T)"
