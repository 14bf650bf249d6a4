#!/usr/bin/env bash
# notes/generate.sh BUILD_DIR — regenerate every measured table in notes/*.md
# and the output excerpt in README.md.
# A table sits between
#     <!-- begin generated: NAME -->  and  <!-- end generated: NAME -->
# and is replaced by what the command for NAME prints now; nothing in those
# blocks is typed by hand. Run through `make notes`.
set -eu
cd "$(dirname "$0")/.."
build=${1:-build}
demo="$build/demo_stages"
[ -x "$demo" ] || { echo "no $demo: run make first"; exit 1; }
export OPENBLAS_NUM_THREADS=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# The model for the ledger tables: the test MLP at 512 wide, 16 layers
# (about 4 M parameters), 64 Ki-element buckets.
model="--device cpu --hidden 512 --layers 16 --micro-batch 16 --bucket 65536 --steps 2"

# ledger: memory and communication per rank, N = 1, 2, 4 x stage 0, 1, 2.
{
  echo "Measured by \`make notes\` (\`mpirun -n N $demo $model --markdown ledger\`). Bytes per rank;"
  echo "the communication columns are bytes sent per optimizer step (A = 1)."
  echo
  echo "| N | stage | Psi_padded | params | grads | optimizer (m, v) | model states | formula | staging | sent per step | formula |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|"
  for ranks in 1 2 4; do
    timeout 300 mpirun -n "$ranks" "$demo" $model --markdown ledger
  done
} >"$out/ledger"

# hashes: the same global batch split as (N, A) = (1,4), (2,2), (4,1).
{
  echo "Measured by \`make notes\` (\`mpirun -n N $demo --device cpu --accum A --markdown hashes\`): the"
  echo "test MLP, 8 steps, global batch 4 micro-batches of 8 samples. Loss of the last step and FNV-1a hash"
  echo "of the final parameters."
  echo
  echo "| N | A | stage | collectives | last loss | loss bits | final parameters hash |"
  echo "|---|---|---|---|---|---|---|"
  for pair in "1 4" "2 2" "4 1"; do
    set -- $pair
    timeout 300 mpirun -n "$1" "$demo" --device cpu --accum "$2" --markdown hashes
  done
  timeout 300 mpirun -n 4 "$demo" --device cpu --accum 1 --collectives native --markdown hashes
} >"$out/hashes"

# sum_order (notes/06): in which order MPI's own collectives add the ranks' contributions, N = 2, 3, 4.
{
  echo "Measured by \`make notes\` (\`mpirun -n N $build/mpi_sum_order\`, $(mpichversion 2>/dev/null | head -n 1 | tr -s ' \t' ' ')):"
  echo "the share of result elements each order of addition explains, over random floats of mixed magnitudes"
  echo "(100%: that is the library's order; orders that coincide at a small N both explain it)."
  echo
  echo "| N | collective | elements | canonical tree | recursive halving | left to right |"
  echo "|---|---|---|---|---|---|"
  for ranks in 2 3 4; do
    timeout 300 mpirun -n "$ranks" "$build/mpi_sum_order"
  done
} >"$out/sum_order"

# build_time (notes/07, "Building"): a fresh clone's make -j2 build/train_bert_mini against the
# last single-file commit, built alternately (measurements/build_time.sh; a few minutes).
{ echo '```'; measurements/build_time.sh 6c9a223 3; echo '```'; } >"$out/build_time"

# gradient_path (notes/00): the definitions one gradient passes through, and their lines.
python3 notes/gradient_path.py >"$out/gradient_path"

# --- BERT-mini (notes/07-bert-mini.md, README.md) ------------------------------------
trainer="$build/train_bert_mini"
# bert_ledger: the default BERT-mini, N = 1, 2, 4 x stage 0, 1, 2, two steps each;
# mixed_ledger (notes/08): the same runs in bf16.
for ranks in 1 2 4; do
  for stage in 0 1 2; do
    timeout 600 mpirun -n "$ranks" "$trainer" --device cpu --stage "$stage" --steps 2 --quiet \
      --json "$out/bert_${ranks}_${stage}.json"
    timeout 600 mpirun -n "$ranks" "$trainer" --device cpu --precision bf16 --stage "$stage" --steps 2 --quiet \
      --json "$out/mixed_${ranks}_${stage}.json"
  done
