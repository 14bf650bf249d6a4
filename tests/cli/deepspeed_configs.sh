#!/usr/bin/env bash
# tests/cli/deepspeed_configs.sh BUILD_DIR — DeepSpeed configs as people write them: the real ones in
# tests/ds_configs run or are refused as their README says, every refused key named in one message; what
# DeepSpeed 0.16.9 makes of the keys a file leaves out (stage 0, clip 0, FusedAdam's or torch.optim.AdamW's
# weight decay, the loss scaler's two sets of defaults) and where each setting came from (--json's
# settings_origin, the header); keys DeepSpeed ignores warn (in the header, on stderr with --quiet),
# near-misses and unknown keys of the blocks it validates are refused, its features not here are named as
# such; each step's rate against DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR / OneCycle /
# LRRangeTest as its engine steps them (log and linear, W < 2, past an fp16-skipped step, a scheduler the
# flags add), the trainer's own schedule without --config; --steps longer on resume, a checkpoint without
# the schedule's convention; ranks (hosts) whose --data or --config differ are named. The groups run in
# this order: later ones read the configs and runs of earlier ones. Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"
echo "=== DeepSpeed configs: real files (tests/ds_configs), what DeepSpeed makes of them, every refused key at once," \
  "the schedule"
ds=tests/ds_configs
o="d['settings_origin']"  # in the checks of ds_runs
# ds_runs CONFIG CHECK FLAGS...: tests/ds_configs/CONFIG runs, and CHECK (Python over its --json's d) holds.
ds_runs() {
  local config=$1 check=$2; shift 2
  rm -f "$work/ds_run.json"
  if timeout 120 mpirun -n 2 "$trainer" --config "$ds/$config" "${one_layer[@]}" --steps 2 "$@" \
       --json "$work/ds_run.json" > "$work/ds_stdout" 2> "$work/ds_stderr" &&
     [ "$(json_get "$work/ds_run.json" "bool($check)")" = True ]; then
    pass "$config runs: $check"
  else fail "$config: $(head -c 300 "$work/ds_stderr") $(json_get "$work/ds_run.json" "$check" 2>&1 | tail -n 1)"; fi
}
# Refused: every unsupported key of the file in one message (bad_case: one message, exit non-zero).
ds_refused() {  # config, the number of refused keys, then fragments each of which the message must hold
  local config=$1 count=$2; shift 2
  bad_case "has $count setting" --config "$config" "${one_layer[@]}" --steps 2
  for fragment in "$@"; do
    grep -qF -- "$fragment" "$work/bad_stderr" || fail "$config: the message lacks '$fragment'"
  done
}
# DeepSpeed needs a batch key (runtime/config.py:979-981): the files written here give the trainer's 8.
micro_batch='"train_micro_batch_size_per_gpu": 8'
schedule() {  # name, then the scheduler's params as JSON
  echo "{$micro_batch, \"scheduler\": {\"type\": \"$1\", \"params\": $2}}" > "$work/ds_$3.json"
}
rates() {  # config, out, flags...
  local config=$1 out=$2; shift 2
  rm -f "$work/$out.json"
  timeout 120 mpirun -n 2 "$trainer" --config "$work/$config.json" "${one_layer[@]}" "$@" --json "$work/$out.json" \
    > /dev/null 2>&1
}
other_schedule() {  # name, params, out, optimizer block, more config
  echo "{$micro_batch, \"optimizer\": $4, \"scheduler\": {\"type\": \"$1\", \"params\": $2}${5:-}}" > "$work/ds_$3.json"
}
# The schedulers' params (other_schedulers, betas_reach_adamw, bad_schedule_params).
cosine='{"total_num_steps": 8, "warmup_num_steps": 3, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05, "warmup_type": "linear"}'
cosine_log='{"total_num_steps": 9, "warmup_num_steps": 4}'
one_cycle='{"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 3, "cycle_second_step_size": 2, "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.01}'
one_cycle_plain='{"cycle_min_lr": 2e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 4, "cycle_momentum": false}'
range_test='{"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 3, "lr_range_test_staircase": true}'
range_test_default='{}'
adamw='{"type": "AdamW", "params": {"lr": 2e-3}}'

# What a file means where it leaves a key out is DeepSpeed 0.16.9's default
# (notes/07): no zero_optimization is stage 0, no gradient_clipping is 0,
# FusedAdam's weight decay is 0, an fp16 block without scaler keys starts at
# 2^32 with hysteresis 1 (DynamicLossScaler()), one with some at the fp16
# section's 2^16 and 2; "auto" keeps the trainer's default.
real_configs() {
  ds_runs autotuning_hf_fp16_z2.json "d['precision'] == 'fp16' and d['stage'] == 2 and d['micro_batch'] == 8 and \
    d['steps'][0]['loss_scale'] == 2**32 and d['loss_scaling']['hysteresis'] == 1 and d['optimizer']['clip'] == 0 and \
    d['optimizer']['weight_decay'] == 0.01 and $o['weight_decay'] == 'trainer_default' and \
    $o['initial_scale_power'] == 'deepspeed_default:DynamicLossScaler()' and d['schedule']['convention'] == 'none'"
  ds_runs open_assistant_zero.json "d['precision'] == 'fp32' and d['stage'] == 2 and not d['overlap'] and \
    d['bucket'] == 1000000000 and d['schedule']['warmup_type'] == 'log' and \
    d['schedule']['convention'] == 'deepspeed' and $o['warmup'] == 'trainer_default:auto' and \
    $o['clip'] == 'trainer_default:auto'"
  ds_runs axolotl_zero1.json "d['stage'] == 1 and d['precision'] == 'fp32' and d['overlap'] and \
    $o['stage'] == 'config:zero_optimization.stage'"
  ds_runs getting_started.json "d['stage'] == 1 and d['micro_batch'] == 4 and d['accum'] == 1 and \
    d['precision'] == 'fp16' and d['schedule']['lr'] == 0.00015 and d['optimizer']['weight_decay'] == 0 and \
    $o['weight_decay'] == 'deepspeed_default:FusedAdam' and d['optimizer']['clip'] == 0 and \
    d['steps'][0]['loss_scale'] == 2**32 and d['loss_scaling']['hysteresis'] == 1 and \
    $o['micro_batch'] == 'derived:train_batch_size' and $o['lr'] == 'config:optimizer.params.lr'"
  ds_runs hand_written.json "d['precision'] == 'bf16' and d['activations'] == 'offload' and d['alloc'] == 'arena' and \
    d['schedule']['decay'] == 'none' and d['micro_batch'] == 4 and all('forward_ms' in s for s in d['steps'])"
  ds_runs chatglm_ptuning.json "d['stage'] == 2 and d['optimizer']['clip'] == 0 and \
    $o['clip'] == 'deepspeed_default:constants.py' and d['loss_scaling']['initial_scale_power'] == 16 and \
    d['loss_scaling']['hysteresis'] == 2 and not d['overlap'] and $o['precision'] == 'trainer_default:auto'"
  ds_runs chatglm_ptuning.json "d['precision'] == 'fp16' and d['steps'][0]['loss_scale'] == 2**16 and \
    d['loss_scaling']['hysteresis'] == 2 and $o['precision'] == 'flag:--precision'" --precision fp16
  ds_runs qanet_bsz512_warmup.json "d['stage'] == 0 and $o['stage'] == 'deepspeed_default:DeepSpeedZeroConfig' and \
    d['optimizer']['clip'] == 0 and d['optimizer']['weight_decay'] == 3e-7 and \
    d['optimizer']['betas'] == [0.8, 0.999] and d['schedule']['warmup'] == 1000 and \
    d['schedule']['decay'] == 'none' and d['schedule']['convention'] == 'deepspeed' and len(d['steps']) == 3" --steps 3
  ds_runs accelerate_zero_stage2.json "d['precision'] == 'fp16' and d['schedule']['convention'] == 'deepspeed' and \
    d['optimizer']['weight_decay'] == 0.01 and $o['weight_decay'] == 'trainer_default:auto' and \
    $o['warmup_type'] == 'deepspeed_default:WarmupDecayLR' and d['bucket'] == 16 * 16"
  ds_runs open_instruct_stage2.json "d['stage'] == 2 and d['overlap'] and $o['lr'] == 'trainer_default' and \
    $o['weight_decay'] == 'trainer_default' and d['schedule']['convention'] == 'none' and \
    all(s['lr'] == 0.001 for s in d['steps'])"
  # ZeRO-Offload's configs (they run the engine's offloaded step): transformers' and HelloDeepSpeed's.
  ds_runs hf_transformers_zero2.json "d['stage'] == 2 and d['offload_optimizer'] == 'cpu' and \
    $o['offload_optimizer'] == 'config:zero_optimization.offload_optimizer.device' and \
    d['memory']['host_model_states_bytes'] == 16 * d['params_padded'] // 2"
  ds_runs hello_deepspeed.json "d['stage'] == 1 and d['precision'] == 'bf16' and d['offload_optimizer'] == 'cpu' and \
    d['optimizer']['weight_decay'] == 0 and d['memory']['host_model_states_bytes'] == 16 * d['params_padded'] // 2"
  ds_runs llama_factory_ds_z2.json "d['stage'] == 2 and \
    [w.split(\"'\")[1] for w in d['config_warnings']] == ['comms_config', 'monitor_config'] and \
    all('DeepSpeed ignores it' in w for w in d['config_warnings'])"
}

