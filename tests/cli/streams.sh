#!/usr/bin/env bash
# tests/cli/streams.sh BUILD_DIR — the simulated device (--device sim: the cuda backend's three streams run
# on the CPU by an adversarial scheduler; notes/15-streams.md). Its bits are --device cpu's over a
# covering set of stage x overlap x precision x activations x optimizer offload x N (A = 4/N) x bucket;
# every site that orders the streams (each record, wait, synchronize
# and synchronize_all the sources call, found by tests/cli/streams.py) is skipped in turn on the configs
# that reach it: the bits change or the run stops, or the site is in streams.py's EXPLAINED list with why
# (the table in notes/15); and four ordering mistakes planted by hand in a copy of the sources, each
# rebuilt, are caught. Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"
# The runs here crash on purpose (a skipped wait). UCX's own SIGSEGV handler frees memory, so a crash
# inside malloc would deadlock in it instead of ending the rank (tests/cli/streams.py, Runner.run).
export UCX_HANDLE_ERRORS=none

# sim_matches LABEL N FLAGS...: the tiny run on N ranks on --device cpu, then on --device sim: the same
# final hash and the same loss bits at every step.
bits_of() { json_get "$1" "d['final_params_hash'] + ' ' + ' '.join(s['loss_bits'] for s in d['steps'])"; }
sim_matches() {
  local label=$1 ranks=$2
  shift 2
  for device in cpu sim; do
    rm -f "$work/$device.json"
    if ! timeout 120 mpirun -n "$ranks" "$trainer" "${tiny_run[@]}" --comm mpi "$@" --device $device \
         --json "$work/$device.json" > "$work/log" 2>&1; then
      fail "$label: --device $device: exit non-zero: $(grep -m1 -E 'error|race' "$work/log" | head -c 300)"; return
    fi
  done
  local cpu_bits sim_bits
  cpu_bits=$(bits_of "$work/cpu.json") sim_bits=$(bits_of "$work/sim.json")
  if [ -n "$cpu_bits" ] && [ "$cpu_bits" = "$sim_bits" ]; then
    pass "$label: --device sim gives --device cpu's bits (${cpu_bits%% *})"
  else fail "$label: sim $sim_bits != cpu $cpu_bits"; fi
}

# One row of the covering set: stage, overlap, precision, activations, optimizer offload, N, bucket.
matrix_row() {
  local stage=$1 overlap=$2 precision=$3 activations=$4 optimizer=$5 ranks=$6 bucket=$7
  local label="sim matrix: stage $stage, overlap $overlap, $precision, activations $activations"
  label+=", optimizer $optimizer, N=$ranks A=$((4 / ranks)), bucket $bucket"
  sim_matches "$label" "$ranks" --stage "$stage" --overlap "$overlap" $(precision_flags "$precision") \
    --activations "$activations" --offload-optimizer "$optimizer" --accum $((4 / ranks)) --bucket "$bucket"
}

# make test: one representative run, every mechanism at once (stage 2's slots, offloaded activations and
# optimizer, 16-bit, accumulation, overlap).
matrix_one() {
  echo "=== --device sim against --device cpu: one representative run"
  matrix_row 2 1 bf16 offload cpu 2 3000
}

# Every pair of values of the seven factors in at least one run (11 runs; an all-pairs covering set,
# not the 972-run product). (Seeded schedules: tests/cli/sim_device.sh.)
matrix() {
  echo "=== --device sim against --device cpu: the covering set"
  #          stage overlap precision activations optimizer N  bucket
  matrix_row 0     1       fp16      offload     none      1  3000
  matrix_row 1     1       bf16      keep        cpu       1  524288
  matrix_row 2     0       fp32      recompute   cpu       1  3000
  matrix_row 0     0       bf16      recompute   none      2  524288
  matrix_row 1     0       fp16      keep        none      2  3000
  matrix_row 2     1       bf16      keep        cpu       2  524288
  matrix_row 2     1       fp32      offload     none      2  524288
  matrix_row 0     0       fp32      keep        none      4  524288
  matrix_row 1     0       fp32      recompute   none      4  524288
  matrix_row 1     0       bf16      offload     cpu       4  3000
  matrix_row 2     1       fp16      recompute   cpu       4  524288
}

# The mutation test (tests/cli/streams.py: the sites, the configs, EXPLAINED), its table for notes/15.
mutation() {
  echo "=== every ordering site skipped in turn (Z2_SIM_SKIP)"
  py streams mutation "$build" "$work/mutation.json" > "$work/mutation.log" 2>&1
  cat "$work/mutation.log"
  add_summary "$work/mutation.log" "the mutation test"
}
# make test's stand-in: one site, stage 2's wait before a slot is reused, skipped: the bits must change.
mutation_one() {
  echo "=== one ordering site skipped: the wait before a stage-2 slot is reused"
  local site
  site=$(py streams sites | awk '$3 == "open_bucket_buffer" && $2 == "wait" { print $1 }')
  [ -n "$site" ] || { fail "no wait in open_bucket_buffer among the sites"; return; }
  rm -f "$work/cpu.json" "$work/skip.json"
  timeout 120 mpirun -n 2 "$trainer" "${tiny_run[@]}" --stage 2 --bucket 3000 --device cpu --json "$work/cpu.json" \
    > /dev/null 2>&1
  Z2_SIM_SKIP=$site timeout 120 mpirun -n 2 "$trainer" "${tiny_run[@]}" --stage 2 --bucket 3000 --device sim \
    --json "$work/skip.json" > "$work/log" 2>&1
  local status=$? times
  times=$(sed -n "s/^\[sim\] skipped $site \([0-9]*\) times$/\1/p" "$work/log")
  if [ "${times:-0}" -eq 0 ]; then fail "$site: not reached"
  elif [ $status -ne 0 ] || [ "$(bits_of "$work/skip.json")" != "$(bits_of "$work/cpu.json")" ]; then
    pass "$site skipped ($times times): the run changes (exit $status)"
  else fail "$site skipped $times times: the bits did not change"; fi
}

