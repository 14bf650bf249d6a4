#!/usr/bin/env bash
# tests/peers/check_peer.sh PEER [BUILD_DIR] — another implementation checked against zero2 through a trace
# (notes/12), as `make check-peer PEER=...` runs it:
#
#   torch      zero2's trace (N = 2, fp32, stage 2, 20 steps) replayed by tests/peers/torch_peer.py on
#              Debian's torch 1.13 in .venv-hf: PyTorch's own ZeRO (DDP + ZeroRedundancyOptimizer) and zero2's
#              step written in torch.distributed (--step flat) pass tests/check_trace.py, on that trace and on
#              one of BERT-mini's default size (4 steps); each planted mistake
#              (tests/lab_mistakes/torch-step.*.py) fails it, and its diagnosis has the words of the mistake's
#              "# expect:" line. In CI. Without .venv-hf (no PyPI): SKIP, with the reason.
#   deepspeed  zero2's trace of the default BERT-mini (N = 2, fp32, stage 2, dropout 0, 20 steps) replayed by
#              DeepSpeed's ZeRO-2 (tests/peers/deepspeed_peer.py) passes tests/check_trace.py; the same with
#              the optimizer offloaded on both sides (ZeRO-Offload, notes/13), and in bf16; then zero2 and
#              DeepSpeed side by side (tests/peers/side_by_side.sh: tokens/s, memory, bytes sent, a few
#              minutes), and ZeRO-Offload's host AdamW beside DeepSpeedCPUAdam (measurements/host_adam.sh,
#              2 minutes). Runs in .venv-deepspeed, made here from PyPI when missing (torch 2.5.1, deepspeed
#              0.16.9, transformers 4.46.3: 5.3 GB; DEEPSPEED_VENV=DIR uses another). Not in CI. Without
#              PyPI: SKIP, with the reason.
#   fsdp       zero2's traces replayed by PyTorch's FSDP (tests/peers/fsdp_peer.py): FSDP1 (SHARD_GRAD_OP) and
#              FSDP2 (fully_shard, gloo's AVG-that-sums divided out) each pass tests/check_trace.py on the small
#              trace (N = 2, 20 steps) and on BERT-mini's default size (4 steps), in fp32 and in bf16 (FSDP's
#              mixed precision over an fp32 master), and FSDP1 on 120-step traces in fp32 and bf16; FSDP2 without the AVG workaround fails, diagnosed "summed
#              over the 2 ranks". Runs in .venv-fsdp, made here from PyPI when missing (torch 2.7.1,
#              transformers 4.46.3: 5.3 GB; FSDP_VENV=DIR uses another). Not in CI. Without PyPI: SKIP, with
#              the reason.
#   large      a model of 25.9M parameters (8 layers, hidden 512), fp32 and bf16, 3 steps: zero2 --portable,
#              the torch peer (fp32) and, where .venv-fsdp is made, FSDP1 and FSDP2 all pass. Not in CI
#              (about 5 minutes).
#
# Ends with a conformance table (every verdict: a correct peer's closest call, a planted mistake's margin and
# whether it was named) and "N passed, M failed" (a SKIP counts in neither).
set -u
cd "$(dirname "$0")/../.."
peer=${1:-}
build=${2:-build}
trainer="$build/train_bert_mini"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
passed=0
failed=0
pass() { echo "PASS $*"; passed=$((passed + 1)); }
fail() { echo "FAIL $*"; failed=$((failed + 1)); }
work=$(mktemp -d /tmp/z2_peer.XXXXXX)
trap 'rm -rf "$work"' EXIT

make_reference() {  # make_reference DIR [FLAGS...]: zero2's trace at N = 2 (tests/peers/reference_trace.sh)
  local dir=$1
  shift
  tests/peers/reference_trace.sh "$trainer" "$dir" 2 "$@" > "$work/reference.log" 2>&1 || { cat "$work/reference.log"; return 1; }
}

# make_default_reference DIR [FLAGS...]: the same at BERT-mini's default sizes (L 4, H 256, B 8, T 128: Psi =
# 3.4M), 4 steps kept every 2, with its twin as reference_trace.sh makes it.
make_default_reference() {
  local dir=$1
  shift
  make_reference "$dir" --layers 4 --hidden 256 --heads 4 --intermediate 1024 --seq 128 --micro-batch 8 \
    --bucket 524288 --steps 4 --trace-params-every 2 "$@"
}

