#!/usr/bin/env bash
# tests/cli/traces.sh BUILD_DIR — traces (notes/12): every file of a --trace and every step's record are the
# same bits at every stage and every (N, A) of one global batch; the trace against --json, --export-hf and
# --dump-batch (read with numpy); --init-hf starts from another run's weights bit for bit (fp32, bf16) and
# refuses a wrong shape, a missing, unknown or untied tensor, F64, a pickle, each named; tests/check_trace.py
# passes zero2 computed another way (--portable) in fp32 and bf16, fails another learning rate, and names
# the file and field of a bad trace (another version, contradicting settings, missing steps, a record or a
# tensor missing, a truncated file, NaN, an unfinished trace, a dropout reference); two runs into one
# --trace: exactly one proceeds. The groups run in this order: later ones read the traces of earlier ones.
# Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"
echo "=== --trace, --init-hf and tests/check_trace.py (notes/12)"
if ! "$PYTHON" -c 'import numpy' 2>/dev/null; then
  echo "SKIP the traces: $PYTHON has no numpy (make test-deps installs python3-numpy)"
  finish
fi
traced=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --steps 4
        --warmup 1 --dropout 0 --clip 0.5 --bucket 3000 --quiet --data "$work/corpus.txt")
trace_run() {  # trace_run DIR N FLAGS...: a trace of the tiny run at N ranks, its summary beside it (DIR.json)
  local dir=$1 ranks=$2
  shift 2
  rm -rf "$dir" "$dir.json"
  timeout 300 mpirun -n "$ranks" "$trainer" "${traced[@]}" --trace-params-every 2 "$@" --trace "$dir" \
    --json "$dir.json" \
    > "$work/log" 2>&1 ||
    { echo "    trace run failed: $(tail -c 300 "$work/log")"; return 1; }
}
# Every file of a trace but trace.json, and trace.json's records of the steps: the same bits at every stage
# and every split of the global batch that keeps the summation tree, as the run's own bits are.
same_trace() {  # same_trace LABEL DIR REFERENCE_DIR
  local label=$1 differing="" records
  for file in $(cd "$3" && find . -type f ! -name trace.json | sort); do
    cmp -s "$2/$file" "$3/$file" || differing="$differing $file"
  done
  records=$(py traces same_records "$2/trace.json" "$3/trace.json")
  if [ -z "$differing" ] && [ "$records" = same ]; then
    pass "$label: every file of the trace and every step's record are the bits of the reference trace"
  else fail "$label: differs in$differing (records: $records)"; fi
}
# The traces' checks need the reference trace (same_traces makes it, and says when it could not).
trace_ok=""

same_traces() {
  trace_ok=yes
  trace_run "$work/trace_ref" 2 --stage 2 || { trace_ok=""; fail "the reference trace could not be made"; return; }
  for case in "1 4 0" "2 2 1" "4 1 2" "2 2 0"; do
    set -- $case
    trace_run "$work/trace_$1_$2_$3" "$1" --accum $((4 / $1)) --stage "$3" --micro-batch 1 &&
      [ "$1 $2 $3" = "1 4 0" ] && cp -r "$work/trace_1_4_0" "$work/trace_split_ref"
  done
  for case in "2 2 1" "4 1 2" "2 2 0"; do
    set -- $case
    same_trace "trace at N = $1, A = $2, stage $3 (global batch 4 x 1)" "$work/trace_$1_$2_$3" "$work/trace_split_ref"
  done
  for stage in 0 1; do
    trace_run "$work/trace_stage$stage" 2 --stage $stage && same_trace "trace at stage $stage, N = 2" \
      "$work/trace_stage$stage" "$work/trace_ref"
  done
}

