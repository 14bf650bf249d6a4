#!/usr/bin/env bash
# tests/lab.sh — build and grade one course lab (notes/labs), or prove that
# every lab can be graded.
#
#   tests/lab.sh LAB [SOLUTION]   link SOLUTION (default: the lab's skeleton;
#                                 "engine": zero2's own code) in place of the
#                                 engine's seam, run the lab's tests under
#                                 mpirun -n 1, 2, 4, print the first failure
#                                 and "N passed, M failed"
#   tests/lab.sh --all            for every lab: the engine's code passes (at
#                                 N = 1, 2, 4), the skeleton fails (at N = 4),
#                                 and each planted mistake in
#                                 tests/lab_mistakes/ fails with the words its
#                                 "// expect:" line names (CI runs this)
#   tests/lab.sh --list           the labs and their seams
#
# `make lab` and `make labs` call it after building build-lab/zero2.o (the
# engine compiled with -DZ2_LAB_BUILD: its seams weak) and build-cpu/'s test
# objects; they pass MPICXX, CXXFLAGS and LAB_OBJECTS.
set -u
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
MPICXX=${MPICXX:-mpicxx}
CXXFLAGS=${CXXFLAGS:--std=c++17 -O2 -ffp-contract=off}
LAB_OBJECTS=${LAB_OBJECTS:-}

# --- the labs: name | the seam a student writes | the tests that grade it ----------
# The tests: the lab's grader first, then the engine's own tests the seam takes part in
# (doctest filters, comma-separated). Every lab runs at mpirun -n 1, 2 and 4.
# "peer": a Python lab. The student's function replaces the torch peer's (tests/peers/torch_peer.py
# --replace), which replays zero2's trace at N = 2 and 4; tests/check_trace.py grades each replay.
lab_table='
tree-sum|z2::tree_sum|lab tree-sum*,accumulating A reduce-scatters*,world-size invariance:*
reduce-scatter|z2::reduce_scatter_blocking, z2::all_gather_blocking|lab reduce-scatter*,deterministic reduce-scatter*
shards|z2::shard_begin|lab shards*,stage matrix*,mixed precision stage matrix*
own-shards|z2::update_region, z2::update_and_gather|lab own-shards*,stage matrix*,mixed precision stage matrix*,checkpoint runs*
gradient-shards|z2::stage2_gradient_output, z2::stage2_gradient_ready|lab gradient-shards*,stage matrix*,world-size invariance:*,mixed precision stage matrix*
loss-scale|z2::LossScaler::update|lab loss-scale*,fp16 loss scaler*,fp16 overflow on one rank*
arena|z2::arena_allocate, z2::arena_push, z2::arena_pop, z2::arena_release|lab arena*,ZeRO-R:*
offload|z2::checkpoint_to_prefetch|lab offload*,ZeRO-R:*
streams|z2::checkpoint_copy|lab streams*
reshard|z2::reshard_reads|lab reshard*
torch-step|sharded_step (tests/peers/torch_peer.py)|peer
'
labs=$(echo "$lab_table" | awk -F'|' 'NF == 3 {print $1}' | tr '\n' ' ')
lab_field() { echo "$lab_table" | awk -F'|' -v name="$1" -v field="$2" '$1 == name {print $field}'; }
seam_of() { lab_field "$1" 2; }
tests_of() { lab_field "$1" 3; }
skeleton_of() { [ "$(tests_of "$1")" = peer ] && echo "notes/labs/$1/skeleton.py" || echo "notes/labs/$1/skeleton.cpp"; }

die() { echo "lab: $*" >&2; echo "0 passed, 1 failed"; exit 1; }
need_build() {
  [ -f build-lab/zero2.o ] || die "no build-lab/zero2.o: run it through make (make lab LAB=...)"
  [ -n "$LAB_OBJECTS" ] || die "LAB_OBJECTS is empty: run it through make (make lab LAB=...)"
}

