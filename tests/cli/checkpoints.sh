#!/usr/bin/env bash
# tests/cli/checkpoints.sh BUILD_DIR — checkpoints through the command line: save at step 4, load, 4 more
# steps = 8 straight in every precision, N and stage; reshard across (N, A, stage); an independent reader
# (tests/read_checkpoint.py); --load --steps 0 = the run's own export; --save-keep; damaged checkpoints
# (one-bit flips of index.json, an impossible loss scale, a latest that loops or holds a NUL) and
# contradicting flags refused; a resume at another summation tree refused (or run with
# --allow-different-bits); pruning leaves what is not this run's and keeps the steps saved last; a second
# saver and a new run into another run's checkpoints refused; a rank killed mid-save; a save killed before
# latest was written or moved (--load DIR takes the step saved last, says so, the same bits; not an
# abandoned higher step); a user's file in a .step_K.incomplete refused before step 1; SIGTERM and SIGINT
# stop, save and resume bit for bit. Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"
echo "=== checkpoints: resume and reshard bit for bit, damaged checkpoints, a killed save, SIGTERM, the export"

# The checkpoint the damage starts from (made by `resume`: saved by 4 ranks at stage 2, fp32), copied
# afresh into $work/damaged before each damage (damaged_from=DIR: another one).
good="$work/ck_fp32_4_2"
damaged() { rm -rf "$work/damaged"; cp -r "${damaged_from:-$good}" "$work/damaged"; }
# An index edited and its index.sha256 made anew (as a forger would): the checks behind the digest still
# name what is wrong.
redigest() { (cd "$1" && sha256sum index.json > index.sha256); }
index_edit() {  # python statement on d (the index), then the bad_case's expected text
  damaged
  py common edit_json "$work/damaged/step_4/index.json" "$1"
  redigest "$work/damaged/step_4"
  bad_case "$2" --load "$work/damaged/step_4"
}

# Save at step 4 (and 8) of 8 at every N and stage; resume each from step 4
# at its own N and stage with nothing but --load: the same bits.
resume() {
  for precision in fp32 bf16 fp16; do
    local matched=0 bad=""
    for N in 1 2 4; do
      for stage in 0 1 2; do
        dir="$work/ck_${precision}_${N}_${stage}"
        if ! timeout 120 mpirun -n $N "$trainer" "${ck[@]}" $(precision_flags $precision) --stage $stage \
          --accum $((4 / N)) \
             --steps 8 --save-every 4 --save "$dir" --json "$dir.straight.json" > "$work/log" 2>&1; then
          bad="$bad (N=$N stage $stage: save run failed: $(head -c 200 "$work/log"))"; continue
        fi
        timeout 120 mpirun -n $N "$trainer" --load "$dir/step_4" --stage $stage \
          --quiet --json "$dir.resumed.json" > "$work/log" 2>&1
        verdict=$(resumed_matches "$dir.straight.json" "$dir.resumed.json" $([ $precision = fp16 ] && echo skips) 2>&1)
        if [ "$verdict" = ok ]; then matched=$((matched + 1)); else \
          bad="$bad (N=$N stage $stage: $verdict $(head -c 200 "$work/log"))"; fi
      done
    done
    [ -z "$bad" ] && pass "$precision: 4 steps, save, load, 4 more = 8 straight, at N = 1, 2, 4 x stages 0, 1, 2" \
      "($matched runs)" ||
      fail "$precision resume:$bad"
  done
}

# The straight runs agree with each other (N and stage never change the bits),
# so every resumed run above equals every straight one.
one_hash_per_precision() {
  distinct=$(for f in "$work"/ck_*_*_*.straight.json; do echo "$(basename "$f" | cut -d_ -f2) $(json_get "$f" "d['final_params_hash']")"; done | sort -u | wc -l)
  [ "$distinct" -eq 3 ] && pass "straight runs: one hash per precision over every N and stage" || fail "straight" \
    "runs: $distinct (precision, hash) pairs, want 3"
}

# Activations (a legitimate change on resume): saved with keep, resumed with offload.
activations_on_resume() {
  for precision in fp32 bf16 fp16; do
    dir="$work/ck_${precision}_2_2"
    timeout 120 mpirun -n 2 "$trainer" --load "$dir/step_4" --activations offload \
      --quiet --json "$dir.offload.json" > "$work/log" 2>&1
    verdict=$(resumed_matches "$dir.straight.json" "$dir.offload.json" 2>&1)
    [ "$verdict" = ok ] && pass "$precision: saved with --activations keep, resumed with offload: the same bits" || \
      fail "$precision offload resume: $verdict"
  done
}

# Reshard: saved at (N, A, stage) = (4, 1, 2), loaded at (2, 2, 1) and (1, 4, 0);
# saved at (1, 4, 0), loaded at (4, 1, 2). A follows from N.
reshard() {
  for precision in fp32 bf16 fp16; do
    bad=""
    for move in "4_2 2 1" "4_2 1 0" "1_0 4 2"; do
      set -- $move
      dir="$work/ck_${precision}_$1"
      timeout 120 mpirun -n $2 "$trainer" --load "$dir/step_4" --stage $3 \
        --quiet --json "$work/reshard.json" > "$work/log" 2>&1
      verdict=$(resumed_matches "$dir.straight.json" "$work/reshard.json" 2>&1)
      [ "$verdict" = ok ] || bad="$bad (from $1 to N=$2 stage $3: $verdict $(head -c 200 "$work/log"))"
    done
    [ -z "$bad" ] && pass "$precision reshard: (4,1,2) -> (2,2,1) and (1,4,0), (1,4,0) -> (4,1,2): the same bits" || \
      fail "$precision reshard:$bad"
  done
}

