#!/usr/bin/env bash
# The side-by-side (docs/benchmarks/serve.md) in two rounds, the servers alternated A B B A: vLLM,
# ours, ours, vLLM, one server at a time, each started fresh. Both rounds run the same five cells
# (distinct and shared-prefix prompts at 4 and 16 streams, 32 requests of 32 greedy tokens; and
# "short": 16 streams of distinct ~80-token prompts, 64 greedy tokens each, where decoding is most
# of the work), a round's cells with the same seeds on both servers, so a drift of the machine's speed over the
# sitting weighs on both alike and each server's greedy text is compared with the other's.
#
#   scripts/serve_alternated.sh VLLM_VENV HF_FOLDER TAG THREADS SEED1 SEED2
#
# VLLM_VENV and HF_FOLDER as `scripts/peer_vllm.py` made them; THREADS compute cores each (ours
# `--threads THREADS`; vLLM's OpenMP threads bound to cores 0..THREADS-1, or its default binding
# for 1). Writes docs/results/serve/{ours,vllm}_Ncore_TAG_rR_CELL_cC.json and the printed
# output to docs/results/serve/sitting_TAG_Ncore.txt. Ports 8000 and 8100 must be free.
set -uo pipefail
venv=$1 weights=$2 tag=$3 threads=$4 seed1=$5 seed2=$6
out=docs/results/serve
log=$out/sitting_${tag}_${threads}core.txt
cd "$(dirname "$0")/.."

# shellcheck source=serve_servers.sh
source scripts/serve_servers.sh
cells() {  # label url round seed [compare_label]
  local seed=$4
  # workload, streams, tokens per answer, words of system prompt, the cell's name; the last
  # cell is the decoding one: short distinct prompts, longer answers.
  for cell in "distinct 4 32 1000 distinct" "distinct 16 32 1000 distinct" \
    "shared-prefix 4 32 1000 shared-prefix" "shared-prefix 16 32 1000 shared-prefix" \
    "distinct 16 64 30 short"; do
    read -r workload streams tokens words cell_name <<<"$cell"
    local name="${tag}_r$3_${cell_name}_c${streams}.json" extra=()
    echo "== $1 round $3 $cell_name c$streams seed $seed load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
    if [[ -n ${5:-} ]]; then extra=(--compare "$out/${5}_$name"); fi
    .venv/bin/cachesvc bench serve --url "$2" --workload "$workload" --concurrency "$streams" \
      --num-requests 32 --max-tokens "$tokens" --system-words "$words" --seed "$seed" \
      --label "$1" --json "$out/${1}_$name" "${extra[@]}"
    seed=$((seed + 1))
  done
}
vllm() {  # round seed [compare_label]
  start_vllm && cells "vllm_${threads}core" http://127.0.0.1:8100 "$1" "$2" "${3:-}" 2>&1 | tee -a "$log"
  stop "$server_pid"
}
ours() {  # round seed [compare_label]
  start_ours && cells "ours_${threads}core" http://127.0.0.1:8000 "$1" "$2" "${3:-}" 2>&1 | tee -a "$log"
  stop "$server_pid"
}

: >"$log"
vllm 1 "$seed1"
ours 1 "$seed1" "vllm_${threads}core"
ours 2 "$seed2"
vllm 2 "$seed2" "ours_${threads}core"
rm -f "$out/.vllm_server.log" "$out/.ours_server.log"
echo "sitting done $(date +%T)"
