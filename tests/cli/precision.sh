#!/usr/bin/env bash
# tests/cli/precision.sh BUILD_DIR — mixed precision through the command line: in bf16 and in fp16 the
# stage matrix and ZeRO-R give one hash per precision (and three precisions three hashes); the ledgers
# against 16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N and 2 bytes an element; an fp16 run forced to
# overflow skips the same steps in every stage and N, with DeepSpeed's scale trajectory recomputed here;
# bf16 and fp16 train as fp32 does (within a margin); the 16-bit rounding against torch's; one bf16 and one
# fp16 step against fp64 and torch.autocast; bad input. Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"

declare -A precision_bits
matrix() {
  echo "=== mixed precision: bf16 and fp16 through the command line"
  for precision in bf16 fp16; do
    reference=""
    for N in 1 2 4; do
      A=$((4 / N))
      # Overlap off at N = 2 only: the engine's own matrix (tests/test_precision.cpp) crosses overlap with
      # every stage and bucket size in both precisions.
      overlaps="1"
      [ $N -eq 2 ] && overlaps="0 1"
      for stage in 0 1 2; do
        for overlap in $overlaps; do
          same_bits_run "$precision matrix N=$N A=$A stage=$stage overlap=$overlap" $N \
            "$work/mixed_${precision}_${N}_${stage}_${overlap}.json" --precision $precision --accum $A \
            --stage $stage --overlap $overlap
        done
      done
      # ZeRO-R in this precision: three combinations per N (every one of them runs in process in every
      # precision and stage: tests/test_bert.cu).
      stage=$(( (N + 1) % 3 ))
      for pair in "recompute naive" "offload arena" "keep caching"; do
        set -- $pair
        same_bits_run "$precision ZeRO-R N=$N A=$A stage=$stage --activations $1 --alloc $2, poisoned" $N \
          "$work/mixed_zero_r_${precision}_${N}_$1_$2.json" --precision $precision --accum $A --stage $stage \
          --activations $1 --alloc $2 --poison-activations
      done
    done
    precision_bits[$precision]=$reference
  done
  reference_run 1 "$work/fp32.json" --accum 4 --stage 0 --overlap 0
  fp32_bits=$(json_get "$work/fp32.json" "d['final_params_hash']")
  if [ "${precision_bits[bf16]%% *}" != "$fp32_bits" ] && [ "${precision_bits[fp16]%% *}" != "$fp32_bits" ] &&
     [ "${precision_bits[bf16]%% *}" != "${precision_bits[fp16]%% *}" ]; then
    pass "mixed: fp32, bf16 and fp16 give three different hashes (the 16-bit roundings show)"
  else
    fail "mixed: a 16-bit run has another precision's hash"
  fi
}

# The ledgers from the config alone (the tiny model of ledgers.sh), over the matrix's runs.
ledgers() {
  for precision in bf16 fp16; do
    verdict=$(py precision ledgers "$work" $precision)
    case "$verdict" in
      ok*) pass "$precision ledgers: 16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N, 2 bytes on the wire: $verdict";;
      *) fail "$precision ledgers: $verdict";;
    esac
  done
}

# fp16 forced to overflow: 2^30 overflows at once; hysteresis 2 and a window of 4 clean steps make the
# scale fall and rise again. Every stage and N must skip the same steps, and the scale of every step must
# follow DeepSpeed's update_scale, recomputed here from the skips alone.
overflow() {
  echo '{"fp16": {"enabled": true, "initial_scale_power": 30, "loss_scale_window": 4, "hysteresis": 2,
         "min_loss_scale": 1}}' > "$work/fp16_overflow.json"
  local overflow_runs=() out
  for run in "1 4 2" "2 2 0" "2 2 1" "2 2 2" "4 1 2"; do
    set -- $run
    out="$work/overflow_$1_$3.json"
    if timeout 300 mpirun -n $1 "$trainer" "${tiny[@]}" --steps 24 --config "$work/fp16_overflow.json" --accum $2 \
        --stage $3 --json "$out" > "$work/log" 2>&1; then
      overflow_runs+=("$out")
    else
      fail "fp16 overflow N=$1 stage=$3: exit non-zero"; cat "$work/log"
    fi
  done
  verdict=$(py precision overflow "${overflow_runs[@]}")
  case "$verdict" in ok*) pass "fp16 overflow: $verdict";; *) fail "fp16 overflow: $verdict";; esac
}