# Its ignored keys: a WARNING line each in the header; with --quiet, on stderr.
ignored_key_warnings() {
  timeout 120 mpirun -n 2 "$trainer" --config "$ds/llama_factory_ds_z2.json" "${one_layer[@]}" --steps 1 \
    2> "$work/ds_stderr" > /dev/null
  quiet_warnings=$(grep -c "^train_bert_mini: warning: config key '\(comms\|monitor\)_config' is not a key DeepSpeed reads: DeepSpeed ignores it" "$work/ds_stderr")
  timeout 120 mpirun -n 2 "$trainer" --config "$ds/llama_factory_ds_z2.json" --layers 1 --hidden 16 \
    --heads 2 --intermediate 32 \
    --seq 16 --max-positions 20 --steps 1 > "$work/ds_stdout" 2>&1
  header_warnings=$(grep -c "^  WARNING   config key '\(comms\|monitor\)_config' is not a key DeepSpeed reads" "$work/ds_stdout")
  [ "$quiet_warnings" = 2 ] && [ "$header_warnings" = 2 ] && ! grep -q "warning" <(grep -v WARNING "$work/ds_stdout") &&
    pass "LLaMA-Factory's ignored keys: a WARNING line each in the header, on stderr with --quiet (rank 0 alone)" ||
    fail "ignored keys' warnings: $quiet_warnings on stderr, $header_warnings in the header:" \
      "$(head -c 300 "$work/ds_stderr")"
}

# The header names the file and each setting's source.
header_sources() {
  timeout 120 mpirun -n 2 "$trainer" --config "$ds/getting_started.json" --layers 1 --hidden 16 \
    --heads 2 --intermediate 32 \
    --seq 16 --max-positions 20 --steps 1 > "$work/ds_stdout" 2>&1
  grep -q "^  config    $ds/getting_started.json: read as DeepSpeed 0.16.9 reads it" "$work/ds_stdout" &&
    grep -q "^            the config: stage 1 (zero_optimization)" "$work/ds_stdout" &&
    tr '\n' ' ' < "$work/ds_stdout" | grep \
      -q "DeepSpeed's defaults: .*weight_decay 0, *bias_correction true *\[FusedAdam\]" &&
    grep -q "^  optimizer AdamW lr 0.00015 at every step (no scheduler" "$work/ds_stdout" &&
    pass "the header names the config and where each setting came from (the file, DeepSpeed's default, the" \
      "trainer's)" ||
    fail "config header: $(grep -A8 '^  optimizer' "$work/ds_stdout" | head -c 600)"
}

# Without --config nothing of this applies: the trainer's defaults, --precision fp16's 2^16 and hysteresis 2.
no_config() {
  timeout 120 mpirun -n 2 "$trainer" "${one_layer[@]}" --steps 2 --precision fp16 \
    --json "$work/ds_none.json" > /dev/null 2>&1
  [ "$(json_get "$work/ds_none.json" "(d['stage'], d['optimizer']['weight_decay'], d['optimizer']['clip'], d['steps'][0]['loss_scale'], d['loss_scaling']['hysteresis'], d['schedule']['convention'], d['config'], sorted(set(v for k, v in d['settings_origin'].items() if k != 'precision')), d['settings_origin']['precision'])")" = \
    "(2, 0.01, 1.0, 65536.0, 2, 'zero2', None, ['trainer_default'], 'flag:--precision')" ] &&
    pass "without --config: stage 2, weight decay 0.01, clip 1, fp16 from 2^16 with hysteresis 2, the trainer's" \
      "schedule" ||
    fail "no config: $(json_get "$work/ds_none.json" "(d['stage'], d['optimizer'], d['steps'][0]['loss_scale'], d['loss_scaling'], d['schedule'], d['settings_origin'])" 2>&1 | head -c 400)"
}

# The optimizer's constructor decides the weight decay a file leaves out:
# FusedAdam's 0; torch.optim.AdamW's 1e-2 with "torch_adam": true (which
# takes no bias_correction: DeepSpeed's call would raise TypeError); an fp16
# block with one scaler key takes the section's defaults for the rest.
left_out_defaults() {
  echo '{"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}' > "$work/ds_fused.json"
  echo '{"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": true}}}' > "$work/ds_torch_adam.json"
  echo '{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}, "fp16": {"enabled": true, "loss_scale_window": 500}}' \
    > "$work/ds_one_scaler_key.json"
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_fused.json" "${one_layer[@]}" --steps 1 \
    --json "$work/ds_fused_run.json" > /dev/null 2>&1
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_torch_adam.json" "${one_layer[@]}" --steps 1 \
    --json "$work/ds_torch_run.json" > /dev/null 2>&1
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_one_scaler_key.json" "${one_layer[@]}" --steps 1 \
    --json "$work/ds_scaler_run.json" > /dev/null 2>&1
  [ "$(json_get "$work/ds_fused_run.json" "(d['optimizer']['weight_decay'], d['settings_origin']['weight_decay'])")" \
    = "(0.0, 'deepspeed_default:FusedAdam')" ] &&
    [ "$(json_get "$work/ds_torch_run.json" "(d['optimizer']['weight_decay'], d['settings_origin']['weight_decay'])")" \
      = "(0.01, 'deepspeed_default:torch.optim.AdamW')" ] &&
    [ "$(json_get "$work/ds_scaler_run.json" "(d['steps'][0]['loss_scale'], d['loss_scaling']['window'], d['loss_scaling']['hysteresis'])")" = "(65536.0, 500, 2)" ] &&
    pass "left out: weight decay 0 (FusedAdam), 0.01 (torch_adam: torch.optim.AdamW); fp16 with one scaler key: 2^16," \
      "hysteresis 2" ||
    fail "optimizer / scaler defaults: $(json_get "$work/ds_fused_run.json" "d['optimizer']" 2>&1 | tail -n 1)" \
      "$(json_get "$work/ds_torch_run.json" "d['optimizer']" 2>&1 | tail -n 1) $(json_get "$work/ds_scaler_run.json" "d['loss_scaling']" 2>&1 | tail -n 1)"
}

# Megatron's partition_activations splits checkpoints across model-parallel
# ranks: with none (size 1) the part is the whole, so it runs (the header notes it).
refused_real_configs() {
  ds_runs megatron_zero2.json "d['stage'] == 2 and d['activations'] == 'keep' and d['precision'] == 'fp16'"
  # cifar's cpu_offload is ZeRO-Offload's old spelling (taken); its fp16 master is not.
  ds_refused "$ds/cifar.json" 1 "fp16.fp16_master_weights_and_grads: true is not supported"
  ds_refused "$ds/bing_bert_bsz4096_adam.json" 1 \
    "optimizer.params.max_grad_norm: DeepSpeed refuses it (engine.py _configure_basic_optimizer raises ValueError"
  ds_refused "$ds/bingbertsquad_bsz24.json" 1 "optimizer.params.max_grad_norm: DeepSpeed refuses it" \
    "write the clip as gradient_clipping"
  ds_refused "$ds/bing_bert_lamb_64k_seq128.json" 4 \
    "optimizer.type: \"Lamb\" is not supported: a DeepSpeed feature not implemented here" \
    "optimizer.params.max_coeff: a DeepSpeed feature not implemented here (Lamb's parameter)" \
    "optimizer.params.min_coeff: a DeepSpeed feature not implemented here (Lamb's parameter)" \
      "sparse_attention: a DeepSpeed feature not implemented here"
  ds_refused "$ds/transformers_zero3.json" 2 "zero_optimization.stage: 3 is not supported" \
    "zero_optimization.reduce_bucket_size: wants"
}

