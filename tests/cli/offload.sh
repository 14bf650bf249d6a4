#!/usr/bin/env bash
# tests/cli/offload.sh BUILD_DIR — ZeRO-Offload (--offload-optimizer cpu; a config's offload_optimizer or
# cpu_offload): the optimizer's partition and step on the host change no bit. Stage 1 and 2 x fp32 / bf16 /
# fp16 x overlap at N = 2, and N = 1, 4, give the bits of the run without it (fp16: the same skipped steps);
# checkpoints saved without it resume with it and the reverse; the ledger's host bytes in --json = 16 Psi/N
# and the device's its formula; the header; --plan's host bytes; bad input (stage 0 by flag and by config,
# unknown and nvme devices, pin_memory, ratio, fast_init, fp16_master_weights_and_grads, both spellings, no
# optimizer type: the client's optimizer, which DeepSpeed refuses under offload), each named. The bad input
# and the plan need no trained step; the rest runs the engine's offloaded step (its own matrix is in
# tests/test_engine.cpp). Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"
echo "=== ZeRO-Offload: bad input, the plan's host bytes, the same bits as without it, checkpoints both ways, the ledger"
# The checkpoint of 8 steps saved at step 4 without offload, at N = 2, stage 2 (as checkpoints.sh saves it):
# $work/ck_PRECISION_2_2, its straight run's summary beside it (.straight.json). Made once.
saved_without_offload() {  # PRECISION
  local dir="$work/ck_${1}_2_2"
  [ -f "$dir.straight.json" ] && return
  timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" $(precision_flags $1) --stage 2 --accum 2 --steps 8 --save-every 4 \
    --save "$dir" --json "$dir.straight.json" > "$work/log" 2>&1 ||
    fail "the $1 checkpoint without offload: $(head -c 200 "$work/log")"
}

bad_input() {
  bad_case "--offload-optimizer cpu with --stage 0: offloading the optimizer needs ZeRO stage 1 or 2" "${small[@]}" \
    --stage 0 --offload-optimizer cpu
  bad_case "--offload-optimizer wants cpu|none (got 'nvme')" "${small[@]}" --offload-optimizer nvme
  # Each config refused for one key, named with its reason (DeepSpeed 0.16.9's, cited in trainer/deepspeed_config.cpp).
  offload_refused() {  # name, the zero_optimization block (JSON), the fragment the one message must hold
    echo "{\"zero_optimization\": $2}" > "$work/offload_$1.json"
    bad_case "$3" "${small[@]}" --config "$work/offload_$1.json"
  }
  offload_refused stage0_default '{"offload_optimizer": {"device": "cpu"}}' \
    "config key 'zero_optimization.offload_optimizer.device' \"cpu\" with stage 0 (DeepSpeed's default"
  offload_refused stage0_old '{"stage": 0, "cpu_offload": true}' \
    "config key 'zero_optimization.cpu_offload' true with config key 'zero_optimization.stage' 0"
  offload_refused device '{"stage": 2, "offload_optimizer": {"device": "gpu"}}' \
    "offload_optimizer.device: \"gpu\" is not a device DeepSpeed knows"
  offload_refused nvme '{"stage": 2, "offload_optimizer": {"device": "nvme"}}' \
    "offload_optimizer.device: \"nvme\" is not supported: NVMe offload (ZeRO-Infinity) is not implemented"
  grep -qF "without nvme_path DeepSpeed's stage 3 fails" "$work/bad_stderr" ||
    fail "nvme without nvme_path: the message does not say what DeepSpeed does without the path"
  offload_refused nvme_path '{"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}' \
    "offload_optimizer.device: \"nvme\" is not supported"
  offload_refused pin '{"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": "yes"}}' \
    "offload_optimizer.pin_memory: wants true or false, a JSON boolean without quotes (got \"yes\")"
  offload_refused ratio '{"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}' \
    "offload_optimizer.ratio: 0.5 is not supported: partial offload"
  offload_refused fast_init '{"stage": 2, "offload_optimizer": {"device": "cpu", "fast_init": true}}' \
    "offload_optimizer.fast_init: true is not supported"
  offload_refused both '{"stage": 2, "cpu_offload": true, "offload_optimizer": {"device": "cpu"}}' \
    "zero_optimization.cpu_offload: given together with zero_optimization.offload_optimizer"
  # No optimizer "type" under offload: the client's optimizer, which DeepSpeed refuses (ZeRORuntimeException).
  offload_refused client_optimizer '{"stage": 2, "offload_optimizer": {"device": "cpu"}}' \
    "config key 'zero_optimization.offload_optimizer.device' offloads the optimizer, and the config file names no optimizer \"type\""
  echo '{"zero_optimization": {"stage": 2, "cpu_offload": true}, "fp16": {"enabled": true, "fp16_master_weights_and_grads": true}}' \
    > "$work/offload_fp16_master.json"
  bad_case "fp16.fp16_master_weights_and_grads: true is not supported" "${small[@]}" \
    --config "$work/offload_fp16_master.json"
}

