#!/usr/bin/env bash
# tests/peers/reference_trace.sh TRAINER DIR N [FLAGS...] — zero2's trace that the peers replay in
# `make check-peer` and the torch-step lab: small enough for CI (seconds), every part of the model, several
# buckets (a shard offset shows per bucket), dropout 0 (zero2's masks are its own), the parameters and
# gradients after steps 1, 5, 10, 15, 20. FLAGS are added last (the last value of a flag counts).
#
# Then its twin, DIR/twin: the same run again with only legitimate rounding changed (--portable: zero2's own
# gemm, every product summed in another order; in 16-bit also started from the initial weights rounded toward
# zero to 16 bits, through --init-hf: one 16-bit rounding of every weight, so the twin differs from step 1 on by
# as much as two 16-bit implementations' roundings do; trace_files.py twin_start). tests/check_trace.py
# finds it there and sets every allowance from how far the twin lies from zero2 (notes/12, "Allowances from
# legitimate rounding"). Z2_NO_TWIN=1 leaves it out (the checker then says its allowances are analytic).
set -u
trainer=$1 dir=$2 ranks=$3
shift 3
[ -x "$trainer" ] || { echo "no $trainer: build it first (make)"; exit 1; }
rm -rf "$dir"
run() {  # run TRACE_DIR [MORE FLAGS...]
  local out=$1
  shift
  OPENBLAS_NUM_THREADS=1 timeout 300 mpirun -n "$ranks" "$trainer" --layers 2 --hidden 64 --heads 2 --intermediate 128 \
    --seq 32 --micro-batch 4 --steps 20 --dropout 0 --bucket 20000 --stage 2 --trace-params-every 5 --quiet "$@" \
    --trace "$out"
}
run "$dir" "$@" || exit $?
[ "${Z2_NO_TWIN:-0}" = 1 ] && exit 0
precision=$(/usr/bin/python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["run"]["precision"])' \
  "$dir/trace.json") || exit 1
start=()
if [ "$precision" != fp32 ]; then
  rounded=$(mktemp -d /tmp/z2_twin_start.XXXXXX)
  trap 'rm -rf "$rounded"' EXIT
  /usr/bin/python3 "$(dirname "$0")/trace_files.py" twin-start "$dir/initial" "$rounded/initial" "$precision" || exit 1
  start=(--init-hf "$rounded/initial")
fi
run "$dir/twin" "$@" --portable "${start[@]}"
