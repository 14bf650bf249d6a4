#!/usr/bin/env bash
# tests/test_trainer.sh BUILD_DIR — the BERT-mini trainer through its real
# command line, as a user runs it:
#   1. the stage matrix: N = 1, 2, 4 (with A = 4/N, so the global batch is the
#      same 4 micro-batches) x stage 0/1/2 x overlap on/off: all 18 runs end
#      with the same final_params_hash and the same loss bits at every step;
#      --collectives native agrees within a tolerance;
#   2. the ledgers in the JSON summary against formulas recomputed here from
#      the model's sizes;
#   3. bad input: one clear message from rank 0, a non-zero exit, no crash, no
#      hang, no output file left behind;
#   4. the PyTorch reference (tests/torch_reference.py) on a dumped batch;
#   5. ZeRO-R: every --activations x --alloc (arena, naive, caching) in every (N, stage) of the matrix
#      gives the matrix's bits, with fresh activation buffers poisoned (NaN:
#      the trainer leaves them unzeroed, so it must write before it reads;
#      the 16-bit ZeRO-R runs of 6. are poisoned too); the offload bound computed here from the
#      config; the arena allocates nothing after step 1; naive and caching run
#      out of memory in a block the arena fits in, cleanly, on every rank;
#   6. mixed precision: in bf16 and in fp16 the stage matrix and ZeRO-R give
#      one hash per precision; the ledgers against 16 Psi, 4 Psi + 12 Psi/N,
#      2 Psi + 14 Psi/N and 2 bytes an element; an fp16 run forced to
#      overflow skips the same steps in every stage and N, with DeepSpeed's
#      scale trajectory recomputed here; bf16 and fp16 train as fp32 does
#      (within a margin); the 16-bit rounding against torch's; one bf16 and
#      one fp16 step against fp64 and torch.autocast; bad input;
#   7. reliability: every writer on a full disk at N = 1, 2, 4 (exit 2 on every
#      rank, nothing left), concurrent exports into one directory, outputs
#      naming inputs (the loaded checkpoint's files too), devices, FIFOs,
#      sockets and dangling symlinks as outputs (refused, left as they were),
#      a symlink followed to its file, paths that are not UTF-8, --metrics
#      appended on resume, FIFOs and devices as inputs, strict UTF-8, strict
#      config files (booleans, NUL, trailing bytes, duplicate keys, depth, large
#      integers), a seq too short to mask, gradients whose squares overflow,
#      a stopped rank ended by the watchdog, which names it, and ranks waiting
#      for different things (tests/watchdog_check.cpp), each named.
#   8. checkpoints: save at step 4, load, 4 more steps = 8 straight in every
#      precision, N and stage; reshard across (N, A, stage); an independent
#      reader; --load --steps 0 = the run's own export; --save-keep; damaged
#      checkpoints (one-bit flips of index.json, an impossible loss scale, a
#      latest that loops or holds a NUL) and contradicting flags refused; a
#      resume at another summation tree refused (or run with
#      --allow-different-bits); pruning leaves what is not this run's and
#      keeps the steps saved last; a second saver and a new run into another
#      run's checkpoints refused; a rank killed mid-save; a save killed
#      before latest was written or moved (--load DIR takes the step saved
#      last, says so, the same bits; not an abandoned higher step); a user's
#      file in a .step_K.incomplete refused before step 1; SIGTERM and SIGINT
#      stop, save and resume bit for bit.
#   9. DeepSpeed configs: the real ones in tests/ds_configs run or are refused
#      as their README says, every refused key named in one message; what
#      DeepSpeed 0.16.9 makes of the keys a file leaves out (stage 0, clip 0,
#      FusedAdam's or torch.optim.AdamW's weight decay, the loss scaler's two
#      sets of defaults) and where each setting came from (--json's
#      settings_origin, the header); keys DeepSpeed ignores warn (in the
#      header, on stderr with --quiet), near-misses and unknown keys of the
#      blocks it validates are refused, its features not here are named as
#      such; each step's rate against DeepSpeed's WarmupLR / WarmupDecayLR as
#      its engine steps them (log and linear, W < 2, past an fp16-skipped
#      step, a scheduler the flags add), the trainer's own schedule without
#      --config; --steps longer on resume, a checkpoint without the schedule's
#      convention; ranks (hosts) whose --data or --config differ are named;
#  10. the export through Hugging Face (tests/hf_roundtrip.py in .venv-hf):
#      AutoTokenizer gives the trainer's ids, AutoModelForMaskedLM the dumped
#      loss, pipeline("fill-mask") runs; SKIP (not a pass) without the venv;
#  11. --metrics: a line per progress line with the mean loss since the last
#      one; a killed run leaves whole lines; --eval-every: the held-out loss
#      has the same bits in every (N, A, stage), its frequency does not change
#      training, a resume continues it.
#  12. --plan: every category of the plan (model states, staging, accumulation,
#      activations, bookkeeping, the device peak and the arena's block)
#      against the measured ledger, to the byte, for every stage, precision
#      and activation mode at N = 1, 2, 4; the arena's block is the smallest
#      --device-memory-limit that trains (256 bytes less runs out); the
#      largest micro-batch and layer count for a limit trains, one more runs
#      out of memory with the allocator's message; bad input. The memory
#      check (notes/10) against ZERO2_MEMORY_LIMIT: a limit between the
#      plan's block and the need (plan + the host's copies) is refused on
#      every rank with nothing written, the need itself trains, and the
#      24-layer run that the OOM killer used to end gets the message.
#  13. portable mode (--portable, notes/11): the default mode's hash follows
#      the OpenBLAS kernel forced with OPENBLAS_CORETYPE, the portable hash
#      stays one under every kernel and a glibc feature mask, equals the
#      other build's, and the golden table (tests/verify.sh --all; a planted
#      wrong row is caught); the config key (= the flag under the same
#      config); the stage / N / ZeRO-R matrix in portable mode, fp32, bf16
#      and fp16.
#  14. traces (notes/12): every file of a --trace and every step's record are
#      the same bits at every stage and every (N, A) of one global batch; the
#      trace against --json, --export-hf and --dump-batch (read with numpy);
#      --init-hf starts from another run's weights bit for bit (fp32, bf16) and
#      refuses a wrong shape, a missing, unknown or untied tensor, F64, a
#      pickle, each named; tests/check_trace.py passes zero2 computed another
#      way (--portable) in fp32 and bf16, fails another learning rate, and
#      names the file and field of a bad trace (another version, contradicting
#      settings, missing steps, a record or a tensor missing, a truncated
#      file, NaN, an unfinished trace, a dropout reference).
#  15. ZeRO-Offload (--offload-optimizer cpu; a config's offload_optimizer or
#      cpu_offload): stage 1 and 2 x fp32 / bf16 / fp16 x overlap at N = 2, and
#      N = 1, 4, give the bits of the run without it (fp16: the same skipped
#      steps); checkpoints saved without it resume with it and the reverse;
#      the ledger's host bytes in --json = 16 Psi/N and the device's its
#      formula; the header; --plan's host bytes; bad input (stage 0 by flag
#      and by config, unknown and nvme devices, pin_memory, ratio, fast_init,
#      fp16_master_weights_and_grads, both spellings, no optimizer type: the
#      client's optimizer, which DeepSpeed refuses under offload), each named.
# Ends with the plain line "N passed, M failed".
#
# Z2_TRAINER_SKIP="9 10 ..." leaves those sections out (default: none). Only
# sections 9, 10, 11, 12, 14, 15 and the file and input checks of 7 can be left out;
# the rest always runs. `make test-cpu` leaves them out (the Makefile's
# TEST_CPU_SKIP): they test the trainer's writers, inputs, config, export,
# metrics and planning logic, the same source in both builds, which
# `make test` runs; and section 15, ZeRO-Offload through the command line
# (the engine's offloaded step runs in both builds' doctest suites:
# tests/test_offload.cpp). Section 7's numbers and watchdog checks always run.
set -u
build=${1:-build}
trainer="$build/train_bert_mini"
[ -x "$trainer" ] || { echo "no $trainer: build it first (make)"; echo "0 passed, 1 failed"; exit 1; }
export OPENBLAS_NUM_THREADS=1
PYTHON=/usr/bin/python3  # Debian's, which has python3-torch
work=$(mktemp -d /tmp/z2_trainer.XXXXXX)
trap 'rm -rf "$work"' EXIT
skipped=${Z2_TRAINER_SKIP:-}
wanted() { [[ " $skipped " != *" $1 "* ]]; }
[ -z "$skipped" ] || echo "=== sections $skipped left out (Z2_TRAINER_SKIP: they test the same source in every build)"
passed=0
failed=0
pass() { echo "PASS $*"; passed=$((passed + 1)); }
fail() { echo "FAIL $*"; failed=$((failed + 1)); }
# A small text file, for the sections that need --data (7, 8, 9, 11).
printf 'The quick brown fox jumps over the lazy dog. %.0s' $(seq 1 40) > "$work/corpus.txt"
# A small model that still has every part: 2 blocks, 2 heads, several buckets.
tiny=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2
      --steps 3 --warmup 1 --dropout 0.1 --clip 0.5 --bucket 3000 --quiet)
json_get() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }
# same_bits_run LABEL N OUT FLAGS...: train the tiny model on N ranks with
# FLAGS, its summary into OUT, and compare its final hash and every step's
# loss bits with $reference (the first run sets it, and says so).
same_bits_run() {
  local label=$1 ranks=$2 out=$3 bits
  shift 3
  if ! timeout 300 mpirun -n "$ranks" "$trainer" "${tiny[@]}" "$@" --json "$out" > "$work/log" 2>&1; then
    fail "$label: exit non-zero"; cat "$work/log"; return
  fi
  bits=$(json_get "$out" "d['final_params_hash'] + ' ' + ' '.join(s['loss_bits'] for s in d['steps'])")
  if [ -z "$bits" ]; then fail "$label: no hash in $out"; return; fi
  [ -z "$reference" ] && reference=$bits && reference_label=$label && echo "    reference ($label): $bits"
  # The claim each line proves: this run computes the reference run's bits (hash and every step's loss).
  if [ "$bits" = "$reference" ]; then pass "$label: the same bits as $reference_label"
  else fail "$label: $bits != $reference ($reference_label)"; fi
}

# --- 1. the stage matrix ---------------------------------------------------------
echo "=== stage matrix through the command line (N x stage x overlap, A = 4/N)"
reference=""
for N in 1 2 4; do
  A=$((4 / N))
  for stage in 0 1 2; do
    for overlap in 0 1; do
      same_bits_run "matrix N=$N A=$A stage=$stage overlap=$overlap" $N "$work/matrix_${N}_${stage}_${overlap}.json" \
        --accum $A --stage $stage --overlap $overlap
    done
  done
done
# The run must have trained: the loss moved (identical bits of a dead run would prove nothing).
first_last=$(json_get "$work/matrix_1_0_0.json" "str(d['steps'][0]['loss'] != d['steps'][-1]['loss'])")
[ "$first_last" = True ] && pass "matrix: the loss changes over the steps" || fail "matrix: the loss did not change"

# Micro-batches that select no position (seq 3: one byte per sample, selected
# 15% of the time; micro-batch 4 x 2 ranks selects 1.2 on average, the least
# the trainer accepts): the head's products have an empty sum (K = 0), which must
# give zero gradients on every backend. A step whose whole global batch
# selected nothing must report a gradient norm of exactly 0 (a stale buffer
# left by a gemm that skipped K = 0 would show here), and stages 0 and 2
# still agree bitwise.
empty=(--layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 3 --micro-batch 4 --steps 16 --warmup 1 --quiet)
for stage in 0 2; do
  timeout 300 mpirun -n 2 "$trainer" "${empty[@]}" --stage $stage --json "$work/empty_$stage.json" > "$work/log" 2>&1 ||
    { fail "empty micro-batches stage $stage: exit non-zero"; cat "$work/log"; }
done
verdict=$(python3 - "$work/empty_0.json" "$work/empty_2.json" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
zero = sum(1 for s in a['steps'] if s['loss'] == 0)
zero_norm = all(s['grad_norm'] == 0 for d in (a, b) for s in d['steps'] if s['loss'] == 0)
same = a['final_params_hash'] == b['final_params_hash'] and [s['loss_bits'] for s in a['steps']] == [s['loss_bits'] for s in b['steps']]
ok = same and zero_norm and 0 < zero < len(a['steps'])
print(("ok" if ok else "bad") + " %d of %d steps selected nothing, their gradient norms %s; hashes %s %s" % (zero, len(a['steps']), "all 0" if zero_norm else "NOT 0", a['final_params_hash'], b['final_params_hash']))
EOF
)
case "$verdict" in ok*) pass "empty micro-batches: stages 0 and 2 equal: $verdict";; *) fail "empty micro-batches: $verdict";; esac

# Native collectives (MPI_Reduce_scatter's own order): close, not bitwise.
# At N = 4: at N = 2 there is only one order of a + b. (For these small
# buckets MPICH's recursive halving may still pair ranks as our tree does and
# agree bitwise; the tolerance is all notes/06 promises.) Three steps of AdamW amplify a last-bit
# difference in the reduced gradient into ~1e-6 relative changes of the loss;
# 1e-4 leaves a wide margin while still catching a wrong sum (off by a factor
# N, a missing rank: > 10%).
if timeout 300 mpirun -n 4 "$trainer" "${tiny[@]}" --accum 1 --stage 2 --collectives native --json "$work/native.json" \
    > "$work/log" 2>&1; then
  verdict=$(python3 - "$work/native.json" "$work/matrix_4_2_1.json" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
worst = max(abs(x['loss'] - y['loss']) / abs(y['loss']) for x, y in zip(a['steps'], b['steps']))
print(("ok" if worst <= 1e-4 else "bad") + " worst relative loss difference %.2e" % worst)
EOF
)
  case "$verdict" in
    ok*) pass "native collectives agree with the deterministic bits within 1e-4 (notes/06): ${verdict#ok }";;
    *) fail "native collectives: $verdict";;
  esac
else
  fail "native collectives: exit non-zero"; cat "$work/log"
fi

# --- 2. ledgers against formulas from the config -----------------------------------
echo "=== ledgers in the JSON summary against formulas from the model's sizes"
for N in 1 2 4; do
  for stage in 0 1 2; do
    verdict=$(python3 - "$work/matrix_${N}_${stage}_1.json" $N $stage <<'EOF'
import json, sys
d = json.load(open(sys.argv[1])); N = int(sys.argv[2]); stage = int(sys.argv[3])
V, P, H, F, L, chunk = 260, 20, 32, 64, 2, 32           # the tiny model above; norm chunk 32
block = [H*H, H, H*H, H, H*H, H, H*H, H, H, H, F*H, F, H*F, H, H, H]
tensors = [V*H, P*H, H, H, H] + block * L + [H*H, H, H, H, V]
psi = sum(tensors)
problems = []
if d['params'] != psi: problems.append("params %d != %d" % (d['params'], psi))
# Padding: each tensor to a multiple of the chunk, each bucket to N chunks.
# The bucket grouping depends on --bucket, so we take Psi_padded from the
# summary and check the rules it must obey instead.
padded = d['params_padded']
aligned = sum((t + chunk - 1) // chunk * chunk for t in tensors)
if padded < aligned or padded % (N * chunk) or padded - aligned >= len(tensors) * N * chunk:
    problems.append("params_padded %d inconsistent with %d aligned" % (padded, aligned))
m = d['memory']
formula = {0: 16 * padded, 1: 8 * padded + 8 * padded // N, 2: 4 * padded + 12 * padded // N}[stage]
if m['model_states_bytes'] != formula: problems.append("model states %d != formula %d" % (m['model_states_bytes'], formula))
if m['model_states_formula_bytes'] != formula: problems.append("formula field %d != %d" % (m['model_states_formula_bytes'], formula))
c = d['comm']; A = 4 // N
moved = c['reduce_scatter_bytes_per_step'] + c['all_gather_bytes_per_step'] + c['all_reduce_bytes_per_step']
expect = (A + 1) * (N - 1) * padded // N * 4     # (A + 1) (N-1)/N Psi elements, 4 bytes each
if moved != expect or c['formula_bytes_per_step'] != expect: problems.append("comm %d, formula field %d, expected %d" % (moved, c['formula_bytes_per_step'], expect))
print("ok Psi=%d padded=%d model states %d comm %d" % (psi, padded, m['model_states_bytes'], moved) if not problems else "bad " + "; ".join(problems))
EOF
)
    case "$verdict" in
      ok*) pass "ledger N=$N stage=$stage: model states and bytes sent equal the paper's formulas (${verdict#ok })";;
      *) fail "ledger N=$N stage=$stage: $verdict";;
    esac
  done
done

# --- 3. bad input ---------------------------------------------------------------------
echo "=== bad input: one message, non-zero exit, no crash, no hang, no file"
printf 'short' > "$work/short.txt"
: > "$work/empty.txt"
head -c 4096 /dev/urandom > "$work/binary.bin"; printf '\0' >> "$work/binary.bin"
printf 'ok \xff\xfe bad utf-8 %.0s' $(seq 1 20) > "$work/latin1.txt"
echo '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket": 1000}}' > "$work/unknown_key.json"
echo '{"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}' > "$work/bad_batch.json"
echo '{"zero_optimization": {"stage": 3}}' > "$work/stage3.json"
bad_case() {  # expected message fragment, then the arguments
  local expect=$1; shift
  local out="$work/bad_out.json"
  rm -f "$out"
  # --json first: the case's own flags come later and win (the last value of a flag counts).
  timeout 60 mpirun -n "${bad_ranks:-2}" "$trainer" --json "$out" "$@" > "$work/bad_stdout" 2> "$work/bad_stderr"
  local status=$?
  local messages
  messages=$(grep -c "train_bert_mini: error:" "$work/bad_stderr")
  local label="bad input [$*]"
  if [ $status -eq 0 ]; then fail "$label: exit 0"
  elif [ $status -eq 124 ] || [ $status -eq 137 ]; then fail "$label: hung (timeout)"
  elif grep -qiE "segmentation|core dumped|terminate called|Assertion|BAD TERMINATION" "$work/bad_stderr"; then
    fail "$label: crashed: $(head -c 300 "$work/bad_stderr")"
  elif [ "$messages" != 1 ]; then fail "$label: $messages error messages (want exactly 1): $(head -c 300 "$work/bad_stderr")"
  elif ! grep -qF -- "$expect" "$work/bad_stderr"; then fail "$label: message lacks '$expect': $(cat "$work/bad_stderr")"
  elif [ -e "$out" ] || [ -e "$work/no" ] || [ -n "$(find "$work" -name '*zero2-tmp*' | head -n 1)" ]; then
    fail "$label: left an output file or a temporary"
  else pass "one message, exit $status, nothing written: $label -> $(sed 's/^train_bert_mini: error: //' "$work/bad_stderr" | head -c 110)"; fi
}
small=(--layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 --micro-batch 2 --steps 1)
bad_case "unknown flag '--bogus' (train_bert_mini --help lists the flags)" "${small[@]}" --bogus 3
# --help: exit 0, and it lists every flag the parser takes (read from the
# source, so a flag added without its line here fails).
help_status=0
timeout 60 mpirun -n 2 "$trainer" --help > "$work/help.txt" 2>&1 || help_status=$?
missing=""
for flag in $(grep -oE 'flag == "--[a-z-]+"' trainer/settings.cpp | grep -oE -- '--[a-z-]+' | sort -u); do
  grep -q -- "$flag" "$work/help.txt" || missing="$missing $flag"
done
if [ $help_status -eq 0 ] && [ -z "$missing" ] && [ "$(grep -c '^usage:' "$work/help.txt")" -eq 1 ]; then
  pass "--help: exit 0, once (rank 0), every flag listed"
else
  fail "--help: exit $help_status, missing:$missing"
fi
bad_case "--steps needs a value" "${small[@]}" --steps
bad_case "unexpected argument" "${small[@]}" stray
for flag_value in "--device gpu" "--comm tcp" "--stage 3" "--stage two" "--collectives fast" "--micro-batch 0" \
                  "--accum 0" "--seq 2" "--layers 0" "--hidden -4" "--heads 0" "--intermediate 0" "--steps 0" \
                  "--lr -1" "--lr nan" "--warmup -2" "--weight-decay -0.1" "--clip -1" "--dropout 1" \
                  "--dropout 1.5" "--seed -1" "--bucket 0" "--overlap 2" "--log-every 0" "--max-positions 1"; do
  set -- $flag_value
  bad_case "$1 wants" "${small[@]}" $flag_value
done
bad_case "cannot open --data" "${small[@]}" --data "$work/missing.txt"
bad_case "is empty" "${small[@]}" --data "$work/empty.txt"
bad_case "looks binary" "${small[@]}" --data "$work/binary.bin"
bad_case "is not UTF-8" "${small[@]}" --data "$work/latin1.txt"
bad_case "is a directory" "${small[@]}" --data "$work"
bad_case "needs at least 14" "${small[@]}" --data "$work/short.txt"
bad_case "longer than the 20 learned positions" "${small[@]}" --seq 32 --max-positions 20
bad_case "not divisible by --heads 3" "${small[@]}" --heads 3
bad_case "--warmup 5 is longer than --steps 1" "${small[@]}" --warmup 5
bad_case "zero_optimization.reduce_bucket: not a DeepSpeed key this trainer knows" "${small[@]}" --config "$work/unknown_key.json"
bad_case "cannot open the config file" "${small[@]}" --config "$work/missing.json"
bad_case "train_batch_size 7" "${small[@]}" --config "$work/bad_batch.json"
bad_case "run it with 1 rank" "${small[@]}" --dump-batch "$work/dump_from_two"
bad_case "does not exist" "${small[@]}" --json "$work/no/such/dir/out.json"
long_name=$(printf 'a%.0s' $(seq 1 300))
bad_case "more than the 255 a file name may have" "${small[@]}" --json "$work/$long_name/$long_name/out.json"
# A message longer than 1,023 bytes arrives whole (it was cut there, the
# reason lost after a long path), from rank 0 and from another rank.
deep=$(printf 'd%.0s' $(seq 1 200))
long_path="$work/$deep/$deep/$deep/$deep/$deep/missing.txt"
bad_case "/missing.txt': No such file or directory" "${small[@]}" --data "$long_path"
timeout 60 mpirun -n 1 "$trainer" "${small[@]}" --data "$work/corpus.txt" : -n 1 "$trainer" "${small[@]}" \
  --data "$long_path" > /dev/null 2> "$work/long_stderr"
long_status=$?
if [ $long_status -eq 2 ] && grep -qF "/missing.txt': No such file or directory (on rank 1)" "$work/long_stderr"; then
  pass "a $(wc -c < "$work/long_stderr")-byte message from rank 1 printed whole by rank 0"
else fail "long message from rank 1: exit $long_status, $(tail -c 200 "$work/long_stderr")"; fi
# A flag given twice: the last counts (argparse's rule), and the header says so.
if timeout 60 "$trainer" "${small[@]}" --steps 3 --steps 4 --json "$work/twice_steps.json" > "$work/log" 2>&1 &&
   grep -qF "flags     --steps given twice ('3', then '4'): the last counts" "$work/log" &&
   [ "$(json_get "$work/twice_steps.json" "len(d['steps'])")" = 4 ]; then
  pass "--steps 3 --steps 4: 4 steps, and the header names the repeat"
else fail "--steps 3 --steps 4: $(grep -E 'flags|error' "$work/log" | head -c 300)"; fi
# A non-zero number that reads as 0 is refused, as one too large is.
echo '{"optimizer": {"type": "AdamW", "params": {"lr": 1e-400}}}' > "$work/lr_underflow.json"
bad_case "optimizer.params.lr: wants 0 or a number of at least 2.22507e-308 in size (got '1e-400'" "${small[@]}" \
  --config "$work/lr_underflow.json"
bad_case "--lr wants 0 or a number of at least 2.22507e-308 in size (got '1e-400'" "${small[@]}" --lr 1e-400
bad_case "too large" "${small[@]}" --micro-batch 1000000 --seq 4096 --max-positions 4096
bad_case "--comm nccl needs --device cuda" "${small[@]}" --device cpu --comm nccl
bad_case "--export-hf '$work/short.txt' is a file, not a directory" "${small[@]}" --export-hf "$work/short.txt"
bad_ranks=1 bad_case "name the same directory" "${small[@]}" --export-hf "$work/same" --dump-batch "$work/same"
bad_ranks=1 bad_case "name the same directory" "${small[@]}" --export-hf "$work/same" --dump-batch "$work/./same/"
bad_case "zero_optimization.stage: 3 is not supported: stage 3 (P_p, the parameters partitioned) is not implemented" "${small[@]}" --config "$work/stage3.json"
bad_case "GiB are available per rank" "${small[@]}" --layers 256 --hidden 16384 --heads 16
for flag_value in "--activations all" "--alloc malloc" "--device-memory-limit 100" "--device-memory-limit lots"; do
  set -- $flag_value
  bad_case "$1 wants" "${small[@]}" $flag_value
done
bad_case "is more than the" "${small[@]}" --device-memory-limit 9000000000000000000
bad_case "out of device memory in the 4,096-byte block (--alloc arena)" "${small[@]}" --device-memory-limit 4096
bad_case "out of device memory in the 4,096-byte block (--alloc naive)" "${small[@]}" --alloc naive --device-memory-limit 4096

# --- 4. the PyTorch reference ---------------------------------------------------------
echo "=== PyTorch reference: loss, every gradient and one AdamW step on a dumped batch"
if ! $PYTHON -c "import torch" 2>/dev/null && [ -n "${Z2_NO_TORCH:-}" ]; then
  echo "SKIP torch reference: no torch here and Z2_NO_TORCH is set (the GPU image; make deps installs python3-torch)"
elif ! $PYTHON -c "import torch" 2>/dev/null; then
  fail "torch reference: $PYTHON cannot import torch (make deps installs python3-torch)"
elif timeout 300 mpirun -n 1 "$trainer" --layers 2 --hidden 64 --heads 4 --intermediate 128 --seq 32 --max-positions 40 \
      --micro-batch 4 --accum 2 --steps 1 --dropout 0 --clip 0.5 --lr 1e-3 --weight-decay 0.01 --seed 3 --quiet \
      --dump-batch "$work/dump" --export-hf "$work/after" > "$work/log" 2>&1; then
  $PYTHON tests/torch_reference.py check "$work/dump" "$work/after" > "$work/torch.log" 2>&1
  status=$?
  cat "$work/torch.log"
  line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$work/torch.log" | tail -n 1)
  if [ -n "$line" ]; then
    passed=$((passed + $(echo "$line" | cut -d' ' -f1)))
    failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
  fi
  [ -z "$line" ] && fail "torch reference: exit $status without a summary line"
else
  fail "torch reference: the dump run failed"; cat "$work/log"
fi

# The reference's own self-test: its file I/O and each of its checks failing
# on a planted fault (so a passing comparison above means something).
if [ -n "${Z2_NO_TORCH:-}" ] && ! $PYTHON -c "import torch" 2>/dev/null; then
  echo "SKIP torch reference selftest (no torch here)"
elif $PYTHON tests/torch_reference.py selftest > "$work/selftest.log" 2>&1; then
  pass "torch reference selftest: $(tail -n 1 "$work/selftest.log")"
else
  fail "torch reference selftest"; cat "$work/selftest.log"
fi

# --- 5. ZeRO-R ------------------------------------------------------------------------
echo "=== ZeRO-R: --activations x --alloc against the stage matrix's bits; bounds; allocations; out of memory"
# Every (N, stage) of the matrix (A = 4/N, overlap on) with the other five
# combinations; keep + arena (the default) is the matrix's own run.
for N in 1 2 4; do
  A=$((4 / N))
  for stage in 0 1 2; do
    cp "$work/matrix_${N}_${stage}_1.json" "$work/zero_r_${N}_${stage}_keep_arena.json"
    for activations in keep recompute offload; do
      for alloc in arena naive caching; do
        [ "$activations/$alloc" = keep/arena ] && continue
        # Poisoned: a read of an activation before it is written would show.
        same_bits_run "ZeRO-R N=$N A=$A stage=$stage --activations $activations --alloc $alloc, poisoned (the matrix's bits)" \
          $N "$work/zero_r_${N}_${stage}_${activations}_${alloc}.json" --accum $A --stage $stage \
          --activations $activations --alloc $alloc --poison-activations
      done
    done
  done
