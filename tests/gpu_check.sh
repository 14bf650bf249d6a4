#!/usr/bin/env bash
# tests/gpu_check.sh — the GPU check, for a machine with one NVIDIA GPU; runs
# unattended in under 5 minutes and ends with a summary.
#
#   tests/gpu_check.sh prepare   on a Debian machine with apt (this repo's dev
#                                machine): downloads the .deb files the GPU
#                                machine lacks into .gpu-debs/ (git-ignored,
#                                ~30 MB) so they can travel with the tree
#   tests/gpu_check.sh           on the GPU machine
#
# What it does on the GPU machine:
#   1. dependencies: the system's MPI, doctest and OpenBLAS if present, else the
#      carried .debs unpacked under /tmp/z2deps (not into /: dpkg -x runs no
#      scripts and would overwrite the image's files), with an mpicxx wrapper;
#   2. the nvcc build (make all), timed;
#   3. the doctest suite under mpirun -n 1, 2, 4: with one GPU, N = 1 runs over
#      NCCL as well as MPI, N = 2 and 4 run over MPI sharing the GPU (NCCL
#      refuses two ranks on one GPU); every suite includes the bitwise stage
#      matrix on the CUDA backend;
#      the suite goes on with the quick checks of tests/cli/'s files (make
#      test's: one per claim, the BERT-mini stage matrix through the command
#      line on the GPU among them; the PyTorch comparisons are skipped: the GPU
#      image has no python3-torch);
#   4. the stage demo on the GPU at N = 1 (NCCL) and N = 2, 4 (MPI): bitwise
#      equal stages, and median step times with overlap on and off;
#   5. BERT-mini on the GPU: 30 steps at N = 1 (NCCL) and N = 2 (MPI), stage 2,
#      tokens/s and ms per step;
#   6. ZeRO-R on the GPU: BERT-mini at N = 1 (NCCL), stage 2, with
#      --activations keep, recompute and offload: median step times and the
#      ratios (offload close to recompute means the copy stream hid the
#      copies), the same final hash in all three and in offload with the naive
#      allocator, and the arena's promise: zero2 makes one cudaMalloc (the
#      block; cuBLAS's and NCCL's own are not counted) and no allocation after
#      step 1;
#   7. mixed precision on the GPU (cuBLAS GemmEx, 16-bit NCCL): BERT-mini at
#      N = 1 (NCCL), stage 2, in fp32, bf16 and fp16: median step times and
#      the ratios to fp32; bf16 at stage 0 must give stage 2's hash; the
#      16-bit conversions against __float2bfloat16_rn / __float2half_rn over
#      all 2^32 floats (the suite's test_conversions_gpu.cu, quoted here),
#      and zero2's exp / log / erf in a kernel against the CPU's bits (every
#      13th float, a NaN only needing to be a NaN; the same file, quoted too);
#      the bf16 / fp16 stage matrices themselves run in step 3's suite;
#   8. checkpoints on the GPU, in bf16 and fp16: 20 steps at N = 1 (NCCL)
#      stage 2, A = 2, straight through; the same saved every 10 steps at N = 2 (MPI)
#      stage 2; step_10 loaded at N = 1 (NCCL) stage 1 (A = 2 taken from the
#      checkpoint's N x A) and continued to step 20: all three final hashes
#      equal; the save and load times;
#   9. a public DeepSpeed config on the GPU (tests/ds_configs/hand_written.json:
#      bf16, activation checkpoints to the host, WarmupLR, wall_clock_breakdown):
#      it runs, and its forward / backward / step milliseconds;
#  10. capacity on the GPU: the plan (--plan) against the measured ledger of
#      BERT-mini at N = 1 (NCCL) in fp32 and bf16, to the byte; the arena in
#      the plan's block trains; --alloc caching and --alloc cuda (cudaMalloc per
#      tensor) give the arena's hash, and their peak reserved beside the
#      arena's; make superlinear's table on the GPU (demos/superlinear.sh with
#      --device cuda, 4 GiB per rank), tokens/s at the largest micro-batch;
#  11. portable bits on the GPU (--portable: zero2's tiled CUDA gemm, notes/11):
#      every row of tests/golden_bits.txt on the GPU (N = 2 over MPI sharing
#      it) must give the table's hash, which the CPU computes; the N = 1 rows
#      (fp32, bf16) over NCCL too; the kernel against the CPU schedule element by element
#      (the suite's test_conversions_gpu.cu, quoted); BERT-mini's portable
#      step time beside cuBLAS's;
#  12. reliability on the GPU: the memory check against the device's free
#      memory (cudaMemGetInfo): a model far larger than the GPU is refused
#      in about a second with the message naming that source, nothing
#      allocated; with ZERO2_MEMORY_LIMIT one MiB under the plan's block the
#      run is refused, at twice the block it trains (on the GPU the block is
#      at most 90% of the limit: the CUDA context and the libraries' buffers
#      live outside it); an output naming a device node
#      is refused and the node stays a device (the same source as the CPU
#      build's, checked once on the GPU build);
#  13. traces on the GPU (notes/12): the GPU run's trace checked against the
#      CPU run's by tests/check_trace.py (cuBLAS and the CUDA kernels sum in
#      other orders than OpenBLAS and the CPU loops, as another implementation
#      does: the checker's tolerances must hold across them), the GPU run
#      started from the CPU trace's initial weights (--init-hf) bit for bit,
#      and the GPU's traces at (N, A) = (1, 2) and (2, 1) the same files;
#  14. ZeRO-Offload on the GPU (--offload-optimizer cpu, notes/13): BERT-mini
#      at N = 1 (NCCL) stage 2 in fp32 and bf16, and N = 2 (MPI) stage 1 in
#      bf16, 30 steps with and without offload: the same final hash; the
#      median step time of each and their ratio (what the host's AdamW and
#      the copies add; how much of the copy down hides behind backward is not
#      measured apart); N = 1 takes no collective and one GPU cannot hold two
#      NCCL ranks, so NCCL with offload at N > 1 is not run here; the ledger's device
#      model states (2 Psi in bf16) and host ones (16 Psi/N) equal to their
#      formulas, from --json;
#  15. a summary.
set -u
cd "$(dirname "$0")/.."
debs_dir=.gpu-debs
packages="mpich libmpich12 libmpich-dev libhwloc15 libucx0 libnuma1 libibverbs1 librdmacm1 libnl-3-200
          libnl-route-3-200 libopenblas0-pthread libopenblas-pthread-dev libopenblas-dev doctest-dev
          libgfortran5 libquadmath0 nlohmann-json3-dev libslurm38 libudev1 libssl-dev libssl3 python3-numpy
          libblas3 liblapack3"

