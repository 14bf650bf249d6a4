#!/usr/bin/env bash
# tests/run_tests.sh BUILD_DIR — the test suite: the doctest suite (the engine and the model in process)
# under mpirun -n 1, 2, 4, then the trainer through its command line, one file per capability
# (tests/cli/*.sh), then the trace checker (tests/cli/checker.sh); each under its own time limit (the table
# below), and one plain closing line "N passed, M failed": doctest's test cases summed over its runs plus
# every file's checks (a run or a file that dies or times out without its summary counts as one failed).
#
#   ONLY="checkpoints plan"  run only these (the names in the table; make test ONLY=...)
#   Z2_QUICK=1               `make test`: each file's quick checks, one per claim the README makes (a file's
#                            `quick` groups); without it (`make test-all`) every check
#   Z2_DOCTEST_RANKS="2"     the world sizes of the doctest runs (default "1 2 4"; make test-cpu: 2)
#   Z2_ALL=1                 `make test-all` (without ONLY): then the targets that check the other builds and
#                            tools, each as make runs it: test-cpu, labs, sanitize, check-peer (PEER=torch)
#
# A file runs alone too: tests/cli/checkpoints.sh build-cpu (every check; Z2_QUICK=1 for the quick ones).
set -u
build=${1:-build}
cd "$(dirname "$0")/.."
# Several ranks on few cores: one OpenBLAS thread each.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}

# name              time limit (s)  what it checks
suite="
doctest             300   the engine and the model in process (tests/test_*.cpp, .cu), per mpirun
stages              120   the stage matrix through the command line: N x stage x overlap, one set of bits
ledgers              60   the JSON summary's ledgers against the paper's formulas
bad_input           180   bad input: one message, a non-zero exit, nothing written
launchers            60   torchrun / srun / Open MPI variables around a one-rank MPI world refused; --deepspeed, --local_rank
torch_reference     120   PyTorch's loss, gradients and AdamW step on a dumped batch
zero_r              240   ZeRO-R: every --activations x --alloc gives the matrix's bits; out of memory
precision           240   bf16 and fp16: the matrix, the ledgers, fp16's skipped steps, accuracy
reliability         300   full disks, odd inputs and outputs, a stopped rank and the watchdog
checkpoints         400   resume and reshard bit for bit, damaged checkpoints, killed saves, signals
deepspeed_configs   300   real DeepSpeed configs, DeepSpeed's defaults and schedulers
hugging_face        120   the export read by Hugging Face transformers
metrics              60   --metrics and --eval-every
plan                480   --plan against the measured ledger, the arena's block, the memory check
portable            300   --portable's bits under every kernel, in both builds; the golden table
traces              240   --trace's bits at every stage and split; --init-hf; check_trace.py on them
offload             180   ZeRO-Offload: the bits without it, checkpoints both ways, the ledger
sim_device           60   --device sim's rules: a missing wait reads poison, races and host reads of device memory stop
streams             300   --device sim: cpu's bits over a covering set; every wait skipped in turn; planted mistakes
timeline             90   --timeline: valid trace-event JSON; on sim the reduce-scatters under backward only with overlap
include_layers       60   trainer/'s includes form layers (settings -> inputs -> formats -> training), no cycle
checker             300   tests/check_trace.py on damaged traces and on peers that must fail or pass
"
names=$(echo "$suite" | awk 'NF { print $1 }')
limit_of() { echo "$suite" | awk -v name="$1" '$1 == name { print $2 }'; }
only=${ONLY:-$names}
for name in $only; do
  if [ -z "$(limit_of "$name")" ]; then
    echo "run_tests: ONLY names '$name'; the names are:" $names
    echo "0 passed, 1 failed"
    exit 2
  fi
done
wanted() { [[ " $(echo $only) " == *" $1 "* ]]; }
[ -n "${Z2_QUICK:-}" ] && echo "=== quick (make test): one check per claim; make test-all runs every check"

passed=0
failed=0
add() {  # LABEL LOG STATUS START: add the log's "N passed, M failed" line; none (or a non-zero exit
         # after a clean summary) is one failure
  local label=$1 log=$2 status=$3 start=$4 line
  line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -n 1)
  if [ -n "$line" ]; then
    passed=$((passed + $(echo "$line" | cut -d' ' -f1)))
    failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
    if [ "$status" -ne 0 ] && [ "$(echo "$line" | cut -d' ' -f3)" -eq 0 ]; then failed=$((failed + 1)); fi
  else
    failed=$((failed + 1))
  fi
  [ "$status" -eq 124 ] && echo "=== $label timed out"
  echo "=== $label: ${line:-no summary}, exit $status, $(($(date +%s) - start)) s"
}

# The doctest suite: its own summary, turned into the plain line.
if wanted doctest; then
  binary="$build/test_zero2"
  if [ ! -x "$binary" ]; then
    echo "=== no $binary: build it first (make)"; failed=$((failed + 1))
  fi
  for ranks in ${Z2_DOCTEST_RANKS:-1 2 4}; do
    [ -x "$binary" ] || break
    echo "=== $binary under mpirun -n $ranks"
    log=$(mktemp)
    start=$(date +%s)
    timeout "$(limit_of doctest)" mpirun -n "$ranks" "$binary" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    summary=$(grep -E '^\[doctest\] test cases:' "$log" | tail -n 1)
    if [ -n "$summary" ]; then
      echo "$(echo "$summary" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+') passed," \
           "$(echo "$summary" | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+') failed" >> "$log"
    fi
    add "mpirun -n $ranks" "$log" "$status" "$start"
    rm -f "$log"
  done
fi

# The files: tests/cli/NAME.sh BUILD_DIR (or NAME.py, a check of the sources), each ending with its plain line.
for name in $names; do
  [ "$name" = doctest ] && continue
  wanted "$name" || continue
  log=$(mktemp)
  start=$(date +%s)
  file="tests/cli/$name.sh"
  [ -f "$file" ] || file="tests/cli/$name.py"  # a check of the sources alone, in Python
  echo "=== $file $build"
  timeout "$(limit_of "$name")" "$file" "$build" 2>&1 | tee "$log"
  add "$name" "$log" "${PIPESTATUS[0]}" "$start"
  rm -f "$log"
done

# make test-all: the other builds and tools, each target's own plain line added in. (Z2_ALL is unset
# for them: test-cpu runs this script again.)
if [ -n "${Z2_ALL:-}" ] && [ -z "${ONLY:-}" ]; then
  for target in test-cpu labs sanitize check-peer; do
    echo "=== make $target"
    log=$(mktemp)
    start=$(date +%s)
    Z2_ALL= make --no-print-directory "$target" 2>&1 | tee "$log"
    add "make $target" "$log" "${PIPESTATUS[0]}" "$start"
    rm -f "$log"
  done
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