# check LABEL EXPECT REF THEIRS: tests/check_trace.py's verdict. EXPECT "agrees", or the words the
# diagnosis must hold.
#
# Each verdict is also a row of the conformance table printed at the end (conformance_table): a correct peer's
# closest call, a planted mistake's first failing check, its margin and whether it was named.
check() {
  local label=$1 expect=$2 status at margin named
  /usr/bin/python3 tests/check_trace.py "$3" "$4" ${CHECK_FLAGS:-} > "$work/check.log" 2>&1
  status=$?
  at=$(grep '^FAIL' "$work/check.log" | cut -c6- | cut -d: -f1 | cut -d';' -f1)
  margin=$(sed -n 's/^margin: the difference is \([^ ]*\) x its allowance.*/\1/p' "$work/check.log")
  if [ "$expect" = agrees ]; then
    printf 'correct\t%s\t%s\t%s\t%s\n' "$label" \
      "$(sed -n 's/.*the closest call: step [0-9]*, \([0-9.]*\) of the allowance.*/\1/p' "$work/check.log")" \
      "$(sed -n 's/.*the closest call: \(step [0-9]*\),.*/\1/p' "$work/check.log")" "$status" >> "$work/conformance.tsv"
    if [ $status = 0 ]; then pass "$label: $(grep '^PASS' "$work/check.log" | sed 's/^PASS: //')"
    else fail "$label: the checker says (exit $status):"; tail -n 4 "$work/check.log"; fi
  elif [ $status = 1 ] && grep '^diagnosis:' "$work/check.log" | grep -qF "$expect"; then
    # the class the checker's "named:" (or "fits:") line gives, beside "yes"
    named=$(sed -n 's/^named: \(.*\)/\1/p; s/^fits: \([^(]*\) (.*/fits: \1/p' "$work/check.log")
    printf 'mistake\t%s\t%s\t%s\tyes (%s)\n' "$label" "$margin" "$at" "${named% }" >> "$work/conformance.tsv"
    pass "$label: fails at $at (${margin} x the allowance), diagnosed \"$expect\""
  else
    printf 'mistake\t%s\t%s\t%s\t%s\n' "$label" "${margin:-inf}" "${at:-exit $status}" \
      "$([ $status = 1 ] && echo no || echo "not failed")" >> "$work/conformance.tsv"
    fail "$label: expected a failure diagnosed \"$expect\"; the checker says (exit $status):"
    tail -n 4 "$work/check.log"
  fi
}

# conformance_table: the rows check() kept, as a table (notes/12 pastes it): the separation is the worst
# correct peer's closest call against the weakest mistake's margin, each as a multiple of its tolerance.
conformance_table() {
  [ -s "$work/conformance.tsv" ] || return 0
  /usr/bin/python3 - "$work/conformance.tsv" <<'PY'
import sys
import re
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1])]
correct = [r for r in rows if r[0] == "correct"]
mistakes = [r for r in rows if r[0] == "mistake"]
number = lambda text: float(text) if text not in ("", "inf") else float("inf")
# "step 1, gradient of NAME[i] (bucket b, rank r's shard at N = 2)" -> "step 1, gradients (bucket b, rank r)"
short = lambda where: re.sub(r", (gradient of )?\S+\[[^\]]*\] \((bucket \d+), (rank \d+)'s shard at N = \d+\)",
                             lambda m: f"{', gradients' if m.group(1) else ''} ({m.group(2)}, {m.group(3)})", where)
print("| implementation | verdict | closest call or margin (x the allowance) | where | named |")
print("|---|---|---|---|---|")
for _, label, closest, where, status in correct:
    print(f"| {label} | {'agrees' if status == '0' else 'FAILS (exit ' + status + ')'} | {closest or '-'} | {where} | |")
for _, label, margin, where, named in mistakes:
    print(f"| {label} | fails | {margin} | {short(where)} | {named} |")
if correct and mistakes:
    worst = max(correct, key=lambda r: number(r[2]) if r[4] == "0" else float("inf"))
    weakest = min(mistakes, key=lambda r: number(r[2]))
    named = sum(r[4].startswith("yes") for r in mistakes)
    print(f"\nseparation: the worst correct closest call {worst[2]} ({worst[1]}), the weakest mistake's margin "
          f"{weakest[2]} ({weakest[1]}): {number(weakest[2]) / max(number(worst[2]), 1e-9):.3g} x apart; "
          f"{named} of {len(mistakes)} mistakes named")
PY
}