# build LAB SOLUTION BINARY: link the engine, the test objects and the solution.
build() {
  local lab=$1 solution=$2 binary=$3 objects=""
  mkdir -p "$(dirname "$binary")"
  if [ "$solution" != engine ]; then
    [ -f "$solution" ] || { echo "lab: no file $solution"; return 1; }
    "$MPICXX" $CXXFLAGS -I. -c "$solution" -o "$binary.solution.o" 2>"$binary.log" || {
      echo "lab: $solution does not compile:"; head -n 20 "$binary.log"; return 1; }
    objects="$binary.solution.o"
  fi
  "$MPICXX" build-lab/zero2.o $LAB_OBJECTS $objects -o "$binary" -lopenblas -fopenmp -lcrypto 2>"$binary.log" || {
    echo "lab: linking $solution failed (does it define $(seam_of "$lab") exactly as zero2.h declares it?):"
    head -n 20 "$binary.log"; return 1; }
}

# grade_peer LAB SOLUTION [RANKS...]: a Python lab (see the table): the peer with the student's
# function replays zero2's trace (tests/peers/reference_trace.sh, by build-cpu's trainer) at each N,
# and tests/check_trace.py grades the replay. Without the Hugging Face venv: SKIP.
grade_peer() {
  local lab=$1 solution=$2; shift 2
  local ranks=${*:-2 4} passed=0 failed=0 first="" dir="build-lab/$lab" python=.venv-hf/bin/python replace=()
  if ! "$python" -c 'import torch, transformers' 2>/dev/null; then
    echo "SKIP: lab $lab needs .venv-hf (Debian's torch and transformers: make hf-venv)"; echo "0 passed, 0 failed"
    return 0
  fi
  if [ "$solution" != engine ]; then
    [ -f "$solution" ] || { echo "lab: no file $solution"; echo "0 passed, 1 failed"; return 1; }
    replace=(--replace "$solution")
  fi
  mkdir -p "$dir"
  for n in $ranks; do
    local log="$dir/run.$n.log" run_passed=0 run_failed=1 summary
    rm -rf "$dir/theirs.$n"
    if ! tests/peers/reference_trace.sh build-cpu/train_bert_mini "$dir/ref.$n" "$n" --steps 10 > "$log" 2>&1; then
      echo "lab: zero2's reference trace at N = $n could not be made:"; tail -n 3 "$log"; echo "0 passed, 1 failed"
      return 1
    fi
    if OMP_NUM_THREADS=1 timeout 300 "$python" tests/peers/torch_peer.py --nproc-per-node "$n" --step flat \
         "${replace[@]}" "$dir/ref.$n" "$dir/theirs.$n" >> "$log" 2>&1; then
      /usr/bin/python3 tests/check_trace.py "$dir/ref.$n" "$dir/theirs.$n" >> "$log" 2>&1
      summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -n 1)
      [ -n "$summary" ] && run_passed=${summary%% *} && run_failed=$(echo "$summary" | cut -d' ' -f3)
    fi
    echo "  N = $n: $run_passed passed, $run_failed failed"
    if [ "$run_failed" -gt 0 ] && [ -z "$first" ]; then
      first=$(grep -E '^FAIL|^diagnosis' "$log" | tr '\n' ' ')
      [ -z "$first" ] && first="the replay did not finish: $(grep -E 'Error|error' "$log" | tail -n 1)"
      first="at N = $n: $first"
    fi
    passed=$((passed + run_passed))
    failed=$((failed + run_failed))
  done
  [ -n "$first" ] && echo "first failure, $first"
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
}

