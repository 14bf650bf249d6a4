#!/usr/bin/env bash
# tests/cli/ledgers.sh BUILD_DIR — the ledgers in the JSON summary (model states, bytes sent per step)
# against formulas recomputed here from the model's sizes, at N = 1, 2, 4 and stages 0, 1, 2 (fp32; the
# 16-bit ledgers are precision.sh's, ZeRO-R's zero_r.sh's, ZeRO-Offload's offload.sh's). Ends with
# "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"

ledgers() {
  echo "=== ledgers in the JSON summary against formulas from the model's sizes"
  for N in 1 2 4; do
    for stage in 0 1 2; do
      reference_run $N "$work/run_${N}_${stage}.json" --accum $((4 / N)) --stage $stage --overlap 1
      verdict=$(py ledgers fp32 "$work/run_${N}_${stage}.json" $N $stage)
      case "$verdict" in
        ok*) pass "ledger N=$N stage=$stage: model states and bytes sent equal the paper's formulas (${verdict#ok })";;
        *) fail "ledger N=$N stage=$stage: $verdict";;
      esac
    done
  done
}

quick ledgers
finish