check_torch() {
  local python=.venv-hf/bin/python
  if ! "$python" -c 'import torch, transformers' 2>/dev/null; then
    echo "SKIP: the torch peer needs .venv-hf (Debian's torch with transformers 4.39.3 from PyPI; make hf-venv), which"
    echo "      could not be made here: $(tail -n 1 .venv-hf.log 2>/dev/null || echo 'no .venv-hf.log')"
    return
  fi
  make_reference "$work/ref" || { fail "zero2's reference trace could not be made"; return; }
  local peer=(tests/peers/torch_peer.py --nproc-per-node 2)
  for step in zero-redundancy flat; do
    rm -rf "$work/theirs"
    if "$python" "${peer[@]}" --step "$step" "$work/ref" "$work/theirs" > "$work/peer.log" 2>&1; then
      check "torch peer --step $step (N = 2, fp32, 20 steps)" agrees "$work/ref" "$work/theirs"
    else
      fail "torch peer --step $step did not run:"; tail -n 5 "$work/peer.log"
    fi
  done
  # A long trace: 120 steps, kept every 10 (a correct peer's distance grows with the steps; the allowances
  # grow with the twin's, notes/12, "Allowances from legitimate rounding"). About 15 s.
  if make_reference "$work/ref_long" --steps 120 --trace-params-every 10; then
    rm -rf "$work/theirs"
    if "$python" "${peer[@]}" --step zero-redundancy "$work/ref_long" "$work/theirs" > "$work/peer.log" 2>&1; then
      check "torch peer --step zero-redundancy (120 steps, N = 2, fp32)" agrees "$work/ref_long" "$work/theirs"
    else
      fail "torch peer on the 120-step trace did not run:"; tail -n 5 "$work/peer.log"
    fi
  else
    fail "zero2's 120-step trace could not be made"
  fi
  # The same two at BERT-mini's default size (L 4, H 256, B 8, T 128: Psi = 3.4M, 4 steps, a few seconds):
  # where a norm tolerance that did not grow with the number of squares failed a correct peer (torch's
  # vector_norm is about 10 ulp off there; notes/12, "Tolerances").
  if make_default_reference "$work/ref_default"; then
    for step in zero-redundancy flat; do
      rm -rf "$work/theirs"
      if timeout 900 "$python" "${peer[@]}" --step "$step" "$work/ref_default" "$work/theirs" > "$work/peer.log" 2>&1; then
        check "torch peer --step $step (BERT-mini's default size, N = 2, fp32, 4 steps)" agrees "$work/ref_default" "$work/theirs"
      else
        fail "torch peer --step $step at the default size did not run:"; tail -n 5 "$work/peer.log"
      fi
    done
  else
    fail "zero2's trace at the default size could not be made:"; tail -n 5 "$work/reference.log"
  fi
  for mistake in tests/lab_mistakes/torch-step.*.py; do
    local name expect
    name=$(basename "$mistake" .py)
    expect=$(sed -n 's/^# expect: //p' "$mistake" | head -n 1)
    rm -rf "$work/theirs"
    if "$python" "${peer[@]}" --step flat --replace "$mistake" "$work/ref" "$work/theirs" > "$work/peer.log" 2>&1; then
      check "planted mistake ${name#torch-step.}" "$expect" "$work/ref" "$work/theirs"
    else
      fail "torch peer with $mistake did not run:"; tail -n 5 "$work/peer.log"
    fi
  done
  check_replayed_mistakes "$python"
}

