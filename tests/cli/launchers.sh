#!/usr/bin/env bash
# tests/cli/launchers.sh BUILD_DIR — launched the way users launch: torchrun's, DeepSpeed's launcher's,
# srun's and Open MPI's variables around a start that MPI makes a world of one are refused on every
# process (one message, a non-zero exit, no file), while mpirun with the same variables runs; DeepSpeed's
# flags (--deepspeed FILE, --deepspeed_config=FILE, --local_rank=N) are taken, a mismatched --local_rank
# refused; a pasted Hugging Face command line gets zero2's flag. Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"

one_step=(--layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 --micro-batch 2 --steps 1 --quiet)

# started VARS... -- FLAGS...: the trainer started directly (no mpirun: an MPI singleton) with VARS set,
# its stderr in $work/started_err, its exit status in $started_status; --json $work/started.json first.
started() {
  local vars=()
  while [ "$1" != "--" ]; do vars+=("$1"); shift; done
  shift
  rm -f "$work/started.json"
  env "${vars[@]}" timeout 60 "$trainer" --json "$work/started.json" "$@" > "$work/started_out" 2> "$work/started_err"
  started_status=$?
}

# refused_alone EXPECT VARS...: a direct start under VARS must stop before step 1 with one message
# holding EXPECT, a non-zero exit and no --json file.
refused_alone() {
  local expect=$1
  shift
  started "$@" -- "${one_step[@]}"
  local label="started alone under [$*]"
  if [ "$started_status" -eq 0 ]; then fail "$label: exit 0"
  elif [ "$started_status" -ge 124 ]; then fail "$label: hung or killed ($started_status)"
  elif [ "$(grep -c 'train_bert_mini: error:' "$work/started_err")" != 1 ]; then
    fail "$label: not one message: $(head -c 300 "$work/started_err")"
  elif ! grep -qF -- "$expect" "$work/started_err"; then fail "$label: lacks '$expect': $(cat "$work/started_err")"
  elif [ -e "$work/started.json" ]; then fail "$label: wrote --json"
  else pass "$label: refused, exit $started_status, nothing written"
  fi
}

environments() {
  echo "=== a launcher's world larger than MPI's: refused on every process, nothing written"
  refused_alone "WORLD_SIZE=2, RANK=1, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2: torchrun" WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2
  refused_alone "WORLD_SIZE=2, RANK=0, LOCAL_RANK=0: torchrun" WORLD_SIZE=2 RANK=0 LOCAL_RANK=0
  refused_alone "SLURM_NTASKS=2, SLURM_PROCID=1: srun" SLURM_NTASKS=2 SLURM_PROCID=1
  refused_alone "SLURM_NTASKS=2, SLURM_PROCID=0, SLURM_LOCALID=0: srun" SLURM_NTASKS=2 SLURM_PROCID=0 SLURM_LOCALID=0
  refused_alone "OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_RANK=1, PMIX_RANK=1: Open MPI" OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=1 PMIX_RANK=1
  refused_alone "PMI_SIZE=2, PMI_RANK=1: a PMI process manager that MPI did not connect to" PMI_SIZE=2 PMI_RANK=1
  refused_alone "mpirun -n 4" RANK=3
  # The issue's own: RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 SLURM_NTASKS=2 around a direct start.
  refused_alone "SLURM_NTASKS=2: srun" RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 SLURM_NTASKS=2
}

# torchrun --standalone --nproc_per_node 2 --no_python, as it starts its processes (Debian's torchrun,
# torch 1.13 on Python 3.11, fails in its own code before starting any: measured, notes/07): both at once,
# each with its RANK, the same --json. Neither may exit 0, and the file must not exist.
torchrun_pair() {
  echo "=== torchrun's two processes, simulated: both refused, no --json"
  local statuses=() pids=() rank
  rm -f "$work/pair.json"
  for rank in 0 1; do
    env WORLD_SIZE=2 RANK=$rank LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 GROUP_RANK=0 MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=29500 TORCHELASTIC_RUN_ID=none OMP_NUM_THREADS=1 \
      timeout 60 "$trainer" "${one_step[@]}" --json "$work/pair.json" 2> "$work/pair_err_$rank" &
    pids+=($!)
  done
  for rank in 0 1; do wait "${pids[$rank]}"; statuses+=($?); done
  local messages
  messages=$(cat "$work/pair_err_0" "$work/pair_err_1" | grep -c 'train_bert_mini: error: the environment names')
  if [ "${statuses[0]}" -ne 0 ] && [ "${statuses[1]}" -ne 0 ] && [ "${statuses[0]}" -lt 124 ] &&
     [ "$messages" = 2 ] && [ ! -e "$work/pair.json" ]; then
    pass "torchrun's pair: exits ${statuses[*]}, one message each, no --json"
  else
    fail "torchrun's pair: exits ${statuses[*]}, $messages messages, json $(ls "$work/pair.json" 2>/dev/null)"
  fi
}