# Issue 39's public ZeRO-2 configs (tests/ds_configs/README.md: each source, and what DeepSpeed 0.16.9 does with it).
public_zero2_configs() {
  ds_runs qwen_finetune_zero2.json "d['stage'] == 2 and d['precision'] == 'fp32' and d['overlap'] and \
    d['bucket'] == 200000000 and d['offload_optimizer'] == 'none' and d['schedule']['convention'] == 'deepspeed' and \
    d['schedule']['decay'] == 'none' and d['schedule']['lr'] == 0.001 and $o['warmup'] == 'trainer_default:auto' and \
    [s['lr'] for s in d['steps']] == [0.0, 0.0] and d['optimizer']['clip'] == 1 and \
    $o['clip'] == 'trainer_default:auto'"
  ds_runs internvl_chat_zero2.json "d['stage'] == 2 and d['precision'] == 'fp32' and d['overlap'] and \
    d['bucket'] == 100000000 and d['optimizer']['betas'] == [0.9, 0.999] and \
    d['optimizer']['weight_decay'] == 0.01 and $o['weight_decay'] == 'trainer_default:auto' and \
    d['optimizer']['clip'] == 1 and d['schedule']['convention'] == 'none' and all(s['lr'] == 0.001 for s in d['steps'])"
  ds_runs internvl_chat_zero2.json "d['precision'] == 'fp16' and d['steps'][0]['loss_scale'] == 2**32 and \
    d['loss_scaling']['hysteresis'] == 2 and d['loss_scaling']['min_scale'] == 1" --precision fp16
  ds_runs internvl_seg_adam_zero2_fp16.json "d['stage'] == 2 and d['precision'] == 'fp16' and \
    d['micro_batch'] == 8 and d['accum'] == 1 and d['steps'][0]['loss_scale'] == 2**32 and \
    d['loss_scaling']['hysteresis'] == 1 and d['optimizer']['weight_decay'] == 0 and d['optimizer']['clip'] == 0 and \
    all(s['lr'] == 4e-5 for s in d['steps']) and [w.split(\"'\")[1] for w in d['config_warnings']] == ['log']"
  ds_runs gan.json "d['stage'] == 0 and d['precision'] == 'fp32' and d['micro_batch'] == 32 and d['accum'] == 1 and \
    d['optimizer']['betas'] == [0.5, 0.999] and d['optimizer']['weight_decay'] == 0 and \
    $o['weight_decay'] == 'deepspeed_default:FusedAdam' and d['optimizer']['clip'] == 0 and \
    d['schedule']['convention'] == 'none' and all(s['lr'] == 0.0002 for s in d['steps'])"
  ds_runs megatron_zero2_cpu_offload.json "d['stage'] == 2 and d['precision'] == 'fp16' and \
    d['offload_optimizer'] == 'cpu' and $o['offload_optimizer'] == 'config:zero_optimization.cpu_offload' and \
    d['optimizer']['clip'] == 1 and d['optimizer']['weight_decay'] == 0 and \
    $o['weight_decay'] == 'deepspeed_default:DeepSpeedCPUAdam' and d['loss_scaling']['initial_scale_power'] == 16 and \
    d['loss_scaling']['hysteresis'] == 2 and d['micro_batch'] == 8 and d['activations'] == 'keep'"
  ds_runs trlx_sft_gptj.json "d['stage'] == 2 and d['precision'] == 'fp16' and d['offload_optimizer'] == 'cpu' and \
    d['optimizer']['betas'] == [0.9, 0.95] and d['optimizer']['weight_decay'] == 0 and d['optimizer']['clip'] == 0 and \
    d['schedule']['lr'] == 1e-5 and $o['lr'] == 'config:scheduler.params.warmup_max_lr' and \
    $o['warmup'] == 'trainer_default:auto' and d['micro_batch'] == 64 and \
    [w.split(\"'\")[1] for w in d['config_warnings']] == ['fp16.opt_level']"
  ds_runs trlx_reward_model_gptj.json "d['stage'] == 2 and d['precision'] == 'fp16' and \
    d['offload_optimizer'] == 'cpu' and d['schedule']['lr'] == 1e-5 and d['schedule']['warmup'] == 100 and \
    d['schedule']['convention'] == 'deepspeed' and d['optimizer']['clip'] == 0 and d['micro_batch'] == 16 and \
    d['loss_scaling']['min_scale'] == 1 and d['loss_scaling']['initial_scale_power'] == 16" --lr 1e-5
  bad_case "but optimizer.params.lr is 1e-5: Hugging Face's Trainer fills both keys from its one learning_rate" \
    --config "$ds/trlx_reward_model_gptj.json" "${one_layer[@]}" --steps 2
  ds_runs wenet_whisper_ds_stage2.json "d['stage'] == 2 and d['precision'] == 'bf16' and \
    $o['precision'] == 'config:bf16.enabled' and d['optimizer']['clip'] == 5 and not d['overlap'] and \
    d['micro_batch'] == 1 and d['offload_optimizer'] == 'none' and $o['lr'] == 'trainer_default' and \
    d['schedule']['convention'] == 'none'"
  ds_runs wenet_s0_ds_stage2.json "d['stage'] == 2 and d['precision'] == 'fp32' and \
    $o['precision'] == 'config:fp16.enabled' and d['optimizer']['clip'] == 0.0001 and d['overlap'] and \
    d['bucket'] == 10000000 and d['activations'] == 'keep' and d['config_warnings'] == []"
  ds_runs ms_swift_zero2.json "d['stage'] == 2 and d['precision'] == 'fp32' and not d['overlap'] and \
    d['bucket'] == 200000000 and d['optimizer']['clip'] == 1 and $o['clip'] == 'trainer_default:auto' and \
    $o['lr'] == 'trainer_default' and d['schedule']['convention'] == 'none'"
  ds_runs ms_swift_zero2_autotp.json "d['stage'] == 2 and d['precision'] == 'fp32' and not d['overlap'] and \
    d['optimizer']['clip'] == 1 and d['schedule']['convention'] == 'none'"
  ds_refused "$ds/axolotl_zero2_torch_compile.json" 2 \
    "compile.backend: not a field of DeepSpeed 0.16.9's CompileConfig" \
    "compile.disable: not a field of DeepSpeed 0.16.9's CompileConfig"
  ds_refused "$ds/megatron_zero_offload.json" 1 \
    "optimizer.type: \"DeepSpeed_Adam\" is not an optimizer DeepSpeed knows (engine.py _do_sanity_check asserts _is_supported_optimizer"
  ds_refused "$ds/megatron_zero_offload_10b.json" 1 \
    "zero_optimization.comm_overlap: not a DeepSpeed key this trainer knows (did you mean 'zero_optimization.overlap_comm'?)"
  for config in fastchat_s2 trlx_ppo_gptj_summarize ms_swift_zero2_offload; do \
     # ZeRO-Offload with the client's optimizer
    bad_case "config key 'zero_optimization.offload_optimizer.device' offloads the optimizer, and the config file names no optimizer \"type\", so the optimizer is the client's" --config "$ds/$config.json" "${one_layer[@]}" --steps 2
  done
}

many_keys() {
  cat > "$work/ds_many.json" <<'JSON'
{"optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 0.3}},
 "scheduler": {"type": "OneCycle", "params": {"last_batch_iteration": 5}},
 "zero_optimization": {"stage": 3, "overlap_comm": "yes"},
 "gradient_predivide_factor": 2.0, "prescale_gradients": true, "steps_per_print": 0, "trian_batch_size": 8,
 "fp16": {"enabled": true, "fp16_master_weights_and_grads": true}, "bf16": {"enabled": false, "loss_scale": 0},
 "tensorboard": {"enabled": true, "output_path": "tb"}}
JSON
  # (prescale_gradients and gradient_predivide_factor are judged with the run's stage, after: issue49_configs.)
  ds_refused "$work/ds_many.json" 10 "optimizer.type: \"Lamb\" is not supported" \
    "optimizer.params.max_coeff: a DeepSpeed feature not implemented here" \
    "scheduler.params.cycle_min_lr: missing: DeepSpeed's OneCycle has no default for it" \
      "scheduler.params.cycle_max_lr: missing" \
    "scheduler.params.last_batch_iteration: 5" "zero_optimization.stage: 3 is not supported" \
    "zero_optimization.overlap_comm: wants true or false" \
    "steps_per_print: wants an integer from 1" "trian_batch_size: not a DeepSpeed key" \
      "fp16.fp16_master_weights_and_grads"
  grep -qF "tensorboard" "$work/bad_stderr" && fail "ds_many.json: an enabled tensorboard (logging only) was refused"
}