# Checkpoints saved at different N and stages hold the same bits, and an
# independent reader (numpy only) rebuilds the full tensors from them.
independent_reader() {
  if $PYTHON tests/read_checkpoint.py "$work/ck_fp32_4_2/step_8" --same-as "$work/ck_fp32_1_0/step_8" \
    > "$work/log" 2>&1 &&
     $PYTHON tests/read_checkpoint.py "$work/ck_bf16_2_1/step_4" --same-as "$work/ck_bf16_4_0/step_4" \
       >> "$work/log" 2>&1; then
    pass "read_checkpoint.py: saved at (4,1,2) = saved at (1,4,0), bit for bit (fp32; bf16 likewise)"
  else fail "read_checkpoint.py --same-as: $(head -c 400 "$work/log")"; fi
}

# Consolidation (zero_to_fp32's job, in the trainer): --load --steps 0 --export-hf
# equals the trainer's own export at that step, byte for byte; the reader agrees.
consolidation() {
  timeout 120 mpirun -n 4 "$trainer" "${ck[@]}" --steps 8 --save "$work/ck_export" \
    --export-hf "$work/own_export" > /dev/null 2>&1
  timeout 120 mpirun -n 1 "$trainer" --load "$work/ck_export" --steps 0 --export-hf "$work/consolidated" \
    --quiet > "$work/log" 2>&1
  if cmp -s "$work/own_export/model.safetensors" "$work/consolidated/model.safetensors" &&
     cmp -s "$work/own_export/config.json" "$work/consolidated/config.json" &&
     $PYTHON tests/read_checkpoint.py "$work/ck_export/step_8" --compare "$work/own_export" \
       > "$work/reader.log" 2>&1; then
    pass "consolidation: --load (saved by 4 ranks) --steps 0 at N=1 = the run's own export, byte for byte;" \
      "read_checkpoint.py agrees"
  else fail "consolidation: $(head -c 300 "$work/log") $(head -c 300 "$work/reader.log")"; fi
}

# --save-keep 2 with a save every 2 steps of 8: step_6 and step_8 remain; latest names step_8.
save_keep() {
  timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 2 --save "$work/ck_keep" \
    --json "$work/ck_keep.json" > /dev/null 2>&1
  kept=$(ls "$work/ck_keep" | tr '\n' ' ')
  [ "$kept" = "latest step_6 step_8 " ] && [ "$(cat "$work/ck_keep/latest")" = step_8 ] && pass "--save-keep 2:" \
    "$kept" ||
    fail "--save-keep 2 left: $kept"
}

# What the run says: the header names what it loaded, the summary what it saved.
header_says() {
  timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_fp32_4_2" --save "$work/ck_said" --stage 1 > "$work/log" 2>&1
  if grep -q "^  loaded    $work/ck_fp32_4_2/step_8: step 8 of 8, saved by 4 rank(s) x accumulation 1, stage 2, fp32" "$work/log" &&
     grep -q "^  saved                    $work/ck_said/step_8/ (" "$work/log" && grep \
       -q "steps trained            none" "$work/log"; then
    pass "the header says what was loaded, the summary what was saved"
  else fail "loaded/saved lines: $(grep -E 'loaded|saved|trained' "$work/log" | head -c 300)"; fi
}