# A host that cannot hold the offloaded optimizer: refused before anything is allocated, the host's share
# named. The limit lies between what the run needs without offload and with it (each read from the
# refusal at a limit of 1 KB), so it is the offloaded 16 Psi/N that does not fit. BERT-mini's size: at
# N = 1 offload adds 4 Psi = 13.7 MB to the need (16 Psi on the host, 12 Psi off the block), well above
# the ~1 MiB by which two runs' measured holdings may differ.
host_memory() {
  need_of() { ZERO2_MEMORY_LIMIT=1000 timeout 60 "$trainer" --steps 1 --stage 2 --offload-optimizer "$1" 2>&1 |
    sed -n 's/.*this configuration needs \([0-9,]*\) bytes.*/\1/p' | tr -d ,; }
  need_none=$(need_of none) need_cpu=$(need_of cpu)
  if [ -n "$need_none" ] && [ -n "$need_cpu" ] && [ "$need_cpu" -gt $((need_none + 4194304)) ]; then
    ZERO2_MEMORY_LIMIT=$(( (need_none + need_cpu) / 2 )) bad_ranks=1 bad_case \
      "the optimizer offloaded (ZeRO-Offload, 16 Psi/N)" --steps 1 --stage 2 --offload-optimizer cpu
  else
    fail "offload's host bytes are not counted by the memory check: needs $need_none without offload, $need_cpu with it"
  fi
}

# The plan with offload (no step needed): every stage and N, the host's
# bytes equal 16 Psi/N to the byte, the device's model states their formula,
# and stage 2's device keeps the working parameters alone.
plan_host_bytes() {
  verdict=$(for precision in fp32 bf16; do
    "$trainer" --plan --plan-world-sizes 1,2,4 --offload-optimizer cpu --precision $precision \
      --json "$work/offload_plan.json" --quiet "${tiny[@]}" > /dev/null 2>&1 ||
      { echo "bad: --plan $precision failed"; continue; }
    py offload plan_rows "$work/offload_plan.json" $precision
  done | sort -u)
  [ "$verdict" = ok ] && pass "--plan --offload-optimizer cpu: host 16 Psi/N and device model states = their" \
    "formulas, fp32 and bf16, stages 0/1/2, N = 1, 2, 4" ||
    fail "offload plan: $verdict"
}

