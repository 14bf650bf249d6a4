#!/usr/bin/env bash
# tests/test_all.sh — `make test-all`: every check there is, each part as its own make target runs it,
# then how long each part took and one plain line, "N passed, M failed", summed over the parts (a part
# that ends without its own line counts as one failed):
#   the suite, whole     tests/run_tests.sh build: the doctest suite at N = 1, 2, 4 and every check of
#                        every tests/cli file (make test runs their quick checks)
#   make test-cpu        the g++ build: it builds, and computes the same bits (the Makefile says which)
#   make labs            every course lab is gradable (notes/labs)
#   make sanitize        the cpu build under AddressSanitizer and UBSan, and the safetensors fuzzer
#   make check-peer      PyTorch's ZeRO replays zero2's trace and passes; each planted mistake is named
# With ONLY= (make test-all ONLY=checkpoints) only the suite runs, and only those files, whole.
set -u
cd "$(dirname "$0")/.."
passed=0
failed=0
took=""
part() {  # LABEL COMMAND...: run it, add its last plain line
  local label=$1 log start line
  shift
  echo "=== $label"
  log=$(mktemp)
  start=$(date +%s)
  "$@" 2>&1 | tee "$log"
  line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -n 1)
  if [ -n "$line" ]; then
    passed=$((passed + $(echo "$line" | cut -d' ' -f1)))
    failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
  else
    failed=$((failed + 1))
  fi
  took="$took${took:+, }$label $(($(date +%s) - start)) s"
  rm -f "$log"
}

part "the suite" tests/run_tests.sh build
if [ -z "${ONLY:-}" ]; then
  for target in test-cpu labs sanitize check-peer; do
    part "make $target" make --no-print-directory "$target"
  done
fi
echo "=== where the time went: $took"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
