#!/usr/bin/env bash
# tests/cli/reliability.sh BUILD_DIR — what the trainer does when the world is not as it should be: every
# writer on a full disk at N = 1, 2, 4 (exit 2 on every rank, nothing left), concurrent exports into one
# directory, outputs naming inputs (the loaded checkpoint's files too), devices, FIFOs, sockets and
# dangling symlinks as outputs (refused, left as they were), a symlink followed to its file, paths that are
# not UTF-8, --metrics appended on resume, FIFOs and devices as inputs, strict UTF-8, strict config files
# (booleans, NUL, trailing bytes, duplicate keys, depth, large integers), a seq too short to mask, gradients
# whose squares overflow, a stopped rank ended by the watchdog, which names it, and ranks waiting for
# different things (tests/watchdog_check.cpp), each named. Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"
echo "=== reliability: writes that fail, inputs that are not what they seem, a stopped rank"

# A full disk: a 64 KiB tmpfs filled up (mount needs root; where it is not
# allowed, the checks say SKIP and why, they do not pass).
full_disk() {
  full="$work/full"
  mkdir -p "$full"
  if mount -t tmpfs -o size=64k tmpfs "$full" 2>"$work/mount.err"; then
    head -c 1M /dev/zero > "$full/filler" 2>/dev/null  # fails when the disk is full: that is the point
    full_case() {  # label, ranks, then the flags whose output lands on the full disk
      local label=$1 ranks=$2
      shift 2
      timeout 60 mpirun -n "$ranks" "$trainer" "${tiny_run[@]}" "$@" > "$work/full_stdout" 2> "$work/full_stderr"
      local status=$? messages left
      messages=$(grep -c "train_bert_mini: error:" "$work/full_stderr")
      # (--metrics is a stream: the file itself stays, with whole lines only)
      left=$(find "$full" -mindepth 1 ! -name filler ! -name export ! -name dump ! -name metrics.jsonl | head -n 3)
      if [ -s "$full/metrics.jsonl" ] && [ "$(tail -c 1 "$full/metrics.jsonl" | od -An -c | tr -d ' ')" != '\n' ]; then
        left="a cut line in metrics.jsonl"
      fi
      if [ $status -eq 0 ] || [ $status -eq 124 ]; then fail "full disk, $label, N=$ranks: exit $status"
      elif [ "$messages" != 1 ] || ! grep -q "No space left on device" "$work/full_stderr"; then
        fail "full disk, $label, N=$ranks: $(head -c 300 "$work/full_stderr")"
      elif [ -n "$left" ]; then fail "full disk, $label, N=$ranks: left $left"
      else pass "full disk, $label, N=$ranks: exit $status on every rank, nothing left ->" \
        "$(sed 's/^train_bert_mini: error: //' "$work/full_stderr" | head -c 90)"; fi
    }
    for N in 1 2 4; do
      full_case "--json" $N --json "$full/out.json"
      full_case "--memory-trace (step 0, the others waiting)" $N --memory-trace "$full/trace.csv"
      full_case "--export-hf" $N --export-hf "$full/export"
      full_case "--metrics (appended as training goes)" $N --metrics "$full/metrics.jsonl"
      rm -f "$full/metrics.jsonl"
    done
    full_case "--dump-batch" 1 --dump-batch "$full/dump"
    umount "$full"
  else
    echo "SKIP full-disk writes: mount -t tmpfs is not allowed here ($(head -c 120 "$work/mount.err"))"
  fi
}

# Two runs exporting into one directory at once, 20 times: whichever ends
# last, the directory's config.json and model.safetensors come from one run
# (hidden 16 and hidden 32 tell them apart).
concurrent_exports() {
  mixed=0
  for k in $(seq 1 20); do
    timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --hidden 16 --export-hf "$work/shared_export" > /dev/null 2>&1 &
    first=$!
    timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --hidden 32 --export-hf "$work/shared_export" > /dev/null 2>&1
    second=$?
    wait $first
    [ $? -eq 0 ] && [ $second -eq 0 ] || mixed=$((mixed + 1000))
    py reliability one_export "$work/shared_export" || mixed=$((mixed + 1))
  done
  leftovers=$(find "$work/shared_export" -name '*zero2-tmp*' | wc -l)
  [ $mixed -eq 0 ] && [ "$leftovers" -eq 0 ] && pass "20 pairs of concurrent exports into one directory: never mixed," \
    "no temporaries left" ||
    fail "concurrent exports: $mixed bad (x1000: a run failed), $leftovers temporaries left"
}