# --- mistakes planted by hand ---------------------------------------------------------------------
# planted LABEL FILE OLD NEW [OLD NEW ...] -- FLAGS: in a copy of the sources FILE's OLD becomes NEW (each
# found exactly once), only the objects that depend on FILE are rebuilt (the make commands of the real
# tree, run in the copy with the build's objects copied beside them), and the planted trainer on sim must
# not give the cpu run's bits (a race report, a stop, other bits), while on cpu, where everything runs at
# once in program order, it must: the mistake is one of order only.
plant_build=""
planted() {
  local label=$1 file=$2 copy="$work/planted" start=$SECONDS edits=()
  shift 2
  while [ "$1" != -- ]; do edits+=("$1"); shift; done
  shift
  rm -rf "$copy" && mkdir -p "$copy"
  cp -a zero2.cu zero2.h train_bert_mini.cu runtime trainer "$plant_build" "$copy/"
  py streams replace "$copy/$file" "${edits[@]}" || { fail "planted $label: the edit of $file did not apply"; return; }
  local commands
  commands=$(make -n -W "$file" "$plant_build/train_bert_mini" 2>/dev/null | grep -v '^make')
  if ! (cd "$copy" && eval "$commands") > "$work/plant_build.log" 2>&1; then
    fail "planted $label: the copy did not build: $(tail -n 3 "$work/plant_build.log")"; return
  fi
  local built=$((SECONDS - start)) planted_trainer="$copy/$plant_build/train_bert_mini"
  rm -f "$work/cpu.json" "$work/planted_cpu.json" "$work/planted.json"
  timeout 120 mpirun -n 2 "$trainer" "${tiny_run[@]}" "$@" --device cpu --json "$work/cpu.json" > /dev/null 2>&1
  timeout 120 mpirun -n 2 "$planted_trainer" "${tiny_run[@]}" "$@" --device cpu --json "$work/planted_cpu.json" \
    > /dev/null 2>&1
  if [ "$(bits_of "$work/planted_cpu.json")" != "$(bits_of "$work/cpu.json")" ]; then
    fail "planted $label: on --device cpu too the bits differ: the edit changed more than an order"; return
  fi
  timeout 120 mpirun -n 2 "$planted_trainer" "${tiny_run[@]}" "$@" --device sim --json "$work/planted.json" \
    > "$work/log" 2>&1
  local status=$? how=""
  if grep -q "a race on the simulated device" "$work/log"; then how="a race report"
  elif [ $status -ne 0 ]; then how="a stop (exit $status: $(grep -m1 -oE 'error: .{0,90}' "$work/log"))"
  elif [ "$(bits_of "$work/planted.json")" != "$(bits_of "$work/cpu.json")" ]; then how="other bits"
  fi
  if [ -n "$how" ]; then pass "planted: $label: caught by $how (built in ${built} s, $((SECONDS - start)) s in all)"
  else fail "planted: $label: not caught, the cpu run's bits (built in ${built} s)"; fi
  rm -rf "$copy"
}
planted_mistakes() {
  echo "=== ordering mistakes planted by hand, each in a rebuilt copy"
  # The g++ build when it is there and current (one .cu compiles in seconds), else this one.
  plant_build=build-cpu
  if [ ! -x build-cpu/train_bert_mini ] || ! make -q build-cpu/train_bert_mini 2>/dev/null; then plant_build=$build; fi
  local wait_shards='rank_state.home->wait_for_shards();'
  local squares='const std::vector<float> local = rank_state.local_chunk_sums();'
  planted "ZeRO-Offload: the host reads the gradient shards (their squares) before it waits for their copies down" \
    zero2.cu "$wait_shards" "" "$squares" "$squares $wait_shards" -- --stage 2 --offload-optimizer cpu --bucket 3000
  planted "ZeRO-Offload: the updated shard's copy up on the copy stream, which the all-gather does not follow" \
    runtime/offload.h 'updated, s.region(b).length * s.element, s.compute.comm_stream());' \
    'updated, s.region(b).length * s.element, s.compute.copy_stream());' \
    -- --stage 2 --offload-optimizer cpu --bucket 3000
  planted "stage 2: a slot zeroed for the next bucket after its copy down, while its reduce-scatter's sum reads it" \
    zero2.cu 'p.compute.wait(p.compute.compute_stream(), p.slots[slot].done);' \
    'p.compute.wait(p.compute.compute_stream(), p.slots[slot].copied);' -- --stage 2 --bucket 3000
  planted "offloaded activations: backward waits for the checkpoint's copy out, not for its copy back" \
    train_bert_mini.cu 'compute_.wait(compute_.compute_stream(), prefetched_[l]);' \
    'compute_.wait(compute_.compute_stream(), offloaded_[l]);' -- --stage 2 --activations offload
}

quick matrix_one
all matrix
quick_only mutation_one
all mutation
all planted_mistakes
finish