# What the trace says against what the run says elsewhere: the --json loss bits, and the export.
trace_against_outputs() {
  [ -n "$trace_ok" ] || return  # (the reference trace could not be made)
  trace_run "$work/trace_export" 2 --stage 2 --export-hf "$work/trace_export_hf"
  if cmp -s "$work/trace_export/step_4/model.safetensors" "$work/trace_export_hf/model.safetensors" &&
     [ "$(json_get "$work/trace_export.json" "' '.join(s['loss_bits'] for s in d['steps'])")" = \
       "$(json_get "$work/trace_export/trace.json" "' '.join(s['loss_bits'] for s in d['steps'])")" ]; then
    pass "trace: step_4's parameters are --export-hf's file, byte for byte; every step's loss bits are --json's"
  else fail "trace: the last parameters or the loss bits differ from --export-hf / --json"; fi
}

# The batch and step 1's gradients against --dump-batch (N = 1), read independently with numpy.
trace_against_dump() {
  [ -n "$trace_ok" ] || return  # (the reference trace could not be made)
  rm -rf "$work/trace_dump" "$work/trace_n1"
  timeout 120 "$trainer" "${traced[@]}" --accum 2 --dump-batch "$work/trace_dump" \
    --trace "$work/trace_n1" > "$work/log" 2>&1
  dump_check=$(py traces against_dump "$work/trace_n1" "$work/trace_dump")
  # (The batch is rebuilt for the trace on rank 0 from the seed, the dump's is what the micro-steps read;
  # at N = 1 both gradients come from one gathered vector: this checks the trace's names and shapes, the
  # gather itself is checked by the traces' equality across N above.)
  [ "$dump_check" = ok ] && pass "trace at N = 1, A = 2: step 1's batch is the one the micro-steps read" \
    "(--dump-batch's), its gradients are named and shaped as the dump's; the micro-batches' selected counts and losses add up" ||
    fail "trace against --dump-batch: $dump_check"
}

# --init-hf: the weights of another run (seed 5's export) are where this run starts, bit for bit, in
# fp32 and bf16 (whose fp32 master takes them whole), and the run from them is one hash at every stage.
init_hf() {
  [ -n "$trace_ok" ] || return  # (the reference trace could not be made)
  rm -rf "$work/seed5"
  timeout 120 "$trainer" "${traced[@]}" --seed 5 --steps 1 --export-hf "$work/seed5" > "$work/log" 2>&1
  for precision in fp32 bf16; do
    hashes=""
    for stage in 0 2; do
      trace_run "$work/init_$precision$stage" 2 --init-hf "$work/seed5" --precision $precision --stage $stage
      hashes="$hashes $(json_get "$work/init_$precision$stage.json" "d['final_params_hash']")"
    done
    set -- $hashes
    if cmp -s "$work/init_${precision}0/initial/model.safetensors" "$work/seed5/model.safetensors" && [ "$1" = "$2" ] &&
       [ "$1" != "$(json_get "$work/trace_stage0.json" "d['final_params_hash']")" ]; then
      pass "--init-hf $precision: the run starts from the given weights bit for bit, and stages 0 and 2 end at one" \
        "hash ($1)"
    else fail "--init-hf $precision: initial weights or hashes differ ($hashes)"; fi
  done
}

# The checker: a zero2 run computed another way (--portable: zero2's own gemm, another summation order)
# agrees within the tolerance, in fp32 and in bf16; one with another learning rate does not.
checker() {
  [ -n "$trace_ok" ] || return  # (the reference trace could not be made)
  for precision in fp32 bf16; do
    trace_run "$work/ck_$precision" 2 --precision $precision --steps 8 &&
    trace_run "$work/ck_${precision}_portable" 2 --precision $precision --steps 8 --portable
    if "$PYTHON" tests/check_trace.py "$work/ck_$precision" "$work/ck_${precision}_portable" \
      > "$work/check.log" 2>&1; then
      pass "checker, $precision: zero2 with its own gemm (--portable) agrees with zero2 with OpenBLAS:" \
        "$(grep '^PASS' "$work/check.log" | cut -c7-120)"
    else fail "checker, $precision: --portable against OpenBLAS:" \
      "$(grep -E '^FAIL|^diagnosis' "$work/check.log" | head -c 400)"; fi
  done
  trace_run "$work/ck_lr" 2 --steps 8 --lr 2e-3
  "$PYTHON" tests/check_trace.py "$work/ck_fp32" "$work/ck_lr" > "$work/check.log" 2>&1
  check_status=$?
  [ $check_status = 1 ] && grep -q '^FAIL step 1, learning rate' "$work/check.log" &&
    pass "checker: another learning rate fails at step 1's rate, exit 1" ||
    fail "checker: another learning rate: exit $check_status, $(head -c 300 "$work/check.log")"
}