# Outputs that name an input, or each other.
outputs_naming_inputs() {
  echo '{"gradient_clipping": 1.0}' > "$work/ds.json"
  mkdir -p "$work/export_over_config"
  cp "$work/ds.json" "$work/export_over_config/config.json"
  bad_case "is the --data file" "${small[@]}" --data "$work/corpus.txt" --json "$work/corpus.txt"
  bad_case "is the --config file" "${small[@]}" --config "$work/ds.json" --json "$work/./ds.json"
  bad_case "is the --data file" "${small[@]}" --data "$work/corpus.txt" --memory-trace "$work/corpus.txt"
  bad_case "--export-hf's config.json '$work/export_over_config/config.json' is the --config file" "${small[@]}" \
    --config "$work/export_over_config/config.json" --export-hf "$work/export_over_config"
  bad_case "name the same file" "${small[@]}" --json "$work/twice.json" --memory-trace "$work/twice.json"
  [ "$(cat "$work/corpus.txt" | head -c 9)" = "The quick" ] && [ "$(cat "$work/ds.json")" \
    = '{"gradient_clipping": 1.0}' ] &&
    pass "the inputs named as outputs are unchanged" || fail "an input was overwritten"
}

# Outputs that are not regular files: a device node (made here with mknod,
# never the real /dev), a FIFO, a socket, a dangling symlink, a symlink to a
# device: refused before step 1 by every writer, each left as it was. (As
# root, the rename would turn them into regular files: /dev/null for the
# whole machine.) A symlink to a regular file is followed: the target is
# written, the link stays a link.
outputs_not_files() {
  nodes="$work/nodes"
  mkdir -p "$nodes/export" "$nodes/dump" "$nodes/save"
  if mknod "$nodes/null" c 1 3 2>"$work/mknod.err" && mknod "$nodes/export/config.json" c 1 3 &&
     mknod "$nodes/dump/batch.safetensors" c 1 3 && mknod "$nodes/save/latest" c 1 3; then
    mkfifo "$nodes/fifo"
    py reliability bind_socket "$nodes/socket"
    ln -s null "$nodes/link_to_device"
    ln -s nowhere.json "$nodes/dangling.json"
    bad_case "--json '$nodes/null' is a character device: zero2 writes only regular files" "${small[@]}" \
      --json "$nodes/null"
    bad_case "--metrics '$nodes/fifo' is a FIFO" "${small[@]}" --metrics "$nodes/fifo"
    bad_case "--memory-trace '$nodes/socket' is a socket" "${small[@]}" --memory-trace "$nodes/socket"
    bad_case "(a symlink to '$nodes/null') is a character device" "${small[@]}" --json "$nodes/link_to_device"
    bad_case "--json '$nodes/dangling.json' is a symlink that leads to no file" "${small[@]}" \
      --json "$nodes/dangling.json"
    bad_case "--export-hf's config.json '$nodes/export/config.json' is a character device" "${small[@]}" \
      --export-hf "$nodes/export"
    bad_ranks=1 bad_case "--dump-batch's batch.safetensors '$nodes/dump/batch.safetensors' is a character device" \
      "${small[@]}" --dump-batch "$nodes/dump"
    bad_case "--save's latest '$nodes/save/latest' is a character device" "${small[@]}" --save "$nodes/save"
    bad_case "--save '$nodes/null' is a character device, not a directory" "${small[@]}" --save "$nodes/null"
    kinds=$(cd "$nodes" && stat -c '%n %F' null fifo socket link_to_device dangling.json export/config.json \
      dump/batch.safetensors save/latest | tr '\n' ',')
    want="null character special file,fifo fifo,socket socket,link_to_device symbolic link,dangling.json symbolic link,"
    want+="export/config.json character special file,dump/batch.safetensors character special file,"
    want+="save/latest character special file,"
    [ "$kinds" = "$want" ] && \
      [ -z "$(ls "$nodes/export" "$nodes/dump" | grep -v -e config.json -e batch.safetensors -e '^$' -e ':$')" ] &&
      pass "every output refused as a device, FIFO, socket or dangling link is left as it was" || fail "outputs that" \
        "are not files: now $kinds"
  else
    echo "SKIP device nodes as outputs: mknod is not allowed here ($(head -c 120 "$work/mknod.err"))"
  fi
  echo '{"kept": "the old contents"}' > "$nodes/target.json"
  ln -s target.json "$nodes/link.json"
  if timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --json "$nodes/link.json" > "$work/log" 2>&1 && \
    [ -L "$nodes/link.json" ] &&
     grep -q final_params_hash "$nodes/target.json" && [ -z "$(ls -A "$nodes" | grep zero2-tmp)" ]; then
    pass "--json through a symlink: the target is written, the link stays a link"
  else fail "--json through a symlink: $(ls -l "$nodes/link.json") $(head -c 200 "$nodes/target.json")" \
    "$(head -c 200 "$work/log")"; fi
}