# DeepSpeed's keys of features not here are refused as such, never as "not a DeepSpeed key".
feature_keys() {
  cat > "$work/ds_features.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 8, "sparse_attention": {"mode": "fixed"}, "pipeline": {"activation_checkpoint_interval": 1},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "min_coeff": 0.01, "momentum": 0.9}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_ratio": 0.1}},
 "zero_optimization": {"stage": 2, "mics_shard_size": 4}}
JSON
  ds_refused "$work/ds_features.json" 6 "sparse_attention: a DeepSpeed feature not implemented here" \
    "pipeline: a DeepSpeed feature not implemented here" \
    "optimizer.params.min_coeff: a DeepSpeed feature not implemented here (Lamb's parameter; DeepSpeed's FusedAdam raises TypeError" \
    "optimizer.params.momentum: a DeepSpeed feature not implemented here (SGD's parameter" \
    "scheduler.params.warmup_min_ratio: not a parameter of WarmupLR (DeepSpeed's WarmupLR.__init__ raises TypeError on it; it is WarmupCosineLR's)" \
    "zero_optimization.mics_shard_size: 4 is not supported: a DeepSpeed feature not implemented here (MiCS)"
  grep -q "not a DeepSpeed key" "$work/bad_stderr" && fail "a DeepSpeed feature's key called not a DeepSpeed key:" \
    "$(cat "$work/bad_stderr")"
  echo '{"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": false}}}' > "$work/ds_adam_l2.json"
  ds_refused "$work/ds_adam_l2.json" 1 "optimizer.params.adam_w_mode: false (Adam with L2 regularization"
  echo '{"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 0.5}}}' \
    > "$work/ds_clips.json"
  ds_refused "$work/ds_clips.json" 1 "optimizer.params.max_grad_norm: DeepSpeed refuses it"
  echo '{"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"torch_adam": true, "bias_correction": false}}}' \
    > "$work/ds_torch_bias.json"
  ds_refused "$work/ds_torch_bias.json" 1 \
    "optimizer.params.bias_correction: torch.optim.AdamW (torch_adam true) has no 'bias_correction' (DeepSpeed's call raises TypeError)"
  echo '{"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"fused": true}}}' > "$work/ds_fused_flag.json"
  ds_refused "$work/ds_fused_flag.json" 1 "optimizer.params.fused: DeepSpeed's FusedAdam has no 'fused'"
}

# DeepSpeed looks a scheduler type up by its exact name.
scheduler_names() {
  echo '{"train_micro_batch_size_per_gpu": 8, "scheduler": {"type": "warmuplr", "params": {"warmup_num_steps": 1}}}' > "$work/ds_lower_scheduler.json"
  ds_refused "$work/ds_lower_scheduler.json" 1 \
    "scheduler.type: \"warmuplr\" is not a scheduler DeepSpeed knows: it looks the type up by its exact name (engine.py _scheduler_from_config). Did you mean \"WarmupLR\"?"
  echo '{"train_micro_batch_size_per_gpu": 8, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1}}}' > "$work/ds_no_total.json"
  bad_case "config key 'scheduler.params.total_num_steps' is missing: DeepSpeed's WarmupDecayLR has no default for it" \
    --config "$work/ds_no_total.json" "${one_layer[@]}" --steps 2
  echo '{"train_micro_batch_size_per_gpu": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.001, "warmup_num_steps": 1}}}' > "$work/ds_min_lr.json"
  bad_case "warmup_min_lr 0.01 is above the learning rate 0.001" --config "$work/ds_min_lr.json" \
    "${one_layer[@]}" --steps 2
  # "auto" beside an explicit rate (trlx's reward-model config): Hugging Face's Trainer fills both keys from one
  # learning_rate and refuses the file unless that equals the explicit value (fill_match); so does the trainer,
  # naming both, and runs it when --lr is the explicit value.
  echo '{"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 2}}}' > "$work/ds_auto_lr.json"
  bad_case "a learning rate in the config is \"auto\", which takes the run's rate (--lr 0.001 (the trainer's default, not given here)), but optimizer.params.lr is 1e-5: Hugging Face's Trainer fills both keys from its one learning_rate" \
    --config "$work/ds_auto_lr.json" "${one_layer[@]}" --steps 2
  bad_case "(--lr 0.002), but optimizer.params.lr is 1e-5" --config "$work/ds_auto_lr.json" \
    "${one_layer[@]}" --steps 2 --lr 2e-3
  if timeout 300 "$trainer" --config "$work/ds_auto_lr.json" "${one_layer[@]}" --steps 3 --lr 1e-5 \
    --json "$work/auto_lr.json" \
       > /dev/null 2>&1 && [ "$(json_get "$work/auto_lr.json" "d['steps'][2]['lr'] == 1e-5")" = True ]; then
    pass "an \"auto\" warmup_max_lr beside an explicit optimizer lr 1e-5 runs with --lr 1e-5, at that rate after the" \
      "warmup"
  else fail "the \"auto\" warmup_max_lr with --lr 1e-5 did not run at 1e-5"; fi
}

# Keys DeepSpeed never reads: a warning where DeepSpeed ignores them (the
# top level, fp16 / bf16, a block without a type), refused where DeepSpeed
# rejects them (zero_optimization) or where they are a near-miss of a real key.
ignored_keys() {
  cat > "$work/ds_ignored.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 8, "cuda_visible_devices": 0, "bf16": {"enabled": false, "loss_scale": 0},
 "optimizer": {"params": {"lr": 5.0}}, "scheduler": {"params": {"warmup_num_steps": 5}}}
JSON
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_ignored.json" "${one_layer[@]}" --steps 2 \
    --json "$work/ds_ignored_run.json" \
    > /dev/null 2> "$work/ds_stderr"
  [ "$(grep -c '^train_bert_mini: warning: ' "$work/ds_stderr")" = 4 ] &&
    [ "$(json_get "$work/ds_ignored_run.json" "(d['schedule']['lr'], d['schedule']['convention'], len(d['config_warnings']))")" = "(0.001, 'none', 4)" ] &&
    grep -q "config key 'bf16.loss_scale' is not a key DeepSpeed reads" "$work/ds_stderr" &&
    grep -q "config block 'optimizer' has no \"type\": DeepSpeed ignores the block" "$work/ds_stderr" &&
    pass "keys DeepSpeed ignores (top level, bf16, an optimizer / scheduler without a type): 4 warnings, the run goes" \
      "on as DeepSpeed's would" ||
    fail "ignored keys: $(cat "$work/ds_stderr" | head -c 400)"
  echo '{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2, "overlap_com": true}, "wall_clock_breakdwon": true, "fp16": {"hysterisis": 2}}' > "$work/ds_typos.json"
  ds_refused "$work/ds_typos.json" 3 \
    "zero_optimization.overlap_com: not a DeepSpeed key this trainer knows (did you mean 'zero_optimization.overlap_comm'?)" \
    "wall_clock_breakdwon: not a DeepSpeed key this trainer knows (did you mean 'wall_clock_breakdown'?)" \
    "fp16.hysterisis: not a DeepSpeed key this trainer knows (did you mean 'fp16.hysteresis'?)"
  echo '{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2, "bucket_of_gradients": 8}}' > "$work/ds_zero_unknown.json"
  ds_refused "$work/ds_zero_unknown.json" 1 \
    "zero_optimization.bucket_of_gradients: not a DeepSpeed key this trainer knows"
}