# The checker's bad input: one message naming the file and the field, exit 2 (NaN: exit 1, named too).
checker_bad_input() {
  [ -n "$trace_ok" ] || return  # (the reference trace could not be made)
  checker_bad() {  # checker_bad LABEL EXPECTED_STATUS EXPECT THEIRS
    "$PYTHON" tests/check_trace.py "$work/ck_fp32" "$4" > "$work/check.log" 2>&1
    local status=$?
    if [ $status = "$2" ] && grep -qF -- "$3" "$work/check.log" && ! grep -q Traceback "$work/check.log"; then
      pass "checker, $1: exit $status, $(grep -E 'error:|^FAIL' "$work/check.log" | head -n 1 | cut -c1-150)"
    else fail "checker, $1: exit $status (want $2), $(head -c 300 "$work/check.log")"; fi
  }
  edited() {  # edited NAME PYTHON: a copy of the portable fp32 trace, its trace.json changed by PYTHON on `t`
    rm -rf "$work/$1"; cp -r "$work/ck_fp32_portable" "$work/$1"
    py traces edit_trace "$work/$1/trace.json" "$2"
  }
  edited v2 't["version"] = 2'
  checker_bad "a trace of another version" 2 "trace.json: 'version' is 2; this reader reads version 1" "$work/v2"
  edited contradicts 't["run"]["world_size"] = 4'
  checker_bad "settings that contradict" 2 "run.world_size is 4, zero2's trace has 2" "$work/contradicts"
  edited missing_step 'del t["steps"][5:]'
  checker_bad "missing steps" 2 "step 6 is missing" "$work/missing_step"
  edited nan_loss 't["steps"][2]["loss"] = float("nan")'
  checker_bad "NaN in theirs' loss" 1 "steps[2].loss" "$work/nan_loss"
  edited no_field 'del t["steps"][1]["grad_norm"]'
  checker_bad "a record without its grad norm" 2 "steps[1].grad_norm is missing" "$work/no_field"
  rm -rf "$work/truncated"; cp -r "$work/ck_fp32_portable" "$work/truncated"
  truncate -s 1000 "$work/truncated/step_8/model.safetensors"
  checker_bad "a truncated tensor file" 2 "step_8/model.safetensors" "$work/truncated"
  rm -rf "$work/no_tensor"; cp -r "$work/ck_fp32_portable" "$work/no_tensor"
  py traces edit_tensors "$work/no_tensor/step_1/model.safetensors" 'del t["cls.predictions.bias"]'
  checker_bad "a missing tensor" 2 "no tensor cls.predictions.bias" "$work/no_tensor"
  rm -f "$work/incomplete.json"; rm -rf "$work/incomplete"; cp -r "$work/ck_fp32_portable" "$work/incomplete"
  rm "$work/incomplete/trace.json"
  checker_bad "a trace whose run did not finish" 2 "trace.json: missing" "$work/incomplete"
  trace_run "$work/ck_dropout" 2 --steps 2 --dropout 0.1
  "$PYTHON" tests/check_trace.py "$work/ck_dropout" "$work/ck_fp32" > "$work/check.log" 2>&1
  check_status=$?
  [ $check_status = 2 ] && grep -qF "run.dropout is 0.1: zero2's dropout masks come from its own hash" \
    "$work/check.log" &&
    pass "checker: a reference traced with dropout is refused (its masks cannot be replayed), exit 2" ||
    fail "checker: a dropout reference: exit $check_status, $(head -c 300 "$work/check.log")"
}

# Bad input: one message, every rank, nothing written.
bad_input() {
  mkdir -p "$work/not_empty"; touch "$work/not_empty/x"
  bad_case "--trace '$work/not_empty' is not empty" "${small[@]}" --trace "$work/not_empty"
}