# The checkpoint being loaded is an input, every file of it: an output in its
# step directory, or over the latest that named it, is refused, and the
# checkpoint is unchanged. (--save into the directory it loads from moves
# latest, after the load: that is how a run continues.)
checkpoint_as_input() {
  timeout 60 "$trainer" "${tiny_run[@]}" --steps 2 --save "$work/ck_input" > /dev/null 2>&1
  ck_before=$(cd "$work/ck_input" && find . -type f | sort | xargs sha256sum | sha256sum)
  bad_ranks=1 bad_case "--json '$work/ck_input/step_2/index.json' is inside the checkpoint it loads" \
    --load "$work/ck_input/step_2" --json "$work/ck_input/step_2/index.json"
  bad_ranks=1 bad_case "--json '$work/ck_input/latest' is the --load checkpoint's latest file" --load "$work/ck_input" \
    --json "$work/ck_input/latest"
  bad_ranks=1 bad_case "--metrics '$work/ck_input/step_2/rank_00000.safetensors' is inside the checkpoint it loads" \
    --load "$work/ck_input" --metrics "$work/ck_input/step_2/rank_00000.safetensors"
  bad_ranks=1 bad_case "--memory-trace '$work/ck_input/step_2/index.json' is inside" --load "$work/ck_input/step_2" \
    --memory-trace "$work/ck_input/step_2/index.json"
  bad_ranks=1 bad_case "--export-hf '$work/ck_input/step_2' is inside the checkpoint it loads" --load "$work/ck_input" \
    --steps 0 --export-hf "$work/ck_input/step_2"
  [ "$(cd "$work/ck_input" && find . -type f | sort | xargs sha256sum | sha256sum)" = "$ck_before" ] &&
    pass "the checkpoint named by the refused outputs is unchanged" || fail "a refused output changed the checkpoint" \
      "it loads"
}

# Paths that are not UTF-8 (the run records paths in JSON, which holds only
# UTF-8): refused before step 1, not at the first save after training; the
# working directory's name counts for a relative path.
non_utf8_paths() {
  cp "$work/corpus.txt" "$work/bad"$'\xff'".txt"
  bad_case 'the path is not UTF-8 (the byte shown as \xff)' "${small[@]}" --data "$work/bad"$'\xff'".txt" \
    --save "$work/ck_utf8"
  bad_case 'the path is not UTF-8' "${small[@]}" --json "$work/out"$'\xfe'".json"
  mkdir -p "$work/cwd"$'\xff'
  relative_trainer=$trainer trainer=$(realpath "$trainer")  # (not a subshell: its pass or fail would not count)
  cd "$work/cwd"$'\xff' && bad_case "is not UTF-8; the run records absolute paths" "${small[@]}" \
    --memory-trace trace.csv
  cd - > /dev/null && trainer=$relative_trainer
  [ ! -e "$work/ck_utf8" ] && [ -z "$(ls -A "$work/cwd"$'\xff')" ] && pass "refused paths that are not UTF-8: nothing" \
    "made" ||
    fail "a refused non-UTF-8 run made $(ls -A "$work/ck_utf8" "$work/cwd"$'\xff' 2>&1 | head -c 200)"

  # --metrics on resume: the first run's lines stay; a marker line says where
}