# The rates: DeepSpeed's WarmupLR and WarmupDecayLR as its engine steps
# them, computed here from lr_schedules.py's formulas, not from the
# trainer's code: the scheduler is built at warmup_min_lr (iteration -1) and
# stepped after each applied update (engine.py _take_model_step), so an
# fp16-skipped step does not advance it; W = max(2, warmup_num_steps); log
# ln(i+1)/ln(W), linear i/W; WarmupDecayLR max(0, (S - i) / max(1, S - W)).
deepspeed_rates() {
  schedule WarmupDecayLR \
    '{"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 3, "total_num_steps": 10}' decay_log
  schedule WarmupDecayLR \
    '{"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 3, "total_num_steps": 10, "warmup_type": "linear"}' decay_linear
  schedule WarmupLR '{"warmup_max_lr": 2e-3, "warmup_num_steps": 1}' constant_w1
  schedule WarmupLR '{"warmup_max_lr": 2e-3, "warmup_num_steps": 0, "warmup_type": "linear"}' constant_w0
  echo '{"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": true, "initial_scale_power": 18, "hysteresis": 1, "loss_scale_window": 3},
   "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 4, "total_num_steps": 8, "warmup_type": "linear"}}}' > "$work/ds_skips.json"
  rates ds_decay_log decay_log                 # total_num_steps alone: the whole schedule, 10 steps
  rates ds_decay_log decay_part --steps 4      # --steps: part of it
  rates ds_decay_log decay_past --steps 13     # past its end
  rates ds_decay_linear decay_linear
  rates ds_constant_w1 constant_w1 --steps 5
  rates ds_constant_w0 constant_w0 --steps 5
  rates ds_skips skips --steps 12
  cp "$ds/open_instruct_stage2.json" "$work/ds_no_scheduler.json"
  rates ds_no_scheduler flags_add --warmup 3 --steps 6 \
      # a flag adds WarmupDecayLR over --steps, its other params DeepSpeed's
  verdict=$(py deepspeed_configs rates "$work")
  [ "$verdict" = ok ] && pass "rates as DeepSpeed's engine steps WarmupDecayLR (log, linear; 10, 4 and 13 steps) and" \
    "WarmupLR (W = 1, 0), past an fp16-skipped step, and the scheduler a --warmup flag adds: each step's lr" ||
    fail "schedules: $verdict"
}

# DeepSpeed's other three schedulers: each step's lr (and OneCycle's betas)
# against tests/deepspeed_schedulers.py, a transcription of lr_schedules.py's
# classes (v0.16.9) stepped on a stand-in optimizer as the engine steps them,
# with Python's own math.cos / math.log (not the trainer's code); runs past
# an fp16-skipped step, past total_num_steps, into OneCycle's decay.
other_schedulers() {
  other_schedule WarmupCosineLR "$cosine" cosine "$adamw"
  other_schedule WarmupCosineLR "$cosine_log" cosine_log "$adamw"
  other_schedule OneCycle "$one_cycle" one_cycle "$adamw"
  other_schedule OneCycle "$one_cycle_plain" one_cycle_plain '{"type": "AdamW", "params": {"betas": [0.85, 0.95]}}'
  other_schedule LRRangeTest "$range_test" range_test "$adamw"
  other_schedule LRRangeTest "$range_test_default" range_test_default "$adamw"
  other_schedule OneCycle "$one_cycle" one_cycle_skips "$adamw" \
    ', "fp16": {"enabled": true, "initial_scale_power": 18, "hysteresis": 1, "loss_scale_window": 3}'
  rates ds_cosine cosine --steps 12                 # past total_num_steps: the cosine rises again
  rates ds_cosine_log cosine_log --steps 9
  rates ds_one_cycle one_cycle --steps 12           # the cycle (5 iterations), then the decay
  rates ds_one_cycle_plain one_cycle_plain --steps 12
  rates ds_range_test range_test --steps 8
  rates ds_range_test_default range_test_default --steps 4
  rates ds_one_cycle_skips one_cycle_skips --steps 12
  verdict=""
  for case in "cosine WarmupCosineLR cosine 2e-3" "cosine_log WarmupCosineLR cosine_log 2e-3" \
              "one_cycle OneCycle one_cycle 2e-3" "one_cycle_plain OneCycle one_cycle_plain 1e-3" \
              "range_test LRRangeTest range_test 2e-3" "range_test_default LRRangeTest range_test_default 2e-3" \
              "one_cycle_skips OneCycle one_cycle 2e-3"; do
    set -- $case
    if [ ! -f "$work/$1.json" ]; then verdict+="$1: no run; "; continue; fi
    said=$("$PYTHON" tests/deepspeed_schedulers.py "$work/$1.json" "$2" "${!3}" "$4" 2>&1)
    [ "$said" = ok ] || verdict+="$1: $said; "
  done
  [ "$(json_get "$work/one_cycle_skips.json" "any(s['skipped'] for s in d['steps'][1:])")" = True ] ||
    verdict+="the fp16 OneCycle run skipped no step; "
  [ -z "$verdict" ] &&
    pass "rates as DeepSpeed's engine steps WarmupCosineLR (linear, log; past total_num_steps), OneCycle (cycle and" \
      "decay, beta1 per step, beta2 0.99; without momentum; past an fp16-skipped step) and LRRangeTest (staircase, defaults): each step's lr and betas as lr_schedules.py's own code gives them" ||
    fail "other schedulers: $verdict"
}

# The per-step betas reach AdamW, and the same AdamW with either spelling:
# OneCycle with cycle_min_mom = cycle_max_mom = 0.9 sets (0.9, 0.99) at every
# update, the bits of cycle_momentum false with the optimizer's betas (0.9,
# 0.99); with its beta1 cycling the bits differ, and stage 2 offloaded
# (the host's AdamW) gives the device loop's bits.
betas_reach_adamw() {
  flat='{"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2, "cycle_min_mom": 0.9, "cycle_max_mom": 0.9}'
  other_schedule OneCycle "$flat" flat_cycled "$adamw" ', "zero_optimization": {"stage": 2}'
  other_schedule OneCycle "${flat%\}}, \"cycle_momentum\": false}" flat_fixed \
    '{"type": "AdamW", "params": {"betas": [0.9, 0.99]}}' ', "zero_optimization": {"stage": 2}'
  other_schedule OneCycle "$one_cycle" cycling "$adamw" ', "zero_optimization": {"stage": 2}'
  rates ds_flat_cycled flat_cycled --steps 6
  rates ds_flat_fixed flat_fixed --steps 6
  rates ds_cycling cycling --steps 6
  rates ds_cycling cycling_offload --steps 6 --offload-optimizer cpu
  verdict=$(py deepspeed_configs betas "$work")
  [ "$verdict" = ok ] && pass "OneCycle's betas reach AdamW: a flat cycle = the optimizer's (0.9, 0.99) bit for bit;" \
    "cycling changes the bits; offloaded (stage 2, cpu) = not offloaded" ||
    fail "OneCycle betas in AdamW: $verdict"
}

# resumes_to_straight LABEL STRAIGHT OUT WHAT LOAD-FLAGS...: resume on 2 ranks with LOAD-FLAGS and no config,
# the summary into OUT; its bits must be STRAIGHT's (the run that never stopped). WHAT is the claim.
resumes_to_straight() {
  local label=$1 straight=$2 out=$3 what=$4 verdict
  shift 4
  timeout 120 mpirun -n 2 "$trainer" "$@" --quiet --json "$out" > "$work/log" 2>&1
  verdict=$(resumed_matches "$straight" "$out" 2>&1)
  [ "$verdict" = ok ] && pass "$what" || fail "$label: $verdict $(head -c 300 "$work/log")"
}

# The header says each, and a resumed run keeps the scheduler (the checkpoint records it).
one_cycle_header_resume() {
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_one_cycle.json" "${one_layer[@]}" --steps 4 \
    --save "$work/ck_cycle" > /dev/null 2>&1
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_one_cycle.json" --layers 1 --hidden 16 \
    --heads 2 --intermediate 32 \
    --seq 16 --max-positions 20 --steps 2 > "$work/ds_stdout" 2>&1
  grep -q "^  betas     (beta1, 0.99): beta1 0.9 down to 0.8 and back" "$work/ds_stdout" &&
    grep -q "optimizer.params.lr 2e-3 has no effect: OneCycle sets every step's rate" "$work/ds_stdout" &&
    pass "OneCycle's header: the rate's cycle, beta1's, and the optimizer's lr without effect" ||
    fail "OneCycle header: $(grep -E 'optimizer|betas' "$work/ds_stdout" | head -c 400)"
  resumes_to_straight "OneCycle resume" "$work/one_cycle.json" "$work/ds_cycle_resumed.json" \
    "OneCycle: saved at 4, resumed to 12 with no config: the 12-step run's bits (schedule, betas: the checkpoint's)" \
    --load "$work/ck_cycle" --steps 12
  bad_case "scheduler \"WarmupCosineLR\" contradicts the checkpoint's \"OneCycle\"" \
    --load "$work/ck_cycle" --config "$work/ds_cosine.json" --steps 6
}