# The mistakes an AdamW is written with, each planted by sed in a copy of torch_peer.py (its step, or the rate
# the replay hands it) and named by the checker's replay of the failing step (tests/peers/adamw_replay.py):
# on the same small model with every step kept (--trace-params-every 1), which the replay needs to recompute
# AdamW's state. Several of these fail only at step 2 or later (AdamW's first step is sign(g): betas and a
# clipping coefficient cancel in it), where the parameters before the step must be kept.
check_replayed_mistakes() {
  local python=$1 source=tests/peers/torch_peer.py
  make_reference "$work/ref_every" --trace-params-every 1 || { fail "zero2's trace with every step kept could not be made"; return; }
  rm -rf "$work/theirs"
  if "$python" "$source" --nproc-per-node 2 --step flat "$work/ref_every" "$work/theirs" > "$work/peer.log" 2>&1; then
    check "torch peer --step flat (every step kept, N = 2, fp32, 20 steps)" agrees "$work/ref_every" "$work/theirs"
  else
    fail "torch peer on the trace with every step kept did not run:"; tail -n 5 "$work/peer.log"
  fi
  # The naming on synthetic peers (each hypothesis's step replayed forward from zero2's gradients), fp32 and
  # bf16: which hypotheses fit, what the steps before and after tell, the "named:" line (tests/test_hypotheses.py).
  if make_reference "$work/ref_every_bf16" --trace-params-every 1 --precision bf16 &&
     /usr/bin/python3 tests/test_hypotheses.py "$work/ref_every" "$work/ref_every_bf16" > "$work/hypotheses.log" 2>&1; then
    pass "tests/test_hypotheses.py: $(tail -n 1 "$work/hypotheses.log")"
  else
    fail "tests/test_hypotheses.py:"; grep -v '^PASS' "$work/hypotheses.log" | tail -n 12
  fi
  # plant NAME EXPECT SED_ARGS...: the copy must differ (a sed that no longer matches the peer plants nothing,
  # and a correct peer would then fail this test for the wrong reason: say so instead).
  plant() {
    local name=$1 expect=$2 copy=$work/torch_peer.$1.py ref=${plant_ref:-$work/ref_every} kept="every step kept"
    shift 2
    [ "$ref" = "$work/ref_every" ] || kept="steps 1, 5, 10, 15, 20 kept"
    sed "$@" "$source" > "$copy"
    if cmp -s "$source" "$copy"; then fail "planted mistake $name: the sed no longer changes $source"; return; fi
    rm -rf "$work/theirs"
    # The copy lives in $work: trace_files.py comes from tests/peers through PYTHONPATH.
    if PYTHONPATH=tests/peers "$python" "$copy" --nproc-per-node 2 --step flat "$ref" "$work/theirs" \
         > "$work/peer.log" 2>&1; then
      check "planted mistake $name ($kept)" "$expect" "$ref" "$work/theirs"
    else
      fail "torch peer with the planted mistake $name did not run:"; tail -n 5 "$work/peer.log"
    fi
  }
  local denominator='denominator = (layout.exp_avg_sq.sqrt() / math.sqrt(1 - beta2 \*\* step))'
  local clipped='clipped = grad \* min(1.0, clip / (norm + 1e-6)) if clip > 0 else grad'
  plant l2-decay "L2-style weight decay" \
    -e 's/^\(    layout.exp_avg.mul_(beta1)\)/    clipped = clipped + settings["weight_decay"] * layout.decay * params\n\1/' \
    -e '/params.mul_(1 - lr \* settings\["weight_decay"\]/d'
  # (the colon: the next variant's name begins with this one's)
  plant eps-inside "eps inside the square root:" \
    -e "s|$denominator.add_(settings\[\"eps\"\])|denominator = (layout.exp_avg_sq / (1 - beta2 ** step) + settings[\"eps\"]).sqrt()|"
  plant eps-inside-before-correction "eps inside the square root, before the bias correction" \
    -e "s|$denominator.add_(settings\[\"eps\"\])|denominator = (layout.exp_avg_sq + settings[\"eps\"]).sqrt() / math.sqrt(1 - beta2 ** step)|"
  plant no-bias-correction-m "AdamW without the bias correction of m" -e 's|value=-lr / (1 - beta1 \*\* step))|value=-lr)|'
  plant no-bias-correction-v "AdamW without the bias correction of v" -e "s|$denominator|denominator = (layout.exp_avg_sq.sqrt())|"
  plant no-bias-correction "AdamW without its bias corrections" -e 's|value=-lr / (1 - beta1 \*\* step))|value=-lr)|' \
    -e "s|$denominator|denominator = (layout.exp_avg_sq.sqrt())|"
  plant betas-swapped "beta1 and beta2 swapped" -e 's|    beta1, beta2 = settings\["betas"\]|    beta2, beta1 = settings["betas"]|'
  plant lr-of-the-step-before "the rate of the step before" \
    -e 's|norm = stepper.step(lr, step)|norm = stepper.step(reference.steps[max(step - 2, 0)]["lr"], step)|'
  plant lr-of-the-step-after "the rate of the step after" \
    -e 's|norm = stepper.step(lr, step)|norm = stepper.step(reference.steps[min(step, len(reference.steps) - 1)]["lr"], step)|'
  plant no-clipping "no gradient clipping" -e "s|$clipped|clipped = grad|"
  # Named by a hypothesis of tests/peers/adamw_replay.py that a pattern once pre-empted or none named: each
  # named alone where the steps after the failing one tell it from the others that fit there.
  local decay_line='params.mul_(1 - lr \* settings\["weight_decay"\] \* layout.decay)'
  plant lr-times-2 "the learning rate scaled (lr x 2 (= N, the number of ranks))" \
    -e 's|norm = stepper.step(lr, step)|norm = stepper.step(2 * lr, step)|'
  # Where step 2 is not kept, lr x 2 and the rate of the step after are one rate at step 1 (a linear warmup
  # doubles it at step 2): both are said, and that step 2 would tell them apart.
  plant_ref=$work/ref plant lr-times-2 "the rate of the step after and the learning rate scaled (lr x 2" \
    -e 's|norm = stepper.step(lr, step)|norm = stepper.step(2 * lr, step)|'
  plant no-weight-decay "no weight decay:" -e "s|$decay_line|pass|"
  plant eps-1e-6 "another eps (eps 1e-06" -e 's|.add_(settings\["eps"\])|.add_(1e-6)|'
  plant state-reset-each-step "the optimizer's state reset every step" \
    -e 's|^\(    layout.exp_avg.mul_(beta1)\)|    layout.exp_avg.zero_(); layout.exp_avg_sq.zero_()\n\1|'
  plant counter-one-ahead "the step counter one ahead" \
    -e 's|beta2 \*\* step|beta2 ** (step + 1)|' -e 's|beta1 \*\* step|beta1 ** (step + 1)|'
  plant clip-per-group "clipping each parameter group by its own norm" \
    -e "s|$clipped|gd = (grad * grad * layout.decay).sum(); gn = (grad * grad).sum() - gd; dist.all_reduce(gd); dist.all_reduce(gn)\n    clipped = grad * (min(1.0, clip / (gd.sqrt().item() + 1e-6)) * layout.decay + min(1.0, clip / (gn.sqrt().item() + 1e-6)) * (1 - layout.decay))|"
  plant decay-without-lr "weight decay without the rate" \
    -e "s|$decay_line|params.mul_(1 - settings[\"weight_decay\"] * layout.decay)|"
  plant warmup-from-zero "the warmup counted from 0" \
    -e 's|norm = stepper.step(lr, step)|norm = stepper.step(reference.steps[step - 2]["lr"] if step > 1 else 0.0, step)|'
  plant clip-by-local-norm "clipping by each rank's own shard's norm" \
    -e "s|$clipped|clipped = grad * min(1.0, clip / (grad.norm().item() + 1e-6)) if clip > 0 else grad|"
  # The mistakes of the reduction, each confined to a bucket, a rank or a step after the first: the checker
  # compares the gradients bucket by bucket and rank by rank before the loss and the norm, so each is named
  # where it lies (notes/12, "Where first").
  local reduced='^        own.append(summed / N)$'
  plant last-bucket-zero "in bucket 6 of 7 (cls.predictions.transform.dense.weight ... cls.predictions.bias) on every rank, while the other buckets agree, theirs' gradients are zero" \
    -e "s|$reduced|        own.append(summed / N if b is not layout.buckets[-1] else torch.zeros_like(summed))|"
  plant last-bucket-local "what one rank's own micro-batches give alone (their part of the sum, divided by N)" \
    -e "s|$reduced|        own.append(summed / N if b is not layout.buckets[-1] else bucket.view(N, -1)[r] / N)|"
  plant norm-before-averaging "the norm was computed before dividing by N" \
    -e 's|^    squares = (grad \* grad).sum()$|    squares = ((grad * N) * (grad * N)).sum()|'
  # Rank 0 takes back only its own shards from step 3's all-gather: its copy of rank 1's shards stays stale.
  plant rank-skips-all-gather-at-step-3 "the shards of rank(s) [1] (every bucket) still hold their values from before this step" \
    -e 's|^        layout.params\[b\["offset"\]:b\["offset"\] + b\["padded_length"\]\] = torch.cat(shards)$|        if step == 3 and r == 0:\n            layout.params[b["offset"]:b["offset"] + b["shard_length"]] = shards[0]\n        else:\n            layout.params[b["offset"]:b["offset"] + b["padded_length"]] = torch.cat(shards)|'
  # With A = 3 micro-steps (N = 2, so a factor names which): each micro-batch's loss divided by A again.
  make_reference "$work/ref_every" --trace-params-every 1 --steps 6 --accum 3 ||
    { fail "zero2's trace with A = 3 could not be made"; return; }
  plant loss-over-A "= 1 / A: the loss is scaled by the number of micro-steps" \
    -e 's|^\(            part = loss_of(logits, labels\[rows\], selected, N)\)$|\1 / A|'
  plant not-averaged-at-A-3 "= N: the gradients were summed over the 2 ranks, not averaged" \
    -e 's|^        own.append(summed / N)$|        own.append(summed)|'
  # The bias corrections counting micro-steps (t A, A = 3 here), and a gradient buffer each micro-step
  # overwrites (the last micro-step's part alone: measured, a slope of 1 / A).
  plant counter-micro-steps "the step counter counting micro-steps" \
    -e 's|beta2 \*\* step|beta2 ** (3 * step)|' -e 's|beta1 \*\* step|beta1 ** (3 * step)|'
  plant accumulation-overwrites "each micro-step's gradient replaced the buffer instead of adding to it" \
    -e 's|^\(            logits = stepper.forward(input_ids=input_ids\[rows\]).logits.float()\)$|            for p in stepper.model.parameters(): p.grad = None\n\1|'
  # A forward pass that differs (ReLU for BERT's GELU): the gradients differ everywhere with scatter, as a
  # reduction that never ran would make them, but the loss differs too, which points to the forward pass.
  plant forward-relu "from the same weights and the same batch the loss differs, so the forward pass or the loss does" \
    -e 's|^\(                                            attention_probs_dropout_prob=0.0\))$|\1, hidden_act="relu")|'
  # DeepSpeed's OneCycle sets Adam's betas every update (beta1 cycles, beta2 0.99): the trace records them
  # (steps[].betas), the peers set them, and a peer that keeps the optimizer's fixed betas is named.
  echo '{"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "scheduler": {"type": "OneCycle", "params":
    {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 3, "cycle_second_step_size": 2,
     "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.01}}}' > "$work/one_cycle.json"
  make_reference "$work/ref_every" --trace-params-every 1 --steps 8 --config "$work/one_cycle.json" ||
    { fail "zero2's trace with DeepSpeed's OneCycle could not be made"; return; }
  local step
  for step in zero-redundancy flat; do
    rm -rf "$work/theirs"
    if "$python" "$source" --nproc-per-node 2 --step "$step" "$work/ref_every" "$work/theirs" > "$work/peer.log" 2>&1; then
      check "torch peer --step $step (OneCycle: betas per update, N = 2, fp32, 8 steps)" agrees "$work/ref_every" \
        "$work/theirs"
    else
      fail "torch peer --step $step on the OneCycle trace did not run:"; tail -n 5 "$work/peer.log"
    fi
  done
  plant fixed-betas-under-OneCycle "the optimizer's betas, not the scheduler's" \
    -e '/^        stepper.betas = reference.steps\[step - 1\].get("betas")/d'
}

# pinned_venv DIR WHAT CHECK INSTALL...: DIR made from PyPI unless its python already passes CHECK (a snippet
# asserting the pinned versions); each INSTALL is one pip install's arguments, in order; WHAT names the versions.
pinned_venv() {
  local venv=$1 what=$2 check=$3 python=$1/bin/python install
  shift 3
  "$python" -c "$check" >/dev/null 2>&1 && return 0
  rm -rf "$venv"
  echo "making $venv: $what from PyPI (5.3 GB; minutes)"
  /usr/bin/python3 -m venv "$venv" >"$venv.log" 2>&1 || { rm -rf "$venv"; return 1; }
  for install in "$@"; do
    # shellcheck disable=SC2086  # one install's arguments, split on purpose
    timeout 1800 "$python" -m pip install --disable-pip-version-check $install >>"$venv.log" 2>&1 ||
      { rm -rf "$venv"; return 1; }
  done
}

# DeepSpeed's venv: the pinned versions from PyPI, made once. DeepSpeed's setup.py imports torch, so it is
# built against the venv's own torch (--no-build-isolation) after torch and transformers are in.
deepspeed_venv() {
  pinned_venv "$1" "torch 2.5.1, deepspeed 0.16.9, transformers 4.46.3" 'import torch, deepspeed, transformers
assert (torch.__version__.split("+")[0], deepspeed.__version__, transformers.__version__) == ("2.5.1", "0.16.9", "4.46.3")' \
    "torch==2.5.1 transformers==4.46.3" "--no-build-isolation deepspeed==0.16.9"
}

check_deepspeed() {
  local venv=${DEEPSPEED_VENV:-.venv-deepspeed}
  if ! deepspeed_venv "$venv"; then
    echo "SKIP: the DeepSpeed peer needs $venv (torch, deepspeed and transformers from PyPI), which could not be"
    echo "      made here: $(tail -n 1 "$venv.log" 2>/dev/null || echo "no $venv.log")"
    return
  fi
  # The default BERT-mini, as make run trains it, but dropout 0 (zero2's masks are its own) and 20 steps; the
  # parameters and gradients after steps 1, 10 and 20. About 20 s on two cores.
  rm -rf "$work/ref"
  if ! timeout 600 mpirun -n 2 "$trainer" --stage 2 --precision fp32 --dropout 0 --steps 20 --trace-params-every 10 \
         --quiet --trace "$work/ref" >"$work/reference.log" 2>&1; then
    fail "zero2's reference trace could not be made:"; tail -n 5 "$work/reference.log"; return
  fi
  # DeepSpeed builds its CPU shared-memory op (deepspeed_shm_comm) on first use: a minute, once per venv.
  if "$venv/bin/python" tests/peers/deepspeed_peer.py "$work/ref" "$work/theirs" >"$work/peer.log" 2>&1; then
    CHECK_FLAGS=--every-step check "DeepSpeed ZeRO-2 peer (BERT-mini, N = 2, fp32, 20 steps)" agrees "$work/ref" "$work/theirs"
    echo "--- the checker, step by step (tests/check_trace.py REF THEIRS --every-step)"
    sed "s|$work/||g" "$work/check.log"
    echo "---"
  else
    fail "the DeepSpeed peer did not run:"; grep -v '^\[' "$work/peer.log" | tail -n 5
  fi
  # bf16 (DeepSpeed's bf16 over ZeRO-2's fp32 partition; notes/08), the same run otherwise. About 30 s.
  rm -rf "$work/ref" "$work/theirs"
  if timeout 600 mpirun -n 2 "$trainer" --stage 2 --precision bf16 --dropout 0 --steps 20 --trace-params-every 10 \
       --quiet --trace "$work/ref" >"$work/reference.log" 2>&1 &&
     "$venv/bin/python" tests/peers/deepspeed_peer.py "$work/ref" "$work/theirs" >"$work/peer.log" 2>&1; then
    check "DeepSpeed ZeRO-2 peer (BERT-mini, N = 2, bf16, 20 steps)" agrees "$work/ref" "$work/theirs"
  else
    fail "the DeepSpeed bf16 replay did not run:"; grep -v '^\[' "$work/reference.log" "$work/peer.log" | tail -n 5
  fi
  # ZeRO-Offload both sides (notes/13): zero2's --offload-optimizer cpu against DeepSpeed's offload_optimizer
  # device cpu (its fp32 partition and torch's AdamW on the host), the same run otherwise. About 40 s.
  rm -rf "$work/ref" "$work/theirs"
  if timeout 600 mpirun -n 2 "$trainer" --stage 2 --precision fp32 --dropout 0 --steps 20 --trace-params-every 10 \
       --offload-optimizer cpu --quiet --trace "$work/ref" >"$work/reference.log" 2>&1 &&
     "$venv/bin/python" tests/peers/deepspeed_peer.py "$work/ref" "$work/theirs" >"$work/peer.log" 2>&1 &&
     grep -q "the optimizer offloaded to the CPU" "$work/peer.log"; then
    check "DeepSpeed ZeRO-Offload peer (offload_optimizer cpu; BERT-mini, N = 2, fp32, 20 steps)" agrees "$work/ref" \
      "$work/theirs"
  else
    fail "the ZeRO-Offload replay did not run:"; grep -v '^\[' "$work/reference.log" "$work/peer.log" | tail -n 5
  fi
  # DeepSpeed's own schedulers choose the rates (deepspeed_peer.py --scheduler): zero2's OneCycle, with its
  # beta1 cycle, and LRRangeTest against DeepSpeed's, rates and parameters at every step (the small model, 8
  # steps, every step kept). WarmupCosineLR is not here: DeepSpeed's sets update 1's rate to 0 in the first
  # parameter group only (lr_schedules.py update_lr zips the groups with get_lr's [0.0]), so with the decay
  # and no-decay groups its biases and LayerNorm weights step at the full rate there (notes/07).
  local schedule name
  for schedule in '"OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 3,
      "cycle_second_step_size": 2, "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.01}' \
    '"LRRangeTest", "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 2,
      "lr_range_test_step_rate": 3, "lr_range_test_staircase": true}'; do
    name=$(echo "$schedule" | head -n 1 | cut -d'"' -f2)
    echo "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 2e-3}}, \"scheduler\": {\"type\": $schedule}}" \
      > "$work/$name.json"
    rm -rf "$work/theirs"
    if make_reference "$work/ref" --steps 8 --trace-params-every 1 --config "$work/$name.json" &&
       "$venv/bin/python" tests/peers/deepspeed_peer.py --scheduler "$work/ref" "$work/theirs" >"$work/peer.log" 2>&1; then
      check "DeepSpeed's own $name sets the rates (and betas) of its ZeRO-2 (N = 2, fp32, 8 steps)" agrees \
        "$work/ref" "$work/theirs"
    else
      fail "the DeepSpeed replay with its own $name did not run:"; grep -v '^\[' "$work/peer.log" | tail -n 5
    fi
  done
  echo
  DEEPSPEED_VENV=$venv tests/peers/side_by_side.sh "$build" || fail "tests/peers/side_by_side.sh did not finish"
  # ZeRO-Offload's host AdamW beside DeepSpeedCPUAdam (figures, not checks; build-cpu's, the host code).
  echo
  if make --no-print-directory -j2 build-cpu/host_adam_bench build-cpu/train_bert_mini >"$work/make.log" 2>&1; then
    DEEPSPEED_VENV=$venv measurements/host_adam.sh build-cpu || fail "measurements/host_adam.sh did not finish"
  else
    fail "build-cpu/host_adam_bench did not build: $(tail -n 3 "$work/make.log")"
  fi
}