metrics_on_resume() {
  timeout 60 "$trainer" "${tiny_run[@]}" --steps 4 --save-every 2 --log-every 1 --save "$work/ck_metrics" \
    --metrics "$work/resumed.jsonl" > /dev/null 2>&1
  timeout 60 "$trainer" --load "$work/ck_metrics/step_2" --log-every 1 \
    --quiet --metrics "$work/resumed.jsonl" > "$work/log" 2>&1
  lines=$(py reliability metrics_steps "$work/resumed.jsonl" 2>&1)
  [ "$lines" = "1 2 3 4 2R 3 4" ] && pass "--metrics on resume: appended after a resumed_from line ($lines)" ||
    fail "--metrics on resume: steps $lines $(head -c 200 "$work/log")"
}

# The same file or directory named two ways, before it exists (a relative
# path against an absolute one), and outputs that name each other's directory.
paths_named_twice() {
  bad_ranks=1 bad_case "name the same directory" "${small[@]}" --export-hf "$work/new_same" \
    --dump-batch "$(realpath --relative-to=. "$work")/new_same"
  bad_case "name the same file" "${small[@]}" --json "$work/new_twice.json" \
    --memory-trace "$(realpath --relative-to=. "$work")/./new_twice.json"
  bad_case "--json and --export-hf name the same path" "${small[@]}" --export-hf "$work/new_dir" --json "$work/new_dir"
  bad_ranks=1 bad_case "--memory-trace and --dump-batch name the same path" "${small[@]}" \
    --dump-batch "$work/new_dump" --memory-trace "$work/new_dump"
  [ ! -e "$work/new_same" ] && [ ! -e "$work/new_dir" ] && pass "refused outputs: no directory created" || fail "a" \
    "refused output's directory was created"
}

# What would fail only after training, refused before it: a directory where
# the export puts a file, a name longer than the file system takes; an empty
# path (an unset shell variable); a timeout too short for a healthy wait.
refused_before_training() {
  mkdir -p "$work/export_with_dir/model.safetensors"
  bad_case "--export-hf's model.safetensors '$work/export_with_dir/model.safetensors' is a directory" "${small[@]}" \
    --export-hf "$work/export_with_dir"
  bad_case "more than the 255 a file name may have" "${small[@]}" --json "$work/$(printf 'n%.0s' $(seq 1 256)).json"
  for flag in --data --config --json --export-hf --dump-batch --memory-trace; do
    bad_case "$flag wants a path (got an empty one" "${small[@]}" $flag ""
  done
  bad_case "--timeout wants a number from 1 to" "${small[@]}" --timeout 0.5
  # A name of 250 bytes is legal: its temporary's name must be too.
  legal_name="$work/$(printf 'l%.0s' $(seq 1 245)).json"
  if timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --json "$legal_name" > "$work/log" 2>&1 && \
    [ -s "$legal_name" ]; then
    pass "a 250-byte file name is written"
  else fail "a 250-byte file name: $(head -c 200 "$work/log")"; fi
  # A file that is replaced keeps its permissions.
  echo '{}' > "$work/private.json" && chmod 600 "$work/private.json"
  timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --json "$work/private.json" > /dev/null 2>&1
  [ "$(stat -c %a "$work/private.json")" = 600 ] && [ "$(head -c 1 "$work/private.json")" = "{" ] && grep \
    -q final_params_hash "$work/private.json" &&
    pass "a replaced output keeps its mode (600)" || fail "a replaced output: mode $(stat -c %a "$work/private.json")"
}