# bf16 and fp16 train as fp32 does: the mean loss of the last 10 of 60 steps within 1% of fp32's
# (measured: within 1e-4 here; 1% is 2.5 bf16 roundings of the loss, while a broken 16-bit path, an
# unscaled fp16 gradient or a lost update, stalls far above it).
accuracy() {
  local small_train=(--layers 2 --hidden 64 --heads 4 --intermediate 256 --seq 64 --max-positions 64 --micro-batch 8
                     --steps 60 --lr 2e-3 --quiet)
  for precision in fp32 bf16 fp16; do
    timeout 300 mpirun -n 2 "$trainer" "${small_train[@]}" --precision $precision \
      --json "$work/accuracy_$precision.json" > "$work/log" 2>&1 ||
      { fail "accuracy $precision: exit non-zero"; cat "$work/log"; }
  done
  verdict=$(py precision accuracy "$work")
  case "$verdict" in ok*) pass "mixed accuracy: $verdict";; *) fail "mixed accuracy: $verdict";; esac
}

# The 16-bit rounding against torch's (every exponent, every boundary).
rounding() {
  if torch_missing; then
    echo "SKIP 16-bit rounding against torch (no torch here)"
  elif "$PYTHON" tests/convert_check.py "$build/convert_tool" > "$work/convert.log" 2>&1; then
    while read -r line; do case "$line" in PASS*) pass "${line#PASS }";; esac; done < "$work/convert.log"
  else
    fail "16-bit rounding against torch"; cat "$work/convert.log"
  fi
}

# One bf16 and one fp16 step against fp64 on the same 16-bit weights, and bf16 against torch.autocast
# (tests/torch_reference.py mixed: the tolerances are justified there).
torch_mixed() {
  for precision in bf16 fp16; do
    if torch_missing; then
      echo "SKIP torch mixed reference (no torch here)"; continue
    fi
    if timeout 300 mpirun -n 1 "$trainer" --layers 2 --hidden 64 --heads 4 --intermediate 128 --seq 32 \
         --max-positions 40 --micro-batch 4 --accum 2 --steps 1 --dropout 0 --clip 0.5 --seed 3 --quiet \
         --precision $precision --dump-batch "$work/dump_$precision" > "$work/log" 2>&1; then
      "$PYTHON" tests/torch_reference.py mixed "$work/dump_$precision" > "$work/torch_mixed.log" 2>&1
      cat "$work/torch_mixed.log"
      add_summary "$work/torch_mixed.log" "torch mixed reference ($precision)"
    else
      fail "torch mixed reference: the $precision dump run failed"; cat "$work/log"
    fi
  done
}

bad_input() {
  echo '{"fp16": {"enabled": true}, "bf16": {"enabled": true}}' > "$work/both.json"
  echo '{"fp16": {"enabled": false}}' > "$work/fp16_off.json"
  # The scaler's keys are read (and checked) only with fp16 on, as DeepSpeed reads them
  # (deepspeed_configs.sh, issue49_configs: off, the same values pass unread).
  echo '{"fp16": {"enabled": true, "loss_scale": -1}}' > "$work/negative_scale.json"
  echo '{"fp16": {"enabled": true, "min_loss_scale": -1}}' > "$work/negative_min.json"
  echo '{"fp16": {"enabled": true, "hysteresis": 0}}' > "$work/zero_hysteresis.json"
  echo '{"fp16": {"enabled": true, "loss_scale_window": 0}}' > "$work/zero_window.json"
  echo '{"bf16": {"enabled": "yes"}}' > "$work/bf16_string.json"
  echo '{"fp16": {"enabled": true, "initial_scale_power": 40, "hysteresis": 1, "min_loss_scale": 1099511627776}}' \
    > "$work/at_minimum.json"
  bad_case "--precision wants fp32|bf16|fp16" "${small[@]}" --precision fp8
  bad_case "'fp16.enabled' and 'bf16.enabled' are both true" "${small[@]}" --config "$work/both.json"
  bad_case "contradicts config key 'fp16.enabled' = false" "${small[@]}" --config "$work/fp16_off.json" --precision fp16
  bad_case "fp16.loss_scale: wants" "${small[@]}" --config "$work/negative_scale.json"
  bad_case "fp16.min_loss_scale: wants a number from 0" "${small[@]}" --config "$work/negative_min.json"
  bad_case "fp16.hysteresis: wants" "${small[@]}" --config "$work/zero_hysteresis.json"
  bad_case "fp16.loss_scale_window: wants" "${small[@]}" --config "$work/zero_window.json"
  bad_case "bf16.enabled: wants true or false" "${small[@]}" --config "$work/bf16_string.json"
  # At the minimum scale an overflow ends the run (DeepSpeed raises), on every rank, naming the step.
  bad_case "optimizer step 1: fp16 gradients overflowed at the minimum loss scale 1099511627776" "${small[@]}" \
    --config "$work/at_minimum.json"
}

quick matrix
all ledgers
quick overflow
all accuracy
all rounding
all torch_mixed
all bad_input
finish