# Damaged checkpoints and contradicting flags: one message naming the file
# or the setting, exit non-zero on every rank, nothing written or changed.
damaged_checkpoints() {
  before=$(cd "$good" && find . -type f | sort | xargs sha256sum | sha256sum)
  damaged; truncate -s -100 "$work/damaged/step_4/rank_00001.safetensors"
  bad_case "rank_00001.safetensors' has 82,752 bytes; its index says 82,852 (cut short" --load "$work/damaged/step_4"
  damaged; py common flip_middle_bit "$work/damaged/step_4/rank_00002.safetensors"
  bad_case "rank_00002.safetensors' is damaged: its SHA-256 is not the one its index records" \
    --load "$work/damaged/step_4"
  damaged; rm "$work/damaged/step_4/rank_00003.safetensors"
  bad_case "cannot open the checkpoint file '$work/damaged/step_4/rank_00003.safetensors'" --load "$work/damaged/step_4"
  damaged; rm "$work/damaged/step_4/index.json"
  bad_case "has neither index.json (a step's directory) nor latest" --load "$work/damaged/step_4"
  damaged; rm "$work/damaged/step_8/index.json"
  bad_case "latest' names 'step_8', which is not a complete checkpoint" --load "$work/damaged"
  # An index edited and its index.sha256 made anew (as a forger would): the
  # checks behind the digest still name what is wrong.
  damaged; echo '{"format": "zero2 checkpoint", "version": 1, "step": ' > "$work/damaged/step_4/index.json"
  redigest "$work/damaged/step_4"
  bad_case "index.json' is not valid JSON" --load "$work/damaged/step_4"
  damaged; echo step_99 > "$work/damaged/latest"
  bad_case "latest' names 'step_99', which is not a complete checkpoint" --load "$work/damaged"
  timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --hidden 16 --steps 2 --save "$work/ck_other" > /dev/null 2>&1
  damaged; cp "$work/ck_other/step_2/index.json" "$work/ck_other/step_2/index.sha256" "$work/damaged/step_4/"
  bad_case "its index says" --load "$work/damaged/step_4"
  bad_case "--hidden 32 contradicts the checkpoint's 16" --load "$work/ck_other" --hidden 32
  bad_case "--lr 0.5 contradicts the checkpoint's 0.001" --load "$good" --lr 0.5
  bad_case "contradicts the checkpoint's" --load "$good" --precision bf16
  bad_case "is not the data the checkpoint" --load "$good" --data "$work/corpus.txt"
  bad_case "the global batch must stay the same" --load "$good" --accum 3
  bad_ranks=3 bad_case "3 ranks cannot split that evenly" --load "$good"
  bad_case "--dump-batch writes step 0 of a fresh run: not with --load" --load "$good" --dump-batch "$work/no_dump"
  [ "$(cd "$good" && find . -type f | sort | xargs sha256sum | sha256sum)" = "$before" ] &&
    pass "the checkpoint loaded by the refused runs is unchanged" || fail "a refused load changed its checkpoint"
}

# A rank killed while writing the second checkpoint (tests only:
# ZERO2_TEST_FAULT, rank 1's second file): latest still names step 4, which
# loads and continues to the straight run's bits.
killed_mid_save() {
  ZERO2_TEST_FAULT="kill 2 1" timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 4 \
    --save "$work/ck_killed" > /dev/null 2>&1
  status=$?
  timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_killed" --quiet --json "$work/after_kill.json" > "$work/log" 2>&1
  verdict=$(resumed_matches "$work/ck_keep.json" "$work/after_kill.json" 2>&1)  # the same run, never killed
  # When rank 1 dies, mpirun kills rank 0 wherever it is: possibly with its
  # own file named but not yet renamed. A temporary may stay inside
  # .step_8.incomplete (the next save removes that directory whole), never
  # outside it.
  stray=$(find "$work/ck_killed" -name '*zero2-tmp*' -not -path '*/.step_8.incomplete/*')
  if [ $status -ne 0 ] && [ "$(cat "$work/ck_killed/latest")" = step_4 ] && [ ! -e "$work/ck_killed/step_8" ] && \
    [ "$verdict" = ok ] &&
     [ -d "$work/ck_killed/.step_8.incomplete" ] && [ -z "$stray" ]; then
    pass "a rank killed mid-save: exit $status, latest = step_4, no step_8 (only .step_8.incomplete), no temporary" \
      "outside it; resuming gives the straight bits"
  else fail "killed save: exit $status, latest $(cat "$work/ck_killed/latest"), $verdict, step_8" \
    "$([ -e "$work/ck_killed/step_8" ] && echo exists || echo absent), .step_8.incomplete $([ -d "$work/ck_killed/.step_8.incomplete" ] && echo exists || echo absent), temporaries outside it: ${stray:-none}"; fi
  # The next save into that directory clears what the killed one left.
  timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_killed" --steps 0 --save "$work/ck_killed" > "$work/log" 2>&1
  [ -z "$(ls -A "$work/ck_killed" | grep incomplete)" ] && pass "the next save removes .step_8.incomplete" ||
    fail "after the next save: $(ls -A "$work/ck_killed" | tr '\n' ' ') $(head -c 200 "$work/log")"
  # A step saved again (resumed from step 6 into the same --save), killed while
  # writing the replacement of step_8: step_8 is still the old complete one,
  # latest still loads it; unkilled, the replacement holds the same bits.
  rm -rf "$work/ck_redo"; cp -r "$work/ck_keep" "$work/ck_redo"
  ZERO2_TEST_FAULT="kill 1 1" timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_redo/step_6" \
    --save "$work/ck_redo" > /dev/null 2>&1
  status=$?
  timeout 120 mpirun -n 1 "$trainer" --load "$work/ck_redo" --steps 0 --json "$work/redo_load.json" > "$work/log" 2>&1
  loads=$?
  timeout 120 mpirun -n 1 "$trainer" --load "$work/ck_redo/step_6" --save "$work/ck_redo" > /dev/null 2>&1
  if [ $status -ne 0 ] && [ $loads -eq 0 ] && [ "$(cat "$work/ck_redo/latest")" = step_8 ] &&
     $PYTHON tests/read_checkpoint.py "$work/ck_redo/step_8" --same-as "$work/ck_keep/step_8" \
       > "$work/reader.log" 2>&1 &&
     [ -z "$(ls -A "$work/ck_redo" | grep incomplete)" ]; then
    pass "a re-save of step_8 killed midway leaves the old step_8 loadable; done at N=1, the same bits"
  else fail "re-save: exit $status, load $loads, $(head -c 200 "$work/log") $(head -c 200 "$work/reader.log")"; fi
}