# FSDP's venv: the pinned versions from PyPI, made once. torch 2.7.1 because FSDP2 runs on the CPU from there
# (an earlier trial: 2.5.1 says "FSDP requires CUDA for streams", 2.6.0 fails in foreach_all_gather); FSDP1
# runs on it too.
# PyPI's torch is the CUDA build (the CPU wheels' index, download.pytorch.org, may not be reachable where PyPI
# is); it runs on the CPU all the same.
fsdp_venv() {
  pinned_venv "$1" "torch 2.7.1, transformers 4.46.3" 'import torch, transformers
assert (torch.__version__.split("+")[0], transformers.__version__) == ("2.7.1", "4.46.3")' \
    "torch==2.7.1 transformers==4.46.3"
}

check_fsdp() {
  local venv=${FSDP_VENV:-.venv-fsdp}
  if ! fsdp_venv "$venv"; then
    echo "SKIP: the FSDP peer needs $venv (torch 2.7.1 and transformers 4.46.3 from PyPI), which could not be made"
    echo "      here: $(tail -n 1 "$venv.log" 2>/dev/null || echo "no $venv.log")"
    return
  fi
  local python=$venv/bin/python peer=(tests/peers/fsdp_peer.py --nproc-per-node 2)
  # The small trace (reference_trace.sh, 20 steps) and BERT-mini's default size (4 steps, as check_torch), in
  # fp32 and bf16: a few seconds each.
  make_reference "$work/ref" || { fail "zero2's reference trace could not be made"; return; }
  make_reference "$work/ref_bf16" --precision bf16 || { fail "zero2's bf16 reference trace could not be made"; return; }
  local precision
  for precision in fp32 bf16; do
    make_default_reference "$work/ref_default_$precision" --precision "$precision" ||
      { fail "zero2's $precision trace at the default size could not be made"; return; }
    # The long runs: 120 steps kept every 10, where the trial's FSDP1 failed correct runs (fp32 at step 92 on
    # the norm, bf16 at step 1 because a later step changed which tensors were noise). About 20 s each.
    make_reference "$work/ref_long_$precision" --steps 120 --trace-params-every 10 --precision "$precision" ||
      { fail "zero2's 120-step $precision trace could not be made"; return; }
  done
  local fsdp ref label
  for fsdp in 1 2; do
    for ref in ref "ref_bf16" ref_default_fp32 ref_default_bf16 ref_long_fp32 ref_long_bf16; do
      [ "$fsdp" = 2 ] && [[ $ref == ref_long_* ]] && continue  # the long runs: FSDP1, as the trial's
      case $ref in
        ref) label="N = 2, fp32, 20 steps" ;;
        ref_bf16) label="N = 2, bf16, 20 steps" ;;
        ref_long_fp32) label="N = 2, fp32, 120 steps" ;;
        ref_long_bf16) label="N = 2, bf16, 120 steps" ;;
        ref_default_fp32) label="BERT-mini's default size, N = 2, fp32, 4 steps" ;;
        ref_default_bf16) label="BERT-mini's default size, N = 2, bf16, 4 steps" ;;
      esac
      rm -rf "$work/theirs"
      if timeout 900 "$python" "${peer[@]}" --fsdp "$fsdp" "$work/$ref" "$work/theirs" > "$work/peer.log" 2>&1; then
        check "FSDP$fsdp peer ($label)" agrees "$work/$ref" "$work/theirs"
      else
        fail "FSDP$fsdp peer on $ref did not run:"; tail -n 5 "$work/peer.log"
      fi
    done
  done
  # gloo's reduce_scatter_tensor in torch 2.7.1 sums when asked to average: FSDP2 left with it reports twice
  # zero2's gradients, and the checker must say so.
  rm -rf "$work/theirs"
  if timeout 900 "$python" "${peer[@]}" --fsdp 2 --no-avg-workaround "$work/ref" "$work/theirs" > "$work/peer.log" 2>&1; then
    check "FSDP2 peer without the AVG workaround (gloo sums; N = 2, fp32)" "summed over the 2 ranks" "$work/ref" \
      "$work/theirs"
  else
    fail "FSDP2 peer --no-avg-workaround did not run:"; tail -n 5 "$work/peer.log"
  fi
}

