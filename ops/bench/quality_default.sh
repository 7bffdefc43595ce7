#!/usr/bin/env bash
# The quality table at the default model (BENCHMARKS.md §1.3), resumable over sittings: every
# run writes results.json when it ends and a run already there with the same configuration is
# skipped, so run this again after an interruption and it goes on where it stopped.
#
#   bash ops/bench/quality_default.sh [OUT]      (default OUT: runs/bench-quality-default)
#
# Order (the most wanted first): seed 0 of data parallel and of the candidate setting at two
# inner learning rates (the same sweep for both); then seeds 1 and 2 of each at its better lr
# (by seed-0 loss); then the shipped setting and H = 100 with an int4 delta down link, three
# seeds each, at the candidate's lr. About 35 minutes per run on the 2-core development VM.
set -euo pipefail
OUT=${1:-runs/bench-quality-default}
DILOCO=${DILOCO:-diloco}
LRS=(1e-3 4e-4)
CAND="frontier H=50 int4/int4Δ"
q() { $DILOCO bench quality --model default --out "$OUT" "$@"; }
best() {  # the lr of variant $1 with the lowest seed-0 loss
  python3 - "$OUT/results.json" "$1" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
c = {k: v["final_eval_loss"] for k, v in runs.items()
     if k.startswith(sys.argv[2] + " lr=") and k.endswith(" seed=0")}
print(min(c, key=c.get).split(" lr=")[1].split(" ")[0])
PY
}
for lr in "${LRS[@]}"; do
  q --only ddp --lrs "$lr" --seeds 0
  q --frontier 50 --only "$CAND" --lrs "$lr" --seeds 0
done
for s in 1 2; do
  q --only ddp --lrs "$(best ddp)" --seeds "$s"
  q --frontier 50 --only "$CAND" --lrs "$(best "$CAND")" --seeds "$s"
done
q --only "decoupled int4/bf16" --lrs "$(best "$CAND")" --seeds 0,1,2
q --frontier 100 --only "frontier H=100 int4/int4Δ" --lrs "$(best "$CAND")" --seeds 0,1,2