# Two runs into one new --trace directory (issue 35: both exited 0, the
# directory mixing their files): the lock is taken before the emptiness
# check, so exactly one proceeds. First deterministically: a run stopped
# (SIGSTOP) while it holds the lock on the still empty directory, seen in
# /proc/locks, refuses the second, which names the holder's pid.
trace_lock() {
  rm -rf "$work/t_locked"; mkdir "$work/t_locked"
  inode=$(stat -c %i "$work/t_locked")
  timeout 300 "$trainer" --steps 1 --quiet --trace "$work/t_locked" > /dev/null 2>&1 &
  run=$!
  holder=""  # the trainer's pid (timeout's child), as /proc/locks lists the lock's owner
  for _ in $(seq 1 400); do
    holder=$(awk -v inode=":$inode" '$2 == "FLOCK" && substr($6, length($6) - length(inode) + 1) == inode { print $5 }' /proc/locks)
    [ -n "$holder" ] && break; sleep 0.01
  done
  [ -n "$holder" ] && kill -STOP "$holder" 2>/dev/null
  if [ -n "$holder" ] && [ -z "$(ls -A "$work/t_locked")" ]; then
    bad_case "--trace '$work/t_locked' is being written by another run: give each run its own directory (the lock's holder: process $holder: $trainer" \
      "${small[@]}" --trace "$work/t_locked"
  else echo "    (the lock on an empty --trace directory was not caught in time: the lock case is left to the rounds below)"; fi
  [ -n "$holder" ] && kill -CONT "$holder" 2>/dev/null
  wait $run && [ -f "$work/t_locked/trace.json" ] && pass "the run holding --trace's lock goes on and writes its" \
    "trace" ||
    fail "the run holding --trace's lock did not finish its trace"
}

# Then as users would meet it: a small run and a BERT-mini run started
# together into one new directory, three rounds; each round exactly one
# exits 0, and the trace is whole and that run's (its model's sizes).
trace_race() {
  for round in 1 2 3; do
    rm -rf "$work/t_race"
    timeout 300 mpirun -n 1 "$trainer" --steps 2 --quiet --trace "$work/t_race" > "$work/race_big.log" 2>&1 &
    big=$!
    timeout 300 mpirun -n 1 "$trainer" "${small[@]}" --quiet --trace "$work/t_race" > "$work/race_small.log" 2>&1
    small_status=$?
    wait $big
    big_status=$?
    hidden=$(json_get "$work/t_race/trace.json" "d['model']['hidden_size']" 2>/dev/null)
    refused=$(cat "$work/race_big.log" "$work/race_small.log" | grep -cE "is being written by another run|is not empty")
    if { [ $big_status = 0 ] && [ $small_status != 0 ] && [ "$hidden" = 256 ]; } ||
       { [ $small_status = 0 ] && [ $big_status != 0 ] && [ "$hidden" = 16 ]; }; then
      [ "$refused" = 1 ] && pass "two runs into one new --trace (round $round): exactly one proceeds (BERT-mini exit" \
        "$big_status, the small run $small_status), the trace is the winner's, the other refused" ||
        fail "two runs into one --trace (round $round): the loser's message:" \
          "$(cat "$work/race_big.log" "$work/race_small.log" | head -c 300)"
    else fail "two runs into one --trace (round $round): BERT-mini exit $big_status, the small run $small_status, the" \
      "trace's hidden ${hidden:-none}"; fi
  done
}

bad_input_more() {
  bad_case "--trace records a run from step 1" "${small[@]}" --trace "$work/t_load" --load "$work/nowhere"
  bad_case "--trace-params-every 2 is for --trace DIR" "${small[@]}" --trace-params-every 2
  bad_case "is inside --trace" "${small[@]}" --trace "$work/t_in" --export-hf "$work/t_in/export"
  bad_case "--plan trains nothing, so --trace" "${small[@]}" --plan --trace "$work/t_plan"
  bad_case "--init-hf '$work/nowhere' and --load" "${small[@]}" --init-hf "$work/nowhere" --load "$work/nowhere"
  bad_case "has no config.json" "${small[@]}" --init-hf "$work"
}

