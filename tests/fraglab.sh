#!/usr/bin/env bash
# tests/fraglab.sh BUILD_DIR [TRACE_DIR] — `make fraglab`: how much device memory one
# training step of the default BERT-mini needs, for every --activations mode
# (keep, recompute, offload) and both allocators (arena, naive).
#
# For each of the six, we binary-search the smallest --device-memory-limit at
# which one step succeeds (one rank, stage 2, 256-byte steps: the allocators'
# alignment), starting from what a run with room to spare measured:
#   known to fail:    peak live bytes - 256 (nothing fits below the peak)
#   known to succeed: the default capacity
# A run that fails must fail with the allocator's out-of-memory message; any
# other failure stops the lab. Then the table: the smallest capacity, the peak
# live bytes and the fragmentation (1 - peak live / peak reserved) of the run
# at that capacity, and naive's capacity over arena's.
#
# With TRACE_DIR, also writes the memory traces of one step (--memory-trace) at
# the default capacity, for notes/plot_memory.py.
set -eu
build=${1:-build}
trace_dir=${2:-}
trainer="$build/train_bert_mini"
[ -x "$trainer" ] || { echo "no $trainer: build it first (make)"; exit 1; }
work=$(mktemp -d /tmp/z2_fraglab.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1
step=(--steps 1 --stage 2 --quiet)
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }

# run ACTIVATIONS ALLOC LIMIT JSON: 0 if the step succeeded, 1 if it ran out of
# device memory; exits the lab on any other outcome.
run() {
  local limit=()
  [ "$3" != default ] && limit=(--device-memory-limit "$3")
  if timeout 300 "$trainer" "${step[@]}" --activations "$1" --alloc "$2" "${limit[@]}" --json "$4" \
      >"$work/log" 2>&1; then
    return 0
  fi
  if grep -q "out of device memory" "$work/log"; then return 1; fi
  echo "fraglab: --activations $1 --alloc $2 --device-memory-limit $3 failed for another reason:" >&2
  cat "$work/log" >&2
  exit 1
}

rows=()
started=$(date +%s)
for activations in keep recompute offload; do
  for alloc in arena naive; do
    run "$activations" "$alloc" default "$work/roomy.json" ||
      { echo "fraglab: $activations/$alloc does not fit in the default capacity" >&2; exit 1; }
    if [ -n "$trace_dir" ]; then
      timeout 300 "$trainer" "${step[@]}" --activations "$activations" --alloc "$alloc" \
        --memory-trace "$trace_dir/memory_${activations}_${alloc}.csv" >/dev/null
    fi
    peak=$(field "$work/roomy.json" "d['memory']['device_peak_bytes']")
    low=$(( (peak - 1) / 256 * 256 ))          # fails: below the peak live bytes
    high=$(field "$work/roomy.json" "d['memory']['capacity_bytes']")  # succeeds
    runs=1
    while [ $((high - low)) -gt 256 ]; do
      middle=$(( (low + high) / 2 / 256 * 256 ))
      runs=$((runs + 1))
      if run "$activations" "$alloc" "$middle" "$work/try.json"; then high=$middle; else low=$middle; fi
    done
    # The answer, run once more for its ledger; one step less must fail.
    run "$activations" "$alloc" "$high" "$work/min.json" ||
      { echo "fraglab: $activations/$alloc failed at the capacity the search found" >&2; exit 1; }
    # Best fit's choices depend on the size of the last free piece, so a
    # larger block is not guaranteed to do at least as well: we say so if
    # one step less happens to succeed, rather than claim a minimum.
    monotone=yes
    if run "$activations" "$alloc" $((high - 256)) "$work/try.json"; then monotone=no; fi
    rows+=("$activations $alloc $high $(field "$work/min.json" \
      "'%d %d %.6f %d' % (d['memory']['device_peak_bytes'], d['memory']['reserved_bytes'], d['memory']['fragmentation'], d['memory']['activation_peak_bytes'])") $runs $monotone")
  done
done

python3 - "$trainer" "$(( $(date +%s) - started ))" "${rows[@]}" <<'PY'
import sys
trainer, seconds, rows = sys.argv[1], int(sys.argv[2]), [r.split() for r in sys.argv[3:]]
print(f"Measured by `make fraglab` ({trainer} --steps 1 --stage 2, one rank, the default BERT-mini:")
print("L 4, H 256, 4 heads, F 1024, micro-batch 8 x 128 tokens). Smallest --device-memory-limit at which")
print("one step succeeds, found by binary search to 256 bytes; the other columns are that run's ledger.")
print()
print("| activations | alloc | smallest capacity (bytes) | peak live | activation peak | peak reserved | fragmentation | naive / arena capacity | runs |")
print("|---|---|---|---|---|---|---|---|---|")
arena = {}
for act, alloc, capacity, live, reserved, frag, activation, runs, monotone in rows:
    capacity = int(capacity)
    if monotone != "yes":
        runs += " (capacity - 256 also succeeded: not a strict minimum)"
    if alloc == "arena":
        arena[act] = capacity
    ratio = f"{capacity / arena[act]:.4f}" if alloc == "naive" else ""
    print(f"| {act} | {alloc} | {capacity:,} | {int(live):,} | {int(activation):,} | {int(reserved):,} | "
          f"{float(frag):.4f} | {ratio} | {runs} |")
print()
print(f"The search took {sum(int(r[7]) for r in rows)} runs and {seconds // 60} min {seconds % 60} s on this machine.")
PY