done
# The ledger rules, from the config alone (the tiny model: L 2, H 32, F 64,
# heads 2, T 16, B 2, dropout on).
verdict=$(python3 - "$work" <<'EOF'
import glob, json, os, sys
L, H, F, NH, T, B, V = 2, 32, 64, 2, 16, 2, 260
R, S, A = B * T, B * (T - 2), B * NH * T * T
f = 4
always = (2 * R + 2 * S + V + 1) * 4 + S * f                 # batch ints, per-row losses
working_set = (7 * R * H + A + 2 * R * F + 4 * R) * f          # one block's activations
scratch = (2 * R * H + R * max(2 * H, F) + A + A) * f          # its backward scratch (dropped probs: dropout on)
backward_long = (V * H + R * H) * f                            # tied-decoder gradient, the flowing gradient
checkpoint = R * H * f
head = (7 * S * H + 2 * S + S * V) * f                         # the MLM head's phase
embeddings = (R * H + 2 * R) * f + checkpoint                  # the embeddings' recomputation
# one block (or the largest other phase) + two checkpoints
bound = always + backward_long + 2 * checkpoint + max(working_set + scratch, head, embeddings)
problems, count = [], 0
for path in sorted(glob.glob(os.path.join(sys.argv[1], "zero_r_*.json"))):
    name = os.path.basename(path)[len("zero_r_"):-len(".json")]
    n, stage, activations, alloc = name.split("_")
    d = json.load(open(path)); m = d["memory"]; count += 1
    if activations == "offload" and m["activation_peak_bytes"] > bound:
        problems.append(f"{name}: offload activation peak {m['activation_peak_bytes']} > bound {bound}")
    if activations == "offload" and m["host_offload_peak_bytes"] != (L - 1) * checkpoint:
        problems.append(f"{name}: host offload peak {m['host_offload_peak_bytes']} != (L-1) checkpoints")
    if alloc == "arena" and (m["device_allocations_after_step1"] != 0 or m["device_allocations_per_step"] != 0):
        problems.append(f"{name}: the arena allocated after step 1 ({m['device_allocations_after_step1']})")
    if alloc in ("naive", "caching") and m["device_allocations_per_step"] <= 0:
        problems.append(f"{name}: {alloc} made no allocation in a step")
    if m["reserved_bytes"] > m["capacity_bytes"] or m["device_peak_bytes"] > m["reserved_bytes"]:
        problems.append(f"{name}: peak {m['device_peak_bytes']} <= reserved {m['reserved_bytes']} <= capacity {m['capacity_bytes']} fails")
    if abs(m["fragmentation"] - (1 - m["device_peak_bytes"] / m["reserved_bytes"])) > 1e-9:
        problems.append(f"{name}: fragmentation is not 1 - peak / reserved")
    if m["activation_peak_bytes"] != d["activation_peak_formula_bytes"]:
        problems.append(f"{name}: activation peak {m['activation_peak_bytes']} != formula {d['activation_peak_formula_bytes']}")
ok = not problems and count == 81
print(("ok" if ok else "bad") + f" {count} runs; offload bound {bound:,} bytes; " + "; ".join(problems[:4]))
EOF
)
case "$verdict" in ok*) pass "ZeRO-R ledgers: $verdict";; *) fail "ZeRO-R ledgers: $verdict";; esac

# Out of memory. A model where offload's long-lived checkpoints, allocated
# between temporaries, leave naive's free memory in pieces: the arena's
# measured need (its peak reserved, exactly what it needs: the block is its
# bottom plus its stack) is enough for the arena and not for naive, at every
# N. One step less (256 bytes) is not enough for the arena either.
oom=(--layers 3 --hidden 64 --heads 2 --intermediate 256 --seq 32 --micro-batch 4 --steps 2 --activations offload)
for N in 1 2 4; do
  if ! timeout 300 mpirun -n $N "$trainer" "${oom[@]}" --alloc arena --quiet --json "$work/oom_arena.json" > "$work/log" 2>&1; then
    fail "out of memory N=$N: the roomy arena run failed"; cat "$work/log"; continue
  fi
  need=$(json_get "$work/oom_arena.json" "d['memory']['reserved_bytes']")
  if timeout 300 mpirun -n $N "$trainer" "${oom[@]}" --alloc arena --device-memory-limit "$need" --quiet \
      --json "$work/oom_arena_tight.json" > "$work/log" 2>&1; then
    pass "out of memory N=$N: the arena runs in its measured need, $need bytes"
  else
    fail "out of memory N=$N: the arena failed in its measured need $need"; cat "$work/log"
  fi
  bad_ranks=$N bad_case "bytes free in" "${oom[@]}" --alloc naive --device-memory-limit "$need"
  bad_ranks=$N bad_case "bytes of the limit not yet in segments" "${oom[@]}" --alloc caching --device-memory-limit "$need"
  bad_ranks=$N bad_case "(--alloc arena)" "${oom[@]}" --alloc arena --device-memory-limit $((need - 256))
done

# --- 6. mixed precision ---------------------------------------------------------------
echo "=== mixed precision: bf16 and fp16 through the command line"
declare -A precision_bits
for precision in bf16 fp16; do
  reference=""
  for N in 1 2 4; do
    A=$((4 / N))
    # Overlap off at N = 2 only: the engine's own matrix (tests/test_precision.cpp)
    # crosses overlap with every stage and bucket size in both precisions.
    overlaps="1"
    [ $N -eq 2 ] && overlaps="0 1"
    for stage in 0 1 2; do
      for overlap in $overlaps; do
        same_bits_run "$precision matrix N=$N A=$A stage=$stage overlap=$overlap" $N \
          "$work/mixed_${precision}_${N}_${stage}_${overlap}.json" --precision $precision --accum $A --stage $stage \
          --overlap $overlap
      done
    done
    # ZeRO-R in this precision: two combinations per N (every one of them
    # runs in process in every precision and stage: tests/test_bert.cu).
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
fp32_bits=$(json_get "$work/matrix_1_0_0.json" "d['final_params_hash']")
if [ "${precision_bits[bf16]%% *}" != "$fp32_bits" ] && [ "${precision_bits[fp16]%% *}" != "$fp32_bits" ] &&
   [ "${precision_bits[bf16]%% *}" != "${precision_bits[fp16]%% *}" ]; then
  pass "mixed: fp32, bf16 and fp16 give three different hashes (the 16-bit roundings show)"
else
  fail "mixed: a 16-bit run has another precision's hash"
fi

# The ledgers from the config alone (the tiny model of section 2).
for precision in bf16 fp16; do
  verdict=$(python3 - "$work" $precision <<'EOF'
import json, sys, os
work, precision = sys.argv[1], sys.argv[2]
problems, count = [], 0
for N in (1, 2, 4):
    for stage in (0, 1, 2):
        d = json.load(open(os.path.join(work, f"mixed_{precision}_{N}_{stage}_1.json"))); count += 1
        psi = d["params_padded"]; m = d["memory"]; c = d["comm"]; A = 4 // N
        # The paper's K = 12: 2-byte parameters and gradients, 12 bytes of fp32 master, m and v.
        formula = {0: 16 * psi, 1: 4 * psi + 12 * psi // N, 2: 2 * psi + 14 * psi // N}[stage]
        expect = {"params_bytes": 2 * psi, "grads_bytes": 2 * psi if stage < 2 else 2 * psi // N,
                  "master_bytes": 4 * psi if stage == 0 else 4 * psi // N,
                  "optimizer_bytes": 8 * psi if stage == 0 else 8 * psi // N,
                  "model_states_bytes": formula, "model_states_formula_bytes": formula,
                  # floor(log2 A) fp32 blocks of Psi/N (grad_accum_dtype fp32)
                  "accumulation_bytes": {1: 0, 2: 1, 4: 2}[A] * (psi // N) * 4}
        for key, value in expect.items():
            if m[key] != value: problems.append(f"N={N} stage={stage} {key} {m[key]} != {value}")
        moved = c["reduce_scatter_bytes_per_step"] + c["all_gather_bytes_per_step"] + c["all_reduce_bytes_per_step"]
        wire = (A + 1) * (N - 1) * (psi // N) * 2       # (A + 1) (N-1)/N Psi elements, 2 bytes each
        if moved != wire or c["formula_bytes_per_step"] != wire:
            problems.append(f"N={N} stage={stage} comm {moved} (formula {c['formula_bytes_per_step']}) != {wire}")
        if d["precision"] != precision or m["precision"] != precision: problems.append(f"N={N} precision field")
print(("ok" if not problems and count == 9 else "bad") + f" {count} runs" + (": " + "; ".join(problems[:4]) if problems else ""))
EOF
)
  case "$verdict" in ok*) pass "$precision ledgers: 16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N, 2 bytes on the wire: $verdict";;
                     *) fail "$precision ledgers: $verdict";; esac
done

# fp16 forced to overflow: 2^30 overflows at once; hysteresis 2 and a window
# of 4 clean steps make the scale fall and rise again. Every stage and N
# must skip the same steps, and the scale of every step must follow
# DeepSpeed's update_scale, recomputed here from the skips alone.
echo '{"fp16": {"enabled": true, "initial_scale_power": 30, "loss_scale_window": 4, "hysteresis": 2, "min_loss_scale": 1}}' \
  > "$work/fp16_overflow.json"
overflow_runs=()
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
verdict=$(python3 - "${overflow_runs[@]}" <<'EOF'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[1:]]
def key(d): return ([s["skipped"] for s in d["steps"]], [s["loss_scale"] for s in d["steps"]], d["final_params_hash"])
same = len(runs) == 5 and all(key(d) == key(runs[0]) for d in runs)
# DeepSpeed's DynamicLossScaler.update_scale (loss_scaler.py), re-typed here.
scale, hysteresis, window, delayed, last, problems = 2.0 ** 30, 2, 4, 2, -1, []
d = runs[0]
for it, s in enumerate(d["steps"]):
    if s["loss_scale"] != scale: problems.append(f"step {s['step']}: scale {s['loss_scale']} != {scale}")
    if s["skipped"]:
        if delayed == 1 or hysteresis == 1: scale = max(scale / 2, 1.0)
        else: hysteresis -= 1
        last = it
    elif (it - last) % window == 0:
        hysteresis = delayed; scale *= 2
skips = sum(s["skipped"] for s in d["steps"])
grew = any(b["loss_scale"] > a["loss_scale"] for a, b in zip(d["steps"], d["steps"][1:]))
ok = same and not problems and d["skipped_steps"] == skips and 0 < skips < len(d["steps"]) and grew and d["loss_scale"] == scale
print(("ok" if ok else "bad") + f" {len(runs)} runs alike: {same}; {skips} of {len(d['steps'])} steps skipped, "
      f"the scale grew again: {grew}; final scale {d['loss_scale']:g} (DeepSpeed's rule: {scale:g}) " + "; ".join(problems[:3]))
EOF
)
case "$verdict" in ok*) pass "fp16 overflow: $verdict";; *) fail "fp16 overflow: $verdict";; esac

# bf16 and fp16 train as fp32 does: the mean loss of the last 10 of 60 steps
# within 1% of fp32's (measured: within 1e-4 here; 1% is 2.5 bf16 roundings
# of the loss, while a broken 16-bit path, an unscaled fp16 gradient or a
# lost update, stalls far above it).
small_train=(--layers 2 --hidden 64 --heads 4 --intermediate 256 --seq 64 --max-positions 64 --micro-batch 8 --steps 60 --lr 2e-3 --quiet)
for precision in fp32 bf16 fp16; do
  timeout 300 mpirun -n 2 "$trainer" "${small_train[@]}" --precision $precision --json "$work/accuracy_$precision.json" \
    > "$work/log" 2>&1 || { fail "accuracy $precision: exit non-zero"; cat "$work/log"; }
done
verdict=$(python3 - "$work" <<'EOF'
import json, sys, os
tail = {}
for p in ("fp32", "bf16", "fp16"):
    d = json.load(open(os.path.join(sys.argv[1], f"accuracy_{p}.json")))
    losses = [s["loss"] for s in d["steps"]]
    tail[p] = sum(losses[-10:]) / 10
fell = tail["fp32"] < 0.8 * json.load(open(os.path.join(sys.argv[1], "accuracy_fp32.json")))["steps"][0]["loss"]
worst = max(abs(tail[p] - tail["fp32"]) / tail["fp32"] for p in ("bf16", "fp16"))
print(("ok" if worst <= 0.01 and fell else "bad") + " last-10 mean loss fp32 %.4f bf16 %.4f fp16 %.4f, worst relative gap %.1e (<= 1e-2)" % (tail["fp32"], tail["bf16"], tail["fp16"], worst))
EOF
)
case "$verdict" in ok*) pass "mixed accuracy: $verdict";; *) fail "mixed accuracy: $verdict";; esac

# The 16-bit rounding against torch's (every exponent, every boundary).
if ! $PYTHON -c "import torch" 2>/dev/null && [ -n "${Z2_NO_TORCH:-}" ]; then
  echo "SKIP 16-bit rounding against torch (no torch here)"
elif $PYTHON tests/convert_check.py "$build/convert_tool" > "$work/convert.log" 2>&1; then
  while read -r line; do case "$line" in PASS*) pass "${line#PASS }";; esac; done < "$work/convert.log"
else
  fail "16-bit rounding against torch"; cat "$work/convert.log"
fi

# One bf16 and one fp16 step against fp64 on the same 16-bit weights, and bf16
# against torch.autocast (tests/torch_reference.py mixed: the tolerances are
# justified there).
for precision in bf16 fp16; do
  if ! $PYTHON -c "import torch" 2>/dev/null && [ -n "${Z2_NO_TORCH:-}" ]; then
    echo "SKIP torch mixed reference (no torch here)"; continue
  fi
  if timeout 300 mpirun -n 1 "$trainer" --layers 2 --hidden 64 --heads 4 --intermediate 128 --seq 32 --max-positions 40 \
      --micro-batch 4 --accum 2 --steps 1 --dropout 0 --clip 0.5 --seed 3 --quiet --precision $precision \
      --dump-batch "$work/dump_$precision" > "$work/log" 2>&1; then
    $PYTHON tests/torch_reference.py mixed "$work/dump_$precision" > "$work/torch_mixed.log" 2>&1
    cat "$work/torch_mixed.log"
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$work/torch_mixed.log" | tail -n 1)
    if [ -n "$line" ]; then
      passed=$((passed + $(echo "$line" | cut -d' ' -f1)))
      failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
    else
      fail "torch mixed reference ($precision): no summary line"
    fi
  else
    fail "torch mixed reference: the $precision dump run failed"; cat "$work/log"
  fi
done

# Bad input for mixed precision.
echo '{"fp16": {"enabled": true}, "bf16": {"enabled": true}}' > "$work/both.json"
echo '{"fp16": {"enabled": false}}' > "$work/fp16_off.json"
echo '{"fp16": {"loss_scale": -1}}' > "$work/negative_scale.json"
echo '{"fp16": {"min_loss_scale": 0}}' > "$work/zero_min.json"
echo '{"fp16": {"hysteresis": 0}}' > "$work/zero_hysteresis.json"
echo '{"fp16": {"loss_scale_window": 0}}' > "$work/zero_window.json"
echo '{"bf16": {"enabled": "yes"}}' > "$work/bf16_string.json"
echo '{"fp16": {"enabled": true, "initial_scale_power": 40, "hysteresis": 1, "min_loss_scale": 1099511627776}}' > "$work/at_minimum.json"
bad_case "--precision wants fp32|bf16|fp16" "${small[@]}" --precision fp8
bad_case "'fp16.enabled' and 'bf16.enabled' are both true" "${small[@]}" --config "$work/both.json"
bad_case "contradicts config key 'fp16.enabled' = false" "${small[@]}" --config "$work/fp16_off.json" --precision fp16
bad_case "fp16.loss_scale: wants" "${small[@]}" --config "$work/negative_scale.json"
bad_case "fp16.min_loss_scale: wants" "${small[@]}" --config "$work/zero_min.json"
bad_case "fp16.hysteresis: wants" "${small[@]}" --config "$work/zero_hysteresis.json"
bad_case "fp16.loss_scale_window: wants" "${small[@]}" --config "$work/zero_window.json"
bad_case "bf16.enabled: wants true or false" "${small[@]}" --config "$work/bf16_string.json"
# At the minimum scale an overflow ends the run (DeepSpeed raises), on every rank, naming the step.
bad_case "optimizer step 1: fp16 gradients overflowed at the minimum loss scale 1099511627776" "${small[@]}" \
  --config "$work/at_minimum.json"

# --- 7. reliability: failed writes, inputs, numbers, a stopped rank ----------------------
echo "=== reliability: writes that fail, inputs that are not what they seem, a stopped rank"
tiny_run=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --steps 3
          --warmup 1 --quiet)
if wanted 7; then  # (Z2_TRAINER_SKIP: files and inputs only)
# A full disk: a 64 KiB tmpfs filled up (mount needs root; where it is not
# allowed, the checks say SKIP and why, they do not pass).
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
    else pass "full disk, $label, N=$ranks: exit $status on every rank, nothing left -> $(sed 's/^train_bert_mini: error: //' "$work/full_stderr" | head -c 90)"; fi
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

# Two runs exporting into one directory at once, 20 times: whichever ends
# last, the directory's config.json and model.safetensors come from one run
# (hidden 16 and hidden 32 tell them apart).
mixed=0
for k in $(seq 1 20); do
  timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --hidden 16 --export-hf "$work/shared_export" > /dev/null 2>&1 &
  first=$!
  timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --hidden 32 --export-hf "$work/shared_export" > /dev/null 2>&1
  second=$?
  wait $first
  [ $? -eq 0 ] && [ $second -eq 0 ] || mixed=$((mixed + 1000))
  python3 - "$work/shared_export" <<'EOF' || mixed=$((mixed + 1))
import json, struct, sys
d = sys.argv[1]
config = json.load(open(f"{d}/config.json"))
with open(f"{d}/model.safetensors", "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
sys.exit(0 if header["bert.embeddings.word_embeddings.weight"]["shape"][1] == config["hidden_size"] else 1)
EOF
done
leftovers=$(find "$work/shared_export" -name '*zero2-tmp*' | wc -l)
[ $mixed -eq 0 ] && [ "$leftovers" -eq 0 ] && pass "20 pairs of concurrent exports into one directory: never mixed, no temporaries left" ||
  fail "concurrent exports: $mixed bad (x1000: a run failed), $leftovers temporaries left"

# Outputs that name an input, or each other.
echo '{"gradient_clipping": 1.0}' > "$work/ds.json"
mkdir -p "$work/export_over_config"
cp "$work/ds.json" "$work/export_over_config/config.json"
bad_case "is the --data file" "${small[@]}" --data "$work/corpus.txt" --json "$work/corpus.txt"
bad_case "is the --config file" "${small[@]}" --config "$work/ds.json" --json "$work/./ds.json"
bad_case "is the --data file" "${small[@]}" --data "$work/corpus.txt" --memory-trace "$work/corpus.txt"
bad_case "--export-hf's config.json '$work/export_over_config/config.json' is the --config file" "${small[@]}" \
  --config "$work/export_over_config/config.json" --export-hf "$work/export_over_config"
bad_case "name the same file" "${small[@]}" --json "$work/twice.json" --memory-trace "$work/twice.json"
[ "$(cat "$work/corpus.txt" | head -c 9)" = "The quick" ] && [ "$(cat "$work/ds.json")" = '{"gradient_clipping": 1.0}' ] &&
  pass "the inputs named as outputs are unchanged" || fail "an input was overwritten"

# Outputs that are not regular files: a device node (made here with mknod,
# never the real /dev), a FIFO, a socket, a dangling symlink, a symlink to a
# device: refused before step 1 by every writer, each left as it was. (As
# root, the rename would turn them into regular files: /dev/null for the
# whole machine.) A symlink to a regular file is followed: the target is
# written, the link stays a link.
nodes="$work/nodes"
mkdir -p "$nodes/export" "$nodes/dump" "$nodes/save"
if mknod "$nodes/null" c 1 3 2>"$work/mknod.err" && mknod "$nodes/export/config.json" c 1 3 &&
   mknod "$nodes/dump/batch.safetensors" c 1 3 && mknod "$nodes/save/latest" c 1 3; then
  mkfifo "$nodes/fifo"
  python3 -c "import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])" "$nodes/socket"
  ln -s null "$nodes/link_to_device"
  ln -s nowhere.json "$nodes/dangling.json"
  bad_case "--json '$nodes/null' is a character device: zero2 writes only regular files" "${small[@]}" --json "$nodes/null"
  bad_case "--metrics '$nodes/fifo' is a FIFO" "${small[@]}" --metrics "$nodes/fifo"
  bad_case "--memory-trace '$nodes/socket' is a socket" "${small[@]}" --memory-trace "$nodes/socket"
  bad_case "(a symlink to '$nodes/null') is a character device" "${small[@]}" --json "$nodes/link_to_device"
  bad_case "--json '$nodes/dangling.json' is a symlink that leads to no file" "${small[@]}" --json "$nodes/dangling.json"
  bad_case "--export-hf's config.json '$nodes/export/config.json' is a character device" "${small[@]}" --export-hf "$nodes/export"
  bad_ranks=1 bad_case "--dump-batch's batch.safetensors '$nodes/dump/batch.safetensors' is a character device" "${small[@]}" --dump-batch "$nodes/dump"
  bad_case "--save's latest '$nodes/save/latest' is a character device" "${small[@]}" --save "$nodes/save"
  bad_case "--save '$nodes/null' is a character device, not a directory" "${small[@]}" --save "$nodes/null"
  kinds=$(cd "$nodes" && stat -c '%n %F' null fifo socket link_to_device dangling.json export/config.json dump/batch.safetensors save/latest | tr '\n' ',')
  want="null character special file,fifo fifo,socket socket,link_to_device symbolic link,dangling.json symbolic link,"
  want+="export/config.json character special file,dump/batch.safetensors character special file,save/latest character special file,"
  [ "$kinds" = "$want" ] && [ -z "$(ls "$nodes/export" "$nodes/dump" | grep -v -e config.json -e batch.safetensors -e '^$' -e ':$')" ] &&
    pass "every output refused as a device, FIFO, socket or dangling link is left as it was" || fail "outputs that are not files: now $kinds"
else
  echo "SKIP device nodes as outputs: mknod is not allowed here ($(head -c 120 "$work/mknod.err"))"
fi
echo '{"kept": "the old contents"}' > "$nodes/target.json"
ln -s target.json "$nodes/link.json"
if timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --json "$nodes/link.json" > "$work/log" 2>&1 && [ -L "$nodes/link.json" ] &&
   grep -q final_params_hash "$nodes/target.json" && [ -z "$(ls -A "$nodes" | grep zero2-tmp)" ]; then
  pass "--json through a symlink: the target is written, the link stays a link"
else fail "--json through a symlink: $(ls -l "$nodes/link.json") $(head -c 200 "$nodes/target.json") $(head -c 200 "$work/log")"; fi

# The checkpoint being loaded is an input, every file of it: an output in its
# step directory, or over the latest that named it, is refused, and the
# checkpoint is unchanged. (--save into the directory it loads from moves
# latest, after the load: that is how a run continues.)
timeout 60 "$trainer" "${tiny_run[@]}" --steps 2 --save "$work/ck_input" > /dev/null 2>&1
ck_before=$(cd "$work/ck_input" && find . -type f | sort | xargs sha256sum | sha256sum)
bad_ranks=1 bad_case "--json '$work/ck_input/step_2/index.json' is inside the checkpoint it loads" --load "$work/ck_input/step_2" --json "$work/ck_input/step_2/index.json"
bad_ranks=1 bad_case "--json '$work/ck_input/latest' is the --load checkpoint's latest file" --load "$work/ck_input" --json "$work/ck_input/latest"
bad_ranks=1 bad_case "--metrics '$work/ck_input/step_2/rank_00000.safetensors' is inside the checkpoint it loads" --load "$work/ck_input" --metrics "$work/ck_input/step_2/rank_00000.safetensors"
bad_ranks=1 bad_case "--memory-trace '$work/ck_input/step_2/index.json' is inside" --load "$work/ck_input/step_2" --memory-trace "$work/ck_input/step_2/index.json"
bad_ranks=1 bad_case "--export-hf '$work/ck_input/step_2' is inside the checkpoint it loads" --load "$work/ck_input" --steps 0 --export-hf "$work/ck_input/step_2"
[ "$(cd "$work/ck_input" && find . -type f | sort | xargs sha256sum | sha256sum)" = "$ck_before" ] &&
  pass "the checkpoint named by the refused outputs is unchanged" || fail "a refused output changed the checkpoint it loads"

# Paths that are not UTF-8 (the run records paths in JSON, which holds only
# UTF-8): refused before step 1, not at the first save after training; the
# working directory's name counts for a relative path.
cp "$work/corpus.txt" "$work/bad"$'\xff'".txt"
bad_case 'the path is not UTF-8 (the byte shown as \xff)' "${small[@]}" --data "$work/bad"$'\xff'".txt" --save "$work/ck_utf8"
bad_case 'the path is not UTF-8' "${small[@]}" --json "$work/out"$'\xfe'".json"
mkdir -p "$work/cwd"$'\xff'
relative_trainer=$trainer trainer=$(realpath "$trainer")  # (not a subshell: its pass or fail would not count)
cd "$work/cwd"$'\xff' && bad_case "is not UTF-8; the run records absolute paths" "${small[@]}" --memory-trace trace.csv
cd - > /dev/null && trainer=$relative_trainer
[ ! -e "$work/ck_utf8" ] && [ -z "$(ls -A "$work/cwd"$'\xff')" ] && pass "refused paths that are not UTF-8: nothing made" ||
  fail "a refused non-UTF-8 run made $(ls -A "$work/ck_utf8" "$work/cwd"$'\xff' 2>&1 | head -c 200)"

# --metrics on resume: the first run's lines stay; a marker line says where
# the resumed run's lines begin.
timeout 60 "$trainer" "${tiny_run[@]}" --steps 4 --save-every 2 --log-every 1 --save "$work/ck_metrics" --metrics "$work/resumed.jsonl" > /dev/null 2>&1
timeout 60 "$trainer" --load "$work/ck_metrics/step_2" --log-every 1 --quiet --metrics "$work/resumed.jsonl" > "$work/log" 2>&1
lines=$(python3 -c "import json,sys; print(' '.join(str(r.get('step')) + ('R' if 'resumed_from' in r else '') for r in map(json.loads, open(sys.argv[1]))))" "$work/resumed.jsonl" 2>&1)
[ "$lines" = "1 2 3 4 2R 3 4" ] && pass "--metrics on resume: appended after a resumed_from line ($lines)" ||
  fail "--metrics on resume: steps $lines $(head -c 200 "$work/log")"

# The same file or directory named two ways, before it exists (a relative
# path against an absolute one), and outputs that name each other's directory.
bad_ranks=1 bad_case "name the same directory" "${small[@]}" --export-hf "$work/new_same" --dump-batch "$(realpath --relative-to=. "$work")/new_same"
bad_case "name the same file" "${small[@]}" --json "$work/new_twice.json" --memory-trace "$(realpath --relative-to=. "$work")/./new_twice.json"
bad_case "--json and --export-hf name the same path" "${small[@]}" --export-hf "$work/new_dir" --json "$work/new_dir"
bad_ranks=1 bad_case "--memory-trace and --dump-batch name the same path" "${small[@]}" --dump-batch "$work/new_dump" --memory-trace "$work/new_dump"
[ ! -e "$work/new_same" ] && [ ! -e "$work/new_dir" ] && pass "refused outputs: no directory created" || fail "a refused output's directory was created"
# What would fail only after training, refused before it: a directory where
# the export puts a file, a name longer than the file system takes; an empty
# path (an unset shell variable); a timeout too short for a healthy wait.
mkdir -p "$work/export_with_dir/model.safetensors"
bad_case "--export-hf's model.safetensors '$work/export_with_dir/model.safetensors' is a directory" "${small[@]}" --export-hf "$work/export_with_dir"
bad_case "more than the 255 a file name may have" "${small[@]}" --json "$work/$(printf 'n%.0s' $(seq 1 256)).json"
for flag in --data --config --json --export-hf --dump-batch --memory-trace; do
  bad_case "$flag wants a path (got an empty one" "${small[@]}" $flag ""
done
bad_case "--timeout wants a number from 1 to" "${small[@]}" --timeout 0.5
# A name of 250 bytes is legal: its temporary's name must be too.
legal_name="$work/$(printf 'l%.0s' $(seq 1 245)).json"
if timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --json "$legal_name" > "$work/log" 2>&1 && [ -s "$legal_name" ]; then
  pass "a 250-byte file name is written"
else fail "a 250-byte file name: $(head -c 200 "$work/log")"; fi
# A file that is replaced keeps its permissions.
echo '{}' > "$work/private.json" && chmod 600 "$work/private.json"
timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --json "$work/private.json" > /dev/null 2>&1
[ "$(stat -c %a "$work/private.json")" = 600 ] && [ "$(head -c 1 "$work/private.json")" = "{" ] && grep -q final_params_hash "$work/private.json" &&
  pass "a replaced output keeps its mode (600)" || fail "a replaced output: mode $(stat -c %a "$work/private.json")"
# A config error on rank 1 only (each rank reads its own --config; on
# several hosts one may lack it): every rank ends at once with its message.
start=$(date +%s)
timeout 60 mpirun -n 1 "$trainer" "${tiny_run[@]}" --config "$work/ds.json" : -n 1 "$trainer" "${tiny_run[@]}" \
  --config "$work/missing.json" > /dev/null 2> "$work/rank1_stderr"
status=$?
took=$(($(date +%s) - start))
if [ $status -eq 2 ] && [ $took -lt 20 ] && grep -q "cannot open the config file .* (on rank 1)" "$work/rank1_stderr"; then
  pass "a config missing on rank 1 only: exit 2 in ${took} s, '(on rank 1)'"
else fail "a config missing on rank 1 only: exit $status after ${took} s: $(head -c 300 "$work/rank1_stderr")"; fi
# Config numbers quoted as written; whole numbers in exponent form (as
# DeepSpeed's configs write bucket sizes) taken as integers; a number
# beyond double named with the file.
echo '{"fp16": {"enabled": true, "loss_scale": 1e39}}' > "$work/big_scale.json"
echo '{"train_batch_size": 18446744073709551616}' > "$work/beyond_u64.json"
echo '{"zero_optimization": {"reduce_bucket_size": 1e-5}}' > "$work/tiny_bucket.json"
echo '{"gradient_clipping": 1e400}' > "$work/beyond_double.json"
echo '{"zero_optimization": {"reduce_bucket_size": 5e8}, "train_micro_batch_size_per_gpu": 2.0}' > "$work/exponent_ints.json"
bad_case "fp16.loss_scale: wants a number from 0 to 1e+30 (got '1e39')" "${small[@]}" --config "$work/big_scale.json"
bad_case "(got '18446744073709551616')" "${small[@]}" --config "$work/beyond_u64.json"
bad_case "(got '1e-5')" "${small[@]}" --config "$work/tiny_bucket.json"
bad_case "the config file '$work/beyond_double.json' is not valid JSON" "${small[@]}" --config "$work/beyond_double.json"
if timeout 60 "$trainer" "${tiny_run[@]}" --steps 1 --config "$work/exponent_ints.json" > "$work/log" 2>&1; then
  pass "config: reduce_bucket_size 5e8 and micro batch 2.0 are integers"
else fail "config: 5e8 / 2.0 refused: $(head -c 200 "$work/log")"; fi

# The export's lock, held by another process past --timeout: the watchdog
# says so (not that a rank is dead).
mkdir -p "$work/locked"
flock "$work/locked" sleep 30 &
holder=$!
sleep 0.5
timeout 60 mpirun -n 2 "$trainer" "${tiny_run[@]}" --export-hf "$work/locked" --timeout 2 > /dev/null 2> "$work/lock_stderr"
status=$?
kill $holder 2>/dev/null; wait $holder 2>/dev/null
if [ $status -eq 3 ] && grep -q "for the lock on the directory '$work/locked' (another process" "$work/lock_stderr" && grep -q "every rank answered" "$work/lock_stderr"; then
  pass "an export directory locked by another process: the watchdog names the lock"
else fail "locked export directory: exit $status: $(head -c 300 "$work/lock_stderr")"; fi
# A write interrupted halfway (tests only: ZERO2_TEST_FAULT): stopped, then
# ended by the watchdog, or killed: no temporary is left, nothing partial
# under a final name; a killed export has its weights but no config.json
# (written last: an export without it is incomplete, by design).
ZERO2_TEST_FAULT="stop 1" timeout 60 mpirun -n 2 "$trainer" "${tiny_run[@]}" --export-hf "$work/stopped_export" --timeout 2 > /dev/null 2> "$work/fault_stderr"
status=$?
pkill -9 -f "stopped_export" 2>/dev/null
if [ $status -eq 3 ] && [ -z "$(ls -A "$work/stopped_export")" ]; then pass "a rank stopped mid-write: exit 3, the directory empty (no temporary)"
else fail "a rank stopped mid-write: exit $status, left: $(ls -A "$work/stopped_export" | head -c 200)"; fi
ZERO2_TEST_FAULT="kill 2" timeout 60 mpirun -n 2 "$trainer" "${tiny_run[@]}" --export-hf "$work/killed_export" > /dev/null 2>&1
status=$?
whole=$(python3 - "$work/killed_export/model.safetensors" <<'EOF' 2>&1
import json, os, struct, sys
with open(sys.argv[1], "rb") as f:
    length = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(length))
end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
print("whole" if os.path.getsize(sys.argv[1]) == 8 + length + end else "cut")
EOF
)
if [ $status -ne 0 ] && [ "$(ls -A "$work/killed_export")" = "model.safetensors" ] && [ "$whole" = whole ]; then
  pass "a rank killed writing config.json: exit $status, model.safetensors whole, no config.json, no temporary"