# A save killed after its step was put in place but before latest was
# written (rank 0's 4th file at the first save: its rank file, index.json,
# index.sha256, then latest): no latest. Rerunning the same command is
# refused, naming --load DIR; that command, with the flag it names, resumes
# from the step saved last, says which, and gives the straight run's bits.
killed_before_latest() {
  rm -rf "$work/ck_nolatest"
  ZERO2_TEST_FAULT="kill 4 0" timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 4 \
    --save "$work/ck_nolatest" > /dev/null 2>&1
  status=$?
  left=$(ls "$work/ck_nolatest" | tr '\n' ' ')
  bad_case "continue that run with --load $work/ck_nolatest," "${ck[@]}" --steps 8 --save-every 4 \
    --save "$work/ck_nolatest"
  suggested=$(grep -o -- "continue that run with --load [^,]*" "$work/bad_stderr" | sed 's/^continue that run with //')
  timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 4 --save "$work/ck_nolatest" $suggested \
    --json "$work/nolatest.json" > "$work/log" 2>&1
  resumed=$?
  verdict=$(resumed_matches "$work/ck_keep.json" "$work/nolatest.json" 2>&1)
  if [ $status -ne 0 ] && [ "$left" = "step_4 " ] && [ -n "$suggested" ] && [ $resumed -eq 0 ] && [ "$verdict" = ok ] &&
     grep -qF "note: '$work/ck_nolatest' has no latest (a save was stopped before it wrote it): took step_4" "$work/log" &&
     [ "$(cat "$work/ck_nolatest/latest")" = step_8 ]; then
    pass "killed before the first latest: left $left; the rerun's refusal names '$suggested', which resumes from" \
      "step_4 (said), the straight bits"
  else fail "killed before latest: exit $status, left '$left', suggested '$suggested', resumed exit $resumed," \
    "$verdict: $(head -c 300 "$work/log")"; fi
  # Killed at the second save's latest (rank 0's 8th file): latest names
  # step_2, step_4 is complete. --load DIR takes step_4 and says so.
  rm -rf "$work/ck_oldlatest"
  ZERO2_TEST_FAULT="kill 8 0" timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 2 \
    --save "$work/ck_oldlatest" > /dev/null 2>&1
  status=$?
  left="$(ls "$work/ck_oldlatest" | tr '\n' ' ')latest = $(cat "$work/ck_oldlatest/latest")"
  timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_oldlatest" \
    --quiet --json "$work/oldlatest.json" > "$work/log" 2>&1
  verdict=$(resumed_matches "$work/ck_keep.json" "$work/oldlatest.json" 2>&1)
  took=$(json_get "$work/oldlatest.json" "d['checkpoint']['loaded']['step']" 2>&1)
  if [ $status -ne 0 ] && [ "$left" = "latest step_2 step_4 latest = step_2" ] && [ "$took" = 4 ] && \
    [ "$verdict" = ok ] &&
     grep -qF "note: '$work/ck_oldlatest/latest' names step_2, but step_4 of the same run was saved after it" "$work/log"; then
    pass "killed before latest moved to step_4: --load DIR takes step_4 (said), the straight bits"
  else fail "killed before latest moved: exit $status, left '$left', took step $took, $verdict:" \
    "$(head -c 300 "$work/log")"; fi
}

# A run resumed from an earlier step into the same --save (step_6 of
# step_6, step_8): its step_7 is newer than the abandoned step_8, latest
# names it, and --load DIR loads it (the highest number would be step_8).
resumed_branch() {
  rm -rf "$work/ck_branch"; cp -r "$work/ck_keep" "$work/ck_branch"
  timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_branch/step_6" --steps 7 --save "$work/ck_branch" > /dev/null 2>&1
  status=$?
  timeout 120 mpirun -n 1 "$trainer" --load "$work/ck_branch" --steps 0 --json "$work/branch.json" > "$work/log" 2>&1
  took=$(json_get "$work/branch.json" "d['checkpoint']['loaded']['step']" 2>&1)
  if [ $status -eq 0 ] && [ "$(ls "$work/ck_branch" | tr '\n' ' ')" = "latest step_6 step_7 step_8 " ] &&
     [ "$(cat "$work/ck_branch/latest")" = step_7 ] && [ "$took" = 7 ] && ! grep -q "note:\|took step" "$work/log"; then
    pass "resumed from step_6 into the same --save: latest names step_7, --load DIR loads it, not the abandoned step_8"
  else fail "resumed branch: exit $status, $(ls "$work/ck_branch" | tr '\n' ' '), latest" \
    "$(cat "$work/ck_branch/latest"), took step $took: $(head -c 300 "$work/log")"; fi
}