# grade LAB SOLUTION [RANKS...]: prints what differs first and "N passed, M failed".
grade() {
  local lab=$1 solution=$2; shift 2
  [ "$(tests_of "$lab")" = peer ] && { grade_peer "$lab" "$solution" "$@"; return; }
  local ranks=${*:-1 2 4} binary="build-lab/$lab/test_lab" passed=0 failed=0 first=""
  build "$lab" "$solution" "$binary" || { echo "0 passed, 1 failed"; return 1; }
  for n in $ranks; do
    local log="build-lab/$lab/run.$n.log"
    # The simulated device's default schedule, whatever the shell set: a grade is the same every time
    # (Z2_SIM_SCHEDULE=seed:N would reorder the streams, Z2_SIM_SKIP drop the engine's own waits).
    env -u Z2_SIM_SCHEDULE -u Z2_SIM_SKIP timeout 120 mpirun -n "$n" "$binary" --test-case="$(tests_of "$lab")" \
      >"$log" 2>&1
    local status=$? summary
    summary=$(grep -E '^\[doctest\] test cases:' "$log" | tail -n 1)
    local run_passed=0 run_failed=1
    if [ -n "$summary" ]; then
      run_passed=$(echo "$summary" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+')
      run_failed=$(echo "$summary" | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+')
    fi
    [ "$status" -ne 0 ] && [ "$run_failed" -eq 0 ] && run_failed=1
    echo "  mpirun -n $n: $run_passed passed, $run_failed failed$([ "$status" -eq 124 ] && echo ' (timed out)')"
    if [ "$run_failed" -gt 0 ] && [ -z "$first" ]; then
      # The grader's own line when there is one; else doctest's first error and its messages.
      first=$(grep -m1 '^\[lab\]' "$log" | sed 's/^\[lab\] //')
      [ -z "$first" ] && first=$(grep -m1 -A4 -E 'ERROR|error:|Error|terminate' "$log" | tr '\n' ' ')
      [ -z "$first" ] && first="the run ended without a summary (exit $status): see $log"
      first="at mpirun -n $n: $first"
    fi
    passed=$((passed + run_passed))
    failed=$((failed + run_failed))
  done
  [ -n "$first" ] && echo "first failure, $first"
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
}

case ${1:-} in
  --list)
    for lab in $labs; do printf '%-15s %s   (notes/labs/%s/)\n' "$lab" "$(seam_of "$lab")" "$lab"; done
    exit 0 ;;
  --all)
    need_build
    checks_passed=0 checks_failed=0
    verdict() {  # verdict OK TEXT
      if [ "$1" = yes ]; then echo "PASS: $2"; checks_passed=$((checks_passed + 1));
      else echo "FAIL: $2"; checks_failed=$((checks_failed + 1)); fi
    }
    for lab in $labs; do
      echo "=== lab $lab: the engine's code"
      out=$(grade "$lab" engine); echo "$out"
      echo "$out" | grep -q '^SKIP' && continue  # a peer lab without its venv: neither passed nor failed
      verdict "$(echo "$out" | grep -qE '^[1-9][0-9]* passed, 0 failed$' && echo yes)" \
        "lab $lab: zero2's own $(seam_of "$lab") passes its grader"
      # A skeleton fails at every N: one run (N = 4, as the mistakes; a peer lab's at N = 2, the
      # fewer Python ranks to start) shows it.
      skeleton_ranks=$([ "$(tests_of "$lab")" = peer ] && echo 2 || echo 4)
      echo "=== lab $lab: the skeleton (N = $skeleton_ranks)"
      out=$(grade "$lab" "$(skeleton_of "$lab")" "$skeleton_ranks"); echo "$out"
      verdict "$(echo "$out" | grep -qE '^[0-9]+ passed, [1-9][0-9]* failed$' && echo yes)" \
        "lab $lab: the skeleton as shipped fails its grader"
      # A peer lab's planted mistakes are the checker's: make check-peer PEER=torch grades them.
      for mistake in tests/lab_mistakes/"$lab".*.cpp; do
        [ -f "$mistake" ] || continue
        expect=$(sed -n 's|^// expect: ||p' "$mistake" | head -n 1)
        echo "=== lab $lab: planted mistake $(basename "$mistake") (N = 4)"
        out=$(grade "$lab" "$mistake" 4); echo "$out"
        verdict "$(echo "$out" | grep -qE '^[0-9]+ passed, [1-9][0-9]* failed$' &&
                   echo "$out" | grep '^first failure' | grep -qF "$expect" && echo yes)" \
          "lab $lab: $(basename "$mistake" .cpp | cut -d. -f2-) fails, and the first failure says \"$expect\""
      done
    done
    echo "$checks_passed passed, $checks_failed failed"
    [ "$checks_failed" -eq 0 ] ;;
  ""|-h|--help)
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    exit 2 ;;
  *)
    lab=$1
    echo " $labs " | grep -q " $lab " || die "no lab \"$lab\"; the labs: $labs (tests/lab.sh --list)"
    need_build
    solution=${2:-$(skeleton_of "$lab")}
    echo "=== lab $lab: grading $solution in place of $(seam_of "$lab")"
    grade "$lab" "$solution" ;;
esac