# Bad params: refused, naming the key, before anything runs.
bad_schedule_params() {
  other_schedule WarmupCosineLR '{"total_num_steps": 1000, "warmup_num_steps": 1000}' cosine_zero "$adamw"
  bad_case "config key 'scheduler.params.total_num_steps' 1000 equals the warmup's 1000 iterations (config key 'scheduler.params.warmup_num_steps' 1000" \
    --config "$work/ds_cosine_zero.json" "${one_layer[@]}" --steps 2
  other_schedule WarmupCosineLR '{"total_num_steps": 10, "warmup_type": "cosine"}' cosine_type "$adamw"
  ds_refused "$work/ds_cosine_type.json" 1 \
    "scheduler.params.warmup_type: \"cosine\" is neither \"linear\" nor \"log\": DeepSpeed's WarmupCosineLR takes it and raises UnboundLocalError"
  other_schedule WarmupCosineLR '{"warmup_num_steps": 3}' cosine_no_total "$adamw"
  bad_case "config key 'scheduler.params.total_num_steps' is missing: DeepSpeed's WarmupCosineLR has no default for it" \
    --config "$work/ds_cosine_no_total.json" "${one_layer[@]}" --steps 2
  other_schedule WarmupCosineLR '{"total_num_steps": 10, "warmup_max_lr": 1e-3}' cosine_max "$adamw"
  ds_refused "$work/ds_cosine_max.json" 1 \
    "scheduler.params.warmup_max_lr: not a parameter of WarmupCosineLR (DeepSpeed's WarmupCosineLR.__init__ raises TypeError on it; it is WarmupDecayLR, WarmupLR's)"
  bad_case "--decay acts on DeepSpeed's WarmupLR / WarmupDecayLR, and the config's scheduler.type is \"WarmupCosineLR\"" \
    --config "$work/ds_cosine.json" "${one_layer[@]}" --steps 2 --decay none
  bad_case "--warmup acts on DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR, and the config's scheduler.type is \"OneCycle\"" \
    --config "$work/ds_one_cycle.json" "${one_layer[@]}" --steps 2 --warmup 3
  for bad in "cycle_first_step_size|-4|wants an integer from 1" "cycle_first_step_size|0|wants an integer from 1" \
             "decay_step_size|-1|wants an integer from 0" "decay_lr_rate|-0.5|wants a number from 0" \
             "cycle_max_mom|1.0|wants a number from 0 to 1 (exclusive)" \
               "cycle_second_step_size|2.5|wants an integer"; do
    IFS='|' read -r key value says <<< "$bad"
    other_schedule OneCycle "{\"cycle_min_lr\": 1e-4, \"cycle_max_lr\": 1e-3, \"$key\": $value}" one_bad "$adamw"
    bad_case "scheduler.params.$key: wants" --config "$work/ds_one_bad.json" "${one_layer[@]}" --steps 2
    grep -qF "$says" "$work/bad_stderr" || fail "OneCycle $key $value: '$says' not said:" \
      "$(head -c 300 "$work/bad_stderr")"
  done
  other_schedule OneCycle \
    '{"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2, "decay_step_size": 1, "decay_mom_rate": 0.1}' one_beta "$adamw"
  bad_case "config key 'scheduler.params.decay_mom_rate' 0.1 takes OneCycle's beta1 to 1.0800000000000001 at update 7 of this run's 8" \
    --config "$work/ds_one_beta.json" "${one_layer[@]}" --steps 8
  other_schedule LRRangeTest '{"lr_range_test_step_size": 0}' range_zero "$adamw"
  bad_case "scheduler.params.lr_range_test_step_size: wants an integer from 1" --config "$work/ds_range_zero.json" \
    "${one_layer[@]}" --steps 2
  other_schedule LRRangeTest '{"lr_range_test_staircase": 1}' range_staircase "$adamw"
  ds_refused "$work/ds_range_staircase.json" 1 "scheduler.params.lr_range_test_staircase: wants true or false (got 1)"
}

# No scheduler block: the optimizer's rate at every step (getting_started's
# run above); without --config the trainer's own schedule, from step 1.
trainer_schedule() {
  timeout 120 mpirun -n 2 "$trainer" "${one_layer[@]}" --steps 5 --warmup 2 \
    --json "$work/ds_trainer_schedule.json" > /dev/null 2>&1
  [ "$(json_get "$work/ds_trainer_schedule.json" "all(abs(s['lr'] / 1e-3 - want) < 1e-12 for s, want in zip(d['steps'], [0.5, 1.0, 1.0, 2 / 3, 1 / 3])) and len(d['steps']) == 5 and d['schedule']['convention'] == 'zero2'")" = True ] &&
    pass "without --config the trainer's schedule stays: linear warmup t / W from step 1, then decay (S - t + 1) / (S" \
      "- W)" ||
    fail "trainer's schedule:" \
      "$(json_get "$work/ds_trainer_schedule.json" "[s['lr'] for s in d['steps']]" 2>&1 | tail -n 1)"
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_decay_log.json" --layers 1 --hidden 16 \
    --heads 2 --intermediate 32 \
    --seq 16 --max-positions 20 --steps 13 > "$work/ds_stdout" 2>&1
  grep -q "^  WARNING   updates 12 to 13 are past total_num_steps: they train at warmup_min_lr = 0.0001" \
    "$work/ds_stdout" &&
    pass "updates past total_num_steps: the header warns" || fail "past the schedule:" \
      "$(grep -E 'optimizer|WARN' "$work/ds_stdout" | head -c 300)"
}

# The run's length may change on resume (the schedule may not): 4 steps of a
# 10-step schedule saved, resumed with --steps 10 and no config = the 10-step
# run, bit for bit (the checkpoint records DeepSpeed's schedule).
longer_resume() {
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_decay_log.json" "${one_layer[@]}" --steps 4 \
    --save "$work/ck_part" > /dev/null 2>&1
  resumes_to_straight "longer resume" "$work/decay_log.json" "$work/ds_longer.json" \
    "4 steps saved, resumed with --steps 10: the 10-step run's bits (the schedule, DeepSpeed's, is the checkpoint's)" \
    --load "$work/ck_part" --steps 10
  bad_case "--schedule-steps 20 contradicts the checkpoint's 10" --load "$work/ck_part" --schedule-steps 20
  # A checkpoint of the trainer's schedule resumed with a config whose scheduler is DeepSpeed's: refused.
  timeout 120 mpirun -n 2 "$trainer" "${one_layer[@]}" --steps 4 --warmup 1 --save "$work/ck_trainer" \
    --json "$work/ds_trainer4.json" > /dev/null 2>&1
  bad_case "this run's learning rates would follow DeepSpeed's scheduler (config:scheduler.type), the checkpoint's" \
    --load "$work/ck_trainer/step_4" --config "$work/ds_constant_w1.json" --steps 6
}

# A checkpoint written before the schedule was recorded keeps the trainer's:
# the field taken out (and the index's digest made anew), it resumes to the
# bits of the run that never stopped.
old_checkpoint() {
  timeout 120 mpirun -n 2 "$trainer" "${one_layer[@]}" --steps 8 --warmup 1 --save-every 4 --save "$work/ck_old" \
    --json "$work/ds_old_straight.json" > /dev/null 2>&1
  py common edit_json "$work/ck_old/step_4/index.json" "del d['settings']['schedule_convention']"
  (cd "$work/ck_old/step_4" && sha256sum index.json > index.sha256)
  resumes_to_straight "old checkpoint resume" "$work/ds_old_straight.json" "$work/ds_old_resumed.json" \
    "a checkpoint without schedule_convention resumes with the trainer's schedule: the straight run's bits" \
    --load "$work/ck_old/step_4"
}

# bias_correction false changes the update (and is recorded in the JSON).
bias_correction() {
  echo '{"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "bias_correction": true}}}' > "$work/ds_bias.json"
  sed 's/"bias_correction": true/"bias_correction": false/' "$work/ds_bias.json" > "$work/ds_no_bias.json"
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_bias.json" "${one_layer[@]}" --steps 2 \
    --json "$work/ds_bias_on.json" > /dev/null 2>&1
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_no_bias.json" "${one_layer[@]}" --steps 2 \
    --json "$work/ds_bias_off.json" > /dev/null 2>&1
  [ "$(json_get "$work/ds_bias_on.json" "d['final_params_hash']")" \
    != "$(json_get "$work/ds_bias_off.json" "d['final_params_hash']")" ] &&
    [ "$(json_get "$work/ds_bias_off.json" "d['optimizer']['bias_correction']")" = False ] &&
    pass "bias_correction false trains differently from true" || fail "bias_correction has no effect"
}