# mpirun is never refused: the same variables around it (an allocation's SLURM_NTASKS larger than the job
# step, a WORLD_SIZE exported in the shell) are another tool's.
mpirun_runs() {
  echo "=== mpirun with the same variables: runs"
  local ranks
  for ranks in 1 2; do
    rm -f "$work/mpirun.json"
    if env WORLD_SIZE=4 RANK=3 SLURM_NTASKS=8 SLURM_PROCID=5 \
         timeout 300 mpirun -n $ranks "$trainer" "${one_step[@]}" --json "$work/mpirun.json" > "$work/log" 2>&1 &&
       [ "$(json_get "$work/mpirun.json" "d['world_size']")" = "$ranks" ]; then
      pass "mpirun -n $ranks under WORLD_SIZE=4 SLURM_NTASKS=8: runs, world $ranks"
    else
      fail "mpirun -n $ranks under WORLD_SIZE=4 SLURM_NTASKS=8: $(tail -c 300 "$work/log")"
    fi
  done
}

# DeepSpeed's flags: --deepspeed FILE and --deepspeed_config FILE read the config (its micro-batch 3 shows
# in the summary); --local_rank=N must be MPI's local rank.
deepspeed_flags() {
  echo "=== DeepSpeed's flags: --deepspeed, --deepspeed_config, --local_rank"
  echo '{"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 2}}' > "$work/ds.json"
  local form micro
  for form in "--deepspeed $work/ds.json" "--deepspeed=$work/ds.json" "--deepspeed_config $work/ds.json" \
              "--deepspeed_config=$work/ds.json" "--deepspeed --deepspeed_config $work/ds.json" \
              "--local_rank=0 --deepspeed $work/ds.json" "--local_rank 0 --deepspeed $work/ds.json"; do
    rm -f "$work/ds_out.json"
    # shellcheck disable=SC2086
    timeout 120 "$trainer" --layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 --steps 1 --quiet $form \
      --json "$work/ds_out.json" > "$work/log" 2>&1
    micro=$(json_get "$work/ds_out.json" "str(d['micro_batch']) + ' ' + str(d['stage'])" 2>/dev/null)
    if [ "$micro" = "3 2" ]; then pass "$form: the config read (micro-batch 3, stage 2)"
    else fail "$form: got '$micro': $(tail -c 300 "$work/log")"; fi
  done
  # Two files (--config, then --deepspeed): the last is read, alone; the first's keys do not mix in.
  echo '{"train_micro_batch_size_per_gpu": 5, "gradient_clipping": 0.25}' > "$work/other.json"
  rm -f "$work/ds_out.json"
  timeout 120 "$trainer" --layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 --steps 1 --quiet \
    --config "$work/other.json" --deepspeed "$work/ds.json" --json "$work/ds_out.json" > "$work/log" 2>&1
  micro=$(json_get "$work/ds_out.json" "str(d['micro_batch']) + ' ' + str(d['optimizer']['clip'])" 2>/dev/null)
  if [ "$micro" = "3 0.0" ]; then pass "--config A --deepspeed B: B alone (micro-batch 3, DeepSpeed's clip 0)"
  else fail "--config A --deepspeed B: got '$micro': $(tail -c 300 "$work/log")"; fi
  bad_case "--local_rank 0, but MPI's local rank of rank 1" "${one_step[@]}" --local_rank=0
  bad_ranks=1 bad_case "--local_rank 1, but MPI's local rank of rank 0" "${one_step[@]}" --local_rank 1
  bad_case "--local_rank wants an integer" "${one_step[@]}" --local_rank=first
}

# A pasted Hugging Face command line: each of its common flags gets zero2's, before any value is read.
hugging_face_flags() {
  echo "=== Hugging Face's TrainingArguments flags: zero2's named"
  local pair
  for pair in "--per_device_train_batch_size 4|--micro-batch" "--gradient_accumulation_steps 2|--accum" \
              "--learning_rate 1e-4|--lr" "--num_train_epochs 3|--steps" "--max_steps 10|--steps" \
              "--warmup_steps 2|--warmup" "--weight_decay 0.1|--weight-decay" "--max_grad_norm 1.0|--clip" \
              "--output_dir out|--save DIR" "--bf16 --learning_rate 1e-4|--precision bf16" "--fp16|--precision fp16" \
              "--logging_steps 5|--log-every" "--save_steps 5|--save-every" "--learning_rate=1e-4|--lr"; do
    # shellcheck disable=SC2086
    bad_case "zero2's is ${pair#*|}" "${one_step[@]}" ${pair%|*}
  done
  bad_case "unknown flag '--stpes' (did you mean '--steps'?)" "${one_step[@]}" --stpes 3
  bad_case "unknown flag '--micro_batch' (did you mean '--micro-batch'?)" "${one_step[@]}" --micro_batch 2
}

quick environments
quick torchrun_pair
quick mpirun_runs
quick deepspeed_flags
all hugging_face_flags
finish
