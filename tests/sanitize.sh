#!/usr/bin/env bash
# tests/sanitize.sh BUILD_DIR — `make sanitize`: the cpu build compiled with
# AddressSanitizer and UndefinedBehaviorSanitizer (build-sanitize/), run on
#   1. the doctest suite under mpirun -n 1 and -n 2 (all of it but the
#      exhaustive F16C comparison, 2^32 conversions that touch no memory);
#   2. a short trainer matrix through the command line: N = 1, 2 x stage 0, 2
#      x fp32, bf16, fp16 (one hash per precision, as in the full suite), the
#      ZeRO-R modes with the naive allocator, the caching allocator, --plan, fp16 overflowing, an export and
#      a dump, and a few bad inputs (a nested config, a FIFO, a short seq);
#   3. the safetensors fuzz target (tests/fuzz_safetensors.cpp) for 20 s from
#      the regression corpus (tests/safetensors_corpus/): no crash, no
#      sanitizer report, no allocation of 16 MB or more (its inputs are at
#      most 4 KB: such an allocation would follow a size the bytes only
#      claim). One check.
# Any sanitizer report ends the run it is in (UBSan without recovery), which
# counts as a failure here. Leak checking is off: MPICH keeps allocations
# until exit by design. Ends with the plain line "N passed, M failed".
# The command-line suite's helpers: $build, $trainer, $work, pass / fail / finish, the tiny model.
source "$(dirname "$0")/cli/common.sh" "${1:-build-sanitize}"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1
sanitizer_said() { grep -qE "ERROR: AddressSanitizer|runtime error:|ERROR: UndefinedBehaviorSanitizer" "$1"; }

for ranks in 1 2; do
  log="$work/doctest_$ranks.log"
  timeout 600 mpirun -n $ranks "$build/test_zero2" -tce="*F16C*" > "$log" 2>&1
  status=$?
  summary=$(grep -E '^\[doctest\] test cases:' "$log" | tail -n 1)
  if [ $status -eq 0 ] && ! sanitizer_said "$log" && [ -n "$summary" ]; then pass "doctest under mpirun -n $ranks: $summary"
  else fail "doctest under mpirun -n $ranks: exit $status"; grep -E -A 12 "Sanitizer|runtime error|FAILED" "$log" | head -n 40; fi
done

run() {  # label, ranks, flags...: the run must exit 0 with no sanitizer report
  local label=$1 ranks=$2
  shift 2
  timeout 300 mpirun -n $ranks "$trainer" "${tiny[@]}" "$@" > "$work/log" 2>&1
  local status=$?
  if [ $status -eq 0 ] && ! sanitizer_said "$work/log"; then return 0; fi
  fail "$label: exit $status"; grep -E -A 12 "Sanitizer|runtime error|error:" "$work/log" | head -n 30
  return 1
}
for precision in fp32 bf16 fp16; do
  reference=""
  for N in 1 2; do
    for stage in 0 2; do
      out="$work/${precision}_${N}_${stage}.json"
      run "$precision N=$N stage=$stage" $N --precision $precision --accum $((2 / N)) --stage $stage --json "$out" || continue
      hash=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['final_params_hash'])" "$out")
      [ -z "$reference" ] && reference=$hash
      [ "$hash" = "$reference" ] && pass "$precision N=$N stage=$stage: clean, the precision's hash $hash" ||
        fail "$precision N=$N stage=$stage: $hash != $reference"
    done
  done
done
for activations in recompute offload; do
  run "--activations $activations --alloc naive" 2 --activations $activations --alloc naive &&
    pass "--activations $activations --alloc naive N=2: clean"
done
echo '{"fp16": {"enabled": true, "initial_scale_power": 30, "loss_scale_window": 2}}' > "$work/fp16.json"
run "fp16 overflowing" 2 --steps 8 --config "$work/fp16.json" && pass "fp16 from 2^30, skipping steps: clean"
run "export and dump" 1 --export-hf "$work/export" --dump-batch "$work/dump" && pass "--export-hf and --dump-batch: clean"
run "--alloc caching" 2 --activations offload --alloc caching && pass "--alloc caching N=2 (offload): clean"
run "--plan" 2 --plan --plan-world-sizes 1,2,4 --device-memory-limit 2000000 --json "$work/plan.json" && pass "--plan with the largest sizes: clean"

bad() {  # expected message, flags...: a clean refusal (exit 2, no sanitizer report)
  local expect=$1
  shift
  timeout 120 mpirun -n 2 "$trainer" "${tiny[@]}" "$@" > "$work/log" 2>&1
  local status=$?
  if [ $status -eq 2 ] && ! sanitizer_said "$work/log" && grep -qF -- "$expect" "$work/log"; then
    pass "refused cleanly: $expect"
  else
    fail "bad input [$*]: exit $status"; head -c 400 "$work/log"
  fi
}
python3 -c "print('[' * 100000 + ']' * 100000)" > "$work/deep.json"
mkfifo "$work/fifo"
bad "more than 16 deep" --config "$work/deep.json"
bad "is not a regular file" --data "$work/fifo"
bad "positions on average" --seq 3 --micro-batch 1
bad "unknown flag" --bogus 1

# The fuzz target: new inputs go to a scratch directory (the committed corpus only seeds it).
# libFuzzer exits 0 when the time is up with nothing found; a crash, a sanitizer report or an
# over-large allocation ends it non-zero and leaves the input as crash-*/oom-* in $work.
mkdir -p "$work/fuzz_corpus"
timeout 120 "$build/fuzz_safetensors" -max_total_time=20 -max_len=4096 -malloc_limit_mb=16 -rss_limit_mb=2048 \
  -timeout=10 -print_final_stats=1 -artifact_prefix="$work/" "$work/fuzz_corpus" tests/safetensors_corpus \
  > "$work/fuzz.log" 2>&1
status=$?
runs=$(grep -oE '^stat::number_of_executed_units: *[0-9]+' "$work/fuzz.log" | grep -oE '[0-9]+$')
if [ $status -eq 0 ] && ! sanitizer_said "$work/fuzz.log" && [ -n "$runs" ]; then
  pass "fuzz_safetensors: $runs inputs in 20 s from tests/safetensors_corpus, no crash, no sanitizer report, no large allocation"
else
  fail "fuzz_safetensors: exit $status"; grep -E -B 2 -A 12 "ERROR|runtime error|deadly signal|malloc\(" "$work/fuzz.log" | head -n 40
fi

finish