# A user's file in .step_2.incomplete, where this run would write its step
# 2 (--save-every 2): refused before step 1, nothing trained (no --metrics
# file), nothing saved, the file left as it was.
user_incomplete() {
  rm -rf "$work/ck_userinc"; mkdir -p "$work/ck_userinc/.step_2.incomplete"
  echo mine > "$work/ck_userinc/.step_2.incomplete/notes.txt"
  rm -f "$work/userinc_metrics"
  bad_case "--save: '$work/ck_userinc/.step_2.incomplete' holds files a save does not write there: move it away" \
    "${ck[@]}" --steps 4 --save-every 2 --save "$work/ck_userinc" --metrics "$work/userinc_metrics"
  [ ! -e "$work/userinc_metrics" ] && [ "$(ls -A "$work/ck_userinc" | tr '\n' ' ')" = ".step_2.incomplete " ] &&
    [ "$(cat "$work/ck_userinc/.step_2.incomplete/notes.txt")" = mine ] &&
    pass "a user's file in .step_2.incomplete: refused before step 1, nothing trained or saved, the file kept" ||
    fail "user's .step_2.incomplete: metrics $([ -e "$work/userinc_metrics" ] && echo written || echo absent), left" \
      "$(ls -A "$work/ck_userinc" | tr '\n' ' ')"
}

# Pruning keeps the steps saved last, not the highest numbers: resumed from
# step_4 of step_4, step_6, step_8 with a save every 3 steps, the run saves
# step_6 again, then step_9; --save-keep 2 keeps step_6 (this run's) and
# step_9, and prunes the abandoned step_8 (saved before both).
prune_order() {
  rm -rf "$work/ck_prune_order"
  timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 2 --save-keep 3 \
    --save "$work/ck_prune_order" > /dev/null 2>&1
  timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_prune_order/step_4" --steps 9 --save-every 3 \
    --save "$work/ck_prune_order" \
    > "$work/log" 2>&1
  kept=$(ls "$work/ck_prune_order" | tr '\n' ' ')
  [ "$kept" = "latest step_6 step_9 " ] && pass "--save-keep 2 after a resume from step_4: kept $kept(saved last)," \
    "not the abandoned step_8" ||
    fail "pruning order: kept $kept $(head -c 200 "$work/log")"
}

# What a review found (each was a wrong result or a raw error before).
# An export that records nothing may run at any N, even one that cannot split the batch:
review_findings() {
  timeout 120 mpirun -n 3 "$trainer" --load "$work/ck_export" --steps 0 --export-hf "$work/consolidated3" \
    --quiet > "$work/log" 2>&1
  cmp -s "$work/own_export/model.safetensors" "$work/consolidated3/model.safetensors" &&
    pass "--load (4 x 1) --steps 0 --export-hf at N=3: the same export" || fail "export at N=3:" \
      "$(head -c 300 "$work/log")"
  # ...but a re-slice records N x A, so it keeps the global batch.
  bad_case "the global batch must stay the same" --load "$good" --steps 0 --accum 3 --save "$work/no_reslice"
  # --steps 0 --save alone (no --json, no export) re-slices at this N.
  timeout 120 mpirun -n 2 "$trainer" --load "$good" --steps 0 --save "$work/ck_reslice" > "$work/log" 2>&1 &&
    $PYTHON tests/read_checkpoint.py "$work/ck_reslice/step_8" --same-as "$good/step_8" > "$work/reader.log" 2>&1 &&
    pass "--load (N=4) --steps 0 --save at N=2: the same bits, saved by 2 ranks" ||
    fail "re-slice: $(head -c 200 "$work/log") $(head -c 200 "$work/reader.log")"
  # A consistent DeepSpeed train_batch_size on resume (2 x 2 x 2 = 8 = the saved 4 x 1 x 2).
  echo '{"train_batch_size": 8}' > "$work/tbs8.json"
  timeout 120 mpirun -n 2 "$trainer" --load "$good/step_4" --config "$work/tbs8.json" \
    --quiet --json "$work/tbs.json" > "$work/log" 2>&1
  verdict=$(resumed_matches "$good.straight.json" "$work/tbs.json" 2>&1)
  [ "$verdict" = ok ] && pass "resume with a consistent train_batch_size: the same bits" || fail "train_batch_size" \
    "resume: $verdict $(head -c 200 "$work/log")"
  # 16-bit accumulation rounds per micro-step: another A would change the bits.
  echo '{"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "bf16"}}' > "$work/bf16_accum.json"
  timeout 120 mpirun -n 1 "$trainer" "${ck[@]}" --config "$work/bf16_accum.json" --accum 4 --steps 2 \
    --save "$work/ck_bf16_accum" > /dev/null 2>&1
  bad_ranks=4 bad_case \
    "accumulates gradients in bf16 (data_types.grad_accum_dtype), which rounds after every micro-step" \
    --load "$work/ck_bf16_accum"
}

# An index whose fields have the wrong type or value, named with the file.
index_fields() {
  index_edit "d['settings']['precision'] = 'fp8'" "wants fp32|bf16|fp16 (got 'fp8')"
  index_edit "d['format'] = 5" "is not a zero2 checkpoint index"
  index_edit "d['files'][0]['file'] = 7" "'files.0.file' = 7 is not a string"
  index_edit "d['files'][2]['bytes'] = -1" "'files.2.bytes' = -1 is not an integer"
  index_edit "d['data']['bytes'] = '12'" "'data.bytes' = \"12\" is not an integer"
  index_edit "d['accum'] = 2**31 - 1" "'accum' = 2147483647 is not an integer from 1 to 1048576"
  damaged; py checkpoints master_not_an_object "$work/damaged/step_4/rank_00000.safetensors"
  bad_case "rank_00000.safetensors' is damaged" --load "$work/damaged/step_4"
  bad_case "--load '$work/nonexistent' does not exist" --load "$work/nonexistent"
}

