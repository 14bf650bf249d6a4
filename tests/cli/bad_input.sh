#!/usr/bin/env bash
# tests/cli/bad_input.sh BUILD_DIR — bad input through the trainer's command line: each refused with one
# clear message from rank 0, a non-zero exit, no crash, no hang, no output file left behind (bad_case,
# tests/cli/common.sh): unknown and repeated flags, values out of range, data files that are missing,
# empty, binary or not UTF-8, configs DeepSpeed would refuse, outputs that cannot be written, models too
# large for the memory; --help lists every flag. Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"

# The core: an unknown flag, a missing value, a stray argument, and every flag's range.
core() {
  echo "=== bad input: one message, non-zero exit, no crash, no hang, no file"
  bad_case "unknown flag '--bogus' (train_bert_mini --help lists the flags)" "${small[@]}" --bogus 3
  bad_case "--steps needs a value" "${small[@]}" --steps
  bad_case "unexpected argument" "${small[@]}" stray
  for flag_value in "--device gpu" "--comm tcp" "--stage 3" "--stage two" "--collectives fast" "--micro-batch 0" \
                    "--accum 0" "--seq 2" "--layers 0" "--hidden -4" "--heads 0" "--intermediate 0" "--steps 0" \
                    "--lr -1" "--lr nan" "--warmup -2" "--weight-decay -0.1" "--clip -1" "--dropout 1" \
                    "--dropout 1.5" "--seed -1" "--bucket 0" "--overlap 2" "--log-every 0" "--max-positions 1"; do
    set -- $flag_value
    bad_case "$1 wants" "${small[@]}" $flag_value
  done
}

# --help: exit 0, and it lists every flag the parser takes (read from the source, so a flag added without
# its line here fails).
help_lists_every_flag() {
  local help_status=0 missing=""
  timeout 60 mpirun -n 2 "$trainer" --help > "$work/help.txt" 2>&1 || help_status=$?
  for flag in $(grep -ohE 'flag == "--[a-z-]+"' trainer/settings.cpp trainer/command_line.cpp | grep -oE -- '--[a-z-]+' | sort -u); do
    grep -q -- "$flag" "$work/help.txt" || missing="$missing $flag"
  done
  if [ $help_status -eq 0 ] && [ -z "$missing" ] && [ "$(grep -c '^usage:' "$work/help.txt")" -eq 1 ]; then
    pass "--help: exit 0, once (rank 0), every flag listed"
  else
    fail "--help: exit $help_status, missing:$missing"
  fi
}

data_and_config() {
  printf 'short' > "$work/short.txt"
  : > "$work/empty.txt"
  head -c 4096 /dev/urandom > "$work/binary.bin"; printf '\0' >> "$work/binary.bin"
  printf 'ok \xff\xfe bad utf-8 %.0s' $(seq 1 20) > "$work/latin1.txt"
  echo '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket": 1000}}' \
    > "$work/unknown_key.json"
  echo '{"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}' > "$work/bad_batch.json"
  echo '{"zero_optimization": {"stage": 3}}' > "$work/stage3.json"
  bad_case "cannot open --data" "${small[@]}" --data "$work/missing.txt"
  bad_case "is empty" "${small[@]}" --data "$work/empty.txt"
  bad_case "looks binary" "${small[@]}" --data "$work/binary.bin"
  bad_case "is not UTF-8" "${small[@]}" --data "$work/latin1.txt"
  bad_case "is a directory" "${small[@]}" --data "$work"
  bad_case "needs at least 14" "${small[@]}" --data "$work/short.txt"
  bad_case "longer than the 20 learned positions" "${small[@]}" --seq 32 --max-positions 20
  bad_case "not divisible by --heads 3" "${small[@]}" --heads 3
  bad_case "--warmup 5 is longer than --steps 1" "${small[@]}" --warmup 5
  bad_case "zero_optimization.reduce_bucket: not a DeepSpeed key this trainer knows" "${small[@]}" \
    --config "$work/unknown_key.json"
  bad_case "cannot open the config file" "${small[@]}" --config "$work/missing.json"
  bad_case "train_batch_size 7" "${small[@]}" --config "$work/bad_batch.json"
  bad_case "run it with 1 rank" "${small[@]}" --dump-batch "$work/dump_from_two"
  bad_case "does not exist" "${small[@]}" --json "$work/no/such/dir/out.json"
  local long_name
  long_name=$(printf 'a%.0s' $(seq 1 300))
  bad_case "more than the 255 a file name may have" "${small[@]}" --json "$work/$long_name/$long_name/out.json"
}