done
python3 - "$out" "$trainer" >"$out/bert_ledger" <<'PY'
import json, os, sys
out, trainer = sys.argv[1], sys.argv[2]
def mib(x): return f"{x / 1048576:.1f}"
print(f"Measured by `make notes` (`mpirun -n N {trainer} --device cpu --stage S --steps 2 --json ...`):")
print("the default BERT-mini (micro-batch 8 x 128 tokens, bucket 524,288 elements). MiB per rank;")
print("traffic is MiB sent per rank per optimizer step.")
print()
print("| N | stage | Psi_padded | params | grads | optimizer (m, v) | model states | formula | staging | activations | device peak | reduce-scatter | all-gather | formula |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for n in (1, 2, 4):
    for stage in (0, 1, 2):
        d = json.load(open(os.path.join(out, f"bert_{n}_{stage}.json")))
        m, c = d["memory"], d["comm"]
        rs = c["reduce_scatter_bytes_per_step"]; ag = c["all_gather_bytes_per_step"]; ar = c["all_reduce_bytes_per_step"]
        print(f"| {n} | {stage} | {d['params_padded']:,} | {mib(m['params_bytes'])} | {mib(m['grads_bytes'])} | "
              f"{mib(m['optimizer_bytes'])} | {mib(m['model_states_bytes'])} | {mib(m['model_states_formula_bytes'])} | "
              f"{mib(m['staging_bytes'])} | {mib(m['activation_peak_bytes'])} | {mib(m['device_peak_bytes'])} | "
              f"{mib(rs + ar / 2)} | {mib(ag + ar / 2)} | {mib(c['formula_bytes_per_step'])} |")
PY

# bert_run: what `make run` prints (2 ranks, stage 2, the embedded corpus).
# Its summary (--json, which prints nothing) is mixed_accuracy's fp32 row.
{
  echo '```'
  echo "\$ make run"
  timeout 900 mpirun -n 2 "$trainer" --device cpu --stage 2 --json "$out/run_fp32.json"
  echo '```'
} >"$out/bert_run"
# bert_run_excerpt (README): the same run's header, steps 1, 10 and 100 and its summary.
{ awk '/^memory per rank/{exit} /^step/ && !/^step +(1|10|100)\//{next} {print}' "$out/bert_run"; echo '```'; } \
  >"$out/bert_run_excerpt"

# bert_reference: the PyTorch comparison on a dumped batch (as tests/cli/torch_reference.sh runs it).
{
  echo '```'
  flags="--layers 2 --hidden 64 --heads 4 --intermediate 128 --seq 32 --max-positions 40 --micro-batch 4 --accum 2 --steps 1 --dropout 0 --clip 0.5 --seed 3"
  echo "\$ $trainer $flags --dump-batch DUMP --export-hf AFTER"
  echo "\$ tests/torch_reference.py check DUMP AFTER"
  timeout 300 mpirun -n 1 "$trainer" $flags --quiet --dump-batch "$out/dump" --export-hf "$out/after"
  /usr/bin/python3 tests/torch_reference.py check "$out/dump" "$out/after"
  echo '```'
} >"$out/bert_reference"

# math_accuracy: zero2's exp / log / erf over every float (notes/07, "Math functions").
{
  echo "\$ make math-accuracy"
  echo
  build/math_accuracy
} >"$out/math_accuracy"

# bert_bench: `make bench`; zero_r_bench: its ZeRO-R lines (notes/04).
# With the g++ build beside it (make notes builds both), the per-core lines compare the two.
measurements/bench.sh "$build" $(test -x build-cpu/train_bert_mini && echo build-cpu) >"$out/bench_output"
{
  echo '```'
  echo "\$ make bench"
  cat "$out/bench_output"
  echo '```'
} >"$out/bert_bench"
{
  echo '```'
  echo "\$ make bench    # (its last lines)"
  sed -n '/^ZeRO-R/,/^  offload/p' "$out/bench_output"
  echo '```'
} >"$out/zero_r_bench"
{
  echo '```'
  echo "\$ make bench    # (its portable-mode lines)"
  sed -n '/^Portable mode/,/^ZeRO-Offload/p' "$out/bench_output" | sed '$d'
  echo '```'
} >"$out/portable_bench"
{
  echo '```'
  echo "\$ make bench    # (its ZeRO-Offload lines)"
  sed -n '/^ZeRO-Offload/,$p' "$out/bench_output"
  echo '```'
} >"$out/offload_cost"
# host_adam (notes/13): ZeRO-Offload's host AdamW beside DeepSpeedCPUAdam, and the whole offloaded step
# by --host-threads (make bench-host-adam; DeepSpeed's columns where .venv-deepspeed exists).
{
  echo '```'
  echo "\$ make bench-host-adam"
  measurements/host_adam.sh build-cpu
  echo '```'
} >"$out/host_adam"
{
  echo '```'
  echo "\$ make bench    # (its per-core lines)"
  sed -n '1p;/^Per core/,/^Two cores/p' "$out/bench_output"
  echo '```'
} >"$out/bench_summary"

# --- portable bits (notes/11-portable-bits.md, README.md) ---------------------------
# golden_table: tests/golden_bits.txt, each row checked on this build first
# (tests/verify.sh --all fails the generation if one differs).
tests/verify.sh "$build" --all >"$out/verify_output"
if [ -x build-cpu/train_bert_mini ]; then tests/verify.sh build-cpu --all >"$out/verify_cpu_output"; fi
python3 - tests/golden_bits.txt "$build" "$out/verify_output" >"$out/golden_table" <<'PY'
import sys
table, build, verdict = sys.argv[1], sys.argv[2], open(sys.argv[3]).read().strip().splitlines()[-1]
print("From `tests/golden_bits.txt`; every row rerun by `make notes` on this build (`tests/verify.sh %s --all`:" % build)
print("\"%s\"). Each run is `mpirun -n N train_bert_mini FLAGS --portable`." % verdict)
print()
print("| configuration | N | flags | final_params_hash | last loss bits | in `make verify` |")
print("|---|---|---|---|---|---|")
for line in open(table):
    if line.startswith("#") or not line.strip(): continue
    name, size, ranks, flags, hash_, bits = (field.strip() for field in line.split("|"))
    print(f"| {name} | {ranks} | `{flags}` | `{hash_}` | `{bits}` | {'yes' if size == 'small' else 'no (the suite)'} |")
PY
# portable_variants: the golden table's first row under forced OpenBLAS
# kernels, thread counts and glibc masks, in the default and the portable
# mode, in both builds (the suite's section 13 checks the same).
variant_flags="--layers 2 --hidden 64 --heads 2 --intermediate 128 --seq 32 --micro-batch 4 --steps 5 --quiet"
{
  echo "Measured by \`make notes\`: \`VARIANT mpirun -n 1 BUILD/train_bert_mini $variant_flags [--portable]\`"
  echo "(final_params_hash, then the last step's loss bits)."
  echo
  echo "| variant | build | default mode | portable mode |"
  echo "|---|---|---|---|"
  # Only the kernels this CPU can run (a forced SkylakeX kernel dies of
  # SIGILL without AVX-512), as the suite's section 13 does.
  cpu_flags=" $(grep -m 1 '^flags' /proc/cpuinfo) "
  forced_kernels=(OPENBLAS_CORETYPE=Sandybridge OPENBLAS_CORETYPE=Nehalem)
  [[ $cpu_flags == *" avx2 "* && $cpu_flags == *" fma "* ]] &&
    forced_kernels=(OPENBLAS_CORETYPE=Haswell "OPENBLAS_CORETYPE=Haswell OPENBLAS_NUM_THREADS=2" "${forced_kernels[@]}")
  [[ $cpu_flags == *" avx512f "* ]] && forced_kernels+=(OPENBLAS_CORETYPE=SkylakeX)
  for binary_dir in "$build" $(test -x build-cpu/train_bert_mini && echo build-cpu); do
    for variant in "OPENBLAS_CORETYPE=" "${forced_kernels[@]}" \
                   "GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX2,-FMA,-AVX512F,-AVX512VL" Z2_PORTABLE_LANES=8 \
                   Z2_PORTABLE_LANES=1; do
      hashes=""
      for mode in "" --portable; do
        env $variant timeout 120 mpirun -n 1 "$binary_dir/train_bert_mini" $variant_flags $mode --json "$out/variant.json" >/dev/null
        hashes="$hashes | \`$(python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(d['final_params_hash'] + '\` \`' + d['steps'][-1]['loss_bits'])" "$out/variant.json")\`"
      done
      shown=$variant
      [ "$variant" = "OPENBLAS_CORETYPE=" ] && shown="(none: OpenBLAS picks)"
      echo "| $shown | $binary_dir/ $hashes |"
    done
  done
} >"$out/portable_variants"

# --- ZeRO-R (notes/04-activation-offload.md, notes/05-arena.md) ---------------------
# zero_r_modes: the default BERT-mini, N = 2, stage 2, every --activations x --alloc.
for activations in keep recompute offload; do
  for alloc in arena naive; do
    timeout 600 mpirun -n 2 "$trainer" --device cpu --stage 2 --steps 3 --warmup 1 --quiet \
      --activations "$activations" --alloc "$alloc" --json "$out/zr_${activations}_${alloc}.json"
  done
done
python3 - "$out" "$trainer" >"$out/zero_r_modes" <<'PY'
import json, os, sys
out, trainer = sys.argv[1], sys.argv[2]
def mib(x): return f"{x / 1048576:.2f}"
print(f"Measured by `make notes` (`mpirun -n 2 {trainer} --device cpu --stage 2 --steps 3 --warmup 1 --activations X --alloc Y --json ...`):")
print("the default BERT-mini, MiB per rank. The formula is `bert::activation_peak_bytes`; allocations are")
print("allocator calls in the last step.")
print()
print("| activations | alloc | activation peak | formula | host offload peak | device peak | reserved | fragmentation | allocations / step | median step (ms) | final hash |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for act in ("keep", "recompute", "offload"):
    for alloc in ("arena", "naive"):
        d = json.load(open(os.path.join(out, f"zr_{act}_{alloc}.json"))); m = d["memory"]
        print(f"| {act} | {alloc} | {mib(m['activation_peak_bytes'])} | {mib(d['activation_peak_formula_bytes'])} | "
              f"{mib(m['host_offload_peak_bytes'])} | {mib(m['device_peak_bytes'])} | {mib(m['reserved_bytes'])} | "
              f"{m['fragmentation']:.4f} | {m['device_allocations_per_step']} | {d['time']['step_ms_median']:.0f} | "
              f"`{d['final_params_hash']}` |")
PY

# fraglab: `make fraglab` (notes/05).
demos/fraglab.sh "$build" >"$out/fraglab"

# oom_message: naive in a block the arena's measured need (tests/cli/zero_r.sh's case, N = 2).
oom="--layers 3 --hidden 64 --heads 2 --intermediate 256 --seq 32 --micro-batch 4 --steps 2 --activations offload"
timeout 300 mpirun -n 2 "$trainer" --device cpu $oom --alloc arena --quiet --json "$out/oom.json"
need=$(python3 -c "import json; print(json.load(open('$out/oom.json'))['memory']['reserved_bytes'])")
{
  echo '```'
  echo "\$ mpirun -n 2 $trainer --device cpu $oom --alloc naive --device-memory-limit $need"
  status=0
  timeout 300 mpirun -n 2 "$trainer" --device cpu $oom --alloc naive --device-memory-limit "$need" --quiet \
    >"$out/oom_log" 2>&1 || status=$?
  fold -w 110 -s "$out/oom_log"
  echo "\$ echo \$?"
  echo "$status"
  echo '```'
} >"$out/oom_message"