else fail "a rank killed mid-write: exit $status, left: $(ls -A "$work/killed_export" | head -c 200)"; fi

# Inputs that are not regular files, or not text.
mkfifo "$work/fifo"
bad_case "is not a regular file" "${small[@]}" --data "$work/fifo"
bad_case "is not a regular file" "${small[@]}" --data /dev/zero
bad_case "is not a regular file" "${small[@]}" --config "$work/fifo"
for bytes in '\xc0\x80' '\xe0\x80\x80' '\xed\xa0\x80' '\xf4\x90\x80\x80' '\xf5\x80\x80\x80' '\x80'; do
  { printf 'plain text before the bad bytes %.0s' $(seq 1 3); printf "$bytes"; printf ' and after'; } > "$work/bad_utf8.txt"
  bad_case "is not UTF-8 text (an ill-formed sequence at offset 96" "${small[@]}" --data "$work/bad_utf8.txt"
done
# Config values and files that a lax parser would accept.
echo '{"gradient_clipping": true}' > "$work/bool_number.json"
printf '{"gradient_clipping": 1.0}\0garbage' > "$work/nul_garbage.json"
echo '{"gradient_clipping": 1.0} trailing' > "$work/trailing.json"
echo '{"gradient_clipping": 1.0, "gradient_clipping": 2.0}' > "$work/duplicate.json"
echo '{"zero_optimization": {"stage": 2, "stage": 1}}' > "$work/duplicate_inner.json"
echo '{"train_batch_size": 18446744073709551615}' > "$work/huge.json"
echo '{"zero_optimization": {"overlap_comm": 1}}' > "$work/number_bool.json"
python3 -c "print('[' * 100000 + ']' * 100000)" > "$work/deep.json"
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
fi  # section 7's files and inputs; its numbers and the watchdog (below) always run

# A global batch that would select no position on most steps.
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
if timeout 60 mpirun -n 2 "$trainer" "${tiny_run[@]}" --steps 5 --dropout 0.99 --json "$work/dropout.json" > "$work/log" 2>&1; then
  verdict=$(json_get "$work/dropout.json" "'ok' if all(s['grad_norm'] is not None and s['grad_norm'] > 0 for s in d['steps']) and max(s['grad_norm'] for s in d['steps']) > 1.8e19 else 'bad ' + str([s['grad_norm'] for s in d['steps']])")
  case "$verdict" in ok*) pass "dropout 0.99: every gradient norm finite, the largest beyond sqrt(FLT_MAX)";; *) fail "dropout 0.99: $verdict";; esac
else
  fail "dropout 0.99: exit non-zero: $(head -c 300 "$work/log")"
fi

# A stopped rank (SIGSTOP: hydra does not notice it): the others' watchdog
# ends the job within --timeout (3 s here) plus the roll call's grace (1 s)
# plus slack, naming the stopped rank as the one that did not answer. Rank 2
# of 4, found by the PMI_RANK hydra gives each process.
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
elif [ $status -ne 0 ] && [ $status -ne 124 ] && [ $took -le 14 ] && grep -q "watchdog: waited 3 s for" "$work/stopped_stderr" \
     && grep -q "roll call (1 s): rank 2 did not answer" "$work/stopped_stderr"; then
  pass "stopped rank: the job ended ${took} s after the stop, exit $status: $(grep -m 1 'roll call' "$work/stopped_stderr" | sed 's/^\[zero2\] *//' | head -c 120)"
else
  fail "stopped rank: exit $status after ${took} s: $(head -c 600 "$work/stopped_stderr")"
fi
# Every rank alive but waiting for different things: each roll call finds
# every rank answering and says what each waits for.
timeout 60 mpirun -n 3 "$build/watchdog_check" 2 > /dev/null 2> "$work/desync_stderr"
status=$?
if [ $status -eq 3 ] && grep -q "every rank answered, so none is stopped" "$work/desync_stderr" \
   && grep -q "for a message from rank 1" "$work/desync_stderr" \
   && grep -q "rank [12] has waited .* for a barrier" "$work/desync_stderr"; then
  pass "desynchronized ranks: the roll call says where each waits"
else
  fail "desynchronized ranks: exit $status: $(head -c 600 "$work/desync_stderr")"
fi

# --- 8. checkpoints: resume, reshard, damage, a killed save, an interrupt ------------
echo "=== checkpoints: resume and reshard bit for bit, damaged checkpoints, a killed save, SIGTERM, the export"
ck=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --warmup 1 --quiet)
# fp16 whose scale doubles every 2 clean steps from 2^16: in 8 steps it
# overflows at steps 3 and 6 (skipped) and changes scale throughout, so the
# part after the step-4 checkpoint holds a skip and scale changes.
# (zero_force_ds_cpu_optimizer false: section 15 offloads it by flag, with
# the trainer's AdamW as the client's optimizer, which DeepSpeed refuses
# under offload without that key.)
echo '{"fp16": {"enabled": true, "initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 1},
      "zero_force_ds_cpu_optimizer": false}' > "$work/fp16_skips.json"
precision_flags() { case $1 in bf16) echo "--precision bf16";; fp16) echo "--config $work/fp16_skips.json";; esac; }
# resumed_matches STRAIGHT RESUMED [skips]: the resumed run's final hash and
# the loss bits, skips and scales of each of its steps equal the straight
# run's; with "skips", its steps include a skipped one and a scale change.
resumed_matches() {
  python3 - "$@" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
straight = {s["step"]: (s["loss_bits"], s["skipped"], s["loss_scale"]) for s in a["steps"]}
mine = [(s["step"], (s["loss_bits"], s["skipped"], s["loss_scale"])) for s in b["steps"]]
problems = []
if a["final_params_hash"] != b["final_params_hash"]: problems.append(f"hash {b['final_params_hash']} != {a['final_params_hash']}")
if not mine: problems.append("no steps resumed")
problems += [f"step {k}" for k, v in mine if straight.get(k) != v]
if len(sys.argv) > 3 and not (any(v[1] for _, v in mine) and len({v[2] for _, v in mine}) > 1):
    problems.append("no skip or no scale change after the checkpoint")
print("ok" if not problems else "; ".join(problems[:4]))
PY
}
# Save at step 4 (and 8) of 8 at every N and stage; resume each from step 4
# at its own N and stage with nothing but --load: the same bits.
for precision in fp32 bf16 fp16; do
  good=0 bad=""
  for N in 1 2 4; do
    for stage in 0 1 2; do
      dir="$work/ck_${precision}_${N}_${stage}"
      if ! timeout 120 mpirun -n $N "$trainer" "${ck[@]}" $(precision_flags $precision) --stage $stage --accum $((4 / N)) \
           --steps 8 --save-every 4 --save "$dir" --json "$dir.straight.json" > "$work/log" 2>&1; then
        bad="$bad (N=$N stage $stage: save run failed: $(head -c 200 "$work/log"))"; continue
      fi
      timeout 120 mpirun -n $N "$trainer" --load "$dir/step_4" --stage $stage --quiet --json "$dir.resumed.json" > "$work/log" 2>&1
      verdict=$(resumed_matches "$dir.straight.json" "$dir.resumed.json" $([ $precision = fp16 ] && echo skips) 2>&1)
      if [ "$verdict" = ok ]; then good=$((good + 1)); else bad="$bad (N=$N stage $stage: $verdict $(head -c 200 "$work/log"))"; fi
    done
  done
  [ -z "$bad" ] && pass "$precision: 4 steps, save, load, 4 more = 8 straight, at N = 1, 2, 4 x stages 0, 1, 2 ($good runs)" ||
    fail "$precision resume:$bad"
done
# The straight runs agree with each other (N and stage never change the bits),
# so every resumed run above equals every straight one.
distinct=$(for f in "$work"/ck_*_*_*.straight.json; do echo "$(basename "$f" | cut -d_ -f2) $(json_get "$f" "d['final_params_hash']")"; done | sort -u | wc -l)
[ "$distinct" -eq 3 ] && pass "straight runs: one hash per precision over every N and stage" || fail "straight runs: $distinct (precision, hash) pairs, want 3"
# Activations (a legitimate change on resume): saved with keep, resumed with offload.
for precision in fp32 bf16 fp16; do
  dir="$work/ck_${precision}_2_2"
  timeout 120 mpirun -n 2 "$trainer" --load "$dir/step_4" --activations offload --quiet --json "$dir.offload.json" > "$work/log" 2>&1
  verdict=$(resumed_matches "$dir.straight.json" "$dir.offload.json" 2>&1)
  [ "$verdict" = ok ] && pass "$precision: saved with --activations keep, resumed with offload: the same bits" || fail "$precision offload resume: $verdict"
done
# Reshard: saved at (N, A, stage) = (4, 1, 2), loaded at (2, 2, 1) and (1, 4, 0);
# saved at (1, 4, 0), loaded at (4, 1, 2). A follows from N.
for precision in fp32 bf16 fp16; do
  bad=""
  for move in "4_2 2 1" "4_2 1 0" "1_0 4 2"; do
    set -- $move
    dir="$work/ck_${precision}_$1"
    timeout 120 mpirun -n $2 "$trainer" --load "$dir/step_4" --stage $3 --quiet --json "$work/reshard.json" > "$work/log" 2>&1
    verdict=$(resumed_matches "$dir.straight.json" "$work/reshard.json" 2>&1)
    [ "$verdict" = ok ] || bad="$bad (from $1 to N=$2 stage $3: $verdict $(head -c 200 "$work/log"))"
  done
  [ -z "$bad" ] && pass "$precision reshard: (4,1,2) -> (2,2,1) and (1,4,0), (1,4,0) -> (4,1,2): the same bits" || fail "$precision reshard:$bad"
done
# Checkpoints saved at different N and stages hold the same bits, and an
# independent reader (numpy only) rebuilds the full tensors from them.
if $PYTHON tests/read_checkpoint.py "$work/ck_fp32_4_2/step_8" --same-as "$work/ck_fp32_1_0/step_8" > "$work/log" 2>&1 &&
   $PYTHON tests/read_checkpoint.py "$work/ck_bf16_2_1/step_4" --same-as "$work/ck_bf16_4_0/step_4" >> "$work/log" 2>&1; then
  pass "read_checkpoint.py: saved at (4,1,2) = saved at (1,4,0), bit for bit (fp32; bf16 likewise)"
else fail "read_checkpoint.py --same-as: $(head -c 400 "$work/log")"; fi
# Consolidation (zero_to_fp32's job, in the trainer): --load --steps 0 --export-hf
# equals the trainer's own export at that step, byte for byte; the reader agrees.
timeout 120 mpirun -n 4 "$trainer" "${ck[@]}" --steps 8 --save "$work/ck_export" --export-hf "$work/own_export" > /dev/null 2>&1
timeout 120 mpirun -n 1 "$trainer" --load "$work/ck_export" --steps 0 --export-hf "$work/consolidated" --quiet > "$work/log" 2>&1
if cmp -s "$work/own_export/model.safetensors" "$work/consolidated/model.safetensors" &&
   cmp -s "$work/own_export/config.json" "$work/consolidated/config.json" &&
   $PYTHON tests/read_checkpoint.py "$work/ck_export/step_8" --compare "$work/own_export" > "$work/reader.log" 2>&1; then
  pass "consolidation: --load (saved by 4 ranks) --steps 0 at N=1 = the run's own export, byte for byte; read_checkpoint.py agrees"
else fail "consolidation: $(head -c 300 "$work/log") $(head -c 300 "$work/reader.log")"; fi
# --save-keep 2 with a save every 2 steps of 8: step_6 and step_8 remain; latest names step_8.
timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 2 --save "$work/ck_keep" --json "$work/ck_keep.json" > /dev/null 2>&1
kept=$(ls "$work/ck_keep" | tr '\n' ' ')
[ "$kept" = "latest step_6 step_8 " ] && [ "$(cat "$work/ck_keep/latest")" = step_8 ] && pass "--save-keep 2: $kept" ||
  fail "--save-keep 2 left: $kept"
# What the run says: the header names what it loaded, the summary what it saved.
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_fp32_4_2" --save "$work/ck_said" --stage 1 > "$work/log" 2>&1
if grep -q "^  loaded    $work/ck_fp32_4_2/step_8: step 8 of 8, saved by 4 rank(s) x accumulation 1, stage 2, fp32" "$work/log" &&
   grep -q "^  saved                    $work/ck_said/step_8/ (" "$work/log" && grep -q "steps trained            none" "$work/log"; then
  pass "the header says what was loaded, the summary what was saved"
else fail "loaded/saved lines: $(grep -E 'loaded|saved|trained' "$work/log" | head -c 300)"; fi