# A model of 25.9M parameters (8 layers, hidden 512, intermediate 2048; 7.5x BERT-mini's default): every
# correct implementation at hand, fp32 and bf16, 3 steps all kept. The tolerances grow with the reductions
# they cover (notes/12, "Tolerances"); this is where a tolerance that did not would fail a correct peer.
# About 30 s a run on two cores; the FSDP peers where .venv-fsdp is already made (PEER=fsdp makes it).
check_large() {
  local flags=(--layers 8 --hidden 512 --heads 8 --intermediate 2048 --dropout 0 --steps 3 --trace-params-every 1)
  local precision label
  for precision in fp32 bf16; do
    label="25.9M parameters, N = 2, $precision, 3 steps"
    rm -rf "$work/large_$precision" "$work/theirs"
    if ! timeout 1200 mpirun -n 2 "$trainer" "${flags[@]}" --precision "$precision" --quiet \
           --trace "$work/large_$precision" > "$work/reference.log" 2>&1; then
      fail "zero2's $precision trace of the large model could not be made:"; tail -n 5 "$work/reference.log"; return
    fi
    if timeout 1200 mpirun -n 2 "$trainer" "${flags[@]}" --precision "$precision" --portable --quiet \
         --trace "$work/theirs" > "$work/peer.log" 2>&1; then
      check "zero2 --portable, its own gemm ($label)" agrees "$work/large_$precision" "$work/theirs"
    else
      fail "zero2 --portable on the large model did not run:"; tail -n 5 "$work/peer.log"
    fi
    if [ "$precision" = fp32 ] && .venv-hf/bin/python -c 'import torch, transformers' 2>/dev/null; then
      rm -rf "$work/theirs"
      if timeout 1800 .venv-hf/bin/python tests/peers/torch_peer.py --nproc-per-node 2 --step zero-redundancy \
           "$work/large_$precision" "$work/theirs" > "$work/peer.log" 2>&1; then
        check "torch peer --step zero-redundancy ($label)" agrees "$work/large_$precision" "$work/theirs"
      else
        fail "the torch peer on the large model did not run:"; tail -n 5 "$work/peer.log"
      fi
    fi
    local fsdp python=${FSDP_VENV:-.venv-fsdp}/bin/python
    if ! "$python" -c 'import torch, transformers' 2>/dev/null; then
      echo "SKIP the FSDP peers ($precision): no ${FSDP_VENV:-.venv-fsdp} (make check-peer PEER=fsdp makes it)"
      continue
    fi
    for fsdp in 1 2; do
      rm -rf "$work/theirs"
      if timeout 1800 "$python" tests/peers/fsdp_peer.py --nproc-per-node 2 --fsdp "$fsdp" "$work/large_$precision" \
           "$work/theirs" > "$work/peer.log" 2>&1; then
        check "FSDP$fsdp peer ($label)" agrees "$work/large_$precision" "$work/theirs"
      else
        fail "the FSDP$fsdp peer on the large model did not run:"; tail -n 5 "$work/peer.log"
      fi
    done
  done
}

case $peer in
  torch) check_torch ;;
  deepspeed) check_deepspeed ;;
  fsdp) check_fsdp ;;
  large) check_large ;;
  *) echo "check_peer.sh: PEER is torch, deepspeed, fsdp or large (make check-peer PEER=...)"; echo "0 passed, 1 failed"; exit 2 ;;
esac
echo "--- conformance"
conformance_table
echo "---"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