# --- mixed precision (notes/08-mixed-precision.md), capacity (notes/10) ----------------
# paper_table: the paper's Tables 1 and 2 (K = 12) from the ledger's formula.
"$build/paper_table" >"$out/paper_table"

# plan_example, plan_largest (notes/10): --plan's tables.
plan_block() {  # NAME ARGS...: the command (fenced), then what it prints (markdown tables)
  local name=$1
  shift
  { echo '```'; echo "\$ $trainer --plan $*"; echo '```'; echo; "$trainer" --plan "$@"; } >"$out/$name"
}
plan_block plan_example --plan-world-sizes 1,2,4,8,64,1024
plan_block plan_largest --plan-world-sizes 1,4,64 --activations recompute --device-memory-limit 100000000

# superlinear (notes/10): make superlinear.
demos/superlinear.sh "$build" >"$out/superlinear"

# mixed_ledger: the bf16 runs made beside bert_ledger's.
python3 - "$out" "$trainer" >"$out/mixed_ledger" <<'PY'
import json, os, sys
out, trainer = sys.argv[1], sys.argv[2]
def mib(x): return f"{x / 1048576:.1f}"
print(f"Measured by `make notes` (`mpirun -n N {trainer} --device cpu --precision bf16 --stage S --steps 2 --json ...`):")
print("the default BERT-mini, MiB per rank. fp32 is the same run in fp32 (notes/07's table); traffic is")
print("MiB sent per rank per step (A = 1), 16-bit slices.")
print()
print("| N | stage | params (bf16) | grads (bf16) | master (fp32) | m, v (fp32) | model states | formula | | fp32 model states | fp32 / bf16 | traffic | formula |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for n in (1, 2, 4):
    for stage in (0, 1, 2):
        d = json.load(open(os.path.join(out, f"mixed_{n}_{stage}.json")))
        f = json.load(open(os.path.join(out, f"bert_{n}_{stage}.json")))
        m, c = d["memory"], d["comm"]
        moved = c["reduce_scatter_bytes_per_step"] + c["all_gather_bytes_per_step"] + c["all_reduce_bytes_per_step"]
        equal = "equal" if m["model_states_bytes"] == m["model_states_formula_bytes"] else "DIFFERS"
        print(f"| {n} | {stage} | {mib(m['params_bytes'])} | {mib(m['grads_bytes'])} | {mib(m['master_bytes'])} | "
              f"{mib(m['optimizer_bytes'])} | {mib(m['model_states_bytes'])} | {m['model_states_formula']} = "
              f"{mib(m['model_states_formula_bytes'])} | {equal} | {mib(f['memory']['model_states_bytes'])} | "
              f"{f['memory']['model_states_bytes'] / m['model_states_bytes']:.2f} | {mib(moved)} | {mib(c['formula_bytes_per_step'])} |")
PY

# mixed_reduction: the 16-bit reduction's error against DeepSpeed's, N = 2 and 4.
{
  echo "Measured by \`make notes\` (\`mpirun -n N $build/reduce_precision\`, measurements/reduce_precision.cu): the"
  echo "default BERT-mini's 16-bit gradients of N micro-batches (step 0; fp16 scaled by 2^16), summed both"
  echo "ways and compared element by element with the exact sum (float64). "Correctly rounded": within half"
  echo "an ulp of the exact sum; ulps are the 16-bit format's at the exact sum."
  echo
  timeout 300 mpirun -n 2 "$build/reduce_precision" --header
  timeout 300 mpirun -n 4 "$build/reduce_precision"
} >"$out/mixed_reduction"

# mixed_overflow: fp16 forced to overflow (a tiny model, 2^24 to start, window 4),
# at stage 2 (a config without zero_optimization means stage 0, as in DeepSpeed).
echo '{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true, "initial_scale_power": 24, "loss_scale_window": 4, "hysteresis": 2}}' >"$out/overflow.json"
overflow_flags="--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --steps 14 --warmup 1 --log-every 1"
{
  echo '```'
  echo "\$ cat ds_fp16.json"
  cat "$out/overflow.json"
  echo "\$ mpirun -n 2 $trainer $overflow_flags --config ds_fp16.json"
  timeout 300 mpirun -n 2 "$trainer" --device cpu $overflow_flags --config "$out/overflow.json" |
    sed -n '/^  precision/,/^  initial loss/p;/^step/p;/loss scale (final)/p' | sed "s|$out/overflow.json|ds_fp16.json|"
  echo '```'
} >"$out/mixed_overflow"

# mixed_accuracy: make run's training (100 steps, N = 2, stage 2) in each precision.
for precision in bf16 fp16; do
  timeout 1800 mpirun -n 2 "$trainer" --device cpu --stage 2 --precision $precision --quiet --json "$out/run_$precision.json"
done
python3 - "$out" "$trainer" >"$out/mixed_accuracy" <<'PY'
import json, os, sys
out, trainer = sys.argv[1], sys.argv[2]
print(f"Measured by `make notes` (`mpirun -n 2 {trainer} --device cpu --stage 2 --precision P --json ...`: make run's")
print("training, 100 steps of the default BERT-mini). The gap is the last-10-step mean loss's, relative to fp32's.")
print()
print("| precision | first loss | last loss | mean of the last 10 | gap to fp32 | within 1% | skipped steps | final loss scale | median step (ms) | final hash |")
print("|---|---|---|---|---|---|---|---|---|---|")
runs = {p: json.load(open(os.path.join(out, f"run_{p}.json"))) for p in ("fp32", "bf16", "fp16")}
tail = {p: sum(s["loss"] for s in d["steps"][-10:]) / 10 for p, d in runs.items()}
for p, d in runs.items():
    gap = (tail[p] - tail["fp32"]) / tail["fp32"]
    print(f"| {p} | {d['steps'][0]['loss']:.4f} | {d['steps'][-1]['loss']:.4f} | {tail[p]:.4f} | {gap:+.2e} | "
          f"{'yes' if abs(gap) <= 0.01 else 'NO'} | "
          f"{d.get('skipped_steps', 0)} | {d.get('loss_scale', 1):g} | {d['time']['step_ms_median']:.0f} | `{d['final_params_hash']}` |")
PY

# mixed_reference: one bf16 and one fp16 step against fp64 and torch.autocast (as tests/cli/precision.sh runs it).
{
  echo '```'
  flags="--layers 2 --hidden 64 --heads 4 --intermediate 128 --seq 32 --max-positions 40 --micro-batch 4 --accum 2 --steps 1 --dropout 0 --clip 0.5 --seed 3"
  for precision in bf16 fp16; do
    echo "\$ $trainer $flags --precision $precision --dump-batch DUMP_$precision"
    echo "\$ tests/torch_reference.py mixed DUMP_$precision"
    timeout 300 mpirun -n 1 "$trainer" $flags --precision $precision --quiet --dump-batch "$out/dump_$precision"
    /usr/bin/python3 tests/torch_reference.py mixed "$out/dump_$precision"
  done
  echo '```'
} >"$out/mixed_reference"

# --- checkpoints (notes/09-checkpoints.md) --------------------------------------------
# checkpoint_resume: the default BERT-mini, 8 steps straight at (N, A, stage)
# = (1, 4, 0); the same saved at step 4 by (4, 1, 2); step_4 loaded by (2, 2, 1)
# and (1, 4, 0) (A from the checkpoint's N x A) and trained to step 8. In fp32
# and fp16 (whose loss scale is part of the state). checkpoint_layout: the
# directory the (4, 1, 2) run left, and its index without the parameter list.
for precision in fp32 fp16; do
  ck="$out/ck_$precision"
  flags=(--device cpu --precision "$precision" --steps 8 --quiet)
  timeout 600 "$trainer" "${flags[@]}" --accum 4 --stage 0 --json "$out/ck_${precision}_straight.json"
  timeout 600 mpirun -n 4 "$trainer" "${flags[@]}" --stage 2 --save "$ck" --save-every 4 \
    --json "$out/ck_${precision}_saved.json"
  timeout 600 mpirun -n 2 "$trainer" --device cpu --quiet --stage 1 --load "$ck/step_4" \
    --json "$out/ck_${precision}_resumed2.json"
  timeout 600 "$trainer" --device cpu --quiet --stage 0 --load "$ck/step_4" --json "$out/ck_${precision}_resumed1.json"
done
timeout 600 mpirun -n 2 "$trainer" --device cpu --load "$out/ck_fp32/step_4" --stage 1 --log-every 4 \
  >"$out/ck_resume_stdout"
python3 - "$out" "$trainer" >"$out/checkpoint_resume" <<'PY'
import json, os, sys
out, trainer = sys.argv[1], sys.argv[2]
print(f"Measured by `make notes`: the default BERT-mini ({trainer} --device cpu --steps 8), 8 optimizer steps")
print("of 4 micro-batches of 8 x 128 tokens. \"saved by\" is the run that wrote step_4 (its times are its two")
print("saves', step 4 and step 8); \"from step_4\" rows loaded it (`--load DIR/step_4 --stage S`, the run's N,")
print("A taken from the checkpoint's N x A = 4) and trained steps 5 to 8.")
print()
print("| precision | run | N | A | stage | steps trained | loss scale at the end | last loss bits | final parameters hash | save / load |")
print("|---|---|---|---|---|---|---|---|---|---|")
for precision in ("fp32", "fp16"):
    rows = [("straight", "straight"), ("saved", "saved by"), ("resumed2", "from step_4"), ("resumed1", "from step_4")]
    for name, label in rows:
        d = json.load(open(os.path.join(out, f"ck_{precision}_{name}.json")))
        ck = d["checkpoint"]
        times = (" + ".join(f"{s['seconds']:.2f} s" for s in ck["saved"]) + " saving" if ck["saved"]
                 else f"{ck['loaded']['seconds']:.2f} s loading" if ck["loaded"] else "")
        trained = f"{d['steps'][0]['step']}..{d['steps'][-1]['step']}" if d["steps"] else "none"
        print(f"| {precision} | {label} | {d['world_size']} | {d['accum']} | {d['stage']} | {trained} | "
              f"{d['loss_scale']:g} | `{d['steps'][-1]['loss_bits']}` | `{d['final_params_hash']}` | {times} |")
PY
{
  echo '```'
  echo "\$ mpirun -n 4 $trainer --precision fp32 --steps 8 --stage 2 --save ck --save-every 4"
  echo "\$ find ck -type f -printf '%p %s bytes\\n' | sort && cat ck/latest"
  find "$out/ck_fp32" -type f -printf '%p %s bytes\n' | sort && cat "$out/ck_fp32/latest"
  echo "\$ cat ck/step_4/index.json    # the parameter list (name, shape, numel of each) cut after the first"
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
d['parameters'] = d['parameters'][:1] + ['... %d more' % (len(d['parameters']) - 1)]
print(json.dumps(d, indent=1))" "$out/ck_fp32/step_4/index.json"
  echo "\$ mpirun -n 2 $trainer --load ck/step_4 --stage 1 --log-every 4    # N x A = 2 x 2, steps 5 to 8"
  sed -n '/^train_bert_mini/,/^summary/p' "$out/ck_resume_stdout" | grep -E '^(train_bert_mini|  (world|stage|batch|loaded)|step)'
  echo '```'
} | sed "s|$out/ck_fp32|ck|g" >"$out/checkpoint_layout"

# --- DeepSpeed configs and --help (notes/07-bert-mini.md) ------------------------------
# config_refused: a public config with two keys this trainer cannot take, both
# in one message; trainer_help: the --help text.
{
  echo '```'
  echo "\$ mpirun -n 2 $trainer --config tests/ds_configs/cifar.json"
  status=0
  timeout 120 mpirun -n 2 "$trainer" --device cpu --config tests/ds_configs/cifar.json --steps 1 >/dev/null 2>"$out/cifar_err" || status=$?
  cat "$out/cifar_err"
  echo "(exit $status)"
  echo '```'
} >"$out/config_refused"
{
  echo '```'
  echo "\$ $trainer --help"
  "$trainer" --help
  echo '```'
} >"$out/trainer_help"

# --- checking another implementation (notes/12-checking-other-implementations.md) ---
# trace_size: a BERT-mini trace of 200 steps and what each part weighs; check_peer_torch: `make check-peer
# PEER=torch` (the torch peer and the planted mistakes); check_trace_failure: the checker's whole output on
# one planted mistake.
notes/generate_traces.sh "$build" "$out"
# offload_ledger (notes/13): BERT-mini at N = 2, stages 1 and 2, fp32 and bf16, with and without
# --offload-optimizer cpu: the device's and the host's model states beside their formulas, the host by
# category, the final hash of each pair (the same).
offload_flags="--steps 3 --quiet"
for precision in fp32 bf16; do
  for stage in 1 2; do
    for offload in none cpu; do
      timeout 300 mpirun -n 2 "$trainer" $offload_flags --precision $precision --stage $stage --offload-optimizer $offload \
        --json "$out/offload_${precision}_${stage}_$offload.json" >/dev/null
    done
  done
done
python3 - "$out" "$trainer" "$offload_flags" >"$out/offload_ledger" <<'PY'
import json, sys
work, trainer, flags = sys.argv[1:]
run = lambda p, s, o: json.load(open(f"{work}/offload_{p}_{s}_{o}.json"))
print(f"Measured by `make notes` (`OPENBLAS_NUM_THREADS=1 mpirun -n 2 {trainer} {flags} --precision P --stage S "
      f"--offload-optimizer O --json FILE`; the hashes depend on OpenBLAS's thread count, which splits its sums):")
print("BERT-mini at its default sizes, bytes per rank; each figure is the run's ledger, each formula `model_states_formula`")
print("or `offloaded_states_formula` of zero2.cu (the same the ledger prints beside it). Hash: the final parameters.")
print()
print("| precision | stage | offload | device model states | formula | host model states | formula "
      "| host: master, m + v, grads, params | final hash |")
print("|---|---|---|---|---|---|---|---|---|")
for p in ("fp32", "bf16"):
    for s in (1, 2):
        for o in ("none", "cpu"):
            d = run(p, s, o); m = d["memory"]
            host = (f"{m['host_master_bytes']:,}, {m['host_optimizer_bytes']:,}, {m['host_grads_bytes']:,}, "
                    f"{m['host_params_bytes']:,}") if o == "cpu" else "-"
            print(f"| {p} | {s} | {o} | {m['model_states_bytes']:,} | {m['model_states_formula']} = "
                  f"{m['model_states_formula_bytes']:,} | {m['host_model_states_bytes']:,} | "
                  f"{'16 Psi/N' if o == 'cpu' else '0'} = "
                  f"{m['host_model_states_formula_bytes']:,} | {host} | `{d['final_params_hash']}` |")
d = run("bf16", 2, "cpu")
print()
print(f"Psi_padded = {d['params_padded']:,} at N = 2. bf16 stage 2 without offload keeps "
      f"{run('bf16', 2, 'none')['memory']['model_states_bytes']:,} bytes of model states on the device; "
      f"with it, {d['memory']['model_states_bytes']:,} "
      f"({d['memory']['model_states_bytes'] / run('bf16', 2, 'none')['memory']['model_states_bytes']:.3f} of it), "
      f"and the host holds {d['memory']['host_model_states_bytes']:,}.")
PY

# --- reliability (notes/14-reliability.md) -------------------------------
# reliability_messages: a rank stopped mid-run (the watchdog), ranks waiting for
# different things (tests/watchdog_check.cpp), a full disk (a
# 64 KiB tmpfs, when mount is allowed), an output that names an input.
tiny_flags="--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --warmup 1 --quiet"
{
  echo '```'
  echo "\$ mpirun -n 4 $trainer ... --timeout 3 &    # then: kill -STOP <rank 2's pid>"
  marker="$out/stopped.json"
  timeout 120 mpirun -n 4 "$trainer" --device cpu $tiny_flags --steps 1000000 --timeout 3 --json "$marker" \
    >/dev/null 2>"$out/stopped_err" &
  job=$!
  sleep 3
  for pid in $(pgrep -f "^$trainer.*$marker"); do
    tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx 'PMI_RANK=2' && kill -STOP "$pid"
  done
  status=0
  wait $job || status=$?
  pkill -9 -f "$marker" 2>/dev/null || true
  grep '^\[zero2\]' "$out/stopped_err" | fold -w 110 -s
  echo "(exit $status)"
  echo "\$ mpirun -n 3 $build/watchdog_check 2    # rank 0 waits for a message, ranks 1 and 2 in a barrier"
  status=0
  timeout 60 mpirun -n 3 "$build/watchdog_check" 2 >/dev/null 2>"$out/desync_err" || status=$?
  grep '^\[zero2\]' "$out/desync_err" | fold -w 110 -s
  echo "(exit $status)"
  mkdir -p "$out/full"
  if mount -t tmpfs -o size=64k tmpfs "$out/full" 2>/dev/null; then
    head -c 1M /dev/zero >"$out/full/filler" 2>/dev/null || true
    echo "\$ mpirun -n 2 $trainer ... --json full_disk/run.json"
    status=0
    timeout 120 mpirun -n 2 "$trainer" --device cpu $tiny_flags --steps 2 --json "$out/full/run.json" \
      >/dev/null 2>"$out/full_err" || status=$?
    umount "$out/full"
    sed "s|$out/full|full_disk|" "$out/full_err" | fold -w 110 -s
    echo "(exit $status)"
  fi
  printf 'Some text to train on. %.0s' $(seq 1 20) >"$out/corpus.txt"
  echo "\$ mpirun -n 2 $trainer ... --data corpus.txt --json corpus.txt"
  status=0
  timeout 120 mpirun -n 2 "$trainer" --device cpu $tiny_flags --steps 2 --data "$out/corpus.txt" --json "$out/corpus.txt" \
    >/dev/null 2>"$out/overwrite_err" || status=$?
  sed "s|$out/||g" "$out/overwrite_err" | fold -w 110 -s
  echo "(exit $status)"
  # An output that is a device (a node made here, as /dev/null is one), and
  # a model the memory limit cannot hold (the limit lowered by the variable,
  # as the suite does: the machine's own would need a model of its size).
  if mknod "$out/null" c 1 3 2>/dev/null; then
    echo "\$ mpirun -n 2 $trainer ... --json /dev/null"
    status=0
    timeout 120 mpirun -n 2 "$trainer" --device cpu $tiny_flags --steps 2 --json "$out/null" \
      >/dev/null 2>"$out/device_err" || status=$?
    sed "s|$out/null|/dev/null|g" "$out/device_err" | fold -w 110 -s
    echo "(exit $status)"
  fi
  echo "\$ ZERO2_MEMORY_LIMIT=2000000000 $trainer --device cpu --layers 8 --hidden 1024 --heads 16 --intermediate 4096"
  status=0
  ZERO2_MEMORY_LIMIT=2000000000 timeout 120 "$trainer" --device cpu --layers 8 --hidden 1024 --heads 16 \
    --intermediate 4096 --steps 1 >/dev/null 2>"$out/memory_err" || status=$?
  fold -w 110 -s "$out/memory_err"
  echo "(exit $status)"
  echo '```'
} >"$out/reliability_messages"

# host_use: what a run holds on the host besides the plan (notes/10): the
# need the memory check computes (read from its own refusal under
# ZERO2_MEMORY_LIMIT=1, which names it and what the process held when it
# checked, measured) against the peak resident memory of the run itself
# (/usr/bin/time -f %M): the need bounds the whole process's peak, for every
# option that holds host memory.
{
  echo "Measured by \`make notes\`: \`/usr/bin/time -f %M $trainer --device cpu FLAGS --quiet\` (peak KiB);"
  echo "the plan's arena block from \`--plan --plan-world-sizes 1 --json\`; the check's need, and what the process"
  echo "held when it checked (measured, part of the need), from the same run refused under \`ZERO2_MEMORY_LIMIT=1\`."
  echo "N = 1, stage 2; --load and --init-hf read what the row above them wrote."
  echo
  echo "| run | 4 Psi | plan block | held at the check | the check's need | peak resident | peak / need |"
  echo "|---|---|---|---|---|---|---|"
  mini="--steps 2"
  medium="--layers 4 --hidden 1024 --heads 16 --intermediate 4096 --seq 32 --micro-batch 1 --steps 1"
  rm -rf "$out"/hu_*
  # label | the model's flags (also --plan's) | the option measured
  for run in "default BERT-mini, --steps 2|$mini|" "the same, --export-hf|$mini|--export-hf $out/hu_export" \
             "the same, --init-hf (that export)|$mini|--init-hf $out/hu_export" \
             "the same, --save|$mini|--save $out/hu_save" "the same, --load (that save), --steps 4|--steps 4|--load $out/hu_save" \
             "the same, --trace|$mini|--trace $out/hu_trace" "the same, --dump-batch|$mini|--dump-batch $out/hu_dump" \
             "the same, --offload-optimizer cpu|$mini --offload-optimizer cpu|" \
             "L 4, H 1024, F 4096, seq 32, micro-batch 1|$medium|" \
             "the same, --export-hf|$medium|--export-hf $out/hu_export_medium" \
             "the same, --init-hf (that export)|$medium|--init-hf $out/hu_export_medium" \
             "the same, --save|$medium|--save $out/hu_save_medium" \
             "the same, --load (that save), --steps 2|$medium --steps 2|--load $out/hu_save_medium" \
             "the same, --trace|$medium|--trace $out/hu_trace_medium" \
             "the same, --dump-batch|$medium|--dump-batch $out/hu_dump_medium" \
             "the same, --offload-optimizer cpu|$medium --offload-optimizer cpu|" \
             "the same, bf16|$medium --precision bf16|" \
             "the same, bf16, --trace|$medium --precision bf16|--trace $out/hu_trace_medium_bf16"; do
    label=${run%%|*} rest=${run#*|}
    plan_flags=${rest%%|*} option=${rest#*|}
    flags="$plan_flags $option"
    [ -z "${option##--load*}" ] && [ -n "$option" ] && flags="--steps ${plan_flags##*--steps } $option"
    written=$(echo "$option" | grep -oE -- '--(export-hf|save|trace|dump-batch) [^ ]+' | cut -d' ' -f2 || true)
    "$trainer" --device cpu $plan_flags --plan --plan-world-sizes 1 --quiet --json "$out/hu_plan.json" >/dev/null
    rm -rf $written  # (the refused run writes nothing; the measured one writes into a new directory)
    ZERO2_MEMORY_LIMIT=1 "$trainer" --device cpu $flags --quiet >/dev/null 2>"$out/hu_need" || true
    /usr/bin/time -f %M -o "$out/hu_peak" "$trainer" --device cpu $flags --quiet >/dev/null
    python3 - "$out/hu_plan.json" "$out/hu_need" "$out/hu_peak" "$label" <<'PY'
import json, re, sys
plan = [r for r in json.load(open(sys.argv[1]))["plan"] if r["stage"] == 2][0]
message = open(sys.argv[2]).read()
need = int(re.search(r"needs ([0-9,]+) bytes", message).group(1).replace(",", ""))
held = float(re.search(r"\(([0-9.]+) GiB held already", message).group(1)) * 2**30
peak = int(open(sys.argv[3]).read().split()[-1]) * 1024
mb = lambda b: f"{b / 1e6:,.1f} MB"
print(f"| {sys.argv[4]} | {mb(4 * plan['psi_padded'])} | {mb(plan['arena_block_bytes'])} | {mb(held)} | {mb(need)} | "
      f"{mb(peak)} | {peak / need:.2f} |")
PY
  done
} >"$out/host_use"

# several_machines: a host file naming this machine twice gives the losses of
# mpirun -n 2; a rank whose --data differs is named (MPMD: one file per rank).
{
  printf 'localhost:1\n127.0.0.1:1\n' >"$out/hostfile"
  echo '```'
  echo "\$ cat hostfile"
  cat "$out/hostfile"
  for launch in "-f hostfile -n 2" "-n 2"; do
    echo "\$ mpirun $launch $trainer $tiny_flags --steps 4 --json run.json"
    timeout 120 mpirun ${launch/hostfile/$out/hostfile} "$trainer" --device cpu $tiny_flags --steps 4 --json "$out/hosts.json" >/dev/null 2>&1
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('  last loss bits %s, final params hash %s' % (d['steps'][-1]['loss_bits'], d['final_params_hash']))" "$out/hosts.json"
  done
  printf 'The same words, on host b. %.0s' $(seq 1 30) >"$out/other.txt"
  cp "$out/other.txt" "$out/mine.txt"; printf 'but not quite' >>"$out/other.txt"
  echo "\$ mpirun -n 1 $trainer ... --data corpus.txt : -n 1 $trainer ... --data corpus.txt    # rank 1's copy differs"
  status=0
  timeout 120 mpirun -n 1 "$trainer" --device cpu $tiny_flags --steps 1 --data "$out/mine.txt" : \
    -n 1 "$trainer" --device cpu $tiny_flags --steps 1 --data "$out/other.txt" >/dev/null 2>"$out/hosts_err" || status=$?
  fold -w 110 -s "$out/hosts_err"
  echo "(exit $status)"
  echo '```'
} >"$out/several_machines"

# launchers (notes/07, "Launching"): each way people start the trainer, what MPI makes of it, the exit
# status, whether --json was written, and the message's start. torchrun's, the deepspeed launcher's, srun's
# and Open MPI's processes are started directly with their variables (what each launcher sets); the last
# row is Debian's own torchrun, which fails before it starts any process (torch 1.13 on Python 3.11).
launch_row() {  # LAUNCH VARS COMMAND...: one row
  local launch=$1 vars=$2 status=0 world=- written=no said
  shift 2
  rm -f "$out/launch.json"
  env $vars timeout 120 "$@" --json "$out/launch.json" >/dev/null 2>"$out/launch_err" || status=$?
  if [ -e "$out/launch.json" ]; then
    written=yes
    world=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['world_size'])" "$out/launch.json")
  fi
  said=$(sed -n 's/^train_bert_mini: error: \(.\{1,80\}\).*/\1 .../p' "$out/launch_err" | head -n 1)
  echo "| $launch | ${vars:+\`$vars\`} | $world | $status | $written | $said |"
}
{
  one_step="--device cpu --layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 --micro-batch 2 --steps 1 --quiet"
  echo "Measured by \`make notes\` ($trainer, one step of a small model; the variables are what each launcher"
  echo "sets, the process started without mpirun as that launcher starts it):"
  echo
  echo "| launch | environment | world (--json) | exit | --json written | message |"
  echo "|---|---|---|---|---|---|"
  launch_row "\`mpirun -n 2\`" "" mpirun -n 2 "$trainer" $one_step
  launch_row "\`mpirun -n 2\` in an allocation, a shell's WORLD_SIZE" "WORLD_SIZE=4 RANK=3 SLURM_NTASKS=8 SLURM_PROCID=5" \
    mpirun -n 2 "$trainer" $one_step
  launch_row "\`mpirun -n 1\` in an allocation" "SLURM_NTASKS=4 SLURM_PROCID=0" mpirun -n 1 "$trainer" $one_step
  launch_row "a bare start (one rank)" "" "$trainer" $one_step
  launch_row "torchrun, process 0 of 2" "WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2" "$trainer" $one_step
  launch_row "torchrun, process 1 of 2" "WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2" "$trainer" $one_step
  launch_row "deepspeed launcher, process 1 of 2 (\`--local_rank=1\`)" "WORLD_SIZE=2 RANK=1 LOCAL_RANK=1" \
    "$trainer" $one_step --local_rank=1
  launch_row "srun without MPI's PMI, task 1 of 2" "SLURM_NTASKS=2 SLURM_PROCID=1 SLURM_LOCALID=1" "$trainer" $one_step
  launch_row "Open MPI's mpirun, rank 1 of 2" "OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=1 PMIX_RANK=1" \
    "$trainer" $one_step
  launch_row "\`mpirun -n 2 ... --local_rank=0\`" "" mpirun -n 2 "$trainer" $one_step --local_rank=0
  status=0
  timeout 120 /usr/bin/python3 -m torch.distributed.run --standalone --nproc_per_node 2 --no_python "$trainer" \
    $one_step --json "$out/launch.json" >/dev/null 2>"$out/torchrun_err" || status=$?
  written=no; [ -e "$out/launch.json" ] && written=yes
  echo "| Debian's \`torchrun --standalone --nproc_per_node 2 --no_python\` | | - | $status | $written |" \
    "torchrun itself: $(grep -E '^[A-Za-z]+Error' "$out/torchrun_err" | tail -n 1 | cut -c1-70) |"
} >"$out/launchers"

# gpu_summary, gpu_zero_r: from the saved log of tests/gpu_check.sh's last GPU run
# (this machine has no GPU; the log is what the GPU machine printed). Its summary line names the mode
# (quick or full) since the script was split; a log without one is the one-pass script's.
gpu_log=notes/gpu/gpu_check_h200.log
gpu_mode=$(sed -n 's/^=== summary (\(quick\|full\),.*/\1/p' "$gpu_log" | head -n 1)
{
  echo '```'
  echo "\$ tests/gpu_check.sh${gpu_mode:+ $gpu_mode}    # $(head -n 1 "$gpu_log" | cut -d'(' -f1)${gpu_mode:-(the one-pass script, before quick and full)}"
  sed -n '/^=== summary/,$p' "$gpu_log"
  echo '```'
} >"$out/gpu_summary"
{
  echo '```'
  sed -n '/^=== summary/,$p' "$gpu_log" | grep -E '^ *ZeRO-R' | sed 's/^ *//'
  echo '```'
} >"$out/gpu_zero_r"

# streams_mutation (notes/15): every site that orders the streams skipped in turn on --device sim, the
# mutation test tests/cli/streams.sh runs (tests/cli/streams.py), its rows as a table.
python3 tests/cli/streams.py mutation "$build" "$out/streams_rows.json" >"$out/streams_mutation.log" 2>&1 ||
  { cat "$out/streams_mutation.log"; echo "the mutation test failed"; exit 1; }
python3 tests/cli/streams.py table "$out/streams_rows.json" >"$out/streams_mutation"

# --- the labs (notes/labs/README.md) -------------------------------------------------
# labs_example: one planted mistake graded as a student's file is;
# labs_check: `make labs`, every lab's engine, skeleton and planted mistakes.
{
  echo '```'
  echo "\$ make lab LAB=reduce-scatter SOLUTION=tests/lab_mistakes/reduce-scatter.left-to-right.cpp"
  make --no-print-directory lab LAB=reduce-scatter SOLUTION=tests/lab_mistakes/reduce-scatter.left-to-right.cpp |
    fold -w 110 -s || true
  echo '```'
} >"$out/labs_example"
make --no-print-directory labs >"$out/labs_output" 2>&1 || { cat "$out/labs_output"; echo "make labs failed"; exit 1; }
{
  echo '```'
  echo "\$ make labs    # (its verdicts)"
  grep -E '^(PASS|FAIL):' "$out/labs_output"
  tail -n 1 "$out/labs_output"
  echo '```'
} >"$out/labs_check"

python3 - "$out" README.md notes/*.md notes/labs/README.md notes/gpu/README.md <<'PY'
import os, re, sys
blocks = sys.argv[1]
for path in sys.argv[2:]:
    text = open(path).read()
    def fill(match):
        name = match.group(1)
        body = open(os.path.join(blocks, name)).read().rstrip("\n")
        return f"<!-- begin generated: {name} -->\n{body}\n<!-- end generated: {name} -->"
    new = re.sub(r"<!-- begin generated: (\S+) -->.*?<!-- end generated: \1 -->", fill, text, flags=re.S)
    if new != text:
        open(path, "w").write(new)
        print(f"updated {path}")
PY