# Damaged checkpoints and contradicting flags: one message naming the file
# or the setting, exit non-zero on every rank, nothing written or changed.
good="$work/ck_fp32_4_2"
before=$(cd "$good" && find . -type f | sort | xargs sha256sum | sha256sum)
damaged() { rm -rf "$work/damaged"; cp -r "$good" "$work/damaged"; }
damaged; truncate -s -100 "$work/damaged/step_4/rank_00001.safetensors"
bad_case "rank_00001.safetensors' has 82,752 bytes; its index says 82,852 (cut short" --load "$work/damaged/step_4"
damaged; python3 -c "
import sys; p = sys.argv[1]; b = bytearray(open(p, 'rb').read()); b[len(b) // 2] ^= 1; open(p, 'wb').write(b)" "$work/damaged/step_4/rank_00002.safetensors"
bad_case "rank_00002.safetensors' is damaged: its SHA-256 is not the one its index records" --load "$work/damaged/step_4"
damaged; rm "$work/damaged/step_4/rank_00003.safetensors"
bad_case "cannot open the checkpoint file '$work/damaged/step_4/rank_00003.safetensors'" --load "$work/damaged/step_4"
damaged; rm "$work/damaged/step_4/index.json"
bad_case "has neither index.json (a step's directory) nor latest" --load "$work/damaged/step_4"
damaged; rm "$work/damaged/step_8/index.json"
bad_case "latest' names 'step_8', which is not a complete checkpoint" --load "$work/damaged"
# An index edited and its index.sha256 made anew (as a forger would): the
# checks behind the digest still name what is wrong.
redigest() { (cd "$1" && sha256sum index.json > index.sha256); }
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

# A rank killed while writing the second checkpoint (tests only:
# ZERO2_TEST_FAULT, rank 1's second file): latest still names step 4, which
# loads and continues to the straight run's bits.
ZERO2_TEST_FAULT="kill 2 1" timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 4 --save "$work/ck_killed" > /dev/null 2>&1
status=$?
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_killed" --quiet --json "$work/after_kill.json" > "$work/log" 2>&1
verdict=$(resumed_matches "$work/ck_keep.json" "$work/after_kill.json" 2>&1)  # the same run, never killed
# When rank 1 dies, mpirun kills rank 0 wherever it is: possibly with its
# own file named but not yet renamed. A temporary may stay inside
# .step_8.incomplete (the next save removes that directory whole), never
# outside it.
stray=$(find "$work/ck_killed" -name '*zero2-tmp*' -not -path '*/.step_8.incomplete/*')
if [ $status -ne 0 ] && [ "$(cat "$work/ck_killed/latest")" = step_4 ] && [ ! -e "$work/ck_killed/step_8" ] && [ "$verdict" = ok ] &&
   [ -d "$work/ck_killed/.step_8.incomplete" ] && [ -z "$stray" ]; then
  pass "a rank killed mid-save: exit $status, latest = step_4, no step_8 (only .step_8.incomplete), no temporary outside it; resuming gives the straight bits"
else fail "killed save: exit $status, latest $(cat "$work/ck_killed/latest"), $verdict, step_8 $([ -e "$work/ck_killed/step_8" ] && echo exists || echo absent), .step_8.incomplete $([ -d "$work/ck_killed/.step_8.incomplete" ] && echo exists || echo absent), temporaries outside it: ${stray:-none}"; fi
# The next save into that directory clears what the killed one left.
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_killed" --steps 0 --save "$work/ck_killed" > "$work/log" 2>&1
[ -z "$(ls -A "$work/ck_killed" | grep incomplete)" ] && pass "the next save removes .step_8.incomplete" ||
  fail "after the next save: $(ls -A "$work/ck_killed" | tr '\n' ' ') $(head -c 200 "$work/log")"
# A step saved again (resumed from step 6 into the same --save), killed while
# writing the replacement of step_8: step_8 is still the old complete one,
# latest still loads it; unkilled, the replacement holds the same bits.
rm -rf "$work/ck_redo"; cp -r "$work/ck_keep" "$work/ck_redo"
ZERO2_TEST_FAULT="kill 1 1" timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_redo/step_6" --save "$work/ck_redo" > /dev/null 2>&1
status=$?
timeout 120 mpirun -n 1 "$trainer" --load "$work/ck_redo" --steps 0 --json "$work/redo_load.json" > "$work/log" 2>&1
loads=$?
timeout 120 mpirun -n 1 "$trainer" --load "$work/ck_redo/step_6" --save "$work/ck_redo" > /dev/null 2>&1
if [ $status -ne 0 ] && [ $loads -eq 0 ] && [ "$(cat "$work/ck_redo/latest")" = step_8 ] &&
   $PYTHON tests/read_checkpoint.py "$work/ck_redo/step_8" --same-as "$work/ck_keep/step_8" > "$work/reader.log" 2>&1 &&
   [ -z "$(ls -A "$work/ck_redo" | grep incomplete)" ]; then
  pass "a re-save of step_8 killed midway leaves the old step_8 loadable; done at N=1, the same bits"
else fail "re-save: exit $status, load $loads, $(head -c 200 "$work/log") $(head -c 200 "$work/reader.log")"; fi

# A save killed after its step was put in place but before latest was
# written (rank 0's 4th file at the first save: its rank file, index.json,
# index.sha256, then latest): no latest. Rerunning the same command is
# refused, naming --load DIR; that command, with the flag it names, resumes
# from the step saved last, says which, and gives the straight run's bits.
rm -rf "$work/ck_nolatest"
ZERO2_TEST_FAULT="kill 4 0" timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 4 --save "$work/ck_nolatest" > /dev/null 2>&1
status=$?
left=$(ls "$work/ck_nolatest" | tr '\n' ' ')
bad_case "continue that run with --load $work/ck_nolatest," "${ck[@]}" --steps 8 --save-every 4 --save "$work/ck_nolatest"
suggested=$(grep -o -- "continue that run with --load [^,]*" "$work/bad_stderr" | sed 's/^continue that run with //')
timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 4 --save "$work/ck_nolatest" $suggested \
  --json "$work/nolatest.json" > "$work/log" 2>&1
resumed=$?
verdict=$(resumed_matches "$work/ck_keep.json" "$work/nolatest.json" 2>&1)
if [ $status -ne 0 ] && [ "$left" = "step_4 " ] && [ -n "$suggested" ] && [ $resumed -eq 0 ] && [ "$verdict" = ok ] &&
   grep -qF "note: '$work/ck_nolatest' has no latest (a save was stopped before it wrote it): took step_4" "$work/log" &&
   [ "$(cat "$work/ck_nolatest/latest")" = step_8 ]; then
  pass "killed before the first latest: left $left; the rerun's refusal names '$suggested', which resumes from step_4 (said), the straight bits"
else fail "killed before latest: exit $status, left '$left', suggested '$suggested', resumed exit $resumed, $verdict: $(head -c 300 "$work/log")"; fi
# Killed at the second save's latest (rank 0's 8th file): latest names
# step_2, step_4 is complete. --load DIR takes step_4 and says so.
rm -rf "$work/ck_oldlatest"
ZERO2_TEST_FAULT="kill 8 0" timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 2 --save "$work/ck_oldlatest" > /dev/null 2>&1
status=$?
left="$(ls "$work/ck_oldlatest" | tr '\n' ' ')latest = $(cat "$work/ck_oldlatest/latest")"
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_oldlatest" --quiet --json "$work/oldlatest.json" > "$work/log" 2>&1
verdict=$(resumed_matches "$work/ck_keep.json" "$work/oldlatest.json" 2>&1)
took=$(json_get "$work/oldlatest.json" "d['checkpoint']['loaded']['step']" 2>&1)
if [ $status -ne 0 ] && [ "$left" = "latest step_2 step_4 latest = step_2" ] && [ "$took" = 4 ] && [ "$verdict" = ok ] &&
   grep -qF "note: '$work/ck_oldlatest/latest' names step_2, but step_4 of the same run was saved after it" "$work/log"; then
  pass "killed before latest moved to step_4: --load DIR takes step_4 (said), the straight bits"
else fail "killed before latest moved: exit $status, left '$left', took step $took, $verdict: $(head -c 300 "$work/log")"; fi
# A run resumed from an earlier step into the same --save (step_6 of
# step_6, step_8): its step_7 is newer than the abandoned step_8, latest
# names it, and --load DIR loads it (the highest number would be step_8).
rm -rf "$work/ck_branch"; cp -r "$work/ck_keep" "$work/ck_branch"
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_branch/step_6" --steps 7 --save "$work/ck_branch" > /dev/null 2>&1
status=$?
timeout 120 mpirun -n 1 "$trainer" --load "$work/ck_branch" --steps 0 --json "$work/branch.json" > "$work/log" 2>&1
took=$(json_get "$work/branch.json" "d['checkpoint']['loaded']['step']" 2>&1)
if [ $status -eq 0 ] && [ "$(ls "$work/ck_branch" | tr '\n' ' ')" = "latest step_6 step_7 step_8 " ] &&
   [ "$(cat "$work/ck_branch/latest")" = step_7 ] && [ "$took" = 7 ] && ! grep -q "note:\|took step" "$work/log"; then
  pass "resumed from step_6 into the same --save: latest names step_7, --load DIR loads it, not the abandoned step_8"
else fail "resumed branch: exit $status, $(ls "$work/ck_branch" | tr '\n' ' '), latest $(cat "$work/ck_branch/latest"), took step $took: $(head -c 300 "$work/log")"; fi
# A user's file in .step_2.incomplete, where this run would write its step
# 2 (--save-every 2): refused before step 1, nothing trained (no --metrics
# file), nothing saved, the file left as it was.
rm -rf "$work/ck_userinc"; mkdir -p "$work/ck_userinc/.step_2.incomplete"
echo mine > "$work/ck_userinc/.step_2.incomplete/notes.txt"
rm -f "$work/userinc_metrics"
bad_case "--save: '$work/ck_userinc/.step_2.incomplete' holds files a save does not write there: move it away" \
  "${ck[@]}" --steps 4 --save-every 2 --save "$work/ck_userinc" --metrics "$work/userinc_metrics"
[ ! -e "$work/userinc_metrics" ] && [ "$(ls -A "$work/ck_userinc" | tr '\n' ' ')" = ".step_2.incomplete " ] &&
  [ "$(cat "$work/ck_userinc/.step_2.incomplete/notes.txt")" = mine ] &&
  pass "a user's file in .step_2.incomplete: refused before step 1, nothing trained or saved, the file kept" ||
  fail "user's .step_2.incomplete: metrics $([ -e "$work/userinc_metrics" ] && echo written || echo absent), left $(ls -A "$work/ck_userinc" | tr '\n' ' ')"
# Pruning keeps the steps saved last, not the highest numbers: resumed from
# step_4 of step_4, step_6, step_8 with a save every 3 steps, the run saves
# step_6 again, then step_9; --save-keep 2 keeps step_6 (this run's) and
# step_9, and prunes the abandoned step_8 (saved before both).
rm -rf "$work/ck_prune_order"
timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 8 --save-every 2 --save-keep 3 --save "$work/ck_prune_order" > /dev/null 2>&1
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_prune_order/step_4" --steps 9 --save-every 3 --save "$work/ck_prune_order" \
  > "$work/log" 2>&1
kept=$(ls "$work/ck_prune_order" | tr '\n' ' ')
[ "$kept" = "latest step_6 step_9 " ] && pass "--save-keep 2 after a resume from step_4: kept $kept(saved last), not the abandoned step_8" ||
  fail "pruning order: kept $kept $(head -c 200 "$work/log")"

# What a review found (each was a wrong result or a raw error before).
# An export that records nothing may run at any N, even one that cannot split the batch:
timeout 120 mpirun -n 3 "$trainer" --load "$work/ck_export" --steps 0 --export-hf "$work/consolidated3" --quiet > "$work/log" 2>&1
cmp -s "$work/own_export/model.safetensors" "$work/consolidated3/model.safetensors" &&
  pass "--load (4 x 1) --steps 0 --export-hf at N=3: the same export" || fail "export at N=3: $(head -c 300 "$work/log")"
# ...but a re-slice records N x A, so it keeps the global batch.
bad_case "the global batch must stay the same" --load "$good" --steps 0 --accum 3 --save "$work/no_reslice"
# --steps 0 --save alone (no --json, no export) re-slices at this N.
timeout 120 mpirun -n 2 "$trainer" --load "$good" --steps 0 --save "$work/ck_reslice" > "$work/log" 2>&1 &&
  $PYTHON tests/read_checkpoint.py "$work/ck_reslice/step_8" --same-as "$good/step_8" > "$work/reader.log" 2>&1 &&
  pass "--load (N=4) --steps 0 --save at N=2: the same bits, saved by 2 ranks" ||
  fail "re-slice: $(head -c 200 "$work/log") $(head -c 200 "$work/reader.log")"
# A consistent DeepSpeed train_batch_size on resume (2 x 2 x 2 = 8 = the saved 4 x 1 x 2).
echo '{"train_batch_size": 8}' > "$work/tbs8.json"
timeout 120 mpirun -n 2 "$trainer" --load "$good/step_4" --config "$work/tbs8.json" --quiet --json "$work/tbs.json" > "$work/log" 2>&1
verdict=$(resumed_matches "$good.straight.json" "$work/tbs.json" 2>&1)
[ "$verdict" = ok ] && pass "resume with a consistent train_batch_size: the same bits" || fail "train_batch_size resume: $verdict $(head -c 200 "$work/log")"
# 16-bit accumulation rounds per micro-step: another A would change the bits.
echo '{"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "bf16"}}' > "$work/bf16_accum.json"
timeout 120 mpirun -n 1 "$trainer" "${ck[@]}" --config "$work/bf16_accum.json" --accum 4 --steps 2 --save "$work/ck_bf16_accum" > /dev/null 2>&1
bad_ranks=4 bad_case "accumulates gradients in bf16 (data_types.grad_accum_dtype), which rounds after every micro-step" \
  --load "$work/ck_bf16_accum"
# An index whose fields have the wrong type or value, named with the file.
index_edit() {  # python statement on d (the index), then the bad_case's expected text
  damaged; python3 -c "
import json, sys; p = sys.argv[1]; d = json.load(open(p)); $1; json.dump(d, open(p, 'w'))" "$work/damaged/step_4/index.json"
  redigest "$work/damaged/step_4"
  bad_case "$2" --load "$work/damaged/step_4"
}
index_edit "d['settings']['precision'] = 'fp8'" "wants fp32|bf16|fp16 (got 'fp8')"
index_edit "d['format'] = 5" "is not a zero2 checkpoint index"
index_edit "d['files'][0]['file'] = 7" "'files.0.file' = 7 is not a string"
index_edit "d['files'][2]['bytes'] = -1" "'files.2.bytes' = -1 is not an integer"
index_edit "d['data']['bytes'] = '12'" "'data.bytes' = \"12\" is not an integer"
index_edit "d['accum'] = 2**31 - 1" "'accum' = 2147483647 is not an integer from 1 to 1048576"
damaged; python3 -c "
import sys; p = sys.argv[1]; b = bytearray(open(p, 'rb').read()); n = int.from_bytes(b[:8], 'little')
h = b[8:8 + n].decode().replace('\"master\":{', '\"master\":5,\"x\":{', 1); b[8:8 + n] = h.encode()[:n].ljust(n)
open(p, 'wb').write(b)" "$work/damaged/step_4/rank_00000.safetensors"
bad_case "rank_00000.safetensors' is damaged" --load "$work/damaged/step_4"
bad_case "--load '$work/nonexistent' does not exist" --load "$work/nonexistent"
# One-bit flips that keep index.json valid JSON (the last digit of a value,
# d -> d xor 1: lr 0.001 -> 0.000, seed 1 -> 0, a parameter's numel, a file's
# size...), or a flipped digit of index.sha256: each is damage, refused.
flip_digit() {  # file, key: flip the lowest bit of the last digit of the first "key": value
  python3 - "$@" <<'PY'
import re, sys
p, key = sys.argv[1:3]; b = bytearray(open(p, 'rb').read())
m = re.search(rb'"' + key.encode() + rb'": (-?[0-9.e+-]+)', b)
at = m.end(1) - 1
while not chr(b[at]).isdigit(): at -= 1
b[at] ^= 1; open(p, 'wb').write(b)
PY
}
flips=""
for key in lr weight_decay beta2 seed dropout eps clip schedule_steps warmup loss_scale applied numel bytes; do
  damaged; flip_digit "$work/damaged/step_4/index.json" $key
  bad_ranks=1 bad_case "index.json' is damaged: its SHA-256 is not the one" --load "$work/damaged/step_4" > "$work/flip.log"
  grep -q "^PASS" "$work/flip.log" && passed=$((passed - 1)) || { failed=$((failed - 1)); flips="$flips $key: $(cat "$work/flip.log")"; }
done
damaged; sed -i 's/^./x/' "$work/damaged/step_4/index.sha256"
bad_ranks=1 bad_case "index.json' is damaged: its SHA-256 is not the one" --load "$work/damaged/step_4" > "$work/flip.log"
grep -q "^PASS" "$work/flip.log" && passed=$((passed - 1)) || { failed=$((failed - 1)); flips="$flips index.sha256: $(cat "$work/flip.log")"; }
[ -z "$flips" ] && pass "one-bit flips of lr, weight decay, beta2, seed, dropout, eps, clip, schedule steps, warmup, the loss scale, AdamW's t, a parameter's numel, a file's size in index.json, and of index.sha256: each refused as damage" ||
  fail "index flips:$flips"
damaged; rm "$work/damaged/step_4/index.sha256"
bad_case "index.json' is damaged: '$work/damaged/step_4/index.sha256', which records its SHA-256, is missing" --load "$work/damaged/step_4"
sed -i 's/"version": 2/"version": 1/' "$work/damaged/step_4/index.json"
bad_case "was written by an earlier zero2 (checkpoint version 1, whose index.json has no SHA-256 of its own" --load "$work/damaged/step_4"
# A loss scale no training reaches (the digest made anew): damage, not divergence.
index_edit "d['progress']['loss_scale'] = 1e308" "progress.loss_scale 1e+308 cannot come from training (fp32 trains at loss scale 1)"
damaged() { rm -rf "$work/damaged"; cp -r "$work/ck_fp16_2_2" "$work/damaged"; }
index_edit "d['progress']['loss_scale'] = 1000.0" "progress.loss_scale 1000.0 cannot come from training (the dynamic scale is a power of two"
damaged() { rm -rf "$work/damaged"; cp -r "$good" "$work/damaged"; }
# latest as a symlink loop, or holding a NUL byte: said as such.
damaged; ln -sfn latest "$work/damaged/latest"
bad_case "'$work/damaged/latest' cannot be read: Too many levels of symbolic links (a symlink loop" --load "$work/damaged"
damaged; printf 'step_8\0step_4' > "$work/damaged/latest"
bad_case "'$work/damaged/latest' holds a NUL byte (at byte 6)" --load "$work/damaged"
# A resume whose split sums in another tree (notes/06): saved at (N, A) =
# (2, 3), N = 3 (A = 2) is refused, naming the splits that keep the bits;
# N = 1 (A = 6) keeps them; --allow-different-bits runs N = 3, recorded.
timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --accum 3 --steps 2 --save-every 1 --save "$work/ck_2x3" --json "$work/ck_2x3.json" > /dev/null 2>&1
bad_ranks=3 bad_case "resuming at N = 3 (A = 2) sums each step's 6 micro-batches in another tree than the checkpoint's run at N = 2 (A = 3)" \
  --load "$work/ck_2x3/step_1"
grep -qF "Splits that keep them: N = 1 (A = 6), N = 2 (A = 3), N = 6 (A = 1); or give --allow-different-bits" "$work/bad_stderr" &&
  pass "the refused N = 3 resume names the splits that keep the bits" || fail "N = 3 refusal: $(cat "$work/bad_stderr")"
timeout 120 mpirun -n 1 "$trainer" --load "$work/ck_2x3/step_1" --quiet --json "$work/ck_2x3_n1.json" > "$work/log" 2>&1
verdict=$(resumed_matches "$work/ck_2x3.json" "$work/ck_2x3_n1.json" 2>&1)
[ "$verdict" = ok ] && pass "saved at (2, 3), resumed at (1, 6): the same bits" || fail "(2, 3) -> (1, 6): $verdict $(head -c 200 "$work/log")"
timeout 120 mpirun -n 3 "$trainer" --load "$work/ck_2x3/step_1" --allow-different-bits --quiet --json "$work/ck_2x3_n3.json" > "$work/log" 2>&1 &&
  [ "$(json_get "$work/ck_2x3_n3.json" "(d['checkpoint']['allow_different_bits'], d['checkpoint']['loaded']['same_summation_tree'])")" = "(True, False)" ] &&
  pass "--allow-different-bits resumes at N = 3, and the JSON records it" || fail "--allow-different-bits: $(head -c 300 "$work/log")"
# Two runs saving into one directory: the second is refused before step 1
# (the first holds the directory's lock; here the shell holds it).
mkdir -p "$work/ck_busy"
exec {busy}< "$work/ck_busy"
flock -x $busy
bad_case "--save '$work/ck_busy' is in use: another run is saving into it" "${ck[@]}" --steps 1 --save "$work/ck_busy"
exec {busy}<&-
# Without the lock (a file system without flock), a step removed under a
# save by another process: the message names a concurrent saver. Rank 1 is
# stopped halfway through its file (ZERO2_TEST_FAULT) while the step's
# directory is removed, then continued.
ZERO2_TEST_FAULT="stop 1 1" timeout 60 mpirun -n 2 "$trainer" "${ck[@]}" --steps 1 --save "$work/ck_vanish" > "$work/vanish.log" 2>&1 &
job=$!
stopped=""
for k in $(seq 1 400); do
  for p in $(pgrep -f "^$trainer .*$work/ck_vanish"); do [ "$(cut -d' ' -f3 /proc/$p/stat 2>/dev/null)" = T ] && stopped=$p; done
  [ -n "$stopped" ] && break
  sleep 0.05
done
rm -rf "$work/ck_vanish/.step_1.incomplete"
[ -n "$stopped" ] && kill -CONT "$stopped"
wait $job
status=$?
[ $status -ne 0 ] && grep -q "another run saving into the same directory at the same time is the likely cause" "$work/vanish.log" &&
  pass "a step removed under a save: exit $status, the message names a concurrent saver" ||
  fail "vanished step: exit $status, stopped rank '${stopped}': $(head -c 300 "$work/vanish.log")"
# A new run into another run's checkpoints is refused and deletes nothing;
# --save-overwrite replaces its latest and the steps it saves, and prunes
# none of the other run's.
damaged; before_other=$(cd "$work/damaged" && find . -type f | sort | xargs sha256sum | sha256sum)
bad_case "--save '$work/damaged' holds checkpoints of another run ($work/damaged/step_4)" "${ck[@]}" --steps 2 --save-keep 1 --save "$work/damaged"
[ "$(cd "$work/damaged" && find . -type f | sort | xargs sha256sum | sha256sum)" = "$before_other" ] &&
  pass "the refused new run left the other run's checkpoints as they were" || fail "the refused new run changed $work/damaged"
timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 2 --save-keep 1 --save "$work/damaged" --save-overwrite > "$work/log" 2>&1 &&
  [ "$(ls "$work/damaged" | tr '\n' ' ')" = "latest step_2 step_4 step_8 " ] && [ "$(cat "$work/damaged/latest")" = step_2 ] &&
  pass "--save-overwrite: latest names the new run's step_2, the other run's steps stay" ||
  fail "--save-overwrite: $(ls "$work/damaged" | tr '\n' ' ') $(head -c 200 "$work/log")"
# Pruning deletes only this run's steps: a user's step_1/ (notes.txt in it)
# stays; a plain file step_4 where this run would save step 4 is refused up
# front, not replaced.
timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 2 --save "$work/ck_user" > /dev/null 2>&1
mkdir "$work/ck_user/step_1"; echo mine > "$work/ck_user/step_1/notes.txt"; echo mine > "$work/ck_user/step_4"
bad_case "'$work/ck_user/step_4' is not a checkpoint of this run (not a directory), and this run may save step 4 there" \
  --load "$work/ck_user" --steps 4 --save "$work/ck_user"
[ "$(cat "$work/ck_user/step_4")" = mine ] && pass "the plain file step_4 is left as it was" || fail "step_4 was changed"
rm "$work/ck_user/step_4"
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_user" --steps 4 --save-every 1 --save-keep 1 --save "$work/ck_user" > "$work/log" 2>&1 &&
  [ "$(ls "$work/ck_user" | tr '\n' ' ')" = "latest step_1 step_4 " ] && [ "$(cat "$work/ck_user/step_1/notes.txt")" = mine ] &&
  pass "--save-keep 1 pruned this run's step_2 and step_3, not the user's step_1/notes.txt" ||
  fail "pruning with a user's step_1: $(ls "$work/ck_user" | tr '\n' ' ') $(head -c 200 "$work/log")"
# A directory named like a step but too large for a number is not one.
mkdir -p "$work/ck_odd/step_99999999999999999999"
timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" --steps 2 --save "$work/ck_odd" --json "$work/odd.json" > "$work/log" 2>&1 &&
  [ -f "$work/odd.json" ] && [ -d "$work/ck_odd/step_99999999999999999999" ] &&
  pass "a stray step_99999999999999999999 is left alone" || fail "stray step directory: $(head -c 200 "$work/log")"
# --data as a relative path, resumed from another working directory.
cp "$work/corpus.txt" "$work/relative.txt"
trainer_path=$(realpath "$trainer")  # the subshells below change directory
(cd "$work" && timeout 120 mpirun -n 2 "$trainer_path" "${ck[@]}" --steps 4 --save-every 2 --data relative.txt --save ck_relative \
   --json relative_straight.json > /dev/null 2>&1)
(cd / && timeout 120 mpirun -n 2 "$trainer_path" --load "$work/ck_relative/step_2" --quiet --json "$work/relative_resumed.json" > "$work/log" 2>&1)
verdict=$(resumed_matches "$work/relative_straight.json" "$work/relative_resumed.json" 2>&1)
[ "$verdict" = ok ] && pass "--data relative.txt, resumed from another directory: found, the same bits" ||
  fail "relative --data resume: $verdict $(head -c 200 "$work/log")"

# SIGTERM (a scheduler's preemption) to mpirun mid-run at N = 2, once step
# 100 of 3000 has been printed: every rank finishes its step, saves, writes
# the JSON marked interrupted, exits 143; resuming from what was saved gives
# the uninterrupted run's bits.
send_when_running() {  # signal, stdout file, process pattern: signal once step 100 is printed
  for k in $(seq 1 400); do
    grep -q "^step   100/" "$2" 2>/dev/null && break
    sleep 0.05
  done
  pkill -$1 -f "$3"
}
long=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --warmup 1
      --log-every 100 --steps 3000)
timeout 120 mpirun -n 2 "$trainer" "${long[@]}" --save "$work/ck_term" --json "$work/term.json" > "$work/term_stdout" 2>&1 &
job=$!
# SIGTERM to every rank, as a scheduler's cancel (scancel) sends it.
send_when_running TERM "$work/term_stdout" "^$trainer .*$work/ck_term"
wait $job
status=$?
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_term" --quiet --json "$work/term_resumed.json" > "$work/log" 2>&1
timeout 120 mpirun -n 2 "$trainer" "${long[@]}" --quiet --json "$work/term_straight.json" > /dev/null 2>&1
verdict=$(resumed_matches "$work/term_straight.json" "$work/term_resumed.json" 2>&1)
stopped_at=$(json_get "$work/term.json" "str(d['interrupted']) + ' ' + str(d['checkpoint']['saved'][-1]['step'])" 2>&1)
if [ $status -eq 143 ] && [ "${stopped_at%% *}" = SIGTERM ] && [ "$(cat "$work/ck_term/latest")" = "step_${stopped_at##* }" ] &&
   [ "${stopped_at##* }" -lt 3000 ] && [ "$verdict" = ok ]; then
  pass "SIGTERM at step ${stopped_at##* } of 3000: exit 143, saved, JSON interrupted; resumed = uninterrupted, bit for bit"
else fail "SIGTERM: exit $status, '$stopped_at', $verdict $(head -c 200 "$work/log")"; fi
# SIGINT (Ctrl-C on a rank run in the foreground): exit 130 and the checkpoint.
timeout 120 mpirun -n 2 "$trainer" "${long[@]}" --save "$work/ck_int" > "$work/int_stdout" 2>&1 &
job=$!
send_when_running INT "$work/int_stdout" "^$trainer .*$work/ck_int"
wait $job
status=$?
[ $status -eq 130 ] && [ -e "$work/ck_int/latest" ] && grep -q "interrupted .* by SIGINT after step" "$work/int_stdout" &&
  pass "SIGINT: exit 130, saved $(cat "$work/ck_int/latest")" || fail "SIGINT: exit $status, latest: $(cat "$work/ck_int/latest" 2>&1)"
# A signal to mpirun: MPICH's launcher forwards it to the ranks, which stop
# and save; the launcher's own exit status is its own (seen 0), not checked.
timeout 120 mpirun -n 2 "$trainer" "${long[@]}" --save "$work/ck_mpirun" > "$work/mpirun_stdout" 2>&1 &
job=$!
send_when_running TERM "$work/mpirun_stdout" "^mpirun -n 2 $trainer .*$work/ck_mpirun"
wait $job
[ -e "$work/ck_mpirun/latest" ] && grep -q "interrupted .* by SIGTERM after step" "$work/mpirun_stdout" &&
  pass "SIGTERM to mpirun: forwarded, saved $(cat "$work/ck_mpirun/latest")" ||
  fail "SIGTERM to mpirun: latest: $(cat "$work/ck_mpirun/latest" 2>&1)"

# --- 9. DeepSpeed configs as people write them ------------------------------------
if wanted 9; then  # (Z2_TRAINER_SKIP)
echo "=== DeepSpeed configs: real files (tests/ds_configs), what DeepSpeed makes of them, every refused key at once, the schedule"
ds=tests/ds_configs
tiny=(--layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 --max-positions 20 --quiet)
# config, then a python expression over the run's JSON d that must hold
ds_runs() {
  local config=$1 check=$2; shift 2
  rm -f "$work/ds_run.json"
  if timeout 120 mpirun -n 2 "$trainer" --config "$ds/$config" "${tiny[@]}" --steps 2 "$@" --json "$work/ds_run.json" \
       > "$work/ds_stdout" 2> "$work/ds_stderr" &&
     [ "$(json_get "$work/ds_run.json" "bool($check)")" = True ]; then
    pass "$config runs: $check"
  else fail "$config: $(head -c 300 "$work/ds_stderr") $(json_get "$work/ds_run.json" "$check" 2>&1 | tail -n 1)"; fi
}
# What a file means where it leaves a key out is DeepSpeed 0.16.9's default
# (notes/07): no zero_optimization is stage 0, no gradient_clipping is 0,
# FusedAdam's weight decay is 0, an fp16 block without scaler keys starts at
# 2^32 with hysteresis 1 (DynamicLossScaler()), one with some at the fp16
# section's 2^16 and 2; "auto" keeps the trainer's default.
o="d['settings_origin']"
ds_runs autotuning_hf_fp16_z2.json "d['precision'] == 'fp16' and d['stage'] == 2 and d['micro_batch'] == 8 and d['steps'][0]['loss_scale'] == 2**32 and d['loss_scaling']['hysteresis'] == 1 and d['optimizer']['clip'] == 0 and d['optimizer']['weight_decay'] == 0.01 and $o['weight_decay'] == 'trainer_default' and $o['initial_scale_power'] == 'deepspeed_default:DynamicLossScaler()' and d['schedule']['convention'] == 'none'"
ds_runs open_assistant_zero.json "d['precision'] == 'fp32' and d['stage'] == 2 and not d['overlap'] and d['bucket'] == 1000000000 and d['schedule']['warmup_type'] == 'log' and d['schedule']['convention'] == 'deepspeed' and $o['warmup'] == 'trainer_default:auto' and $o['clip'] == 'trainer_default:auto'"
ds_runs axolotl_zero1.json "d['stage'] == 1 and d['precision'] == 'fp32' and d['overlap'] and $o['stage'] == 'config:zero_optimization.stage'"
ds_runs getting_started.json "d['stage'] == 1 and d['micro_batch'] == 4 and d['accum'] == 1 and d['precision'] == 'fp16' and d['schedule']['lr'] == 0.00015 and d['optimizer']['weight_decay'] == 0 and $o['weight_decay'] == 'deepspeed_default:FusedAdam' and d['optimizer']['clip'] == 0 and d['steps'][0]['loss_scale'] == 2**32 and d['loss_scaling']['hysteresis'] == 1 and $o['micro_batch'] == 'derived:train_batch_size' and $o['lr'] == 'config:optimizer.params.lr'"
ds_runs hand_written.json "d['precision'] == 'bf16' and d['activations'] == 'offload' and d['alloc'] == 'arena' and d['schedule']['decay'] == 'none' and d['micro_batch'] == 4 and all('forward_ms' in s for s in d['steps'])"
ds_runs chatglm_ptuning.json "d['stage'] == 2 and d['optimizer']['clip'] == 0 and $o['clip'] == 'deepspeed_default:constants.py' and d['loss_scaling']['initial_scale_power'] == 16 and d['loss_scaling']['hysteresis'] == 2 and not d['overlap'] and $o['precision'] == 'trainer_default:auto'"
ds_runs chatglm_ptuning.json "d['precision'] == 'fp16' and d['steps'][0]['loss_scale'] == 2**16 and d['loss_scaling']['hysteresis'] == 2 and $o['precision'] == 'flag:--precision'" --precision fp16
ds_runs qanet_bsz512_warmup.json "d['stage'] == 0 and $o['stage'] == 'deepspeed_default:DeepSpeedZeroConfig' and d['optimizer']['clip'] == 0 and d['optimizer']['weight_decay'] == 3e-7 and d['optimizer']['betas'] == [0.8, 0.999] and d['schedule']['warmup'] == 1000 and d['schedule']['decay'] == 'none' and d['schedule']['convention'] == 'deepspeed' and len(d['steps']) == 3" --steps 3
ds_runs accelerate_zero_stage2.json "d['precision'] == 'fp16' and d['schedule']['convention'] == 'deepspeed' and d['optimizer']['weight_decay'] == 0.01 and $o['weight_decay'] == 'trainer_default:auto' and $o['warmup_type'] == 'deepspeed_default:WarmupDecayLR'"
ds_runs open_instruct_stage2.json "d['stage'] == 2 and d['overlap'] and $o['lr'] == 'trainer_default' and $o['weight_decay'] == 'trainer_default' and d['schedule']['convention'] == 'none' and all(s['lr'] == 0.001 for s in d['steps'])"
# ZeRO-Offload's configs (they run the engine's offloaded step): transformers' and HelloDeepSpeed's.
ds_runs hf_transformers_zero2.json "d['stage'] == 2 and d['offload_optimizer'] == 'cpu' and $o['offload_optimizer'] == 'config:zero_optimization.offload_optimizer.device' and d['memory']['host_model_states_bytes'] == 16 * d['params_padded'] // 2"
ds_runs hello_deepspeed.json "d['stage'] == 1 and d['precision'] == 'bf16' and d['offload_optimizer'] == 'cpu' and d['optimizer']['weight_decay'] == 0 and d['memory']['host_model_states_bytes'] == 16 * d['params_padded'] // 2"
ds_runs llama_factory_ds_z2.json "d['stage'] == 2 and [w.split(\"'\")[1] for w in d['config_warnings']] == ['comms_config', 'monitor_config'] and all('DeepSpeed ignores it' in w for w in d['config_warnings'])"
# Its ignored keys: a WARNING line each in the header; with --quiet, on stderr.
timeout 120 mpirun -n 2 "$trainer" --config "$ds/llama_factory_ds_z2.json" "${tiny[@]}" --steps 1 2> "$work/ds_stderr" > /dev/null
quiet_warnings=$(grep -c "^train_bert_mini: warning: config key '\(comms\|monitor\)_config' is not a key DeepSpeed reads: DeepSpeed ignores it" "$work/ds_stderr")
timeout 120 mpirun -n 2 "$trainer" --config "$ds/llama_factory_ds_z2.json" --layers 1 --hidden 16 --heads 2 --intermediate 32 \
  --seq 16 --max-positions 20 --steps 1 > "$work/ds_stdout" 2>&1
header_warnings=$(grep -c "^  WARNING   config key '\(comms\|monitor\)_config' is not a key DeepSpeed reads" "$work/ds_stdout")
[ "$quiet_warnings" = 2 ] && [ "$header_warnings" = 2 ] && ! grep -q "warning" <(grep -v WARNING "$work/ds_stdout") &&
  pass "LLaMA-Factory's ignored keys: a WARNING line each in the header, on stderr with --quiet (rank 0 alone)" ||
  fail "ignored keys' warnings: $quiet_warnings on stderr, $header_warnings in the header: $(head -c 300 "$work/ds_stderr")"
# The header names the file and each setting's source.
timeout 120 mpirun -n 2 "$trainer" --config "$ds/getting_started.json" --layers 1 --hidden 16 --heads 2 --intermediate 32 \
  --seq 16 --max-positions 20 --steps 1 > "$work/ds_stdout" 2>&1
grep -q "^  config    $ds/getting_started.json: read as DeepSpeed 0.16.9 reads it" "$work/ds_stdout" &&
  grep -q "^            the config: stage 1 (zero_optimization)" "$work/ds_stdout" &&
  tr '\n' ' ' < "$work/ds_stdout" | grep -q "DeepSpeed's defaults: .*weight_decay 0, *bias_correction true *\[FusedAdam\]" &&
  grep -q "^  optimizer AdamW lr 0.00015 at every step (no scheduler" "$work/ds_stdout" &&
  pass "the header names the config and where each setting came from (the file, DeepSpeed's default, the trainer's)" ||
  fail "config header: $(grep -A8 '^  optimizer' "$work/ds_stdout" | head -c 600)"
# Without --config nothing of this applies: the trainer's defaults, --precision fp16's 2^16 and hysteresis 2.
timeout 120 mpirun -n 2 "$trainer" "${tiny[@]}" --steps 2 --precision fp16 --json "$work/ds_none.json" > /dev/null 2>&1
[ "$(json_get "$work/ds_none.json" "(d['stage'], d['optimizer']['weight_decay'], d['optimizer']['clip'], d['steps'][0]['loss_scale'], d['loss_scaling']['hysteresis'], d['schedule']['convention'], d['config'], sorted(set(v for k, v in d['settings_origin'].items() if k != 'precision')), d['settings_origin']['precision'])")" = \
  "(2, 0.01, 1.0, 65536.0, 2, 'zero2', None, ['trainer_default'], 'flag:--precision')" ] &&
  pass "without --config: stage 2, weight decay 0.01, clip 1, fp16 from 2^16 with hysteresis 2, the trainer's schedule" ||
  fail "no config: $(json_get "$work/ds_none.json" "(d['stage'], d['optimizer'], d['steps'][0]['loss_scale'], d['loss_scaling'], d['schedule'], d['settings_origin'])" 2>&1 | head -c 400)"