# A config error on rank 1 only (each rank reads its own --config; on
# several hosts one may lack it): every rank ends at once with its message.
config_on_one_rank() {
  echo '{"gradient_clipping": 1.0}' > "$work/ds.json"
  start=$(date +%s)
  timeout 60 mpirun -n 1 "$trainer" "${tiny_run[@]}" --config "$work/ds.json" : -n 1 "$trainer" "${tiny_run[@]}" \
    --config "$work/missing.json" > /dev/null 2> "$work/rank1_stderr"
  status=$?
  took=$(($(date +%s) - start))
  if [ $status -eq 2 ] && [ $took -lt 20 ] && grep -q "cannot open the config file .* (on rank 1)" \
    "$work/rank1_stderr"; then
    pass "a config missing on rank 1 only: exit 2 in ${took} s, '(on rank 1)'"
  else fail "a config missing on rank 1 only: exit $status after ${took} s: $(head -c 300 "$work/rank1_stderr")"; fi
}

# Config numbers quoted as written; whole numbers in exponent form (as
# DeepSpeed's configs write bucket sizes) taken as integers; a number
# beyond double named with the file.
config_numbers() {
  echo '{"fp16": {"enabled": true, "loss_scale": 1e39}}' > "$work/big_scale.json"
  echo '{"train_batch_size": 18446744073709551616}' > "$work/beyond_u64.json"
  echo '{"zero_optimization": {"reduce_bucket_size": 1e-5}}' > "$work/tiny_bucket.json"
  echo '{"gradient_clipping": 1e400}' > "$work/beyond_double.json"
  echo '{"zero_optimization": {"reduce_bucket_size": 5e8}, "train_micro_batch_size_per_gpu": 2.0}' \
    > "$work/exponent_ints.json"
  bad_case "fp16.loss_scale: wants a number from 0 to 1e+30 (got '1e39')" "${small[@]}" --config "$work/big_scale.json"
  bad_case "(got '18446744073709551616')" "${small[@]}" --config "$work/beyond_u64.json"
  bad_case "(got '1e-5')" "${small[@]}" --config "$work/tiny_bucket.json"
  bad_case "the config file '$work/beyond_double.json' is not valid JSON" "${small[@]}" \
    --config "$work/beyond_double.json"
  if timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --config "$work/exponent_ints.json" > "$work/log" 2>&1; then
    pass "config: reduce_bucket_size 5e8 and micro batch 2.0 are integers"
  else fail "config: 5e8 / 2.0 refused: $(head -c 200 "$work/log")"; fi
}

# The export's lock, held by another process past --timeout: the watchdog
# says so (not that a rank is dead).
export_lock() {
  mkdir -p "$work/locked"
  flock "$work/locked" sleep 30 &
  holder=$!
  sleep 0.5
  timeout 60 mpirun -n 2 "$trainer" "${tiny_run[@]}" --export-hf "$work/locked" --timeout 2 > /dev/null \
    2> "$work/lock_stderr"
  status=$?
  kill $holder 2>/dev/null; wait $holder 2>/dev/null
  if [ $status -eq 3 ] && grep -q "for the lock on the directory '$work/locked' (another process" "$work/lock_stderr" \
    && grep -q "every rank answered" "$work/lock_stderr"; then
    pass "an export directory locked by another process: the watchdog names the lock"
  else fail "locked export directory: exit $status: $(head -c 300 "$work/lock_stderr")"; fi
}

# A write interrupted halfway (tests only: ZERO2_TEST_FAULT): stopped, then
# ended by the watchdog, or killed: no temporary is left, nothing partial
# under a final name; a killed export has its weights but no config.json
# (written last: an export without it is incomplete, by design).
interrupted_writes() {
  ZERO2_TEST_FAULT="stop 1" timeout 60 mpirun -n 2 "$trainer" "${tiny_run[@]}" --export-hf "$work/stopped_export" \
    --timeout 2 > /dev/null 2> "$work/fault_stderr"
  status=$?
  pkill -9 -f "stopped_export" 2>/dev/null
  if [ $status -eq 3 ] && [ -z "$(ls -A "$work/stopped_export")" ]; then pass "a rank stopped mid-write: exit 3, the" \
    "directory empty (no temporary)"
  else fail "a rank stopped mid-write: exit $status, left: $(ls -A "$work/stopped_export" | head -c 200)"; fi
  ZERO2_TEST_FAULT="kill 2" timeout 60 mpirun -n 2 "$trainer" "${tiny_run[@]}" \
    --export-hf "$work/killed_export" > /dev/null 2>&1
  status=$?
  whole=$(py reliability whole_safetensors "$work/killed_export/model.safetensors" 2>&1)
  if [ $status -ne 0 ] && [ "$(ls -A "$work/killed_export")" = "model.safetensors" ] && [ "$whole" = whole ]; then
    pass "a rank killed writing config.json: exit $status, model.safetensors whole, no config.json, no temporary"
  else fail "a rank killed mid-write: exit $status, left: $(ls -A "$work/killed_export" | head -c 200)"; fi
}