# The same bits: every (stage 1, 2) x precision x overlap at N = 2, and N = 1 and 4 once, against the run
# without offload (for fp32 and bf16 the stage matrix's run at N = 2, stage 2, overlap on: A = 4/N, the same
# global batch; fp16 with the config that overflows, fp16_skips.json, so that the skipped steps are compared
# too).
same_bits() {
  for precision in fp32 bf16 fp16; do
    reference=""
    case $precision in
      fp32|bf16)
        reference_run 2 "$work/matrix_$precision.json" --precision $precision --accum 2 --stage 2 --overlap 1
        reference=$(json_get "$work/matrix_$precision.json" \
          "d['final_params_hash'] + ' ' + ' '.join(s['loss_bits'] for s in d['steps'])")
        reference_label="the $precision matrix's N=2 stage=2 overlap=1";;
      fp16) same_bits_run "fp16 (overflowing) stage 2 N=2, no offload" 2 "$work/offload_ref_fp16.json" \
              --config "$work/fp16_skips.json" --accum 2 --steps 8 --stage 2;;
    esac
    extra=(); [ $precision = fp16 ] && extra=(--config "$work/fp16_skips.json" --steps 8) || \
      extra=(--precision $precision)
    for stage in 1 2; do
      for overlap in 0 1; do
        same_bits_run "$precision offload N=2 A=2 stage=$stage overlap=$overlap" 2 \
          "$work/offload_${precision}_2_${stage}_${overlap}.json" "${extra[@]}" --accum 2 --stage $stage \
            --overlap $overlap \
          --offload-optimizer cpu
      done
    done
    same_bits_run "$precision offload N=1 A=4 stage=2" 1 "$work/offload_${precision}_1.json" "${extra[@]}" --accum 4 \
      --stage 2 --offload-optimizer cpu
    same_bits_run "$precision offload N=4 A=1 stage=1" 4 "$work/offload_${precision}_4.json" "${extra[@]}" --accum 1 \
      --stage 1 --offload-optimizer cpu
  done
  skips=$(for f in "$work"/offload_ref_fp16.json "$work"/offload_fp16_*.json; do
    json_get "$f" "[s['step'] for s in d['steps'] if s['skipped']]"; done | sort -u)
  [ "$(echo "$skips" | wc -l)" = 1 ] && [ "$skips" != "[]" ] &&
    pass "fp16 with offload skips the steps it skips without ($skips)" || fail "fp16 skipped steps differ with" \
      "offload: $skips"
}

# The host's threads (--host-threads K) change no bit: each thread owns whole norm chunks. K = 2 and 3
# (3 splits the chunks unevenly, and the last thread's run ends the region) on both precisions and
# stages, against the run without offload; K = 1 is same_bits' (2 ranks on this machine's 2 cores:
# the default is 1). The engine suite runs K = 1, 2, 3 for every stage and precision (test_offload.cpp).
host_threads() {
  for precision in fp32 bf16; do
    reference_run 2 "$work/matrix_$precision.json" --precision $precision --accum 2 --stage 2 --overlap 1
    reference=$(json_get "$work/matrix_$precision.json" \
      "d['final_params_hash'] + ' ' + ' '.join(s['loss_bits'] for s in d['steps'])")
    reference_label="the $precision matrix's N=2 stage=2 overlap=1 (no offload)"
    for stage in 1 2; do
      threads=$((4 - stage))  # stage 1 on 3 threads, stage 2 on 2
      same_bits_run "$precision offload N=2 A=2 stage=$stage --host-threads $threads" 2 \
        "$work/threads_${precision}_${stage}.json" --precision $precision --accum 2 --stage $stage \
        --offload-optimizer cpu --host-threads $threads
    done
  done
  verdict=$(json_get "$work/threads_bf16_2.json" "d['host_threads']")
  [ "$verdict" = 2 ] && pass "--json records the host threads the run used ($verdict)" ||
    fail "--json's host_threads: '$verdict'"
  bad_case "--host-threads wants an integer from 0 to 1024 (got '-1')" "${small[@]}" --offload-optimizer cpu \
    --host-threads -1
  bad_case "--host-threads wants an integer from 0 to 1024 (got 'two')" "${small[@]}" --host-threads two
}