# The optimizer's constructor decides the weight decay a file leaves out:
# FusedAdam's 0; torch.optim.AdamW's 1e-2 with "torch_adam": true (which
# takes no bias_correction: DeepSpeed's call would raise TypeError); an fp16
# block with one scaler key takes the section's defaults for the rest.
echo '{"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}' > "$work/ds_fused.json"
echo '{"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": true}}}' > "$work/ds_torch_adam.json"
echo '{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true, "loss_scale_window": 500}}' > "$work/ds_one_scaler_key.json"
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_fused.json" "${tiny[@]}" --steps 1 --json "$work/ds_fused_run.json" > /dev/null 2>&1
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_torch_adam.json" "${tiny[@]}" --steps 1 --json "$work/ds_torch_run.json" > /dev/null 2>&1
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_one_scaler_key.json" "${tiny[@]}" --steps 1 --json "$work/ds_scaler_run.json" > /dev/null 2>&1
[ "$(json_get "$work/ds_fused_run.json" "(d['optimizer']['weight_decay'], d['settings_origin']['weight_decay'])")" = "(0.0, 'deepspeed_default:FusedAdam')" ] &&
  [ "$(json_get "$work/ds_torch_run.json" "(d['optimizer']['weight_decay'], d['settings_origin']['weight_decay'])")" = "(0.01, 'deepspeed_default:torch.optim.AdamW')" ] &&
  [ "$(json_get "$work/ds_scaler_run.json" "(d['steps'][0]['loss_scale'], d['loss_scaling']['window'], d['loss_scaling']['hysteresis'])")" = "(65536.0, 500, 2)" ] &&
  pass "left out: weight decay 0 (FusedAdam), 0.01 (torch_adam: torch.optim.AdamW); fp16 with one scaler key: 2^16, hysteresis 2" ||
  fail "optimizer / scaler defaults: $(json_get "$work/ds_fused_run.json" "d['optimizer']" 2>&1 | tail -n 1) $(json_get "$work/ds_torch_run.json" "d['optimizer']" 2>&1 | tail -n 1) $(json_get "$work/ds_scaler_run.json" "d['loss_scaling']" 2>&1 | tail -n 1)"

# Refused: every unsupported key of the file in one message (bad_case: one message, exit non-zero).
ds_refused() {  # config, the number of refused keys, then fragments each of which the message must hold
  local config=$1 count=$2; shift 2
  bad_case "has $count setting" --config "$config" "${tiny[@]}" --steps 2
  for fragment in "$@"; do
    grep -qF -- "$fragment" "$work/bad_stderr" || fail "$config: the message lacks '$fragment'"
  done
}
# Megatron's partition_activations splits checkpoints across model-parallel
# ranks: with none (size 1) the part is the whole, so it runs (the header notes it).
ds_runs megatron_zero2.json "d['stage'] == 2 and d['activations'] == 'keep' and d['precision'] == 'fp16'"
# cifar's cpu_offload is ZeRO-Offload's old spelling (taken); its fp16 master is not.
ds_refused "$ds/cifar.json" 1 "fp16.fp16_master_weights_and_grads: true is not supported"
ds_refused "$ds/bing_bert_bsz4096_adam.json" 1 "optimizer.params.max_grad_norm: DeepSpeed refuses it (engine.py _configure_basic_optimizer raises ValueError"
ds_refused "$ds/bingbertsquad_bsz24.json" 1 "optimizer.params.max_grad_norm: DeepSpeed refuses it" "write the clip as gradient_clipping"
ds_refused "$ds/bing_bert_lamb_64k_seq128.json" 4 "optimizer.type: \"Lamb\" is not supported: a DeepSpeed feature not implemented here" \
  "optimizer.params.max_coeff: a DeepSpeed feature not implemented here (Lamb's parameter)" \
  "optimizer.params.min_coeff: a DeepSpeed feature not implemented here (Lamb's parameter)" "sparse_attention: a DeepSpeed feature not implemented here"
ds_refused "$ds/transformers_zero3.json" 2 "zero_optimization.stage: 3 is not supported" "zero_optimization.reduce_bucket_size: wants"
# Issue 39's public ZeRO-2 configs (tests/ds_configs/README.md: each source, and what DeepSpeed 0.16.9 does with it).
ds_runs qwen_finetune_zero2.json "d['stage'] == 2 and d['precision'] == 'fp32' and d['overlap'] and d['bucket'] == 200000000 and d['offload_optimizer'] == 'none' and d['schedule']['convention'] == 'deepspeed' and d['schedule']['decay'] == 'none' and d['schedule']['lr'] == 0.001 and $o['warmup'] == 'trainer_default:auto' and [s['lr'] for s in d['steps']] == [0.0, 0.0] and d['optimizer']['clip'] == 1 and $o['clip'] == 'trainer_default:auto'"
ds_runs internvl_chat_zero2.json "d['stage'] == 2 and d['precision'] == 'fp32' and d['overlap'] and d['bucket'] == 100000000 and d['optimizer']['betas'] == [0.9, 0.999] and d['optimizer']['weight_decay'] == 0.01 and $o['weight_decay'] == 'trainer_default:auto' and d['optimizer']['clip'] == 1 and d['schedule']['convention'] == 'none' and all(s['lr'] == 0.001 for s in d['steps'])"
ds_runs internvl_chat_zero2.json "d['precision'] == 'fp16' and d['steps'][0]['loss_scale'] == 2**32 and d['loss_scaling']['hysteresis'] == 2 and d['loss_scaling']['min_scale'] == 1" --precision fp16
ds_runs internvl_seg_adam_zero2_fp16.json "d['stage'] == 2 and d['precision'] == 'fp16' and d['micro_batch'] == 8 and d['accum'] == 1 and d['steps'][0]['loss_scale'] == 2**32 and d['loss_scaling']['hysteresis'] == 1 and d['optimizer']['weight_decay'] == 0 and d['optimizer']['clip'] == 0 and all(s['lr'] == 4e-5 for s in d['steps']) and [w.split(\"'\")[1] for w in d['config_warnings']] == ['log']"
ds_runs gan.json "d['stage'] == 0 and d['precision'] == 'fp32' and d['micro_batch'] == 32 and d['accum'] == 1 and d['optimizer']['betas'] == [0.5, 0.999] and d['optimizer']['weight_decay'] == 0 and $o['weight_decay'] == 'deepspeed_default:FusedAdam' and d['optimizer']['clip'] == 0 and d['schedule']['convention'] == 'none' and all(s['lr'] == 0.0002 for s in d['steps'])"
ds_runs megatron_zero2_cpu_offload.json "d['stage'] == 2 and d['precision'] == 'fp16' and d['offload_optimizer'] == 'cpu' and $o['offload_optimizer'] == 'config:zero_optimization.cpu_offload' and d['optimizer']['clip'] == 1 and d['optimizer']['weight_decay'] == 0 and $o['weight_decay'] == 'deepspeed_default:DeepSpeedCPUAdam' and d['loss_scaling']['initial_scale_power'] == 16 and d['loss_scaling']['hysteresis'] == 2 and d['micro_batch'] == 8 and d['activations'] == 'keep'"
ds_runs trlx_sft_gptj.json "d['stage'] == 2 and d['precision'] == 'fp16' and d['offload_optimizer'] == 'cpu' and d['optimizer']['betas'] == [0.9, 0.95] and d['optimizer']['weight_decay'] == 0 and d['optimizer']['clip'] == 0 and d['schedule']['lr'] == 1e-5 and $o['lr'] == 'config:scheduler.params.warmup_max_lr' and $o['warmup'] == 'trainer_default:auto' and d['micro_batch'] == 64 and [w.split(\"'\")[1] for w in d['config_warnings']] == ['fp16.opt_level']"
ds_runs trlx_reward_model_gptj.json "d['stage'] == 2 and d['precision'] == 'fp16' and d['offload_optimizer'] == 'cpu' and d['schedule']['lr'] == 1e-5 and d['schedule']['warmup'] == 100 and d['schedule']['convention'] == 'deepspeed' and d['optimizer']['clip'] == 0 and d['micro_batch'] == 16 and d['loss_scaling']['min_scale'] == 1 and d['loss_scaling']['initial_scale_power'] == 16" --lr 1e-5
bad_case "but optimizer.params.lr is 1e-5: Hugging Face's Trainer fills both keys from its one learning_rate" --config "$ds/trlx_reward_model_gptj.json" "${tiny[@]}" --steps 2
ds_runs wenet_whisper_ds_stage2.json "d['stage'] == 2 and d['precision'] == 'bf16' and $o['precision'] == 'config:bf16.enabled' and d['optimizer']['clip'] == 5 and not d['overlap'] and d['micro_batch'] == 1 and d['offload_optimizer'] == 'none' and $o['lr'] == 'trainer_default' and d['schedule']['convention'] == 'none'"
ds_runs wenet_s0_ds_stage2.json "d['stage'] == 2 and d['precision'] == 'fp32' and $o['precision'] == 'config:fp16.enabled' and d['optimizer']['clip'] == 0.0001 and d['overlap'] and d['bucket'] == 10000000 and d['activations'] == 'keep' and d['config_warnings'] == []"
ds_runs ms_swift_zero2.json "d['stage'] == 2 and d['precision'] == 'fp32' and not d['overlap'] and d['bucket'] == 200000000 and d['optimizer']['clip'] == 1 and $o['clip'] == 'trainer_default:auto' and $o['lr'] == 'trainer_default' and d['schedule']['convention'] == 'none'"
ds_runs ms_swift_zero2_autotp.json "d['stage'] == 2 and d['precision'] == 'fp32' and not d['overlap'] and d['optimizer']['clip'] == 1 and d['schedule']['convention'] == 'none'"
ds_refused "$ds/axolotl_zero2_torch_compile.json" 2 "compile.backend: not a field of DeepSpeed 0.16.9's CompileConfig" "compile.disable: not a field of DeepSpeed 0.16.9's CompileConfig"
ds_refused "$ds/megatron_zero_offload.json" 1 "optimizer.type: \"DeepSpeed_Adam\" is not an optimizer DeepSpeed knows (engine.py _do_sanity_check asserts _is_supported_optimizer"
ds_refused "$ds/megatron_zero_offload_10b.json" 1 "zero_optimization.comm_overlap: not a DeepSpeed key this trainer knows (did you mean 'zero_optimization.overlap_comm'?)"
for config in fastchat_s2 trlx_ppo_gptj_summarize ms_swift_zero2_offload; do  # ZeRO-Offload with the client's optimizer
  bad_case "config key 'zero_optimization.offload_optimizer.device' offloads the optimizer, and the config file names no optimizer \"type\", so the optimizer is the client's" --config "$ds/$config.json" "${tiny[@]}" --steps 2
done
cat > "$work/ds_many.json" <<'JSON'
{"optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 0.3}},
 "scheduler": {"type": "OneCycle", "params": {"last_batch_iteration": 5}},
 "zero_optimization": {"stage": 3, "overlap_comm": "yes"},
 "gradient_predivide_factor": 2.0, "prescale_gradients": true, "steps_per_print": 0, "trian_batch_size": 8,
 "fp16": {"enabled": true, "fp16_master_weights_and_grads": true}, "bf16": {"enabled": false, "loss_scale": 0},
 "tensorboard": {"enabled": true, "output_path": "tb"}}
JSON
ds_refused "$work/ds_many.json" 12 "optimizer.type: \"Lamb\" is not supported" "optimizer.params.max_coeff: a DeepSpeed feature not implemented here" \
  "scheduler.params.cycle_min_lr: missing: DeepSpeed's OneCycle has no default for it" "scheduler.params.cycle_max_lr: missing" \
  "scheduler.params.last_batch_iteration: 5" "zero_optimization.stage: 3 is not supported" \
  "zero_optimization.overlap_comm: wants true or false" "gradient_predivide_factor: 2.0" "prescale_gradients: true" \
  "steps_per_print: wants an integer from 1" "trian_batch_size: not a DeepSpeed key" "fp16.fp16_master_weights_and_grads"
grep -qF "tensorboard" "$work/bad_stderr" && fail "ds_many.json: an enabled tensorboard (logging only) was refused"
# DeepSpeed's keys of features not here are refused as such, never as "not a DeepSpeed key".
cat > "$work/ds_features.json" <<'JSON'
{"sparse_attention": {"mode": "fixed"}, "pipeline": {"activation_checkpoint_interval": 1},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "min_coeff": 0.01, "momentum": 0.9}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_ratio": 0.1}},
 "zero_optimization": {"stage": 2, "mics_shard_size": 4}}
JSON
ds_refused "$work/ds_features.json" 6 "sparse_attention: a DeepSpeed feature not implemented here" "pipeline: a DeepSpeed feature not implemented here" \
  "optimizer.params.min_coeff: a DeepSpeed feature not implemented here (Lamb's parameter; DeepSpeed's FusedAdam raises TypeError" \
  "optimizer.params.momentum: a DeepSpeed feature not implemented here (SGD's parameter" \
  "scheduler.params.warmup_min_ratio: not a parameter of WarmupLR (DeepSpeed's WarmupLR.__init__ raises TypeError on it; it is WarmupCosineLR's)" \
  "zero_optimization.mics_shard_size: 4 is not supported: a DeepSpeed feature not implemented here (MiCS)"
grep -q "not a DeepSpeed key" "$work/bad_stderr" && fail "a DeepSpeed feature's key called not a DeepSpeed key: $(cat "$work/bad_stderr")"
echo '{"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": false}}}' > "$work/ds_adam_l2.json"
ds_refused "$work/ds_adam_l2.json" 1 "optimizer.params.adam_w_mode: false (Adam with L2 regularization"
echo '{"gradient_clipping": 1.0, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 0.5}}}' > "$work/ds_clips.json"
ds_refused "$work/ds_clips.json" 1 "optimizer.params.max_grad_norm: DeepSpeed refuses it"
echo '{"optimizer": {"type": "AdamW", "params": {"torch_adam": true, "bias_correction": false}}}' > "$work/ds_torch_bias.json"
ds_refused "$work/ds_torch_bias.json" 1 "optimizer.params.bias_correction: torch.optim.AdamW (torch_adam true) has no 'bias_correction' (DeepSpeed's call raises TypeError)"
echo '{"optimizer": {"type": "AdamW", "params": {"fused": true}}}' > "$work/ds_fused_flag.json"
ds_refused "$work/ds_fused_flag.json" 1 "optimizer.params.fused: DeepSpeed's FusedAdam has no 'fused'"
# DeepSpeed looks a scheduler type up by its exact name.
echo '{"scheduler": {"type": "warmuplr", "params": {"warmup_num_steps": 1}}}' > "$work/ds_lower_scheduler.json"
ds_refused "$work/ds_lower_scheduler.json" 1 "scheduler.type: \"warmuplr\" is not a scheduler DeepSpeed knows: it looks the type up by its exact name (engine.py _scheduler_from_config). Did you mean \"WarmupLR\"?"
echo '{"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1}}}' > "$work/ds_no_total.json"
bad_case "config key 'scheduler.params.total_num_steps' is missing: DeepSpeed's WarmupDecayLR has no default for it" \
  --config "$work/ds_no_total.json" "${tiny[@]}" --steps 2
echo '{"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.001, "warmup_num_steps": 1}}}' > "$work/ds_min_lr.json"
bad_case "warmup_min_lr 0.01 is above the learning rate 0.001" --config "$work/ds_min_lr.json" "${tiny[@]}" --steps 2
# "auto" beside an explicit rate (trlx's reward-model config): Hugging Face's Trainer fills both keys from one
# learning_rate and refuses the file unless that equals the explicit value (fill_match); so does the trainer,
# naming both, and runs it when --lr is the explicit value.
echo '{"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 2}}}' > "$work/ds_auto_lr.json"
bad_case "a learning rate in the config is \"auto\", which takes the run's rate (--lr 0.001 (the trainer's default, not given here)), but optimizer.params.lr is 1e-5: Hugging Face's Trainer fills both keys from its one learning_rate" \
  --config "$work/ds_auto_lr.json" "${tiny[@]}" --steps 2
bad_case "(--lr 0.002), but optimizer.params.lr is 1e-5" --config "$work/ds_auto_lr.json" "${tiny[@]}" --steps 2 --lr 2e-3
if timeout 300 "$trainer" --config "$work/ds_auto_lr.json" "${tiny[@]}" --steps 3 --lr 1e-5 --json "$work/auto_lr.json" \
     > /dev/null 2>&1 && python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); sys.exit(d["steps"][2]["lr"] != 1e-5)' \
     "$work/auto_lr.json"; then
  pass "an \"auto\" warmup_max_lr beside an explicit optimizer lr 1e-5 runs with --lr 1e-5, at that rate after the warmup"
else fail "the \"auto\" warmup_max_lr with --lr 1e-5 did not run at 1e-5"; fi
# Keys DeepSpeed never reads: a warning where DeepSpeed ignores them (the
# top level, fp16 / bf16, a block without a type), refused where DeepSpeed
# rejects them (zero_optimization) or where they are a near-miss of a real key.
cat > "$work/ds_ignored.json" <<'JSON'
{"cuda_visible_devices": 0, "bf16": {"enabled": false, "loss_scale": 0},
 "optimizer": {"params": {"lr": 5.0}}, "scheduler": {"params": {"warmup_num_steps": 5}}}
JSON
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_ignored.json" "${tiny[@]}" --steps 2 --json "$work/ds_ignored_run.json" \
  > /dev/null 2> "$work/ds_stderr"
[ "$(grep -c '^train_bert_mini: warning: ' "$work/ds_stderr")" = 4 ] &&
  [ "$(json_get "$work/ds_ignored_run.json" "(d['schedule']['lr'], d['schedule']['convention'], len(d['config_warnings']))")" = "(0.001, 'none', 4)" ] &&
  grep -q "config key 'bf16.loss_scale' is not a key DeepSpeed reads" "$work/ds_stderr" &&
  grep -q "config block 'optimizer' has no \"type\": DeepSpeed ignores the block" "$work/ds_stderr" &&
  pass "keys DeepSpeed ignores (top level, bf16, an optimizer / scheduler without a type): 4 warnings, the run goes on as DeepSpeed's would" ||
  fail "ignored keys: $(cat "$work/ds_stderr" | head -c 400)"
echo '{"zero_optimization": {"stage": 2, "overlap_com": true}, "wall_clock_breakdwon": true, "fp16": {"hysterisis": 2}}' > "$work/ds_typos.json"
ds_refused "$work/ds_typos.json" 3 "zero_optimization.overlap_com: not a DeepSpeed key this trainer knows (did you mean 'zero_optimization.overlap_comm'?)" \
  "wall_clock_breakdwon: not a DeepSpeed key this trainer knows (did you mean 'wall_clock_breakdown'?)" \
  "fp16.hysterisis: not a DeepSpeed key this trainer knows (did you mean 'fp16.hysteresis'?)"
echo '{"zero_optimization": {"stage": 2, "bucket_of_gradients": 8}}' > "$work/ds_zero_unknown.json"
ds_refused "$work/ds_zero_unknown.json" 1 "zero_optimization.bucket_of_gradients: not a DeepSpeed key this trainer knows"

# The rates: DeepSpeed's WarmupLR and WarmupDecayLR as its engine steps
# them, computed here from lr_schedules.py's formulas, not from the
# trainer's code: the scheduler is built at warmup_min_lr (iteration -1) and
# stepped after each applied update (engine.py _take_model_step), so an
# fp16-skipped step does not advance it; W = max(2, warmup_num_steps); log
# ln(i+1)/ln(W), linear i/W; WarmupDecayLR max(0, (S - i) / max(1, S - W)).
schedule() {  # name, then the scheduler's params as JSON
  echo "{\"scheduler\": {\"type\": \"$1\", \"params\": $2}}" > "$work/ds_$3.json"
}
schedule WarmupDecayLR '{"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 3, "total_num_steps": 10}' decay_log
schedule WarmupDecayLR '{"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 3, "total_num_steps": 10, "warmup_type": "linear"}' decay_linear
schedule WarmupLR '{"warmup_max_lr": 2e-3, "warmup_num_steps": 1}' constant_w1
schedule WarmupLR '{"warmup_max_lr": 2e-3, "warmup_num_steps": 0, "warmup_type": "linear"}' constant_w0
echo '{"fp16": {"enabled": true, "initial_scale_power": 18, "hysteresis": 1, "loss_scale_window": 3},
 "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 4, "total_num_steps": 8, "warmup_type": "linear"}}}' > "$work/ds_skips.json"
rates() {  # config, out, flags...
  local config=$1 out=$2; shift 2
  rm -f "$work/$out.json"
  timeout 120 mpirun -n 2 "$trainer" --config "$work/$config.json" "${tiny[@]}" "$@" --json "$work/$out.json" > /dev/null 2>&1
}
rates ds_decay_log decay_log                 # total_num_steps alone: the whole schedule, 10 steps
rates ds_decay_log decay_part --steps 4      # --steps: part of it
rates ds_decay_log decay_past --steps 13     # past its end
rates ds_decay_linear decay_linear
rates ds_constant_w1 constant_w1 --steps 5
rates ds_constant_w0 constant_w0 --steps 5
rates ds_skips skips --steps 12
cp "$ds/open_instruct_stage2.json" "$work/ds_no_scheduler.json"
rates ds_no_scheduler flags_add --warmup 3 --steps 6   # a flag adds WarmupDecayLR over --steps, its other params DeepSpeed's
verdict=$(python3 - "$work" <<'PY'
import json, math, os, sys
work = sys.argv[1]
def load(name): return json.load(open(os.path.join(work, name + ".json")))
def deepspeed(low, high, W, S, warmup_type, decays, steps):
    """Each step's rate, stepping a WarmupLR / WarmupDecayLR as DeepSpeed's engine does."""
    W = max(2, W)
    iteration, rates = -1, []
    for s in steps:
        if iteration < 0: gamma = 0.0
        elif iteration < W: gamma = math.log(iteration + 1) / math.log(W) if warmup_type == "log" else iteration / W
        elif decays: gamma = max(0.0, (S - iteration) / max(1.0, S - W))
        else: gamma = 1.0
        rates.append(low + (high - low) * gamma)
        if not s["skipped"]: iteration += 1
    return rates
cases = [("decay_log", 1e-4, 2e-3, 3, 10, "log", True, 10), ("decay_part", 1e-4, 2e-3, 3, 10, "log", True, 4),
         ("decay_past", 1e-4, 2e-3, 3, 10, "log", True, 13), ("decay_linear", 1e-4, 2e-3, 3, 10, "linear", True, 10),
         ("constant_w1", 0.0, 2e-3, 1, 0, "log", False, 5), ("constant_w0", 0.0, 2e-3, 0, 0, "linear", False, 5),
         ("skips", 0.0, 1e-3, 4, 8, "linear", True, 12), ("flags_add", 0.0, 1e-3, 3, 6, "log", True, 6)]
problems = []
for name, low, high, W, S, kind, decays, count in cases:
    try: d = load(name)
    except Exception as e: problems.append(f"{name}: no run ({e})"); continue
    steps = d["steps"]
    if len(steps) != count: problems.append(f"{name}: {len(steps)} steps, not {count}")
    want = deepspeed(low, high, W, S, kind, decays, steps)
    for s, rate in zip(steps, want):
        if abs(s["lr"] - rate) > 1e-12 * max(rate, 1e-300): problems.append(f"{name} step {s['step']}: lr {s['lr']} != {rate}")
skips = load("skips")["steps"]
if not any(s["skipped"] for s in skips[2:-1]): problems.append("the fp16 run skipped no step between its third and its last")
if load("flags_add")["settings_origin"]["schedule"] != "flag:--warmup": problems.append("flags_add: the schedule's origin is not --warmup")
print("ok" if not problems else "; ".join(problems[:4]))
PY
)
[ "$verdict" = ok ] && pass "rates as DeepSpeed's engine steps WarmupDecayLR (log, linear; 10, 4 and 13 steps) and WarmupLR (W = 1, 0), past an fp16-skipped step, and the scheduler a --warmup flag adds: each step's lr" ||
  fail "schedules: $verdict"
# DeepSpeed's other three schedulers: each step's lr (and OneCycle's betas)
# against tests/deepspeed_schedulers.py, a transcription of lr_schedules.py's
# classes (v0.16.9) stepped on a stand-in optimizer as the engine steps them,
# with Python's own math.cos / math.log (not the trainer's code); runs past
# an fp16-skipped step, past total_num_steps, into OneCycle's decay.
cosine='{"total_num_steps": 8, "warmup_num_steps": 3, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05, "warmup_type": "linear"}'
cosine_log='{"total_num_steps": 9, "warmup_num_steps": 4}'
one_cycle='{"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 3, "cycle_second_step_size": 2, "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.01}'
one_cycle_plain='{"cycle_min_lr": 2e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 4, "cycle_momentum": false}'
range_test='{"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 3, "lr_range_test_staircase": true}'
range_test_default='{}'
other_schedule() {  # name, params, out, optimizer block, more config
  echo "{\"optimizer\": $4, \"scheduler\": {\"type\": \"$1\", \"params\": $2}${5:-}}" > "$work/ds_$3.json"
}
adamw='{"type": "AdamW", "params": {"lr": 2e-3}}'
other_schedule WarmupCosineLR "$cosine" cosine "$adamw"
other_schedule WarmupCosineLR "$cosine_log" cosine_log "$adamw"
other_schedule OneCycle "$one_cycle" one_cycle "$adamw"
other_schedule OneCycle "$one_cycle_plain" one_cycle_plain '{"type": "AdamW", "params": {"betas": [0.85, 0.95]}}'
other_schedule LRRangeTest "$range_test" range_test "$adamw"
other_schedule LRRangeTest "$range_test_default" range_test_default "$adamw"
other_schedule OneCycle "$one_cycle" one_cycle_skips "$adamw" ', "fp16": {"enabled": true, "initial_scale_power": 18, "hysteresis": 1, "loss_scale_window": 3}'
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
  said=$(python3 tests/deepspeed_schedulers.py "$work/$1.json" "$2" "${!3}" "$4" 2>&1)
  [ "$said" = ok ] || verdict+="$1: $said; "
done
[ "$(json_get "$work/one_cycle_skips.json" "any(s['skipped'] for s in d['steps'][1:])")" = True ] ||
  verdict+="the fp16 OneCycle run skipped no step; "
[ -z "$verdict" ] &&
  pass "rates as DeepSpeed's engine steps WarmupCosineLR (linear, log; past total_num_steps), OneCycle (cycle and decay, beta1 per step, beta2 0.99; without momentum; past an fp16-skipped step) and LRRangeTest (staircase, defaults): each step's lr and betas as lr_schedules.py's own code gives them" ||
  fail "other schedulers: $verdict"
# The per-step betas reach AdamW, and the same AdamW with either spelling:
# OneCycle with cycle_min_mom = cycle_max_mom = 0.9 sets (0.9, 0.99) at every
# update, the bits of cycle_momentum false with the optimizer's betas (0.9,
# 0.99); with its beta1 cycling the bits differ, and stage 2 offloaded
# (the host's AdamW) gives the device loop's bits.
flat='{"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2, "cycle_min_mom": 0.9, "cycle_max_mom": 0.9}'
other_schedule OneCycle "$flat" flat_cycled "$adamw" ', "zero_optimization": {"stage": 2}'
other_schedule OneCycle "${flat%\}}, \"cycle_momentum\": false}" flat_fixed '{"type": "AdamW", "params": {"betas": [0.9, 0.99]}}' ', "zero_optimization": {"stage": 2}'
other_schedule OneCycle "$one_cycle" cycling "$adamw" ', "zero_optimization": {"stage": 2}'
rates ds_flat_cycled flat_cycled --steps 6
rates ds_flat_fixed flat_fixed --steps 6
rates ds_cycling cycling --steps 6
rates ds_cycling cycling_offload --steps 6 --offload-optimizer cpu
verdict=$(python3 - "$work" <<'PY'
import json, os, sys
work = sys.argv[1]
def load(name): return json.load(open(os.path.join(work, name + ".json")))
try:
    cycled, fixed, cycling, offload = (load(n) for n in ("flat_cycled", "flat_fixed", "cycling", "cycling_offload"))
except Exception as e:
    print(f"no run ({e})"); sys.exit()
problems = []
if cycled["final_params_hash"] != fixed["final_params_hash"]: problems.append("betas (0.9, 0.99) per step != the optimizer's (0.9, 0.99)")
if any(s["betas"] != [0.9, 0.99] for s in cycled["steps"]): problems.append("flat cycle: betas not (0.9, 0.99)")
if cycling["final_params_hash"] == cycled["final_params_hash"]: problems.append("a cycling beta1 changed no bit")
if offload["final_params_hash"] != cycling["final_params_hash"] or offload["offload_optimizer"] != "cpu":
    problems.append("offloaded AdamW with cycling betas != the device's")
print("ok" if not problems else "; ".join(problems))
PY
)
[ "$verdict" = ok ] && pass "OneCycle's betas reach AdamW: a flat cycle = the optimizer's (0.9, 0.99) bit for bit; cycling changes the bits; offloaded (stage 2, cpu) = not offloaded" ||
  fail "OneCycle betas in AdamW: $verdict"