# Inputs that are not regular files, or not text.
inputs_not_files() {
  mkfifo "$work/fifo"
  bad_case "is not a regular file" "${small[@]}" --data "$work/fifo"
  bad_case "is not a regular file" "${small[@]}" --data /dev/zero
  bad_case "is not a regular file" "${small[@]}" --config "$work/fifo"
  for bytes in '\xc0\x80' '\xe0\x80\x80' '\xed\xa0\x80' '\xf4\x90\x80\x80' '\xf5\x80\x80\x80' '\x80'; do
    { printf 'plain text before the bad bytes %.0s' $(seq 1 3); printf "$bytes"; printf ' and after'; } \
      > "$work/bad_utf8.txt"
    bad_case "is not UTF-8 text (an ill-formed sequence at offset 96" "${small[@]}" --data "$work/bad_utf8.txt"
  done
}

# Config values and files that a lax parser would accept.
strict_configs() {
  echo '{"gradient_clipping": true}' > "$work/bool_number.json"
  printf '{"gradient_clipping": 1.0}\0garbage' > "$work/nul_garbage.json"
  echo '{"gradient_clipping": 1.0} trailing' > "$work/trailing.json"
  echo '{"gradient_clipping": 1.0, "gradient_clipping": 2.0}' > "$work/duplicate.json"
  echo '{"zero_optimization": {"stage": 2, "stage": 1}}' > "$work/duplicate_inner.json"
  echo '{"train_batch_size": 18446744073709551615}' > "$work/huge.json"
  echo '{"zero_optimization": {"overlap_comm": 1}}' > "$work/number_bool.json"
  py reliability deep_json > "$work/deep.json"
  bad_case "gradient_clipping: wants a number (got true)" "${small[@]}" --config "$work/bool_number.json"
  bad_case "has a NUL byte at offset 26" "${small[@]}" --config "$work/nul_garbage.json"
  bad_case "is not valid JSON" "${small[@]}" --config "$work/trailing.json"
  bad_case "has the key 'gradient_clipping' twice" "${small[@]}" --config "$work/duplicate.json"
  bad_case "has the key 'stage' twice" "${small[@]}" --config "$work/duplicate_inner.json"
  bad_case "(got '18446744073709551615')" "${small[@]}" --config "$work/huge.json"
  # -0 is quoted as written (it was quoted '0', a value the file does not hold).
  echo '{"train_micro_batch_size_per_gpu": -0}' > "$work/minus_zero.json"
  bad_case "(got '-0')" "${small[@]}" --config "$work/minus_zero.json"
  bad_case "zero_optimization.overlap_comm: wants true or false" "${small[@]}" --config "$work/number_bool.json"
  bad_case "nests objects and arrays more than 16 deep" "${small[@]}" --config "$work/deep.json"
}

