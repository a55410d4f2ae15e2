#!/usr/bin/env bash
# One server's cells of the side-by-side (docs/benchmarks/serve.md), each logged with the load
# average at its start: shared-prefix and distinct prompts at 4 and 16 streams, 32 requests of
# 32 greedy tokens, seeds SEED..SEED+3 in that order.
#
#   scripts/serve_cells.sh LABEL URL TAG SEED [COMPARE_LABEL]
#
# writes docs/results/serve/LABEL_TAG_WORKLOAD_cN.json; with COMPARE_LABEL each cell's greedy
# text is compared with COMPARE_LABEL_TAG_WORKLOAD_cN.json (the other server's same cell).
set -euo pipefail
label=$1 url=$2 tag=$3 seed=$4 compare=${5:-}
out=docs/results/serve
for cell in "shared-prefix 4" "distinct 4" "shared-prefix 16" "distinct 16"; do
  read -r workload streams <<<"$cell"
  name="${tag}_${workload}_c${streams}.json"
  echo "== $label $workload c$streams seed $seed load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
  extra=()
  if [[ -n $compare ]]; then extra=(--compare "$out/${compare}_$name"); fi
  cachesvc bench serve --url "$url" --workload "$workload" --concurrency "$streams" \
    --num-requests 32 --max-tokens 32 --seed "$seed" --label "$label" \
    --json "$out/${label}_$name" "${extra[@]}"
  seed=$((seed + 1))
done