# One-bit flips that keep index.json valid JSON (the last digit of a value,
# d -> d xor 1: lr 0.001 -> 0.000, seed 1 -> 0, a parameter's numel, a file's
# size...), or a flipped digit of index.sha256: each is damage, refused.
index_flips() {
  flips=""
  for key in lr weight_decay beta2 seed dropout eps clip schedule_steps warmup loss_scale applied numel bytes; do
    damaged; py common flip_digit "$work/damaged/step_4/index.json" $key
    bad_ranks=1 bad_case "index.json' is damaged: its SHA-256 is not the one" \
      --load "$work/damaged/step_4" > "$work/flip.log"
    grep -q "^PASS" "$work/flip.log" && passed=$((passed - 1)) || { failed=$((failed - 1)); \
      flips="$flips $key: $(cat "$work/flip.log")"; }
  done
  damaged; sed -i 's/^./x/' "$work/damaged/step_4/index.sha256"
  bad_ranks=1 bad_case "index.json' is damaged: its SHA-256 is not the one" \
    --load "$work/damaged/step_4" > "$work/flip.log"
  grep -q "^PASS" "$work/flip.log" && passed=$((passed - 1)) || { failed=$((failed - 1)); \
    flips="$flips index.sha256: $(cat "$work/flip.log")"; }
  [ -z "$flips" ] && pass "one-bit flips of lr, weight decay, beta2, seed, dropout, eps, clip, schedule steps," \
    "warmup, the loss scale, AdamW's t, a parameter's numel, a file's size in index.json, and of index.sha256: each refused as damage" ||
    fail "index flips:$flips"
  damaged; rm "$work/damaged/step_4/index.sha256"
  bad_case "index.json' is damaged: '$work/damaged/step_4/index.sha256', which records its SHA-256, is missing" \
    --load "$work/damaged/step_4"
  sed -i 's/"version": 2/"version": 1/' "$work/damaged/step_4/index.json"
  bad_case "was written by an earlier zero2 (checkpoint version 1, whose index.json has no SHA-256 of its own" \
    --load "$work/damaged/step_4"
}

# A loss scale no training reaches (the digest made anew): damage, not divergence.
impossible_loss_scale() {
  index_edit "d['progress']['loss_scale'] = 1e308" \
    "progress.loss_scale 1e+308 cannot come from training (fp32 trains at loss scale 1)"
  damaged_from="$work/ck_fp16_2_2" index_edit "d['progress']['loss_scale'] = 1000.0" \
    "progress.loss_scale 1000.0 cannot come from training (the dynamic scale is a power of two"
}

# latest as a symlink loop, or holding a NUL byte: said as such.
odd_latest() {
  damaged; ln -sfn latest "$work/damaged/latest"
  bad_case "'$work/damaged/latest' cannot be read: Too many levels of symbolic links (a symlink loop" \
    --load "$work/damaged"
  damaged; printf 'step_8\0step_4' > "$work/damaged/latest"
  bad_case "'$work/damaged/latest' holds a NUL byte (at byte 6)" --load "$work/damaged"
}

# A resume whose split sums in another tree (notes/06): saved at (N, A) =
# (2, 3), N = 3 (A = 2) is refused, naming the splits that keep the bits;
# N = 1 (A = 6) keeps them; --allow-different-bits runs N = 3, recorded.
summation_tree() {
  timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --accum 3 --steps 2 --save-every 1 --save "$work/ck_2x3" \
    --json "$work/ck_2x3.json" > /dev/null 2>&1
  bad_ranks=3 bad_case \
    "resuming at N = 3 (A = 2) sums each step's 6 micro-batches in another tree than the checkpoint's run at N = 2 (A = 3)" \
    --load "$work/ck_2x3/step_1"
  grep -qF "Splits that keep them: N = 1 (A = 6), N = 2 (A = 3), N = 6 (A = 1); or give --allow-different-bits" "$work/bad_stderr" &&
    pass "the refused N = 3 resume names the splits that keep the bits" || fail "N = 3 refusal:" \
      "$(cat "$work/bad_stderr")"
  timeout 120 mpirun -n 1 "$trainer" --load "$work/ck_2x3/step_1" \
    --quiet --json "$work/ck_2x3_n1.json" > "$work/log" 2>&1
  verdict=$(resumed_matches "$work/ck_2x3.json" "$work/ck_2x3_n1.json" 2>&1)
  [ "$verdict" = ok ] && pass "saved at (2, 3), resumed at (1, 6): the same bits" || fail "(2, 3) -> (1, 6): $verdict" \
    "$(head -c 200 "$work/log")"
  timeout 120 mpirun -n 3 "$trainer" --load "$work/ck_2x3/step_1" \
    --allow-different-bits --quiet --json "$work/ck_2x3_n3.json" > "$work/log" 2>&1 &&
    [ "$(json_get "$work/ck_2x3_n3.json" "(d['checkpoint']['allow_different_bits'], d['checkpoint']['loaded']['same_summation_tree'])")" = "(True, False)" ] &&
    pass "--allow-different-bits resumes at N = 3, and the JSON records it" || fail "--allow-different-bits:" \
      "$(head -c 300 "$work/log")"
}