# The header says each, and a resumed run keeps the scheduler (the checkpoint records it).
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_one_cycle.json" "${tiny[@]}" --steps 4 --save "$work/ck_cycle" > /dev/null 2>&1
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_one_cycle.json" --layers 1 --hidden 16 --heads 2 --intermediate 32 \
  --seq 16 --max-positions 20 --steps 2 > "$work/ds_stdout" 2>&1
grep -q "^  betas     (beta1, 0.99): beta1 0.9 down to 0.8 and back" "$work/ds_stdout" &&
  grep -q "optimizer.params.lr 2e-3 has no effect: OneCycle sets every step's rate" "$work/ds_stdout" &&
  pass "OneCycle's header: the rate's cycle, beta1's, and the optimizer's lr without effect" ||
  fail "OneCycle header: $(grep -E 'optimizer|betas' "$work/ds_stdout" | head -c 400)"
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_cycle" --steps 12 --quiet --json "$work/ds_cycle_resumed.json" > "$work/log" 2>&1
verdict=$(resumed_matches "$work/one_cycle.json" "$work/ds_cycle_resumed.json" 2>&1)
[ "$verdict" = ok ] && pass "OneCycle: 4 steps saved, resumed with --steps 12 and no config: the 12-step run's bits (scheduler and betas from the checkpoint)" ||
  fail "OneCycle resume: $verdict $(head -c 300 "$work/log")"
bad_case "scheduler \"WarmupCosineLR\" contradicts the checkpoint's \"OneCycle\"" \
  --load "$work/ck_cycle" --config "$work/ds_cosine.json" --steps 6
# Bad params: refused, naming the key, before anything runs.
other_schedule WarmupCosineLR '{"total_num_steps": 1000, "warmup_num_steps": 1000}' cosine_zero "$adamw"
bad_case "config key 'scheduler.params.total_num_steps' 1000 equals the warmup's 1000 iterations (config key 'scheduler.params.warmup_num_steps' 1000" \
  --config "$work/ds_cosine_zero.json" "${tiny[@]}" --steps 2
other_schedule WarmupCosineLR '{"total_num_steps": 10, "warmup_type": "cosine"}' cosine_type "$adamw"
ds_refused "$work/ds_cosine_type.json" 1 "scheduler.params.warmup_type: \"cosine\" is neither \"linear\" nor \"log\": DeepSpeed's WarmupCosineLR takes it and raises UnboundLocalError"
other_schedule WarmupCosineLR '{"warmup_num_steps": 3}' cosine_no_total "$adamw"
bad_case "config key 'scheduler.params.total_num_steps' is missing: DeepSpeed's WarmupCosineLR has no default for it" \
  --config "$work/ds_cosine_no_total.json" "${tiny[@]}" --steps 2
other_schedule WarmupCosineLR '{"total_num_steps": 10, "warmup_max_lr": 1e-3}' cosine_max "$adamw"
ds_refused "$work/ds_cosine_max.json" 1 "scheduler.params.warmup_max_lr: not a parameter of WarmupCosineLR (DeepSpeed's WarmupCosineLR.__init__ raises TypeError on it; it is WarmupDecayLR, WarmupLR's)"
bad_case "--decay acts on DeepSpeed's WarmupLR / WarmupDecayLR, and the config's scheduler.type is \"WarmupCosineLR\"" \
  --config "$work/ds_cosine.json" "${tiny[@]}" --steps 2 --decay none
bad_case "--warmup acts on DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR, and the config's scheduler.type is \"OneCycle\"" \
  --config "$work/ds_one_cycle.json" "${tiny[@]}" --steps 2 --warmup 3
for bad in "cycle_first_step_size|-4|wants an integer from 1" "cycle_first_step_size|0|wants an integer from 1" \
           "decay_step_size|-1|wants an integer from 0" "decay_lr_rate|-0.5|wants a number from 0" \
           "cycle_max_mom|1.0|wants a number from 0 to 1 (exclusive)" "cycle_second_step_size|2.5|wants an integer"; do
  IFS='|' read -r key value says <<< "$bad"
  other_schedule OneCycle "{\"cycle_min_lr\": 1e-4, \"cycle_max_lr\": 1e-3, \"$key\": $value}" one_bad "$adamw"
  bad_case "scheduler.params.$key: wants" --config "$work/ds_one_bad.json" "${tiny[@]}" --steps 2
  grep -qF "$says" "$work/bad_stderr" || fail "OneCycle $key $value: '$says' not said: $(head -c 300 "$work/bad_stderr")"
done
other_schedule OneCycle '{"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2, "decay_step_size": 1, "decay_mom_rate": 0.1}' one_beta "$adamw"
bad_case "config key 'scheduler.params.decay_mom_rate' 0.1 takes OneCycle's beta1 to 1.0800000000000001 at update 7 of this run's 8" \
  --config "$work/ds_one_beta.json" "${tiny[@]}" --steps 8
other_schedule LRRangeTest '{"lr_range_test_step_size": 0}' range_zero "$adamw"
bad_case "scheduler.params.lr_range_test_step_size: wants an integer from 1" --config "$work/ds_range_zero.json" "${tiny[@]}" --steps 2
other_schedule LRRangeTest '{"lr_range_test_staircase": 1}' range_staircase "$adamw"
ds_refused "$work/ds_range_staircase.json" 1 "scheduler.params.lr_range_test_staircase: wants true or false (got 1)"
# No scheduler block: the optimizer's rate at every step (getting_started's
# run above); without --config the trainer's own schedule, from step 1.
timeout 120 mpirun -n 2 "$trainer" "${tiny[@]}" --steps 5 --warmup 2 --json "$work/ds_trainer_schedule.json" > /dev/null 2>&1
[ "$(json_get "$work/ds_trainer_schedule.json" "all(abs(s['lr'] / 1e-3 - want) < 1e-12 for s, want in zip(d['steps'], [0.5, 1.0, 1.0, 2 / 3, 1 / 3])) and len(d['steps']) == 5 and d['schedule']['convention'] == 'zero2'")" = True ] &&
  pass "without --config the trainer's schedule stays: linear warmup t / W from step 1, then decay (S - t + 1) / (S - W)" ||
  fail "trainer's schedule: $(json_get "$work/ds_trainer_schedule.json" "[s['lr'] for s in d['steps']]" 2>&1 | tail -n 1)"
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_decay_log.json" --layers 1 --hidden 16 --heads 2 --intermediate 32 \
  --seq 16 --max-positions 20 --steps 13 > "$work/ds_stdout" 2>&1
grep -q "^  WARNING   updates 12 to 13 are past total_num_steps: they train at warmup_min_lr = 0.0001" "$work/ds_stdout" &&
  pass "updates past total_num_steps: the header warns" || fail "past the schedule: $(grep -E 'optimizer|WARN' "$work/ds_stdout" | head -c 300)"
# The run's length may change on resume (the schedule may not): 4 steps of a
# 10-step schedule saved, resumed with --steps 10 and no config = the 10-step
# run, bit for bit (the checkpoint records DeepSpeed's schedule).
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_decay_log.json" "${tiny[@]}" --steps 4 --save "$work/ck_part" > /dev/null 2>&1
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_part" --steps 10 --quiet --json "$work/ds_longer.json" > "$work/log" 2>&1
verdict=$(resumed_matches "$work/decay_log.json" "$work/ds_longer.json" 2>&1)
[ "$verdict" = ok ] && pass "4 steps saved, resumed with --steps 10: the 10-step run's bits (the schedule, DeepSpeed's, is the checkpoint's)" ||
  fail "longer resume: $verdict $(head -c 200 "$work/log")"
bad_case "--schedule-steps 20 contradicts the checkpoint's 10" --load "$work/ck_part" --schedule-steps 20
# A checkpoint of the trainer's schedule resumed with a config whose scheduler is DeepSpeed's: refused.
timeout 120 mpirun -n 2 "$trainer" "${tiny[@]}" --steps 4 --warmup 1 --save "$work/ck_trainer" --json "$work/ds_trainer4.json" > /dev/null 2>&1
bad_case "this run's learning rates would follow DeepSpeed's scheduler (config:scheduler.type), the checkpoint's" \
  --load "$work/ck_trainer/step_4" --config "$work/ds_constant_w1.json" --steps 6
# A checkpoint written before the schedule was recorded keeps the trainer's:
# the field taken out (and the index's digest made anew), it resumes to the
# bits of the run that never stopped.
timeout 120 mpirun -n 2 "$trainer" "${tiny[@]}" --steps 8 --warmup 1 --save-every 4 --save "$work/ck_old" --json "$work/ds_old_straight.json" > /dev/null 2>&1
python3 - "$work/ck_old/step_4/index.json" <<'PY'
import json, sys
index = json.load(open(sys.argv[1]))
del index["settings"]["schedule_convention"]
json.dump(index, open(sys.argv[1], "w"), indent=2)
PY
(cd "$work/ck_old/step_4" && sha256sum index.json > index.sha256)
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_old/step_4" --quiet --json "$work/ds_old_resumed.json" > "$work/log" 2>&1
verdict=$(resumed_matches "$work/ds_old_straight.json" "$work/ds_old_resumed.json" 2>&1)
[ "$verdict" = ok ] && pass "a checkpoint without schedule_convention resumes with the trainer's schedule: the straight run's bits" ||
  fail "old checkpoint resume: $verdict $(head -c 300 "$work/log")"
# bias_correction false changes the update (and is recorded in the JSON).
echo '{"optimizer": {"type": "Adam", "params": {"lr": 2e-4, "bias_correction": true}}}' > "$work/ds_bias.json"
sed 's/"bias_correction": true/"bias_correction": false/' "$work/ds_bias.json" > "$work/ds_no_bias.json"
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_bias.json" "${tiny[@]}" --steps 2 --json "$work/ds_bias_on.json" > /dev/null 2>&1
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_no_bias.json" "${tiny[@]}" --steps 2 --json "$work/ds_bias_off.json" > /dev/null 2>&1
[ "$(json_get "$work/ds_bias_on.json" "d['final_params_hash']")" != "$(json_get "$work/ds_bias_off.json" "d['final_params_hash']")" ] &&
  [ "$(json_get "$work/ds_bias_off.json" "d['optimizer']['bias_correction']")" = False ] &&
  pass "bias_correction false trains differently from true" || fail "bias_correction has no effect"
# Keys DeepSpeed has that change nothing here, at their "off" values, run;
# an all-false activation_checkpointing block changes nothing and says so;
# without --config, steps past the schedule's end warn.
cat > "$work/ds_offs.json" <<'JSON'
{"elasticity": {"enabled": false}, "compile": {"deepcompile": false}, "sparse_gradients": false, "dump_state": false,
 "memory_breakdown": false, "communication_data_type": null, "checkpoint": {"tag_validation": "Warn"},
 "bf16": {"enabled": false, "immediate_grad_update": false},
 "zero_optimization": {"stage": 2, "zero_quantized_weights": false, "zero_hpz_partition_size": 1, "mics_shard_size": -1},
 "activation_checkpointing": {"partition_activations": false, "cpu_checkpointing": false,
                              "contiguous_memory_optimization": false, "number_checkpoints": null}}
JSON
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_offs.json" --layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 \
  --max-positions 20 --steps 2 --json "$work/ds_offs_run.json" > "$work/ds_stdout" 2>&1 &&
  [ "$(json_get "$work/ds_offs_run.json" "d['activations']")" = keep ] &&
  grep -q "^  config    activation_checkpointing: which activations are checkpointed is --activations here" "$work/ds_stdout" &&
  pass "DeepSpeed keys at their off values run; an all-false activation_checkpointing block keeps --activations keep and says why" ||
  fail "off-value keys: $(head -c 300 "$work/ds_stdout")"
# comms_logger and flops_profiler only time and profile in DeepSpeed: enabled, a note each and the same bits;
# CommsLoggerConfig forbids other fields (refused), the flops profiler's reader ignores them (a warning).
cat > "$work/ds_loggers.json" <<'JSON'
{"zero_optimization": {"stage": 2},
 "comms_logger": {"enabled": true, "verbose": false, "prof_all": true, "debug": false, "prof_ops": ["all_reduce"]},
 "flops_profiler": {"enabled": true, "profile_step": 2, "module_depth": -1, "top_modules": 1, "detailed": true,
                    "output_file": null, "recompute_fwd_factor": 0.0, "note": "once"}}
JSON
echo '{"zero_optimization": {"stage": 2}}' > "$work/ds_no_loggers.json"
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_loggers.json" --layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 \
  --max-positions 20 --steps 2 --json "$work/ds_loggers_run.json" > "$work/ds_stdout" 2>&1
timeout 120 mpirun -n 2 "$trainer" --config "$work/ds_no_loggers.json" "${tiny[@]}" --steps 2 --json "$work/ds_no_loggers_run.json" > /dev/null 2>&1
grep -q "^  config    comms_logger.enabled true: DeepSpeed would time each collective (comm/comm.py timed_op" "$work/ds_stdout" &&
  grep -q "^  config    flops_profiler.enabled true: DeepSpeed would profile step 2's forward on rank 0" "$work/ds_stdout" &&
  grep -q "^  WARNING   config key 'flops_profiler.note' is not a key DeepSpeed reads" "$work/ds_stdout" &&
  [ "$(json_get "$work/ds_loggers_run.json" "d['final_params_hash']")" = "$(json_get "$work/ds_no_loggers_run.json" "d['final_params_hash']")" ] &&
  pass "comms_logger and flops_profiler enabled: a note each (an unknown profiler field warned about), the bits of the run without them" ||
  fail "comms_logger / flops_profiler: $(grep -E 'comms|flops|error' "$work/ds_stdout" | head -c 400)"
echo '{"comms_logger": {"enabled": true, "prof_al": true}, "flops_profiler": {"enabled": "yes", "profile_stp": 2, "top_modules": "3"}}' > "$work/ds_loggers_bad.json"
ds_refused "$work/ds_loggers_bad.json" 4 "comms_logger.prof_al: not a field of DeepSpeed's CommsLoggerConfig (comm/config.py, a pydantic model that forbids other fields) (did you mean 'comms_logger.prof_all'?)" \
  "flops_profiler.enabled: wants true or false (got \"yes\")" \
  "flops_profiler.profile_stp: not a DeepSpeed key this trainer knows (did you mean 'flops_profiler.profile_step'?)" \
  "flops_profiler.top_modules: wants an integer (got \"3\")"
timeout 120 mpirun -n 2 "$trainer" --layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 --max-positions 20 \
  --steps 6 --schedule-steps 4 > "$work/ds_stdout" 2>&1
grep -q "^  WARNING   steps 5 to 6 are past the schedule's end: they train at warmup_min_lr = 0 (no update at all)" "$work/ds_stdout" &&
  pass "steps past the schedule's end: the header warns" || fail "past the schedule: $(grep -E 'steps|WARN' "$work/ds_stdout" | head -c 300)"
# Several hosts: each rank reads its own copy of --data and --config; a copy
# that differs is named with its rank and host, on every rank (MPMD: rank 1
# is given another file under another name, as another host's copy would be).
cp "$work/corpus.txt" "$work/copy_a.txt"; cp "$work/corpus.txt" "$work/copy_b.txt"; printf ' and more' >> "$work/copy_b.txt"
timeout 60 mpirun -n 1 "$trainer" "${tiny[@]}" --steps 1 --data "$work/copy_a.txt" : -n 1 "$trainer" "${tiny[@]}" --steps 1 \
  --data "$work/copy_b.txt" > "$work/hosts_out" 2>&1
status=$?
[ $status -ne 0 ] && [ "$(grep -c "train_bert_mini: error: --data is not the same file on every rank: rank 0 on .* has 1,800 bytes.*; rank 1 on .* has 1,809 bytes" "$work/hosts_out")" -eq 1 ] &&
  pass "a rank whose --data differs: one message naming rank 1 and its host, exit $status" || fail "differing --data: exit $status $(head -c 300 "$work/hosts_out")"
cp "$ds/getting_started.json" "$work/cfg_a.json"; sed 's/0.00015/0.00016/' "$ds/getting_started.json" > "$work/cfg_b.json"
timeout 60 mpirun -n 1 "$trainer" "${tiny[@]}" --steps 1 --config "$work/cfg_a.json" : -n 1 "$trainer" "${tiny[@]}" --steps 1 \
  --config "$work/cfg_b.json" > "$work/hosts_out" 2>&1
status=$?
[ $status -ne 0 ] && grep -q "error: --config is not the same file on every rank" "$work/hosts_out" &&
  pass "a rank whose --config differs: named, exit $status" || fail "differing --config: exit $status $(head -c 300 "$work/hosts_out")"
timeout 60 mpirun -n 1 "$trainer" "${tiny[@]}" --steps 1 --data "$work/copy_a.txt" : -n 1 "$trainer" "${tiny[@]}" --steps 1 \
  --data "$work/corpus.txt" > "$work/hosts_out" 2>&1 && pass "the same bytes under two names on two ranks: runs" ||
  fail "same --data, two names: $(head -c 300 "$work/hosts_out")"

fi  # section 9
# --- 10. The export through Hugging Face itself ------------------------------------
if wanted 10; then  # (Z2_TRAINER_SKIP)
echo "=== Hugging Face: AutoTokenizer, AutoModelForMaskedLM, pipeline('fill-mask') on the export"
hf_python=.venv-hf/bin/python  # made by make test (hf-venv): transformers 4.39.3 on Debian's torch
if ! [ -x "$hf_python" ] || ! "$hf_python" -c 'import transformers' 2>/dev/null; then
  echo "SKIP the Hugging Face round trip: no $hf_python with transformers ($(tail -n 1 .venv-hf.log 2>/dev/null || echo 'make hf-venv was not run'))"
else
  rm -rf "$work/hf_dump"
  if timeout 120 "$trainer" --layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 32 --max-positions 40 --micro-batch 4 \
       --accum 2 --steps 1 --dropout 0 --data "$work/corpus.txt" --dump-batch "$work/hf_dump" --quiet > "$work/log" 2>&1 &&
     "$hf_python" tests/hf_roundtrip.py "$work/hf_dump" > "$work/hf.log" 2>&1 &&
     [ "$(grep -c '^PASS' "$work/hf.log")" -eq 5 ]; then
    pass "Hugging Face round trip: $(grep '^PASS' "$work/hf.log" | sed 's/^PASS //' | cut -c1-70 | paste -sd ';' | cut -c1-330)"
  else fail "Hugging Face round trip: $(grep -E 'FAIL|Error' "$work/hf.log" | head -c 400) $(head -c 200 "$work/log")"; fi
fi

fi  # section 10
# --- 11. Metrics while training ---------------------------------------------------
if wanted 11; then  # (Z2_TRAINER_SKIP)
echo "=== --metrics and --eval-every: progress as training goes, the held-out loss"
timeout 120 mpirun -n 2 "$trainer" "${tiny[@]}" --steps 30 --log-every 10 --metrics "$work/metrics.jsonl" --json "$work/metrics_run.json" \
  > /dev/null 2>&1
verdict=$(python3 - "$work/metrics.jsonl" "$work/metrics_run.json" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
run = json.load(open(sys.argv[2]))
loss = {s["step"]: s["loss"] for s in run["steps"]}
problems = []
if [l["step"] for l in lines] != [1, 10, 20, 30]: problems.append(f"steps {[l['step'] for l in lines]}")
previous = 0
for l in lines:
    mean = sum(loss[t] for t in range(previous + 1, l["step"] + 1)) / (l["step"] - previous)
    if abs(l["loss_mean"] - mean) > 1e-9 * abs(mean) or l["losses_in_mean"] != l["step"] - previous:
        problems.append(f"step {l['step']}: loss_mean {l['loss_mean']} != {mean}")
    if l["loss"] != loss[l["step"]]: problems.append(f"step {l['step']}: loss")
    previous = l["step"]
if any(b["elapsed_s"] < a["elapsed_s"] for a, b in zip(lines, lines[1:])): problems.append("elapsed goes back")
if lines and lines[-1]["eta_s"] != 0: problems.append("ETA at the last step is not 0")
print("ok" if not problems else "; ".join(problems[:3]))
PY
)
[ "$verdict" = ok ] && pass "--metrics: lines at steps 1, 10, 20, 30; loss_mean = the mean of the --json losses since the last line; elapsed rises, ETA ends at 0" ||
  fail "--metrics: $verdict"
# A run killed mid-way leaves whole lines only.
timeout 120 mpirun -n 2 "$trainer" "${tiny[@]}" --steps 100000 --log-every 100 --metrics "$work/killed.jsonl" > /dev/null 2>&1 &
job=$!
for k in $(seq 1 200); do [ -f "$work/killed.jsonl" ] && [ "$(wc -l < "$work/killed.jsonl")" -ge 5 ] && break; sleep 0.05; done
pkill -KILL -f "^$trainer .*$work/killed.jsonl"
wait $job
python3 -c "
import json, sys
lines = open(sys.argv[1]).read().split('\n')
assert lines[-1] == '', 'a partial last line'
[json.loads(l) for l in lines[:-1]]
print(len(lines) - 1)" "$work/killed.jsonl" > "$work/log" 2>&1 &&
  pass "a run killed by SIGKILL: --metrics holds $(cat "$work/log") whole lines, none cut" || fail "killed --metrics: $(cat "$work/log")"
bad_case "--metrics '$work/corpus.txt' is the --data file" "${tiny[@]}" --steps 2 --data "$work/corpus.txt" --metrics "$work/corpus.txt"
# --eval-every: the held-out loss is the same bits at every (N, A, stage);
# how often it runs does not change training; bad values refused.
ev_bad=""
for run in "1 4 0" "2 2 1" "4 1 2"; do
  set -- $run
  timeout 120 mpirun -n $1 "$trainer" "${tiny[@]}" --accum $2 --stage $3 --steps 6 --eval-every 3 --json "$work/eval_$1.json" \
    > /dev/null 2>&1 || ev_bad="$ev_bad (N=$1 failed)"
done
timeout 120 mpirun -n 2 "$trainer" "${tiny[@]}" --accum 2 --steps 6 --eval-every 6 --metrics "$work/eval.jsonl" --json "$work/eval_rare.json" \
  > /dev/null 2>&1
verdict=$(python3 - "$work"/eval_1.json "$work"/eval_2.json "$work"/eval_4.json "$work/eval_rare.json" "$work/eval.jsonl" <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[1:5]]
metrics = [json.loads(l) for l in open(sys.argv[5])]
problems = []
evals = [[(e["step"], e["loss_bits"]) for e in r["eval"]] for r in runs[:3]]
if [s for s, _ in evals[0]] != [3, 6]: problems.append(f"evaluated at {evals[0]}")
if any(e != evals[0] for e in evals): problems.append(f"eval bits differ: {evals}")
if len({r["final_params_hash"] for r in runs}) != 1: problems.append("--eval-every 3 and 6 train differently")
if runs[3]["eval"] != runs[0]["eval"][1:]: problems.append("the step-6 evaluation differs between --eval-every 3 and 6")
if [m["eval_loss"] for m in metrics if "eval_loss" in m] != [runs[3]["eval"][0]["loss"]]: problems.append("metrics lack the eval line")
print("ok" if not problems else "; ".join(problems))
PY
)
[ -z "$ev_bad" ] && [ "$verdict" = ok ] &&
  pass "--eval-every: the held-out loss has the same bits at (N, A, stage) = (1,4,0), (2,2,1), (4,1,2); every 3 or every 6 trains the same; it is in --metrics" ||
  fail "--eval-every:$ev_bad $verdict"
bad_case "--eval-every 10 is more than --steps 2" "${tiny[@]}" --steps 2 --eval-every 10
printf 'abcdefghijklmnopqrstuvwxyz' > "$work/tiny_corpus.txt"
bad_case "--eval-every holds out the data's last 14 bytes" "${tiny[@]}" --steps 2 --eval-every 1 --data "$work/tiny_corpus.txt"
timeout 120 mpirun -n 2 "$trainer" "${tiny[@]}" --steps 4 --eval-every 2 --save "$work/ck_eval" > /dev/null 2>&1
bad_case "--eval-every 0 keeps the data's tail in training, and the checkpoint's run" --load "$work/ck_eval" --eval-every 0 --steps 6
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_eval" --steps 6 --quiet --json "$work/eval_resumed.json" > "$work/log" 2>&1 &&
  [ "$(json_get "$work/eval_resumed.json" "[e['step'] for e in d['eval']]")" = "[6]" ] &&
  pass "resumed without --eval-every: the saved one (every 2) continues" || fail "eval resume: $(head -c 200 "$work/log")"

fi  # section 11
# --- 12. the memory plan ---------------------------------------------------------
if wanted 12; then  # (Z2_TRAINER_SKIP)
echo "=== --plan: the plan against the measured ledger to the byte; the largest sizes against real runs"
# The first section's small model (section 9 redefines tiny): 2 blocks, several buckets.
planned=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2
         --steps 3 --warmup 1 --dropout 0.1 --clip 0.5 --bucket 3000 --quiet)
# Nine (precision, activations) cases, each planned once for N = 1, 2, 4 and
# run at every (stage, N): 81 one-step runs. The cases also vary what the
# plan must follow: accumulation (the tree's blocks), overlap (staging's
# slots in stages 0/1), the 16-bit accumulation type, and naive (its own
# live peak; its block is not planned).
verdict=$("$PYTHON" - "$trainer" "$work" "${planned[@]}" <<'PY'
import json, subprocess, sys
trainer, work, tiny = sys.argv[1], sys.argv[2], sys.argv[3:]
tiny = [a for a in tiny if a != "--quiet"]
cases = [("fp32", "keep", ["--accum", "1"]), ("fp32", "recompute", ["--accum", "4", "--alloc", "naive"]),
         ("fp32", "offload", ["--accum", "2", "--overlap", "0"]), ("bf16", "keep", ["--accum", "4"]),
         ("bf16", "recompute", ["--accum", "1", "--overlap", "0"]), ("bf16", "offload", ["--accum", "2", "--alloc", "naive"]),
         ("fp16", "keep", ["--accum", "2", "--alloc", "caching"]), ("fp16", "recompute", ["--accum", "2"]),
         ("fp16", "offload", ["--accum", "4", "--config", work + "/plan_accum16.json"]),
         # DeepSpeed's batch rule: train_batch_size 8 of micro-batches of 2 is A = 4 / N at each N
         ("fp32", "recompute", ["--config", work + "/plan_batch.json"])]
json.dump({"data_types": {"grad_accum_dtype": "fp16"}}, open(work + "/plan_accum16.json", "w"))
json.dump({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, open(work + "/plan_batch.json", "w"))
keys = ["params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes", "accumulation_bytes", "staging_bytes",
        "activation_peak_bytes", "bookkeeping_bytes", "model_states_bytes", "device_peak_bytes"]
problems, compared = [], 0
for precision, activations, extra in cases:
    flags = tiny + ["--precision", precision, "--activations", activations, "--steps", "1"] + extra
    plan_file = f"{work}/plan.json"
    out = subprocess.run([trainer, "--plan", "--plan-world-sizes", "1,2,4", "--json", plan_file, "--quiet"] + flags,
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        problems.append(f"--plan {precision} {activations}: {out.stderr[:200]}"); continue
    plan = {(r["stage"], r["world_size"]): r for r in json.load(open(plan_file))["plan"]}
    for stage in (0, 1, 2):
        for ranks in (1, 2, 4):
            run = subprocess.run(["mpirun", "-n", str(ranks), trainer, "--stage", str(stage), "--quiet", "--json",
                                  f"{work}/run.json"] + flags, capture_output=True, text=True, timeout=120)
            label = f"{precision} {activations} {' '.join(extra[:4])} stage {stage} N {ranks}"
            if run.returncode != 0:
                problems.append(f"{label}: the run failed: {run.stderr[:200]}"); continue
            ledger, row = json.load(open(f"{work}/run.json"))["memory"], plan[(stage, ranks)]
            for key in keys + (["reserved_bytes"] if "--alloc" not in extra else []):
                planned = row["arena_block_bytes" if key == "reserved_bytes" else key]
                compared += 1
                if planned != ledger[key]:
                    problems.append(f"{label}: {key} planned {planned}, measured {ledger[key]}")
print(f"ok {compared}" if not problems else "; ".join(problems[:6]) + f" ({len(problems)} in all)")
PY
)
case "$verdict" in
  ok*) pass "--plan = the measured ledger to the byte: ${verdict#ok } values (10 categories, and the arena's reserved block), 3 precisions x 3 activation modes x stages 0/1/2 x N = 1, 2, 4, with A = 1, 2, 4, overlap off, naive, caching, 16-bit accumulation, and a config's train_batch_size (A by N)" ;;
  *) fail "--plan against the ledger: $verdict" ;;