if [ "${1:-}" = prepare ]; then
  mkdir -p "$debs_dir"
  grep -qx "/$debs_dir/" .git/info/exclude 2>/dev/null || echo "/$debs_dir/" >>.git/info/exclude
  (cd "$debs_dir" && apt-get download $packages) || { echo "apt-get download failed"; exit 1; }
  du -sh "$debs_dir"
  exit 0
fi

started=$(date +%s)
summary=()
note() { summary+=("$1"); echo "=== $1"; }
elapsed() { echo $(($(date +%s) - $1)); }

nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"

# --- 1. dependencies --------------------------------------------------------------
# Z2_CARRIED_DEBS=1 uses the .debs even where the system has the packages
# (how this path is tested on the dev machine).
# The system's MPI counts only if it is MPICH: an image may ship Open MPI,
# whose mpirun refuses to run as root and which this project is not tested on.
if [ -z "${Z2_CARRIED_DEBS:-}" ] && command -v mpicxx >/dev/null && command -v mpichversion >/dev/null &&
   [ -f /usr/include/doctest/doctest.h ] &&
   [ -f /usr/include/nlohmann/json.hpp ] && [ -f /usr/include/openssl/evp.h ] &&
   { [ -f /usr/include/x86_64-linux-gnu/cblas.h ] || [ -f /usr/include/cblas.h ]; }; then
  note "dependencies: from the system"