# Keys DeepSpeed has that change nothing here, at their "off" values, run;
# an all-false activation_checkpointing block changes nothing and says so;
# without --config, steps past the schedule's end warn.
off_values() {
  cat > "$work/ds_offs.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 8, "elasticity": {"enabled": false}, "compile": {"deepcompile": false}, "sparse_gradients": false, "dump_state": false,
 "memory_breakdown": false, "communication_data_type": null, "checkpoint": {"tag_validation": "Warn"},
 "bf16": {"enabled": false, "immediate_grad_update": false},
 "zero_optimization": {"stage": 2, "zero_quantized_weights": false, "zero_hpz_partition_size": 1, "mics_shard_size": -1},
 "activation_checkpointing": {"partition_activations": false, "cpu_checkpointing": false,
                              "contiguous_memory_optimization": false, "number_checkpoints": null}}
JSON
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_offs.json" --layers 1 --hidden 16 --heads 2 \
    --intermediate 32 --seq 16 \
    --max-positions 20 --steps 2 --json "$work/ds_offs_run.json" > "$work/ds_stdout" 2>&1 &&
    [ "$(json_get "$work/ds_offs_run.json" "d['activations']")" = keep ] &&
    grep -q "^  config    activation_checkpointing: which activations are checkpointed is --activations here" \
      "$work/ds_stdout" &&
    pass "DeepSpeed keys at their off values run; an all-false activation_checkpointing block keeps --activations" \
      "keep and says why" ||
    fail "off-value keys: $(head -c 300 "$work/ds_stdout")"
  # comms_logger and flops_profiler only time and profile in DeepSpeed: enabled, a note each and the same bits;
}

# CommsLoggerConfig forbids other fields (refused), the flops profiler's reader ignores them (a warning).
loggers() {
  cat > "$work/ds_loggers.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2},
 "comms_logger": {"enabled": true, "verbose": false, "prof_all": true, "debug": false, "prof_ops": ["all_reduce"]},
 "flops_profiler": {"enabled": true, "profile_step": 2, "module_depth": -1, "top_modules": 1, "detailed": true,
                    "output_file": null, "recompute_fwd_factor": 0.0, "note": "once"}}
JSON
  echo '{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}' > "$work/ds_no_loggers.json"
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_loggers.json" --layers 1 --hidden 16 --heads 2 \
    --intermediate 32 --seq 16 \
    --max-positions 20 --steps 2 --json "$work/ds_loggers_run.json" > "$work/ds_stdout" 2>&1
  timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_no_loggers.json" "${one_layer[@]}" --steps 2 \
    --json "$work/ds_no_loggers_run.json" > /dev/null 2>&1
  grep -q "^  config    comms_logger.enabled true: DeepSpeed would time each collective (comm/comm.py timed_op" \
    "$work/ds_stdout" &&
    grep -q "^  config    flops_profiler.enabled true: DeepSpeed would profile step 2's forward on rank 0" \
      "$work/ds_stdout" &&
    grep -q "^  WARNING   config key 'flops_profiler.note' is not a key DeepSpeed reads" "$work/ds_stdout" &&
    [ "$(json_get "$work/ds_loggers_run.json" "d['final_params_hash']")" \
      = "$(json_get "$work/ds_no_loggers_run.json" "d['final_params_hash']")" ] &&
    pass "comms_logger and flops_profiler enabled: a note each (an unknown profiler field warned about), the bits of" \
      "the run without them" ||
    fail "comms_logger / flops_profiler: $(grep -E 'comms|flops|error' "$work/ds_stdout" | head -c 400)"
  echo '{"train_micro_batch_size_per_gpu": 8, "comms_logger": {"enabled": true, "prof_al": true}, "flops_profiler": {"enabled": "yes", "profile_stp": 2, "top_modules": "3"}}' > "$work/ds_loggers_bad.json"
  ds_refused "$work/ds_loggers_bad.json" 4 \
    "comms_logger.prof_al: not a field of DeepSpeed's CommsLoggerConfig (comm/config.py, a pydantic model that forbids other fields) (did you mean 'comms_logger.prof_all'?)" \
    "flops_profiler.enabled: wants true or false (got \"yes\")" \
    "flops_profiler.profile_stp: not a DeepSpeed key this trainer knows (did you mean 'flops_profiler.profile_step'?)" \
    "flops_profiler.top_modules: wants an integer (got \"3\")"
  timeout 120 mpirun -n 2 "$trainer" --layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 --max-positions 20 \
    --steps 6 --schedule-steps 4 > "$work/ds_stdout" 2>&1
  grep -q "^  WARNING   steps 5 to 6 are past the schedule's end: they train at warmup_min_lr = 0 (no update at all)" \
    "$work/ds_stdout" &&
    pass "steps past the schedule's end: the header warns" || fail "past the schedule:" \
      "$(grep -E 'steps|WARN' "$work/ds_stdout" | head -c 300)"
}

# Several hosts: each rank reads its own copy of --data and --config; a copy
# that differs is named with its rank and host, on every rank (MPMD: rank 1
# is given another file under another name, as another host's copy would be).
several_hosts() {
  cp "$work/corpus.txt" "$work/copy_a.txt"; cp "$work/corpus.txt" "$work/copy_b.txt"; printf ' and more' \
    >> "$work/copy_b.txt"
  timeout 60 mpirun -n 1 "$trainer" "${one_layer[@]}" --steps 1 --data "$work/copy_a.txt" : -n 1 "$trainer" \
    "${one_layer[@]}" --steps 1 \
    --data "$work/copy_b.txt" > "$work/hosts_out" 2>&1
  status=$?
  [ $status -ne 0 ] && \
    [ "$(grep -c "train_bert_mini: error: --data is not the same file on every rank: rank 0 on .* has 1,800 bytes.*; rank 1 on .* has 1,809 bytes" "$work/hosts_out")" -eq 1 ] &&
    pass "a rank whose --data differs: one message naming rank 1 and its host, exit $status" || fail "differing" \
      "--data: exit $status $(head -c 300 "$work/hosts_out")"
  cp "$ds/getting_started.json" "$work/cfg_a.json"; sed 's/0.00015/0.00016/' "$ds/getting_started.json" \
    > "$work/cfg_b.json"
  timeout 60 mpirun -n 1 "$trainer" "${one_layer[@]}" --steps 1 --config "$work/cfg_a.json" : -n 1 "$trainer" \
    "${one_layer[@]}" --steps 1 \
    --config "$work/cfg_b.json" > "$work/hosts_out" 2>&1
  status=$?
  [ $status -ne 0 ] && grep -q "error: --config is not the same file on every rank" "$work/hosts_out" &&
    pass "a rank whose --config differs: named, exit $status" || fail "differing --config: exit $status" \
      "$(head -c 300 "$work/hosts_out")"
  timeout 60 mpirun -n 1 "$trainer" "${one_layer[@]}" --steps 1 --data "$work/copy_a.txt" : -n 1 "$trainer" \
    "${one_layer[@]}" --steps 1 \
    --data "$work/corpus.txt" > "$work/hosts_out" 2>&1 && pass "the same bytes under two names on two ranks: runs" ||
    fail "same --data, two names: $(head -c 300 "$work/hosts_out")"
}