init_hf_refused() {
  [ -n "$trace_ok" ] || return  # (the reference trace could not be made)
  small_init=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --steps 1)
  bad_case "config.json's num_hidden_layers is 2, this run's --layers is 3: give --layers 2" \
    "${small_init[@]}" --layers 3 \
    --init-hf "$work/seed5"
  bad_case "config.json's hidden_size is 32, this run's --hidden is 64" "${small_init[@]}" --hidden 64 \
    --init-hf "$work/seed5"
  # Hand-made directories: a tensor of the wrong shape, one missing, one unknown, an untied decoder, a pickle.
  init_dir() {  # init_dir NAME PYTHON: seed5's export with its tensors `t` changed by PYTHON
    rm -rf "$work/$1"; cp -r "$work/seed5" "$work/$1"
    py traces edit_tensors "$work/$1/model.safetensors" "$2"
  }
  init_dir wrong_shape 't["bert.encoder.layer.1.intermediate.dense.weight"] = np.zeros((32, 64), np.float32)'
  bad_case "bert.encoder.layer.1.intermediate.dense.weight has shape [32, 64], this run's is [64, 32]" \
    "${small_init[@]}" --init-hf "$work/wrong_shape"
  init_dir missing_tensor 'del t["bert.encoder.layer.0.output.LayerNorm.bias"]'
  bad_case "has no tensor bert.encoder.layer.0.output.LayerNorm.bias (shape [32])" "${small_init[@]}" \
    --init-hf "$work/missing_tensor"
  init_dir unknown_tensor 't["bert.encoder.layer.2.output.dense.weight"] = np.zeros((32, 64), np.float32)'
  bad_case "holds bert.encoder.layer.2.output.dense.weight [32, 64], which BertForMaskedLM has no parameter for" \
    "${small_init[@]}" --init-hf "$work/unknown_tensor"
  init_dir untied 't["cls.predictions.decoder.weight"] = t["bert.embeddings.word_embeddings.weight"] + 1'
  bad_case "cls.predictions.decoder.weight differs from bert.embeddings.word_embeddings.weight" "${small_init[@]}" \
    --init-hf "$work/untied"
  init_dir f64 't["cls.predictions.bias"] = t["cls.predictions.bias"].astype(np.float64)'
  bad_case "tensor 'cls.predictions.bias' is F64" "${small_init[@]}" --init-hf "$work/f64"
  rm -rf "$work/pickle"; mkdir -p "$work/pickle"; cp "$work/seed5/config.json" "$work/pickle/"; : \
    > "$work/pickle/pytorch_model.bin"
  bad_case "but a pytorch_model.bin" "${small_init[@]}" --init-hf "$work/pickle"
  # model.safetensors read as untrusted input (trainer/safetensors.h; tests/test_safetensors.cpp has the
  # whole corpus): a header length 4 bytes short (its padding keeps the JSON valid, every tensor would shift
  # by one float), trailing bytes, a name twice, a NaN weight.
  raw_dir() {  # raw_dir NAME PYTHON: seed5's export with model.safetensors' bytes `b` changed by PYTHON
    rm -rf "$work/$1"; cp -r "$work/seed5" "$work/$1"
    py traces edit_bytes "$work/$1/model.safetensors" "$2"
  }
  raw_dir header_short 'h = header + b" " * 8; b = struct.pack("<Q", len(h) - 4) + h + data'
  bad_case "model.safetensors' is not a safetensors file we can read: its tensors' data ends at byte" \
    "${small_init[@]}" --init-hf "$work/header_short"
  raw_dir trailing 'b += b"\0" * 4'
  bad_case "the rest belongs to no tensor" "${small_init[@]}" --init-hf "$work/trailing"
  raw_dir twice 'h = b"{\"cls.predictions.bias\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}," + header[1:]; b = struct.pack("<Q", len(h)) + h + data'
  bad_case "its header has the key 'cls.predictions.bias' twice in one object" "${small_init[@]}" \
    --init-hf "$work/twice"
  init_dir nan 'x = t["bert.encoder.layer.1.attention.self.query.bias"].copy(); x[5] = np.nan; t["bert.encoder.layer.1.attention.self.query.bias"] = x'
  bad_case "nan/model.safetensors': tensor 'bert.encoder.layer.1.attention.self.query.bias' element 5 [5] is nan: weights to start from must be finite" \
    "${small_init[@]}" --init-hf "$work/nan"
  # config.json's sizes: a value that is not a positive integer is quoted as written, and the only advice
  # is a flag value the flag takes.
  config_dir() {  # config_dir NAME TEXT: seed5's export with config.json's hidden_size written as TEXT
    rm -rf "$work/$1"; cp -r "$work/seed5" "$work/$1"
    py traces set_hidden_size "$work/$1/config.json" "$2"
  }
  for written in 64.0 '"64"' -64 true null 1e3; do
    config_dir hidden "$written"
    bad_case "config.json's hidden_size is $written, not a positive integer (BertConfig's sizes are ints); this run's --hidden is 32" \
      "${small_init[@]}" --init-hf "$work/hidden"
    if grep -qF -- "give --hidden" "$work/bad_stderr"; then fail "--init-hf hidden_size $written: advice to give a" \
      "flag value"; fi
  done
  # Absent: BertConfig's default is named as the default (it was called "not a positive integer"), and
  # the advice is the flag value that matches it.
  rm -rf "$work/absent"; cp -r "$work/seed5" "$work/absent"
  py common edit_json "$work/absent/config.json" "del d['hidden_size']"
  bad_case "config.json's hidden_size is absent (BertConfig's default 768), this run's --hidden is 32: give --hidden 768" \
    "${small_init[@]}" --init-hf "$work/absent"
  config_dir hidden 18446744073709551615
  bad_case "hidden_size is 18446744073709551615, this run's --hidden is 32 (and 18446744073709551615 is beyond what --hidden takes)" \
    "${small_init[@]}" --init-hf "$work/hidden"
  # A dangling link and a link loop under the name: said as such, not as "has no model.safetensors".
  rm -rf "$work/links"; mkdir -p "$work/links"; cp "$work/seed5/config.json" "$work/links/"
  ln -s "$work/links/nowhere" "$work/links/model.safetensors"
  bad_case "--init-hf's model.safetensors '$work/links/model.safetensors' cannot be read: No such file or directory (a symlink to nothing)" \
    "${small_init[@]}" --init-hf "$work/links"
  rm "$work/links/model.safetensors"; ln -s model.safetensors "$work/links/model.safetensors"
  bad_case "model.safetensors' cannot be read: Too many levels of symbolic links (a symlink loop" \
    "${small_init[@]}" --init-hf "$work/links"
  rm "$work/links/config.json"; ln -s config.json "$work/links/config.json"
  bad_case "--init-hf's config.json '$work/links/config.json' cannot be read: Too many levels of symbolic links (a symlink loop" \
    "${small_init[@]}" --init-hf "$work/links"
  # A save that also holds the tied names and the pre-training heads (pooler, NSP) is taken, the heads named unused.
  init_dir pretraining \
    't["cls.predictions.decoder.weight"] = t["bert.embeddings.word_embeddings.weight"]; t["bert.pooler.dense.bias"] = np.zeros(32, np.float32); t["cls.predictions.transform.dense.bias"] = t["cls.predictions.transform.dense.bias"].astype(np.float16)'
  if timeout 60 "$trainer" "${small_init[@]}" --init-hf "$work/pretraining" > "$work/log" 2>&1 &&
     grep -qF "not used, as from_pretrained leaves them: bert.pooler.dense.bias" "$work/log"; then
    pass "--init-hf: a tied duplicate, a pooler and an F16 tensor are taken; the header names what is not used"
  else fail "--init-hf with tied names and a pooler: $(grep -E 'error|init' "$work/log" | head -c 300)"; fi
}

quick same_traces
quick checker
all trace_against_outputs
all trace_against_dump
all init_hf
all checker_bad_input
all bad_input
all trace_lock
all trace_race
all bad_input_more
all init_hf_refused
finish