# The ledger in --json: the host's bytes equal 16 Psi/N, the device's model
# states model_states_formula(..., offload), measured and recomputed here.
offload_ledger() {
  verdict=$(py offload ledger "$work"/offload_*_2_*_1.json "$work"/offload_*_1.json "$work"/offload_*_4.json)
  case "$verdict" in ok*) pass "offload ledger: host = 16 Psi/N, device = 4 Psi / 2 Psi (stage 1: twice), by" \
    "category, ${verdict#ok }";;
    *) fail "offload ledger: $verdict";; esac
}

# The header: both shares beside their formulas, equal.
header() {
  timeout 120 mpirun -n 2 "$trainer" "${tiny[@]:0:${#tiny[@]}-1}" --precision bf16 \
    --offload-optimizer cpu > "$work/log" 2>&1
  grep -q "^  model states on the device per rank: [0-9,]* bytes; formula 2 Psi = [0-9,]* (equal)" "$work/log" &&
    grep -q "^  offloaded to the host per rank: [0-9,]* bytes; formula 16 Psi/N = [0-9,]* (equal)" "$work/log" &&
    grep -q "^  offload   optimizer to the host (ZeRO-Offload)" "$work/log" &&
    pass "the header: device and host model states beside their formulas, equal" ||
    fail "offload header: $(grep -E 'model states|offload|error' "$work/log" | head -c 400)"
}

# A config's offload_optimizer without pin_memory gets the pinning note,
# only while the run offloads: --offload-optimizer none overriding it
# printed the note anyway (issue 35).
pinning_note() {
  echo '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "AdamW"}}' \
    > "$work/offload_unpinned.json"
  for choice in cpu none; do
    timeout 120 mpirun -n 2 "$trainer" "${tiny[@]:0:${#tiny[@]}-1}" --steps 1 --config "$work/offload_unpinned.json" \
      --offload-optimizer $choice > "$work/pin_$choice.log" 2>&1
  done
  grep -q "pin_memory false (DeepSpeed 0.16.9's default): zero2 pins" "$work/pin_cpu.log" &&
    ! grep -q "zero2 pins" "$work/pin_none.log" && ! grep -q "error" "$work/pin_none.log" &&
    pass "the header's pinning note only where the run offloads (the config's cpu, not --offload-optimizer none over" \
      "it)" ||
    fail "pinning note: with cpu $(grep -c 'zero2 pins' "$work/pin_cpu.log"), with none" \
      "$(grep -c 'zero2 pins' "$work/pin_none.log")"
}

# Checkpoints: saved without offload (as checkpoints.sh saves them), resumed with it; saved with it,
# resumed without; both = the straight 8 steps (fp16: with its skips).
checkpoints_both_ways() {
  for precision in fp32 bf16 fp16; do
    dir="$work/ck_${precision}_2_2"
    saved_without_offload $precision
    timeout 120 mpirun -n 2 "$trainer" --load "$dir/step_4" --offload-optimizer cpu \
      --quiet --json "$dir.to_offload.json" \
      > "$work/log" 2>&1
    verdict=$(resumed_matches "$dir.straight.json" "$dir.to_offload.json" 2>&1)
    [ "$verdict" = ok ] && pass "$precision: saved without offload, resumed with it: the same bits" ||
      fail "$precision resume into offload: $verdict $(head -c 200 "$work/log")"
    odir="$work/ck_offload_${precision}"
    timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" $(precision_flags $precision) --stage 1 --accum 2 \
      --steps 8 --save-every 4 \
      --save "$odir" --offload-optimizer cpu > "$work/log" 2>&1
    timeout 120 mpirun -n 2 "$trainer" --load "$odir/step_4" --stage 2 --offload-optimizer none --quiet \
      --json "$odir.resumed.json" > "$work/log" 2>&1
    verdict=$(resumed_matches "$dir.straight.json" "$odir.resumed.json" $([ $precision = fp16 ] && echo skips) 2>&1)
    [ "$verdict" = ok ] && pass "$precision: saved with offload (stage 1), resumed without it (stage 2): the same" \
      "bits" ||
      fail "$precision resume out of offload: $verdict $(head -c 200 "$work/log")"
  done
}