# A message longer than 1,023 bytes arrives whole (it was cut there, the reason lost after a long path),
# from rank 0 and from another rank.
long_messages() {
  local deep long_path long_status
  deep=$(printf 'd%.0s' $(seq 1 200))
  long_path="$work/$deep/$deep/$deep/$deep/$deep/missing.txt"
  bad_case "/missing.txt': No such file or directory" "${small[@]}" --data "$long_path"
  timeout 60 mpirun -n 1 "$trainer" "${small[@]}" --data "$work/corpus.txt" : -n 1 "$trainer" "${small[@]}" \
    --data "$long_path" > /dev/null 2> "$work/long_stderr"
  long_status=$?
  if [ $long_status -eq 2 ] && grep -qF "/missing.txt': No such file or directory (on rank 1)" "$work/long_stderr"; then
    pass "a $(wc -c < "$work/long_stderr")-byte message from rank 1 printed whole by rank 0"
  else fail "long message from rank 1: exit $long_status, $(tail -c 200 "$work/long_stderr")"; fi
}

# A flag given twice: the last counts (argparse's rule), and the header says so. A non-zero number that
# reads as 0 is refused, as one too large is.
numbers_and_outputs() {
  if timeout 60 "$trainer" "${small[@]}" --steps 3 --steps 4 --json "$work/twice_steps.json" > "$work/log" 2>&1 &&
     grep -qF "flags     --steps given twice ('3', then '4'): the last counts" "$work/log" &&
     [ "$(json_get "$work/twice_steps.json" "len(d['steps'])")" = 4 ]; then
    pass "--steps 3 --steps 4: 4 steps, and the header names the repeat"
  else fail "--steps 3 --steps 4: $(grep -E 'flags|error' "$work/log" | head -c 300)"; fi
  echo '{"optimizer": {"type": "AdamW", "params": {"lr": 1e-400}}}' > "$work/lr_underflow.json"
  bad_case "optimizer.params.lr: wants 0 or a number of at least 2.22507e-308 in size (got '1e-400'" "${small[@]}" \
    --config "$work/lr_underflow.json"
  bad_case "--lr wants 0 or a number of at least 2.22507e-308 in size (got '1e-400'" "${small[@]}" --lr 1e-400
  bad_case "too large" "${small[@]}" --micro-batch 1000000 --seq 4096 --max-positions 4096
  bad_case "--comm nccl needs --device cuda" "${small[@]}" --device cpu --comm nccl
  printf 'short' > "$work/short.txt"
  bad_case "--export-hf '$work/short.txt' is a file, not a directory" "${small[@]}" --export-hf "$work/short.txt"
  bad_ranks=1 bad_case "name the same directory" "${small[@]}" --export-hf "$work/same" --dump-batch "$work/same"
  bad_ranks=1 bad_case "name the same directory" "${small[@]}" --export-hf "$work/same" --dump-batch "$work/./same/"
  echo '{"zero_optimization": {"stage": 3}}' > "$work/stage3.json"
  bad_case "zero_optimization.stage: 3 is not supported: stage 3 (P_p, the parameters partitioned) is not implemented" \
    "${small[@]}" --config "$work/stage3.json"
  bad_case "GiB are available per rank" "${small[@]}" --layers 256 --hidden 16384 --heads 16
}

memory_flags() {
  for flag_value in "--activations all" "--alloc malloc" "--device-memory-limit 100" "--device-memory-limit lots"; do
    set -- $flag_value
    bad_case "$1 wants" "${small[@]}" $flag_value
  done
  bad_case "is more than the" "${small[@]}" --device-memory-limit 9000000000000000000
  bad_case "out of device memory in the 4,096-byte block (--alloc arena)" "${small[@]}" --device-memory-limit 4096
  bad_case "out of device memory in the 4,096-byte block (--alloc naive)" "${small[@]}" --alloc naive \
    --device-memory-limit 4096
}

quick core
all help_lists_every_flag
all data_and_config
all long_messages
all numbers_and_outputs
all memory_flags
finish