esac

# The arena's block: the plan's figure trains, 256 bytes less runs out of
# memory (the allocator's message, every rank).
block_check() {  # LABEL RANKS STAGE FLAGS...
  local label=$1 ranks=$2 stage=$3 block
  shift 3
  "$trainer" --plan --plan-world-sizes "$ranks" --json "$work/plan.json" --quiet "${planned[@]}" "$@" > /dev/null 2>&1
  block=$(json_get "$work/plan.json" "[r['arena_block_bytes'] for r in d['plan'] if r['stage'] == $stage][0]")
  if ! timeout 120 mpirun -n "$ranks" "$trainer" "${planned[@]}" --steps 1 --stage "$stage" "$@" \
       --device-memory-limit "$block" > "$work/log" 2>&1; then
    fail "$label: the plan's block $block does not train: $(head -c 200 "$work/log")"; return
  fi
  timeout 120 mpirun -n "$ranks" "$trainer" "${planned[@]}" --steps 1 --stage "$stage" "$@" \
    --device-memory-limit $((block - 256)) > "$work/log" 2>&1
  local status=$?
  if [ $status -ne 0 ] && grep -q "out of device memory" "$work/log" && [ "$(grep -c 'error:' "$work/log")" = 1 ]; then
    pass "$label: the plan's arena block ($block bytes) trains, 256 bytes less runs out of memory"
  else fail "$label: $((block - 256)) bytes: exit $status, $(head -c 200 "$work/log")"; fi
}
block_check "block, fp32 keep, stage 2, N = 2" 2 2
block_check "block, bf16 offload, stage 1, N = 4" 4 1 --precision bf16 --activations offload --accum 2
block_check "block, fp16 recompute, stage 0, N = 1" 1 0 --precision fp16 --activations recompute

# The largest micro-batch and layer count for a limit, against real runs.
# The limit: 1.5 times the default tiny model's stage-2 block at N = 4.
"$trainer" --plan --plan-world-sizes 4 --json "$work/plan.json" --quiet "${planned[@]}" > /dev/null 2>&1
limit=$(json_get "$work/plan.json" "[r['arena_block_bytes'] * 3 // 2 for r in d['plan'] if r['stage'] == 2][0]")
"$trainer" --plan --plan-world-sizes 1,2,4 --device-memory-limit "$limit" --json "$work/largest.json" --quiet "${planned[@]}" \
  > /dev/null 2>&1
for probe in "0 1" "2 1" "0 4" "2 4"; do
  set -- $probe
  stage=$1 ranks=$2
  for what in micro_batch layers; do
    flag=--${what//_/-}
    answer=$(json_get "$work/largest.json" "[r['$what'] for r in d['largest'] if r['stage'] == $stage and r['world_size'] == $ranks][0]")
    common=("${planned[@]}" --steps 1 --stage "$stage" --device-memory-limit "$limit")
    if [ "$answer" -lt 1 ]; then fail "largest $what at stage $stage, N = $ranks: the plan says none fits"; continue; fi
    timeout 120 mpirun -n "$ranks" "$trainer" "${common[@]}" "$flag" "$answer" > "$work/log" 2>&1
    fits=$?
    timeout 120 mpirun -n "$ranks" "$trainer" "${common[@]}" "$flag" $((answer + 1)) > "$work/log_above" 2>&1
    above=$?
    if [ $fits -eq 0 ] && [ $above -ne 0 ] && grep -q "out of device memory" "$work/log_above"; then
      pass "largest $what for a $limit-byte limit, stage $stage, N = $ranks: $answer trains, $((answer + 1)) runs out of memory"
    else
      fail "largest $what at stage $stage, N = $ranks: $answer exit $fits ($(head -c 150 "$work/log")), $((answer + 1)) exit $above ($(head -c 150 "$work/log_above"))"
    fi
  done
done
# ZeRO's point, in the plan's numbers: stage 2 at N = 4 fits more than stage 0.
json_get "$work/largest.json" "[(r['stage'], r['world_size'], r['micro_batch']) for r in d['largest']]" > "$work/largest.txt"
more=$(json_get "$work/largest.json" "{(r['stage'], r['world_size']): r['micro_batch'] for r in d['largest']}[(2, 4)] > {(r['stage'], r['world_size']): r['micro_batch'] for r in d['largest']}[(0, 4)]")
[ "$more" = True ] && pass "the plan: stage 2 at N = 4 holds a larger micro-batch than stage 0 in the same limit ($(cat "$work/largest.txt"))" ||
  fail "stage 2 does not hold more than stage 0: $(cat "$work/largest.txt")"

bad_ranks=1 bad_case "--plan trains nothing, so --save" --plan "${planned[@]}" --save "$work/no"
bad_case "--plan-world-sizes is for --plan" "${planned[@]}" --plan-world-sizes 1,2
bad_case "'0' is not a world size" --plan "${planned[@]}" --plan-world-sizes 1,0,4
bad_case "'x' is not a world size" --plan "${planned[@]}" --plan-world-sizes 2,x
bad_case "'' is not a world size" --plan "${planned[@]}" --plan-world-sizes 2,,4
bad_case "in increasing order" --plan "${planned[@]}" --plan-world-sizes 4,2
bad_case "exact for --alloc arena only" --plan "${planned[@]}" --alloc naive --device-memory-limit 1000000
bad_case "exact for --alloc arena only" --plan "${planned[@]}" --alloc caching --device-memory-limit 1000000
bad_case "--alloc cuda is cudaMalloc and cudaFree for every tensor: it needs a GPU" "${planned[@]}" --device cpu --alloc cuda
bad_case "--device-memory-limit 4,096 holds nothing" --plan "${planned[@]}" --device-memory-limit 4096
bad_case "--hidden 30 is not divisible by --heads 4" --plan "${planned[@]}" --hidden 30 --heads 4
# (bad_case gives --json, which --plan --quiet writes to: this one runs alone)
timeout 60 mpirun -n 2 "$trainer" --plan --quiet > "$work/log" 2>&1
status=$?
[ $status -eq 2 ] && [ "$(grep -c 'would print nothing' "$work/log")" = 1 ] &&
  pass "bad input [--plan --quiet]: one message, exit 2" || fail "--plan --quiet: exit $status, $(head -c 200 "$work/log")"
bad_case "write '--stage 2'" --plan --stage=2

# The memory check (notes/10, "What a run holds on the host besides the
# plan"): on the cpu a run needs the plan's block plus the host copies the
# plan does not count, and ZERO2_MEMORY_LIMIT lowers the limit it is
# compared with. A limit just above the plan's block (what the check used to
# compare) is refused on every rank before anything is allocated or written;
# the need the message names trains, a little less is refused. The need
# counts what the process holds at the check, measured (its resident bytes,
# rounded up to a MiB: the libraries, the corpus), which varies between two
# runs of one command by about 0.2 MB: 2 MiB either side of it.
memory_refused() {  # LABEL RANKS LIMIT FLAGS...: refused with the check's one message, no file written
  local label=$1 ranks=$2 limit=$3
  shift 3
  rm -rf "$work/mem_out" "$work/mem.json"
  ZERO2_MEMORY_LIMIT=$limit timeout 60 mpirun -n "$ranks" "$trainer" "$@" --save "$work/mem_out/ck" \
    --export-hf "$work/mem_out/hf" --json "$work/mem.json" > "$work/log" 2>&1
  local status=$?
  if [ $status -eq 2 ] && [ "$(grep -c 'error:' "$work/log")" = 1 ] &&
     grep -q "are available per rank (ZERO2_MEMORY_LIMIT).*besides the plan" "$work/log" &&
     [ ! -e "$work/mem.json" ] && [ -z "$(find "$work/mem_out" -type f 2> /dev/null)" ]; then
    pass "$label: ZERO2_MEMORY_LIMIT=$limit refused, one message, exit 2, no file written"
  else fail "$label: ZERO2_MEMORY_LIMIT=$limit: exit $status, $(head -c 300 "$work/log")"; fi
}
for ranks in 1 2; do
  "$trainer" --plan --plan-world-sizes "$ranks" --json "$work/plan.json" --quiet "${planned[@]}" > /dev/null 2>&1
  block=$(json_get "$work/plan.json" "[r['arena_block_bytes'] for r in d['plan'] if r['stage'] == 2][0]")
  memory_refused "memory check, N = $ranks, a limit 1 MiB above the plan's block" "$ranks" $((block + 1048576)) \
    "${planned[@]}" --steps 1
  need=$(grep -o 'needs [0-9,]* bytes' "$work/log" | tr -dc '0-9')
  if [ -z "$need" ]; then fail "memory check, N = $ranks: no need in the message"; continue; fi
  memory_refused "memory check, N = $ranks, 2 MiB below the need the message names ($need)" "$ranks" \
    $((need - 2097152)) "${planned[@]}" --steps 1
  rm -rf "$work/mem_out"
  if ZERO2_MEMORY_LIMIT=$((need + 2097152)) timeout 60 mpirun -n "$ranks" "$trainer" "${planned[@]}" --steps 1 \
       --save "$work/mem_out/ck" --export-hf "$work/mem_out/hf" > "$work/log" 2>&1 &&
     [ -e "$work/mem_out/hf/config.json" ]; then
    pass "memory check, N = $ranks: a limit of the need ($need bytes) + 2 MiB trains, saves and exports"
  else fail "memory check, N = $ranks, at the need ($need): $(head -c 300 "$work/log")"; fi
done
# The case that the OOM killer used to end (24 layers, H 2048: a 19.86 GB plan
# at N = 1, plus 9 GiB of initial parameters on the host) ends with the
# message, before allocating: under a 8 GB address-space limit, so that a
# check that let it through fails at once instead of filling the machine.
start=$(date +%s%N)
(ulimit -v 8000000; ZERO2_MEMORY_LIMIT=20000000000 timeout 60 mpirun -n 1 "$trainer" --device cpu --layers 24 \
   --hidden 2048 --heads 16 --intermediate 8192 --seq 32 --micro-batch 1 --steps 1 --quiet) > "$work/log" 2>&1
status=$? took=$(( ($(date +%s%N) - start) / 1000000 ))
if [ $status -eq 2 ] && [ "$(grep -c 'error:' "$work/log")" = 1 ] &&
   grep -q "19,861,069,312 bytes of the plan.*for building the initial parameters" "$work/log" && [ $took -lt 10000 ]; then
  pass "memory check: the 24-layer run a 20 GB machine cannot hold is refused in $took ms: $(grep -o 'needs [0-9,]* bytes' "$work/log"), the plan's 19,861,069,312 and the host's copies"
else fail "memory check, 24 layers: exit $status in $took ms, $(head -c 300 "$work/log")"; fi
ZERO2_MEMORY_LIMIT=1e9 bad_case "ZERO2_MEMORY_LIMIT='1e9' is not a number of bytes" "${planned[@]}" --device cpu
# The need bounds the peak: a 52M-parameter model (4 Psi = 209 MB, so that a
# copy the check does not count shows above its 64 MiB for the heap) with
# each option that holds host copies besides the plan, its peak resident
# memory (getrusage of the child) at most the need its refusal names. Before
# issue 35, --trace peaked at 1.27 x the need (its copies were not counted,
# and a `?:` copied its gradient once more), --init-hf likewise.
medium=(--device cpu --layers 4 --hidden 1024 --heads 16 --intermediate 4096 --seq 32 --micro-batch 1 --steps 1 --quiet)
peak_of() { "$PYTHON" -c "import resource, subprocess, sys
status = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 if status == 0 else 'failed')" "$@"; }
rm -rf "$work/peak_init"
"$trainer" "${medium[@]}" --export-hf "$work/peak_init" > /dev/null 2>&1
for option in "--trace $work/peak_trace" "--init-hf $work/peak_init" "--save $work/peak_save" "--offload-optimizer cpu"; do
  rm -rf "$work/peak_trace" "$work/peak_save"
  need=$(ZERO2_MEMORY_LIMIT=1 "$trainer" "${medium[@]}" $option 2>&1 | grep -o 'needs [0-9,]* bytes' | tr -dc '0-9')
  rm -rf "$work/peak_trace" "$work/peak_save"
  peak=$(peak_of "$trainer" "${medium[@]}" $option)
  if [ -n "$need" ] && [ "$peak" != failed ] && [ "$peak" -le "$need" ]; then
    pass "memory check, ${option%% *}: the peak resident $peak bytes is within the need $need ($(( peak * 100 / need ))%)"
  else fail "memory check, ${option%% *}: peak ${peak:-?} above the need ${need:-?}"; fi
done
fi  # section 12
# --- 13. portable bits ---------------------------------------------------------------
echo "=== portable mode: the same bits whatever OpenBLAS and glibc pick, in both builds; the golden table; the matrix"
# A tiny configuration: tests/golden_bits.txt's first row.
portable_tiny=(--layers 2 --hidden 64 --heads 2 --intermediate 128 --seq 32 --micro-batch 4 --steps 5 --quiet)
tiny_bits() {  # tiny_bits TRAINER ENV_ASSIGNMENT FLAGS...: "hash last-loss-bits", or "failed"
  local binary=$1 assignment=$2
  shift 2
  rm -f "$work/portable.json"
  if env $assignment timeout 120 mpirun -n 1 "$binary" "${portable_tiny[@]}" "$@" --json "$work/portable.json" \
      > "$work/log" 2>&1; then
    json_get "$work/portable.json" "d['final_params_hash'] + ' ' + d['steps'][-1]['loss_bits']"
  else
    echo failed
  fi
}
# OpenBLAS's kernel, forced (each is an sgemm with its own blocking and order;
# Sandybridge and Nehalem have no FMA), its thread count (the Haswell kernel
# splits the work differently on 2 threads), and glibc's CPU features masked
# (the variants of its functions it would pick). The default mode's bits follow
# OpenBLAS; portable mode calls neither.
# And zero2's own schedules, forced the same way (Z2_PORTABLE_LANES: the
# narrower ones this build has; they change only the portable mode).
portable_lanes=""
for lanes in 8 1; do
  Z2_PORTABLE_LANES=$lanes timeout 60 mpirun -n 1 "$trainer" "${portable_tiny[@]}" --steps 1 --portable \
    > /dev/null 2>&1 && portable_lanes="$portable_lanes Z2_PORTABLE_LANES=$lanes"
done
declare -A default_seen=()
portable_seen=()
# Only the kernels this CPU can run: OpenBLAS runs a forced kernel without
# asking (SkylakeX's on a CPU without AVX-512 dies of SIGILL).
cpu_flags=" $(grep -m 1 '^flags' /proc/cpuinfo) "
forced_kernels=(OPENBLAS_CORETYPE=Sandybridge OPENBLAS_CORETYPE=Nehalem)
[[ $cpu_flags == *" avx2 "* && $cpu_flags == *" fma "* ]] &&
  forced_kernels+=(OPENBLAS_CORETYPE=Haswell "OPENBLAS_CORETYPE=Haswell OPENBLAS_NUM_THREADS=2")
[[ $cpu_flags == *" avx512f "* ]] && forced_kernels+=(OPENBLAS_CORETYPE=SkylakeX)
for variant in "OPENBLAS_CORETYPE=" "${forced_kernels[@]}" \
               "GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX2,-FMA,-AVX512F,-AVX512VL" $portable_lanes; do
  default=$(tiny_bits "$trainer" "$variant")
  portable=$(tiny_bits "$trainer" "$variant" --portable)
  echo "    $variant: default $default, portable $portable"
  default_seen[$default]=1
  portable_seen+=("$portable")
done
Z2_PORTABLE_LANES=3 bad_case "Z2_PORTABLE_LANES=3: this build's portable CPU schedules have" "${small[@]}" --portable
golden_first=$(grep -v '^#' "$(dirname "$0")/golden_bits.txt" | head -n 1 | awk -F'|' '{gsub(/ /, "", $5); gsub(/ /, "", $6); print $5 " " $6}')
distinct_portable=$(printf '%s\n' "${portable_seen[@]}" | sort -u)
[ ${#default_seen[@]} -ge 2 ] && [ -z "${default_seen[failed]:-}" ] &&
  pass "default mode: the forced OpenBLAS kernels give ${#default_seen[@]} different hashes (the bits follow the machine)" ||
  fail "default mode: the forced OpenBLAS kernels gave ${#default_seen[@]} hash(es): ${!default_seen[*]} (nothing to show)"
[ "$(echo "$distinct_portable" | wc -l)" = 1 ] && [ "$distinct_portable" = "$golden_first" ] &&
  pass "portable mode: one hash under every OpenBLAS kernel, glibc mask and zero2 schedule ($portable_lanes), the golden table's ($golden_first)" ||
  fail "portable mode: $(echo $distinct_portable) under the variants, the golden table has $golden_first"
# The other build (nvcc <-> g++), if it is there: the same portable bits.
other_build=$([ "$build" = build-cpu ] && echo build || echo build-cpu)
if [ -x "$other_build/train_bert_mini" ]; then
  ours=$(tiny_bits "$trainer" "" --portable --precision bf16)
  theirs=$(tiny_bits "$other_build/train_bert_mini" "" --portable --precision bf16)
  [ "$ours" = "$theirs" ] && [ "$ours" != failed ] && pass "portable bf16: $build and $other_build give the same bits ($ours)" ||
    fail "portable bf16: $build gives $ours, $other_build $theirs"
else
  echo "    ($other_build/train_bert_mini not built: the cross-build check is the golden table's alone)"
fi
# The config key, and its bad values. (A config means DeepSpeed's defaults
# for what it leaves out, notes/07, so the key is compared with the flag
# under the same, otherwise empty, config.)
echo '{"zero2_portable": true}' > "$work/portable.json.cfg"
echo '{}' > "$work/empty.json.cfg"
by_flag=$(tiny_bits "$trainer" "" --config "$work/empty.json.cfg" --portable)
by_key=$(tiny_bits "$trainer" "" --config "$work/portable.json.cfg")
[ "$by_key" = "$by_flag" ] && [ "$by_key" != failed ] && [ "$(json_get "$work/portable.json" "d['portable']")" = True ] &&
  pass "config \"zero2_portable\": true = --portable ($by_key)" ||
  fail "config zero2_portable: $by_key, --portable $by_flag"
echo '{"zero2_portable": "yes"}' > "$work/portable_bad.json"
bad_case "zero2_portable: wants true or false" "${small[@]}" --config "$work/portable_bad.json"
bad_case "'--portable=1': --portable takes no value (write '--portable' to switch it on; a config file's" \
  "${small[@]}" --portable=1
bad_case "--portable needs --collectives deterministic" "${small[@]}" --portable --collectives native

# A portable run saved and resumed (at another N and stage, no --portable on
# the command line: the checkpoint's mode continues) ends on the golden
# table's bits for the straight run; a checkpoint without the record (from
# before portable mode) loads in the default mode; a damaged record is named.
golden_n2=$(grep -v '^#' "$(dirname "$0")/golden_bits.txt" | grep '^tiny fp32, N=2, A=2 ' | awk -F'|' '{gsub(/ /, "", $5); print $5}')
if timeout 120 mpirun -n 2 "$trainer" "${portable_tiny[@]}" --accum 2 --portable --save "$work/portable_ck" --save-keep 3 \
     --save-every 2 > "$work/log" 2>&1 &&
   timeout 120 mpirun -n 4 "$trainer" --load "$work/portable_ck/step_2" --stage 1 --quiet --json "$work/resumed.json" \
     > "$work/log" 2>&1; then
  resumed=$(json_get "$work/resumed.json" "d['final_params_hash'] + ' ' + str(d['portable'])")
  [ "$resumed" = "$golden_n2 True" ] && pass "portable: saved at step 2 (N=2 A=2), resumed at N=4 stage 1 = the golden straight run ($resumed)" ||
    fail "portable resume: $resumed, the golden straight run $golden_n2"
  python3 -c "
import json, sys; p = sys.argv[1]; d = json.load(open(p)); del d['settings']['portable']; json.dump(d, open(p, 'w'))" \
    "$work/portable_ck/step_2/index.json"
  (cd "$work/portable_ck/step_2" && sha256sum index.json > index.sha256)  # edited on purpose: its digest made anew
  timeout 120 mpirun -n 4 "$trainer" --load "$work/portable_ck/step_2" --quiet --json "$work/resumed.json" > "$work/log" 2>&1 &&
    [ "$(json_get "$work/resumed.json" "d['portable']")" = False ] &&
    pass "portable: a checkpoint without the record loads in the default mode" ||
    fail "portable: a checkpoint without settings.portable: $(head -c 300 "$work/log")"
  python3 -c "
import json, sys; p = sys.argv[1]; d = json.load(open(p)); d['settings']['portable'] = 'yes'; json.dump(d, open(p, 'w'))" \
    "$work/portable_ck/step_2/index.json"
  (cd "$work/portable_ck/step_2" && sha256sum index.json > index.sha256)  # edited on purpose: its digest made anew
  bad_ranks=4 bad_case 'settings.portable is "yes", not true or false' --load "$work/portable_ck/step_2"
else
  fail "portable save / resume: a run failed: $(head -c 300 "$work/log")"
fi

# tests/gpu_check.sh runs only where a GPU is lent: it must at least parse.
bash -n "$(dirname "$0")/gpu_check.sh" 2> "$work/log" && pass "tests/gpu_check.sh parses (bash -n)" ||
  fail "tests/gpu_check.sh does not parse: $(head -c 300 "$work/log")"

# The golden table (tests/verify.sh, make verify), every row with make run's
# configuration; then a table with one row planted wrong must be caught.
bash "$(dirname "$0")/verify.sh" "$build" --all > "$work/verify.log" 2>&1
verify_status=$?
while read -r word rest; do
  case "$word" in
    same) pass "golden table: $rest";;
    DIFFERS|FAILED) fail "golden table: $word $rest";;
  esac
done < "$work/verify.log"
[ $verify_status -eq 0 ] && pass "golden table: $(tail -n 1 "$work/verify.log")" || fail "golden table: $(tail -n 1 "$work/verify.log")"
sed '0,/^[^#]/s/| \([0-9a-f]\{16\}\) |/| 0123456789abcdef |/' "$(dirname "$0")/golden_bits.txt" > "$work/golden_planted.txt"
Z2_GOLDEN="$work/golden_planted.txt" bash "$(dirname "$0")/verify.sh" "$build" > "$work/verify.log" 2>&1
planted_status=$?
[ $planted_status -ne 0 ] && grep -q "^DIFFERS tiny fp32, N=1: this build gives $golden_first" "$work/verify.log" &&
  grep -q "does NOT compute zero2's reference bits: 1 of" "$work/verify.log" &&
  pass "golden table: a planted wrong hash is named, exit $planted_status" ||
  fail "golden table: the planted row was not caught (exit $planted_status): $(tail -n 2 "$work/verify.log")"

# The bitwise matrix in portable mode: each precision one hash across N, A,
# stage and ZeRO-R (poisoned activations), as in the default mode.
for precision in fp32 bf16 fp16; do
  reference=""
  for N in 1 2 4; do
    for stage in 0 1 2; do
      [ $precision != fp32 ] && [ $(( (N + stage) % 2 )) = 1 ] && continue  # 16-bit: a subset of the (N, stage)
      same_bits_run "portable $precision N=$N A=$((4 / N)) stage=$stage" $N "$work/portable_matrix.json" --portable \
        --precision $precision --accum $((4 / N)) --stage $stage
    done
  done
  # ZeRO-R: fp32 every --activations x --alloc at N = 2, stage 2; 16-bit two of them.
  for activations in keep recompute offload; do
    for alloc in arena naive caching; do
      case "$precision $activations $alloc" in
        fp32*|*"offload naive"|*"recompute caching") ;;
        *) continue;;
      esac
      same_bits_run "portable $precision N=2 stage 2 --activations $activations --alloc $alloc (poisoned)" 2 \
        "$work/portable_matrix.json" --portable --precision $precision --accum 2 --stage 2 --activations $activations \
        --alloc $alloc --poison-activations
    done
  done
done

# --- 14. traces: another implementation checked against zero2 ----------------------------
if wanted 14; then  # (Z2_TRAINER_SKIP)
echo "=== --trace, --init-hf and tests/check_trace.py (notes/12)"
if ! "$PYTHON" -c 'import numpy' 2>/dev/null; then
  echo "SKIP the traces: $PYTHON has no numpy (make test-deps installs python3-numpy)"
else
traced=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --steps 4
        --warmup 1 --dropout 0 --clip 0.5 --bucket 3000 --quiet --data "$work/corpus.txt")