# A checkpoint saved with offload is the checkpoint saved without it: the same tensor files, the same index
# but for its run_id (each run's own).
checkpoint_files() {
  for offload in none cpu; do
    timeout 120 mpirun -n 2 "$trainer" "${tiny[@]}" --steps 2 --save-every 2 --stage 2 --precision bf16 \
      --offload-optimizer $offload --save "$work/ck_files_$offload" > "$work/log" 2>&1
  done
  verdict=$(py offload same_checkpoint "$work/ck_files_none/step_2" "$work/ck_files_cpu/step_2")
  case "$verdict" in ok*) pass "a checkpoint saved with offload: the files of one saved without it (${verdict#ok };" \
    "the index but its run_id and the offload setting)";;
    *) fail "checkpoint files with offload: $verdict";; esac
}

# A trace with offload is the trace without it, file for file but trace.json (which says it offloaded).
trace_files() {
  trace_flags=("${tiny[@]}" --dropout 0 --stage 2 --precision bf16 --trace-params-every 1)
  timeout 120 mpirun -n 2 "$trainer" "${trace_flags[@]}" --trace "$work/trace_plain" > "$work/log" 2>&1
  timeout 120 mpirun -n 2 "$trainer" "${trace_flags[@]}" --offload-optimizer cpu \
    --trace "$work/trace_offload" >> "$work/log" 2>&1
  same=yes
  [ "$(cd "$work/trace_plain" 2>/dev/null && find . -type f | sort)" \
    = "$(cd "$work/trace_offload" 2>/dev/null && find . -type f | sort)" ] ||
    same="no (not the same files)"
  for file in $(cd "$work/trace_plain" 2>/dev/null && find . -type f ! -name trace.json); do
    cmp -s "$work/trace_plain/$file" "$work/trace_offload/$file" || same="no ($file)"
  done
  [ -d "$work/trace_plain/step_3" ] && [ "$same" = yes ] &&
    [ "$(json_get "$work/trace_offload/trace.json" "d['run']['offload_optimizer']")" = True ] &&
    pass "--trace with offload: the files of the trace without it (parameters and gradients at every step), offload" \
      "recorded" ||
    fail "offload trace: the same files: $same $(tail -c 300 "$work/log")"
}

# Resumed with no word on offload: it continues as saved (a run that needed the host's memory keeps it).
inherit_on_resume() {
  timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_offload_bf16/step_4" --quiet --json "$work/ck_inherit.json" \
    > "$work/log" 2>&1
  saved_without_offload bf16
  verdict=$(resumed_matches "$work/ck_bf16_2_2.straight.json" "$work/ck_inherit.json" 2>&1)
  [ "$verdict" = ok ] && \
    [ "$(json_get "$work/ck_inherit.json" "d['offload_optimizer'] + ' ' + d['settings_origin']['offload_optimizer']")" \
    = "cpu checkpoint" ] &&
    pass "--load without --offload-optimizer: offloaded as saved (settings_origin: checkpoint), the same bits" ||
    fail "offload not continued from the checkpoint: $verdict" \
      "$(json_get "$work/ck_inherit.json" "d['offload_optimizer'], d['settings_origin'].get('offload_optimizer')" 2>&1 | head -c 200)"
  bad_case "--offload-optimizer cpu (the checkpoint's, not given here) with --stage 0" \
    --load "$work/ck_offload_bf16/step_4" --stage 0
}

quick same_bits
quick checkpoints_both_ways
quick host_threads
all bad_input
all host_memory
all plan_host_bytes
all offload_ledger
all header
all pinning_note
all checkpoint_files
all trace_files
all inherit_on_resume
finish
