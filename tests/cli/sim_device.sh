#!/usr/bin/env bash
# tests/cli/sim_device.sh BUILD_DIR — the simulated device's own rules (runtime/simulated_device.h), each
# shown by a small stream program (tests/sim_check.cpp) at N = 2 (the host read at N = 1): a wait orders a copy before the loop
# that reads it, and without it the loop reads poison; the host sees a copy's destination only after a
# synchronize; a copy reads its source when it runs, not when it is asked for; two unordered operations
# on the same bytes are a race, reported on every rank with both call sites; the host may not touch device
# memory. Then the golden table's bits on sim, what --device sim refuses, and seeded interleavings
# training to --device cpu's bits.
# Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"

check_program() { # CASE [N]: run build/sim_check CASE at N ranks (2), its output in $work/CASE.log, its status in $status
  timeout 60 mpirun -n "${2:-2}" "$build/sim_check" "$1" > "$work/$1.log" 2>&1
  status=$?
}

stream_rules() {
  echo "=== the simulated device's rules, one stream program each (tests/sim_check.cpp)"
  check_program ordered
  [ $status -eq 0 ] && [ "$(grep -c '^result: 2 4 6 8$' "$work/ordered.log")" = 2 ] &&
    pass "a loop that waits for the copy up reads its values (2 4 6 8 on both ranks)" ||
    fail "ordered: $(head -c 300 "$work/ordered.log")"
  check_program no-wait
  [ $status -eq 0 ] && [ "$(grep -c '^result: -*nan -*nan -*nan -*nan$' "$work/no-wait.log")" = 2 ] &&
    pass "without the wait the loop reads the copy's poisoned destination (NaN on both ranks), every run" ||
    fail "no-wait: $(head -c 300 "$work/no-wait.log")"
  check_program host-early
  [ $status -eq 0 ] && [ "$(grep -c '^early:' "$work/host-early.log")" = 2 ] &&
    ! grep -q '^early: 2 4 6 8$' "$work/host-early.log" &&
    pass "the host reading a copy's destination before synchronizing does not see the copy's values" ||
    fail "host-early: $(head -c 300 "$work/host-early.log")"
  check_program source-late
  [ $status -eq 0 ] && [ "$(grep -c '^result: 20 40 60 80$' "$work/source-late.log")" = 2 ] &&
    pass "a copy reads its source when it runs: a source rewritten before the synchronize is what arrives" ||
    fail "source-late: $(head -c 300 "$work/source-late.log")"
  check_program race
  [ $status -ne 0 ] && [ "$(grep -c 'a race on the simulated device: copy of 16 bytes on the copy stream (asked at tests/sim_check.cpp:[0-9]* (race)) and fill of 16 bytes on the comm stream (asked at tests/sim_check.cpp:[0-9]* (race))' "$work/race.log")" -ge 1 ] &&
    ! grep -q 'no race reported' "$work/race.log" &&
    pass "a fill on comm and a copy on copy into the same bytes, no event: a race, both named with their" \
      "streams and lines; the job stops (MPI_Abort), exit $status" ||
    fail "race: exit $status, $(head -c 400 "$work/race.log")"
  check_program host-read 1  # one rank: the call stack is not cut short by another rank's abort
  [ $status -ne 0 ] && [ "$(grep -c 'the host touched device memory: byte 4 of a 4,096-byte device buffer' "$work/host-read.log")" -ge 1 ] &&
    grep -q 'host_read.* at .*tests/sim_check.cpp:[0-9]' "$work/host-read.log" &&
    ! grep -q '^read ' "$work/host-read.log" &&
    pass "the host reading device memory stops the job, naming the buffer and the line that read it" ||
    fail "host-read: exit $status, $(head -c 400 "$work/host-read.log")"
  check_program host-read-freed 1
  [ $status -ne 0 ] && grep -q 'the host touched device memory: device memory no live buffer holds' "$work/host-read-freed.log" &&
    pass "the host reading a released device buffer stops the job too" ||
    fail "host-read-freed: exit $status, $(head -c 400 "$work/host-read-freed.log")"
}

refusals() {
  echo "=== what --device sim refuses"
  bad_case "--comm nccl with --device sim: the simulated device runs MPI's collectives only" "${tiny_run[@]}" \
    --device sim --comm nccl
  Z2_SIM_SCHEDULE=sideways bad_case "Z2_SIM_SCHEDULE=sideways: the simulated device's schedules are late" \
    "${tiny_run[@]}" --device sim
}

# The randomised interleavings (Z2_SIM_SCHEDULE=seed:N) run operations as
# early as a GPU may: a correct program trains to --device cpu's bits under each.
seeded_schedules() {
  echo "=== seeded interleavings: --device cpu's bits under each"
  local flags=("${tiny_run[@]}" --stage 2 --bucket 300 --activations offload --offload-optimizer cpu)
  timeout 120 mpirun -n 2 "$trainer" "${flags[@]}" --device cpu --quiet --json "$work/seed_cpu.json" > /dev/null 2>&1
  local expected differing=""
  expected=$(json_get "$work/seed_cpu.json" "d['final_params_hash']")
  for seed in 1 2 3; do
    Z2_SIM_SCHEDULE=seed:$seed timeout 120 mpirun -n 2 "$trainer" "${flags[@]}" --device sim --quiet \
      --json "$work/seed_$seed.json" > "$work/log" 2>&1
    [ "$(json_get "$work/seed_$seed.json" "d['final_params_hash']" 2>/dev/null)" = "$expected" ] ||
      differing+=" seed:$seed ($(tail -n 2 "$work/log" | head -c 200))"
  done
  [ -n "$expected" ] && [ -z "$differing" ] &&
    pass "Z2_SIM_SCHEDULE=seed:1, 2, 3 (stage 2, small buckets, activation offload, ZeRO-Offload, N = 2):" \
      "--device cpu's hash $expected" || fail "seeded schedules:$differing"
}

# The golden table (tests/golden_bits.txt, README "Portable bits") holds
# hashes made on the cpu backend in portable mode: the same on sim means the
# stream program, run late and poisoned, computes exactly the cpu's program.
golden_bits() {
  echo "=== the golden table's bits on the simulated device (--portable)"
  Z2_VERIFY_FLAGS="--device sim" timeout 300 tests/verify.sh "$build" > "$work/verify.log" 2>&1 &&
    pass "--device sim: $(tail -n 1 "$work/verify.log")" || fail "golden bits on sim: $(grep -v '^same' "$work/verify.log" | head -c 400)"
}

quick stream_rules
quick golden_bits
quick refusals
all seeded_schedules
finish