# Two runs saving into one directory: the second is refused before step 1
# (the first holds the directory's lock; here the shell holds it).
busy_directory() {
  mkdir -p "$work/ck_busy"
  exec {busy}< "$work/ck_busy"
  flock -x $busy
  bad_case "--save '$work/ck_busy' is in use: another run is saving into it" "${ck[@]}" --steps 1 --save "$work/ck_busy"
  exec {busy}<&-
}

# Without the lock (a file system without flock), a step removed under a
# save by another process: the message names a concurrent saver. Rank 1 is
# stopped halfway through its file (ZERO2_TEST_FAULT) while the step's
# directory is removed, then continued.
vanished_step() {
  ZERO2_TEST_FAULT="stop 1 1" timeout 60 mpirun -n 2 "$trainer" "${ck[@]}" --steps 1 --save "$work/ck_vanish" \
    > "$work/vanish.log" 2>&1 &
  job=$!
  stopped=""
  for k in $(seq 1 400); do
    for p in $(pgrep -f "^$trainer .*$work/ck_vanish"); do [ "$(cut -d' ' -f3 /proc/$p/stat 2>/dev/null)" = T \
      ] && stopped=$p; done
    [ -n "$stopped" ] && break
    sleep 0.05
  done
  rm -rf "$work/ck_vanish/.step_1.incomplete"
  [ -n "$stopped" ] && kill -CONT "$stopped"
  wait $job
  status=$?
  [ $status -ne 0 ] && grep -q "another run saving into the same directory at the same time is the likely cause" \
    "$work/vanish.log" &&
    pass "a step removed under a save: exit $status, the message names a concurrent saver" ||
    fail "vanished step: exit $status, stopped rank '${stopped}': $(head -c 300 "$work/vanish.log")"
}

# A new run into another run's checkpoints is refused and deletes nothing;
# --save-overwrite replaces its latest and the steps it saves, and prunes
# none of the other run's.
another_runs_checkpoints() {
  damaged; before_other=$(cd "$work/damaged" && find . -type f | sort | xargs sha256sum | sha256sum)
  bad_case "--save '$work/damaged' holds checkpoints of another run ($work/damaged/step_4)" "${ck[@]}" --steps 2 \
    --save-keep 1 --save "$work/damaged"
  [ "$(cd "$work/damaged" && find . -type f | sort | xargs sha256sum | sha256sum)" = "$before_other" ] &&
    pass "the refused new run left the other run's checkpoints as they were" || fail "the refused new run changed" \
      "$work/damaged"
  timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 2 --save-keep 1 --save "$work/damaged" \
    --save-overwrite > "$work/log" 2>&1 &&
    [ "$(ls "$work/damaged" | tr '\n' ' ')" = "latest step_2 step_4 step_8 " ] && \
      [ "$(cat "$work/damaged/latest")" = step_2 ] &&
    pass "--save-overwrite: latest names the new run's step_2, the other run's steps stay" ||
    fail "--save-overwrite: $(ls "$work/damaged" | tr '\n' ' ') $(head -c 200 "$work/log")"
}

# Pruning deletes only this run's steps: a user's step_1/ (notes.txt in it)
# stays; a plain file step_4 where this run would save step 4 is refused up
# front, not replaced.
pruning_user_files() {
  timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 2 --save "$work/ck_user" > /dev/null 2>&1
  mkdir "$work/ck_user/step_1"; echo mine > "$work/ck_user/step_1/notes.txt"; echo mine > "$work/ck_user/step_4"
  bad_case "'$work/ck_user/step_4' is not a checkpoint of this run (not a directory), and this run may save step 4 there" \
    --load "$work/ck_user" --steps 4 --save "$work/ck_user"
  [ "$(cat "$work/ck_user/step_4")" = mine ] && pass "the plain file step_4 is left as it was" || fail "step_4 was" \
    "changed"
  rm "$work/ck_user/step_4"
  timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_user" --steps 4 --save-every 1 --save-keep 1 \
    --save "$work/ck_user" > "$work/log" 2>&1 &&
    [ "$(ls "$work/ck_user" | tr '\n' ' ')" = "latest step_1 step_4 " ] && \
      [ "$(cat "$work/ck_user/step_1/notes.txt")" = mine ] &&
    pass "--save-keep 1 pruned this run's step_2 and step_3, not the user's step_1/notes.txt" ||
    fail "pruning with a user's step_1: $(ls "$work/ck_user" | tr '\n' ' ') $(head -c 200 "$work/log")"
}

# A directory named like a step but too large for a number is not one.
stray_step() {
  mkdir -p "$work/ck_odd/step_99999999999999999999"
  timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 2 --save "$work/ck_odd" --json "$work/odd.json" \
    > "$work/log" 2>&1 &&
    [ -f "$work/odd.json" ] && [ -d "$work/ck_odd/step_99999999999999999999" ] &&
    pass "a stray step_99999999999999999999 is left alone" || fail "stray step directory: $(head -c 200 "$work/log")"
}

