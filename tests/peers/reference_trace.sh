#!/usr/bin/env bash
# tests/peers/reference_trace.sh TRAINER DIR N [FLAGS...] — zero2's trace that the peers replay in
# `make check-peer` and the torch-step lab: small enough for CI (seconds), every part of the model, several
# buckets (a shard offset shows per bucket), dropout 0 (zero2's masks are its own), the parameters and
# gradients after steps 1, 5, 10, 15, 20. FLAGS are added last (the last value of a flag counts).
set -u
trainer=$1 dir=$2 ranks=$3
shift 3
[ -x "$trainer" ] || { echo "no $trainer: build it first (make)"; exit 1; }
rm -rf "$dir"
OPENBLAS_NUM_THREADS=1 timeout 300 mpirun -n "$ranks" "$trainer" --layers 2 --hidden 64 --heads 2 --intermediate 128 \
  --seq 32 --micro-batch 4 --steps 20 --dropout 0 --bucket 20000 --stage 2 --trace-params-every 5 --quiet "$@" \
  --trace "$dir"
