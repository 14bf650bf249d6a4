#!/usr/bin/env bash
# tests/cli/zero_r.sh BUILD_DIR — ZeRO-R through the command line: every --activations x --alloc (arena,
# naive, caching) in every (N, stage) of the stage matrix gives the matrix's bits, with fresh activation
# buffers poisoned (NaN: the trainer leaves them unzeroed, so it must write before it reads; the 16-bit
# ZeRO-R runs are precision.sh's); the offload bound computed here from the config; the arena allocates
# nothing after step 1; naive and caching run out of memory in a block the arena fits in, cleanly, on every
# rank. Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"

# Every (N, stage) of the matrix (A = 4/N, overlap on) with the other eight combinations; keep + arena (the
# default) is the matrix's own run, the reference. `make test` runs stage 2 alone; `make test-all` all three.
zero_r_runs() {  # STAGES
  echo "=== ZeRO-R: --activations x --alloc against the stage matrix's bits; bounds; allocations; out of memory"
  for N in 1 2 4; do
    A=$((4 / N))
    for stage in "$@"; do
      reference_run $N "$work/zero_r_${N}_${stage}_keep_arena.json" --accum $A --stage $stage --overlap 1
      [ -z "$reference" ] && reference=$(json_get "$work/zero_r_${N}_${stage}_keep_arena.json" \
        "d['final_params_hash'] + ' ' + ' '.join(s['loss_bits'] for s in d['steps'])") &&
        reference_label="the matrix's N=$N stage=$stage"
      for activations in keep recompute offload; do
        for alloc in arena naive caching; do
          [ "$activations/$alloc" = keep/arena ] && continue
          # Poisoned: a read of an activation before it is written would show.
          same_bits_run \
            "ZeRO-R N=$N A=$A stage=$stage --activations $activations --alloc $alloc, poisoned (the matrix's bits)" \
            $N "$work/zero_r_${N}_${stage}_${activations}_${alloc}.json" --accum $A --stage $stage \
            --activations $activations --alloc $alloc --poison-activations
        done
      done
    done
  done
}
stage_2() { zero_r_runs 2; }
stages_0_1() { zero_r_runs 0 1; }

ledgers() {
  verdict=$(py zero_r ledgers "$work")
  case "$verdict" in ok*) pass "ZeRO-R ledgers: $verdict";; *) fail "ZeRO-R ledgers: $verdict";; esac
}

# Out of memory. A model where offload's long-lived checkpoints, allocated between temporaries, leave
# naive's free memory in pieces: the arena's measured need (its peak reserved, exactly what it needs: the
# block is its bottom plus its stack) is enough for the arena and not for naive, at every N. One step less
# (256 bytes) is not enough for the arena either.
out_of_memory() {
  local oom=(--layers 3 --hidden 64 --heads 2 --intermediate 256 --seq 32 --micro-batch 4 --steps 2
             --activations offload)
  for N in 1 2 4; do
    if ! timeout 300 mpirun -n $N "$trainer" "${oom[@]}" --alloc arena --quiet --json "$work/oom_arena.json" \
         > "$work/log" 2>&1; then
      fail "out of memory N=$N: the roomy arena run failed"; cat "$work/log"; continue
    fi
    need=$(json_get "$work/oom_arena.json" "d['memory']['reserved_bytes']")
    if timeout 300 mpirun -n $N "$trainer" "${oom[@]}" --alloc arena --device-memory-limit "$need" --quiet \
        --json "$work/oom_arena_tight.json" > "$work/log" 2>&1; then
      pass "out of memory N=$N: the arena runs in its measured need, $need bytes"
    else
      fail "out of memory N=$N: the arena failed in its measured need $need"; cat "$work/log"
    fi
    bad_ranks=$N bad_case "bytes free in" "${oom[@]}" --alloc naive --device-memory-limit "$need"
    bad_ranks=$N bad_case "bytes of the limit not yet in segments" "${oom[@]}" --alloc caching \
      --device-memory-limit "$need"
    bad_ranks=$N bad_case "(--alloc arena)" "${oom[@]}" --alloc arena --device-memory-limit $((need - 256))
  done
}

quick stage_2
all stages_0_1
all ledgers
all out_of_memory
finish