# --data as a relative path, resumed from another working directory.
relative_data() {
  cp "$work/corpus.txt" "$work/relative.txt"
  trainer_path=$(realpath "$trainer")  # the subshells below change directory
  (cd "$work" && timeout 120 mpirun -n 2 "$trainer_path" "${ck[@]}" --steps 4 --save-every 2 --data relative.txt --save ck_relative \
     --json relative_straight.json > /dev/null 2>&1)
  (cd / && timeout 120 mpirun -n 2 "$trainer_path" --load "$work/ck_relative/step_2" --quiet --json "$work/relative_resumed.json" > "$work/log" 2>&1)
  verdict=$(resumed_matches "$work/relative_straight.json" "$work/relative_resumed.json" 2>&1)
  [ "$verdict" = ok ] && pass "--data relative.txt, resumed from another directory: found, the same bits" ||
    fail "relative --data resume: $verdict $(head -c 200 "$work/log")"
}

# SIGTERM (a scheduler's preemption) to mpirun mid-run at N = 2, once step
# 100 of 3000 has been printed: every rank finishes its step, saves, writes
# the JSON marked interrupted, exits 143; resuming from what was saved gives
# the uninterrupted run's bits.
sigterm() {
  send_when_running() {  # signal, stdout file, process pattern: signal once step 100 is printed
    for k in $(seq 1 400); do
      grep -q "^step   100/" "$2" 2>/dev/null && break
      sleep 0.05
    done
    pkill -$1 -f "$3"
  }
  long=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --warmup 1
        --log-every 100 --steps 3000)
  timeout 120 mpirun -n 2 "$trainer" "${long[@]}" --save "$work/ck_term" --json "$work/term.json" \
    > "$work/term_stdout" 2>&1 &
  job=$!
  # SIGTERM to every rank, as a scheduler's cancel (scancel) sends it.
  send_when_running TERM "$work/term_stdout" "^$trainer .*$work/ck_term"
  wait $job
  status=$?
  timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_term" --quiet --json "$work/term_resumed.json" > "$work/log" 2>&1
  timeout 120 mpirun -n 2 "$trainer" "${long[@]}" --quiet --json "$work/term_straight.json" > /dev/null 2>&1
  verdict=$(resumed_matches "$work/term_straight.json" "$work/term_resumed.json" 2>&1)
  stopped_at=$(json_get "$work/term.json" "str(d['interrupted']) + ' ' + str(d['checkpoint']['saved'][-1]['step'])" 2>&1)
  if [ $status -eq 143 ] && [ "${stopped_at%% *}" = SIGTERM ] && [ "$(cat "$work/ck_term/latest")" \
    = "step_${stopped_at##* }" ] &&
     [ "${stopped_at##* }" -lt 3000 ] && [ "$verdict" = ok ]; then
    pass "SIGTERM at step ${stopped_at##* } of 3000: exit 143, saved, JSON interrupted; resumed = uninterrupted, bit" \
      "for bit"
  else fail "SIGTERM: exit $status, '$stopped_at', $verdict $(head -c 200 "$work/log")"; fi
}

# SIGINT (Ctrl-C on a rank run in the foreground): exit 130 and the checkpoint.
sigint() {
  timeout 120 mpirun -n 2 "$trainer" "${long[@]}" --save "$work/ck_int" > "$work/int_stdout" 2>&1 &
  job=$!
  send_when_running INT "$work/int_stdout" "^$trainer .*$work/ck_int"
  wait $job
  status=$?
  [ $status -eq 130 ] && [ -e "$work/ck_int/latest" ] && grep -q "interrupted .* by SIGINT after step" \
    "$work/int_stdout" &&
    pass "SIGINT: exit 130, saved $(cat "$work/ck_int/latest")" || fail "SIGINT: exit $status, latest:" \
      "$(cat "$work/ck_int/latest" 2>&1)"
}

# A signal to mpirun: MPICH's launcher forwards it to the ranks, which stop
# and save; the launcher's own exit status is its own (seen 0), not checked.
sigterm_mpirun() {
  timeout 120 mpirun -n 2 "$trainer" "${long[@]}" --save "$work/ck_mpirun" > "$work/mpirun_stdout" 2>&1 &
  job=$!
  send_when_running TERM "$work/mpirun_stdout" "^mpirun -n 2 $trainer .*$work/ck_mpirun"
  wait $job
  [ -e "$work/ck_mpirun/latest" ] && grep -q "interrupted .* by SIGTERM after step" "$work/mpirun_stdout" &&
    pass "SIGTERM to mpirun: forwarded, saved $(cat "$work/ck_mpirun/latest")" ||
    fail "SIGTERM to mpirun: latest: $(cat "$work/ck_mpirun/latest" 2>&1)"
}


quick resume
quick reshard
all one_hash_per_precision
all activations_on_resume
all independent_reader
all consolidation
all save_keep
all header_says
all damaged_checkpoints
all killed_mid_save
all killed_before_latest
all resumed_branch
all user_incomplete
all prune_order
all review_findings
all index_fields
all index_flips
all impossible_loss_scale
all odd_latest
all summation_tree
all busy_directory
all vanished_step
all another_runs_checkpoints
all pruning_user_files
all stray_step
all relative_data
all sigterm
all sigint
all sigterm_mpirun
finish