trace_run() {  # trace_run DIR N FLAGS...: a trace of the tiny run at N ranks, its summary beside it (DIR.json)
  local dir=$1 ranks=$2
  shift 2
  rm -rf "$dir" "$dir.json"
  timeout 300 mpirun -n "$ranks" "$trainer" "${traced[@]}" --trace-params-every 2 "$@" --trace "$dir" --json "$dir.json" \
    > "$work/log" 2>&1 ||
    { echo "    trace run failed: $(tail -c 300 "$work/log")"; return 1; }
}
# Every file of a trace but trace.json, and trace.json's records of the steps: the same bits at every stage
# and every split of the global batch that keeps the summation tree, as the run's own bits are.
same_trace() {  # same_trace LABEL DIR REFERENCE_DIR
  local label=$1 differing=""
  for file in $(cd "$3" && find . -type f ! -name trace.json | sort); do
    cmp -s "$2/$file" "$3/$file" || differing="$differing $file"
  done
  local records
  records=$("$PYTHON" - "$2/trace.json" "$3/trace.json" <<'EOF'
import json, sys
a, b = (json.load(open(path)) for path in sys.argv[1:])
print("same" if a["steps"] == b["steps"] and a["parameter_steps"] == b["parameter_steps"] else "differ")
EOF
)
  if [ -z "$differing" ] && [ "$records" = same ]; then
    pass "$label: every file of the trace and every step's record are the bits of the reference trace"
  else fail "$label: differs in$differing (records: $records)"; fi
}
trace_ok=yes
trace_run "$work/trace_ref" 2 --stage 2 || trace_ok=""
if [ -n "$trace_ok" ]; then
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
    trace_run "$work/trace_stage$stage" 2 --stage $stage && same_trace "trace at stage $stage, N = 2" "$work/trace_stage$stage" "$work/trace_ref"
  done
  # What the trace says against what the run says elsewhere: the --json loss bits, and the export.
  trace_run "$work/trace_export" 2 --stage 2 --export-hf "$work/trace_export_hf"
  if cmp -s "$work/trace_export/step_4/model.safetensors" "$work/trace_export_hf/model.safetensors" &&
     [ "$(json_get "$work/trace_export.json" "' '.join(s['loss_bits'] for s in d['steps'])")" = \
       "$(json_get "$work/trace_export/trace.json" "' '.join(s['loss_bits'] for s in d['steps'])")" ]; then
    pass "trace: step_4's parameters are --export-hf's file, byte for byte; every step's loss bits are --json's"
  else fail "trace: the last parameters or the loss bits differ from --export-hf / --json"; fi
  # The batch and step 1's gradients against --dump-batch (N = 1), read independently with numpy.
  rm -rf "$work/trace_dump" "$work/trace_n1"
  timeout 120 "$trainer" "${traced[@]}" --accum 2 --dump-batch "$work/trace_dump" --trace "$work/trace_n1" > "$work/log" 2>&1
  dump_check=$("$PYTHON" - "$work/trace_n1" "$work/trace_dump" <<'EOF'
import sys
sys.path.insert(0, "tests/peers")
import numpy as np
from trace_files import Trace, read_safetensors
trace, dump = Trace(sys.argv[1]), read_safetensors(sys.argv[2] + "/batch.safetensors")
ids, labels = trace.batch(1)
gradients = trace.gradients(1)
problems = []
if not (np.array_equal(ids, dump["input_ids"]) and np.array_equal(labels, dump["labels"])):
    problems.append("step 1's batch differs from --dump-batch's")
for name, g in gradients.items():
    if g.tobytes() != dump["grad." + name].tobytes():
        problems.append(f"gradient {name} differs from --dump-batch's")
record = trace.steps[0]
counts = [int((labels[m * 2:(m + 1) * 2] != -100).sum()) for m in range(2)]
if record["micro_batch_selected"] != counts or record["selected"] != sum(counts):
    problems.append(f"selected counts {record['micro_batch_selected']} != the batch's {counts}")
if abs(sum(record["micro_batch_losses"]) - record["loss"]) > 4 * np.spacing(np.float32(record["loss"])):
    problems.append("the micro-batch losses do not add up to the loss")
print("; ".join(problems) or "ok")
EOF
)
  # (The batch is rebuilt for the trace on rank 0 from the seed, the dump's is what the micro-steps read;
  # at N = 1 both gradients come from one gathered vector: this checks the trace's names and shapes, the
  # gather itself is checked by the traces' equality across N above.)
  [ "$dump_check" = ok ] && pass "trace at N = 1, A = 2: step 1's batch is the one the micro-steps read (--dump-batch's), its gradients are named and shaped as the dump's; the micro-batches' selected counts and losses add up" ||
    fail "trace against --dump-batch: $dump_check"
  # --init-hf: the weights of another run (seed 5's export) are where this run starts, bit for bit, in
  # fp32 and bf16 (whose fp32 master takes them whole), and the run from them is one hash at every stage.
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
      pass "--init-hf $precision: the run starts from the given weights bit for bit, and stages 0 and 2 end at one hash ($1)"
    else fail "--init-hf $precision: initial weights or hashes differ ($hashes)"; fi
  done
  # The checker: a zero2 run computed another way (--portable: zero2's own gemm, another summation order)
  # agrees within the tolerance, in fp32 and in bf16; one with another learning rate does not.
  for precision in fp32 bf16; do
    trace_run "$work/ck_$precision" 2 --precision $precision --steps 8 &&
    trace_run "$work/ck_${precision}_portable" 2 --precision $precision --steps 8 --portable
    if /usr/bin/python3 tests/check_trace.py "$work/ck_$precision" "$work/ck_${precision}_portable" > "$work/check.log" 2>&1; then
      pass "checker, $precision: zero2 with its own gemm (--portable) agrees with zero2 with OpenBLAS: $(grep '^PASS' "$work/check.log" | cut -c7-120)"
    else fail "checker, $precision: --portable against OpenBLAS: $(grep -E '^FAIL|^diagnosis' "$work/check.log" | head -c 400)"; fi
  done
  trace_run "$work/ck_lr" 2 --steps 8 --lr 2e-3
  /usr/bin/python3 tests/check_trace.py "$work/ck_fp32" "$work/ck_lr" > "$work/check.log" 2>&1
  check_status=$?
  [ $check_status = 1 ] && grep -q '^FAIL step 1, learning rate' "$work/check.log" &&
    pass "checker: another learning rate fails at step 1's rate, exit 1" ||
    fail "checker: another learning rate: exit $check_status, $(head -c 300 "$work/check.log")"
  # The checker's bad input: one message naming the file and the field, exit 2 (NaN: exit 1, named too).
  checker_bad() {  # checker_bad LABEL EXPECTED_STATUS EXPECT THEIRS
    /usr/bin/python3 tests/check_trace.py "$work/ck_fp32" "$4" > "$work/check.log" 2>&1
    local status=$?
    if [ $status = "$2" ] && grep -qF -- "$3" "$work/check.log" && ! grep -q Traceback "$work/check.log"; then
      pass "checker, $1: exit $status, $(grep -E 'error:|^FAIL' "$work/check.log" | head -n 1 | cut -c1-150)"
    else fail "checker, $1: exit $status (want $2), $(head -c 300 "$work/check.log")"; fi
  }
  edited() {  # edited NAME PYTHON: a copy of the portable fp32 trace, its trace.json changed by PYTHON on `t`
    rm -rf "$work/$1"; cp -r "$work/ck_fp32_portable" "$work/$1"
    "$PYTHON" -c "import json; t = json.load(open('$work/$1/trace.json')); $2; json.dump(t, open('$work/$1/trace.json', 'w'))"
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
  "$PYTHON" - "$work/no_tensor/step_1/model.safetensors" <<'EOF'
import sys
sys.path.insert(0, "tests/peers")
from trace_files import read_safetensors, write_safetensors
tensors = read_safetensors(sys.argv[1]); del tensors["cls.predictions.bias"]; write_safetensors(sys.argv[1], tensors)
EOF
  checker_bad "a missing tensor" 2 "no tensor cls.predictions.bias" "$work/no_tensor"
  rm -f "$work/incomplete.json"; rm -rf "$work/incomplete"; cp -r "$work/ck_fp32_portable" "$work/incomplete"
  rm "$work/incomplete/trace.json"
  checker_bad "a trace whose run did not finish" 2 "trace.json: missing" "$work/incomplete"
  trace_run "$work/ck_dropout" 2 --steps 2 --dropout 0.1
  /usr/bin/python3 tests/check_trace.py "$work/ck_dropout" "$work/ck_fp32" > "$work/check.log" 2>&1
  check_status=$?
  [ $check_status = 2 ] && grep -qF "run.dropout is 0.1: zero2's dropout masks come from its own hash" "$work/check.log" &&
    pass "checker: a reference traced with dropout is refused (its masks cannot be replayed), exit 2" ||
    fail "checker: a dropout reference: exit $check_status, $(head -c 300 "$work/check.log")"
fi
# Bad input: one message, every rank, nothing written.
mkdir -p "$work/not_empty"; touch "$work/not_empty/x"
bad_case "--trace '$work/not_empty' is not empty" "${small[@]}" --trace "$work/not_empty"
# Two runs into one new --trace directory (issue 35: both exited 0, the
# directory mixing their files): the lock is taken before the emptiness
# check, so exactly one proceeds. First deterministically: a run stopped
# (SIGSTOP) while it holds the lock on the still empty directory, seen in
# /proc/locks, refuses the second, which names the holder's pid.
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
wait $run && [ -f "$work/t_locked/trace.json" ] && pass "the run holding --trace's lock goes on and writes its trace" ||
  fail "the run holding --trace's lock did not finish its trace"
# Then as users would meet it: a small run and a BERT-mini run started
# together into one new directory, three rounds; each round exactly one
# exits 0, and the trace is whole and that run's (its model's sizes).
for round in 1 2 3; do
  rm -rf "$work/t_race"
  timeout 300 mpirun -n 1 "$trainer" --steps 2 --quiet --trace "$work/t_race" > "$work/race_big.log" 2>&1 &
  big=$!
  timeout 300 mpirun -n 1 "$trainer" "${small[@]}" --quiet --trace "$work/t_race" > "$work/race_small.log" 2>&1
  small_status=$?
  wait $big
  big_status=$?
  hidden=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['model']['hidden_size'])" "$work/t_race/trace.json" 2>/dev/null)
  refused=$(cat "$work/race_big.log" "$work/race_small.log" | grep -cE "is being written by another run|is not empty")
  if { [ $big_status = 0 ] && [ $small_status != 0 ] && [ "$hidden" = 256 ]; } ||
     { [ $small_status = 0 ] && [ $big_status != 0 ] && [ "$hidden" = 16 ]; }; then
    [ "$refused" = 1 ] && pass "two runs into one new --trace (round $round): exactly one proceeds (BERT-mini exit $big_status, the small run $small_status), the trace is the winner's, the other refused" ||
      fail "two runs into one --trace (round $round): the loser's message: $(cat "$work/race_big.log" "$work/race_small.log" | head -c 300)"
  else fail "two runs into one --trace (round $round): BERT-mini exit $big_status, the small run $small_status, the trace's hidden ${hidden:-none}"; fi
done
bad_case "--trace records a run from step 1" "${small[@]}" --trace "$work/t_load" --load "$work/nowhere"
bad_case "--trace-params-every 2 is for --trace DIR" "${small[@]}" --trace-params-every 2
bad_case "is inside --trace" "${small[@]}" --trace "$work/t_in" --export-hf "$work/t_in/export"
bad_case "--plan trains nothing, so --trace" "${small[@]}" --plan --trace "$work/t_plan"
bad_case "--init-hf '$work/nowhere' and --load" "${small[@]}" --init-hf "$work/nowhere" --load "$work/nowhere"
bad_case "has no config.json" "${small[@]}" --init-hf "$work"
if [ -n "$trace_ok" ]; then
  small_init=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --steps 1)
  bad_case "config.json's num_hidden_layers is 2, this run's --layers is 3: give --layers 2" "${small_init[@]}" --layers 3 \
    --init-hf "$work/seed5"
  bad_case "config.json's hidden_size is 32, this run's --hidden is 64" "${small_init[@]}" --hidden 64 --init-hf "$work/seed5"
  # Hand-made directories: a tensor of the wrong shape, one missing, one unknown, an untied decoder, a pickle.
  init_dir() {  # init_dir NAME PYTHON: seed5's export with its tensors `t` changed by PYTHON
    rm -rf "$work/$1"; cp -r "$work/seed5" "$work/$1"
    "$PYTHON" - "$work/$1/model.safetensors" "$2" <<'EOF'
import sys
sys.path.insert(0, "tests/peers")
import numpy as np
from trace_files import read_safetensors, write_safetensors
t = read_safetensors(sys.argv[1]); exec(sys.argv[2]); write_safetensors(sys.argv[1], t)
EOF
  }
  init_dir wrong_shape 't["bert.encoder.layer.1.intermediate.dense.weight"] = np.zeros((32, 64), np.float32)'
  bad_case "bert.encoder.layer.1.intermediate.dense.weight has shape [32, 64], this run's is [64, 32]" \
    "${small_init[@]}" --init-hf "$work/wrong_shape"
  init_dir missing_tensor 'del t["bert.encoder.layer.0.output.LayerNorm.bias"]'
  bad_case "has no tensor bert.encoder.layer.0.output.LayerNorm.bias (shape [32])" "${small_init[@]}" --init-hf "$work/missing_tensor"
  init_dir unknown_tensor 't["bert.encoder.layer.2.output.dense.weight"] = np.zeros((32, 64), np.float32)'
  bad_case "holds bert.encoder.layer.2.output.dense.weight [32, 64], which BertForMaskedLM has no parameter for" \
    "${small_init[@]}" --init-hf "$work/unknown_tensor"
  init_dir untied 't["cls.predictions.decoder.weight"] = t["bert.embeddings.word_embeddings.weight"] + 1'
  bad_case "cls.predictions.decoder.weight differs from bert.embeddings.word_embeddings.weight" "${small_init[@]}" \
    --init-hf "$work/untied"
  init_dir f64 't["cls.predictions.bias"] = t["cls.predictions.bias"].astype(np.float64)'
  bad_case "tensor 'cls.predictions.bias' is F64" "${small_init[@]}" --init-hf "$work/f64"
  rm -rf "$work/pickle"; mkdir -p "$work/pickle"; cp "$work/seed5/config.json" "$work/pickle/"; : > "$work/pickle/pytorch_model.bin"
  bad_case "but a pytorch_model.bin" "${small_init[@]}" --init-hf "$work/pickle"
  # model.safetensors read as untrusted input (trainer/safetensors.h; tests/test_safetensors.cpp has the
  # whole corpus): a header length 4 bytes short (its padding keeps the JSON valid, every tensor would shift
  # by one float), trailing bytes, a name twice, a NaN weight.
  raw_dir() {  # raw_dir NAME PYTHON: seed5's export with model.safetensors' bytes `b` changed by PYTHON
    rm -rf "$work/$1"; cp -r "$work/seed5" "$work/$1"
    "$PYTHON" - "$work/$1/model.safetensors" "$2" <<'EOF'
import struct, sys
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
header, data = b[8:8 + n].rstrip(b" "), b[8 + n:]
exec(sys.argv[2])
open(sys.argv[1], "wb").write(b)
EOF
  }
  raw_dir header_short 'h = header + b" " * 8; b = struct.pack("<Q", len(h) - 4) + h + data'
  bad_case "model.safetensors' is not a safetensors file we can read: its tensors' data ends at byte" \
    "${small_init[@]}" --init-hf "$work/header_short"
  raw_dir trailing 'b += b"\0" * 4'
  bad_case "the rest belongs to no tensor" "${small_init[@]}" --init-hf "$work/trailing"
  raw_dir twice 'h = b"{\"cls.predictions.bias\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}," + header[1:]; b = struct.pack("<Q", len(h)) + h + data'
  bad_case "its header has the key 'cls.predictions.bias' twice in one object" "${small_init[@]}" --init-hf "$work/twice"
  init_dir nan 'x = t["bert.encoder.layer.1.attention.self.query.bias"].copy(); x[5] = np.nan; t["bert.encoder.layer.1.attention.self.query.bias"] = x'
  bad_case "nan/model.safetensors': tensor 'bert.encoder.layer.1.attention.self.query.bias' element 5 [5] is nan: weights to start from must be finite" \
    "${small_init[@]}" --init-hf "$work/nan"
  # config.json's sizes: a value that is not a positive integer is quoted as written, and the only advice
  # is a flag value the flag takes.
  config_dir() {  # config_dir NAME TEXT: seed5's export with config.json's hidden_size written as TEXT
    rm -rf "$work/$1"; cp -r "$work/seed5" "$work/$1"
    "$PYTHON" -c "import re, sys; p = sys.argv[1]; t = open(p).read(); open(p, 'w').write(re.sub(r'\"hidden_size\": *[^,}]*', '\"hidden_size\": ' + sys.argv[2], t))" \
      "$work/$1/config.json" "$2"
  }
  for written in 64.0 '"64"' -64 true null 1e3; do
    config_dir hidden "$written"
    bad_case "config.json's hidden_size is $written, not a positive integer (BertConfig's sizes are ints); this run's --hidden is 32" \
      "${small_init[@]}" --init-hf "$work/hidden"
    if grep -qF -- "give --hidden" "$work/bad_stderr"; then fail "--init-hf hidden_size $written: advice to give a flag value"; fi
  done
  # Absent: BertConfig's default is named as the default (it was called "not a positive integer"), and
  # the advice is the flag value that matches it.
  rm -rf "$work/absent"; cp -r "$work/seed5" "$work/absent"
  "$PYTHON" -c "import json, sys; p = sys.argv[1]; c = json.load(open(p)); del c['hidden_size']; json.dump(c, open(p, 'w'))" \
    "$work/absent/config.json"
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
  init_dir pretraining 't["cls.predictions.decoder.weight"] = t["bert.embeddings.word_embeddings.weight"]; t["bert.pooler.dense.bias"] = np.zeros(32, np.float32); t["cls.predictions.transform.dense.bias"] = t["cls.predictions.transform.dense.bias"].astype(np.float16)'
  if timeout 60 "$trainer" "${small_init[@]}" --init-hf "$work/pretraining" > "$work/log" 2>&1 &&
     grep -qF "not used, as from_pretrained leaves them: bert.pooler.dense.bias" "$work/log"; then
    pass "--init-hf: a tied duplicate, a pooler and an F16 tensor are taken; the header names what is not used"
  else fail "--init-hf with tied names and a pooler: $(grep -E 'error|init' "$work/log" | head -c 300)"; fi
fi

fi  # numpy
fi  # section 14

# --- 15. ZeRO-Offload ----------------------------------------------------------------
# --offload-optimizer cpu (zero_optimization.offload_optimizer, cpu_offload):
# the optimizer's partition and step on the host change no bit. The bad
# input and the plan need no trained step; the rest runs the engine's
# offloaded step (its own matrix is in tests/test_engine.cpp).
if wanted 15; then  # (Z2_TRAINER_SKIP)
echo "=== ZeRO-Offload: bad input, the plan's host bytes, the same bits as without it, checkpoints both ways, the ledger"
# Section 1's small model again (section 9 redefines tiny): its matrices are the references.
tiny=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2
      --steps 3 --warmup 1 --dropout 0.1 --clip 0.5 --bucket 3000 --quiet)
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
bad_case "fp16.fp16_master_weights_and_grads: true is not supported" "${small[@]}" --config "$work/offload_fp16_master.json"

# A host that cannot hold the offloaded optimizer: refused before anything is allocated, the host's share
# named. The limit lies between what the run needs without offload and with it (each read from the
# refusal at a limit of 1 KB), so it is the offloaded 16 Psi/N that does not fit. BERT-mini's size: at
# N = 1 offload adds 4 Psi = 13.7 MB to the need (16 Psi on the host, 12 Psi off the block), well above
# the ~1 MiB by which two runs' measured holdings may differ.
need_of() { ZERO2_MEMORY_LIMIT=1000 timeout 60 "$trainer" --steps 1 --stage 2 --offload-optimizer "$1" 2>&1 |
  sed -n 's/.*this configuration needs \([0-9,]*\) bytes.*/\1/p' | tr -d ,; }
need_none=$(need_of none) need_cpu=$(need_of cpu)
if [ -n "$need_none" ] && [ -n "$need_cpu" ] && [ "$need_cpu" -gt $((need_none + 4194304)) ]; then
  ZERO2_MEMORY_LIMIT=$(( (need_none + need_cpu) / 2 )) bad_ranks=1 bad_case \
    "the optimizer offloaded (ZeRO-Offload, 16 Psi/N)" --steps 1 --stage 2 --offload-optimizer cpu
else
  fail "offload's host bytes are not counted by the memory check: needs $need_none without offload, $need_cpu with it"
fi

# The plan with offload (no step needed): every stage and N, the host's
# bytes equal 16 Psi/N to the byte, the device's model states their formula,
# and stage 2's device keeps the working parameters alone.
verdict=$(for precision in fp32 bf16; do
  "$trainer" --plan --plan-world-sizes 1,2,4 --offload-optimizer cpu --precision $precision --json "$work/offload_plan.json" \
    --quiet "${tiny[@]}" > /dev/null 2>&1 || { echo "bad: --plan $precision failed"; continue; }
  json_get "$work/offload_plan.json" "'ok' if all(r['host_model_states_bytes'] == r['host_model_states_formula_bytes'] == (16 * r['psi_padded'] // r['world_size'] if r['stage'] else 0) and r['model_states_bytes'] == r['model_states_formula_bytes'] and (r['stage'] != 2 or r['model_states_bytes'] == r['params_bytes']) for r in d['plan']) else 'bad $precision: ' + str([(r['stage'], r['world_size'], r['host_model_states_bytes'], r['model_states_bytes']) for r in d['plan']])"
done | sort -u)
[ "$verdict" = ok ] && pass "--plan --offload-optimizer cpu: host 16 Psi/N and device model states = their formulas, fp32 and bf16, stages 0/1/2, N = 1, 2, 4" ||
  fail "offload plan: $verdict"

# --- from here on the engine's offloaded step runs ---
# The same bits: every (stage 1, 2) x precision x overlap at N = 2, and N = 1
# and 4 once, against the run without offload (section 1's and section 6's
# matrices for fp32 and bf16: A = 4/N, the same global batch; fp16 with
# section 8's config that overflows, so that the skipped steps are compared too).
for precision in fp32 bf16 fp16; do
  reference=""
  case $precision in
    fp32) reference=$(json_get "$work/matrix_2_2_1.json" "d['final_params_hash'] + ' ' + ' '.join(s['loss_bits'] for s in d['steps'])")
          reference_label="section 1's matrix";;
    bf16) reference=$(json_get "$work/mixed_bf16_2_2_1.json" "d['final_params_hash'] + ' ' + ' '.join(s['loss_bits'] for s in d['steps'])")
          reference_label="section 6's matrix";;
    fp16) same_bits_run "fp16 (overflowing) stage 2 N=2, no offload" 2 "$work/offload_ref_fp16.json" \
            --config "$work/fp16_skips.json" --accum 2 --steps 8 --stage 2;;
  esac
  extra=(); [ $precision = fp16 ] && extra=(--config "$work/fp16_skips.json" --steps 8) || extra=(--precision $precision)
  for stage in 1 2; do
    for overlap in 0 1; do
      same_bits_run "$precision offload N=2 A=2 stage=$stage overlap=$overlap" 2 \
        "$work/offload_${precision}_2_${stage}_${overlap}.json" "${extra[@]}" --accum 2 --stage $stage --overlap $overlap \
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
  pass "fp16 with offload skips the steps it skips without ($skips)" || fail "fp16 skipped steps differ with offload: $skips"

# The ledger in --json: the host's bytes equal 16 Psi/N, the device's model
# states model_states_formula(..., offload), measured and recomputed here.
verdict=$(python3 - "$work"/offload_*_2_*_1.json "$work"/offload_*_1.json "$work"/offload_*_4.json <<'PY'
import json, sys
problems = []
for path in sys.argv[1:]:
    d = json.load(open(path)); m = d['memory']; N = d['world_size']; psi = d['params_padded']; stage = d['stage']
    work_bytes = 4 if d['precision'] == 'fp32' else 2
    device = (2 if stage == 1 else 1) * work_bytes * psi          # the working parameters (stage 1: and its gradient)
    if not (m['offload_optimizer'] and m['host_model_states_bytes'] == m['host_model_states_formula_bytes'] == 16 * psi // N):
        problems.append(f"{path}: host {m['host_model_states_bytes']} formula {m['host_model_states_formula_bytes']} want {16 * psi // N}")
    if not (m['model_states_bytes'] == m['model_states_formula_bytes'] == device):
        problems.append(f"{path}: device {m['model_states_bytes']} formula {m['model_states_formula_bytes']} want {device}")
    if m['host_master_bytes'] + m['host_optimizer_bytes'] + m['host_grads_bytes'] + m['host_params_bytes'] != m['host_model_states_bytes']:
        problems.append(f"{path}: the host categories do not add up")
print("ok %d runs" % (len(sys.argv) - 1) if not problems else "; ".join(problems[:3]))
PY
)
case "$verdict" in ok*) pass "offload ledger: host = 16 Psi/N, device = 4 Psi / 2 Psi (stage 1: twice), by category, ${verdict#ok }";;
  *) fail "offload ledger: $verdict";; esac
# The header: both shares beside their formulas, equal.
timeout 120 mpirun -n 2 "$trainer" "${tiny[@]:0:${#tiny[@]}-1}" --precision bf16 --offload-optimizer cpu > "$work/log" 2>&1
grep -q "^  model states on the device per rank: [0-9,]* bytes; formula 2 Psi = [0-9,]* (equal)" "$work/log" &&
  grep -q "^  offloaded to the host per rank: [0-9,]* bytes; formula 16 Psi/N = [0-9,]* (equal)" "$work/log" &&
  grep -q "^  offload   optimizer to the host (ZeRO-Offload)" "$work/log" &&
  pass "the header: device and host model states beside their formulas, equal" ||
  fail "offload header: $(grep -E 'model states|offload|error' "$work/log" | head -c 400)"
# A config's offload_optimizer without pin_memory gets the pinning note,
# only while the run offloads: --offload-optimizer none overriding it
# printed the note anyway (issue 35).
echo '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "AdamW"}}' \
  > "$work/offload_unpinned.json"
for choice in cpu none; do
  timeout 120 mpirun -n 2 "$trainer" "${tiny[@]:0:${#tiny[@]}-1}" --steps 1 --config "$work/offload_unpinned.json" \
    --offload-optimizer $choice > "$work/pin_$choice.log" 2>&1
done
grep -q "pin_memory false (DeepSpeed 0.16.9's default): zero2 pins" "$work/pin_cpu.log" &&
  ! grep -q "zero2 pins" "$work/pin_none.log" && ! grep -q "error" "$work/pin_none.log" &&
  pass "the header's pinning note only where the run offloads (the config's cpu, not --offload-optimizer none over it)" ||
  fail "pinning note: with cpu $(grep -c 'zero2 pins' "$work/pin_cpu.log"), with none $(grep -c 'zero2 pins' "$work/pin_none.log")"

# Checkpoints: saved without offload (section 8), resumed with it; saved
# with it, resumed without; both = the straight 8 steps (fp16: with its skips).
for precision in fp32 bf16 fp16; do
  dir="$work/ck_${precision}_2_2"
  timeout 120 mpirun -n 2 "$trainer" --load "$dir/step_4" --offload-optimizer cpu --quiet --json "$dir.to_offload.json" \
    > "$work/log" 2>&1
  verdict=$(resumed_matches "$dir.straight.json" "$dir.to_offload.json" 2>&1)
  [ "$verdict" = ok ] && pass "$precision: saved without offload, resumed with it: the same bits" ||
    fail "$precision resume into offload: $verdict $(head -c 200 "$work/log")"
  odir="$work/ck_offload_${precision}"
  timeout 120 mpirun -n 2 "$trainer" "${ck[@]}" $(precision_flags $precision) --stage 1 --accum 2 --steps 8 --save-every 4 \
    --save "$odir" --offload-optimizer cpu > "$work/log" 2>&1
  timeout 120 mpirun -n 2 "$trainer" --load "$odir/step_4" --stage 2 --offload-optimizer none --quiet \
    --json "$odir.resumed.json" > "$work/log" 2>&1
  verdict=$(resumed_matches "$dir.straight.json" "$odir.resumed.json" $([ $precision = fp16 ] && echo skips) 2>&1)
  [ "$verdict" = ok ] && pass "$precision: saved with offload (stage 1), resumed without it (stage 2): the same bits" ||
    fail "$precision resume out of offload: $verdict $(head -c 200 "$work/log")"
done
# A checkpoint saved with offload is the checkpoint saved without it: the same tensor files, the same index
# but for its run_id (each run's own).
for offload in none cpu; do
  timeout 120 mpirun -n 2 "$trainer" "${tiny[@]}" --steps 2 --save-every 2 --stage 2 --precision bf16 \
    --offload-optimizer $offload --save "$work/ck_files_$offload" > "$work/log" 2>&1
done
verdict=$(python3 - "$work/ck_files_none/step_2" "$work/ck_files_cpu/step_2" <<'PY'
import json, os, sys
a, b = sys.argv[1:]
tensors = sorted(f for f in os.listdir(a) if f.endswith(".safetensors"))
same = bool(tensors) and all(open(os.path.join(a, f), "rb").read() == open(os.path.join(b, f), "rb").read() for f in tensors)
index = [json.load(open(os.path.join(d, "index.json"))) for d in (a, b)]
def without_run_id(value):  # and the setting itself, which a resumed run continues with (notes/13)
    if isinstance(value, dict):
        return {k: without_run_id(v) for k, v in value.items() if k not in ("run_id", "offload_optimizer")}
    return [without_run_id(v) for v in value] if isinstance(value, list) else value
print("ok %d tensor files" % len(tensors) if same and without_run_id(index[0]) == without_run_id(index[1]) else "differ")
PY
)
case "$verdict" in ok*) pass "a checkpoint saved with offload: the files of one saved without it (${verdict#ok }; the index but its run_id and the offload setting)";;
  *) fail "checkpoint files with offload: $verdict";; esac
# A trace with offload is the trace without it, file for file but trace.json (which says it offloaded).
trace_flags=("${tiny[@]}" --dropout 0 --stage 2 --precision bf16 --trace-params-every 1)
timeout 120 mpirun -n 2 "$trainer" "${trace_flags[@]}" --trace "$work/trace_plain" > "$work/log" 2>&1
timeout 120 mpirun -n 2 "$trainer" "${trace_flags[@]}" --offload-optimizer cpu --trace "$work/trace_offload" >> "$work/log" 2>&1
same=yes
[ "$(cd "$work/trace_plain" 2>/dev/null && find . -type f | sort)" = "$(cd "$work/trace_offload" 2>/dev/null && find . -type f | sort)" ] ||
  same="no (not the same files)"
for file in $(cd "$work/trace_plain" 2>/dev/null && find . -type f ! -name trace.json); do
  cmp -s "$work/trace_plain/$file" "$work/trace_offload/$file" || same="no ($file)"
done
[ -d "$work/trace_plain/step_3" ] && [ "$same" = yes ] &&
  [ "$(json_get "$work/trace_offload/trace.json" "d['run']['offload_optimizer']")" = True ] &&
  pass "--trace with offload: the files of the trace without it (parameters and gradients at every step), offload recorded" ||
  fail "offload trace: the same files: $same $(tail -c 300 "$work/log")"
# Resumed with no word on offload: it continues as saved (a run that needed the host's memory keeps it).
timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_offload_bf16/step_4" --quiet --json "$work/ck_inherit.json" \
  > "$work/log" 2>&1
verdict=$(resumed_matches "$work/ck_bf16_2_2.straight.json" "$work/ck_inherit.json" 2>&1)
[ "$verdict" = ok ] && [ "$(json_get "$work/ck_inherit.json" "d['offload_optimizer'] + ' ' + d['settings_origin']['offload_optimizer']")" = "cpu checkpoint" ] &&
  pass "--load without --offload-optimizer: offloaded as saved (settings_origin: checkpoint), the same bits" ||
  fail "offload not continued from the checkpoint: $verdict $(json_get "$work/ck_inherit.json" "d['offload_optimizer'], d['settings_origin'].get('offload_optimizer')" 2>&1 | head -c 200)"
bad_case "--offload-optimizer cpu (the checkpoint's, not given here) with --stage 0" --load "$work/ck_offload_bf16/step_4" --stage 0
fi  # section 15

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
