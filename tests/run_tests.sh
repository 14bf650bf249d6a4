#!/usr/bin/env bash
# tests/run_tests.sh BUILD_DIR — run the doctest suite under mpirun -n 1, 2, 4,
# each run under a timeout, then the trainer's command-line tests
# (tests/test_trainer.sh) and the trace checker's (tests/test_checker.sh), and
# end with one plain line: "N passed, M failed" (doctest test cases summed
# over the three runs plus the trainer's and the checker's checks; a run that
# dies or times out without its summary counts as one failed).
set -u
build=${1:-build}
binary="$build/test_zero2"
[ -x "$binary" ] || { echo "no $binary: build it first (make)"; echo "0 passed, 1 failed"; exit 1; }
# Several ranks on few cores: one OpenBLAS thread each.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}

passed=0
failed=0
for ranks in 1 2 4; do
  echo "=== $binary under mpirun -n $ranks"
  log=$(mktemp)
  start=$(date +%s)
  timeout 300 mpirun -n "$ranks" "$binary" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  summary=$(grep -E '^\[doctest\] test cases:' "$log" | tail -n 1)
  if [ -n "$summary" ]; then
    run_passed=$(echo "$summary" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+')
    run_failed=$(echo "$summary" | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+')
  else
    run_passed=0
    run_failed=1
  fi
  if [ "$status" -ne 0 ] && [ "$run_failed" -eq 0 ]; then run_failed=1; fi  # died after the summary
  [ "$status" -eq 124 ] && echo "=== mpirun -n $ranks timed out after 300 s"
  echo "=== mpirun -n $ranks: $run_passed passed, $run_failed failed, exit $status, $(($(date +%s) - start)) s"
  passed=$((passed + run_passed))
  failed=$((failed + run_failed))
  rm -f "$log"
done
# A test script with its own plain summary line ("N passed, M failed"),
# under a timeout, added in; a script that ends without one counts as one failed.
run_script() {  # run_script LABEL TIMEOUT SCRIPT
  local label=$1 limit=$2 script=$3 log start line
  echo "=== $script $build"
  log=$(mktemp)
  start=$(date +%s)
  timeout "$limit" "$script" "$build" 2>&1 | tee "$log"
  line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -n 1)
  if [ -n "$line" ]; then
    passed=$((passed + $(echo "$line" | cut -d' ' -f1)))
    failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
  else
    failed=$((failed + 1))
  fi
  echo "=== $label: ${line:-no summary}, $(($(date +%s) - start)) s"
  rm -f "$log"
}
# The trainer through its command line (stage matrix, ledgers, bad input,
# PyTorch reference), then the trace checker (tests/check_trace.py) on
# damaged traces and on peers that must fail or pass.
run_script "trainer tests" 1200 tests/test_trainer.sh
run_script "checker tests" 600 tests/test_checker.sh

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