elif [ -d "$debs_dir" ]; then
  prefix=/tmp/z2deps
  mkdir -p "$prefix/bin"
  for deb in "$debs_dir"/*.deb; do dpkg -x "$deb" "$prefix"; done
  lib=$prefix/usr/lib/x86_64-linux-gnu
  # nvcc -ccbin wants one executable: a wrapper that adds the include and
  # library directories (link flags are ignored when only compiling).
  cat >"$prefix/bin/mpicxx" <<EOF
#!/bin/sh
exec g++ -I$prefix/usr/include/x86_64-linux-gnu/mpich -I$prefix/usr/include \\
  -I$prefix/usr/include/x86_64-linux-gnu/openblas-pthread "\$@" \\
  -L$lib -L$lib/openblas-pthread -L$prefix/lib/x86_64-linux-gnu -lmpichcxx -lmpich
EOF
  # Hydra finds hydra_pmi_proxy next to the mpiexec it was started as.
  printf '#!/bin/sh\nexec %s "$@"\n' "$prefix/usr/bin/mpiexec.hydra" >"$prefix/bin/mpirun"
  chmod +x "$prefix/bin/mpicxx" "$prefix/bin/mpirun"
  export PATH="$prefix/bin:$PATH"
  export LD_LIBRARY_PATH="$lib:$lib/openblas-pthread:$prefix/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  note "dependencies: carried .debs unpacked under $prefix"
else
  note "dependencies: MISSING (no system MPI/doctest/OpenBLAS and no $debs_dir: run 'tests/gpu_check.sh prepare' first)"
  printf '%s\n' "${summary[@]}"
  exit 1
fi
# tests/check_trace.py and the trace tests read traces with numpy: the carried python3-numpy where the
# image's python has none (the same Python minor version as Debian 12's, 3.11, is assumed).
python3 -c 'import numpy' 2>/dev/null || [ ! -d /tmp/z2deps/usr/lib/python3/dist-packages ] ||
  export PYTHONPATH=/tmp/z2deps/usr/lib/python3/dist-packages${PYTHONPATH:+:$PYTHONPATH}
export OPENBLAS_NUM_THREADS=1
export Z2_NO_TORCH=1  # no python3-torch on the GPU image: tests/cli skips those checks, saying so

# --- 2. build ---------------------------------------------------------------------
t=$(date +%s)
# Only the GPU at hand: sm_90 code for Hopper keeps the build short. From
# scratch: objects left by an earlier call may come from another MPI.
rm -rf build
if make -j"$(nproc)" all CUDA_ARCH="-arch=sm_90" >/tmp/z2build.log 2>&1; then
  note "build: nvcc, $(elapsed "$t") s"
  grep -E "^  (nvcc|NCCL|MPI):" /tmp/z2build.log
else
  tail -n 40 /tmp/z2build.log
  note "build: FAILED (log above)"
  printf '%s\n' "${summary[@]}"
  exit 1
fi

# --- 3. the doctest suite (CUDA backends included) --------------------------------------
t=$(date +%s)
Z2_QUICK=1 tests/run_tests.sh build 2>&1 | tee /tmp/z2tests.log  # make test's quick checks
grep -E "^\[test\] (world size|CUDA)" /tmp/z2tests.log | sort -u
note "tests (mpirun -n 1, 2, 4; cpu + cuda backends): $(tail -n 1 /tmp/z2tests.log), $(elapsed "$t") s"

# --- 4. the stage demo on the GPU, with timings ------------------------------------------
# An MLP of 8.4 M parameters (1024 wide, 8 layers), 64 samples per micro-batch.
failures=0
# A suite that died before its summary line counts as failed too.
grep -qE '^[0-9]+ passed, 0 failed$' <(tail -n 1 /tmp/z2tests.log) || failures=1
for run in "1 nccl 1" "1 nccl 0" "2 mpi 1" "2 mpi 0" "4 mpi 1"; do
  set -- $run
  out=$(timeout 120 mpirun -n "$1" build/demo_stages --device cuda --comm "$2" --overlap "$3" \
          --hidden 1024 --layers 8 --micro-batch 64 --bucket 1000000 --steps 12 2>&1)
  if echo "$out" | grep -q "identical final parameters"; then
    note "demo N=$1 $2 overlap=$3: stages bitwise equal; $(echo "$out" | grep '^median step' | sed 's/median step: //')"
  else
    echo "$out" | tail -n 8
    note "demo N=$1 $2 overlap=$3: FAILED ($(echo "$out" | grep -v '^$' | tail -n 1 | cut -c1-160))"
    failures=$((failures + 1))
  fi
done

# --- 5. BERT-mini on the GPU, timed ----------------------------------------------------
for run in "1 nccl" "2 mpi"; do
  set -- $run
  out=$(timeout 120 mpirun -n "$1" build/train_bert_mini --device cuda --comm "$2" --stage 2 --steps 30 --log-every 10 \
          --json /tmp/z2_bert_gpu.json 2>&1)
  if [ $? -eq 0 ] && [ -f /tmp/z2_bert_gpu.json ]; then
    echo "$out" | grep -E "^step|loss  "
    note "BERT-mini N=$1 $2 stage 2: $(python3 -c "import json; d=json.load(open('/tmp/z2_bert_gpu.json')); print('%s, %.1f ms/step median, %.0f tokens/s, loss %.3f -> %.3f' % (d['device'], d['time']['step_ms_median'], d['time']['tokens_per_s_median'], d['steps'][0]['loss'], d['steps'][-1]['loss']))")"
  else
    echo "$out" | tail -n 8
    note "BERT-mini N=$1 $2: FAILED"
    failures=$((failures + 1))
  fi
  rm -f /tmp/z2_bert_gpu.json
done

# --- 6. ZeRO-R on the GPU ------------------------------------------------------------
declare -A step_ms hash
for activations in keep recompute offload; do
  if timeout 120 build/train_bert_mini --device cuda --comm nccl --stage 2 --steps 30 --quiet \
       --activations "$activations" --json "/tmp/z2_zr_$activations.json" >/tmp/z2_zr.log 2>&1; then
    step_ms[$activations]=$(python3 -c "import json; print('%.2f' % json.load(open('/tmp/z2_zr_$activations.json'))['time']['step_ms_median'])")
    hash[$activations]=$(python3 -c "import json; print(json.load(open('/tmp/z2_zr_$activations.json'))['final_params_hash'])")
    arena=$(python3 -c "import json; m=json.load(open('/tmp/z2_zr_$activations.json'))['memory']; print('%d cudaMalloc, %d allocations after step 1, activation peak %.1f MiB' % (m['device_mallocs'], m['device_allocations_after_step1'], m['activation_peak_bytes'] / 1048576))")
    note "ZeRO-R --activations $activations (arena): ${step_ms[$activations]} ms/step median; $arena"
    case "$arena" in "1 cudaMalloc, 0 allocations"*) ;; *) note "ZeRO-R arena: FAILED (allocations after start-up)"; failures=$((failures + 1));; esac
  else
    tail -n 8 /tmp/z2_zr.log
    note "ZeRO-R --activations $activations: FAILED"
    failures=$((failures + 1))
  fi
done
# Offload with the naive allocator: the free list and the copy stream together.
if timeout 120 build/train_bert_mini --device cuda --comm nccl --stage 2 --steps 30 --quiet --activations offload \
     --alloc naive --json /tmp/z2_zr_naive.json >/tmp/z2_zr.log 2>&1; then
  hash[naive]=$(python3 -c "import json; print(json.load(open('/tmp/z2_zr_naive.json'))['final_params_hash'])")
  note "ZeRO-R --activations offload --alloc naive: $(python3 -c "import json; d=json.load(open('/tmp/z2_zr_naive.json')); m=d['memory']; print('%.2f ms/step median, %d allocations per step, fragmentation %.4f' % (d['time']['step_ms_median'], m['device_allocations_per_step'], m['fragmentation']))")"
else
  tail -n 8 /tmp/z2_zr.log
  note "ZeRO-R --activations offload --alloc naive: FAILED"
  failures=$((failures + 1))
fi
if [ -n "${hash[keep]:-}" ] && [ "${hash[keep]}" = "${hash[recompute]:-}" ] && [ "${hash[keep]}" = "${hash[offload]:-}" ] &&
   [ "${hash[keep]}" = "${hash[naive]:-}" ]; then
  note "ZeRO-R on the GPU: keep, recompute, offload (arena and naive) give the same final hash ${hash[keep]}; $(python3 -c "
k, r, o = ${step_ms[keep]}, ${step_ms[recompute]}, ${step_ms[offload]}
print('recompute/keep %.3f, offload/keep %.3f, offload/recompute %.3f (1.0: the copies are hidden)' % (r / k, o / k, o / r))")"
else
  note "ZeRO-R on the GPU: FAILED (hashes ${hash[keep]:-none} ${hash[recompute]:-none} ${hash[offload]:-none} ${hash[naive]:-none})"
  failures=$((failures + 1))
fi

# --- 7. mixed precision on the GPU --------------------------------------------------
conversions=$(grep -m 1 "all 2^32 floats on the GPU" /tmp/z2tests.log | sed 's/.*MESSAGE: //')
if [ -n "$conversions" ]; then note "16-bit conversions vs CUDA intrinsics: $conversions"
else note "16-bit conversions vs CUDA intrinsics: NOT RUN (no MESSAGE in the suite's log)"; failures=$((failures + 1)); fi
math_bits=$(grep -m 1 "exp / log / erf on the GPU vs the CPU" /tmp/z2tests.log | sed 's/.*MESSAGE: //')
if [ -n "$math_bits" ]; then note "own exp / log / erf, GPU vs CPU: $math_bits"
else note "own exp / log / erf, GPU vs CPU: NOT RUN (no MESSAGE in the suite's log)"; failures=$((failures + 1)); fi
declare -A mixed_ms mixed_hash
for run in "fp32 2" "bf16 2" "fp16 2" "bf16 0"; do
  set -- $run
  if timeout 120 build/train_bert_mini --device cuda --comm nccl --stage "$2" --steps 30 --quiet --precision "$1" \
       --json "/tmp/z2_mixed_$1_$2.json" >/tmp/z2_mixed.log 2>&1; then
    mixed_ms[$1_$2]=$(python3 -c "import json; print('%.2f' % json.load(open('/tmp/z2_mixed_$1_$2.json'))['time']['step_ms_median'])")
    mixed_hash[$1_$2]=$(python3 -c "import json; print(json.load(open('/tmp/z2_mixed_$1_$2.json'))['final_params_hash'])")
    note "BERT-mini N=1 nccl stage $2 --precision $1: $(python3 -c "import json; d=json.load(open('/tmp/z2_mixed_$1_$2.json')); m=d['memory']; print('%.2f ms/step median, %.0f tokens/s, loss %.3f -> %.3f, model states %d bytes (formula %d), %d skipped' % (d['time']['step_ms_median'], d['time']['tokens_per_s_median'], d['steps'][0]['loss'], d['steps'][-1]['loss'], m['model_states_bytes'], m['model_states_formula_bytes'], d['skipped_steps']))")"
  else
    tail -n 8 /tmp/z2_mixed.log
    note "BERT-mini --precision $1 stage $2 on the GPU: FAILED"
    failures=$((failures + 1))
  fi
done
if [ -n "${mixed_hash[bf16_2]:-}" ] && [ "${mixed_hash[bf16_2]}" = "${mixed_hash[bf16_0]:-}" ] && [ -n "${mixed_ms[fp32_2]:-}" ]; then
  note "mixed precision on the GPU: bf16 stages 0 and 2 give the same hash ${mixed_hash[bf16_2]}; $(python3 -c "
f, b, h = ${mixed_ms[fp32_2]}, ${mixed_ms[bf16_2]}, ${mixed_ms[fp16_2]:-0}
print('step time fp32/bf16 %.2f, fp32/fp16 %.2f' % (f / b, f / h if h else 0))")"
else
  note "mixed precision on the GPU: FAILED (bf16 hashes ${mixed_hash[bf16_2]:-none} ${mixed_hash[bf16_0]:-none})"
  failures=$((failures + 1))
fi

# --- 8. checkpoints on the GPU: resume and reshard ---------------------------------------
for precision in bf16 fp16; do
  ck=/tmp/z2_ck_$precision
  rm -rf "$ck"
  common=(--device cuda --precision "$precision" --steps 20 --quiet)
  timeout 120 build/train_bert_mini "${common[@]}" --comm nccl --stage 2 --accum 2 --json /tmp/z2_ck_straight.json >/tmp/z2_ck.log 2>&1 &&
  timeout 120 mpirun -n 2 build/train_bert_mini "${common[@]}" --comm mpi --stage 2 --save "$ck" --save-every 10 \
    --json /tmp/z2_ck_saved.json >>/tmp/z2_ck.log 2>&1 &&
  timeout 120 build/train_bert_mini --device cuda --comm nccl --stage 1 --quiet --load "$ck/step_10" \
    --json /tmp/z2_ck_resumed.json >>/tmp/z2_ck.log 2>&1
  if [ $? -eq 0 ]; then
    verdict=$(python3 -c "
import json
straight, saved, resumed = (json.load(open('/tmp/z2_ck_%s.json' % name)) for name in ('straight', 'saved', 'resumed'))
hashes = {straight['final_params_hash'], saved['final_params_hash'], resumed['final_params_hash']}
first_save, loaded = saved['checkpoint']['saved'][0], resumed['checkpoint']['loaded']
print('%s %s; save %d bytes in %.3f s, load (N=2 stage 2 -> N=1 stage 1, A=%d) in %.3f s' % (
    'ok' if len(hashes) == 1 else 'DIFFERENT', ' '.join(sorted(hashes)), first_save['bytes'], first_save['seconds'],
    resumed['accum'], loaded['seconds']))")
    case "$verdict" in
      ok*) note "checkpoint $precision on the GPU: straight N=1, saved N=2, resumed N=1 stage 1 give one hash ${verdict#ok }" ;;
      *) note "checkpoint $precision on the GPU: FAILED ($verdict)"; failures=$((failures + 1)) ;;
    esac
  else
    tail -n 8 /tmp/z2_ck.log
    note "checkpoint $precision on the GPU: FAILED (a run failed; log above)"
    failures=$((failures + 1))
  fi
done

# --- 9. a DeepSpeed config on the GPU, with DeepSpeed's wall-clock breakdown --------------
if timeout 120 build/train_bert_mini --device cuda --comm nccl --config tests/ds_configs/hand_written.json --steps 20 \
     --log-every 10 --json /tmp/z2_ds.json >/tmp/z2_ds.log 2>&1; then
  note "DeepSpeed config hand_written.json on the GPU: $(python3 -c "
import json; d = json.load(open('/tmp/z2_ds.json')); s = d['steps'][-1]
print('%s, --activations %s, %.2f ms/step median; last step forward %.2f, backward %.2f, optimizer step %.2f ms' % (
    d['precision'], d['activations'], d['time']['step_ms_median'], s['forward_ms'], s['backward_ms'], s['optimizer_ms']))")"
else
  tail -n 8 /tmp/z2_ds.log
  note "DeepSpeed config hand_written.json on the GPU: FAILED"
  failures=$((failures + 1))
fi

# --- 10. capacity on the GPU: the plan, caching and cudaMalloc, super-linear --------------
for precision in fp32 bf16; do
  cap=(--device cuda --comm nccl --precision $precision --steps 2)
  if build/train_bert_mini "${cap[@]}" --plan --plan-world-sizes 1 --quiet --json /tmp/z2_plan.json >/tmp/z2_plan.log 2>&1 &&
     timeout 120 build/train_bert_mini "${cap[@]}" --quiet --json /tmp/z2_cap_arena.json >>/tmp/z2_plan.log 2>&1 &&
     timeout 120 build/train_bert_mini "${cap[@]}" --alloc caching --quiet --json /tmp/z2_cap_caching.json >>/tmp/z2_plan.log 2>&1 &&
     timeout 120 build/train_bert_mini "${cap[@]}" --alloc cuda --quiet --json /tmp/z2_cap_cuda.json >>/tmp/z2_plan.log 2>&1; then
    verdict=$(python3 -c "
import json
plan = [r for r in json.load(open('/tmp/z2_plan.json'))['plan'] if r['stage'] == 2][0]
runs = {a: json.load(open('/tmp/z2_cap_%s.json' % a)) for a in ('arena', 'caching', 'cuda')}
m = runs['arena']['memory']
keys = ['params_bytes', 'grads_bytes', 'master_bytes', 'optimizer_bytes', 'staging_bytes', 'activation_peak_bytes',
        'bookkeeping_bytes', 'device_peak_bytes']
bad = [k for k in keys if plan[k] != m[k]] + (['reserved'] if plan['arena_block_bytes'] != m['reserved_bytes'] else [])
hashes = {a: r['final_params_hash'] for a, r in runs.items()}
if len(set(hashes.values())) != 1: bad.append('hashes %s' % hashes)
print(('ok' if not bad else 'DIFFERS ' + ' '.join(bad)) + '; peak reserved arena %.1f MiB, caching %.1f, cuda %.1f' % tuple(
    runs[a]['memory']['reserved_bytes'] / 1048576 for a in ('arena', 'caching', 'cuda')))")
    case "$verdict" in
      ok*) note "capacity $precision on the GPU: the plan = the ledger to the byte, arena = caching = cuda hash${verdict#ok}" ;;
      *) note "capacity $precision on the GPU: FAILED ($verdict)"; failures=$((failures + 1)) ;;
    esac
  else
    tail -n 8 /tmp/z2_plan.log
    note "capacity $precision on the GPU: FAILED (a run failed; log above)"
    failures=$((failures + 1))
  fi
done
if Z2_DEVICE=cuda timeout 240 demos/superlinear.sh build 4294967296 >/tmp/z2_superlinear.log 2>&1; then
  cat /tmp/z2_superlinear.log
  note "superlinear on the GPU: $(grep -E '^\| 2 \| 4 ' /tmp/z2_superlinear.log | tr -s ' ')"
else
  tail -n 8 /tmp/z2_superlinear.log
  note "superlinear on the GPU: FAILED"
  failures=$((failures + 1))
fi

# --- 11. portable bits on the GPU ------------------------------------------------------
Z2_VERIFY_FLAGS="--device cuda --comm mpi" timeout 240 tests/verify.sh build --all >/tmp/z2_verify.log 2>&1
status=$?
if [ $status -eq 0 ]; then
  note "portable on the GPU: $(tail -n 1 /tmp/z2_verify.log) (the CPU's table, on the GPU, N = 2 over MPI)"
else
  cat /tmp/z2_verify.log
  if [ $status -eq 124 ]; then note "portable on the GPU: FAILED (timed out after 240 s; the rows done are above)"
  else note "portable on the GPU: FAILED ($(grep -c '^DIFFERS\|^FAILED' /tmp/z2_verify.log) row(s) differ from the CPU's table)"; fi
  failures=$((failures + 1))
fi
# Over NCCL only the N = 1 rows can run (NCCL refuses two ranks on one GPU).
{ grep '^#' tests/golden_bits.txt; grep -v '^#' tests/golden_bits.txt | awk -F'|' '$3 + 0 == 1'; } >/tmp/z2_golden_n1.txt
if Z2_GOLDEN=/tmp/z2_golden_n1.txt Z2_VERIFY_FLAGS="--device cuda --comm nccl" timeout 120 tests/verify.sh build \
     >/tmp/z2_verify_nccl.log 2>&1; then
  note "portable on the GPU over NCCL: $(tail -n 1 /tmp/z2_verify_nccl.log) (the N = 1 rows)"
else
  cat /tmp/z2_verify_nccl.log
  note "portable on the GPU over NCCL: FAILED"
  failures=$((failures + 1))
fi
portable_kernel=$(grep -m 1 "the portable gemm kernel on the GPU" /tmp/z2tests.log | sed 's/.*MESSAGE: //')
note "portable gemm kernel vs the CPU schedule: ${portable_kernel:-not in the suite log}"
portable_ms=()
for mode in default portable; do
  extra=$([ $mode = portable ] && echo --portable)
  if timeout 120 build/train_bert_mini --device cuda --comm nccl --stage 2 --steps 30 --quiet $extra \
       --json /tmp/z2_portable_$mode.json >/tmp/z2_portable.log 2>&1; then
    portable_ms+=("$(python3 -c "import json; print('%.2f' % json.load(open('/tmp/z2_portable_$mode.json'))['time']['step_ms_median'])")")
  else
    tail -n 8 /tmp/z2_portable.log; portable_ms+=(failed); failures=$((failures + 1))
  fi
done
note "portable step on the GPU (BERT-mini N=1 stage 2 fp32, median): cuBLAS ${portable_ms[0]} ms, zero2's kernel ${portable_ms[1]} ms"

# --- 12. reliability on the GPU: the memory check, an output that is a device -------------
mem=(--device cuda --comm nccl --stage 2 --steps 1 --quiet)
build/train_bert_mini "${mem[@]}" --plan --plan-world-sizes 1 --json /tmp/z2_mem_plan.json >/tmp/z2_mem.log 2>&1
block=$(python3 -c "import json; print([r for r in json.load(open('/tmp/z2_mem_plan.json'))['plan'] if r['stage'] == 2][0]['arena_block_bytes'])" 2>/dev/null)
start_ms=$(date +%s%N)
timeout 60 build/train_bert_mini "${mem[@]}" --layers 64 --hidden 8192 --heads 64 --intermediate 32768 --seq 32 \
  --micro-batch 1 >/tmp/z2_mem_huge.log 2>&1
huge_status=$? huge_ms=$((($(date +%s%N) - start_ms) / 1000000))
ZERO2_MEMORY_LIMIT=$((${block:-0} - 1048576)) timeout 60 build/train_bert_mini "${mem[@]}" >/tmp/z2_mem_under.log 2>&1
under_status=$?
ZERO2_MEMORY_LIMIT=$((2 * ${block:-0})) timeout 60 build/train_bert_mini "${mem[@]}" >/tmp/z2_mem_at.log 2>&1
at_status=$?
mkdir -p /tmp/z2_nodes && rm -f /tmp/z2_nodes/null && mknod /tmp/z2_nodes/null c 1 3
timeout 60 build/train_bert_mini "${mem[@]}" --json /tmp/z2_nodes/null >/tmp/z2_node.log 2>&1
node_status=$?
if [ -n "$block" ] && [ $huge_status -eq 2 ] && grep -q "the GPU's free memory" /tmp/z2_mem_huge.log && [ $under_status -eq 2 ] &&
   grep -q ZERO2_MEMORY_LIMIT /tmp/z2_mem_under.log && [ $at_status -eq 0 ] && [ $node_status -eq 2 ] && [ -c /tmp/z2_nodes/null ]; then
  note "reliability on the GPU: a 51.5B-parameter model refused in $huge_ms ms against the GPU's free memory; 1 MiB under the plan's block ($block bytes) refused, twice it trains; --json naming a device node refused, the node kept"
else
  tail -n 3 /tmp/z2_mem.log /tmp/z2_mem_huge.log /tmp/z2_mem_under.log /tmp/z2_mem_at.log /tmp/z2_node.log
  note "reliability on the GPU: FAILED (huge $huge_status, under the block $under_status, at the block $at_status, device node $node_status)"
  failures=$((failures + 1))
fi

# --- 13. traces on the GPU (notes/12) ---------------------------------------------------------
if python3 -c 'import numpy' 2>/dev/null; then
  rm -rf /tmp/z2_trace_*
  tests/peers/reference_trace.sh build/train_bert_mini /tmp/z2_trace_cpu 1 --device cpu --accum 2 --micro-batch 2 \
    >/tmp/z2_trace.log 2>&1
  tests/peers/reference_trace.sh build/train_bert_mini /tmp/z2_trace_gpu 1 --device cuda --comm nccl --accum 2 \
    --micro-batch 2 --init-hf /tmp/z2_trace_cpu/initial >>/tmp/z2_trace.log 2>&1
  tests/peers/reference_trace.sh build/train_bert_mini /tmp/z2_trace_gpu2 2 --device cuda --comm mpi --micro-batch 2 \
    >>/tmp/z2_trace.log 2>&1
  python3 tests/check_trace.py /tmp/z2_trace_cpu /tmp/z2_trace_gpu >/tmp/z2_trace_check.log 2>&1
  check_status=$?
  split_same=yes
  for file in $(cd /tmp/z2_trace_gpu && find . -type f ! -name trace.json); do
    cmp -s "/tmp/z2_trace_gpu/$file" "/tmp/z2_trace_gpu2/$file" || split_same=no
  done
  if [ $check_status -eq 0 ] && cmp -s /tmp/z2_trace_cpu/initial/model.safetensors /tmp/z2_trace_gpu/initial/model.safetensors &&
     [ $split_same = yes ]; then
    note "traces on the GPU: the GPU run (from the CPU trace's weights, --init-hf) against the CPU run: $(grep '^PASS' /tmp/z2_trace_check.log | cut -c7-); (N, A) = (1, 2) and (2, 1) the same files"
  else
    tail -n 5 /tmp/z2_trace.log /tmp/z2_trace_check.log
    note "traces on the GPU: FAILED (checker exit $check_status, splits the same: $split_same)"
    failures=$((failures + 1))
  fi
  rm -rf /tmp/z2_trace_cpu /tmp/z2_trace_gpu /tmp/z2_trace_gpu2 /tmp/z2_trace.log /tmp/z2_trace_check.log
else
  note "traces on the GPU: SKIP (no numpy for tests/check_trace.py, not even the carried python3-numpy)"
fi

# --- 14. ZeRO-Offload on the GPU (notes/13) ------------------------------------------------
offload_run() {  # $1 label, then train_bert_mini's flags; prints "hash ms device host device_formula host_formula"
  local label=$1
  shift
  if timeout 120 "$@" --steps 30 --quiet --json "/tmp/z2_off_$label.json" >/tmp/z2_off.log 2>&1; then
    python3 -c "
import json; d = json.load(open('/tmp/z2_off_$label.json')); m = d['memory']
print(d['final_params_hash'], '%.2f' % d['time']['step_ms_median'], m['model_states_bytes'], m.get('host_model_states_bytes', 0), m['model_states_formula_bytes'], m.get('host_model_states_formula_bytes', 0))"
  else
    tail -n 5 /tmp/z2_off.log >&2
    echo "FAILED"
  fi
}
for config in "1 nccl 2 fp32" "1 nccl 2 bf16" "2 mpi 1 bf16"; do
  read -r ranks comm stage precision <<<"$config"
  flags=(build/train_bert_mini --device cuda --comm "$comm" --stage "$stage" --precision "$precision")
  launch=()
  [ "$ranks" -gt 1 ] && launch=(mpirun -n "$ranks")
  read -r plain_hash plain_ms _ <<<"$(offload_run plain "${launch[@]}" "${flags[@]}")"
  read -r off_hash off_ms device host device_formula host_formula <<<"$(offload_run off "${launch[@]}" "${flags[@]}" --offload-optimizer cpu)"
  if [ "$plain_hash" != FAILED ] && [ "${off_hash:-}" = "$plain_hash" ] && [ "${device:-x}" = "${device_formula:-y}" ] &&
     [ "${host:-x}" = "${host_formula:-y}" ] && [ "${host:-0}" != 0 ]; then
    note "ZeRO-Offload N=$ranks ($comm) stage $stage $precision: the hash without offload ($plain_hash); $off_ms ms/step median against $plain_ms (offload / none = $(python3 -c "print('%.2f' % ($off_ms / $plain_ms))")); device model states $device = formula, host $host = 16 Psi/N"
  else
    note "ZeRO-Offload N=$ranks ($comm) stage $stage $precision: FAILED (hash $plain_hash vs ${off_hash:-none}; device ${device:-?} vs ${device_formula:-?}; host ${host:-?} vs ${host_formula:-?})"
    failures=$((failures + 1))
  fi
done
rm -f /tmp/z2_off_plain.json /tmp/z2_off_off.json /tmp/z2_off.log

echo
echo "=== summary ($(elapsed "$started") s)"
printf '%s\n' "${summary[@]}"
if [ "$failures" -eq 0 ]; then echo "gpu check: OK"; else echo "gpu check: FAILED"; fi
[ "$failures" -eq 0 ]