# A global batch that would select no position on most steps.
numbers() {
  bad_case "positions on average" "${small[@]}" --seq 3 --micro-batch 1
  # Numbers: a tiny learning rate is a number in range (a subnormal one,
  # 1e-320, is refused: it cannot keep its precision); a bucket beyond Psi is
  # not a memory requirement.
  for flags in "--lr 1e-30" "--bucket 1073741824"; do
    if timeout 60 mpirun -n 2 "$trainer" "${tiny_run[@]}" $flags > "$work/log" 2>&1; then pass "accepted: $flags"
    else fail "refused: $flags: $(head -c 200 "$work/log")"; fi
  done

  # Gradients whose fp32 squares overflow (dropout 0.99 scales them by 1/0.01
  # at every site; at 0.97 whether they overflow depends on the masks: seeds
  # 1, 2, 3 give first-step norms of 2e7, 6e27 and 9e6 there, above 1e22 at
  # 0.99): the norm is still finite, and every step reports it.
  if timeout 60 mpirun -n 2 "$trainer" "${tiny_run[@]}" --steps 5 --dropout 0.99 --json "$work/dropout.json" \
    > "$work/log" 2>&1; then
    verdict=$(json_get "$work/dropout.json" "('ok' if all(s['grad_norm'] is not None and s['grad_norm'] > 0
      for s in d['steps']) and max(s['grad_norm'] for s in d['steps']) > 1.8e19
      else 'bad ' + str([s['grad_norm'] for s in d['steps']]))")
    case "$verdict" in ok*) pass "dropout 0.99: every gradient norm finite, the largest beyond sqrt(FLT_MAX)";; *) \
      fail "dropout 0.99: $verdict";; esac
  else
    fail "dropout 0.99: exit non-zero: $(head -c 300 "$work/log")"
  fi
}

# A stopped rank (SIGSTOP: hydra does not notice it): the others' watchdog
# ends the job within --timeout (3 s here) plus the roll call's grace (1 s)
# plus slack, naming the stopped rank as the one that did not answer. Rank 2
# of 4, found by the PMI_RANK hydra gives each process.
stopped_rank() {
  marker="$work/stopped_rank.json"
  timeout 120 mpirun -n 4 "$trainer" "${tiny_run[@]}" --steps 1000000 --timeout 3 --json "$marker" \
    > "$work/stopped_stdout" 2> "$work/stopped_stderr" &
  job=$!
  sleep 3
  victim=""
  for pid in $(pgrep -f "^$trainer.*$marker"); do
    tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx 'PMI_RANK=2' && victim=$pid
  done
  stopped_at=$(date +%s)
  [ -n "$victim" ] && kill -STOP "$victim"
  wait $job
  status=$?
  took=$(($(date +%s) - stopped_at))
  pkill -9 -f "$marker" 2>/dev/null
  if [ -z "$victim" ]; then fail "stopped rank: no process with PMI_RANK=2 found to stop"
  elif [ $status -ne 0 ] && [ $status -ne 124 ] && [ $took -le 14 ] && grep -q "watchdog: waited 3 s for" \
    "$work/stopped_stderr" \
       && grep -q "roll call (1 s): rank 2 did not answer" "$work/stopped_stderr"; then
    pass "stopped rank: the job ended ${took} s after the stop, exit $status:" \
      "$(grep -m 1 'roll call' "$work/stopped_stderr" | sed 's/^\[zero2\] *//' | head -c 120)"
  else
    fail "stopped rank: exit $status after ${took} s: $(head -c 600 "$work/stopped_stderr")"
  fi
}

# Every rank alive but waiting for different things: each roll call finds
# every rank answering and says what each waits for.
desynchronized_ranks() {
  timeout 60 mpirun -n 3 "$build/watchdog_check" 2 > /dev/null 2> "$work/desync_stderr"
  status=$?
  if [ $status -eq 3 ] && grep -q "every rank answered, so none is stopped" "$work/desync_stderr" \
     && grep -q "for a message from rank 1" "$work/desync_stderr" \
     && grep -q "rank [12] has waited .* for a barrier" "$work/desync_stderr"; then
    pass "desynchronized ranks: the roll call says where each waits"
  else
    fail "desynchronized ranks: exit $status: $(head -c 600 "$work/desync_stderr")"
  fi
}

quick stopped_rank
all full_disk
all concurrent_exports
all outputs_naming_inputs
all outputs_not_files
all checkpoint_as_input
all non_utf8_paths
all metrics_on_resume
all paths_named_twice
all refused_before_training
all config_on_one_rank
all config_numbers
all export_lock
all interrupted_writes
all inputs_not_files
all strict_configs
all numbers
all desynchronized_ranks
finish
