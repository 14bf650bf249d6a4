#!/usr/bin/env bash
# tests/verify.sh BUILD_DIR [--all | --write] — does this build compute
# zero2's reference bits? Each row of tests/golden_bits.txt is a portable run
# (--portable: zero2's own gemm and math, notes/11) whose final_params_hash
# and last loss bits depend on its inputs alone; this trains each and compares.
#   (no option)  the small rows (make verify: under 2 minutes)
#   --all        every row, with make run's configuration (the suite)
#   --write      run every row and write the table anew (make golden): only
#                when a change is meant to change the bits, said in its commit
# One line per row ("same" or "DIFFERS"), then the verdict; exit 1 if any
# row differs or fails to run. Z2_VERIFY_FLAGS is added to every run
# (tests/gpu_check.sh: "--device cuda --comm mpi", the same table on the GPU).
set -u
build=${1:-build}
mode=${2:-small}
case "$mode" in small|--all|--write) ;; *) echo "verify: unknown option '$mode' (--all or --write)"; exit 2;; esac
trainer="$build/train_bert_mini"
table="${Z2_GOLDEN:-$(dirname "$0")/golden_bits.txt}"  # Z2_GOLDEN: another table (the suite plants a wrong row)
[ -x "$trainer" ] || { echo "verify: no $trainer: build it first (make)"; exit 1; }
[ -f "$table" ] || { echo "verify: no $table"; exit 1; }
export OPENBLAS_NUM_THREADS=1
work=$(mktemp -d /tmp/z2_verify.XXXXXX)
trap 'rm -rf "$work"' EXIT
differ=()
rows=0
new_table="$work/table"
grep '^#' "$table" > "$new_table"
while IFS='|' read -r name size ranks flags hash loss_bits; do
  name=$(echo $name); size=$(echo $size); ranks=$(echo $ranks); hash=$(echo $hash); loss_bits=$(echo $loss_bits)
  [ -z "$name" ] && continue
  case "$name" in \#*) continue;; esac
  if [ "$mode" = small ] && [ "$size" = large ]; then continue; fi
  rows=$((rows + 1))
  # shellcheck disable=SC2086  # the flags are words
  if ! timeout 600 mpirun -n "$ranks" "$trainer" $flags ${Z2_VERIFY_FLAGS:-} --portable --quiet --json "$work/out.json" < /dev/null > "$work/log" 2>&1; then
    echo "FAILED  $name: the run exited non-zero"; sed 's/^/    /' "$work/log" | head -20
    differ+=("$name"); continue
  fi
  got=$(/usr/bin/python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['final_params_hash'], d['steps'][-1]['loss_bits'])" "$work/out.json")
  if [ "$mode" = --write ]; then
    printf '%s | %s | %s | %s | %s\n' "$name" "$size" "$ranks" "$(echo $flags)" "$got" | sed 's/ \([0-9a-f]*\) \([0-9a-f]*\)$/ \1 | \2/' >> "$new_table"
    echo "wrote   $name: $got"
  elif [ "$got" = "$hash $loss_bits" ]; then
    echo "same    $name: final params hash $hash, last loss bits $loss_bits"
  else
    echo "DIFFERS $name: this build gives $got, the table $hash $loss_bits (mpirun -n $ranks $trainer $(echo $flags) ${Z2_VERIFY_FLAGS:-} --portable)"
    differ+=("$name")
  fi
done < "$table"
if [ "$mode" = --write ]; then
  [ ${#differ[@]} -eq 0 ] || { echo "verify --write: ${#differ[@]} run(s) failed; $table left as it was"; exit 1; }
  cp "$new_table" "$table" && echo "wrote $table ($rows rows)"
  exit 0
fi
if [ ${#differ[@]} -eq 0 ] && [ $rows -gt 0 ]; then
  echo "your build computes zero2's reference bits ($rows configuration(s) of tests/golden_bits.txt)"
else
  echo "your build does NOT compute zero2's reference bits: ${#differ[@]} of $rows differ (${differ[*]})"
  exit 1
fi