# Issue 49's config gaps: fp16's scaler keys read only with fp16 on (min_loss_scale 0 runs as DeepSpeed's
# scaler takes it); contiguous_gradients / allgather_partitions false taken, the same bits; a
# reduce_bucket_size "auto" filled as Hugging Face does (hidden_size^2); no batch key refused as DeepSpeed
# refuses it (--micro-batch lifts it); prescale_gradients / gradient_predivide_factor by stage (1: the same
# bits and a note; 2: DeepSpeed's assertion; 0: its arithmetic, not implemented); SGD's reason; the Hjson
# hint only where hjson 3.1.0 reads the file (measured), bytes not UTF-8 shown escaped.
config_gaps() {
  gap_run() {  # gap_run OUT JSON FLAGS...: the file written and trained (2 ranks, 2 steps; not --quiet: the header)
    local out=$1; echo "$2" > "$work/gap.json"; shift 2
    rm -f "$work/$out.json"
    timeout 120 mpirun -n 2 "$trainer" --config "$work/gap.json" "${one_layer[@]:0:12}" --steps 2 "$@" \
      --json "$work/$out.json" > "$work/gap_stdout" 2> "$work/gap_stderr"
  }
  gap_holds() {  # gap_holds LABEL OUT CHECK
    if [ "$(json_get "$work/$2.json" "bool($3)" 2>/dev/null)" = True ]; then pass "$1: $3"
    else fail "$1: $(head -c 300 "$work/gap_stderr")"; fi
  }
  local batch='"train_micro_batch_size_per_gpu": 4'
  gap_run gap_min0 "{$batch, \"fp16\": {\"enabled\": true, \"min_loss_scale\": 0}}"
  gap_holds "fp16 min_loss_scale 0 runs" gap_min0 "d['precision'] == 'fp16' and d['loss_scaling']['min_scale'] == 0"
  gap_run gap_fp16_off "{$batch, \"bf16\": {\"enabled\": true}, \"fp16\": {\"enabled\": false, \"min_loss_scale\": -3, \"loss_scale\": \"x\"}}" --log-every 1
  gap_holds "fp16's keys in a bf16 run's file are not read" gap_fp16_off "d['precision'] == 'bf16'"
  grep -q "fp16.min_loss_scale, fp16.loss_scale not read: the run trains in bf16" "$work/gap_stdout" &&
    pass "the header says the fp16 keys were not read" || fail "no 'not read' note: $(grep config "$work/gap_stdout")"
  echo "{$batch, \"fp16\": {\"min_loss_scale\": -3}}" > "$work/gap_scaler_only.json"  # fp16 off unless a flag
  gap_run gap_scaler_fp32 "$(cat "$work/gap_scaler_only.json")"
  gap_holds "fp16's keys without fp16 on are not read" gap_scaler_fp32 "d['precision'] == 'fp32'"
  bad_case "fp16.min_loss_scale: wants a number from 0" --config "$work/gap_scaler_only.json" "${one_layer[@]}" \
    --precision fp16 --steps 1  # the same file in fp16: read and checked
  # Layout keys: the same bits as without them.
  gap_run gap_plain "{$batch, \"zero_optimization\": {\"stage\": 2}}"
  gap_run gap_layout "{$batch, \"zero_optimization\": {\"stage\": 2, \"contiguous_gradients\": false, \"allgather_partitions\": false}}"
  local plain
  plain=$(json_get "$work/gap_plain.json" "d['final_params_hash']")
  gap_holds "contiguous_gradients / allgather_partitions false" gap_layout "d['final_params_hash'] == '$plain'"
  grep -q "contiguous_gradients false changes no arithmetic here" "$work/gap_stdout" &&
    grep -q "allgather_partitions false changes no arithmetic here" "$work/gap_stdout" &&
    pass "the header names both as changing no arithmetic" || fail "layout notes missing"
  gap_run gap_auto "{$batch, \"zero_optimization\": {\"stage\": 2, \"reduce_bucket_size\": \"auto\"}}"
  gap_holds "reduce_bucket_size auto" gap_auto "d['bucket'] == 256 and $o['bucket'] == 'hugging_face_auto:hidden_size^2'"
  grep -q 'reduce_bucket_size "auto": hidden_size^2 = 16^2 = 256 elements' "$work/gap_stdout" &&
    pass "the header prints the filled bucket" || fail "no bucket note: $(grep -i bucket "$work/gap_stdout")"
  gap_run gap_auto_flag "{$batch, \"zero_optimization\": {\"stage\": 2, \"reduce_bucket_size\": \"auto\"}}" --bucket 1000
  gap_holds "reduce_bucket_size auto with --bucket" gap_auto_flag "d['bucket'] == 1000"
  # No batch key: DeepSpeed's assertion; --micro-batch gives it.
  echo '{"zero_optimization": {"stage": 2}}' > "$work/gap_no_batch.json"
  echo '{"gradient_accumulation_steps": 2}' > "$work/gap_accum_only.json"
  bad_case "gives neither train_batch_size nor train_micro_batch_size_per_gpu: DeepSpeed refuses it" \
    --config "$work/gap_no_batch.json" "${one_layer[@]}" --steps 1
  bad_case "(\"Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided\"" \
    --config "$work/gap_accum_only.json" "${one_layer[@]}" --steps 1
  gap_run gap_micro '{"zero_optimization": {"stage": 2}}' --micro-batch 2
  gap_holds "no batch key with --micro-batch 2" gap_micro "d['micro_batch'] == 2"
  # prescale_gradients / gradient_predivide_factor by stage.
  local scaled='"prescale_gradients": true, "gradient_predivide_factor": 8'
  gap_run gap_stage1 "{$batch, \"zero_optimization\": {\"stage\": 1}}"
  plain=$(json_get "$work/gap_stage1.json" "d['final_params_hash']")
  gap_run gap_scaled1 "{$batch, $scaled, \"zero_optimization\": {\"stage\": 1}}"
  gap_holds "prescale / predivide at stage 1: the same bits" gap_scaled1 "d['final_params_hash'] == '$plain'"
  grep -q "config key 'prescale_gradients' true changes nothing, here as in DeepSpeed at stage 1" "$work/gap_stdout" &&
    pass "stage 1: the header says the keys change nothing" || fail "no stage-1 note"
  echo "{$batch, $scaled, \"zero_optimization\": {\"stage\": 2}}" > "$work/gap_scaled2.json"
  bad_case "stage_1_and_2.py:246 asserts \"pre-scale gradients is not yet supported with ZeRO-2 with reduce scatter enabled\"" \
    --config "$work/gap_scaled2.json" "${one_layer[@]}" --steps 1
  grep -qF 'stage_1_and_2.py:245 asserts "gradient_predivide_factor != 1.0' "$work/bad_stderr" &&
    pass "stage 2: both keys in the one message" || fail "stage 2: predivide missing: $(cat "$work/bad_stderr")"
  # Stage 0 (DeepSpeedExamples' BERT configs: no zero_optimization, both keys): the engine's arithmetic.
  bad_case "DeepSpeed's engine then multiplies each rank's gradient by 1 / N before the sum over the ranks (engine.py:2565-2567, allreduce_bucket; gradient_predivide_factor is then not read)" \
    --config "$work/gap_scaled2.json" "${one_layer[@]}" --steps 1 --stage 0
  echo "{$batch, \"gradient_predivide_factor\": 8}" > "$work/gap_predivide0.json"
  bad_case "DeepSpeed's engine then multiplies each rank's gradient by 1 / 8 before the sum over the ranks and the sum by 8 / N after (engine.py:2557-2564" \
    --config "$work/gap_predivide0.json" "${one_layer[@]}" --steps 1
  echo "{$batch, \"optimizer\": {\"type\": \"SGD\", \"params\": {\"lr\": 0.1}}, \"zero_allow_untested_optimizer\": true}" \
    > "$work/gap_sgd.json"
  ds_refused "$work/gap_sgd.json" 1 "another update rule (a momentum buffer, no second moment)"
  # Hjson: the hint where hjson reads the file, not where it fails too; a byte that is not UTF-8 escaped.
  printf '{"train_micro_batch_size_per_gpu": 4,}\n' > "$work/gap_trailing_comma.json"
  printf '{"train_micro_batch_size_per_gpu": 4},\n' > "$work/gap_trailing_root.json"
  printf '{"train_micro_batch_size_per_gpu": 4, "a\xff": 1}\n' > "$work/gap_latin1.json"
  bad_case "DeepSpeed reads configs as Hjson, which forgives" --config "$work/gap_trailing_comma.json" "${one_layer[@]}"
  bad_case "is not valid JSON" --config "$work/gap_trailing_root.json" "${one_layer[@]}"
  grep -q Hjson "$work/bad_stderr" && fail "a trailing '},' (hjson: Extra data) got the Hjson hint" ||
    pass "a trailing '},' after the root: no Hjson hint"
  bad_case 'is not UTF-8 text: the byte \xff at offset 40' --config "$work/gap_latin1.json" "${one_layer[@]}"
  LC_ALL=C grep -q $'\xff' "$work/bad_stderr" && fail "the raw byte reached the terminal" ||
    pass "the byte that is not UTF-8 is shown escaped, never raw"
}

quick real_configs
all ignored_key_warnings
all header_sources
all no_config
all left_out_defaults
all refused_real_configs
all public_zero2_configs
all many_keys
all feature_keys
all scheduler_names
all ignored_keys
all deepspeed_rates
all other_schedulers
all betas_reach_adamw
all one_cycle_header_resume
all bad_schedule_params
all trainer_schedule
all longer_resume
all old_checkpoint
all bias_correction
all off_values
all loggers
all several_hosts
all config_gaps
finish
